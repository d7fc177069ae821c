"""`SafePyTreeHandler`: Orbax's StandardCheckpointHandler, with kd_ckpt's writers and bounded reads.

A drop-in for `ocp.StandardCheckpointHandler()` in any `Checkpointer` or
`CheckpointManager` (Kauldron's included): same `StandardSave` /
`StandardRestore` semantics, same on-disk format.  Configuration goes in
`__init__` (the default budget and strategy); what changes per save travels
in the save's `SafeSave` args, Orbax's own pattern: the plan, the save's
context (limiter capacity, checksum collector, reuse source) and a callback
for when the commit is durable.  Each call builds its own Orbax PyTree
handler and type handlers from those args; nothing on this object changes
between saves.

Restores go through Orbax's PyTree handler too (structure, target types,
shardings from `_sharding` when the target has none, typed PRNG keys, casts),
with kd_ckpt's bounded `jax.Array` and `np.ndarray` readers.

Example:

  mgr = ocp.CheckpointManager(d, item_handlers=SafePyTreeHandler(host_ram_budget='4GiB'))
  mgr.save(step, args=SafeSave(state))          # plans itself
  state = mgr.restore(step, args=SafeRestore(abstract_state))

A `CheckpointManager` matches a handler to its args' exact class: a loop
that keeps Orbax's `StandardSave`/`PyTreeSave` args uses `handler_registry`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, Sequence

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from kd_ckpt import arrays as arrays_lib
from kd_ckpt import budget as budget_lib
from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import hostmem
from kd_ckpt import integrity
from kd_ckpt import orbax_writer
from kd_ckpt import plan as plan_lib
from kd_ckpt import reading
from kd_ckpt import reuse as reuse_lib
from kd_ckpt import startup
from kd_ckpt import storage
from kd_ckpt import streaming
from kd_ckpt import text
from kd_ckpt import tree as tree_lib

# Orbax's own PyTree handler, as imported: inside `kd_ckpt.within_budget` the
# public name is kd_ckpt's (`orbax_scope`), which hands its restores here.
ORBAX_PYTREE_HANDLER = ocp.PyTreeCheckpointHandler

# Match `ocp.StandardCheckpointHandler()`: what stock Kauldron writes and
# what every Orbax reader expects by default.
USE_OCDBT = True
USE_ZARR3 = False
_STOCK_HANDLER = ocp.StandardCheckpointHandler
_HOST_TYPES = (np.ndarray, np.number, int, float)


@contextlib.contextmanager
def _quiet_absl(message: str):
  """Drops absl log records whose format string contains `message`, meanwhile."""

  def keep(record: logging.LogRecord) -> bool:
    return message not in str(record.msg)

  logger = logging.getLogger('absl')
  logger.addFilter(keep)
  try:
    yield
  finally:
    logger.removeFilter(keep)


def registry(array_handler, numpy_handler) -> Any:
  """Orbax's default type handlers with kd_ckpt's for jax.Array and np.ndarray."""
  pairs = []
  for ty, h in compat.default_type_handler_pairs():
    if ty is jax.Array:
      h = array_handler
    elif ty is np.ndarray:
      h = numpy_handler
    pairs.append((ty, h))
  return ocp.type_handlers.create_type_handler_registry(*pairs)


def _standard_leaves(item: Any, *, restore: bool) -> Any:
  """`item` as StandardCheckpointHandler takes it; raises naming a bad leaf.

  As Orbax does: array-likes (numpy scalars included) are saved as numpy
  arrays; a restore target takes only the standard types and
  `jax.ShapeDtypeStruct`.
  """
  ok = ocp.checkpoint_utils.STANDARD_ARRAY_TYPES + (
      (jax.ShapeDtypeStruct,) if restore else ())

  def check(path, x):
    if not restore and not isinstance(x, (np.ndarray, jax.Array)) and hasattr(x, '__array__'):
      x = np.asarray(x)
    if not isinstance(x, ok):
      what = 'restore target' if restore else 'save'
      raise ValueError(
          f'Unsupported type: {type(x)} for leaf {tree_lib.name_of(path)!r} of the'
          f' {what}: StandardCheckpointHandler stores jax.Array, numpy arrays and'
          ' Python int/float'
          + (' (and takes jax.ShapeDtypeStruct in a target)' if restore else '')
          + '; convert it, or keep it out of the checkpointed tree.')
    return x

  return jax.tree_util.tree_map_with_path(check, item)


class _StockTypestr:
  """`typestr()`: the class's own name on the class, the stock handler's on instances.

  Orbax registers handler classes by `cls.typestr()` (ours must not collide
  with the stock handler's), and records `handler.typestr()` of the handler
  that saved each item in `_CHECKPOINT_METADATA`, where a CheckpointManager
  restoring without args looks up which handler to build.  Recording the
  stock StandardCheckpointHandler there means nothing ever needs kd_ckpt to
  load a kd_ckpt checkpoint: the bytes are the stock format.
  """

  def __get__(self, obj, cls):
    if obj is None:
      return lambda: f'{cls.__module__}.{cls.__qualname__}'
    return _STOCK_HANDLER.typestr


class SafePyTreeHandler(ocp.StandardCheckpointHandler):
  """A StandardCheckpointHandler that keeps saves and restores inside a host-RAM budget.

  Attributes (constructor arguments):
    host_ram_budget: default budget of saves and restores that do not bring
      their own plan (see `kd_ckpt.budget`).
    strategy: default strategy ('auto', 'orbax', 'streaming').
    multiprocessing_options: as for Orbax's handlers.
  """

  def __init__(self, *, host_ram_budget: budget_lib.BudgetLike = 'auto',
               strategy: str = 'auto',
               multiprocessing_options: ocp.options.MultiprocessingOptions = (
                   ocp.options.MultiprocessingOptions()),
               pytree_metadata_options=None, use_ocdbt: bool = USE_OCDBT):
    kwargs = {}
    if pytree_metadata_options is not None:
      kwargs['pytree_metadata_options'] = pytree_metadata_options
    super().__init__(multiprocessing_options=multiprocessing_options,
                     use_ocdbt=use_ocdbt, **kwargs)
    self._budget = budget_lib.parse(host_ram_budget)
    self._strategy = plan_lib.check_strategy(strategy)
    self._mp = multiprocessing_options
    self._use_ocdbt = use_ocdbt
    self._tree_kwargs = kwargs

  typestr = _StockTypestr()

  def _pytree_handler(self, array_handler, numpy_handler, **kwargs) -> ocp.PyTreeCheckpointHandler:
    return ORBAX_PYTREE_HANDLER(
        use_ocdbt=self._use_ocdbt, use_zarr3=USE_ZARR3, multiprocessing_options=self._mp,
        type_handler_registry=registry(array_handler, numpy_handler),
        **self._tree_kwargs, **kwargs)

  # --- save -------------------------------------------------------------------

  async def async_save(self, directory, item=None, save_args=None, args=None):
    """Orbax's save through the plan's writer, plus the CRC32C file."""
    # Orbax's TensorStore specs refuse a relative path ('Checkpoint path
    # should be absolute'): `CheckpointManager('ckpts')` failed its first
    # save, and so does it with Orbax's own handler.  Likewise below.
    directory = storage.absolute(directory)
    if args is None:
      args = SafeSave(item=item, save_args=save_args)
    if args.item is None:
      raise ValueError('Must provide item to save.')
    if isinstance(args.item, (jax.Array, int, float, np.number)):
      raise ValueError('SafePyTreeHandler saves trees; wrap a single array in a dict.')
    item = _standard_leaves(args.item, restore=False)
    # Plain StandardSave args (e.g. Orbax's own code) bring no plan: plan here.
    plan = getattr(args, 'plan', None) or plan_lib.plan_save(
        item, host_ram_budget=self._budget, strategy=self._strategy,
        pay_startup=True,
        save_id=directory, blocking=False)
    ctx = getattr(args, 'context', None) or context_for(plan)
    if plan.strategy == 'streaming':
      array_handler = streaming.StreamingArrayHandler(
          save=ctx, store_zero_size=True, primary_host=self._mp.primary_host,
          use_replica_parallel=jax.process_count() > 1,
          min_slice_bytes_for_replica_parallel=cost.MIN_REPLICA_PARALLEL_BYTES)
      kwargs = dict(use_compression=False, enable_pinned_host_transfer=False)
    else:
      array_handler = orbax_writer.OrbaxArrayHandler(
          save=ctx, use_replica_parallel=plan.orbax.use_replica_parallel,
          primary_host=self._mp.primary_host)
      kwargs = dict(use_compression=plan.orbax.use_compression,
                    enable_pinned_host_transfer=plan.orbax.enable_pinned_host_transfer)
    # Orbax deep-copies numpy leaves against concurrent modification; a
    # streaming save is done with them before `save()` returns.
    numpy_handler = arrays_lib.KdNumpyHandler(deepcopy_host_arrays=plan.strategy == 'orbax')
    impl = self._pytree_handler(array_handler, numpy_handler, **kwargs)
    sums = ctx.checksums
    if sums is not None and jax.process_index() == 0:
      # Orbax writes host values from process 0 only.
      for leaf in tree_lib.leaves(item):
        if isinstance(leaf.value, _HOST_TYPES):
          sums.add_whole(leaf.name, leaf.value, path=leaf.name)
    try:
      futures = await impl.async_save(directory, args=ocp.args.PyTreeSave(
          item=item, save_args=args.save_args, custom_metadata=args.custom_metadata))
    except Exception as e:
      raise _disk_full_or(e, directory) from e
    target = directory.path if hasattr(directory, 'path') else directory
    on_commit = getattr(args, 'on_commit', None)

    fps = ctx.fingerprints

    def finish():
      # Runs once every write of this item is durable, before Orbax's rename.
      if sums is not None:
        sums.write(target, jax.process_index())
      if fps is not None:
        fps.write(target, jax.process_index())
      if on_commit is not None:
        on_commit()

    return [ocp.future.ChainedFuture(list(futures or []), finish)]

  def metadata(self, directory):
    """Orbax's, for a relative path too."""
    return super().metadata(storage.absolute(directory))

  def finalize(self, directory: epath.Path) -> None:
    """Orbax's finalize (OCDBT merge), then checks every array is reachable."""
    directory = storage.absolute(directory)
    finalizer = ocp.BasePyTreeCheckpointHandler(
        use_ocdbt=self._use_ocdbt, use_zarr3=USE_ZARR3, multiprocessing_options=self._mp,
        # Orbax's validation re-opens every key through a 100 MB node cache
        # (+40 MiB at the end of a 1 GB save); `check_arrays_present` lists
        # the keys instead.
        enable_post_merge_validation=False,
        type_handler_registry=registry(arrays_lib.KdArrayHandler(),
                                       arrays_lib.KdNumpyHandler()))
    # When one process wrote straight into the root database
    # (`streaming.ocdbt_subdir`) and no host value needed Orbax's writer,
    # Orbax's merge finds nothing to merge, as intended, and would warn
    # about it on every save.
    nothing_to_merge = self._use_ocdbt and not any(directory.glob('ocdbt.process_*'))
    # A root database before Orbax's merge holds arrays written straight
    # into it (the streaming writer of a single process); arrays that only
    # Orbax merged are where a stock save puts them and are not listed again
    # (~3 ms a save, 30-80 ms at 2,000 leaves).
    written_to_root = self._use_ocdbt and (directory / 'manifest.ocdbt').exists()
    with (_quiet_absl('Skipping merge of OCDBT checkpoints') if nothing_to_merge
          else contextlib.nullcontext()):
      finalizer.finalize(directory)
    if self._use_ocdbt and ocp.multihost.is_primary_host(self._mp.primary_host):
      reuse_lib.prune(directory)
      if written_to_root:
        check_arrays_present(directory)

  # --- restore -----------------------------------------------------------------

  def restore(self, directory, item=None, args=None):
    """Orbax's StandardRestore, reading every array within the budget.

    `args` may also be Orbax's `PyTreeRestore` (its `restore_args`,
    `transforms` and `partial_restore` are passed on as they are), as
    `orbax_scope` hands over the restores of Orbax's PyTree handler.
    """
    if isinstance(item, ocp.args.CheckpointArgs):
      raise ValueError('Pass restore args as `args=`.')
    directory = storage.absolute(directory)
    if args is None:
      args = SafeRestore(item=item)
    # `_METADATA` parsed once: at 10,000 leaves each parse is ~0.1 s.
    params = compat.stored_params(directory)
    # A PyTree restore may ask for part of the tree (`transforms`,
    # `partial_restore`): Orbax's handler checks it against the checkpoint.
    if args.item is not None and not isinstance(args, ocp.args.PyTreeRestore):
      _standard_leaves(args.item, restore=True)
      check_structure(directory, args.item, params)
    budget_spec = budget_lib.parse(getattr(args, 'host_ram_budget', None) or self._budget)
    budget_bytes = budget_lib.resolve(budget_spec, hostmem.probe())
    num_leaves = len([n for n, t in params if t in _STORED_TYPES])
    # A process whose first jit is this restore pays XLA's start-up first
    # (placing pieces compiles): the pieces share what is left.
    # Only jax.Array leaves are placed on devices (programs); a checkpoint of
    # numpy arrays and scalars restores without compiling.
    arrays = any(t == 'jax.Array' for _, t in params)
    # A local restore of jax.Array leaves and scalars leaves it to its fill,
    # which pays it only if it compiles (`reading._pay_compiler`): nothing
    # else of the restore reads then, so the RSS measured is the start-up's.
    # Paid lazily wherever a read compiled, numpy leaves read beside it
    # (b6ddee7), a CI run stalled at 48 MiB (300 s waiting for 3 MiB): the
    # numpy reads were sized for the room before the start-up took its share.
    # A target on device-local layouts compiles relayouts however its leaves
    # are read: paid up front too, where a budget that cannot hold it is
    # refused before paying it (below).
    defer = (arrays and not startup.compiler_started() and not storage.is_remote(directory)
             and not any(t == 'np.ndarray' for _, t in params) and not _reads_numpy(args)
             and not _asks_layouts(args))
    # Likewise a first touch of a bucket (`kd_ckpt.restore` starts the clients
    # before it looks for the checkpoint, and says what that took).
    storage_bytes = getattr(args, 'storage_startup_bytes', 0) + startup.start_storage(directory)
    # Refused whatever XLA's start-up costs: not paid (a fresh process's 16
    # MiB restore of numpy leaves peaked at 58 MiB to be refused), named.
    unpaid_bytes = 0
    if arrays and not defer:
      pending = startup.pending_compiler_bytes()
      if budget_bytes < cost.min_restore_budget_bytes(num_leaves) + storage_bytes + pending:
        unpaid_bytes = pending
    compiler_bytes = startup.start_compiler() if arrays and not defer and not unpaid_bytes else 0
    startup_bytes = compiler_bytes + storage_bytes
    need = cost.min_restore_budget_bytes(num_leaves) + startup_bytes + unpaid_bytes
    if budget_bytes < need:
      named = cost.suggested_budget_bytes(need, startup_bytes + unpaid_bytes)
      if arrays:
        # Above the floor, the placement programs may not fit either: named
        # alone, the floor was refused again by 20 of 56 restores of drawn
        # states refused at 16 MiB (seeds 0-13, saved by stock Orbax, on devices
        # that share and that copy, onto the saved layouts and others).  Priced
        # there instead: leaves opened, programs counted, nothing read.
        named = self._read(directory, args, named, startup_bytes + unpaid_bytes, num_leaves,
                           price_only=True, compiler_pending=defer)
      raise plan_lib.BudgetTooSmallError(
          f'host_ram_budget={budget_spec.text} ({text.format_bytes(budget_bytes)}) is'
          f' below the smallest budget a restore of this checkpoint can honour,'
          f' {text.format_bytes(need)}: a fixed floor of'
          f' {text.format_bytes(cost.FLOOR_BYTES)}, {num_leaves} leaves\' bookkeeping'
          f' ({text.format_bytes(cost.leaves_charge(num_leaves))}) and a few pieces.'
          ' Raise host_ram_budget to'
          f' {text.budget_literal(named)} or more'
          + (' (where the programs placing its pieces on the devices fit too).'
             if named > cost.suggested_budget_bytes(need, startup_bytes + unpaid_bytes)
             else '.')
          + (f' This restore first paid {text.format_bytes(compiler_bytes)} for XLA\'s'
             ' compiler start-up (the first compile of the ops kd_ckpt uses in this'
             ' process): a process that has compiled a training step pays under'
             ' 1 MiB of it, one that compiled only a trivial program ~12 MiB.'
             if compiler_bytes else '')
          + (startup.unpaid_compiler_note(unpaid_bytes) if unpaid_bytes else '')
          + (f' It paid {text.format_bytes(storage_bytes)} to start the storage clients'
             ' (the first gs:// access of this process: gcsfs, TensorStore\'s HTTP'
             ' transport); a process that has touched the bucket before does not.'
             if storage_bytes else ''))
    out = self._read(directory, args, budget_bytes, startup_bytes, num_leaves,
                     compiler_pending=defer)
    hostmem.release_free_memory()
    return out

  def _read(self, directory, args, budget_bytes: int, startup_bytes: int, num_leaves: int,
            price_only: bool = False, compiler_pending: bool = False):
    """The restore at `budget_bytes`; with `price_only`, the least budget
    (at least `budget_bytes`) its pieces and programs fit in, nothing read."""
    capacity = cost.limiter_capacity(budget_bytes) - startup_bytes
    read = arrays_lib.read_context_for(capacity, num_leaves, budget_bytes=budget_bytes,
                                       startup_bytes=startup_bytes, price_only=price_only,
                                       keep_opened=args.item is None,
                                       compiler_pending=compiler_pending)
    impl = self._pytree_handler(arrays_lib.KdArrayHandler(read=read),
                                arrays_lib.KdNumpyHandler(read=read))
    if isinstance(args, ocp.args.PyTreeRestore):
      tree_args = args  # the caller's restore args and transforms, for Orbax's handler
    else:
      restore_args = compat.orbax.construct_restore_args(
          args.item, functools.partial(impl.metadata, directory), args.fallback_sharding,
          args.support_layout)
      if not args.strict:
        restore_args = jax.tree.map(
            lambda a: dataclasses.replace(a, strict=False) if hasattr(a, 'strict') else a,
            restore_args)
      tree_args = ocp.args.PyTreeRestore(item=args.item, restore_args=restore_args)
    with read.limiter.lease(capacity, mmap_threshold_bytes=hostmem.read_mmap_threshold(
        remote=storage.is_remote(directory), capacity_bytes=capacity)):
      try:
        out = impl.restore(directory, args=tree_args)
      except reading.Priced as priced:
        return priced.budget_bytes
    return budget_bytes if price_only else out


def context_for(plan: plan_lib.SavePlan, **kwargs) -> arrays_lib.SaveContext:
  """The save context of a plan: limiter capacity and slices from its budget."""
  kwargs.setdefault('checksums', integrity.collector())
  layout = plan.layout or cost.streaming_layout(plan.budget_bytes, plan.num_leaves)
  return arrays_lib.SaveContext(
      capacity_bytes=max(1, layout.capacity_bytes), slice_bytes=max(1, layout.slice_bytes),
      group_bytes=max(1, layout.group_bytes), budget_slice_bytes=layout.budget_slice_bytes,
      **kwargs)


@ocp.args.register_with_handler(SafePyTreeHandler, for_save=True)
@dataclasses.dataclass
class SafeSave(ocp.args.StandardSave):
  """`StandardSave` for `SafePyTreeHandler`, carrying the save's own inputs.

  Attributes:
    plan: the save's plan (None: the handler plans with its defaults).
    context: limiter capacity, checksum collector, reuse source (None: from
      the plan).
    on_commit: called once this item's writes are durable (the measured
      save's end for async saves).
  """

  plan: plan_lib.SavePlan | None = None
  context: arrays_lib.SaveContext | None = None
  on_commit: Callable[[], None] | None = None


@ocp.args.register_with_handler(SafePyTreeHandler, for_restore=True)
@dataclasses.dataclass
class SafeRestore(ocp.args.StandardRestore):
  """`StandardRestore` for `SafePyTreeHandler`, with the restore's budget.

  Attributes:
    host_ram_budget: the restore's budget (None: the handler's).
    storage_startup_bytes: part of the budget this restore already spent
      starting its storage clients before the handler ran.
  """

  host_ram_budget: budget_lib.BudgetLike | None = None
  storage_startup_bytes: int = 0


def handler_registry(host_ram_budget: budget_lib.BudgetLike = 'auto', *,
                     strategy: str = 'auto', items: Sequence[str] = ('default',)) -> Any:
  """An Orbax handler registry that saves and restores `items` through
  `SafePyTreeHandler`, under Orbax's args as well as kd_ckpt's.

  Orbax's `CheckpointManager` looks a call's handler up by the exact class
  of its args.  A handler given as `item_handlers=` answers only to the args
  registered with its class (`SafeSave`, `SafeRestore`): a loop that saves
  with `ocp.args.StandardSave` or `PyTreeSave` then fails ('does not match
  with any registered handler').  Under this registry it runs unchanged:
  `StandardSave`/`StandardRestore`, `PyTreeSave`/`PyTreeRestore` (restore
  args, transforms, partial restores) and `SafeSave`/`SafeRestore` all go
  to one `SafePyTreeHandler` per item, with `host_ram_budget` and `strategy`.

  Example:

    mgr = ocp.CheckpointManager(d, handler_registry=kd_ckpt.handler_registry('4GiB'))
    mgr.save(step, args=ocp.args.StandardSave(state))     # the loop as it was
    state = mgr.restore(step, args=ocp.args.StandardRestore(abstract_state))

    # Named items (MaxText's 'items'):
    mgr = ocp.CheckpointManager(d, handler_registry=kd_ckpt.handler_registry(
        '4GiB', items=('items',)))
    mgr.save(step, args=ocp.args.Composite(items=ocp.args.PyTreeSave(state)))

  Raises:
    ValueError: a bad budget, strategy or item name, before anything is built.
  """
  items = (items,) if isinstance(items, str) else tuple(items)
  bad = [i for i in items if not isinstance(i, str) or not i]
  if bad or not items:
    raise ValueError(f'items={items!r}: give the CheckpointManager item names as non-empty'
                     " strings, e.g. items=('default',) (a manager's single item) or"
                     " items=('state', 'params').")
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for item in items:
    handler = SafePyTreeHandler(host_ram_budget=host_ram_budget, strategy=strategy)
    for args_cls in (SafeSave, SafeRestore, ocp.args.StandardSave, ocp.args.StandardRestore,
                     ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
      registry.add(item, args_cls, handler)
  return registry


def _reads_numpy(args) -> bool:
  """Whether a restore's target asks for numpy arrays (read by the numpy
  handler, beside the arrays): a numpy leaf in the item, or restore args
  of another restore type."""
  if isinstance(args, ocp.args.PyTreeRestore) and args.restore_args is not None:
    return any(getattr(a, 'restore_type', None) not in (None, jax.Array)
               for a in jax.tree_util.tree_leaves(args.restore_args))
  return any(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(args.item))


def _asks_layouts(args) -> bool:
  """Whether a restore's target names device-local layouts (`Format`s, with
  `support_layout`), which place leaves through relayout programs."""
  if isinstance(args, ocp.args.PyTreeRestore):
    return any(not isinstance(s, (type(None), jax.sharding.Sharding)) for s in (
        getattr(a, 'sharding', None) for a in jax.tree_util.tree_leaves(args.restore_args)))
  return bool(getattr(args, 'support_layout', False)) and any(
      getattr(x, 'format', None) is not None for x in jax.tree_util.tree_leaves(args.item))


def check_structure(directory, target: Any, params=None) -> None:
  """Raises naming the first leaf where `target` and the checkpoint differ.

  Stock Orbax refuses the same targets (its message lists the tree
  difference); this says which leaf, and what to do, before anything is read.
  `params`: `compat.stored_params(directory)`, when the caller has it.
  Linear in the leaves (it runs before every restore of 10,000-leaf states).
  """
  params = compat.stored_params(directory) if params is None else params
  stored = [n for n, t in params if t in _STORED_TYPES]
  # Empty nodes saved (None, optax.MaskedNode, {}) are recorded too; a target
  # leaf there comes back as None, as with stock Orbax.
  recorded = {n for n, _ in params}
  wanted = tree_lib.names(target)
  fix = (f' `python -m kd_ckpt inspect {directory}` lists the saved leaves;'
         ' build the target from them, or pass target=None.')
  missing = [n for n in wanted if n not in recorded]
  if missing:
    raise ValueError(
        f'Structure mismatch: target leaf {missing[0]!r} is not in the checkpoint'
        + (f' (nor {len(missing) - 1} more: {missing[1:4]})' if len(missing) > 1 else '')
        + f'; the checkpoint has {len(stored)} leaves.' + fix)
  # A None in the target skips the saved leaves under it (restored as None).
  skipped = {tree_lib.name_of(kp) for kp, v in jax.tree_util.tree_flatten_with_path(
      target, is_leaf=lambda x: x is None)[0] if v is None}
  wanted = set(wanted)

  def under_skipped(n: str) -> bool:
    # n itself or one of its ancestors ('a.b' for 'a.b.c'; '' is the root).
    parts = n.split('.')
    return any('.'.join(parts[:k]) in skipped for k in range(len(parts) + 1))

  extra = [n for n in stored if n not in wanted and not (skipped and under_skipped(n))]
  if extra:
    raise ValueError(
        f'Structure mismatch: checkpoint leaf {extra[0]!r} is missing from the target'
        + (f' (and {len(extra) - 1} more: {extra[1:4]})' if len(extra) > 1 else '')
        + '; a restore covers every saved leaf.' + fix)


def check_arrays_present(directory) -> None:
  """Raises if an array `_METADATA` lists is not in the root OCDBT database.

  kd_ckpt's streaming writer puts a single process's arrays straight into
  the root database and relies on Orbax's finalize merging only the
  per-process databases *into* it.  If an Orbax upgrade changed that, the
  checkpoint would silently lose arrays: this check makes it loud.
  """
  directory = epath.Path(directory)
  names = [n for n, t in compat.stored_params(directory) if t in _STORED_TYPES]
  if not names:
    return
  kv = ts.KvStore.open(compat.orbax.build_kvstore_tspec(directory.as_posix(), use_ocdbt=True),
                       context=ts.Context({'cache_pool#ocdbt': {
                           'total_bytes_limit': cost.READ_NODE_CACHE_BYTES}})).result()
  keys = {k.decode() for k in kv.list().result()}
  missing = [n for n in names
             if f'{n}/.zarray' not in keys and f'{n}/zarr.json' not in keys]
  if missing:
    raise RuntimeError(
        f'kd_ckpt: after Orbax finalized {directory}, {len(missing)} array(s)'
        f' are missing from its OCDBT database (first: {missing[0]!r}).'
        f' orbax-checkpoint {compat.version("orbax-checkpoint")} merges per-process'
        ' databases differently from the versions kd_ckpt was tested with'
        f' ({compat.TESTED["orbax-checkpoint"]}); this checkpoint is incomplete.'
        ' Pin orbax-checkpoint to a tested version.')


_STORED_TYPES = ('jax.Array', 'np.ndarray', 'scalar')


def _disk_full_or(e: BaseException, directory) -> BaseException:
  """A full disk as kd_ckpt's DiskFullError (an OSError: Kauldron does not retry it)."""
  if isinstance(e, storage.DiskFullError) or not storage.is_disk_full(e):
    return e
  target = directory.path if hasattr(directory, 'path') else directory
  return storage.DiskFullError.during_save(target, None)
