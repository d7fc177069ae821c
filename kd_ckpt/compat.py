"""The one place kd_ckpt touches Orbax, JAX, TensorStore or Kauldron internals.

Orbax's `_src` is not public API (`orbax/checkpoint/_src/README.md` says so)
and changes with almost every release; the same holds for `jax._src`,
TensorStore's `experimental_*` functions and Kauldron's private names.  Every
such name kd_ckpt uses is looked up here, once, by `_need`, which checks its
shape (a callable with the parameters kd_ckpt passes, an attribute that
exists) and otherwise fails *loudly*, naming the package version and the
symbol:

  kd_ckpt needs orbax.checkpoint._src.serialization.replica_slices.
  transfer_arrays_to_host(arrays, replica_id, use_replica_parallel, ...),
  which orbax-checkpoint 0.13.0 does not have (tested: >=0.12.8,<0.13) ...

Nothing here degrades silently: an internal that moved is an error at import
(Orbax, JAX, TensorStore) or at first use (Kauldron, imported lazily), never a
save that quietly loses its budget.  `tests/test_compat.py` checks every entry.

Example:

  from kd_ckpt import compat
  host_slices = compat.orbax.transfer_arrays_to_host(arrays, 0, True)
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import itertools
import types
from typing import Any, Callable, Sequence

# orbax-checkpoint releases kd_ckpt supports: [lowest, below), as pyproject.toml
# declares.  The lowest runs the core tests in `make test-orbax-lowest`;
# 0.12.0-0.12.6 lack `_physical_read_spec`, 0.12.0-0.12.4 also
# `NumpyHandler(deepcopy_host_arrays=)`.
SUPPORTED_ORBAX = ('0.12.7', '0.13')

# The versions `make test` installs (constraints.txt); a mismatch is not an
# error by itself, a missing symbol is.
TESTED = {
    'orbax-checkpoint': '0.12.8',
    'jax': '0.12.0.1',
    'tensorstore': '0.1.86',
    'kauldron': '1.4.4',
}


class IncompatibleVersionError(ImportError):
  """An internal kd_ckpt relies on is missing or changed shape."""


def version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return 'not installed'


def _need(package: str, module: str, name: str,
          params: Sequence[str] = (), kind: str = 'callable') -> Any:
  """`module.name`, checked: exists, and takes `params` if callable."""
  try:
    obj = importlib.import_module(module)
    for part in name.split('.'):
      obj = getattr(obj, part)
  except (ImportError, AttributeError) as e:
    raise IncompatibleVersionError(_message(package, module, name, params, str(e))) from e
  if kind == 'callable':
    if not callable(obj):
      raise IncompatibleVersionError(
          _message(package, module, name, params, 'it is not callable'))
    if params:
      try:
        sig = inspect.signature(obj)
      except (TypeError, ValueError):
        sig = None
      if sig is not None and not any(
          p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        missing = [p for p in params if p not in sig.parameters]
        if missing:
          raise IncompatibleVersionError(_message(
              package, module, name, params, f'it has no parameter(s) {missing}'))
    if '.' not in name and not isinstance(obj, type):
      return _late_bound(importlib.import_module(module), name, obj)
  return obj


def _late_bound(module: types.ModuleType, name: str, obj: Callable[..., Any]):
  """Calls `module.name` as it is at call time (so patches of it, e.g. in
  Orbax's own tests, apply to kd_ckpt too), with `obj`'s signature checked."""

  @functools.wraps(obj)
  def call(*args, **kwargs):
    return getattr(module, name)(*args, **kwargs)

  return call


def _message(package, module, name, params, why) -> str:
  sig = f'({", ".join(params)})' if params else ''
  return (
      f'kd_ckpt needs {module}.{name}{sig}, and {package} {version(package)}'
      f' does not provide it: {why}. kd_ckpt was tested with {package}'
      f' {TESTED.get(package, "?")}{_range_text(package)}; install that version (pip install'
      f' "{package}=={TESTED.get(package, "")}") or a kd_ckpt release that'
      ' supports yours.')


def _range_text(package: str) -> str:
  if package != 'orbax-checkpoint':
    return ''
  lo, hi = SUPPORTED_ORBAX
  return f' and supports >={lo},<{hi}'


def version_tuple(v: str) -> tuple[int, ...]:
  """'0.12.8' -> (0, 12, 8); non-numeric parts end it ('0.13.0rc1' -> (0, 13, 0))."""
  out = []
  for part in v.split('.'):
    digits = ''.join(itertools.takewhile(str.isdigit, part))
    if not digits:
      break
    out.append(int(digits))
  return tuple(out)


# --- Orbax -------------------------------------------------------------------

_O = 'orbax.checkpoint._src'


def _orbax() -> types.SimpleNamespace:
  n = functools.partial(_need, 'orbax-checkpoint')
  ser = f'{_O}.serialization'
  return types.SimpleNamespace(
      # Device -> host copies of the replica slices a process writes, and the
      # slices themselves (no copy): the unit Orbax writes.
      get_replica_slices=n(f'{ser}.replica_slices', 'get_replica_slices',
                           ('arr', 'replica_id', 'use_replica_parallel')),
      transfer_arrays_to_host=n(
          f'{ser}.replica_slices', 'transfer_arrays_to_host',
          ('arrays', 'replica_id', 'use_replica_parallel', 'enable_pinned_host_transfer')),
      # Orbax's own writer of host replica slices (one OCDBT transaction), so
      # the Orbax strategy writes exactly what stock Orbax writes.
      serialize_replica_slices=n(
          f'{ser}.jax_array_handlers', '_async_serialize_replica_slices',
          ('values', 'infos', 'args', 'primary_host', 'metadata_key',
           'array_metadata_store', 'ext_metadata')),
      deserialize_shardings=n(f'{ser}.jax_array_handlers', '_deserialize_shardings',
                              ('infos', 'args', 'sharding_file_exists')),
      physical_read_spec=n(f'{ser}.jax_array_handlers', '_physical_read_spec',
                           ('arg', 'sharding')),
      wrap_random_key_data=n(f'{ser}.jax_array_handlers', '_wrap_random_key_data',
                             ('array_metadatas', 'infos', 'deserialized_arrays')),
      sharding_file_name=n(f'{ser}.jax_array_handlers', '_SHARDING_FILE_NAME', kind='value'),
      # The `_sharding` file's spec for one leaf (a JSON pointer into one
      # document) and the string stored there: `arrays.write_sharding_file`
      # writes the same document in one write.
      sharding_tspec=n(f'{ser}.tensorstore_utils', 'get_sharding_tensorstore_spec',
                       ('directory', 'param_name')),
      sharding_metadata=n(f'{_O}.metadata.sharding', 'from_jax_sharding', ('jax_sharding',)),
      sharding_from_string=n(f'{_O}.metadata.sharding', 'from_serialized_string',
                             ('serialized_str',)),
      # An opened array's `ArrayMetadata`, as `ArrayHandler.metadata` builds it.
      array_metadata_of=n(f'{ser}.tensorstore_utils', 'array_metadata_from_tensorstore',
                          ('t', 'info', 'sharding')),
      random_key_impl=n(f'{_O}.metadata.array_metadata', 'RANDOM_KEY_IMPL', kind='value'),
      array_metadata_store=n(f'{_O}.metadata.array_metadata_store', 'Store'),
      build_array_write_spec=n(
          f'{ser}.tensorstore_utils', 'build_array_write_spec',
          ('info', 'arg', 'global_shape', 'local_shape', 'dtype', 'use_ocdbt',
           'process_index', 'metadata_key', 'ext_metadata')),
      build_array_read_spec=n(f'{ser}.tensorstore_utils', 'build_array_read_spec',
                              ('info', 'use_ocdbt', 'metadata_key', 'target_dtype')),
      build_kvstore_tspec=n(f'{ser}.tensorstore_utils', 'build_kvstore_tspec',
                            ('directory', 'name', 'use_ocdbt')),
      process_subdir=n(f'{ser}.ocdbt_utils', 'get_process_index_for_subdir', ('use_ocdbt',)),
      assert_parameter_files_exist=n(f'{ser}.tensorstore_utils', 'assert_parameter_files_exist',
                                     ('param_dir', 'metadata_key')),
      # `save/restore_concurrent_gb`: the byte limiters Orbax hands its type
      # handlers (ParamInfo.byte_limiter), honoured by kd_ckpt's too.
      unlimited_bytes=n(f'{ser}.limits', 'UnlimitedInFlightBytes', kind='value'),
      default_type_handlers=n(f'{ser}.type_handler_registry', '_DEFAULT_TYPE_HANDLERS',
                              kind='value'),
      construct_restore_args=n(
          f'{_O}.handlers.standard_checkpoint_handler', '_construct_restore_args',
          ('target', 'metadata', 'fallback_sharding')),
      coordination_timeout=n(f'{_O}.multihost.multihost', 'coordination_timeout'),
      # Async saves create their directories in a background thread and hand
      # handlers the paths first; writes must wait for these signals.
      current_operation_id=n(f'{_O}.futures.synchronization',
                             'OperationIdGenerator.get_current_operation_id'),
      awaitable_signals=n(f'{_O}.futures.future',
                          'AwaitableSignalsContract.get_awaitable_signals_from_contract',
                          ('operation_id',)),
      wait_for_signals=n(f'{_O}.futures.future', 'wait_for_signals',
                         ('receive_signals', 'timeout_secs', 'operation_id')),
      # `_METADATA`'s parser: the stored tree and each leaf's value type,
      # without opening any array (Orbax's public `metadata()` opens all).
      internal_tree_metadata=n(f'{_O}.metadata.tree', 'InternalTreeMetadata.from_json',
                               ('json_dict',)),
      pytree_metadata_file=n(f'{_O}.handlers.base_pytree_checkpoint_handler',
                             'PYTREE_METADATA_FILE', kind='value'),
  )


orbax = _orbax()


def default_type_handler_pairs() -> list[tuple[Any, Any]]:
  """Orbax's default (type, handler) pairs, to swap in kd_ckpt's handlers."""
  pairs = list(orbax.default_type_handlers)
  if not pairs or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
    raise IncompatibleVersionError(_message(
        'orbax-checkpoint', f'{_O}.serialization.type_handler_registry',
        '_DEFAULT_TYPE_HANDLERS', (), 'it is no longer a tuple of (type, handler) pairs'))
  return pairs


def replace_standard_checkpoint_handler(cls: type) -> type:
  """Makes Orbax's `StandardCheckpointHandler` resolve to `cls`; returns the one before.

  Orbax's `StandardCheckpointer` (and its test utilities, when imported)
  look the name up in its defining module; `kd_ckpt.orbax_scope` swaps it.
  """
  return _replace_handler('standard_checkpoint_handler', 'StandardCheckpointHandler', cls)


def replace_pytree_checkpoint_handler(cls: type) -> type:
  """Makes Orbax's `PyTreeCheckpointHandler` resolve to `cls`; returns the one before.

  Orbax's `PyTreeCheckpointer` and `StandardCheckpointHandler` look the name
  up in its defining module; `kd_ckpt.orbax_scope` swaps it.
  """
  return _replace_handler('pytree_checkpoint_handler', 'PyTreeCheckpointHandler', cls)


def _replace_handler(module: str, name: str, cls: type) -> type:
  mod = importlib.import_module(f'{_O}.handlers.{module}')
  if not hasattr(mod, name):
    raise IncompatibleVersionError(_message(
        'orbax-checkpoint', mod.__name__, name, (), 'it is gone'))
  previous = getattr(mod, name)
  setattr(mod, name, cls)
  return previous


def is_unlimited(byte_limiter) -> bool:
  return isinstance(byte_limiter, orbax.unlimited_bytes)


def byte_limit(byte_limiter) -> int | None:
  """The bytes Orbax's byte limiter admits at once; None: no limit.

  Orbax sets `restore_concurrent_gb` to 96 GB unless told otherwise; a
  limit at least the budget never binds, and each reservation is a round
  trip through the restore's event loop.  An unknown limiter counts as 1
  byte (always honoured).
  """
  if byte_limiter is None or is_unlimited(byte_limiter):
    return None
  limit = getattr(byte_limiter, '_max_bytes', None)
  return limit if isinstance(limit, int) and limit > 0 else 1


def async_replica_slice_writer(
    values, infos, args, *, primary_host, metadata_key, array_metadata_store,
    ext_metadata) -> Any:
  """Orbax's coroutine writing host replica slices (stock format, one txn)."""
  return orbax.serialize_replica_slices(
      values, infos, args, primary_host=primary_host, metadata_key=metadata_key,
      array_metadata_store=array_metadata_store,
      enable_replica_parallel_separate_folder=False, use_replica_parallel=True,
      ext_metadata=ext_metadata)


def stored_params(directory) -> list[tuple[str, str]]:
  """(param name, value type) of every stored leaf, from `_METADATA` alone.

  The value type is Orbax's typestr ('jax.Array', 'np.ndarray', 'scalar',
  ...); no array is opened (Orbax's public `metadata()` opens every one, ~1 ms
  a leaf).
  """
  import json  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top

  text = (epath.Path(directory) / orbax.pytree_metadata_file).read_text()
  meta = orbax.internal_tree_metadata(json.loads(text))
  try:
    return [
        ('.'.join(k.nested_key_name for k in e.key_metadata.nested_key_metadata_entries),
         e.value_metadata.value_type)
        for e in meta.tree_metadata_entries
    ]
  except AttributeError as e:
    raise IncompatibleVersionError(_message(
        'orbax-checkpoint', f'{_O}.metadata.tree', 'InternalTreeMetadata', (),
        f'its entries changed shape ({e})')) from e


# --- TensorStore -------------------------------------------------------------

def _tensorstore() -> types.SimpleNamespace:
  n = functools.partial(_need, 'tensorstore')
  return types.SimpleNamespace(
      # Copies keys between OCDBT databases by reference (no data rewritten)
      # when the source lives under the target's base: used to reuse leaves.
      copy_range_to=n('tensorstore', 'KvStore.experimental_copy_range_to',
                      ('target', 'source_range')),
      # Walks OCDBT B-tree nodes: which data files a database references.
      ocdbt_dump=n('tensorstore', 'ocdbt.dump', ('base', 'node')),
  )


tensorstore = _tensorstore()


# --- JAX ---------------------------------------------------------------------

def distributed_client() -> Any:
  """JAX's distributed key-value client (None outside `jax.distributed`)."""
  state = _need('jax', 'jax._src.distributed', 'global_state', kind='value')
  client = getattr(state, 'client', None)
  if client is not None:
    for method in ('key_value_set', 'blocking_key_value_get'):
      if not callable(getattr(client, method, None)):
        raise IncompatibleVersionError(_message(
            'jax', 'jax._src.distributed', f'global_state.client.{method}', (),
            'the distributed client has no such method'))
  return client


def format_layout(fmt: Any) -> Any:
  """The device-local layout of a `jax` Format (renamed across JAX versions)."""
  for name in ('layout', 'device_local_layout'):
    if hasattr(fmt, name):
      return getattr(fmt, name)
  raise IncompatibleVersionError(_message(
      'jax', 'jax.experimental.layout', 'Format.layout', (), 'Format has no layout'))


def shard_map(f, *, mesh, in_specs, out_specs):
  """`jax.shard_map` (`jax.experimental.shard_map.shard_map` before jax 0.7)."""
  params = ('mesh', 'in_specs', 'out_specs')
  try:
    fn = _need('jax', 'jax', 'shard_map', params)
  except IncompatibleVersionError:
    fn = _need('jax', 'jax.experimental.shard_map', 'shard_map', params)
  return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def make_format(layout: Any, sharding: Any) -> Any:
  fmt = _need('jax', 'jax.experimental.layout', 'Format')
  return fmt(layout, sharding)


# Orbax's ArrayHandler keeps its constructor options in private attributes;
# kd_ckpt's handlers (subclasses) and readers need them.  Read here only.
_ARRAY_HANDLER_ATTRS = {
    'replica_id': '_replica_id',
    'use_replica_parallel': '_use_replica_parallel',
    'min_slice_bytes_for_replica_parallel': '_min_slice_bytes_for_replica_parallel',
    'max_replicas_for_replica_parallel': '_max_replicas_for_replica_parallel',
    'primary_host': '_primary_host',
    'array_metadata_store': '_array_metadata_store',
    'metadata_key': '_metadata_key',
    'enable_write_sharding_file': '_enable_write_sharding_file',
}


def array_handler_options(handler: Any) -> types.SimpleNamespace:
  """An Orbax `ArrayHandler`'s options (replica parallelism, primary host, metadata).

  Raises:
    IncompatibleVersionError: this orbax-checkpoint keeps one under another name.
  """
  out = {}
  for name, attr in _ARRAY_HANDLER_ATTRS.items():
    if not hasattr(handler, attr):
      raise IncompatibleVersionError(_message(
          'orbax-checkpoint', type(handler).__module__, f'ArrayHandler.{attr}', (),
          'the handler no longer keeps this option there'))
    out[name] = getattr(handler, attr)
  return types.SimpleNamespace(**out)


def handler_option(handler: Any, name: str) -> Any:
  """One option of an Orbax type handler (e.g. 'metadata_key' of a NumpyHandler too)."""
  attr = _ARRAY_HANDLER_ATTRS[name]
  if not hasattr(handler, attr):
    raise IncompatibleVersionError(_message(
        'orbax-checkpoint', type(handler).__module__, f'{type(handler).__name__}.{attr}', (),
        'the handler no longer keeps this option there'))
  return getattr(handler, attr)


def single_device_arrays(arr: Any) -> list[Any]:
  """A jax.Array's per-device arrays (JAX's `_arrays`; [] where it has none)."""
  return list(getattr(arr, '_arrays', None) or [])


def has_host_cache(arr: Any) -> bool:
  """Whether JAX cached a host copy on `arr` (`_npy_value`)."""
  return getattr(arr, '_npy_value', None) is not None


def drop_host_cache(arr: Any) -> bool:
  """Drops the host copy JAX cached on `arr` (`_npy_value`); False if refused.

  jaxlib 0.12's C++ `ArrayImpl` refuses the assignment: the cache then lives
  until the array does.
  """
  if getattr(arr, '_npy_value', None) is None:
    return False
  try:
    arr._npy_value = None  # pylint: disable=protected-access
    return True
  except (AttributeError, TypeError):
    return False


# --- Kauldron (optional; imported on first use) ------------------------------

@functools.cache
def kauldron() -> types.SimpleNamespace:
  """Kauldron internals used by kd_ckpt's Kauldron glue and CLI."""
  n = functools.partial(_need, 'kauldron')
  return types.SimpleNamespace(
      checkpoint_folder_name=n('kauldron.checkpoints.checkpointer',
                               'CHECKPOINT_FOLDER_NAME', kind='value'),
      # `Checkpointer.save` without Kauldron's retry decorator (3 retries of
      # any ValueError, 5 s apart): kd_ckpt retries with a fresh save itself.
      unretried_save=_unwrapped('kauldron.checkpoints.checkpointer', 'Checkpointer', 'save'),
  )


def _unwrapped(module: str, cls: str, method: str) -> Callable[..., Any]:
  owner = _need('kauldron', module, cls, kind='value')
  fn = getattr(owner, method, None)
  inner = getattr(fn, '__wrapped__', None)
  if inner is None:
    raise IncompatibleVersionError(_message(
        'kauldron', module, f'{cls}.{method}.__wrapped__', (),
        'the method is no longer wrapped by a functools.wraps decorator'))
  return inner


def backends_initialized() -> bool:
  """Whether JAX has started its backends (then XLA_FLAGS no longer apply)."""
  return _need('jax', 'jax._src.xla_bridge', 'backends_are_initialized')()


def set_flag_argv(flag: Any, argv: Sequence[str]) -> None:
  """Points an ml_collections config flag at `argv` instead of `sys.argv`.

  ml_collections' config flag re-reads `--cfg.x` overrides from `sys.argv`
  (its `_sys_argv`); `python -m kd_ckpt plan` may run inside another program.
  """
  if not hasattr(flag, '_sys_argv'):
    raise IncompatibleVersionError(_message(
        'ml_collections', 'ml_collections.config_flags', 'ConfigFlag._sys_argv', (),
        'the config flag no longer keeps its argv'))
  flag._sys_argv = list(argv)  # pylint: disable=protected-access


def check_all() -> dict[str, str]:
  """Looks up every internal now (Kauldron too, if installed); returns versions."""
  _orbax()
  _tensorstore()
  distributed_client()
  if version('kauldron') != 'not installed':
    kauldron()
  return {p: version(p) for p in TESTED}


def call_with_known_kwargs(fn: Callable[..., Any], **kwargs) -> Any:
  """Calls `fn` with the subset of `kwargs` it accepts (optional knobs only)."""
  params = inspect.signature(fn).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return fn(**kwargs)
  return fn(**{k: v for k, v in kwargs.items() if k in params})
