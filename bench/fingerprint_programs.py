"""What a reusing save's first fingerprints compile: one program per shard, or per leaf shape.

Each leaf shape a save hashes on its devices compiles an XLA program that XLA
keeps for the life of the process (`kd_ckpt.fingerprint`).  Hashed shard by
shard (one program per shape *and device*, as kd_ckpt did before its thirtieth
session) against side by side (`fingerprint.fingerprint_many`: the shards of
a leaf in one program over their devices), each in a fresh process with 8
CPU devices whose compiler has started:

  .venv/bin/python bench/fingerprint_programs.py --shapes 30

Prints programs compiled, the host RAM they kept (RSS after less before),
the seconds of that first hash, and the median of 5 later ones (nothing
compiled: a later save's cost), per way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _worker(way: str, shapes: int, rows_per_shard: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from kd_ckpt import fingerprint, hostmem, reuse, startup  # pylint: disable=g-import-not-at-top

  startup.start_compiler()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))
  # Leaves of `rows_per_shard` rows a shard and up, each of its own shape, over 8 devices.
  leaves = [jax.device_put(jnp.full((8 * (rows_per_shard + i), 1031), i, jnp.float32), rows)
            for i in range(shapes)]
  jax.block_until_ready(leaves)
  sets = [reuse._write_set(x, 0, True, None, None) for x in leaves]  # pylint: disable=protected-access

  def hash_all():
    if way == 'per device':
      # Each shard alone, as `_lane_sums` ran before: a program per shape and device.
      pending = []
      for pieces in sets:
        for data, src, glob in pieces:
          sizes = tuple(s.stop - s.start for s in src)
          pending.append((data.dtype, glob, fingerprint._lane_sums(  # pylint: disable=protected-access
              data, np.array([s.start for s in src], np.int32), sizes)))
      return [fingerprint._collect([p]) for p in pending]  # pylint: disable=protected-access
    return fingerprint.fingerprint_many(sets)

  hostmem.release_free_memory()
  before = hostmem.current_rss_bytes()
  start = time.perf_counter()
  hash_all()
  secs = time.perf_counter() - start
  programs = (fingerprint._spmd_program._cache_size()  # pylint: disable=protected-access
              + fingerprint._lane_sums._cache_size())  # pylint: disable=protected-access
  hostmem.release_free_memory()
  kept = hostmem.current_rss_bytes() - before
  again = []  # a later save's hash of the same shapes: nothing compiles
  for _ in range(5):
    start = time.perf_counter()
    hash_all()
    again.append(time.perf_counter() - start)
  return {'programs': programs, 'kept_bytes': kept, 'secs': secs,
          'again_secs': sorted(again)[len(again) // 2]}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--shapes', type=int, default=30, help='leaf shapes (one leaf each)')
  p.add_argument('--rows', type=int, default=256, help='rows of 1031 f32 a shard (256: ~1 MiB)')
  p.add_argument('--worker', nargs=3, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker:
    print(json.dumps(_worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))))
    return 0
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  print(f'{a.shapes} leaf shapes of {a.rows}+ rows of 1031 f32 a shard, each sharded over 8 CPU'
        ' devices; a fresh process each way')
  print(f'{"way":<14} {"programs":>8} {"kept by XLA":>12} {"seconds":>8} {"again s":>8}')
  for way in ('per device', 'side by side'):
    out = subprocess.run([sys.executable, __file__, '--worker', way, str(a.shapes), str(a.rows)], env=env,
                         cwd=REPO, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f'{way:<14} {r["programs"]:>8} {r["kept_bytes"] / MiB:>8.1f} MiB {r["secs"]:>8.2f}'
          f' {r["again_secs"]:>8.3f}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
