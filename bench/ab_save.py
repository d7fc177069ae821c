"""Saves alternating in one process, each rep beside `dd` of the same bytes (issue 20).

The disk here is noisy (dd of the same bytes: 1.1-8 s from one minute to the
next), so variants are compared rep by rep in one process, with `dd
conv=fsync` of the same bytes before each rep (the issue's yardstick), and
`dd oflag=direct conv=fsync` (the disk without the page cache, which
kd_ckpt's local saves leave as they write, `kd_ckpt.writeback`):

  now             the streaming writer as it is (`strategy='streaming'`)
  fsync/commit    TensorStore fsyncs every commit (`file_io_sync` on), as
                  before `kd_ckpt.writeback`
  before          that, and every slice copied into a fresh host buffer
                  (no `_BufferPool`): the writer at 9506c6a
  all-raw         every leaf raw, its array created before its data (as
                  before zero leaves were stored zstd,
                  `arrays.ZSTD_ZERO_LEAVES_FROM_BYTES`)
  prev            the writer at 81c6ce7: writeback waited for on the save's
                  own thread, and slabs of a group's eighth only (a buffer
                  of its own for each bigger slice); the bigger-buffer take
                  of c2af8e8 stays
  cols            chunks as the greedy chooser cuts them (the largest that
                  fits, columns cut first where that keeps it largest), as
                  before bands of whole rows (`slicing._row_band`)
  budget-slices   slices sized by the budget alone, as before slices of at
                  most an eighth of the state (`cost.STATE_SLICES`)
  late-start      writeback started every 64 MiB, a commit retired only when
                  the next one starts, the replaced manifests not held open:
                  the writer before writeback started after each small
                  group (`writeback._ManifestHolder`, `_Pipeline.maybe_flush`)
  no-eager        late-start's retire only; no-hold its manifests only;
  start-64mib     its writeback start every 64 MiB only
  auto            `kd_ckpt.save(strategy='auto')` at the same budget
  kd-orbax        `kd_ckpt.save(strategy='orbax')`: Orbax's writer with the
                  settings auto picks where Orbax's worst case fits
  orbax           `ocp.StandardCheckpointer().save` + `wait_until_finished`
  ts-alone        TensorStore alone: the state's bytes (in 2 MiB rows of one
                  raw zarr array) from one reused host buffer, through OCDBT
                  transactions of the streaming layout's group size, one
                  commit in flight, writeback started after each commit and
                  every file fsynced at the end (`kd_ckpt.writeback`, as a
                  streaming save does): no device-to-host copy, checksum or
                  Python between slices.  The writer's floor on this disk,
                  in the same run.

A kd_ckpt variant may name its own budget, `now@1GiB` or `auto@1GiB`
(otherwise `--budget`): does a larger budget save faster?

Besides seconds: the process's CPU seconds (user + system), the pages it
faulted in (minor faults, in MiB of 4 KiB pages: on these VMs a first touch
is slow, "Measuring" in bench/README.md), the device's cache flushes and
write requests (/proc/diskstats), and the seconds spent in the
device-to-host copies (`streaming.to_host`).  The "before" variants are
made by patching the writer from here; the product has no switch for them.

  .venv/bin/python bench/ab_save.py --state gemma_gb --reps 3 --out bench/results/ab_save.md
  .venv/bin/python bench/ab_save.py --state gemma_gb --reps 8 --variants now,auto,orbax
  .venv/bin/python bench/ab_save.py --state big --reps 5 --variants now,now@1GiB,auto,auto@1GiB
  .venv/bin/python bench/ab_save.py --state big --gb 0.134 --reps 15 --variants now,orbax --no-dd
  .venv/bin/python bench/ab_save.py --state leaves --leaves 1000 --leaf-bytes 4096 --reps 7 --variants now,auto,orbax
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import shutil
import subprocess
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'bench'))

import workloads  # pylint: disable=g-import-not-at-top,wrong-import-position
VARIANTS = ('now', 'prev', 'fsync/commit', 'before', 'all-raw', 'cols', 'budget-slices',
            'late-start', 'no-eager', 'no-hold', 'start-64mib', 'auto',
            'kd-orbax', 'orbax', 'ts-alone')
TS_ALONE_ROW_BYTES = 2 << 20


def _disk(root: str):
  """(bytes written, write requests, flushes) of the device holding root."""
  d = workloads.disk_stats(root)
  return d['written_bytes'], d['writes'], d['flushes']


def _tree_bytes(path: str) -> int:
  """Bytes of the files under path (the checkpoint's size)."""
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _patch(variant: str, streaming):
  """Applies a variant; returns its undo."""
  undo = []
  if variant in ('fsync/commit', 'before'):
    old = streaming.writeback_lib
    streaming.writeback_lib = types.SimpleNamespace(
        Writeback=lambda root, **k: None, START_EVERY_BYTES=old.START_EVERY_BYTES)
    undo.append(lambda: setattr(streaming, 'writeback_lib', old))
  if variant == 'all-raw':  # every leaf raw, created in the batch open
    arrays = streaming.arrays_lib
    threshold = arrays.ZSTD_ZERO_LEAVES_FROM_BYTES
    arrays.ZSTD_ZERO_LEAVES_FROM_BYTES = float('inf')
    undo.append(lambda: setattr(arrays, 'ZSTD_ZERO_LEAVES_FROM_BYTES', threshold))
  if variant == 'cols':
    chunk_shape = streaming.slicing.chunk_shape

    def greedy(*a, rows_first=False, **k):
      del rows_first
      return chunk_shape(*a, **k)
    streaming.slicing.chunk_shape = greedy
    undo.append(lambda: setattr(streaming.slicing, 'chunk_shape', chunk_shape))
  if variant == 'budget-slices':
    layout = streaming.cost.streaming_layout

    def by_budget(budget_bytes, num_leaves=0, data_bytes=None):
      del data_bytes
      return layout(budget_bytes, num_leaves)
    streaming.cost.streaming_layout = by_budget
    undo.append(lambda: setattr(streaming.cost, 'streaming_layout', layout))
  wb_lib, pipeline = streaming.writeback_lib, streaming._Pipeline  # pylint: disable=protected-access
  if variant in ('late-start', 'no-eager'):
    maybe_flush = pipeline.maybe_flush

    async def retire_at_next_commit(self):
      if self.staged_bytes >= self.group_bytes:
        await self.flush()
    pipeline.maybe_flush = retire_at_next_commit
    undo.append(lambda: setattr(pipeline, 'maybe_flush', maybe_flush))
  if variant in ('late-start', 'no-hold'):
    holder = wb_lib._ManifestHolder.start  # pylint: disable=protected-access
    wb_lib._ManifestHolder.start = classmethod(lambda cls, root: None)  # pylint: disable=protected-access
    undo.append(lambda: setattr(wb_lib._ManifestHolder, 'start', holder))  # pylint: disable=protected-access
  if variant in ('late-start', 'start-64mib'):
    init = wb_lib.Writeback.__init__

    def every_64mib(self, root, **k):
      k['start_every_bytes'] = wb_lib.START_EVERY_BYTES
      init(self, root, **k)
    wb_lib.Writeback.__init__ = every_64mib
    undo.append(lambda: setattr(wb_lib.Writeback, '__init__', init))
  if variant == 'prev':
    wb_lib = streaming.writeback_lib

    class InlineWriteback(wb_lib.Writeback):
      def committed(self, nbytes):  # the waits on the caller's thread
        self._pending_bytes += nbytes
        if self._pending_bytes >= wb_lib.START_EVERY_BYTES:
          self._pending_bytes = 0
          self.started()

    streaming.writeback_lib = types.SimpleNamespace(
        Writeback=InlineWriteback, START_EVERY_BYTES=wb_lib.START_EVERY_BYTES)
    undo.append(lambda: setattr(streaming, 'writeback_lib', wb_lib))
    init = streaming._Pipeline.__init__  # pylint: disable=protected-access

    def small_slabs(self, *a, **k):
      k['largest_slice_bytes'] = 0
      init(self, *a, **k)
    streaming._Pipeline.__init__ = small_slabs  # pylint: disable=protected-access
    undo.append(lambda: setattr(streaming._Pipeline, '__init__', init))  # pylint: disable=protected-access
  if variant == 'before':
    admit = streaming._Pipeline.admit  # pylint: disable=protected-access

    async def plain(self, charge, buffer_bytes=None):
      del buffer_bytes
      return await admit(self, charge)
    streaming._Pipeline.admit = plain  # pylint: disable=protected-access
    undo.append(lambda: setattr(streaming._Pipeline, 'admit', admit))  # pylint: disable=protected-access
  return lambda: [u() for u in undo]


def _ts_alone(path: str, nbytes: int, group_bytes: int) -> None:
  """The `ts-alone` variant: TensorStore writing nbytes as the streaming writer's transactions do."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  from kd_ckpt import streaming, writeback  # pylint: disable=g-import-not-at-top
  cols = TS_ALONE_ROW_BYTES // 4
  rows = -(-nbytes // TS_ALONE_ROW_BYTES)
  src = np.random.default_rng(0).random(cols, dtype=np.float32)

  wb = writeback.Writeback(path)

  async def write():
    t = await ts.open({
        'driver': 'zarr',
        'kvstore': {'driver': 'ocdbt', 'base': f'file://{path}', 'path': 'a/'},
        'metadata': {'shape': [rows, cols], 'chunks': [1, cols], 'dtype': '<f4',
                     'compressor': None}},
        create=True, open=True, context=streaming.write_context(sync=False))
    txn, staged, group, commit = None, 0, [], None
    for r in range(rows):
      txn = txn or ts.Transaction(atomic=False)
      group.append(t.with_transaction(txn)[r].write(
          src, can_reference_source_data_indefinitely=True))
      staged += TS_ALONE_ROW_BYTES
      if staged >= group_bytes or r == rows - 1:
        for f in group:
          await f
        if commit is not None:
          await commit
          wb.committed(group_bytes)
        commit, txn, staged, group = txn.commit_async(), None, 0, []
    await commit

  try:
    asyncio.run(write())
    wb.finish()  # fsyncs every file and directory, as a save's end does
  finally:
    wb.close()


def _dd_rows(rows, root: str, f: str, nbytes: int) -> None:
  """`dd conv=fsync` of nbytes, then `dd oflag=direct conv=fsync`: one row each."""
  d0, t = _disk(root), time.perf_counter()
  subprocess.run(['dd', 'if=/dev/zero', f'of={f}', 'bs=1M', f'count={-(-nbytes // (1 << 20))}',
                  'conv=fsync'], check=True, capture_output=True)
  secs, d1 = time.perf_counter() - t, _disk(root)
  rows['dd'].append((secs, 0.0, d1[2] - d0[2], d1[1] - d0[1], 0.0, os.path.getsize(f), 0))
  os.remove(f)
  # The disk without the page cache: kd_ckpt's local saves drop their
  # pages as they write (`kd_ckpt.writeback`), plain `dd` fills fresh ones.
  d0, t = _disk(root), time.perf_counter()
  subprocess.run(['dd', 'if=/dev/zero', f'of={f}', 'bs=4M', f'count={-(-nbytes // (4 << 20))}',
                  'oflag=direct', 'conv=fsync'], check=True, capture_output=True)
  secs, d1 = time.perf_counter() - t, _disk(root)
  rows['dd direct'].append((secs, 0.0, d1[2] - d0[2], d1[1] - d0[1], 0.0, os.path.getsize(f),
                            0))
  os.remove(f)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  workloads.add_one_state_args(ap, reps=3)
  ap.add_argument('--out', default=None, help='also write the table to this file')
  ap.add_argument('--no-dd', action='store_true',
                  help='no dd before each rep (its dirty pages and flushes land on'
                  ' the next save: a small state\'s saves are then mostly that)')
  ap.add_argument('--variants', default=','.join(VARIANTS),
                  help=f'comma-separated, of {VARIANTS} (default: all)')
  args = ap.parse_args(argv)
  thp = workloads.disable_thp()
  asked = args.variants.split(',')
  bad = [v for v in asked if v.partition('@')[0] not in VARIANTS
         or ('@' in v and v.partition('@')[0] not in ('now', 'auto'))]
  if not asked or bad:
    ap.error(f'--variants {args.variants!r}: {bad} unknown; choose from {",".join(VARIANTS)}'
             ' (now and auto may add @BUDGET, e.g. now@1GiB)')
  # In VARIANTS' order, each with its budgeted forms after it; 'now' first.
  variants = tuple(a for v in VARIANTS for a in asked if a.partition('@')[0] == v)
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup, streaming  # pylint: disable=g-import-not-at-top

  startup.start_compiler()
  state = workloads.build_one_state(jax, args)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  root = workloads.make_work_dir(args.dir, 'kd_ab_')
  copy_secs = collections.Counter()
  real_to_host = streaming.to_host

  def to_host(*a, **k):
    t = time.perf_counter()
    try:
      return real_to_host(*a, **k)
    finally:
      copy_secs['s'] += time.perf_counter() - t
  streaming.to_host = to_host
  rows = collections.defaultdict(list)
  try:
    kd_ckpt.save(os.path.join(root, 'warm'), {'x': np.ones(4)}, strategy='streaming')
    for rep in range(args.reps):
      if not args.no_dd:
        _dd_rows(rows, root, os.path.join(root, 'dd.bin'), nbytes)
      order = variants if rep % 2 == 0 else variants[::-1]
      for v in order:
        kind, _, budget = v.partition('@')
        undo = _patch(kind, streaming)
        path = os.path.join(root, f'c{rep}_{v.replace("/", "_").replace("@", "_")}')
        copy_secs.clear()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0, d0, t = os.times(), _disk(root), time.perf_counter()
        try:
          if kind == 'ts-alone':
            _ts_alone(path, nbytes, kd_ckpt.plan_save(
                state, host_ram_budget=args.budget, strategy='streaming').layout.group_bytes)
          elif kind == 'orbax':
            ckptr = ocp.StandardCheckpointer()
            ckptr.save(path, state)
            ckptr.wait_until_finished()
            ckptr.close()
          else:
            kd_ckpt.save(path, state, strategy={'auto': 'auto', 'kd-orbax': 'orbax'}.get(
                kind, 'streaming'), host_ram_budget=budget or args.budget)
        finally:
          undo()
        secs, c1, d1 = time.perf_counter() - t, os.times(), _disk(root)
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        rows[v].append((secs, cpu, d1[2] - d0[2], d1[1] - d0[1], copy_secs['s'],
                        _tree_bytes(path), faults * 4096))
        print(f'rep {rep} {v}: {secs:.2f} s'
              + ('' if args.no_dd else f', dd {rows["dd"][-1][0]:.2f} s'), flush=True)
        shutil.rmtree(path)
  finally:
    streaming.to_host = real_to_host
    shutil.rmtree(root, ignore_errors=True)

  base = 'before' if 'before' in variants else 'orbax' if 'orbax' in variants else variants[0]
  med = lambda v, i: float(np.median([r[i] for r in rows[v]]))
  lines = [
      f'<!-- .venv/bin/python bench/ab_save.py --state {args.state}'
      + (f' --gb {args.gb:g}' if args.gb else '')
      + (f' --leaves {args.leaves} --leaf-bytes {args.leaf_bytes} --leaf-values {args.leaf_values}'
         if args.state == 'leaves' else '') +
      f' --budget {args.budget} --reps {args.reps} --variants {",".join(variants)}'
      + (' --no-dd' if args.no_dd else '') + ' -->',
      f'{args.state}: {nbytes / 1e9:.4f} GB, {len(jax.tree.leaves(state))} leaves,'
      f' {len(jax.devices())} devices, streaming at {args.budget}, {os.cpu_count()} cores;'
      f' medians of {args.reps} alternating reps (each rep: '
      + ('the variants only, no dd' if args.no_dd else 'dd, dd direct, then the variants') + ');'
      + ('' if args.no_dd else ' x dd is against plain `dd conv=fsync`, through the page cache;')
      + f' {thp}.',
      '',
      f'| variant | save s (each rep) | median s | x dd (throughput) | x dd direct |'
      f' x {base} | process CPU s | faulted in MiB | device flushes | write requests |'
      ' to_host s | files MB |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  dd = lambda v, key: '-' if args.no_dd else f'{med(key, 0) / med(v, 0):.2f}'
  dd_rows = () if args.no_dd else ('dd', 'dd direct')
  for v in dd_rows + variants:
    each = ' / '.join(f'{r[0]:.2f}' for r in rows[v])
    cpu, faults, copy = ('-', '-', '-') if v.startswith('dd') else (
        f'{med(v, 1):.2f}', f'{med(v, 6) / (1 << 20):.0f}', f'{med(v, 4):.2f}')
    lines.append(
        f'| {v} | {each} | {med(v, 0):.2f} | {dd(v, "dd")} |'
        f' {dd(v, "dd direct")} | {med(v, 0) / med(base, 0):.2f} | {cpu} |'
        f' {faults} | {med(v, 2):.0f} | {med(v, 3):.0f} | {copy} | {med(v, 5) / 1e6:.2f} |')
  text = '\n'.join(lines) + '\n'
  print(text)
  if args.out:
    with open(args.out, 'w') as fh:
      fh.write(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
