"""Re-measures the fixed costs behind kd_ckpt's constants (`kd_ckpt/cost.py`).

    make calibrate          # = .venv/bin/python bench/calibrate.py, ~1 min on 2 cores

Each figure comes from a fresh process with 8 CPU devices whose compiler has
started (a training process has compiled before):

* programs: host RAM XLA keeps per program that a restore compiles to fill a
  big shard in place (a zeros buffer, an update), one device and SPMD over 8
  (`cost.PROGRAM_BYTES`);
* fingerprint programs: host RAM XLA keeps per program a reusing save
  compiles to hash a leaf shape on its devices, on one device, sharded and
  replicated over 8 (`cost.FINGERPRINT_PROGRAM_BYTES`);
* floor and per leaf: the peak extra RSS of a streaming save and of a
  restore of 1 and of 2,000 tiny leaves, less the buffers the limiter
  admitted, against what the budget sets aside for it (`cost.FLOOR_BYTES`
  plus `cost.PER_LEAF_BYTES` per leaf).

Prints one table, and its JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _programs(kind: str, count: int) -> dict:
  import gc  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from kd_ckpt import hostmem, reading, startup  # pylint: disable=g-import-not-at-top

  startup.start_compiler()
  hostmem.mmap_large_buffers().__enter__()  # as inside a kd_ckpt operation, throughout
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))

  def rss():
    gc.collect()
    hostmem.release_free_memory()
    return hostmem.current_rss_bytes()

  if kind.startswith('fingerprint'):
    return _fingerprint_programs(kind, count, mesh, rss)
  before = rss()
  for i in range(count):
    # The programs kd_ckpt compiles (reading._zeros, reading._update and
    # reading._update_every_shard), each for a new shape.
    if kind == 'one device':
      d = jax.devices()[i % 8]
      sharding = jax.sharding.SingleDeviceSharding(d)
      buf = reading._zeros((64 + i, 128), np.dtype('float32'), sharding)()  # pylint: disable=protected-access
      buf = reading._update(buf, jax.device_put(np.ones((8, 128), np.float32), d),  # pylint: disable=protected-access
                            np.array([1, 0], np.int32))
    else:
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))
      buf = reading._zeros((8 * (64 + i), 128), np.dtype('float32'), sharding)()  # pylint: disable=protected-access
      pieces = jax.device_put(np.ones((64, 128), np.float32), sharding)
      live = jax.device_put(np.ones((8, 1), bool), sharding)
      buf = reading._update_every_shard(sharding)(buf, pieces, np.array([1, 0], np.int32), live)  # pylint: disable=protected-access
      del pieces, live
    buf.block_until_ready()
    del buf
  return {'programs': 2 * count, 'bytes_per_program': (rss() - before) / (2 * count)}


def _fingerprint_programs(kind: str, count: int, mesh, rss) -> dict:
  """Host RAM per fingerprint program (a reusing save's hash of a leaf shape)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from kd_ckpt import fingerprint, reuse  # pylint: disable=g-import-not-at-top

  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  make = {
      'fingerprint, one device': lambda i: jnp.zeros((256 + i, 1031), jnp.float32),
      'fingerprint, bf16 one device': lambda i: jnp.zeros((4, 128 + i, 1031), jnp.bfloat16),
      'fingerprint, sharded over 8': lambda i: jax.device_put(
          jnp.zeros((8 * (32 + i), 1031), jnp.float32), rows),
      'fingerprint, replicated over 8': lambda i: jax.device_put(
          jnp.zeros((8 * (4 + i), 1031), jnp.float32), replicated),
  }[kind]
  leaves = [make(i) for i in range(count)]
  sets = [reuse._write_set(x, 0, True, None, None) for x in leaves]  # pylint: disable=protected-access
  keys = set().union(*(fingerprint.program_keys(p) for p in sets))
  before = rss()
  fingerprint.fingerprint_many(sets)
  return {'programs': len(keys), 'bytes_per_program': (rss() - before) / len(keys)}


def _fixed(mode: str, num_leaves: int, directory: str) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import cost, hostmem, limiter, startup  # pylint: disable=g-import-not-at-top

  startup.start_compiler()
  tree = {f'l{i:04d}': jax.device_put(np.full((16, 16), i, np.float32), jax.devices()[i % 8])
          for i in range(num_leaves)}
  budget = cost.min_budget_bytes(num_leaves) + 8 * MiB
  lim = limiter.process_limiter()
  if mode == 'save':
    hostmem.release_free_memory()
    with hostmem.PeakRss() as peak:
      kd_ckpt.save(directory, tree, host_ram_budget=budget, strategy='streaming')
    extra = peak.extra_bytes
  else:
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    del tree
    hostmem.release_free_memory()
    with hostmem.PeakRss() as peak:
      jax.block_until_ready(kd_ckpt.restore(directory, target, host_ram_budget=budget))
    restored = num_leaves * 16 * 16 * 4
    extra = peak.extra_bytes - restored
  # What the buffers took: the limiter's peak less the leaves' charge, which
  # is what is measured here.
  buffers = lim.stats().peak_admitted_bytes - cost.leaves_charge(num_leaves)
  return {'peak_extra_bytes': extra, 'buffers_bytes': buffers}


def _run(*args: str) -> dict:
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  out = subprocess.run([sys.executable, __file__, '--worker', *args], env=env, cwd=REPO,
                       capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f'worker {args} failed:\n{out.stderr[-3000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--json', action='store_true', help='print the figures as JSON too')
  p.add_argument('--worker', nargs='+', help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker:
    if a.worker[0] == 'programs':
      out = _programs(a.worker[1], int(a.worker[2]))
    else:
      out = _fixed(a.worker[0], int(a.worker[1]), a.worker[2])
    print(json.dumps(out))
    return 0
  import tempfile  # pylint: disable=g-import-not-at-top

  from kd_ckpt import cost  # pylint: disable=g-import-not-at-top

  rows = []
  for kind in ('one device', 'SPMD over 8'):
    r = _run('programs', kind, '20')
    rows.append((f'program kept by XLA, {kind}', r['bytes_per_program'],
                 f'cost.PROGRAM_BYTES = {cost.PROGRAM_BYTES / MiB:.2f} MiB'))
  for kind in ('one device', 'bf16 one device', 'sharded over 8', 'replicated over 8'):
    r = _run('programs', f'fingerprint, {kind}', '30')
    rows.append((f'fingerprint program kept by XLA, {kind}', r['bytes_per_program'],
                 f'cost.FINGERPRINT_PROGRAM_BYTES = {cost.FINGERPRINT_PROGRAM_BYTES / MiB:.2f} MiB'))
  with tempfile.TemporaryDirectory() as tmp:
    for n in (1, 2000):
      d = os.path.join(tmp, f'c{n}')
      for mode in ('save', 'restore'):
        r = _run(mode, str(n), d)
        # What the budget sets aside beyond the buffers: the floor and the
        # leaves' bookkeeping.  The RSS peak and the limiter's need not
        # coincide: this is what was not admitted at most at the limiter's peak.
        aside = cost.FLOOR_BYTES + cost.leaves_charge(n)
        rows.append((f'{mode}, {n} leaves: peak less admitted buffers',
                     r['peak_extra_bytes'] - r['buffers_bytes'],
                     f'floor + {n} x PER_LEAF_BYTES = {aside / MiB:.2f} MiB'))
  width = max(len(r[0]) for r in rows)
  print(f'{"figure":<{width}}  {"measured":>12}  charged')
  for name, value, charged in rows:
    shown = f'{value / MiB:.2f} MiB' if value >= MiB / 2 else f'{value / 1024:.1f} KiB'
    print(f'{name:<{width}}  {shown:>12}  {charged}')
  if a.json:
    print(json.dumps({name: value for name, value, _ in rows}))
  return 0


if __name__ == '__main__':
  sys.exit(main())
