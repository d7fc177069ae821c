"""Restores onto custom device-local layouts (`support_layout=True`): a known gap.

    .venv/bin/python bench/relayout_restore.py        # ~1 min on 2 cores

A target whose shardings are `Format`s with a custom layout (here column-major)
is placed by a relayout per shard shape.  kd_ckpt does not bound that part:
neither the relayout programs nor the copies the relayout makes are charged.
For each case this saves LEAVES leaves of distinct shapes, sharded over the 8
CPU devices, then restores them in a fresh process (after a warm-up jit) with
`kd_ckpt.restore(support_layout=True)` onto the column-major layout and onto the
default one, at BUDGET.  Each row: the peak RSS beyond the restored arrays
and the budget it ran at (a refused restore is run again, in a fresh
process, at the budget its refusal names).

  --budget-mib 48
  --programs     instead: what one relayout program costs (the figures behind
                 `cost.RELAYOUT_PROGRAM_BYTES` and `RELAYOUT_COMPILE_BYTES`):
                 20 shard shapes put onto 8 devices each, host memory trimmed
                 between, for shards of 20 KiB, 1 MiB and 4 MiB
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

_WORKER = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np, kd_ckpt
from jax.experimental import layout
from jax.sharding import NamedSharding as NS, PartitionSpec as P, Mesh
from kd_ckpt import hostmem, startup
d, rows, n, budget, custom = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == '1'
m = Mesh(np.array(jax.devices()), ('x',))
shapes = [(8 * (rows + i), 257) for i in range(n)]
if not os.path.exists(d):
  kd_ckpt.save(d, {f'l{i:03d}': jax.device_put(np.full(s, i, np.float32), NS(m, P('x')))
                   for i, s in enumerate(shapes)}, host_ram_budget=256 << 20)
  sys.exit(0)
startup.start_compiler()
jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # a process that has compiled
sharding = lambda: (layout.Format(layout.Layout(major_to_minor=(1, 0)), NS(m, P('x')))
                    if custom else NS(m, P('x')))
target = {f'l{i:03d}': jax.ShapeDtypeStruct(s, np.float32, sharding=sharding())
          for i, s in enumerate(shapes)}
import re
with hostmem.PeakRss() as peak:
  try:
    back = kd_ckpt.restore(d, target, host_ram_budget=budget, support_layout=custom)
    jax.block_until_ready(back)
  except kd_ckpt.BudgetTooSmallError as e:
    print(json.dumps({'named': int(re.search(r"to '(\\d+)MiB'", str(e)).group(1)) << 20,
                      'beyond': peak.extra_bytes}))
    sys.exit(0)
restored = sum(x.nbytes for x in jax.tree.leaves(back))
assert all((np.asarray(back[f'l{i:03d}']) == i).all() for i in range(n))
print(json.dumps({'beyond': peak.extra_bytes - restored, 'restored': restored,
                  'layout': str(back['l000'].format.layout.major_to_minor)}))
"""


_PROGRAMS_WORKER = """
import json, sys
import jax, numpy as np
from jax.experimental import layout
from jax.sharding import SingleDeviceSharding as SDS
from kd_ckpt import hostmem, startup
rows, n = int(sys.argv[1]), 20
startup.start_compiler()
hosts = [hostmem.zeros_aligned((rows + i, 257), np.float32) for i in range(n)]
hostmem.release_free_memory()
worst = 0
with hostmem.PeakRss() as whole:
  ys = []
  for h in hosts:
    with hostmem.PeakRss() as step:
      for d in jax.devices():
        ys.append(jax.device_put(h, layout.Format(layout.Layout(major_to_minor=(1, 0)), SDS(d))))
        ys[-1].block_until_ready()
    worst = max(worst, step.extra_bytes - len(jax.devices()) * h.nbytes)
    hostmem.release_free_memory()
kept = whole.extra_bytes - sum(y.nbytes for y in ys)
print(json.dumps({'kept_per_shape': kept / n, 'worst_step': worst, 'shard': hosts[0].nbytes}))
"""


def _programs() -> None:
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  print('| shard | kept a shard shape | most beyond a shape\'s results while it compiles |')
  print('| --- | --- | --- |')
  for rows in (20, 1020, 4000):
    proc = subprocess.run([sys.executable, '-c', _PROGRAMS_WORKER, str(rows)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"| {r['shard'] / MiB:.2f} MiB | {r['kept_per_shape'] / MiB:.2f} MiB"
          f" | {r['worst_step'] / MiB:.2f} MiB |", flush=True)


def _run(*args) -> dict:
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  proc = subprocess.run([sys.executable, '-c', _WORKER, *map(str, args)], capture_output=True,
                        text=True, env=env, cwd=REPO, timeout=600, check=True)
  lines = proc.stdout.strip().splitlines()
  return json.loads(lines[-1]) if lines else {}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--budget-mib', type=int, default=48)
  ap.add_argument('--programs', action='store_true')
  args = ap.parse_args()
  if args.programs:
    _programs()
    return
  budget = args.budget_mib * MiB
  print(f'restores at {args.budget_mib} MiB onto 8 CPU devices; peak RSS beyond the arrays')
  print('| leaves | shard rows | restored | default layout | column-major |')
  print('| --- | --- | --- | --- | --- |')
  with tempfile.TemporaryDirectory(prefix='kd_relayout_') as root:
    for n, rows in ((25, 20), (100, 20), (50, 1020)):
      d = os.path.join(root, f'{n}_{rows}')
      _run(d, rows, n, budget, 0)  # saves
      cells = []
      for custom in (0, 1):
        got, at = _run(d, rows, n, budget, custom), budget
        cell = ''
        if 'named' in got:  # refused before reading: again, at the budget it names
          cell = f"refused ({got['beyond'] / MiB:.1f} MiB), "
          at = got['named']
          got = _run(d, rows, n, at, custom)
        assert 'named' not in got, got
        assert got['layout'] == ('(1, 0)' if custom else '(0, 1)'), got
        cells.append(cell + f"{got['beyond'] / MiB:.1f} MiB at {at // MiB} MiB")
      print(f"| {n} | {rows}-{rows + n - 1} | {got['restored'] / MiB:.1f} MiB | {cells[0]}"
            f" | {cells[1]} |", flush=True)


if __name__ == '__main__':
  main()
