"""Restores over a grid of shapes x writers x placement paths x budgets: none may stall.

A budget is a limit on shapes nobody tuned for.  This restores each state
(prime extents, 8-way and 2-D meshes, replicated and partly replicated,
column-sharded, bf16), written by stock Orbax and by kd_ckpt's streaming
writer at several budgets (each cuts its own chunk grid), on the CPU path
(devices keep their host shards) and the copying path (GPU's,
`KD_CKPT_SHARE_HOST_BUFFERS=0`), at every budget.  Each restore must come
back bit-exact or be refused with `BudgetTooSmallError`, never wait on
itself (`STALL_SECS` is cut to --stall-secs), and once a budget works every
larger one must.  It found the reader-lane deadlock fixed in abb139a.
About 2 min on 2 cores:

  .venv/bin/python tools/sweep_restores.py            # or: make sweep-restores

Exit status 1 if any restore stalled, failed, differed or broke monotonicity.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_BUDGETS = '20,24,28,32,36,40,44,48,56,64,80,96,112,128,192,256,512'


def _states(jax, np):
  from jax.sharding import Mesh, NamedSharding as NS, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  devs = np.array(jax.devices())
  m1, m2 = Mesh(devs, ('x',)), Mesh(devs.reshape(2, 4), ('a', 'b'))
  rng = np.random.default_rng(0)
  rows = [('x8_1031x1021', (8 * 1031, 1021), NS(m1, P('x')), np.float32),
          ('x8_2003x997', (8 * 2003, 997), NS(m1, P('x')), np.float32),
          ('replicated_1031x1021', (1031, 1021), NS(m1, P()), np.float32),
          ('mesh2d_prime', (2 * 1009, 4 * 1013), NS(m2, P('a', 'b')), np.float32),
          ('mesh2d_part_replicated', (2 * 2011, 1009), NS(m2, P('a')), np.float32),
          ('columns_1021x8x1031', (1021, 8 * 1031), NS(m1, P(None, 'x')), np.float32),
          ('bf16_x8', (8 * 1543, 1531), NS(m1, P('x')), jax.numpy.bfloat16)]
  for name, shape, sharding, dtype in rows:
    yield name, rng.standard_normal(shape).astype(dtype), sharding


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--budgets', default=DEFAULT_BUDGETS, help='comma list, MiB')
  ap.add_argument('--save-budgets', default='40,64,96',
                  help="comma list, MiB: the streaming writer's budgets (its chunk grids)")
  ap.add_argument('--stall-secs', type=float, default=10.0,
                  help='a restore that waits this long without progress fails')
  ap.add_argument('--dir', default=None, help='where checkpoints go (default: a temp dir)')
  args = ap.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import limiter, reading, startup  # pylint: disable=g-import-not-at-top

  limiter.STALL_SECS = args.stall_secs
  startup.start_compiler()  # as in a training process
  budgets = [int(b) for b in args.budgets.split(',')]
  root = args.dir or tempfile.mkdtemp(prefix='kd_sweep_')
  bad, counts = [], {}
  try:
    for name, value, sharding in _states(jax, np):
      tree = {'w': jax.device_put(value, sharding)}
      target = jax.eval_shape(lambda t=tree: t)
      writers = ['stock'] + [f'streaming@{b}' for b in args.save_budgets.split(',') if b]
      for writer in writers:
        d = os.path.join(root, f'{name}_{writer}')
        if writer == 'stock':
          with ocp.StandardCheckpointer() as c:
            c.save(d, tree)
        else:
          # Each budget cuts other chunks: a (1031, 1031) shard saved at 64
          # MiB, in (516, 1031) chunks, hung a restore at 48 MiB (6823ef4).
          kd_ckpt.save(d, tree, strategy='streaming',
                       host_ram_budget=f'{writer.partition("@")[2]}MiB')
        for shared in (True, False):
          reading.SHARE_HOST_BUFFERS = shared
          worked = False
          for b in budgets:
            start = time.monotonic()
            try:
              back = kd_ckpt.restore(d, target, host_ram_budget=f'{b}MiB')
              same = np.asarray(back['w']).tobytes() == np.asarray(value).tobytes()
              result = 'ok' if same else 'DIFFERS'
              del back
            except kd_ckpt.BudgetTooSmallError:
              result = 'refused' if not worked else 'REFUSED after a smaller budget worked'
            except Exception as e:  # pylint: disable=broad-except
              result = f'FAILED {type(e).__name__}: {str(e)[:200]}'
            worked = worked or result == 'ok'
            counts[result.split(':')[0]] = counts.get(result.split(':')[0], 0) + 1
            path = 'shared' if shared else 'copying'
            line = (f'{name:24s} {writer:13s} {path:7s} {b:4d} MiB'
                    f' {time.monotonic() - start:6.2f} s  {result}')
            print(line, flush=True)
            if result not in ('ok', 'refused'):
              bad.append(line)
        shutil.rmtree(d, ignore_errors=True)
  finally:
    if args.dir is None:
      shutil.rmtree(root, ignore_errors=True)
  print('\n' + ', '.join(f'{n} {k}' for k, n in sorted(counts.items())))
  for line in bad:
    print('BAD', line)
  return 1 if bad else 0


if __name__ == '__main__':
  sys.exit(main())
