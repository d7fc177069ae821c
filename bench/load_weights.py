"""Pretrained weights loaded by code that builds its own Orbax checkpointer.

    .venv/bin/python bench/load_weights.py --out FILE.md     # ~2 min on 2 cores

Gemma's loader (`gm.ckpts.load_params`, behind `gm.ckpts.LoadCheckpoint`)
restores a stock Orbax checkpoint with an `ocp.StandardCheckpointer()` of its
own, MaxText's (`load_params_from_path`) with an `ocp.PyTreeCheckpointer()`.
For each state (`tests/states.py`: shapes no cost was fitted on) this saves a
stock checkpoint, then loads it in fresh processes: through
`ocp.StandardCheckpointer().restore`, Gemma's `load_params` and
`ocp.PyTreeCheckpointer().restore` with restore args, each once with Orbax's
reader and once inside `kd_ckpt.within_budget(BUDGET)`.
Each row: seconds, the peak RSS beyond the restored arrays (each device
buffer counted once: Orbax places a replicated leaf's copies apart, kd_ckpt
on the CPU backend shares one host buffer), and the arrays.  Every load is
checked bit-exact against the saved values (by the worker).

  --states mesh2d_prime,many_medium,prime_rep --mib 192 --budget 64MiB
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
MiB = 1 << 20
# (label, tests/states.py restore VIA)
LOADERS = (
    ('StandardCheckpointer, Orbax', 'orbax'),
    ('StandardCheckpointer, kd_ckpt.within_budget', 'standard'),
    ('gm.ckpts.load_params, Orbax', 'gemma_stock'),
    ('gm.ckpts.load_params, kd_ckpt.within_budget', 'gemma'),
    ('PyTreeCheckpointer (MaxText), Orbax', 'pytree_stock'),
    ('PyTreeCheckpointer (MaxText), kd_ckpt.within_budget', 'pytree'),
)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--states', default='mesh2d_prime,many_medium,prime_rep')
  ap.add_argument('--mib', type=int, default=192, help='state size in MiB')
  ap.add_argument('--budget', default='64MiB')
  ap.add_argument('--loaders', default=','.join(v for _, v in LOADERS),
                  help='comma list of ' + ','.join(v for _, v in LOADERS))
  ap.add_argument('--out', default=None, help='also write the table here')
  args = ap.parse_args(argv)
  from tests import states  # pylint: disable=g-import-not-at-top
  wanted = args.loaders.split(',')
  lines = [
      f'<!-- .venv/bin/python bench/load_weights.py --states {args.states} --mib {args.mib}'
      f' --budget {args.budget} -->',
      f'Stock Orbax checkpoints of {args.mib} MiB, loaded in fresh processes (8 CPU devices);'
      f' kd_ckpt inside `within_budget({args.budget!r})`.',
      '',
      '| state | loader | seconds | x Orbax | peak beyond the arrays | arrays |',
      '| --- | --- | --- | --- | --- | --- |',
  ]
  with tempfile.TemporaryDirectory(dir=os.environ.get('KD_BENCH_DIR')) as root:
    for state in args.states.split(','):
      d = os.path.join(root, state)
      states.run_worker('stock', d, state, str(args.mib * MiB))
      orbax_secs = {}
      for label, via in LOADERS:
        if via not in wanted:
          continue
        got = states.run_worker('restore', d, state, str(args.mib * MiB), args.budget, via)
        base = {'standard': 'orbax', 'gemma': 'gemma_stock', 'pytree': 'pytree_stock'}.get(via, via)
        if via == base:
          orbax_secs[base] = got['seconds']
        ratio = (f'{got["seconds"] / orbax_secs[base]:.2f}x' if base in orbax_secs else '-')
        beyond = (got['peak_extra_bytes'] - got['restored_bytes']) / MiB
        lines.append(f'| {state} | {label} | {got["seconds"]:.2f} | {ratio} |'
                     f' {beyond:.1f} MiB | {got["restored_bytes"] / MiB:.0f} MiB |')
        print(lines[-1], flush=True)
  table = '\n'.join(lines) + '\n'
  print(table)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(table)
  return 0


if __name__ == '__main__':
  sys.exit(main())
