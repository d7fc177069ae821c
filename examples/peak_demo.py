"""What kd_ckpt is for, in one minute: the same state saved by stock Orbax and by kd_ckpt.

  python examples/peak_demo.py [--state-mib 512] [--budget 64MiB] [--out DIR]

Builds a state on 8 fake CPU devices (a replicated leaf, as a data-parallel
model's parameters are), saves it once with stock Orbax
(`ocp.StandardCheckpointer`, its defaults) and once with `kd_ckpt.save` at a
small host-RAM budget, each in a fresh process, and prints the two peaks of
extra host RAM side by side (VmHWM during the save minus RSS just before),
plus a bar chart.  `make demo` runs it first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _child(kind: str, directory: str, state_mib: int, budget: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  rows = state_mib * MiB // 4 // 1024
  state = {'params': jax.jit(lambda: jnp.ones((rows, 1024)) * 0.5, out_shardings=
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))()}
  jax.block_until_ready(state)
  if kind == 'orbax':
    with kd_ckpt.PeakRss() as peak:
      ckptr = ocp.StandardCheckpointer()
      ckptr.save(directory, state)
      ckptr.wait_until_finished()
    print(json.dumps({'peak_extra_bytes': peak.extra_bytes}))
  else:
    strategy = 'streaming' if kind == 'kd_streaming' else 'auto'
    report = kd_ckpt.save(directory, state, host_ram_budget=budget, strategy=strategy)
    print(json.dumps({'peak_extra_bytes': report.peak_extra_bytes,
                      'strategy': report.strategy, 'budget_bytes': report.budget_bytes}))


def _run(kind: str, directory: str, state_mib: int, budget: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO,
             XLA_FLAGS='--xla_force_host_platform_device_count=8')
  proc = subprocess.run(
      [sys.executable, __file__, '--child', kind, directory, str(state_mib), budget],
      capture_output=True, text=True, env=env, timeout=600)
  if proc.returncode:
    raise SystemExit(f'{kind} save failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
  if len(sys.argv) > 1 and sys.argv[1] == '--child':
    _child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    return 0
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--state-mib', type=int, default=512)
  p.add_argument('--budget', default='64MiB')
  p.add_argument('--out', default=None, help='where the plot goes (default: a temp dir)')
  args = p.parse_args()
  out = args.out or tempfile.mkdtemp(prefix='kd_ckpt_peak_demo_')
  os.makedirs(out, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix='kd_ckpt_peak_demo_ckpt_') as tmp:
    orbax = _run('orbax', os.path.join(tmp, 'orbax'), args.state_mib, args.budget)
    kd = _run('kd_ckpt', os.path.join(tmp, 'kd'), args.state_mib, args.budget)
    ks = _run('kd_streaming', os.path.join(tmp, 'ks'), args.state_mib, args.budget)
  o, k, s = (r['peak_extra_bytes'] / MiB for r in (orbax, kd, ks))
  b = kd['budget_bytes'] / MiB
  print(f'Saving a {args.state_mib} MiB state (replicated on 8 CPU devices), extra host RAM at peak:')
  rows = [
      ('stock Orbax (StandardCheckpointer)', o, f'{o / args.state_mib:.2f}x the state'),
      (f'kd_ckpt.save, {args.budget}, auto', k, f'{kd["strategy"]}: on CPU Orbax\'s own'
       ' save is chosen when its worst case fits'),
      (f'kd_ckpt.save, {args.budget}, streaming', s, f'{s / b:.2f}x the budget: what a GPU'
       ' host pays, copies included'),
  ]
  width = max(len(r[0]) for r in rows)
  for label, mib, note in rows:
    print(f'  {label:<{width}}  {mib:7.1f} MiB  ({note})')
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(['stock Orbax', 'kd_ckpt auto', 'kd_ckpt streaming'], [o, k, s],
           color=['#c44', '#4a4', '#48c'])
    ax.axhline(kd['budget_bytes'] / MiB, color='k', ls='--', lw=1, label='kd_ckpt budget')
    ax.set_ylabel('peak extra host RAM (MiB)')
    ax.set_title(f'Saving {args.state_mib} MiB')
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, 'peak_demo.png')
    fig.savefig(path, dpi=100)
    print(f'  plot: {path}')
  except ImportError:
    print('  (no matplotlib: no plot)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
