"""kd_ckpt's `jax.Array` type handlers: what both save strategies share, and the bounded read.

Orbax's PyTree handler hands each type handler the leaves of its type.  kd_ckpt
plugs in a subclass of Orbax's `ArrayHandler` per save (`handler.py` builds it
from the plan; nothing on it changes afterwards):

  * `streaming.StreamingArrayHandler` writes slice by slice inside the
    host limiter;
  * `orbax_writer.OrbaxArrayHandler` writes exactly as stock Orbax does, and
    checksums Orbax's host copies on the way.

Both store typed PRNG keys as Orbax does (key data plus the key impl in the
array metadata), hand leaves that did not change since the previous save to
`reuse`, and restore through `reading` (bounded), so a handler built for a
save also restores.

Example:

  handler = StreamingArrayHandler(save=SaveContext.for_budget(256 << 20))
  registry = handler_lib.registry(handler)   # Orbax's defaults + this one
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import Any, Sequence

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import integrity
from kd_ckpt import limiter as limiter_lib
from kd_ckpt import reading
from kd_ckpt import text
from kd_ckpt import tree as tree_lib


@dataclasses.dataclass
class SaveStats:
  """Counters of one save, shared by its handlers (the report reads them)."""

  bytes_written: int = 0
  slices_written: int = 0
  bytes_reused: int = 0
  leaves_reused: int = 0
  handler_ran: bool = False
  start_secs: float = dataclasses.field(default_factory=time.monotonic)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def __deepcopy__(self, memo) -> 'SaveStats':
    return self  # Shared by a save's handlers (Orbax deep-copies registries).

  def add(self, nbytes: int, nslices: int = 1) -> None:
    with self.lock:
      self.bytes_written += nbytes
      self.slices_written += nslices

  def add_reused(self, nbytes: int, nleaves: int = 1) -> None:
    with self.lock:
      self.bytes_reused += nbytes
      self.leaves_reused += nleaves


@dataclasses.dataclass(frozen=True)
class SaveContext:
  """What one save's array handler needs: a value built per save, never mutated.

  Attributes:
    capacity_bytes: what the host limiter admits during this save.
    slice_bytes: streaming slice (and zarr chunk) size.
    budget_slice_bytes: the slice the budget allows where the state made
      `slice_bytes` smaller (`cost.StreamingLayout`); 0: `slice_bytes`.
    group_bytes: staged bytes per OCDBT transaction (streaming).
    checksums: the CRC32C collector of this save (None: no checksums).
    stats: counters the report reads.
    reuse: the previous checkpoint to reuse unchanged leaves from, or None.
    fingerprints: collects every leaf's fingerprint for the next save's reuse
      (None: reuse off, nothing hashed).
    progress_total_bytes: bytes to write, for the progress lines (0: silent).
    limiter: the process's host limiter.
    rss_ceiling_bytes: the process RSS a streaming save keeps under by
      draining its own commits (the RSS before the save plus its budget,
      less the floor's headroom); None: the RSS at the write's start plus
      `capacity_bytes`.
  """

  capacity_bytes: int
  slice_bytes: int
  group_bytes: int
  checksums: integrity.Checksums | None = None
  stats: SaveStats = dataclasses.field(default_factory=SaveStats)
  reuse: Any = None  # reuse.Source
  fingerprints: Any = None  # reuse.Fingerprints
  progress_total_bytes: int = 0
  limiter: limiter_lib.HostLimiter = dataclasses.field(
      default_factory=limiter_lib.process_limiter)
  rss_ceiling_bytes: int | None = None
  budget_slice_bytes: int = 0

  @classmethod
  def for_budget(cls, budget_bytes: int, num_leaves: int = 0, **kwargs) -> 'SaveContext':
    layout = cost.streaming_layout(budget_bytes, num_leaves)
    return cls(capacity_bytes=layout.capacity_bytes, slice_bytes=layout.slice_bytes,
               group_bytes=layout.group_bytes, **kwargs)


def read_context_for(capacity_bytes: int, num_leaves: int = 0, *, budget_bytes: int = 0,
                     startup_bytes: int = 0, price_only: bool = False,
                     keep_opened: bool = False,
                     compiler_pending: bool = False) -> reading.ReadContext:
  """A restore's reads: pieces sized to what the leaves' bookkeeping leaves.

  `budget_bytes`, `startup_bytes`: the budget behind `capacity_bytes` and
  what the process's start-up took of it, for refusals to name a budget.
  `price_only`: read nothing, raise `reading.Priced` (`ReadContext`).
  `keep_opened`: the leaves a handler opens for their metadata are kept
  for the read (a context of one restore only).
  `compiler_pending`: XLA's compiler start-up is left to the fill, which
  pays it only if it compiles (`reading._pay_compiler`).
  """
  pieces = capacity_bytes - cost.leaves_charge(num_leaves)
  return reading.ReadContext(limiter_lib.process_limiter(), capacity_bytes,
                             cost.restore_piece_bytes(pieces), pieces,
                             budget_bytes=budget_bytes, startup_bytes=startup_bytes,
                             price_only=price_only, opened={} if keep_opened else None,
                             compiler_pending=compiler_pending)


# A leaf this process holds at least this many bytes of, all zero (an
# optimizer's moments before the first step, a LoRA `B` at init), is stored
# zstd-compressed, as Orbax's default stores every leaf: raw chunks of zeros
# cost their full size in disk and write time (40 x 4 MiB of zeros: Orbax
# 0.15 s and 0.02 MB of files; kd_ckpt raw 0.50 s and 168 MB; zstd 0.23 s
# streaming, 0.20 s on Orbax's writer, 0.02 MB: bench/results/
# ab_save_zeros.md).  Both writers look at the bytes once they are on the
# host (`all_zero`): the streaming writer at a leaf's first slice, Orbax's
# at its host copies.
ZSTD_ZERO_LEAVES_FROM_BYTES = 4 << 20
# Scanned for a non-zero byte per step: random data stops at the first.
_ZERO_SCAN_BYTES = 1 << 20


def zstd_if_zero(nbytes: int) -> bool:
  """Whether a leaf of which this process writes `nbytes` is stored zstd if all zero.

  Single-process saves only: the other processes of a job write through the
  metadata the primary host created before any of them saw a byte.
  """
  return jax.process_count() == 1 and nbytes >= ZSTD_ZERO_LEAVES_FROM_BYTES


def all_zero(host: np.ndarray) -> bool:
  """Whether every byte of `host` is 0 (stops at the first non-zero step).

  Example:

    all_zero(np.zeros((1024, 1024), np.float32))   # True, in 1 MiB steps
  """
  if not host.flags.c_contiguous:
    return False  # a strided view (Orbax's replica slice across a minor axis, CPU only): raw
  flat = host.reshape(-1).view(np.uint8)
  if flat.size % 8 == 0 and flat.ctypes.data % 8 == 0:
    flat = flat.view(np.uint64)  # 2x faster per byte than uint8
  if not flat.size:
    return True
  if flat[:512].max():
    return False  # most data: at the first bytes
  # max, not count_nonzero: 0.08 s a GiB here against 0.11-0.13.
  step = _ZERO_SCAN_BYTES // flat.itemsize
  return not any(flat[i:i + step].max() for i in range(0, flat.size, step))


def shards_all_zero(shards: Sequence[jax.Array]) -> bool | None:
  """Whether every byte of these single-device arrays is 0, read in place.

  On the CPU backend a device buffer is host memory and is scanned where it
  lives (`all_zero`: random data stops at its first bytes), so nothing is
  copied; a leaf found zero is written from zero pages (`streaming`),
  checksummed by its length (`integrity.crc32c_zeros`).  None where that
  cannot be told without copying: a dtype narrower than a byte or complex
  (`zero_checkable`), or a shard on an accelerator (`scanned_in_place`;
  the streaming writer runs a program of its own there,
  `streaming._DevicePrograms.any_bit_set`).

  Example:

    shards_all_zero([s.data for s in jnp.zeros((8, 1024)).addressable_shards])
    # True
  """
  for s in shards:
    if not zero_checkable(s.dtype) or not scanned_in_place(s):
      return None
    if not all_zero(np.asarray(s)):  # a view of the device buffer
      return False
  return True


def scanned_in_place(shard: jax.Array) -> bool:
  """Whether `shards_all_zero` can read this shard's buffer in place (the CPU backend)."""
  return next(iter(shard.devices())).platform == 'cpu'


def zero_checkable(dtype) -> bool:
  """Whether a shard of `dtype` can be told zero without copying it (`has_set_bit`)."""
  return _bit_width(dtype) == 8 * np.dtype(dtype).itemsize


def _bit_width(dtype) -> int | None:
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return 8
  if np.issubdtype(dtype, np.complexfloating):
    return None  # no unsigned integer as wide to bitcast to
  try:
    return jax.numpy.iinfo(dtype).bits
  except ValueError:
    pass
  try:
    return jax.numpy.finfo(dtype).bits
  except ValueError:
    return None


def has_set_bit(x: jax.Array) -> jax.Array:
  """Whether any bit of `x` is set (-0.0 counts: its sign bit); traced, on its device.

  The streaming writer compiles it per leaf, kept within its budget
  (`streaming._DevicePrograms`): a jitted copy shared by every caller would
  keep one program per shape, dtype and device for the process's life.
  """
  if x.dtype == jax.numpy.bool_:
    return jax.numpy.any(x)
  uint = {1: jax.numpy.uint8, 2: jax.numpy.uint16, 4: jax.numpy.uint32,
          8: jax.numpy.uint64}[x.dtype.itemsize]
  return jax.numpy.any(jax.lax.bitcast_convert_type(x, uint) != 0)



# Restores through a handler that was not given a budget (e.g. Orbax's own
# tests plugging kd_ckpt in) use this one.
DEFAULT_BUDGET_BYTES = 256 << 20


class KdArrayHandler(ocp.type_handlers.ArrayHandler):
  """Orbax's ArrayHandler with kd_ckpt's shared save prelude and bounded read."""

  @property
  def _options(self):
    """Orbax's options of this handler (replica parallelism, primary host, metadata)."""
    return compat.array_handler_options(self)

  def __init__(self, *, save: SaveContext | None = None,
               read: reading.ReadContext | None = None,
               use_replica_parallel: bool = True, **kwargs):
    kwargs.setdefault('array_metadata_store', compat.orbax.array_metadata_store())
    super().__init__(use_replica_parallel=use_replica_parallel, **kwargs)
    # Orbax's own reader of small leaves, called once per batch of them.
    # Without the array metadata store: with it, every call re-reads the
    # store's file, which lists every leaf (quadratic: 7.8 s instead of 4.3
    # for 3,000 leaves at 100 MiB).  `reading` wraps random keys once.
    self._stock = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=use_replica_parallel,
        **{**kwargs, 'array_metadata_store': None})
    self._save_ctx = save or SaveContext.for_budget(DEFAULT_BUDGET_BYTES)
    self._read_ctx = read or read_context_for(
        cost.limiter_capacity(DEFAULT_BUDGET_BYTES))

  @property
  def save_context(self) -> SaveContext:
    return self._save_ctx

  def stored_values(self, values: Sequence[jax.Array], infos) -> tuple[list[jax.Array], dict]:
    """The arrays as stored: typed PRNG keys become their key data (as Orbax does)."""
    arrays, ext = [], {}
    for v, info in zip(values, infos):
      if jax.process_count() > 1 and isinstance(v, jax.Array) and v.is_fully_addressable:
        raise ValueError(
            f'Leaf {info.name!r} is a host-local jax.Array in a multi-process'
            ' save (e.g. from pmap); every process would write all of it.'
            ' Make it a global array first (see orbax.checkpoint.utils.'
            'fully_replicated_host_local_array_to_global_array).')
      if tree_lib.is_prng_key(v):
        ext[info.name] = {compat.orbax.random_key_impl: str(jax.random.key_impl(v))}
        v = jax.random.key_data(v)
      arrays.append(v)
    return arrays, ext

  def target_subdir(self) -> int | str | None:
    """The OCDBT database this handler writes: None for the root, else the process's."""
    raise NotImplementedError

  async def split_reused(self, arrays, infos, args):
    """(indices to write, reuse job or None): unchanged leaves are not written."""
    ctx = self._save_ctx
    if ctx.fingerprints is None:
      return list(range(len(arrays))), None
    from kd_ckpt import reuse  # pylint: disable=g-import-not-at-top
    del args
    return await reuse.split(self, arrays, infos, ctx)

  async def directories_ready(self, infos) -> None:
    """Before writing into the item's directory (slices, reuse's links): it exists."""
    await directories_created()
    await asyncio.gather(*[info.await_path_creation() for info in infos])

  def note_written(self) -> None:
    self._save_ctx.stats.handler_ran = True

  async def metadata(self, infos):
    """Orbax's `ArrayHandler.metadata`, reading the `_sharding` file once.

    Orbax's opens the file once per leaf and reads each entry in turn (a
    JSON pointer into a 630 KB document at 2,001 leaves).  A restore without
    a target asks for this first: 2,001 leaves restored in 1.52 s against
    2.08 s.  From a bucket TensorStore served those reads with one GET either
    way (`bench/gcs_requests.py`).
    """
    await asyncio.gather(*[info.await_path_creation() for info in infos])
    if infos[0].parent_dir is None:
      raise ValueError('parent_dir cannot be None')
    metadata_key = compat.handler_option(self, 'metadata_key')
    if self._read_ctx.opened is not None:  # a restore's: its read takes them
      stores = await asyncio.to_thread(reading.keep_opened, infos, self._read_ctx, metadata_key)
    else:
      stores = await asyncio.gather(*[
          ts.open(ts.Spec(compat.orbax.build_array_read_spec(
              info, use_ocdbt=info.is_ocdbt_checkpoint, metadata_key=metadata_key,
              raise_array_data_missing_error=info.raise_array_data_missing_error).json),
                  open=True, context=info.ts_context)
          for info in infos])
    exists = await asyncio.to_thread(
        (infos[0].parent_dir / compat.orbax.sharding_file_name).exists)
    strings = await read_sharding_file(infos) if exists else [None] * len(infos)
    parsed = {s: compat.orbax.sharding_from_string(s) for s in set(strings) if s}
    return [compat.orbax.array_metadata_of(t, info, parsed.get(s))
            for t, info, s in zip(stores, infos, strings)]

  async def deserialize(self, infos, args=None):
    # Small leaves `reading` may not read whole go to Orbax's own reader.
    try:
      return await reading.read_arrays(self, infos, args, self._read_ctx,
                                       stock_read=self._stock.deserialize)
    finally:  # kept for this read only, taken or not
      reading.forget_opened(self._read_ctx, infos)


def refuse_zero_size(values, infos, fix: str) -> None:
  """Orbax's refusal of zero-size arrays (its message says 'zero size'), with the fix."""
  for v, info in zip(values, infos):
    if 0 in getattr(v, 'shape', ()):
      raise ValueError(
          f'Leaf {info.name!r} has zero size {tuple(v.shape)}, which Orbax'
          f' cannot save. {fix}')


class KdNumpyHandler(ocp.type_handlers.NumpyHandler):
  """Orbax's NumpyHandler whose restore fills the result in bounded pieces.

  Saves are Orbax's (the value is already host memory); the deep copy Orbax
  makes against concurrent modification is kept only for async saves.
  """

  def __init__(self, *, read: reading.ReadContext | None = None,
               deepcopy_host_arrays: bool = True, **kwargs):
    super().__init__(deepcopy_host_arrays=deepcopy_host_arrays, **kwargs)
    self._read_ctx = read or read_context_for(
        cost.limiter_capacity(DEFAULT_BUDGET_BYTES))

  async def deserialize(self, infos, args=None):
    return await reading.read_numpy(self, infos, args, self._read_ctx)


class Progress:
  """A bounded progress display: at most ~8 INFO lines per save, process 0.

  Silent for saves shorter than `after_secs`.
  """

  def __init__(self, total_bytes: int, *, after_secs: float = 3.0, max_lines: int = 8):
    self.total_bytes = max(1, total_bytes)
    self.after_secs = after_secs
    self.max_lines = max_lines
    self.lines = 0
    self.next_fraction = 0.0
    self.start = time.monotonic()
    self.enabled = jax.process_index() == 0

  def update(self, done_bytes: int) -> None:
    if not self.enabled or self.lines >= self.max_lines:
      return
    elapsed = time.monotonic() - self.start
    frac = done_bytes / self.total_bytes
    if elapsed < self.after_secs or frac < self.next_fraction:
      return
    if self.lines == 0:
      logging.info('kd_ckpt streaming save: %s to write', text.format_bytes(self.total_bytes))
    self.lines += 1
    self.next_fraction = frac + 1.0 / self.max_lines
    logging.info('kd_ckpt streaming save: %5.1f%% %s, %.2f GB/s', 100 * frac,
                 text.format_bytes(done_bytes), done_bytes / 1e9 / max(elapsed, 1e-9))


async def write_sharding_file(shardings: Sequence[jax.sharding.Sharding | None], infos, *,
                              primary_host: int | None) -> None:
  """Orbax's `_sharding` file for these leaves, written as one JSON document.

  The file a stock save writes, byte for byte: one entry per leaf, at the
  JSON pointer Orbax's `get_sharding_tensorstore_spec` names, holding
  `ShardingMetadata.to_serialized_string()`.  Orbax's own writer opens the
  file once per leaf and writes each entry into one transaction; that took
  0.55 s of a 2.5 s save of 2,001 leaves, run after the data, where this
  takes ~50 ms.  Entries already in the file (an earlier call for the same
  item) are read and kept.

  Example:

    await write_sharding_file([a.sharding for a in arrays], infos, primary_host=0)
  """
  await asyncio.gather(*[info.await_path_creation() for info in infos])
  if not ocp.multihost.is_primary_host(primary_host):
    return
  documents: dict[str, tuple[dict[str, Any], Any, dict[str, str]]] = {}
  strings: dict[jax.sharding.Sharding, str | None] = {}  # leaves share a few shardings
  for sharding, info in zip(shardings, infos):
    if sharding is None:
      continue
    if info.parent_dir is None:
      raise ValueError('parent_dir cannot be None')
    if sharding not in strings:
      metadata = compat.orbax.sharding_metadata(sharding)
      strings[sharding] = metadata.to_serialized_string() if metadata is not None else None
    serialized = strings[sharding]
    if serialized is None:
      continue
    where, spec, key = _sharding_entry(info)
    documents.setdefault(where, (spec, info.ts_context, {}))[2][key] = serialized
  for spec, context, entries in documents.values():
    t = await ts.open(spec, open=True, context=context)
    await t.write({**await _read_document(t), **entries})


async def read_sharding_file(infos) -> list[str | None]:
  """Each leaf's entry in its item's `_sharding` file (None: no entry or no file).

  The file is read once; Orbax's `ArrayHandler.metadata` opens it once per
  leaf and reads each entry in turn.
  """
  out, documents = [], {}
  for info in infos:
    if info.name is None:
      out.append(None)
      continue
    where, spec, key = _sharding_entry(info)
    if where not in documents:
      t = await ts.open(spec, open=True, context=info.ts_context)
      documents[where] = await _read_document(t)
    out.append(documents[where].get(key) or None)
  return out


def _sharding_entry(info) -> tuple[str, dict[str, Any], str]:
  """(which file, its whole JSON document's spec, the leaf's key in it)."""
  spec = compat.orbax.sharding_tspec(info.parent_dir.as_posix(), info.name)
  key = _json_pointer_key(spec.pop('json_pointer'))
  return json.dumps(spec['kvstore'], sort_keys=True, default=str), {**spec, 'json_pointer': ''}, key


async def _read_document(t: ts.TensorStore) -> dict[str, Any]:
  """A JSON document's top-level object ({} where there is no file yet)."""
  try:
    doc = (await t.read()).item()
  except ValueError as e:  # TensorStore reports a missing file as NOT_FOUND
    if 'NOT_FOUND' not in str(e):
      raise
    return {}
  return doc if isinstance(doc, dict) else {}


def _json_pointer_key(pointer: str) -> str:
  """'/a~1b' -> 'a/b': the one key a one-level JSON pointer (RFC 6901) names."""
  if not pointer.startswith('/') or '/' in pointer[1:]:
    raise ValueError(f'Expected a one-level JSON pointer, got {pointer!r}: this Orbax'
                     ' version lays out its sharding file differently than kd_ckpt knows.')
  return pointer[1:].replace('~1', '/').replace('~0', '~')


async def directories_created() -> None:
  """Waits until Orbax has created this save's temporary directories.

  An async Orbax save (`CheckpointManager`, hence Kauldron) creates the
  step's and items' `*.orbax-checkpoint-tmp` directories in a background
  thread and hands the handler their paths before they exist.  Stock handlers
  write later, in commit futures that first wait for the directory-creation
  signals of the save's contract.  We write during `serialize`, so we wait for
  the same signals first (as Orbax's composite handler does for blocking
  items).  Without this, TensorStore creates the directory first, and Orbax's
  creator then finds it, deletes it with the arrays already written, and the
  save fails or hangs.  A synchronous save (`kd_ckpt.save`) has no such
  signals: this returns at once.
  """
  operation_id = compat.orbax.current_operation_id()
  signals = compat.orbax.awaitable_signals(operation_id=operation_id)
  if signals:
    await asyncio.to_thread(
        compat.orbax.wait_for_signals, signals,
        timeout_secs=compat.orbax.coordination_timeout(), operation_id=operation_id)
