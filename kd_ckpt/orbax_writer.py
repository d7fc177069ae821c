"""The Orbax strategy: stock Orbax's device-to-host copy and write, checksummed on the way.

When the plan's worst case for Orbax's own save fits the budget (`cost.
predict_orbax_async`), kd_ckpt saves exactly as stock Orbax does, async
included: Orbax's `transfer_arrays_to_host` copies every replica slice this
process writes to the host before `save()` returns, and Orbax's
`_async_serialize_replica_slices` writes them in the background, in one OCDBT
transaction, with the same zarr layout.  The additions: the CRC32C of each
host copy, taken right after the transfer on the very buffer Orbax then
writes (no extra pass, no copy), typed PRNG keys included; and Orbax's zstd
codec for a leaf whose host copies are all zero (`arrays.zstd_if_zero`),
where the rest is raw.

Example:

  handler = OrbaxArrayHandler(save=ctx, use_replica_parallel=True)
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from kd_ckpt import arrays as arrays_lib
from kd_ckpt import compat
from kd_ckpt import estimate as estimate_lib
from kd_ckpt import integrity
from kd_ckpt import reuse
from kd_ckpt import slicing
from kd_ckpt import storage
from kd_ckpt import writeback as writeback_lib


# (shape, dtype, sharding, slicing options) of the arrays whose replica-slice
# programs this process has recorded (`estimate.note_slice_programs`).
_SLICED_LAYOUTS: set[tuple] = set()


def _layout_key(a: jax.Array, slicing_args: tuple) -> tuple:
  """`_SLICED_LAYOUTS`' key of `a`; one never seen before if its sharding cannot be hashed."""
  try:
    hash(a.sharding)
  except TypeError:
    return (id(a), object())
  return (a.shape, a.dtype, a.sharding, slicing_args)


class OrbaxArrayHandler(arrays_lib.KdArrayHandler):
  """Orbax's ArrayHandler save path, plus CRC32C of its host copies."""

  def target_subdir(self):
    return compat.orbax.process_subdir(True)  # Orbax writes per process, always

  async def serialize(self, values: Sequence[jax.Array], infos, args=None):
    args = args or [ocp.type_handlers.SaveArgs()] * len(values)
    ocp.type_handlers.check_input_arguments(values, infos, args)
    arrays_lib.refuse_zero_size(
        values, infos, 'Use strategy="auto" or "streaming" (kd_ckpt\'s streaming'
        ' writer stores zero-size arrays), or drop the leaf.')
    self.note_written()
    arrays, ext = self.stored_values(values, infos)
    if self.save_context.reuse is not None:
      # Reuse links files into the item's directory now, which an async save
      # creates in a background thread: Orbax's creator would delete them.
      await self.directories_ready(infos)
    write_idx, reuse_job = await self.split_reused(arrays, infos, args)
    w_arrays = [arrays[i] for i in write_idx]
    w_infos = [infos[i] for i in write_idx]
    w_args = [args[i] for i in write_idx]
    pinned = bool(infos[0].enable_pinned_host_transfer)
    opts = self._options
    slicing_args = (opts.replica_id, opts.use_replica_parallel,
                    opts.min_slice_bytes_for_replica_parallel, opts.max_replicas_for_replica_parallel)
    # Layouts whose replica slices were never cut in this process (a save of
    # the same state finds none: 2,000 replicated leaves took 0.1-0.3 s to
    # look at again).
    layouts = {k: a for a in w_arrays
               if (k := _layout_key(a, slicing_args)) not in _SLICED_LAYOUTS
               } if opts.use_replica_parallel else {}
    sliced = [compat.orbax.get_replica_slices(a, *slicing_args) for a in layouts.values()]
    host = compat.orbax.transfer_arrays_to_host(
        w_arrays, opts.replica_id, opts.use_replica_parallel,
        min_slice_bytes_for_replica_parallel=opts.min_slice_bytes_for_replica_parallel,
        max_replicas_for_replica_parallel=opts.max_replicas_for_replica_parallel,
        enable_pinned_host_transfer=pinned) if w_arrays else []
    # The programs that cut those replica slices are XLA's now: later plans
    # do not charge them again (`cost.ORBAX_SLICE_PROGRAM_BYTES`).
    estimate_lib.note_slice_programs(
        estimate_lib.slice_program_key(rs.unsliced_data.shape, rs.unsliced_data.dtype,
                                       rs.slice_args.axis, rs.slice_args.start_index,
                                       rs.slice_args.limit_index,
                                       next(iter(rs.unsliced_data.devices())).id)
        for h in sliced for rs in h.replica_slices
        if rs.slice_args is not None and not rs.is_on_host)
    _SLICED_LAYOUTS.update(layouts)
    # Leaves stored zstd (`arrays.ZSTD_ZERO_LEAVES_FROM_BYTES`): those whose
    # host copies are all zero.  The scan stops at the first bytes of most
    # data; on a zero leaf it stands in for the CRC pass (`crc32c_zeros`).
    zero = {k for k, (rslices, info) in enumerate(zip(host, w_infos))
            if _zero_candidate(rslices, info)
            and all(isinstance(d := rs.data(), np.ndarray) and arrays_lib.all_zero(d)
                    for rs in rslices.replica_slices)}
    sums = self.save_context.checksums
    if sums is not None:
      for k, (rslices, info) in enumerate(zip(host, w_infos)):
        for rs in rslices.replica_slices:
          d = rs.data()
          sums.add(info.name, slicing.pairs(rs.index, rslices.global_shape), d,
                   path=info.name, shape=rslices.global_shape, dtype=rslices.dtype,
                   crc=integrity.crc32c_zeros(d.nbytes) if k in zero else None)
    stats = self.save_context.stats
    primary = self._options.primary_host
    # What the background write needs of the arrays, taken now: the caller
    # may donate them as soon as `save()` returns.
    metadatas = ([self._write_spec(a, i, g, ext).metadata for a, i, g in zip(arrays, infos, args)]
                 if reuse_job is not None else None)
    kvstore_spec = (reuse.kvstore_of(self._write_spec(arrays[0], infos[0], args[0], ext).json)
                    if reuse_job is not None else None)
    shardings = [a.sharding for a in arrays]
    store = self._options.array_metadata_store
    metadata_key = self._options.metadata_key

    async def write():
      await asyncio.gather(*[info.await_path_creation() for info in infos])
      if reuse_job is not None:
        await reuse_job(infos[0].ts_context, kvstore_spec)
      if w_arrays:
        # Only the zarr spec changes: Orbax's array metadata store records no codec.
        infos_as_written = [_with_zstd(info) if k in zero else info
                            for k, info in enumerate(w_infos)]
        # One local process: what TensorStore has fsynced leaves the page
        # cache as it goes (`writeback.PageDropper`), as the streaming
        # writer's pages do.
        local = jax.process_count() == 1 and not storage.is_remote(infos[0].parent_dir)
        with (writeback_lib.PageDropper(str(infos[0].parent_dir)) if local
              else contextlib.nullcontext()):
          await compat.async_replica_slice_writer(
              host, infos_as_written, w_args, primary_host=primary, metadata_key=metadata_key,
              array_metadata_store=store if reuse_job is None else None,
              ext_metadata=ext)
        stats.add(sum(h.nbytes for h in host), sum(len(h.replica_slices) for h in host))
      if store is not None and reuse_job is not None:
        # Metadata of every leaf, reused ones included, as Orbax records it.
        await store.write(checkpoint_dir=infos[0].parent_dir, array_metadatas=metadatas,
                          process_index=jax.process_index())

    futures = []
    if self._options.enable_write_sharding_file:
      futures.append(ocp.future.CommitFutureAwaitingContractedSignals(
          arrays_lib.write_sharding_file(shardings, infos, primary_host=primary),
          name='serialize_shardings'))
    futures.append(ocp.future.CommitFutureAwaitingContractedSignals(
        write(), name='array_type_handler'))
    return futures

  def _write_spec(self, arr, info, arg, ext):
    """The zarr spec Orbax writes `arr` with (its metadata is what we record)."""
    rslices = compat.orbax.get_replica_slices(
        arr, self._options.replica_id, self._options.use_replica_parallel,
        self._options.min_slice_bytes_for_replica_parallel,
        self._options.max_replicas_for_replica_parallel)
    return compat.orbax.build_array_write_spec(
        info=info, arg=arg, global_shape=arr.shape,
        local_shape=tuple(rslices.local_shape), dtype=arr.dtype,
        use_ocdbt=info.is_ocdbt_checkpoint,
        process_index=compat.orbax.process_subdir(info.is_ocdbt_checkpoint),
        metadata_key=self._options.metadata_key, ext_metadata=ext.get(info.name))


def _zero_candidate(rslices, info) -> bool:
  """Whether the leaf is stored zstd if its host copies are all zero."""
  return not info.use_compression and arrays_lib.zstd_if_zero(rslices.nbytes)


def _with_zstd(info):
  """A copy of Orbax's `ParamInfo` asking for its zstd codec (`use_compression`)."""
  info = copy.copy(info)
  info.use_compression = True
  return info
