"""Bounded reads: restore stored arrays into any sharding, piece by piece, inside the limiter.

Orbax's own restore reads each target shard whole (and TensorStore decodes
every stored chunk it touches whole), so restoring costs the largest shard
or chunk on top of the restored arrays.  Here each target shard is allocated
on its device(s) once, then filled piece by piece; every host buffer (the
piece, TensorStore's decode of the stored chunks it touches, the device copy
on the CPU backend) is admitted through the host limiter first.  A stored
chunk bigger than a piece (stock Orbax stores a whole shard as one chunk) is
read in byte ranges or through streaming zstd decompression
(`chunkread`), never whole.

Everything else is Orbax's: the tree, the target's types, the shardings
(`_sharding` when the target has none), typed PRNG keys, casts and
`strict=False` padding.  `handler.SafePyTreeHandler` plugs these in as the
`jax.Array` and `np.ndarray` type handlers' `deserialize`.

Example:

  with lim.lease(capacity):
    arrays = await read_arrays(handler, infos, args, ReadContext(lim, 8 << 20))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
from typing import Any, Iterator, Sequence

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from kd_ckpt import chunkread
from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import limiter as limiter_lib
from kd_ckpt import slicing


@dataclasses.dataclass(frozen=True)
class ReadContext:
  """How one restore reads: the limiter, its capacity and the largest piece."""

  limiter: limiter_lib.HostLimiter
  capacity_bytes: int
  piece_bytes: int

  @functools.cached_property
  def ts_context(self) -> ts.Context:
    return read_context()


def read_context() -> ts.Context:
  """One TensorStore context for all the leaves of a read.

  OCDBT reads its manifest and B-tree nodes once per context (a context per
  leaf re-read them: 17 ms/leaf for 10,000 leaves); the node cache is small
  (Orbax's default is 100 MB, outside any budget) and no decoded chunk is
  cached.
  """
  return ts.Context({
      'file_io_concurrency': {'limit': 32},
      'cache_pool': {'total_bytes_limit': 0},
      'cache_pool#ocdbt': {'total_bytes_limit': cost.READ_NODE_CACHE_BYTES},
  })


@functools.lru_cache(maxsize=256)
def _zeros(shape, dtype, device):
  """A jitted zero buffer made on `device` directly.

  `jnp.zeros(shape, device=d)` peaked at 3.4x the buffer here (it is made
  elsewhere, then moved); this at 1.15x.
  """
  return jax.jit(functools.partial(jax.numpy.zeros, shape, dtype),
                 out_shardings=jax.sharding.SingleDeviceSharding(device))


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf, piece, starts):
  return jax.lax.dynamic_update_slice(buf, piece, tuple(starts))


class Source:
  """One stored array, read in pieces through TensorStore or `chunkread`."""

  def __init__(self, name: str, t: ts.TensorStore, kv: ts.KvStore, ctx: ReadContext):
    self.name = name
    self.t = t
    self.ctx = ctx
    self.shape = tuple(int(n) for n in t.shape)
    self.dtype = np.dtype(t.dtype.numpy_dtype)
    grid = t.chunk_layout.read_chunk.shape  # None for 0-d arrays
    chunk = tuple(int(n) for n in grid) if grid is not None else self.shape
    self.chunk_bytes = math.prod(chunk) * self.dtype.itemsize
    # A chunk bigger than a piece is never decoded whole.
    self.stored = None
    if self.chunk_bytes > ctx.piece_bytes:
      self.stored = chunkread.StoredArray.open(kv, name)

  def pieces(self, box: slicing.Box):
    """(sub_box, host array) covering `box` (global, inside the stored domain)."""
    lim = self.ctx.limiter
    if self.stored is not None:
      # chunkread holds at most two pieces and its state at any time.
      charge = 2 * self.ctx.piece_bytes + self.stored.state_bytes(self.ctx.piece_bytes)
      lim.acquire(charge)
      try:
        yield from self.stored.read_pieces(box, self.ctx.piece_bytes)
      finally:
        lim.release(charge)
      return
    # Whole stored chunks, each at most a piece, decoded by TensorStore.
    charge = cost.read_charge(slicing.nbytes(box, self.dtype.itemsize), self.chunk_bytes)
    lim.acquire(charge)
    try:
      data = self.t[box].read().result()
      yield box, data
    finally:
      lim.release(charge)


  @contextlib.contextmanager
  def assembled(self, box: slicing.Box) -> Iterator[np.ndarray]:
    """`box` as one host array, admitted while the caller holds it."""
    shape = tuple(s.stop - s.start for s in box)
    with self.ctx.limiter.hold_sync(slicing.nbytes(box, self.dtype.itemsize)):
      out = np.empty(shape, self.dtype)
      for sub, data in self.pieces(box):
        out[tuple(slice(a.start - b.start, a.stop - b.start) for a, b in zip(sub, box))] = data
        del data
      yield out
      del out


def open_stored(directory, name: str, ctx: 'ReadContext') -> Source:
  """A stored array of a checkpoint by name (zarr or zarr3), for bounded reads."""
  directory = epath.Path(directory)
  kv = ts.KvStore.open(compat.orbax.build_kvstore_tspec(directory.as_posix(), use_ocdbt=True),
                       context=ctx.ts_context).result()
  last = None
  for driver in ('zarr', 'zarr3'):
    try:
      t = ts.open({'driver': driver, 'kvstore': compat.orbax.build_kvstore_tspec(
          directory.as_posix(), name=name, use_ocdbt=True)}, open=True, read=True,
                  context=ctx.ts_context).result()
      return Source(name, t, kv, ctx)
    except ValueError as e:  # Not this zarr version.
      last = e
  raise ValueError(f'Cannot open array {name!r} in {directory}: {last}')


def _shard_groups(shape, sharding) -> dict[tuple, list]:
  """Target shard index -> the addressable devices holding it."""
  groups: dict[tuple, list] = {}
  for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
    key = slicing.pairs(index, shape)
    groups.setdefault(key, []).append(device)
  return groups


def fill_array(src: Source, shape, dtype, sharding, *, strict: bool, name: str,
               reserve=None) -> jax.Array:
  """A jax.Array of `shape` in `sharding`, filled from `src` within the limiter.

  `reserve(nbytes)`, if given, is a context manager each piece is read
  under (Orbax's `restore_concurrent_gb` byte limiter, when the user set one).
  """
  if strict and tuple(shape) != src.shape:
    raise ValueError(
        f'Leaf {name!r}: the requested shape {tuple(shape)} is not compatible with'
        f' the stored shape {src.shape}. Pass a target with the saved shape'
        ' (`python -m kd_ckpt inspect DIR` lists them), or restore with'
        ' strict=False to pad or truncate.')
  dtype = np.dtype(dtype)
  itemsize = max(dtype.itemsize, src.dtype.itemsize)
  piece = src.ctx.piece_bytes
  layout = None
  if not isinstance(sharding, jax.sharding.Sharding):
    # A `Format`: a custom device-local layout, plus the sharding.
    layout, sharding = compat.format_layout(sharding), sharding.sharding
  memory_kind = getattr(sharding, 'memory_kind', None)
  shards = {}
  for key, devices in _shard_groups(shape, sharding).items():
    shard_shape = tuple(b - a for a, b in key)
    placer = _Placer(shard_shape, dtype, devices, key, memory_kind, layout, src.ctx)
    with placer:
      if math.prod(shard_shape):
        grid = slicing.chunk_shape(shard_shape, itemsize, piece)
        for box in slicing.boxes(shard_shape, grid, itemsize, piece):
          glob = slicing.offset(slicing.from_pairs(key), box, shape)
          inside = tuple(slice(s.start, min(s.stop, n)) for s, n in zip(glob, src.shape))
          if any(s.stop <= s.start for s in inside):
            continue  # strict=False: beyond the saved array, stays zero.
          with (reserve(slicing.nbytes(inside, src.dtype.itemsize)) if reserve
                else contextlib.nullcontext()):
            for sub, data in src.pieces(inside):
              placer.place(data, sub)
      shards.update(placer.result())
  arrays = [shards[d] for d in sharding.addressable_devices_indices_map(tuple(shape))]
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


class _Placer:
  """One target shard on its devices, filled piece by piece.

  Placing on a device compiles nothing where it can: XLA keeps every program
  it compiles, 0.7-1.5 MiB of host RAM each (measured), per shape AND device.

    * A shard that comes in one piece is transferred as it is.
    * A shard of up to two pieces, and any shard of another memory kind (e.g.
      `pinned_host`) or with a custom layout, is assembled in one host buffer,
      admitted through the limiter, then transferred.
    * A bigger one is allocated on the first device of its replica group and
      updated in place (the buffer is donated): a zeros and an update program
      per shape and device (the fixed floor covers a few; README, "Limits");
      the group's other devices get device-to-device copies, nothing compiled.
  """

  def __init__(self, shape, dtype, devices, key, memory_kind, layout, ctx):
    self.shape, self.dtype, self.key, self.ctx = shape, dtype, key, ctx
    self.lim = ctx.limiter
    self.memory_kind = memory_kind
    self.layout = layout
    self.devices = devices
    nbytes = math.prod(shape) * dtype.itemsize
    plain = memory_kind in (None, 'device') and layout is None
    self.on_device = plain and nbytes > 2 * ctx.piece_bytes
    # One piece covering the shard: the piece is the staging buffer.
    self.whole_piece = plain and not self.on_device and nbytes <= ctx.piece_bytes
    self.staging = 0
    self.host = None
    self.bufs = None
    self.direct = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.staging:
      self.host = None
      self.lim.release(self.staging)
      self.staging = 0

  def _stage(self) -> None:
    if self.host is None:
      self.staging = math.prod(self.shape) * self.dtype.itemsize
      self.lim.acquire(self.staging)
      self.host = np.zeros(self.shape, self.dtype)

  def place(self, data: np.ndarray, sub: slicing.Box) -> None:
    rel = tuple(slice(s.start - a, s.stop - a) for s, (a, _) in zip(sub, self.key))
    # The piece is already admitted; its cast and its device copy (host RAM
    # on the CPU backend, a staging buffer on GPUs) are admitted here.
    extra = data.nbytes if data.dtype == self.dtype else data.nbytes + data.size * self.dtype.itemsize
    if self.whole_piece and tuple(data.shape) == tuple(self.shape):
      with self.lim.hold_sync(extra):
        host = data if data.dtype == self.dtype else data.astype(self.dtype)
        self.direct = {d: jax.device_put(host, d) for d in self.devices}
        jax.block_until_ready(list(self.direct.values()))
      return
    if not self.on_device:
      self._stage()
      self.host[rel] = data
      return
    starts = np.array([s.start for s in rel], dtype=np.int32)
    with self.lim.hold_sync(extra):
      host = data if data.dtype == self.dtype else data.astype(self.dtype)
      self._allocate()
      d = self.devices[0]
      piece = jax.device_put(host, d)
      self.bufs = _update(self.bufs, piece, starts)
      self.bufs.block_until_ready()  # the piece's copy is gone before release
      del piece

  def _allocate(self) -> None:
    if self.bufs is None:
      d = self.devices[0]
      self.bufs = _zeros(tuple(self.shape), np.dtype(self.dtype), d)()
      self.bufs.block_until_ready()

  def result(self) -> dict:
    if self.direct is not None:
      return self.direct
    if self.on_device:
      self._allocate()  # nothing saved there (strict=False): zeros
      out = {self.devices[0]: self.bufs}
      for d in self.devices[1:]:
        out[d] = jax.device_put(self.bufs, d)
        out[d].block_until_ready()
      return out
    self._stage()  # zero-size, or nothing saved there (strict=False)
    out = {}
    for d in self.devices:
      target = jax.sharding.SingleDeviceSharding(d, memory_kind=self.memory_kind)
      if self.layout is not None:
        target = compat.make_format(self.layout, target)
      out[d] = jax.device_put(self.host, target)
    jax.block_until_ready(list(out.values()))
    return out


def _open(info, ctx: ReadContext, metadata_key) -> tuple[ts.TensorStore, ts.KvStore]:
  spec = compat.orbax.build_array_read_spec(
      info, use_ocdbt=info.is_ocdbt_checkpoint, metadata_key=metadata_key,
      raise_array_data_missing_error=info.raise_array_data_missing_error,
      target_dtype=None).json
  t = ts.open(spec, open=True, context=ctx.ts_context).result()
  kv = ts.KvStore.open(
      compat.orbax.build_kvstore_tspec(info.parent_dir.as_posix(), use_ocdbt=True)
      if info.is_ocdbt_checkpoint else
      compat.orbax.build_kvstore_tspec(info.parent_dir.as_posix(), use_ocdbt=False),
      context=ctx.ts_context).result()
  return t, kv


async def _check_files(infos, handler) -> None:
  """Without OCDBT each array is its own folder: a missing one is FileNotFoundError."""
  for info in infos:
    if not info.is_ocdbt_checkpoint:
      await compat.orbax.assert_parameter_files_exist(
          info.parent_dir / info.name, handler._metadata_key, info.use_zarr3)  # pylint: disable=protected-access


def _orbax_reservation(byte_limiter, loop):
  """Orbax's own byte limiter (`restore_concurrent_gb`), honoured when set.

  It is an asyncio object of the restore's event loop; reads run in a worker
  thread, so reservations are made on that loop.
  """
  if byte_limiter is None or compat.is_unlimited(byte_limiter):
    return None

  @contextlib.contextmanager
  def reserve(nbytes: int):
    asyncio.run_coroutine_threadsafe(byte_limiter.wait_for_bytes(nbytes), loop).result()
    try:
      yield
    finally:
      asyncio.run_coroutine_threadsafe(byte_limiter.release_bytes(nbytes), loop).result()

  return reserve


async def read_arrays(handler, infos, args, ctx: ReadContext) -> list[jax.Array]:
  """`ArrayHandler.deserialize`, bounded: Orbax's semantics, kd_ckpt's memory."""
  if args is None:
    raise ValueError('Must provide ArrayRestoreArgs to restore as jax.Array.')
  ocp.type_handlers.check_input_arguments(infos, args)
  await asyncio.gather(*[info.await_path_creation() for info in infos])
  parent = epath.Path(infos[0].parent_dir)
  await _check_files(infos, handler)
  sharding_file = (parent / compat.orbax.sharding_file_name).exists()
  shardings = await compat.orbax.deserialize_shardings(infos, args, sharding_file)
  loop = asyncio.get_running_loop()

  def read_all():
    out = []
    for info, arg, sharding in zip(infos, args, shardings):
      shape, dtype, sharding = compat.orbax.physical_read_spec(arg, sharding)
      t, kv = _open(info, ctx, handler._metadata_key)  # pylint: disable=protected-access
      src = Source(info.name, t, kv, ctx)
      if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        dtype = src.dtype
      out.append(fill_array(
          src, shape if shape is not None else src.shape, dtype, sharding,
          strict=getattr(arg, 'strict', True), name=info.name,
          reserve=_orbax_reservation(info.byte_limiter, loop)))
    return out

  # Reads block on TensorStore and on the limiter: off the event loop.  The
  # leaves' bookkeeping (specs, open TensorStores, results) is admitted first.
  with ctx.limiter.lease(ctx.capacity_bytes), ctx.limiter.hold_sync(
      cost.leaves_charge(len(infos))):
    out = await asyncio.to_thread(read_all)
  store = handler._array_metadata_store  # pylint: disable=protected-access
  if store is not None:
    metadatas = await store.read(checkpoint_dir=parent)
    if metadatas:
      out = list(compat.orbax.wrap_random_key_data(metadatas, infos, out))
  return out


async def read_numpy(handler, infos, args, ctx: ReadContext) -> list[np.ndarray]:
  """`NumpyHandler.deserialize`, bounded: fills the result in pieces."""
  args = args or [ocp.type_handlers.RestoreArgs()] * len(infos)
  ocp.type_handlers.check_input_arguments(infos, args)
  await asyncio.gather(*[info.await_path_creation() for info in infos])
  await _check_files(infos, handler)

  def read_all():
    out = []
    for info, arg in zip(infos, args):
      t, kv = _open(info, ctx, handler._metadata_key)  # pylint: disable=protected-access
      src = Source(info.name, t, kv, ctx)
      dtype = np.dtype(arg.dtype) if getattr(arg, 'dtype', None) is not None else src.dtype
      result = np.empty(src.shape, dtype)  # the restored value itself
      itemsize = max(dtype.itemsize, src.dtype.itemsize)
      grid = slicing.chunk_shape(src.shape, itemsize, ctx.piece_bytes)
      for box in slicing.boxes(src.shape, grid, itemsize, ctx.piece_bytes):
        for sub, data in src.pieces(box):
          result[sub] = data
      out.append(result)
    return out

  with ctx.limiter.lease(ctx.capacity_bytes), ctx.limiter.hold_sync(
      cost.leaves_charge(len(infos))):
    return await asyncio.to_thread(read_all)
