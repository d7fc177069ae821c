"""Where a save's time goes: its parts timed alone, beside the whole save (issue 20).

One process, one state (a single f32 leaf on one device, as seed 000's;
hashed values that zstd cannot shrink, `workloads.gen_leaf`), in one run so
the machine's noise is shared:

  dd           the same bytes written with `dd conv=fsync` (the disk's speed)
  copy         device -> host copy in 64 MiB slices, as the streaming writer
               does it (`streaming.to_host`: on the CPU backend a memcpy into
               a fresh buffer, on a GPU the PCIe transfer)
  crc32c       kd_ckpt's checksum over those bytes (google-crc32c)
  fingerprint  kd_ckpt's on-device 128-bit hash of the leaf (reuse only)
  ts write     TensorStore alone: raw zarr chunks of 64 MiB into OCDBT on a
               local file kvstore, written one after another, then committed
               (TensorStore's file kvstore fsyncs what it writes)
  ts write, no fsync   the same with `file_io_sync: false`: the difference
               is what fsync costs
  ts zstd      the same chunks zstd-compressed (Orbax's default codec)
  kd_ckpt      `kd_ckpt.save(strategy='streaming')` at the budget
  orbax        `ocp.StandardCheckpointer().save` + `wait_until_finished`

The parts are not additive (the streaming save overlaps copy, checksum and
write); "what is left" is the save minus the slowest part, an upper bound on
the pipeline's own overhead (Python, waits, metadata).

  .venv/bin/python bench/profile_save.py --gib 1 --budget 256MiB
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MiB = 1 << 20
PIECE = 64 * MiB


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--gib', type=float, default=1.0, help='state size in GiB')
  ap.add_argument('--budget', default='256MiB')
  ap.add_argument('--dir', default=None, help='where to write (default: a temp dir)')
  args = ap.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import integrity, startup  # pylint: disable=g-import-not-at-top

  startup.start_compiler()
  sys.path.insert(0, os.path.join(REPO, 'bench'))
  import workloads  # pylint: disable=g-import-not-at-top
  from kd_ckpt import fingerprint, slicing, streaming  # pylint: disable=g-import-not-at-top

  nbytes = int(args.gib * (1 << 30)) // PIECE * PIECE
  rows = nbytes // 4 // 1024
  state = {'w': jax.block_until_ready(workloads.gen_leaf(
      jax, (rows, 1024), np.float32,
      jax.sharding.SingleDeviceSharding(jax.devices()[0]), 1))}
  root = workloads.make_work_dir(args.dir, 'kd_profile_')
  rows_per_piece = PIECE // 4 // 1024
  out = {}
  try:
    f = os.path.join(root, 'dd.bin')
    out['dd'] = _timed(lambda: subprocess.run(
        ['dd', 'if=/dev/zero', f'of={f}', 'bs=16M', f'count={nbytes // (16 * MiB)}',
         'conv=fsync'], check=True, capture_output=True))
    os.remove(f)

    pieces = []
    shard = state['w'].addressable_shards[0].data

    def copy():
      for r in range(0, rows, rows_per_piece):
        box = (slice(r, r + rows_per_piece), slice(0, 1024))
        pieces.append(streaming.to_host(shard, box))
    out['copy'] = _timed(copy)

    def crc():
      for p in pieces:
        integrity.crc32c(p)
    out['crc32c'] = _timed(crc)

    whole = tuple(slice(0, n) for n in shard.shape)
    fingerprint.fingerprint_boxes([(shard, whole, whole)])  # compile first
    out['fingerprint'] = _timed(lambda: fingerprint.fingerprint_boxes([(shard, whole, whole)]))

    def ts_write(name, compressor=None, sync=True):
      def go():
        spec = {'driver': 'zarr',
                'kvstore': {'driver': 'ocdbt',
                            'base': {'driver': 'file', 'path': f'{root}/{name}/',
                                     'file_io_sync': sync}},
                'metadata': {'shape': [rows, 1024], 'chunks': [rows_per_piece, 1024],
                             'dtype': '<f4', 'compressor': compressor}}
        t = ts.open(spec, create=True, open=True).result()
        for i, p in enumerate(pieces):
          t[i * rows_per_piece:(i + 1) * rows_per_piece].write(p).result()
      return _timed(go)
    out['ts write'] = ts_write('ts')
    out['ts write, no fsync'] = ts_write('ts_nosync', sync=False)
    out['ts zstd'] = ts_write('ts_zstd', compressor={'id': 'zstd', 'level': 1})
    del pieces
    del slicing

    out['kd_ckpt'] = _timed(lambda: kd_ckpt.save(
        os.path.join(root, 'kd'), state, strategy='streaming', host_ram_budget=args.budget))

    def orbax():
      with ocp.StandardCheckpointer() as c:
        c.save(os.path.join(root, 'orbax'), state)
        c.wait_until_finished()
    out['orbax'] = _timed(orbax)
  finally:
    shutil.rmtree(root, ignore_errors=True)

  gb = nbytes / 1e9
  print(f'{nbytes / (1 << 30):.2f} GiB f32 leaf on one device, streaming at {args.budget};'
        f' {os.cpu_count()} cores')
  print('| part | seconds | GB/s | x dd | share of kd_ckpt save |')
  print('| --- | --- | --- | --- | --- |')
  for k, s in out.items():
    print(f'| {k} | {s:.3f} | {gb / s:.2f} | {s / out["dd"]:.2f} |'
          f' {s / out["kd_ckpt"]:.0%} |')
  parts = max(out['copy'], out['crc32c'], out['ts write'])
  print(f'fsync: {max(0.0, out["ts write"] - out["ts write, no fsync"]):.2f} s of the TensorStore'
        f' write; zstd encode: {max(0.0, out["ts zstd"] - out["ts write"]):.2f} s more than raw')
  print(f'what is left of the kd_ckpt save beyond its slowest part:'
        f' {max(0.0, out["kd_ckpt"] - parts):.2f} s;'
        f' copy + crc32c + ts write in series: {out["copy"] + out["crc32c"] + out["ts write"]:.2f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())
