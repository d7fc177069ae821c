"""Host RAM and compile time of the programs a save runs on the devices, per program.

The budget charges each program XLA keeps (`cost.DEVICE_PROGRAM_BYTES`,
`cost.ORBAX_SLICE_PROGRAM_BYTES`: 1 MiB) from measurements on CPU devices
only.  This measures them wherever it runs (bench/gpu_check.sh runs it on a
GPU host), each kind after one warm-up compile, over `--programs` distinct
shapes:

  cut      the streaming writer cutting part of a shard on its device
           (`streaming._DevicePrograms.cut`, one per shard shape and device;
           f32, int4 on the CPU backend, where only packed dtypes are cut)
  zero     the streaming writer looking for a set bit in a leaf over every
           local device (`streaming._DevicePrograms.any_bit_set`, one per leaf)
  slice    Orbax's replica-parallel cut (`lax.slice_in_dim`, eager: one per
           shard shape, slice and device), as Orbax's writer runs it

  kept MiB/program   RSS after compiling them (gc'd, malloc trimmed) minus
                     before, over the count
  after drop MiB     what stays when kd_ckpt's cache drops them (cut, zero;
                     Orbax's are XLA's for good)

  .venv/bin/python bench/device_programs.py --out FILE.md
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

MiB = 1 << 20


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--programs', type=int, default=40)
  ap.add_argument('--out', default=None, help='markdown table to write (else stdout only)')
  args = ap.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top
  from kd_ckpt import slicing  # pylint: disable=g-import-not-at-top
  from kd_ckpt import streaming  # pylint: disable=g-import-not-at-top

  devices = jax.local_devices()
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  n = args.programs

  def rss() -> int:
    gc.collect()
    hostmem.release_free_memory()
    return hostmem.current_rss_bytes()

  # On the CPU backend numpy cuts other dtypes; the writer cuts packed ones
  # on the device there (`streaming._cut_key`).
  cut_dtype = jax.numpy.int4 if devices[0].platform == 'cpu' else np.float32

  def shard(i: int):
    return jax.device_put(np.ones((8 + i, 96), cut_dtype), devices[i % len(devices)])

  def leaf(i: int):
    rows = len(devices) * (8 + i)
    return jax.device_put(np.zeros((rows, 96), np.float32),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('d')))

  def replicated(i: int):
    return jax.device_put(np.ones((len(devices) * (8 + i), 96), np.float32),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

  kinds = {}
  programs = streaming._DevicePrograms()  # pylint: disable=protected-access

  def cut(x):
    return programs.cut(x, (slice(1, x.shape[0]), slice(0, 96)), grow=True)

  def zero(x):
    return programs.any_bit_set(x, grow=True)

  def orbax_slice(x):
    out = []
    for s in x.addressable_shards:  # each replica's part, on its device, as Orbax cuts it
      size = s.data.shape[0] // len(devices)
      r = s.replica_id
      out.append(jax.lax.slice_in_dim(s.data, r * size, (r + 1) * size, axis=0))
    return out

  for name, make, run, per in (('cut', shard, cut, 1), ('zero', leaf, zero, 1),
                               ('slice', replicated, orbax_slice, len(devices))):
    programs = streaming._DevicePrograms()  # pylint: disable=protected-access
    xs = [make(i) for i in range(n + 1)]
    jax.block_until_ready(run(xs[-1]))  # the kind's first compile, apart
    before = rss()
    t = time.perf_counter()
    for x in xs[:n]:
      jax.block_until_ready(run(x))
    secs = time.perf_counter() - t
    kept = rss() - before
    count = n * per
    dropped = None
    if name != 'slice':
      programs = streaming._DevicePrograms()  # pylint: disable=protected-access
      dropped = rss() - before
    kinds[name] = (count, kept / MiB / count, secs / count, dropped)
    del xs

  platform = devices[0].platform
  lines = [f'{platform}, {len(devices)} local devices ({devices[0].device_kind}),'
           f' {n} shapes a kind; jax {jax.__version__}', '',
           '| kind | programs | kept MiB/program | compile s/program | after drop MiB |',
           '| --- | --- | --- | --- | --- |']
  for name, (count, per_mib, per_secs, dropped) in kinds.items():
    lines.append(f'| {name} | {count} | {per_mib:.3f} | {per_secs:.4f} |'
                 f' {"-" if dropped is None else f"{dropped / MiB:.1f}"} |')
  text = '\n'.join(lines)
  print(text)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text + '\n')
  return 0


if __name__ == '__main__':
  sys.exit(main())
