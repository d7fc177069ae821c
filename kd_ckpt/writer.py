"""Write: turn a SavePlan into Orbax handlers, and clean up after a save.

Both strategies write through Orbax's `PyTreeCheckpointHandler` with the same
format as `ocp.StandardCheckpointHandler()` (what Kauldron uses): OCDBT, zarr
v2 arrays, `_METADATA`, `_sharding`.  The plan only changes the handler's
knobs and, for streaming, the `jax.Array` type handler.

Example:

  handler = SafePyTreeHandler()
  handler.use_plan(plan)
  ocp.Checkpointer(handler).save(path, args=ocp.args.StandardSave(tree))
"""

from __future__ import annotations

from typing import Any

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.futures import future as future_lib
from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler
from orbax.checkpoint._src.handlers import pytree_checkpoint_handler
from orbax.checkpoint._src.metadata import array_metadata_store as array_metadata_store_lib
from orbax.checkpoint._src.serialization import type_handler_registry as registry_lib
from orbax.checkpoint._src.serialization import type_handlers
from orbax.checkpoint._src.serialization import types
import tensorstore as ts

from kd_ckpt import hostmem
from kd_ckpt import integrity
from kd_ckpt import plan as plan_lib
from kd_ckpt import streaming

# Match `ocp.StandardCheckpointHandler()`: what stock Kauldron writes and
# what every Orbax reader expects by default.
USE_OCDBT = True
USE_ZARR3 = False


def _registry(array_handler) -> Any:
  """Orbax's default type handlers with `array_handler` for jax.Array."""
  pairs = []
  for ty, handler in registry_lib._DEFAULT_TYPE_HANDLERS:  # pylint: disable=protected-access
    pairs.append((ty, array_handler if ty is jax.Array else handler))
  return registry_lib.create_type_handler_registry(*pairs)


class ChecksummedArrayHandler(type_handlers.ArrayHandler):
  """Orbax's ArrayHandler, unchanged, whose host copies are checksummed.

  The CRC32C is taken by `integrity`'s wrapper of Orbax's device-to-host
  transfer, on the buffers Orbax then writes (no extra pass, no copy).
  """

  checksums: integrity.Checksums | None = None

  async def serialize(self, values, infos, args=None):
    if self.checksums is not None:
      integrity.register(
          values, [i.name for i in infos],
          [integrity.keypath_text(i.keypath, i.name) for i in infos], self.checksums)
    return await super().serialize(values, infos, args)


def array_handler_for(plan: plan_lib.SavePlan, stats: streaming.StreamStats | None = None):
  store = array_metadata_store_lib.Store()
  if plan.strategy == 'streaming':
    return streaming.StreamingArrayHandler(
        slice_bytes=plan.slice_bytes,
        slices_in_flight=plan.slices_in_flight,
        # Replica-parallel on one host only changes who writes; it never adds
        # host memory here because each slice is copied separately.
        use_replica_parallel=True,
        stats=stats,
        progress_total_bytes=plan.total_bytes,
        array_metadata_store=store,
    )
  assert plan.orbax is not None
  return ChecksummedArrayHandler(
      use_replica_parallel=plan.orbax.use_replica_parallel,
      array_metadata_store=store,
  )


# Orbax gives OCDBT a 100 MB B-tree node cache.  A streaming save commits
# every few slices, and each commit leaves new node versions in that cache:
# measured +60 MiB over a 1 GB save.  Nothing is read back during a save, so
# a small cache costs nothing.
STREAMING_OCDBT_CACHE_BYTES = 8 * 10**6


class _StreamingPyTreeHandler(base_pytree_checkpoint_handler.BasePyTreeCheckpointHandler):
  """Orbax's PyTree handler, with a TensorStore context sized for streaming."""

  def _get_param_infos(self, item, directory, **kwargs):
    infos = super()._get_param_infos(item, directory, **kwargs)
    if not kwargs.get('use_ocdbt', True):
      return infos
    # One context for every leaf: they share one OCDBT database, which must
    # have one writer.
    context = ts.Context({
        'file_io_concurrency': {'limit': 128},
        'cache_pool#ocdbt': {'total_bytes_limit': STREAMING_OCDBT_CACHE_BYTES},
    })
    for info in jax.tree_util.tree_leaves(infos, is_leaf=lambda x: isinstance(x, types.ParamInfo)):
      if isinstance(info, types.ParamInfo):
        info.ts_context = context
    return infos


def pytree_handler_for(
    plan: plan_lib.SavePlan, stats: streaming.StreamStats | None = None,
    array_handler=None,
) -> ocp.PyTreeCheckpointHandler:
  """A PyTreeCheckpointHandler configured exactly as `plan` says."""
  o = plan.orbax
  kwargs = {}
  if o is not None:
    kwargs.update(
        save_concurrent_bytes=o.save_concurrent_bytes,
        save_device_host_concurrent_bytes=o.save_device_host_concurrent_bytes,
        use_compression=o.use_compression,
        enable_pinned_host_transfer=o.enable_pinned_host_transfer,
    )
    if o.save_device_host_concurrent_bytes is not None:
      # Orbax batches device->host copies only for keys marked non-prioritized;
      # mark all of them so the limit applies (the save is synchronous).
      kwargs['is_prioritized_key_fn'] = lambda keypath: False
  else:
    # Streaming writes raw chunks.  TensorStore's zstd encoder, run per slice
    # on its worker threads, fragments glibc's thread arenas: in a soak of 50
    # saves of 512 MiB (256 MiB budget) RSS climbed 19-73 MiB with malloc's
    # bytes in use flat, and malloc_trim cannot give it back; raw, +0.8 MiB
    # (bench soak).  Raw is also faster here (3.9 s vs 5.2 s a save) and zstd
    # saved ~8% of the bytes on float weights.
    kwargs.update(enable_pinned_host_transfer=False, use_compression=False)
  cls = (_StreamingPyTreeHandler if plan.strategy == 'streaming'
         else base_pytree_checkpoint_handler.BasePyTreeCheckpointHandler)
  if plan.strategy == 'streaming':
    # Post-merge validation re-opens every key of the merged database through
    # a fresh context with a 100 MB node cache: measured +40 MiB at the end of
    # a 1 GB save.  Each write was already confirmed durable.
    kwargs['enable_post_merge_validation'] = False
  impl = cls(
      use_ocdbt=USE_OCDBT,
      use_zarr3=USE_ZARR3,
      type_handler_registry=_registry(array_handler or array_handler_for(plan, stats)),
      **kwargs,
  )
  return pytree_checkpoint_handler.PyTreeCheckpointHandler(
      use_ocdbt=USE_OCDBT, use_zarr3=USE_ZARR3, handler_impl=impl
  )


class SafePyTreeHandler(ocp.StandardCheckpointHandler):
  """A StandardCheckpointHandler whose Orbax knobs follow a SavePlan.

  Drop-in for `ocp.StandardCheckpointHandler()` in a CheckpointManager: it
  takes `StandardSave`/`StandardRestore` args and writes the same format.
  Call `use_plan(plan)` before each save; restores use Orbax's defaults.
  """

  def __init__(self):
    super().__init__()
    self._default_impl = self._impl
    self.plan: plan_lib.SavePlan | None = None
    self.stats: streaming.StreamStats | None = None

  def use_plan(self, plan: plan_lib.SavePlan | None) -> None:
    self.plan = plan
    if plan is None:
      self._impl = self._default_impl
      self.stats = None
      return
    self.stats = streaming.StreamStats()
    self._array_handler = array_handler_for(plan, self.stats)
    self._impl = pytree_handler_for(plan, self.stats, self._array_handler)

  async def async_save(self, directory, item=None, save_args=None, args=None):
    """Orbax's save, plus the CRC32C file (see `kd_ckpt.integrity`)."""
    if self.plan is None:
      return await super().async_save(directory, item=item, save_args=save_args, args=args)
    tree = args.item if args is not None else item
    sums = integrity.Checksums()
    handler = self._array_handler
    handler.checksums = sums
    if jax.process_index() == 0:  # Orbax writes host values from process 0 only.
      _checksum_host_leaves(tree, sums)
    futures = await super().async_save(directory, item=item, save_args=save_args, args=args)
    target = directory.path if hasattr(directory, 'path') else directory

    def finish():
      # Runs once every write is durable, before Orbax's rename.
      integrity.unregister(sums)
      handler.checksums = None
      sums.write(target, jax.process_index())

    return [future_lib.ChainedFuture(list(futures or []), finish)]

  def restore(self, directory, item=None, args=None):
    impl, self._impl = self._impl, self._default_impl
    try:
      return super().restore(directory, item=item, args=args)
    finally:
      self._impl = impl


def _checksum_host_leaves(tree: Any, sums: integrity.Checksums) -> None:
  """CRC32C of numpy and scalar leaves (Orbax stores them as zarr arrays)."""
  names = jax.tree_util.tree_leaves(base_pytree_checkpoint_handler.get_param_names(tree))
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  if len(names) != len(flat):
    return  # Orbax dropped some leaves (e.g. None): names would not line up.
  for (path, x), name in zip(flat, names):
    if isinstance(x, (np.ndarray, np.number, int, float)) and not isinstance(x, bool):
      if isinstance(x, np.ndarray) and x.dtype == object:
        continue
      sums.add_whole(name, x, path=integrity.keypath_text(path, name))


@ocp.args.register_with_handler(SafePyTreeHandler, for_save=True)
class SafeSave(ocp.args.StandardSave):
  """`StandardSave` for `SafePyTreeHandler` (so Orbax can pair them)."""


@ocp.args.register_with_handler(SafePyTreeHandler, for_restore=True)
class SafeRestore(ocp.args.StandardRestore):
  """`StandardRestore` for `SafePyTreeHandler`."""


def drop_host_caches(tree: Any) -> int:
  """Drops host copies JAX cached on the live arrays during a save.

  Orbax's `np.asarray(shard.data)` stores the host copy on the per-device
  array (`_npy_value`), which lives as long as the training state: the
  host RAM of a GPU/TPU save would otherwise stay taken until the next step
  donates the buffers.  Clearing the cache frees it now.

  jaxlib's C++ `ArrayImpl` (0.12) refuses `_npy_value = None`; there the
  cache cannot be dropped from Python and stays until the array dies (the
  next train step replaces the state).  That must never fail the save, so
  the refusal is logged once and ignored.

  Returns:
    How many cached host copies were dropped.
  """
  dropped = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    if not isinstance(leaf, jax.Array):
      continue
    for arr in [leaf, *(getattr(leaf, '_arrays', None) or [])]:
      if getattr(arr, '_npy_value', None) is None:
        continue
      try:
        arr._npy_value = None  # pylint: disable=protected-access
        dropped += 1
      except (AttributeError, TypeError) as e:
        logging.log_first_n(
            logging.WARNING,
            'kd_ckpt: cannot drop the host copy JAX cached on a live array'
            ' (%s); it is freed when the array is (the next train step).', 1,
            f'{type(e).__name__}')
        return dropped
  return dropped


def after_save(tree: Any) -> None:
  """What every save ends with, so RSS does not ratchet from save to save."""
  drop_host_caches(tree)
  hostmem.release_free_memory()
