"""Restoring a checkpoint that stock Orbax wrote: Orbax's restore against kd_ckpt's.

    make bench-restore-stock     # = .venv/bin/python bench/restore_stock.py, ~1 min

Stock Orbax (and Kauldron) store each shard as one zstd chunk, so a
kd_ckpt restore at a budget below the shard reads every chunk in pieces
through streaming decompression.  This saves one float32 leaf with
`ocp.StandardCheckpointer` (on one device, and sharded over 8), then
restores it in fresh processes: with stock Orbax, and with
`kd_ckpt.restore` at each budget.  Each row: seconds, the ratio to Orbax's
restore of the same checkpoint in the same run, and the peak RSS beyond the
restored arrays (each device buffer counted once).  Every restore is checked
bit-exact against the saved values.  A third layout splits the same bytes
into `--leaves` leaves on one device (0: skipped): each is one chunk, decoded
by one stream, so a restore that reads leaf after leaf uses one core.

  --gib 1 --budgets 64MiB,128MiB,256MiB --leaves 24 --out FILE.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
LAYOUTS = {'1 device': None, '8 devices': 'x'}


def _tree(value, leaves: int) -> dict:
  """The saved tree: `value` whole, or split by rows into `leaves` leaves."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if leaves <= 1:
    return {'w': value}
  return {f'l{i:02d}': np.ascontiguousarray(part)
          for i, part in enumerate(np.array_split(value, leaves))}


def _value(gib: float):
  import numpy as np  # pylint: disable=g-import-not-at-top
  rows = int(gib * (1 << 30)) // (4 * 1024) // 8 * 8
  rng = np.random.default_rng(0)
  # Small integers as float32: zstd compresses them about 2x, as it does
  # trained weights' low bytes.
  return rng.integers(-1000, 1000, (rows, 1024)).astype(np.float32)


def _sharding(axis):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  if axis is None:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  mesh = jax.sharding.Mesh(np.array(jax.devices()), (axis,))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))


def _worker(spec: dict) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem, startup  # pylint: disable=g-import-not-at-top

  values = _tree(_value(spec['gib']), spec.get('leaves', 1))
  sharding = _sharding(spec['axis'])
  if spec['mode'] == 'save':
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(spec['dir'], {k: jax.device_put(v, sharding) for k, v in values.items()})
    ckptr.wait_until_finished()
    return {}
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
            for k, v in values.items()}
  startup.start_compiler()  # as in a training process, which has compiled
  hostmem.release_free_memory()
  with hostmem.PeakRss() as peak:
    start = time.perf_counter()
    if spec['budget'] is None:
      back = ocp.StandardCheckpointer().restore(spec['dir'], target)
    else:
      back = kd_ckpt.restore(spec['dir'], target, host_ram_budget=spec['budget'])
    jax.block_until_ready(back)
    seconds = time.perf_counter() - start
  buffers = {s.data.unsafe_buffer_pointer(): s.data.nbytes
             for x in back.values() for s in x.addressable_shards}
  if any(not np.array_equal(np.asarray(back[k]), v) for k, v in values.items()):
    raise SystemExit('restored values differ from the saved ones')
  return {'seconds': seconds, 'beyond_bytes': peak.extra_bytes - sum(buffers.values())}


def _run(spec: dict) -> dict:
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  proc = subprocess.run([sys.executable, __file__, '--worker', json.dumps(spec)],
                        capture_output=True, text=True, env=env, timeout=1800, check=False)
  if proc.returncode:
    raise SystemExit(f'worker {spec} failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--gib', type=float, default=1.0)
  p.add_argument('--budgets', default='64MiB,128MiB,256MiB')
  p.add_argument('--leaves', type=int, default=24,
                 help='a third layout: this many leaves on one device (0: none)')
  p.add_argument('--out', default='')
  p.add_argument('--worker', default='')
  args = p.parse_args(argv)
  if args.worker:
    print(json.dumps(_worker(json.loads(args.worker))))
    return 0
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import workloads  # pylint: disable=g-import-not-at-top
  thp = workloads.disable_thp()  # the workers inherit it
  lines = [f'Restore of {args.gib:g} GiB of float32 saved by stock Orbax'
           f' (`python bench/restore_stock.py --gib {args.gib:g} --budgets {args.budgets}'
           f' --leaves {args.leaves}`); {thp}', '',
           '| layout | restored by | seconds | x Orbax | peak beyond the arrays |',
           '| --- | --- | --- | --- | --- |']
  with tempfile.TemporaryDirectory() as tmp:
    layouts = [(name, axis, 1) for name, axis in LAYOUTS.items()]
    if args.leaves > 1:
      layouts.append((f'1 device, {args.leaves} leaves', None, args.leaves))
    for layout, axis, leaves in layouts:
      d = os.path.join(tmp, f'{axis or "one"}_{leaves}', 'c')
      base = dict(gib=args.gib, axis=axis, dir=d, leaves=leaves)
      _run(dict(base, mode='save'))
      orbax = None
      for budget in [None] + args.budgets.split(','):
        r = _run(dict(base, mode='restore', budget=budget))
        orbax = orbax or r['seconds']
        who = 'Orbax' if budget is None else f'kd_ckpt @{budget}'
        lines.append(f'| {layout} | {who} | {r["seconds"]:.2f} |'
                     f' {r["seconds"] / orbax:.2f}x | {r["beyond_bytes"] / MiB:.1f} MiB |')
        print(lines[-1], flush=True)
  text = '\n'.join(lines) + '\n'
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text)
  print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
