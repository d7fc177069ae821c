"""An Orbax `CheckpointManager` loop, unchanged, under `kd_ckpt.handler_registry`.

    .venv/bin/python bench/manager_loop.py                  # ~1 min on 2 cores
    .venv/bin/python bench/manager_loop.py --state many_medium --mib 512 --budget-mib 128

The loop a MaxText-style script has: `mgr.save(step,
args=ocp.args.StandardSave(state))`, `mgr.restore(step,
args=ocp.args.StandardRestore(abstract))`.  Each variant runs in a fresh
process over 8 CPU devices, after a warm-up jit: `stock` (Orbax's handler)
and kd_ckpt's registry with `auto` and `streaming` at BUDGET.  It saves once
(warm-up), then measures the next save (the async commit included) and a
restore, whose peak is counted beyond the restored arrays.  A state of the
test suite (`tests/states.py`), whose shapes nothing was tuned on.
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
import json, sys
import jax, jax.numpy as jnp
import orbax.checkpoint as ocp, kd_ckpt
from kd_ckpt import hostmem
from tests import states
root, state, total, budget, variant = sys.argv[1:6]
tree = jax.block_until_ready(states.make_state(state, int(total)))
jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # a training process has compiled
kw = {} if variant == 'stock' else {'handler_registry': kd_ckpt.handler_registry(
    int(budget), strategy=variant)}
with ocp.CheckpointManager(root, **kw) as mgr:
  mgr.save(0, args=ocp.args.StandardSave(tree))
  mgr.wait_until_finished()
  hostmem.release_free_memory()
  with hostmem.PeakRss() as save:
    mgr.save(1, args=ocp.args.StandardSave(tree))
    mgr.wait_until_finished()
  abstract = jax.eval_shape(lambda: tree)
  del tree
  hostmem.release_free_memory()
  with hostmem.PeakRss() as restore:
    back = jax.block_until_ready(mgr.restore(1, args=ocp.args.StandardRestore(abstract)))
print(json.dumps({'save_peak_bytes': save.extra_bytes,
                  'restore_beyond_bytes': restore.extra_bytes - states.resident_bytes(back)}))
"""


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--state', default='mesh2d_prime', help='a tests/states.py state')
  ap.add_argument('--mib', type=int, default=256, help='the state\'s size')
  ap.add_argument('--budget-mib', type=int, default=64)
  args = ap.parse_args(argv)
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': REPO,
         'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  budget = args.budget_mib * MiB
  print(f'{args.state}, {args.mib} MiB, through a CheckpointManager; kd_ckpt at'
        f' {args.budget_mib} MiB; peaks in MiB (restore: beyond the restored arrays)')
  print(f"{'variant':<10} {'save peak':>10} {'restore':>10}")
  worst = 0
  with tempfile.TemporaryDirectory() as tmp:
    for variant in ('stock', 'auto', 'streaming'):
      proc = subprocess.run(
          [sys.executable, '-c', _WORKER, os.path.join(tmp, variant), args.state,
           str(args.mib * MiB), str(budget), variant],
          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
      if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
      r = json.loads(proc.stdout.strip().splitlines()[-1])
      print(f"{variant:<10} {r['save_peak_bytes'] / MiB:>10.1f}"
            f" {r['restore_beyond_bytes'] / MiB:>10.1f}")
      if variant != 'stock':
        worst = max(worst, r['save_peak_bytes'], r['restore_beyond_bytes'])
  # Exit 1 if kd_ckpt went over its budget (+8 MiB, the test suite's tolerance).
  return int(worst > budget + 8 * MiB)


if __name__ == '__main__':
  sys.exit(main())
