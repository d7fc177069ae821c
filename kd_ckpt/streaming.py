"""The streaming writer: leaf by leaf, big leaves in chunk-aligned slices, inside the limiter.

`StreamingArrayHandler` is an Orbax `ArrayHandler` whose `serialize` admits
every host buffer through the process's host limiter before allocating it:
a slice is copied to the host only once its bytes (and what TensorStore
allocates for it while its OCDBT transaction commits, `cost.STAGED_FACTOR`)
fit, and they are released when the commit is done.  Whatever the state,
the admitted bytes never exceed the budget less the fixed floor.

Everything else is Orbax's own: the PyTree handler, `_METADATA`, `_sharding`,
the OCDBT layout, the zarr spec (`build_array_write_spec`), the temporary
directory and the atomic rename.  Only the chunk shape differs: every slice
is a whole number of chunks (`slicing`), so TensorStore never buffers or
re-reads a partial chunk.  Stock Orbax reads any chunk grid, so the
checkpoint restores without kd_ckpt.

Per slice: cut the shard on its device, copy that slice into a fresh host
buffer, stage it in a non-atomic OCDBT transaction (TensorStore references
the buffer: raw chunks are not re-encoded), drop it when the transaction has
committed.  No full-shard host copy exists, and the live arrays' host-value
cache (`jax.Array._npy_value`) is never filled.

Example (what `kd_ckpt.save(..., strategy="streaming")` does):

  ctx = arrays.SaveContext.for_budget(256 << 20)
  handler = StreamingArrayHandler(save=ctx)
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import math
import sys
import threading
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from kd_ckpt import arrays as arrays_lib
from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import estimate as estimate_lib
from kd_ckpt import hostmem
from kd_ckpt import integrity
from kd_ckpt import limiter as limiter_lib
from kd_ckpt import reuse
from kd_ckpt import slicing
from kd_ckpt import storage
from kd_ckpt import writeback as writeback_lib


# How often the writer returns freed memory to the OS.  A trim costs about a
# millisecond; every 8 commits keeps the overhead under 1% of a 1 MiB slice.
TRIM_EVERY_COMMITS = 8
# On CPU, slices are copied into host buffers the save reuses (`_BufferPool`)
# rather than fresh ones: a fresh buffer above glibc's mmap threshold during
# an operation (`hostmem`, 1 MiB) is a new mapping whose pages the copy
# faults in one by one (2.2 GB of Gemma-like shards: 2.1 s into fresh
# buffers, 0.4 s into reused ones, on this 2-core machine).  Slices share
# slabs of `SLABS_PER_GROUP`-th of a group or of the save's biggest slice,
# whichever is bigger, so that every slab fits every slice and a slab is
# never freed for a slice of another size (Gemma-like 2.2 GB at 256 MiB,
# `bench/ab_save.py --variants now,prev`: 151 MiB of pages faulted in by a
# save, against 459 MiB with a buffer per slice above group/8; the copies
# took 0.60 s against 0.69 s).  A bigger slice (none, unless the largest
# was underestimated) gets a buffer of its own.
SLABS_PER_GROUP = 8
SLAB_ALIGN_BYTES = 64
# Smaller slices (a norm's scale, a step counter) are left to malloc, whose
# arenas recycle them without a mapping, and go through Orbax's transfer.
POOL_MIN_BYTES = 64 << 10
# A leaf that may be stored zstd (`arrays.ZSTD_ZERO_LEAVES_FROM_BYTES`) has
# its array created in the group's transaction once its shards were looked
# at where they live (`_all_zero`), or, for dtypes that cannot be looked at
# there (or an accelerator's leaf with no room for the program), once its
# first slice is on the host, rather than in the batch before.  On leaves of noise that cost
# 0.2-0.6 ms of CPU a leaf at 1 MiB (300 x 1 MiB: 1.13 s against 0.97 s,
# ab_save_zero_check_1mib.md) and nothing measurable at 4 MiB (100 x 4 MiB:
# 0.95 s against 1.13 s, and 1.03 against 0.98 in another run,
# ab_save_zero_check.md): hence the threshold.  On the host only the first
# slice is looked at (a zero first slice and data after it: zstd on the
# rest, still correct).


def to_host(data: jax.Array, box: slicing.Box, *, pinned: bool = False,
            out: np.ndarray | None = None, grow: bool = False) -> np.ndarray:
  """One slice of a single-device array, copied into a host buffer of its own.

  A whole shard goes through Orbax's own transfer
  (`replica_slices.transfer_arrays_to_host`), through pinned host memory
  when `pinned` (Orbax's `enable_pinned_host_transfer`) and the device has
  it.  A part of a shard is cut on the device, then transferred the same
  way.  On the CPU backend the device buffer *is* host memory: the slice is
  read through a zero-copy view (no program compiled per slice) and copied
  into `out` (a reused buffer of the slice's shape and dtype, see
  `_BufferPool`) or a fresh one, which is exactly what a GPU host pays (one
  host buffer per slice) -- no more, no less.  `out` is used on CPU only.
  On CPU a whole shard that is not pooled still takes Orbax's transfer, so
  that Orbax's `enable_pinned_host_transfer` reaches it as in Orbax's own
  writer (its handler tests check that); without pinned memory that
  transfer hands back a view of the shard, copied here.
  """
  whole = all(s.start == 0 and s.stop == n for s, n in zip(box, data.shape))
  # A packed dtype (int4) has no view on CPU either: numpy unpacks the whole
  # buffer, and jax keeps that copy on the array.  Cut on the device as on an
  # accelerator, so that only the slice is unpacked.
  cpu = (next(iter(data.devices())).platform == 'cpu'
         and not estimate_lib.packed_on_device(data.dtype))
  if cpu and (out is not None or not whole):
    view = np.asarray(data)  # zero-copy on CPU; `data` is a per-shard array.
    part = view if whole else view[box]
    if out is None:
      return np.array(part, copy=True, order='C')
    np.copyto(out, part)
    return out
  # On an accelerator, a fresh device array even for a whole shard: the host
  # copy JAX caches on an array it converts (`_npy_value`) must die with the
  # slice, not live on the caller's shard.  On CPU that cache is a zero-copy
  # view: the shard itself is handed over.  The copy is the runtime's
  # (`device_put(may_alias=False)`): `jnp.array(copy=True)` compiled a program
  # for every shard shape, ~1 MiB each that XLA keeps (28 int4/float4 leaves
  # of one fuzz state: a save 4.8 MiB over its budget, 9 MiB on a bucket).
  # A part of a shard is cut by a program of `_PROGRAMS` (one per shard shape,
  # part shape and device; its offsets are arguments), which `grow` says
  # the caller has charged for keeping.
  piece = (data if cpu else jax.device_put(data, data.sharding, may_alias=False) if whole
           else _PROGRAMS.cut(data, box, grow=grow))
  [host] = compat.orbax.transfer_arrays_to_host(
      [piece], 0, False, min_slice_bytes_for_replica_parallel=None,
      max_replicas_for_replica_parallel=None, enable_pinned_host_transfer=pinned)
  host = np.asarray(host.replica_slices[0].data())
  if cpu and host.ctypes.data == piece.unsafe_buffer_pointer():
    # A view of the live device buffer: copy it, as a GPU host would.
    host = np.array(host, copy=True, order='C')
  return host


def write_context(*, remote: bool = False, sync: bool = True) -> ts.Context:
  """One context per save: its leaves share one OCDBT database (one writer).

  The node cache is small: a save reads nothing back, and each commit leaves
  new node versions in it (Orbax's 100 MB default grew +60 MiB over 1 GB).
  On a bucket, a failed request is retried for about 40 s at most
  (`storage.bucket_retries`).  `sync=False`: local files are not fsynced per
  commit; the caller makes them durable (`writeback.Writeback`).
  """
  spec = {
      'file_io_concurrency': {'limit': 128},
      'cache_pool#ocdbt': {'total_bytes_limit': cost.WRITE_NODE_CACHE_BYTES},
  }
  if remote:
    spec['gcs_request_retries'] = storage.bucket_retries()
  if not sync:
    spec['file_io_sync'] = False
  return ts.Context(spec)


def ocdbt_subdir(use_ocdbt: bool) -> int | str | None:
  """Where this process's arrays go inside the checkpoint's OCDBT database.

  With one process there is one writer: the arrays go straight into the
  root database, through kd_ckpt's own small-cache context, skipping Orbax's
  end-of-save merge (which copies every entry through one transaction: +35
  MiB at the end of a 1 GB save); Orbax's own host values (numpy arrays,
  scalars) are merged as usual, and `handler.SafePyTreeHandler.finalize`
  checks every array is there.  With several processes each writes its
  `ocdbt.process_<i>` database as stock Orbax does, through the save's Orbax
  context (process 0's numpy leaves share that database: one writer).
  """
  if not use_ocdbt or jax.process_count() == 1:
    return None
  return compat.orbax.process_subdir(use_ocdbt)


class StreamingArrayHandler(arrays_lib.KdArrayHandler):
  """An Orbax ArrayHandler that writes inside the host limiter.

  Attributes (constructor arguments, besides `KdArrayHandler`'s):
    store_zero_size: store zero-size arrays (metadata only; stock Orbax reads
      them back).  False, as Orbax's own handler: refuse them with Orbax's
      error, so that code registering this handler in Orbax's place behaves
      as with Orbax.  `kd_ckpt.save` and `SafePyTreeHandler` store them.
  """

  def __init__(self, *, store_zero_size: bool = False, **kwargs):
    super().__init__(**kwargs)
    self._store_zero_size = store_zero_size

  def target_subdir(self):
    return ocdbt_subdir(True)

  async def serialize(self, values: Sequence[jax.Array], infos, args=None):
    args = args or [ocp.type_handlers.SaveArgs()] * len(values)
    ocp.type_handlers.check_input_arguments(values, infos, args)
    if not self._store_zero_size:
      arrays_lib.refuse_zero_size(
          values, infos, 'kd_ckpt.save and SafePyTreeHandler store them'
          ' (StreamingArrayHandler(store_zero_size=True)); or drop the leaf.')
    ctx = self.save_context
    self.note_written()
    arrays, ext = self.stored_values(values, infos)
    prepared = [self._prepare(a, i, g, ext.get(i.name)) for a, i, g in zip(arrays, infos, args)]
    # The arrays are written *now*, before this coroutine returns: the caller
    # may donate or overwrite them as soon as `save()` returns, and we keep
    # no host copy to write from later.  Async saves create the directories
    # in a background thread first.
    await self.directories_ready(infos)
    write_idx, reuse_job = await self.split_reused(arrays, infos, args)
    remote = storage.is_remote(infos[0].parent_dir)
    # One writer, on a local disk: one fsync pass at the end instead of
    # TensorStore's fsyncs per commit (`writeback`).
    group_bytes = max(ctx.slice_bytes, ctx.group_bytes)
    # Writeback starts after every group's commit in a save of small groups
    # (a small state's: `cost.STATE_SLICES`), so the disk starts early.
    wb = (writeback_lib.Writeback(str(infos[0].parent_dir), start_every_bytes=min(
        writeback_lib.START_EVERY_BYTES, group_bytes))
          if jax.process_count() == 1 and not remote else None)
    context = (write_context(remote=remote, sync=wb is None)
               if jax.process_count() == 1 else infos[0].ts_context)
    lim = ctx.limiter
    progress = arrays_lib.Progress(ctx.progress_total_bytes) if ctx.progress_total_bytes else None
    leaves = cost.leaves_charge(len(infos))
    with lim.lease(cost.streaming_capacity(ctx.capacity_bytes, leaves)):
      pipeline = _Pipeline(lim, group_bytes=group_bytes,
                           stats=ctx.stats, progress=progress,
                           rss_ceiling_bytes=ctx.rss_ceiling_bytes or (
                               hostmem.current_rss_bytes() + ctx.capacity_bytes),
                           writeback=wb,
                           largest_slice_bytes=max(
                               (min(ctx.slice_bytes, math.prod(p.local_shape) * p.itemsize)
                                for p in prepared), default=0))
      # The leaves' bookkeeping (Orbax's and TensorStore's, per leaf) lives
      # for the whole save: admitted first, released last.
      await pipeline.admit(leaves)
      # New programs on the devices (`_PROGRAMS`: cuts, zero checks) may take
      # what two of the largest slices leave, packed ones' extra included.
      worst = (cost.staged_charge(ctx.slice_bytes, contiguous=False)
               + cost.packed_copy_extra_bytes(ctx.slice_bytes, cpu=True))
      pipeline.program_room_bytes = max(
          0, cost.streaming_capacity(ctx.capacity_bytes, leaves) - leaves - 2 * worst)
      try:
        if reuse_job is not None:
          await reuse_job(context, reuse.kvstore_of(prepared[0].tspec))
        todo = [prepared[i] for i in write_idx]
        for start in range(0, len(todo), cost.OPEN_BATCH_LEAVES):
          await self._write_batch(todo[start:start + cost.OPEN_BATCH_LEAVES],
                                  context, pipeline)
        await pipeline.drain()
        if wb is not None:
          await asyncio.to_thread(wb.finish)  # durable before Orbax renames it
      except BaseException:
        # A failed write (e.g. disk full) must not leave others running: they
        # would re-create the temporary directory after the caller removed it.
        await pipeline.abort()
        if wb is not None:
          await asyncio.to_thread(wb.close)
        raise
      finally:
        lim.release(leaves + pipeline.program_bytes)
    hostmem.release_free_memory()
    if self._options.array_metadata_store is not None:
      await self._options.array_metadata_store.write(
          checkpoint_dir=infos[0].parent_dir,
          array_metadatas=[p.spec.metadata for p in prepared],
          process_index=jax.process_index())
    futures = []
    if self._options.enable_write_sharding_file:
      # The `_sharding` file a stock save writes, in one write
      # (`arrays.write_sharding_file`).  Started after the data, so a failed
      # save leaves no writer behind.
      futures.append(ocp.future.CommitFutureAwaitingContractedSignals(
          arrays_lib.write_sharding_file(
              [a.sharding for a in arrays], infos, primary_host=self._options.primary_host),
          name='kd_ckpt_serialize_shardings'))
    return futures

  def _prepare(self, arr: jax.Array, info, arg, ext_metadata) -> '_Prepared':
    rslices = compat.orbax.get_replica_slices(
        arr, self._options.replica_id, self._options.use_replica_parallel,
        self._options.min_slice_bytes_for_replica_parallel,
        self._options.max_replicas_for_replica_parallel)
    itemsize = np.dtype(arr.dtype).itemsize
    local_shape = tuple(rslices.local_shape)
    chunk = slicing.chunk_shape(local_shape, itemsize, self.save_context.slice_bytes,
                                global_shape=arr.shape, rows_first=True,
                                up_to_bytes=self.save_context.budget_slice_bytes)
    spec = compat.orbax.build_array_write_spec(
        info=info, arg=arg, global_shape=arr.shape, local_shape=local_shape,
        dtype=arr.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
        process_index=ocdbt_subdir(info.is_ocdbt_checkpoint),
        metadata_key=self._options.metadata_key, ext_metadata=ext_metadata)
    limiter = info.byte_limiter
    limit = compat.byte_limit(limiter)
    if limit is None or limit >= self.save_context.capacity_bytes:
      # Orbax's default (96 GB) never binds inside the budget: skip its
      # per-slice reservation, which also waits for each slice's staging.
      limiter = None
    return _Prepared(arr, rslices, local_shape, chunk, itemsize, spec,
                     with_chunk_shape(spec.json, chunk), info.name, limiter,
                     bool(info.enable_pinned_host_transfer))

  async def open_store(self, tspec: dict[str, Any], context: ts.Context) -> ts.TensorStore:
    """Creates the stored array (primary host) and opens it for writing.

    The host that creates the array writes through the store it created;
    the others open it from its spec without reading the metadata back, as
    Orbax's serializer does (one open a leaf instead of Orbax's two: ~5% of
    a 2,000-leaf save).
    """
    if self._options.primary_host is None or jax.process_index() == self._options.primary_host:
      return await ts.open(ts.Spec(tspec), create=True, open=True, context=context)
    return await ts.open(ts.Spec(tspec), open=True, assume_metadata=True, context=context)

  async def _write_batch(self, batch, context, pipeline: '_Pipeline') -> None:
    # Creating an array's metadata is a small OCDBT commit: do a batch at
    # once rather than one per leaf between data writes.  Batches bound the
    # open TensorStores (charged per leaf, `cost.PER_LEAF_BYTES`).
    # A leaf that may be stored compressed (`arrays.ZSTD_ZERO_LEAVES_FROM_BYTES`)
    # is created when its first slice is on the host (None here).
    async def opened(p):
      return None if _zero_candidate(p) else await self.open_store(p.tspec, context)
    stores = await asyncio.gather(*[opened(p) for p in batch])
    for p, t in zip(batch, stores):
      await self._write_array(p, t, pipeline, context)
    await pipeline.drain(keep_pool=True)
    del stores

  async def _write_array(self, p: '_Prepared', t: ts.TensorStore | None,
                         pipeline: '_Pipeline', context: ts.Context) -> None:
    target_dtype = jax.numpy.dtype(p.tspec['dtype'])  # the store's (a cast's source)
    sums = self.save_context.checksums
    if math.prod(p.local_shape) == 0:
      # Zero-size: the metadata is all there is (Orbax refuses these); its
      # record says so, so verify knows the leaf.
      if sums is not None:
        sums.add(p.name, tuple((0, int(n)) for n in p.arr.shape),
                 np.zeros(p.local_shape, target_dtype), path=p.name,
                 shape=p.arr.shape, dtype=target_dtype)
      return
    interleaved = slicing.interleaved(p.chunk, p.local_shape, p.arr.shape)
    cpu = next(iter(p.arr.devices())).platform == 'cpu'
    zero = None
    if t is None:
      # A leaf that may be stored zstd: its shards are looked at where they
      # live, before any copy.  A zero one (an optimizer's moments before the
      # first step) is then written from zero pages, which hold no RAM, and
      # checksummed by its length; nothing of it comes to the host.
      zero = await _all_zero(p, pipeline)
      zspec = with_zstd(p.tspec)
      if zero is not None:
        t = await pipeline.create(zspec if zero else p.tspec, context)
      keys = _zero_chunk_keys(p, zspec) if zero else None
      if keys is not None:
        await self._write_zero_chunks(p, t, zspec, keys, pipeline, target_dtype)
        return
    for rslice in p.rslices.replica_slices:
      data = rslice.unsliced_data
      base = _shard_part(rslice)
      for box in slicing.boxes(p.local_shape, p.chunk, p.itemsize,
                               self.save_context.slice_bytes):
        src_box = tuple(slice(b.start + bb.start, b.start + bb.stop)
                        for b, bb in zip(base, box))
        nbytes = slicing.nbytes(box, p.itemsize)
        charge = cost.staged_charge(
            nbytes, chunks=slicing.num_chunks(box, p.chunk),
            contiguous=slicing.contiguous(p.chunk, box) and not interleaved,
            aligned_bytes=slicing.aligned_nbytes(box, p.chunk, p.itemsize))
        if p.pinned:
          charge += nbytes  # the pinned staging copy, on hosts that have it
        # On CPU the slice is copied into a buffer the pipeline reuses; its
        # charge then counts the buffer's capacity, not nbytes.
        packed = estimate_lib.packed_on_device(p.arr.dtype)
        if packed:
          # On CPU the device is host RAM: the slice cut there (half its
          # unpacked bytes) and the unpacked buffer numpy's copy is made
          # from.  An 8-32 MiB int4 slice peaked at 2.0-2.5x its bytes.
          # Elsewhere the transfer may land packed before it is unpacked
          # on the host: half again (not measured on an accelerator).
          charge += cost.packed_copy_extra_bytes(nbytes, cpu=cpu)
        pooled = (not zero and cpu and not packed and p.arr.dtype == target_dtype
                  and nbytes >= POOL_MIN_BYTES)
        buf, charge = await pipeline.admit(charge, buffer_bytes=nbytes if pooled else None)
        # Until the slice is staged its charge is this loop's to give back:
        # a failed copy, cast, checksum or write must not shrink every later
        # save's limiter (the pipeline's abort releases only staged slices).
        staged = False
        try:
          shape = tuple(b.stop - b.start for b in box)
          if zero:
            host = pipeline.zeros(shape, target_dtype)
          else:
            out = None if buf is None else buf[:nbytes].view(data.dtype).reshape(shape)
            key = None if out is not None else _cut_key(data, src_box)
            grow = key is not None and key not in _PROGRAMS and await pipeline.charge_program()
            host = to_host(data, src_box, pinned=p.pinned, out=out, grow=grow)
            del out
          if host.dtype != target_dtype:
            host = host.astype(target_dtype)
          if t is None:
            t = await pipeline.create(with_zstd(p.tspec) if arrays_lib.all_zero(host) else p.tspec,
                                      context)
          dst = slicing.offset(tuple(rslice.index), box, p.arr.shape)
          if sums is not None:
            sums.add(p.name, slicing.pairs(dst, p.arr.shape), host, path=p.name,
                     shape=p.arr.shape, dtype=target_dtype,
                     crc=integrity.crc32c_zeros(host.nbytes) if zero else None)
          if p.byte_limiter is None:
            pipeline.write(t, dst, host, charge, base=buf)
            staged = True
          else:
            # The user's `save_concurrent_gb` (Orbax's byte limiter) bounds the
            # bytes being handed to TensorStore at once, as in stock Orbax.
            await p.byte_limiter.wait_for_bytes(nbytes)
            try:
              staging = pipeline.write(t, dst, host, charge, base=buf)
              staged = True
              await staging
            finally:
              await p.byte_limiter.release_bytes(nbytes)
        except BaseException:
          if not staged:
            pipeline.lim.release(charge)
          raise
        del host, buf
        await pipeline.maybe_flush()

  async def _write_zero_chunks(self, p: '_Prepared', t: ts.TensorStore, zspec: dict[str, Any],
                               keys: list[tuple[str, int]], pipeline: '_Pipeline',
                               target_dtype) -> None:
    """Writes an all-zero leaf's chunks as one encoded chunk, stored under every key.

    Through the array, TensorStore allocated and filled a chunk buffer for
    every chunk of zeros before encoding it (a 512 MiB leaf: 0.25 s and 406
    MiB faulted in, against 0.12 s and none for Orbax's writer).  Every
    chunk of zeros encodes to the same bytes (zarr v2 stores edge chunks
    whole), so one is encoded, streamed from the shared zero pages in 1 MiB
    pieces (no RAM but zstd's context), and written to each chunk key in the
    group's transaction, as the array would have written it.  The checkpoint
    is the one the array writes make: stock Orbax reads it alike.
    """
    nbytes = math.prod(zspec['metadata']['chunks']) * np.dtype(target_dtype).itemsize
    # zstd's context and the frame, charged as the slice the array write was.
    charge = cost.staged_charge(min(nbytes, self.save_context.slice_bytes))
    _, charge = await pipeline.admit(charge)
    try:
      encoded = _zstd_zeros(nbytes, pipeline.zeros((min(nbytes, 1 << 20),), np.uint8))
    finally:
      pipeline.lim.release(charge)
    kv = t.kvstore
    for key, elements in keys:
      _, held = await pipeline.admit(cost.staged_charge(len(encoded)))
      pipeline.write_bytes(kv, key, encoded, held,
                           logical_bytes=elements * np.dtype(target_dtype).itemsize)
      await pipeline.maybe_flush()
    sums = self.save_context.checksums
    if sums is not None:
      for rslice in p.rslices.replica_slices:
        dst = _region(rslice, p.arr.shape)
        shape = tuple(d.stop - d.start for d in dst)
        sums.add(p.name, slicing.pairs(dst, p.arr.shape), pipeline.zeros(shape, target_dtype),
                 path=p.name, shape=p.arr.shape, dtype=target_dtype,
                 crc=integrity.crc32c_zeros(math.prod(shape) * np.dtype(target_dtype).itemsize))


def _cut_key(data: jax.Array, box: slicing.Box) -> tuple | None:
  """The program `to_host` cuts `box` of the shard `data` with (None: none).

  None for a whole shard (the runtime copies it) and, on the CPU backend,
  for dtypes numpy can view (a numpy copy cuts it); else one per shard
  shape, dtype, part shape and device.
  """
  if all(b.start == 0 and b.stop == n for b, n in zip(box, data.shape)):
    return None
  device = next(iter(data.devices()))
  if device.platform == 'cpu' and not estimate_lib.packed_on_device(data.dtype):
    return None
  return ('cut', tuple(data.shape), str(data.dtype), tuple(b.stop - b.start for b in box),
          device)


class _DevicePrograms:
  """The programs the writer runs on the devices, each dropped when evicted.

  Two kinds: one cuts part of a shard (`cut`, keyed by `_cut_key`: per
  shard shape, part shape, dtype and device), the other looks for a set bit
  in a leaf that may be all zero (`any_bit_set`, keyed by `_zero_key`: per
  leaf shape, dtype and sharding).  jnp's indexing and a shared jitted
  zero check compiled theirs per shard and device, and XLA's caches kept every one for
  the process's life, outside any budget: 120 int4 leaves of as many
  shapes, sliced on one CPU device (175 programs), saved at 48 MiB peaked
  at 89.8 MiB; 30 leaves of 4 MiB over 8 CPU devices looked at as on an
  accelerator (240 reductions, 8 s of compiles) at 76.0 MiB.  Each program
  here is a jitted function of its own, and dropping it frees its
  executable (measured: 120 cuts compiled and dropped in turn left RSS
  flat, against +46 MiB kept; 60 zero checks over 8 devices left 9 MiB of
  their 41 MiB behind, in jax's own caches).  The cache grows only by what
  a save has charged for (`_Pipeline.charge_program`).  Otherwise a new cut takes the place
  of the least recently used program (one is kept uncharged at most), and
  a zero check is not compiled at all: the leaf is looked at on the host.
  What the cache holds after a save stays for the next ones, which then
  compile nothing.
  """

  def __init__(self):
    self._fns: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  def __contains__(self, key) -> bool:
    with self._lock:
      return key in self._fns

  def __len__(self) -> int:
    with self._lock:
      return len(self._fns)

  def _get(self, key: tuple, make, *, grow: bool, replace: bool):
    """The key's program: kept, or made if `grow` or `replace` (None otherwise)."""
    with self._lock:
      fn = self._fns.get(key)
      if fn is not None:
        self._fns.move_to_end(key)
        return fn
      if not grow:
        if not replace:
          return None
        if self._fns:
          self._fns.popitem(last=False)  # its executable goes with it
      fn = self._fns[key] = make()
      return fn

  def cut(self, data: jax.Array, box: slicing.Box, *, grow: bool) -> jax.Array:
    """`data[box]` on its device, by the key's program (compiled if new)."""
    key = _cut_key(data, box)
    sizes = key[3]
    fn = self._get(key, lambda: jax.jit(lambda a, *starts: jax.lax.dynamic_slice(a, starts, sizes)),
                   grow=grow, replace=True)
    return fn(data, *(np.int32(b.start) for b in box))

  def any_bit_set(self, arr: jax.Array, *, grow: bool) -> bool | None:
    """Whether any bit of `arr` is set, by the key's program (`_zero_key`).

    None if the program is not kept and `grow` is False.  One program runs
    on every device of the leaf at once, each looking at its own shard (no
    collective), and one flag a device comes back.
    """
    fn = self._get(_zero_key(arr), lambda: _zero_program(arr.sharding), grow=grow, replace=False)
    return None if fn is None else bool(np.asarray(fn(arr)).any())


def _zero_program(sharding: jax.sharding.Sharding):
  """A new program (`_zero_key`'s): per device, whether its shard has a set bit.

  A function of its own each time: jax's caches are keyed by the function,
  so a shared one would keep every executable after its wrapper is dropped.
  """
  def flag(x):
    return arrays_lib.has_set_bit(x).reshape(1)
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh
    return jax.jit(compat.shard_map(flag, mesh=mesh, in_specs=sharding.spec,
                                    out_specs=jax.sharding.PartitionSpec(mesh.axis_names)))
  return jax.jit(flag)


_PROGRAMS = _DevicePrograms()


def _zero_key(arr: jax.Array) -> tuple | None:
  """The program that looks for a set bit in the leaf `arr` on its devices (None: none).

  One per leaf shape, dtype and sharding, not per shard and device: a leaf
  over 8 GPUs takes one program, not 8.  None for a sharding other than a
  mesh's or a single device's, and for a leaf kept in host memory (an
  offloaded optimizer state: a program would run on the devices): the
  leaf is then looked at on the host.
  """
  if (not isinstance(arr.sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding))
      or arr.sharding.memory_kind not in (None, 'device')):
    return None
  return ('zero', tuple(arr.shape), str(arr.dtype), arr.sharding)


async def _all_zero(p: '_Prepared', pipeline: '_Pipeline') -> bool | None:
  """Whether the leaf `p` is all zero, looked at where it lives; None if not looked at.

  On the CPU backend its shards are scanned in place (`arrays.shards_all_zero`).
  On an accelerator a program runs on its devices (`_DevicePrograms.any_bit_set`),
  kept only if the save has room to charge it; where it has none, the leaf
  is not looked at there (None) and its first slice is, on the host
  (`StreamingArrayHandler._write_array`).
  """
  shards = [r.unsliced_data for r in p.rslices.replica_slices]
  if not arrays_lib.zero_checkable(p.arr.dtype):
    return None
  if all(arrays_lib.scanned_in_place(s) for s in shards):
    return arrays_lib.shards_all_zero(shards)
  key = _zero_key(p.arr)
  if key is None or (key not in _PROGRAMS and not await pipeline.charge_program()):
    return None
  return not _PROGRAMS.any_bit_set(p.arr, grow=True)


def _shard_part(rslice) -> list[slice]:
  """The part of its shard a replica slice writes (its `slice_args`), in the shard's coordinates."""
  base = [slice(0, n) for n in rslice.unsliced_data.shape]
  if rslice.slice_args is not None:
    a = rslice.slice_args
    base[a.axis] = slice(a.start_index, a.limit_index)
  return base


def _region(rslice, shape) -> tuple[slice, ...]:
  """The global region a replica slice writes.

  Orbax's `ReplicaSlice.index` is that region already: for a replica-parallel
  slice it is the part of the shard (`slice_args`) in global coordinates, not
  the shard's index.  (Offsetting it by `slice_args` again put a second
  process's zero chunks under its neighbour's keys.)
  """
  return slicing.from_pairs(slicing.pairs(rslice.index, shape))


def _zero_chunk_keys(p: '_Prepared', zspec: dict[str, Any]) -> list[tuple[str, int]] | None:
  """The zarr v2 chunk keys this process writes of an all-zero leaf, or None.

  Each key comes with the number of the array's elements in its chunk (an
  edge chunk holds fewer than its shape).

  None (write through the array) unless every region it writes is whole
  chunks (a region may end at the array's edge) of a zarr v2 array with a
  zstd compressor and no filters.
  """
  meta = zspec.get('metadata') or {}
  chunks = meta.get('chunks')
  if (zspec.get('driver') != 'zarr' or meta.get('zarr_format', 2) != 2 or not chunks
      or (meta.get('compressor') or {}).get('id') != 'zstd' or meta.get('filters')
      or len(chunks) != len(p.arr.shape) or not p.arr.shape):
    return None
  sep = meta.get('dimension_separator', '.')
  keys: list[tuple[str, int]] = []
  for rslice in p.rslices.replica_slices:
    ranges = []
    for d, c, n in zip(_region(rslice, p.arr.shape), chunks, p.arr.shape):
      if d.start % c or (d.stop % c and d.stop != n) or d.stop <= d.start:
        return None
      ranges.append(range(d.start // c, -(-d.stop // c)))
    keys += [(sep.join(map(str, idx)),
              math.prod(min(c, n - i * c) for i, c, n in zip(idx, chunks, p.arr.shape)))
             for idx in itertools.product(*ranges)]
  return keys if len({k for k, _ in keys}) == len(keys) else None


def _zstd_zeros(nbytes: int, zeros: np.ndarray) -> bytes:
  """One zstd frame (level 1, Orbax's zarr v2 level) of `nbytes` zero bytes, fed from `zeros`."""
  import zstandard  # pylint: disable=g-import-not-at-top  (a kd_ckpt dependency)
  cobj = zstandard.ZstdCompressor(level=1).compressobj(size=nbytes)
  out, left = [], nbytes
  while left:
    n = min(left, zeros.nbytes)
    out.append(cobj.compress(zeros[:n]))
    left -= n
  out.append(cobj.flush())
  return b''.join(out)


class _Pipeline:
  """Slice writes grouped into non-atomic OCDBT transactions, inside the limiter.

  A write outside a transaction is an OCDBT commit of its own (a B-tree update
  and fsyncs, 4-15 ms here whatever its size), so 10,000 small leaves would
  cost 10,000 commits.  Slices are staged in a transaction until it holds
  `group_bytes`; it then commits in the background while the next one fills.
  Each slice's charge is released when its transaction has committed,
  except for its host buffer's, which moves to the pipeline's `_BufferPool`
  when nothing else holds the buffer.  When the limiter has no room, the
  pipeline makes room itself (frees the pool, commits what is staged, waits
  for the oldest commit) before waiting for other users.
  """

  def __init__(self, lim: limiter_lib.HostLimiter, *, group_bytes: int,
               stats: arrays_lib.SaveStats, progress=None, max_commits: int = 1,
               rss_ceiling_bytes: int | None = None,
               writeback: writeback_lib.Writeback | None = None,
               largest_slice_bytes: int = 0):
    self.lim = lim
    self.writeback = writeback
    # Programs this save added to `_PROGRAMS`, charged until it ends (the
    # executables stay: later saves find them), within `program_room_bytes`.
    self.program_bytes = 0
    self.program_room_bytes = 0
    self.rss_ceiling_bytes = rss_ceiling_bytes
    self.group_bytes = group_bytes
    self.stats = stats
    self.progress = progress
    self.max_commits = max_commits
    self.txn: ts.Transaction | None = None
    self.staged: list[Any] = []
    self.creates: list[Any] = []  # arrays created in this group (`create`)
    self.staged_bytes = 0  # what the group writes to storage
    # The leaves' bytes it stands for (a zero leaf's chunks are written as
    # a few KB each, `_write_zero_chunks`): the report's bytes written.
    self.staged_logical_bytes = 0
    self.staged_charge = 0
    self.commits: collections.deque = collections.deque()
    self.retired = 0
    # Slabs hold the save's biggest slice too: every pooled buffer then fits
    # every slice, and none is freed to make room for one of another size.
    slab = max(group_bytes // SLABS_PER_GROUP, min(largest_slice_bytes, group_bytes))
    self.pool = _BufferPool(lim, slab_bytes=max(
        SLAB_ALIGN_BYTES, -(-slab // SLAB_ALIGN_BYTES) * SLAB_ALIGN_BYTES))
    # The slab this group's small slices are cut from: its bytes are in
    # `staged_charge`, it is in `staged_bases`, and it closes with the group.
    self.slab: np.ndarray | None = None
    self.slab_used = 0
    self.staged_bases: list[np.ndarray] = []
    self._zeros = np.zeros(0, np.uint8)

  def zeros(self, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A read-only zero array: a view of one calloc'd buffer for the whole save.

    Its pages are never written, so reading them maps the kernel's zero page:
    no RAM, and (one buffer, not one per slice) no page faults after the first
    slice's.
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if self._zeros.nbytes < nbytes:
      self._zeros = np.zeros(nbytes, np.uint8)
      self._zeros.flags.writeable = False
    return self._zeros[:nbytes].view(dtype).reshape(shape)

  async def _make_room(self) -> bool:
    """Frees the cheapest bytes this save holds; False if it holds none.

    In order: the pool's oldest free buffer, then what is staged (committed
    now), then the oldest commit (waited for).
    """
    if self.pool.held_bytes:
      self.pool.drop_oldest()
    elif self.staged:
      await self.flush()
    elif self.commits:
      await self._retire()
    else:
      return False
    return True

  async def admit(self, charge: int, *, buffer_bytes: int | None = None
                  ) -> tuple[np.ndarray | None, int]:
    """Waits until `charge` fits in the limiter; returns (buffer, charge held).

    With `buffer_bytes` (part of `charge`: the slice's host buffer) the
    slice gets a uint8 buffer of at least that many bytes, and the charge
    held counts the buffer that really holds them: a piece of the group's
    slab (charged to the group), or a buffer of its own, reused from the
    pool (its bytes are held already) or fresh.  Room is made cheapest
    first: free the pool's oldest buffer, commit what is staged, wait for
    the oldest commit, then wait for the save's other items.
    """
    rest = charge if buffer_bytes is None else charge - buffer_bytes
    slab_bytes = self.pool.slab_bytes
    if buffer_bytes is not None and rest + max(buffer_bytes, slab_bytes) > (
        self.lim.capacity_bytes or 0):
      buffer_bytes, rest = None, charge  # a tiny budget: the plain charge only
    # The charges model what TensorStore allocates per staged byte; RSS says
    # what it did.  Where the storage or the write pattern costs more than
    # modelled (e.g. an object store's upload buffers, chunk keys of several
    # shards interleaving in OCDBT's B-tree), the pipeline drains its own
    # commits before the process passes the ceiling.  (Before a slab is cut:
    # a piece of it must be staged in the slab's own group.)
    trimmed = False
    while (self.rss_ceiling_bytes is not None
           and hostmem.current_rss_bytes() + charge > self.rss_ceiling_bytes):
      if await self._make_room():
        continue
      if trimmed:
        break
      hostmem.release_free_memory()
      trimmed = True
    small = buffer_bytes is not None and buffer_bytes <= slab_bytes
    taken = None  # a pool buffer taken for this slice: its bytes are held
    while True:
      cut = small and self.slab is not None and (
          self.slab_used + buffer_bytes <= self.slab.nbytes)
      if buffer_bytes is not None and not cut and taken is None:
        taken = self.pool.take(slab_bytes if small else buffer_bytes, exact=small)
      fresh = 0
      if buffer_bytes is not None and not cut and taken is None:
        fresh = slab_bytes if small else buffer_bytes
      if self.lim.try_acquire(rest + fresh):
        break
      if fresh:
        # Rather than free a pooled buffer to make room for a fresh one (whose
        # pages the copy then faults in), take a bigger one already held.
        taken = self.pool.take(fresh, any_bigger=True)
        if taken is not None:
          continue
      if await self._make_room():
        continue
      if taken is not None:
        # Wait for another item holding nothing but what this slice needs.
        self.lim.release(taken.nbytes)
        taken = None
        continue
      await self.lim.acquire_async(rest + fresh)  # held by another item of the save
      break
    buf, held = None, rest
    if buffer_bytes is not None:
      if cut:
        buf = self.slab[self.slab_used:self.slab_used + buffer_bytes]
      else:
        new = taken if taken is not None else np.empty(fresh, np.uint8)  # touched by the copy
        if small:
          # A new slab for the group: charged to it, released when it retires.
          self.slab, self.slab_used = new, 0
          self.staged_bases.append(new)
          self.staged_charge += new.nbytes
          buf = new[:buffer_bytes]
        else:
          buf, held = new, rest + new.nbytes
      if small:
        self.slab_used += -(-buffer_bytes // SLAB_ALIGN_BYTES) * SLAB_ALIGN_BYTES
    return buf, held

  async def charge_program(self) -> bool:
    """Charges one more kept device program (`_PROGRAMS`) if the room allows; whether it did."""
    if self.program_bytes + cost.DEVICE_PROGRAM_BYTES > self.program_room_bytes:
      return False
    await self.admit(cost.DEVICE_PROGRAM_BYTES)
    self.program_bytes += cost.DEVICE_PROGRAM_BYTES
    return True

  async def create(self, tspec: dict[str, Any], context: ts.Context) -> ts.TensorStore:
    """Creates an array in the group's transaction: committed with its data.

    The metadata is staged like a slice (the group's commit waits for it);
    the store returned is opened from the spec's metadata, reading nothing,
    and `write` binds it to each group in turn.
    """
    self.creates.append(ts.open(ts.Spec(tspec), create=True, open=True, context=context,
                                transaction=self._transaction()))
    return await ts.open(ts.Spec(tspec), open=True, assume_metadata=True, context=context)

  def write(self, t: ts.TensorStore, dst, host: np.ndarray, charge: int, *,
            base: np.ndarray | None = None):
    """Stages `host` at `dst`; returns the staging future (awaiting it is optional).

    `base`: the buffer from `admit` that `host` views.  A buffer of the
    slice's own (its capacity is in `charge`) is reused once the commit is
    durable; a piece of a slab is the slab's (already tracked).
    """
    fut = t.with_transaction(self._transaction())[dst].write(
        host, can_reference_source_data_indefinitely=True)
    if base is not None and base.base is None:  # its own buffer, not a slab's piece
      self.staged_bases.append(base)
    return self._staged(fut, host.nbytes, host.nbytes, charge)

  def write_bytes(self, kv: ts.KvStore, key: str, value: bytes, charge: int, *,
                  logical_bytes: int):
    """Stages `value` under `key` of `kv` (an array's stored chunk), as `write` stages a slice.

    `logical_bytes`: the leaf's bytes the chunk holds once decoded.
    """
    fut = kv.with_transaction(self._transaction()).write(key, value)
    return self._staged(fut, len(value), logical_bytes, charge)

  def _transaction(self) -> ts.Transaction:
    """The group's transaction, begun by its first write."""
    if self.txn is None:
      self.txn = ts.Transaction(atomic=False)
    return self.txn

  def _staged(self, fut, stored_bytes: int, logical_bytes: int, charge: int):
    """Counts a staged write in the group; returns its future."""
    self.staged.append(fut)
    self.staged_bytes += stored_bytes
    self.staged_logical_bytes += logical_bytes
    self.staged_charge += charge
    return fut

  async def maybe_flush(self) -> None:
    # A commit already done is retired now, not when the next group commits:
    # its buffers go back to the pool and its writeback starts (the disk
    # otherwise idled through a small save's first two groups).
    while self.commits and self.commits[0][0].done():
      await self._retire()
    if self.staged_bytes >= self.group_bytes:
      await self.flush()

  async def flush(self) -> None:
    self.slab = None  # the group's slab closes with it
    if self.txn is None:
      # Nothing staged, but a slab may have been opened for a slice that
      # then failed: back to the pool (or freed).
      self.lim.release(self.staged_charge - self.pool.put_free(self.staged_bases))
      self.staged_charge = 0
      return
    for f in self.creates + self.staged:  # Staged in memory; nothing is on disk yet.
      await f
    self.commits.append((self.txn.commit_async(), self.staged_bytes, self.staged_logical_bytes,
                         len(self.staged), self.staged_charge, self.staged_bases))
    self.txn, self.staged, self.staged_bytes, self.staged_charge = None, [], 0, 0
    self.staged_logical_bytes = 0
    self.creates = []
    self.staged_bases = []
    while len(self.commits) > self.max_commits:
      await self._retire()

  async def _retire(self) -> None:
    fut, nbytes, logical_bytes, nslices, charge, bases = self.commits.popleft()
    try:
      await fut
    except BaseException:
      self.lim.release(charge)
      raise
    # Committed: the buffers nothing else holds keep their bytes, in the pool.
    self.lim.release(charge - self.pool.put_free(bases))
    if self.writeback is not None:
      # Written to the page cache only: the writeback thread starts its
      # writeback (waiting here only when it is `writeback.DEPTH` starts
      # behind, which bounds the dirty page cache).
      await asyncio.to_thread(self.writeback.committed, nbytes)
    self.stats.add(logical_bytes, nslices)
    self.retired += 1
    if self.retired % TRIM_EVERY_COMMITS == 0:
      # TensorStore's threads free commit buffers into their own glibc
      # arenas; without a trim RSS creeps up through a long save.
      hostmem.release_free_memory()
    if self.progress is not None:
      self.progress.update(self.stats.bytes_written)

  async def drain(self, *, keep_pool: bool = False) -> None:
    """Commits everything; frees the pool unless `keep_pool` (more to write)."""
    await self.flush()
    while self.commits:
      await self._retire()
    if not keep_pool:
      self.pool.drop()

  async def abort(self) -> None:
    """Waits out every write and commit, ignoring their errors; releases all."""
    if self.txn is not None:
      for f in self.creates + self.staged:
        try:
          await f
        except Exception:  # pylint: disable=broad-exception-caught
          pass
      self.txn.abort()
      self.txn = None
      self.lim.release(self.staged_charge)
      self.staged, self.staged_bytes, self.staged_charge = [], 0, 0
      self.staged_logical_bytes = 0
      self.staged_bases, self.creates = [], []
    elif self.staged_charge:  # a slab opened, nothing written
      self.lim.release(self.staged_charge)
      self.staged_charge, self.staged_bases = 0, []
    self.slab = None
    self.pool.drop()
    while self.commits:
      fut, _, _, _, charge, _ = self.commits.popleft()
      try:
        await fut
      except Exception:  # pylint: disable=broad-exception-caught
        pass
      finally:
        self.lim.release(charge)


class _BufferPool:
  """Host slice buffers reused from one commit to the next, inside the limiter.

  A buffer's bytes (its capacity) stay acquired in the limiter while it
  waits here: a buffer is always paid for, in a slice's or a group's charge,
  or in `held_bytes`.  When a charge does not fit, the pipeline frees the
  oldest buffers first, and it frees them all at the end of every save: a
  pool never costs a save its depth and never outlives it.  A buffer is
  reused only if nothing but the pipeline references it once its commit is
  durable: a view TensorStore kept (a cache, a retry) leaves it a plain
  buffer, never overwritten.

  Two kinds: slabs of `slab_bytes` (any of them fits any small slice), and
  buffers of a big slice's size; a big slice takes the smallest free
  buffer of 1 to 2 times its size, and is charged for all of it.
  """

  def __init__(self, lim: limiter_lib.HostLimiter, *, slab_bytes: int):
    self.lim = lim
    self.slab_bytes = slab_bytes
    self.free: list[np.ndarray] = []  # oldest first
    self.held_bytes = 0
    self.reused = 0

  def take(self, nbytes: int, *, exact: bool = False, any_bigger: bool = False
           ) -> np.ndarray | None:
    """The smallest free buffer that fits: of `nbytes` exactly (`exact`), of
    1 to 2 times `nbytes`, or (`any_bigger`) of any size from `nbytes` up."""
    best = None
    top = nbytes if exact else None if any_bigger else 2 * nbytes
    for i, b in enumerate(self.free):
      if nbytes <= b.nbytes and (top is None or b.nbytes <= top) and (
          best is None or b.nbytes < self.free[best].nbytes):
        best = i
    if best is None:
      return None
    buf = self.free.pop(best)
    self.held_bytes -= buf.nbytes
    self.reused += 1
    return buf

  def put_free(self, bases: list[np.ndarray]) -> int:
    """Keeps the buffers only `bases` references; returns their bytes."""
    # What a buffer nothing else holds counts: the list's entry and
    # getrefcount's argument (measured on a fresh one, not assumed).
    bases.append(np.empty(0, np.uint8))
    own = sys.getrefcount(bases[-1])
    bases.pop()
    kept = 0
    for i in range(len(bases)):
      if sys.getrefcount(bases[i]) == own:
        self.free.append(bases[i])
        kept += bases[i].nbytes
    bases.clear()
    self.held_bytes += kept
    return kept

  def drop_oldest(self) -> None:
    buf = self.free.pop(0)
    self.held_bytes -= buf.nbytes
    self.lim.release(buf.nbytes)

  def drop(self) -> None:
    self.free.clear()
    held, self.held_bytes = self.held_bytes, 0
    if held:
      self.lim.release(held)


@dataclasses.dataclass(frozen=True)
class _Prepared:
  """One array's write plan: what to slice, and the TensorStore spec."""

  arr: jax.Array
  rslices: Any
  local_shape: tuple[int, ...]
  chunk: tuple[int, ...]
  itemsize: int
  spec: Any
  tspec: dict[str, Any]
  name: str
  byte_limiter: Any = None
  pinned: bool = False  # Orbax's enable_pinned_host_transfer


def _zero_candidate(p: '_Prepared') -> bool:
  """Whether the leaf's codec waits for its first slice (`arrays.zstd_if_zero`)."""
  shards = len(p.rslices.replica_slices)  # one process: whole shards, no replica slicing
  return (not _compressed(p.tspec)
          and arrays_lib.zstd_if_zero(shards * math.prod(p.local_shape) * p.itemsize))


def _compressed(tspec: dict[str, Any]) -> bool:
  _, meta = _with_metadata_copied(tspec)
  if 'codecs' in meta:
    return 'zstd' in json.dumps(meta['codecs'])
  return meta.get('compressor') is not None


def _with_metadata_copied(tspec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """A copy of `tspec` and its zarr metadata (copied too, to edit in place)."""
  spec = dict(tspec)
  node = spec
  while 'metadata' not in node:  # A cast driver wraps the zarr spec.
    node = node['base'] = dict(node['base'])
  meta = node['metadata'] = dict(node['metadata'])
  return spec, meta


def with_zstd(tspec: dict[str, Any]) -> dict[str, Any]:
  """The spec with Orbax's default compression: zstd level 3 (zarr3), 1 (zarr2)."""
  spec, meta = _with_metadata_copied(tspec)
  if 'codecs' in meta:  # zarr3: inside sharding_indexed, as Orbax puts it
    zstd = {'name': 'zstd', 'configuration': {'level': 3}}
    codecs = [dict(c) for c in meta['codecs']]
    sharded = [c for c in codecs if c.get('name') == 'sharding_indexed']
    for c in sharded:
      conf = c['configuration'] = dict(c['configuration'])
      conf['codecs'] = [*conf['codecs'], zstd]
    meta['codecs'] = codecs if sharded else [*codecs, zstd]
  else:
    meta['compressor'] = {'id': 'zstd', 'level': 1}
  return spec


def with_chunk_shape(tspec: dict[str, Any], chunk: tuple[int, ...]) -> dict[str, Any]:
  """Sets the zarr chunk grid (outer and inner chunk of `sharding_indexed`)."""
  spec, meta = _with_metadata_copied(tspec)
  if 'chunk_grid' in meta:  # zarr3
    meta['chunk_grid'] = {'name': 'regular', 'configuration': {'chunk_shape': list(chunk)}}
    codecs = [dict(c) for c in meta['codecs']]
    for c in codecs:
      if c.get('name') == 'sharding_indexed':
        c['configuration'] = dict(c['configuration'], chunk_shape=list(chunk))
    meta['codecs'] = codecs
  else:  # zarr2
    meta['chunks'] = list(chunk)
  return spec
