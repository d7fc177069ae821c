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

On the CPU backend a device keeps an aligned host buffer it is given as its
array (`_shares_host_buffers`): there each shard is read whole into the
buffer that becomes its array, with only the read charged, and nothing is
filled in place.

A leaf whose whole read costs no more than one of our pieces is read whole
instead, with its charge held in the limiter: many at once, as one
TensorStore read each and one batched `jax.device_put` (`_read_whole`),
where Orbax's own `ArrayHandler.deserialize` spends ~1.6 ms of Python a
leaf.  Small leaves `_read_whole` may not read (strict=False, a bucket,
other processes' shardings, layouts) are read by Orbax's reader, under its
charge (`_stock_charge`).

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
import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import itertools
import math
import os
import threading
import time
from typing import Any, Iterator, Sequence

from absl import logging
from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from kd_ckpt import chunkread
from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import hostmem
from kd_ckpt import limiter as limiter_lib
from kd_ckpt import plan as plan_lib
from kd_ckpt import readahead
from kd_ckpt import slicing
from kd_ckpt import startup
from kd_ckpt import storage
from kd_ckpt import text


class Priced(Exception):  # pylint: disable=g-bad-exception-name
  """A restore priced, not read (`ReadContext.price_only`): `budget_bytes`
  is the least budget its pieces and placement programs fit in (at least
  the one priced)."""

  def __init__(self, budget_bytes: int):
    super().__init__(budget_bytes)
    self.budget_bytes = budget_bytes


@dataclasses.dataclass(frozen=True)
class ReadContext:
  """How one restore reads: the limiter, its capacity and the largest piece.

  `pieces_capacity_bytes` is what the pieces and placement programs share
  (the capacity less the leaves' bookkeeping; default: the capacity).
  """

  limiter: limiter_lib.HostLimiter
  capacity_bytes: int
  piece_bytes: int
  pieces_capacity_bytes: int = 0
  # Shards filled in place may cut their last piece short (`_partial_tiles`),
  # unless the programs that takes do not fit (`_admit_programs`).
  partial_tiles: bool = True
  # XLA's compiler may not have started in this process: a fill that
  # compiles placement programs starts it first (`_pay_compiler`).
  compiler_pending: bool = False
  # What that start-up took, named in refusals (part of `startup_bytes`).
  compiler_bytes: int = 0
  # `compiler_bytes` is the start-up's estimate, not paid
  # (`startup.pending_compiler_bytes`): a price, or a refusal before paying.
  compiler_estimated: bool = False
  # The restore's host_ram_budget (0: not known), named in refusals: raising
  # it raises `pieces_capacity_bytes` byte for byte.
  budget_bytes: int = 0
  # What of it the process's one-time start-up took (`startup`).
  startup_bytes: int = 0
  # Price the read at `budget_bytes`, read nothing: `read_arrays` raises
  # `Priced` once it knows whether its pieces and programs fit there.
  price_only: bool = False
  # Leaves opened for their metadata (a restore without a target asks for it
  # first), kept for the read (`_open_many` takes them); None: not kept.
  opened: dict | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    if not self.pieces_capacity_bytes:
      object.__setattr__(self, 'pieces_capacity_bytes', self.capacity_bytes)

  @functools.cached_property
  def opened_secs(self) -> float:
    """When this read began (its first ask): what the kvstores cached since
    is fresh enough for it (`chunkread.StoredArray.staleness_bound`)."""
    return time.time()

  @functools.cached_property
  def ts_context(self) -> ts.Context:
    return read_context()


def read_context() -> ts.Context:
  """One TensorStore context for all the leaves of a read.

  OCDBT reads its manifest and B-tree nodes once per context (a context per
  leaf re-read them: 17 ms/leaf for 10,000 leaves); the node cache is small
  (Orbax's default is 100 MB, outside any budget) and no decoded chunk is
  cached.  Local files are read through memory maps: TensorStore's default
  file reads and their conversion to Python bytes ran at 0.4 GB/s from the
  page cache here, mapped reads of <= 4 MiB at 4-5.6 GB/s (copied into the
  destination array); a mapping lasts as long as the bytes read from it.
  """
  return ts.Context({
      'file_io_concurrency': {'limit': 32},
      'file_io_mode': {'mode': 'memmap'},
      'cache_pool': {'total_bytes_limit': 0},
      'cache_pool#ocdbt': {'total_bytes_limit': cost.READ_NODE_CACHE_BYTES},
  })


# --- placement programs -------------------------------------------------------
# Filling a big shard on its device compiles a zeros and an update program.
# XLA keeps every program it compiles (cost.PROGRAM_BYTES of host RAM each):
# a read admits each new one through the limiter, for the rest of the read,
# before compiling it (`_admit_programs`).  Their keys, once compiled:
_COMPILED: set = set()
# Relayouts compile one at a time (`cost.RELAYOUT_COMPILE_BYTES` is held once).
_RELAYOUT_LOCK = threading.Lock()


def _programs_charge(keys) -> int:
  """What `keys` (new programs) are held: relayouts cost more than placements."""
  return cost.programs_charge(len(keys), sum(1 for k in keys if k[0] == 'relayout'))


def _relayout_key(shard_shape, dtype, layout) -> tuple:
  return ('relayout', tuple(int(n) for n in shard_shape), np.dtype(dtype).name, str(layout))


@functools.cache
def _zeros(shape, dtype, sharding):
  """A jitted zero buffer made in `sharding` directly (one program per key).

  `jnp.zeros(shape, device=d)` peaked at 3.4x the buffer here (it is made
  elsewhere, then moved); this at 1.15x.
  """
  return jax.jit(functools.partial(jax.numpy.zeros, shape, dtype), out_shardings=sharding)


def _narrow_float(dtype) -> bool:
  """Whether `dtype` is a float of 8 bits or fewer (`float8_*`, `float4_e2m1fn`).

  XLA:CPU has no arithmetic of their own and runs an update of such a
  buffer through a wider float, over the whole buffer (`_as_bits`).
  """
  dtype = np.dtype(dtype)
  return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating)
              and jax.numpy.finfo(dtype).bits <= 8)


def _as_bits(update):
  """`update(buf, piece, ...)` moving a narrow float's bits as unsigned ints.

  An update only moves bits, but XLA:CPU converts a `float8_*` or
  `float4_e2m1fn` buffer to a wider float and back at every update, the
  whole buffer each time.  A (359, 29, 1999) `float8_e4m3fn` buffer on one
  device: 80 ms an update, 0.2 ms with its bits as `uint8`; `float4_e2m1fn`
  93 ms, 9.6 ms as `uint4` (`int4` itself: 10-12 ms).  A bitcast between
  types of one width is exact.  Wider floats keep their own type: as bits
  their SPMD update copied the whole buffer (`bfloat16` 0.4 ms, 14.6 ms as
  `uint16`).  Measured with a /tmp script, 2026-12-07.
  """

  def run(buf, piece, *rest):
    dtype = np.dtype(buf.dtype)
    if not _narrow_float(dtype):
      return update(buf, piece, *rest)
    bits = jax.numpy.uint8 if jax.numpy.finfo(dtype).bits == 8 else jax.numpy.uint4
    cast = jax.lax.bitcast_convert_type
    return cast(update(cast(buf, bits), cast(piece, bits), *rest), dtype)

  return run


@functools.partial(jax.jit, donate_argnums=0)
@_as_bits
def _update(buf, piece, starts):
  return jax.lax.dynamic_update_slice(buf, piece, tuple(starts))


@functools.cache
def _update_every_shard(sharding: jax.sharding.NamedSharding):
  """One SPMD program writing a piece at the same place in every live shard.

  `live`: one flag a shard (`_live_flags`); a shard whose flag is False
  keeps what it holds, whatever its piece (a filler).  So the shards can be
  filled a few at a time (`_fill_in_place`'s passes) with one program.
  """

  def body(buf, piece, starts, live):
    at = tuple(starts[i] for i in range(buf.ndim))
    kept = jax.lax.dynamic_slice(buf, at, piece.shape)
    return jax.lax.dynamic_update_slice(buf, jax.numpy.where(live.reshape(()), piece, kept), at)

  return jax.jit(jax.shard_map(
      _as_bits(body), mesh=sharding.mesh,
      in_specs=(sharding.spec, sharding.spec, jax.sharding.PartitionSpec(), sharding.spec),
      out_specs=sharding.spec, check_vma=False), donate_argnums=0)


def _live_flags(shape, shard, sharding, keys) -> jax.Array:
  """`_update_every_shard`'s flags: True for the shards whose boxes are `keys`.

  One bool a shard, laid out as the shards are (same sharding, one element
  each).
  """
  flags = np.zeros(tuple(n // s for n, s in zip(shape, shard)), bool)
  for key in keys:
    flags[tuple(a // s for (a, _), s in zip(key, shard))] = True
  return jax.device_put(flags, sharding)


def _stored_chunk(t: ts.TensorStore) -> tuple[int, ...]:
  grid = t.chunk_layout.read_chunk.shape  # None for 0-d arrays
  return tuple(int(n) for n in (grid if grid is not None else t.shape))


# From a local disk, a leaf stored as one zstd chunk of at least this size
# is decoded by `chunkread` even where TensorStore could decode it whole:
# straight into the destination, one stream per leaf.  Leaves of several
# chunks (sharded ones) stay with TensorStore, which reads their shards in
# batches: through chunkread the `sharded` and `mesh2d` states' stock
# restores (16 leaves of 8 chunks of 4 MiB) took 1.24-1.39x Orbax's time,
# against 0.83-1.03x (`bench/shapes.py --states sharded,mesh2d`).  A stock
# checkpoint of 24 leaves of 25-50 MB (1 GB, normal values), 1 CPU device,
# 2 cores, leaves read in two parts (4 alternating reps in one process, a
# scratch script): 0.72-0.76 s against 1.13-1.16 s through TensorStore, at
# 1 and 4 GiB, where a bigger budget had been slower than 256 MiB (1.15 s,
# chunkread).  Raw chunks (kd_ckpt's own) stay with TensorStore: 0.44 s
# against 0.52 s.
STREAM_ZSTD_FROM_BYTES = 4 << 20


def _zstd_chunks(t: ts.TensorStore) -> bool:
  """Whether `t` stores zstd chunks (from its spec, no I/O)."""
  try:
    codec = t.codec.to_json()
  except (ValueError, AttributeError):
    return False
  if isinstance(codec.get('compressor'), dict):  # zarr v2
    return codec['compressor'].get('id') == 'zstd'
  return any(isinstance(c, dict) and c.get('name') == 'zstd'
             for c in codec.get('codecs') or ())


class Source:
  """One stored array, read in pieces through TensorStore or `chunkread`.

  `stream_zstd`: a leaf of one zstd chunk of at least `STREAM_ZSTD_FROM_BYTES`
  is read by chunkread too (local disks: from a bucket its windows are round
  trips).  `ranged_kv` (from a bucket: the checkpoint's kvstore without read
  coalescing): raw chunks of at least `RANGED_FROM_BYTES` are read in byte
  ranges sent together (`ranged`, `_start_host`).
  """

  def __init__(self, name: str, t: ts.TensorStore, kv: ts.KvStore, ctx: ReadContext,
               *, stream_zstd: bool = False, ranged_kv: ts.KvStore | None = None):
    self.name = name
    self.t = t
    self.kv = kv
    self.ctx = ctx
    self.shape = tuple(int(n) for n in t.shape)
    self.dtype = np.dtype(t.dtype.numpy_dtype)
    self.chunk = _stored_chunk(t)
    self.chunk_bytes = math.prod(self.chunk) * self.dtype.itemsize
    # A chunk bigger than a piece is never decoded whole.
    self.stored = None
    self.cursors, self.held_bytes = 1, 0
    if (stream_zstd and self.chunk == self.shape
        and STREAM_ZSTD_FROM_BYTES <= self.chunk_bytes <= ctx.piece_bytes and _zstd_chunks(t)):
      self.stream_chunks()
    elif self.chunk_bytes > ctx.piece_bytes:
      self.stored = chunkread.StoredArray.open(kv, name, staleness_bound=ctx.opened_secs)
      # Its state grows with the piece: read in pieces small enough that
      # pieces, state and the kept decoder stay within what the read set
      # aside for them.
      self.read_bytes = self._read_bytes(1)
      if self.read_bytes is None:
        need = 2 * self.dtype.itemsize + self._state_bytes(1)(self.dtype.itemsize)
        # Pieces are a fifth of what the read has (`cost.restore_piece_bytes`).
        extra = 5 * (-(-(need - cost.CHUNKREAD_STATE_BYTES) // 2) - ctx.piece_bytes)
        raise plan_lib.BudgetTooSmallError(
            f'Leaf {name!r} is stored in chunks bigger than this restore\'s pieces'
            f' ({text.format_bytes(ctx.piece_bytes)}), and reading them in pieces'
            f' holds {text.format_bytes(need)} of decoder state, more than the'
            f' budget leaves for it ({text.format_bytes(2 * ctx.piece_bytes + cost.CHUNKREAD_STATE_BYTES)}).'
            f' Raise host_ram_budget by {-(-extra // cost.MiB)} MiB or more.')

    # From a bucket, big raw chunks are read in byte ranges sent at once
    # (`_start_host`), where TensorStore reads each in one request.
    self.ranged = None
    if (ranged_kv is not None and self.chunk_bytes >= RANGED_FROM_BYTES
        and not _zstd_chunks(t)):
      try:
        self.ranged = chunkread.StoredArray(ranged_kv, name, t.spec().to_json()['metadata'])
      except (NotImplementedError, KeyError, ValueError, TypeError):
        self.ranged = None  # a layout chunkread does not read: TensorStore
      else:
        # A checkpoint does not change while it is restored: the manifest
        # read once serves every range (revalidated, it was a round trip
        # before each: 23-41 of them restoring one 400 MB leaf).
        self.ranged.staleness_bound = ctx.opened_secs

  def stream_chunks(self) -> None:
    """Reads its chunks through chunkread where its state fits beside the
    pieces: a zstd chunk through a decoder kept from piece to piece, a raw
    one in the byte ranges each piece needs; else (or a layout chunkread
    does not read) stays with TensorStore, which reads a whole chunk for
    any part of it.

    A raw leaf of 400 MB over 8 devices, stored in chunks of 25 MB, filled in
    tiles of a thirteenth of a chunk from the GCS emulator at 256 MiB: 5,200
    MB downloaded through TensorStore, thirteen times the leaf.
    """
    if self.stored is not None or self.kv is None:
      return
    try:
      self.stored = chunkread.StoredArray.open(self.kv, self.name,
                                               staleness_bound=self.ctx.opened_secs)
      self.read_bytes = self._read_bytes(1)
    except NotImplementedError:  # a layout chunkread does not read: TensorStore
      self.stored = None
    if self.stored is not None and self.read_bytes is None:
      self.stored = None  # its state does not fit beside the pieces: TensorStore

  def _state_bytes(self, cursors: int):
    return lambda p: self.stored.state_bytes(p) + cursors * self.stored.cursor_bytes(p)

  def _read_bytes(self, cursors: int) -> int | None:
    return cost.chunkread_piece_bytes(self.ctx.piece_bytes, self._state_bytes(cursors),
                                      self.dtype.itemsize)

  def keep_decoders(self, n: int, *, max_read_bytes: int | None = None,
                    room_bytes: int | None = None) -> None:
    """Keeps up to `n` zstd decoders between reads where they fit (else one).

    A read that interleaves `n` stored chunks (every shard's next piece in
    turn) would otherwise decompress each chunk again from its start for
    every piece: time quadratic in the chunk-to-piece ratio.  They fit where
    they and the read's pieces and state stay within what the read set aside
    (`cost.chunkread_piece_bytes`).  Else, given `room_bytes` (what the
    limiter has beside the read's tasks), as many as fit in it: with c of n
    kept, `_fill_in_place` reads the shards in passes of c a reader.
    Reads are in pieces of at most `max_read_bytes` (the reads' boxes: a
    decoder's window grows with the piece).
    """
    if self.stored is None or not self.stored.compressed or self.held_bytes:
      return
    cap = lambda read: read if max_read_bytes is None else max(
        min(read, max_read_bytes), self.dtype.itemsize)
    if n > 1 and (read := self._read_bytes(n)) is not None:
      read, kept = cap(read), n
    else:
      read, kept = cap(self._read_bytes(1)), 1
      if n > 1 and room_bytes is not None:
        kept = max(1, min(n, room_bytes // self.stored.cursor_bytes(read)))
    self.read_bytes, self.cursors = read, kept
    self.stored.max_cursors = kept

  def keeps(self, n: int) -> bool:
    """Whether reading `n` stored chunks in turn restarts no decoder."""
    return self.stored is None or not self.stored.compressed or self.cursors >= n

  def close(self) -> None:
    """Closes the kept decoders and releases what they held."""
    if self.stored is not None:
      self.stored.close()
    if self.held_bytes:
      self.ctx.limiter.release(self.held_bytes)
      self.held_bytes = 0

  def __enter__(self) -> 'Source':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def lane(self) -> 'Source':
    """Another reader of this array, with decoders of its own (for another thread)."""
    other = copy.copy(self)
    other.held_bytes = 0
    if self.stored is not None:
      other.stored = chunkread.StoredArray.open(self.kv, self.name,
                                                staleness_bound=self.ctx.opened_secs)
    return other

  def hold_decoders(self, *, wait: bool = True) -> bool:
    """Admits the decoders kept between reads (held until `close()`).

    `wait=False`: only if they fit now; False if they do not.
    """
    if self.stored is None or not self.stored.compressed or self.held_bytes:
      return True
    need = self.cursors * self.stored.cursor_bytes(self.read_bytes)
    if wait:
      self.ctx.limiter.acquire(need)
    elif not self.ctx.limiter.try_acquire(need):
      return False
    self.held_bytes = need
    return True

  def read_charge(self, box: slicing.Box) -> int:
    """What reading `box` holds at once, beyond the kept decoders (bytes).

    chunkread: two of its pieces (a piece is at most the box's whole rows of
    the stored chunk) and its state; TensorStore: the piece and two chunks.
    """
    if self.stored is None:
      return cost.read_charge(slicing.nbytes(box, self.dtype.itemsize), self.chunk_bytes)
    # chunkread decodes runs of whole rows of a chunk (its trailing axes in C
    # order, leading ones in F order), then cuts them to the box.
    if box and self.stored.order == 'C':
      rows = math.prod([box[0].stop - box[0].start, *self.chunk[1:]])
      piece = min(self.read_bytes, rows * self.dtype.itemsize)
    elif box:
      rows = math.prod([*self.chunk[:-1], box[-1].stop - box[-1].start])
      piece = min(self.read_bytes, rows * self.dtype.itemsize)
    else:
      piece = self.dtype.itemsize
    return 2 * piece + self.stored.state_bytes(self.read_bytes)

  def one_piece(self, box: slicing.Box) -> bool:
    """Whether reading `box` yields a single piece (no host buffer to assemble)."""
    lo = [s.start // c for s, c in zip(box, self.chunk)]
    hi = [(s.stop - 1) // c for s, c in zip(box, self.chunk)]
    if lo != hi:
      return False
    return self.stored is None or slicing.nbytes(box, self.dtype.itemsize) <= self.read_bytes

  def pieces(self, box: slicing.Box, *, prepaid: bool = False, out: np.ndarray | None = None):
    """(sub_box, host array) covering `box` (global, inside the stored domain).

    `prepaid`: the caller holds `read_charge(box)` (and `hold_decoders()`).
    `out` (`box`'s shape, the stored dtype): where the caller assembles it;
    what chunkread decodes straight into it is not yielded.
    """
    lim = self.ctx.limiter
    if self.stored is not None:
      if not prepaid:
        self.hold_decoders()
      # chunkread holds at most two pieces and its state at any time.
      charge = 0 if prepaid else 2 * self.read_bytes + self.stored.state_bytes(self.read_bytes)
      lim.acquire(charge)
      try:
        yield from self.stored.read_pieces(box, self.read_bytes, out=out)
      finally:
        lim.release(charge)
      return
    # Whole stored chunks, each at most a piece, decoded by TensorStore.
    charge = 0 if prepaid else self.read_charge(box)
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
  kv = ts.KvStore.open(storage.without_read_gaps(compat.orbax.build_kvstore_tspec(
      directory.as_posix(), use_ocdbt=True)), context=ctx.ts_context).result()
  last = None
  for driver in ('zarr', 'zarr3'):
    try:
      t = ts.open({'driver': driver, 'kvstore': storage.without_read_gaps(
          compat.orbax.build_kvstore_tspec(directory.as_posix(), name=name, use_ocdbt=True))},
                  open=True, read=True,
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


@dataclasses.dataclass(frozen=True)
class _InPlace:
  """How shards too big for the host are filled on their devices.

  A zeros buffer in `sharding` (the leaf's, every shard at once; or one
  device's, one shard), then one update per piece: the pieces tile a shard
  in whole stored chunks where they fit (`slicing.tile_shape`), all of one
  shape, so two programs.  With `partial`, the last piece along an axis
  the pieces do not divide is cut short (`slicing.tiles`): an update
  program for each piece shape (`_partial_tiles` says when).
  """

  sharding: Any
  shape: tuple[int, ...]       # the buffer: the leaf, or one shard
  shard: tuple[int, ...]
  piece: tuple[int, ...]       # each piece, in one shard
  dtype: np.dtype
  partial: bool = False

  @property
  def programs(self) -> set:
    return {('zeros', self.shape, self.dtype, self.sharding)} | {
        ('update', self.shape, piece, self.dtype, self.sharding)
        for piece in slicing.tile_shapes(self.shard, self.piece, partial=self.partial)}

  def tiles(self):
    return slicing.tiles(self.shard, self.piece, partial=self.partial)


def _partial_tiles(shard, piece, chunk, streamed: bool, whole_chunks: bool = False) -> bool:
  """Whether a shard's last pieces are cut short rather than moved back.

  Moved back, the last piece along an axis overlaps its neighbour; where a
  stored zstd chunk spans both (one chunk per shard, as stock Orbax writes;
  `streamed`), chunkread's decoder has passed the overlap and decodes the
  chunk again from its start.  TensorStore reads whole chunks
  (`whole_chunks`: those of up to a piece): the overlap reads the chunk it
  falls in again.  Bigger raw chunks are read in byte ranges: there the
  overlap costs only itself, and one program is kept.

  `bench/restore_stock.py --leaves 24` on devices that copy
  (KD_CKPT_SHARE_HOST_BUFFERS=0) at 256 MiB: leaves of 10,922 and 10,923
  rows (no divisor near the piece's 2,860, `slicing.even_tile`) in four
  pieces decoded 1,843 MiB for 1,024 and took 2.11-2.20 s; cut short,
  1,024 MiB in 1.46-1.65 s (Orbax: 1.57-1.62 s).  A shorter last piece
  costs one more update program (`cost.PROGRAM_BYTES`, admitted with the
  others).
  """
  return any(int(n) % int(t) and (whole_chunks or (streamed and int(c) > int(t)))
             for n, t, c in zip(shard, piece, chunk))


def _split_format(sharding):
  """(sharding, layout): a `Format` carries a custom device-local layout."""
  if isinstance(sharding, jax.sharding.Sharding):
    return sharding, None
  return sharding.sharding, compat.format_layout(sharding)


def _placement(shape, dtype, itemsize, chunk, sharding, piece_bytes, streamed: bool = False,
               partial_ok: bool = True):
  """(groups, plan): shard box -> devices, and which shards are filled in place.

  plan is an `_InPlace` for the whole leaf (every shard at once), or a dict
  from shard box to an `_InPlace` (None: assembled on the host).  When the
  budget holds whole shards of a plain sharding, `fill_array` reads them
  whole instead, several at once (`_fill_by_shard`).

    * A shard of up to two pieces (one, when pieces are at least
      `IN_PLACE_MIN_PIECE_BYTES`), or of another memory kind (`pinned_host`)
      or a custom layout, is assembled on the host (nothing compiled).
    * Bigger equal shards of a NamedSharding on this process's devices are
      filled together: one SPMD program per leaf shape.  Filled one device
      at a time they would compile two programs per shape AND device.
    * Otherwise (several processes: an SPMD program would need every process
      to run it in step) each is filled on the first device of its replica
      group, whose other devices get device-to-device copies.
  """
  sharding, layout = _split_format(sharding)
  dtype = np.dtype(dtype)
  groups = _shard_groups(shape, sharding)
  plain = layout is None and getattr(sharding, 'memory_kind', None) in (None, 'device')
  extents = {key: tuple(b - a for a, b in key) for key in groups}
  # With big pieces, a shard over one piece is filled in place too: its reads
  # then run in parallel (`readahead`), and two programs are little next to
  # the pieces.  With small ones the programs would crowd out the pieces.
  most = piece_bytes if piece_bytes >= IN_PLACE_MIN_PIECE_BYTES else 2 * piece_bytes
  big = {key: plain and math.prod(e) * dtype.itemsize > most
         for key, e in extents.items()}
  # TensorStore decodes whole chunks (those of up to a piece; bigger ones go
  # to chunkread, which reads byte ranges): a tile holding part of one
  # reads it whole.
  whole_chunks = math.prod(chunk) * itemsize <= piece_bytes
  # Tiles of half a piece: two reads fit in flight, one ahead of the
  # placement of the other (`readahead`).
  piece_bytes = max(piece_bytes // 2, itemsize)
  # XLA:CPU's SPMD update of a narrow float whose shards have replicas held
  # temporaries of most of the devices' bytes, in its own type or as bits
  # (`_as_bits`): a (359, 58, 1999) `float8_e4m3fn` leaf over a 4x2 mesh,
  # P(None, 'b'), 139 MiB (114 MiB as bits) for 166 MB on the devices,
  # `float8_e5m2` 44 MiB; none unreplicated, none for other types.  A
  # restore at 54 MiB peaked at 172 MiB beyond its arrays and took 3 minutes
  # (`tools/fuzz_budget.py --gcs` seed 3034).  Such a leaf is filled a
  # shard at a time, on one device of each replica group, and copied to
  # the others.
  replicated_narrow = _narrow_float(dtype) and any(len(d) > 1 for d in groups.values())
  if (all(big.values()) and len(groups) > 1 and len(set(extents.values())) == 1
      and isinstance(sharding, jax.sharding.NamedSharding) and sharding.is_fully_addressable
      and not replicated_narrow):
    shard = next(iter(extents.values()))
    devices = sum(len(d) for d in groups.values())
    # A step holds every device's copy of its piece (host RAM on the CPU
    # backend) and one host piece: within two of the read's pieces.
    piece_bytes = max(2 * piece_bytes // (devices + 2), itemsize)
    tile = slicing.even_tile(shard, slicing.tile_shape(shard, chunk, itemsize, piece_bytes),
                             chunk)
    return groups, _InPlace(sharding, tuple(shape), shard, tile, dtype, partial_ok and
                            _partial_tiles(shard, tile, chunk, streamed, whole_chunks))

  def tile_of(key):
    e = extents[key]
    tile_bytes = piece_bytes
    if whole_chunks and len(groups[key]) == 1:
      # A whole chunk a tile where one fits a piece, rather than half a
      # chunk a tile, each reading the chunk whole: kd_ckpt's own 1 GiB in
      # 24 leaves (chunks of 21.3 MiB, pieces of 22 MiB) restored on devices
      # that copy at 256 MiB read 96 times in 1.45 s, now 48 in 0.89 s.
      # A task then holds up to a piece (`cost.restore_piece_bytes` sizes
      # pieces for that); fewer run ahead of the placement.
      tile_bytes = max(tile_bytes, math.prod(min(c, n) for c, n in zip(chunk, e)) * itemsize)
    return slicing.even_tile(e, slicing.tile_shape(e, chunk, itemsize, tile_bytes), chunk)

  tiles = {key: tile_of(key) for key in groups if big[key]}
  return groups, {
      key: _InPlace(jax.sharding.SingleDeviceSharding(groups[key][0]), extents[key],
                    extents[key], tiles[key], dtype, partial_ok and
                    _partial_tiles(extents[key], tiles[key], chunk, streamed, whole_chunks))
      if big[key] else None for key in groups}


def _programs(shape, dtype, itemsize, chunk, sharding, streamed, piece_bytes,
              partial_ok: bool = True) -> set:
  """The placement programs a leaf may compile (a leaf read by shard compiles
  none: admitted anyway, as `fill_array` decides that once its source is open)."""
  groups, plan = _placement(shape, dtype, itemsize, chunk, sharding, piece_bytes, streamed,
                            partial_ok)
  plans = [plan] if isinstance(plan, _InPlace) else [p for p in plan.values() if p]
  out = set().union(*(p.programs for p in plans))
  _, layout = _split_format(sharding)
  if layout is not None:  # each shard assembled on the host, then relayed out
    out |= {_relayout_key([b - a for a, b in key], dtype, layout) for key in groups}
  return out


def check_shape(name: str, shape, stored_shape, strict: bool) -> None:
  """Raises naming the leaf when a strict restore asks for another shape."""
  if strict and tuple(shape) != tuple(stored_shape):
    raise ValueError(
        f'Leaf {name!r}: the requested shape {tuple(shape)} is not compatible with'
        f' the stored shape {tuple(stored_shape)}. Pass a target with the saved shape'
        ' (`python -m kd_ckpt inspect DIR` lists them), or restore with'
        ' strict=False to pad or truncate.')


def fill_array(src: Source, shape, dtype, sharding, *, strict: bool, name: str,
               reserve=None, max_lanes: int | None = None,
               batch_reads: bool = False) -> jax.Array:
  """A jax.Array of `shape` in `sharding`, filled from `src` within the limiter.

  `reserve(nbytes)`, if given, is a context manager each piece is read
  under (Orbax's `restore_concurrent_gb` byte limiter, when the user set one).
  `batch_reads`: shards read whole through TensorStore go out in batches of
  what fits at once (`readahead.Task.start`), which TensorStore coalesces
  (from a bucket).  Shards filled in place are read one at a time: batched,
  a 192 MiB leaf of them restored at 128 MiB from the GCS emulator peaked
  at 183-195 MiB beyond its arrays, even with each read charged its stored
  bytes too.
  The placement programs it compiles are admitted by the caller
  (`_admit_programs`).
  """
  check_shape(name, shape, src.shape, strict)
  dtype = np.dtype(dtype)
  itemsize = max(dtype.itemsize, src.dtype.itemsize)
  piece = src.ctx.piece_bytes
  groups, plan = _placement(shape, dtype, itemsize, src.chunk, sharding, piece,
                            _zstd_chunks(src.t), src.ctx.partial_tiles)
  sharding, layout = _split_format(sharding)
  memory_kind = getattr(sharding, 'memory_kind', None)
  plain = layout is None and memory_kind in (None, 'device')
  if plain and (tasks := _by_shard_tasks(src, shape, dtype, groups)):
    return _fill_by_shard(src, shape, dtype, sharding, groups, tasks, reserve, max_lanes,
                          batch_reads)
  # TensorStore decodes a whole chunk for each read: tiles of part of a zstd
  # chunk would decode it once a tile.  Stock Orbax's replica-parallel save
  # splits a replicated shard into chunks of 32 MiB here; filled in place in
  # tiles of 128-256 rows of their 2,048, on devices that copy, a 256 MiB
  # leaf took 1.8-3.2 s at 192 MiB-1 GiB against 0.67 s at 160 MiB, where
  # the chunks were bigger than a piece (chunkread).
  if any(p is not None and _part_of_a_chunk(p, src.chunk)
         for p in (plan.values() if isinstance(plan, dict) else [plan])):
    src.stream_chunks()
  if isinstance(plan, _InPlace):
    return _fill_in_place(src, shape, plan, groups, reserve, max_lanes)
  shards = {}
  for key, devices in groups.items():
    if plan[key] is not None:
      buf = _fill_in_place(src, shape, plan[key], {key: devices[:1]}, reserve, max_lanes)
      shards[devices[0]] = buf
      for d in devices[1:]:
        shards[d] = jax.device_put(buf, d)
        shards[d].block_until_ready()
      continue
    shard_shape = tuple(b - a for a, b in key)
    with _HostShard(shard_shape, dtype, devices, key, memory_kind, layout, src.ctx) as placer:
      # Pieces that land in the staging buffer: chunkread decodes them there.
      # A stock 128 MiB leaf in 8 shards on devices that copy, at 96 MiB (4
      # alternating fresh processes, 3 restores each): median 0.21 s, against
      # 0.30 s through pieces copied in.
      direct = src.stored is not None and src.dtype == dtype and not placer.whole_piece
      if math.prod(shard_shape):
        grid = slicing.read_grid(shard_shape, itemsize, piece)
        for box in slicing.boxes(shard_shape, grid, itemsize, piece):
          inside = _inside(slicing.offset(slicing.from_pairs(key), box, shape), src.shape)
          if inside is None:
            continue  # strict=False: beyond the saved array, stays zero.
          with (reserve(slicing.nbytes(inside, src.dtype.itemsize)) if reserve
                else contextlib.nullcontext()):
            for sub, data in src.pieces(inside, out=placer.staged(inside) if direct else None):
              placer.place(data, sub)
      shards.update(placer.result())
  arrays = [shards[d] for d in sharding.addressable_devices_indices_map(tuple(shape))]
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def _fill_in_place(src: Source, shape, plan: _InPlace, groups, reserve,
                   max_lanes: int | None = None) -> jax.Array:
  """`groups`' shards filled on their devices: zeros, then one update per piece.

  Each step reads the same relative box of the shards of a pass and puts it
  on their devices.  The reads run ahead in worker threads (`readahead`),
  each admitted with its host piece and device copies (host RAM on the CPU
  backend) until the update has run.

  A pass is as many shards as the lanes keep zstd decoders for: one, all
  of them, whatever the budget holds.  Read in turn, piece by piece, a
  stored chunk whose decoder was not kept would be decompressed again from
  its start for every piece (time quadratic in its pieces); in passes each
  is decompressed once.  A step's other shards get a filler piece and keep
  what they hold (`_update_every_shard`'s `live` flags).  The `prime` test
  state's stock checkpoint (8 chunks of 32 MiB) on devices that copy, at
  36 MiB, where one lane keeps 5 decoders: 17.4 s and 884 decoders with
  every shard in turn, 1.5 s and 8 in passes (`bench/fill_passes.py`,
  bench/results/fill_passes.md); from the GCS emulator at 48 MiB, 114 s
  and 4.0 s.
  """
  lim, dtype = src.ctx.limiter, plan.dtype
  every = isinstance(plan.sharding, jax.sharding.NamedSharding)
  update = _update_every_shard(plan.sharding) if every else _update
  piece_nbytes = math.prod(plan.piece) * dtype.itemsize  # the largest
  order = list(plan.sharding.addressable_devices_indices_map(plan.shape))
  keys = list(groups)
  tiles = _chunk_major(list(plan.tiles()), src)
  # A step holds the device copies of its earlier shards' pieces while it
  # waits for the next read: all of them and the largest read must fit.
  # Every tile: with strict=False, one reaching past the saved array also
  # holds a host piece that a tile inside it may not.
  need = max(_read_task_charge(src, g, _inside(g, src.shape), dtype, len(groups[key]))
             for rel in tiles for key in keys
             for g in [slicing.offset(slicing.from_pairs(key), rel, shape)])
  need += sum(len(groups[key]) for key in keys) * piece_nbytes
  lanes = _lanes(src, keys, shape, MAX_READ_LANES if max_lanes is None else max_lanes, need,
                 interleaved=len(tiles) > 1,
                 max_read_bytes=slicing.nbytes(tiles[0], max(dtype.itemsize, src.dtype.itemsize)))
  # Shard j is read by lane j % len(lanes) (`_lanes` checked that they share
  # no stored chunk); a pass gives each lane as many as it keeps decoders for.
  per_pass = _shards_per_pass(lanes, len(keys)) if len(tiles) > 1 else len(keys)
  passes = [range(a, min(a + per_pass, len(keys))) for a in range(0, len(keys), per_pass)]
  tasks = []
  for p, js in enumerate(passes):
    for t, rel in enumerate(tiles):
      for j in js:
        lane = lanes[j % len(lanes)]
        glob = slicing.offset(slicing.from_pairs(keys[j]), rel, shape)
        inside = _inside(glob, src.shape)
        charge = _read_task_charge(lane, glob, inside, dtype, len(groups[keys[j]]))
        read = functools.partial(_read_host, lane, glob, inside, dtype, reserve)
        if p and t == 0 and j < js[0] + len(lanes):
          read = functools.partial(_after_closing_decoders, lane, read)
        # From a bucket, tiles of raw chunks go out in byte ranges, several
        # tiles at once (`_start_host`), not one request after another.
        start = (functools.partial(_start_host, lane, glob, inside, dtype)
                 if _ranged(lane, glob, inside, dtype) else None)
        tasks.append(readahead.Task(j % len(lanes), charge, read, start=start))
  # The filler pieces of the shards outside a pass (on their devices), held
  # for the whole fill: with a pass's own pieces, no more than a step of
  # every shard holds.
  filler_bytes = piece_nbytes * max(
      sum(len(groups[k]) for k in keys) - sum(len(groups[keys[j]]) for j in js)
      for js in passes)
  held_fillers = 0
  try:
    buf = _zeros(plan.shape, dtype, plan.sharding)()
    buf.block_until_ready()
    lim.acquire(filler_bytes)
    held_fillers = filler_bytes
    with readahead.ReadAhead(lim, tasks) as ahead:
      i = 0
      for js in passes:
        live = _live_flags(plan.shape, plan.shard, plan.sharding,
                           [keys[j] for j in js]) if every else None
        idle = [d for j, key in enumerate(keys) if j not in js for d in groups[key]]
        fillers: dict = {}
        for rel in tiles:
          on_devices, held = {}, 0
          tile_nbytes = slicing.nbytes(rel, dtype.itemsize)  # a short last piece's own
          tile_shape = tuple(r.stop - r.start for r in rel)
          if idle and (not fillers or next(iter(fillers.values())).shape != tile_shape):
            fillers.clear()  # a short last piece: fillers of its shape
            zeros = np.zeros(tile_shape, dtype)  # calloc'd: its pages are never touched
            fillers = {d: jax.device_put(zeros, d) for d in idle}
            jax.block_until_ready(list(fillers.values()))
            del zeros
          try:
            for j in js:
              host, charge = ahead.take(i)
              i += 1
              devices = groups[keys[j]]
              try:
                for d in devices:
                  on_devices[d] = jax.device_put(host, d)
                jax.block_until_ready([on_devices[d] for d in devices])
              finally:
                del host  # the read and host piece go; the device copies stay
                dev = len(devices) * tile_nbytes
                lim.release(charge - dev)
                held += dev
            on_devices.update(fillers)
            at = np.array([s.start for s in rel], np.int32)
            if every:
              pieces = jax.make_array_from_single_device_arrays(
                  tuple((r.stop - r.start) * (n // e)
                        for r, n, e in zip(rel, plan.shape, plan.shard)),
                  plan.sharding, [on_devices.pop(d) for d in order])
              buf = update(buf, pieces, at, live)
            else:
              pieces = on_devices.pop(order[0])
              buf = update(buf, pieces, at)
            buf.block_until_ready()  # the pieces' copies are gone before release
            del pieces
          finally:
            on_devices.clear()
            lim.release(held)
          if i % TRIM_EVERY_TASKS < len(js):
            # Pieces below the read's mmap threshold are freed into glibc's
            # arenas (one per thread): give them back as the read goes.
            hostmem.release_free_memory()
        fillers.clear()
  finally:
    lim.release(held_fillers)
    for lane in lanes[1:]:
      lane.close()
  # Compiled now (a leaf read by shard compiles none: `_admit_programs`
  # admits them anyway, and they stay uncounted as compiled).
  _COMPILED.update(plan.programs)
  return buf


def _part_of_a_chunk(plan: _InPlace, chunk) -> bool:
  """Whether `plan`'s tiles hold part of a stored chunk (not whole ones)."""
  return any(t < min(c, n) for t, c, n in zip(plan.piece, chunk, plan.shard))


def _chunk_major(tiles: list[slicing.Box], src: Source) -> list[slicing.Box]:
  """`tiles` of a shard, stored chunk after stored chunk, each in its order.

  A shard of several stored chunks across its tiles' rows (stock Orbax's
  replica-parallel saves split a replicated shard by columns, one chunk a
  replica) read row band after row band would interleave its chunks: with
  a decoder kept for each shard only, each tile restarted one.  Chunk after
  chunk, each is decoded once by one decoder.  (The shard's offset is taken
  as a multiple of the chunk, as Orbax stores it.)
  """
  f = src.stored is not None and src.stored.order == 'F'
  flip = (lambda t: t[::-1]) if f else (lambda t: t)
  return sorted(tiles, key=lambda rel: (
      flip(tuple(r.start // c for r, c in zip(rel, src.chunk))), flip(tuple(r.start for r in rel))))


def _shards_per_pass(lanes: list['Source'], num_shards: int) -> int:
  """How many shards the lanes read in turn without restarting a decoder."""
  per_lane = -(-num_shards // len(lanes))
  if all(lane.keeps(per_lane) for lane in lanes):
    return num_shards
  return len(lanes) * max(1, min(lane.cursors for lane in lanes))


def _after_closing_decoders(lane: 'Source', read):
  """`read()` after `lane` closed the decoders of its last pass's chunks
  (done: a decoder kept past its chunk's end would crowd out the next)."""
  if lane.stored is not None:
    lane.stored.close()
  return read()


def _read_task_charge(lane: Source, glob: slicing.Box, inside, dtype, copies: int) -> int:
  """What one `_read_host` of `glob` holds until placed on `copies` devices.

  Its device copies (host RAM on the CPU backend), its read (prepaid), and
  the host buffer it is assembled in unless one stored piece is it.
  """
  nbytes = slicing.nbytes(glob, dtype.itemsize)
  charge = copies * nbytes
  if _ranged(lane, glob, inside, dtype):  # into a host buffer of its own
    return charge + nbytes + _ranged_charge(lane, inside)
  if inside is None or inside != glob or not lane.one_piece(inside) or lane.dtype != dtype:
    charge += nbytes
  if inside is not None:
    charge += lane.read_charge(inside)
  return charge


def _by_shard_tasks(src: Source, shape, dtype, groups) -> list[tuple] | None:
  """(box, part inside the saved array, charge, shared) per shard, if the
  budget holds whole shards; else None.

  On devices that copy the host shard, a whole-shard read holds it, its read
  and its device copies until they are placed.  Where the devices keep it
  (`_shares_host_buffers`: the CPU backend), the host shard is the restored
  array itself, and only its read is held.  Each may take half of the
  pieces' room, so that one runs ahead of the placement of another.
  """
  room = src.ctx.pieces_capacity_bytes // 2
  out = []
  for key, devices in groups.items():
    glob = slicing.from_pairs(key)
    inside = _inside(glob, src.shape)
    shared = _shares_host_buffers(devices, dtype)
    if shared and _ranged(src, glob, inside, dtype):  # into the array itself
      charge = _ranged_charge(src, inside)
    elif shared:
      charge = _shared_read_charge(src, inside, dtype)
    else:
      charge = _read_task_charge(src, glob, inside, dtype, len(devices))
    if charge > room:
      return None
    out.append((glob, inside, charge, shared))
  return out


@functools.cache
def _adopts(device, dtype: np.dtype) -> bool:
  """Whether `jax.device_put` of an aligned host array onto `device` keeps it.

  XLA's CPU client adopts a host buffer aligned for it instead of copying it
  (device memory is host memory there); not for every dtype (int4 is packed,
  float64 is cast without x64), so it is asked once per device and dtype.
  """
  host = hostmem.zeros_aligned((16,), dtype)
  placed = jax.device_put(host, device)
  placed.block_until_ready()
  return placed.unsafe_buffer_pointer() == host.ctypes.data


def _check_kept(host: np.ndarray, placed) -> None:
  """Stops sharing for the rest of the process if a device copied an
  aligned host shard it was expected to keep (the probe was wrong).

  Only the shards then in flight were charged too little; every later read
  charges host shards as copies.
  """
  global SHARE_HOST_BUFFERS
  # `host` is aligned: a shared read's buffer always is (`_read_host`).
  if all(a.unsafe_buffer_pointer() == host.ctypes.data for a in placed) or not SHARE_HOST_BUFFERS:
    return
  SHARE_HOST_BUFFERS = False
  logging.warning(
      'kd_ckpt: %s copied an aligned host buffer that its backend had kept when'
      ' asked; restores in this process now charge host shards as copies. Set'
      ' KD_CKPT_SHARE_HOST_BUFFERS=0 to start that way.', placed[0].sharding)


def _shares_host_buffers(devices, dtype) -> bool:
  """Whether the host shard put on `devices` becomes their arrays' memory."""
  return SHARE_HOST_BUFFERS and all(
      d.platform == 'cpu' and _adopts(d, np.dtype(dtype)) for d in devices)


def _shared_read_charge(src: Source, inside, dtype) -> int:
  """What reading a shard into its shared host buffer holds beyond the buffer.

  chunkread yields bounded pieces of any box; a TensorStore read goes in
  boxes of at most a piece (`_read_host`'s `shared`).  Zeros beyond the saved
  array are the restored array's own.
  """
  if inside is None:
    return 0
  if src.stored is not None:
    return src.read_charge(inside)
  itemsize = max(src.dtype.itemsize, np.dtype(dtype).itemsize)
  return cost.read_charge(min(src.ctx.piece_bytes, slicing.nbytes(inside, itemsize)),
                          src.chunk_bytes)


def _fill_by_shard(src: Source, shape, dtype, sharding, groups, tasks, reserve,
                   max_lanes: int | None = None, batch_reads: bool = False) -> jax.Array:
  """Every shard read whole into one host buffer and put on its devices.

  Reads run ahead in worker threads (`readahead`), each admitted with its
  charge (`_by_shard_tasks`).  Nothing is compiled, no zeros or update pass
  is paid, and a bigger budget has more shards read at once.  The host
  buffers are aligned (`hostmem.empty_aligned`): on the CPU backend the
  device arrays share them, as Orbax's restore does.
  """
  lim = src.ctx.limiter
  keys = list(groups)
  batch_reads = batch_reads and _batchable(src, reserve)
  lanes = _lanes(src, keys, shape, 1 if batch_reads else MAX_READ_LANES if max_lanes is None
                 else max_lanes, max(t[2] for t in tasks), interleaved=False)
  work = []
  for j, (glob, inside, charge, shared) in enumerate(tasks):
    work.append(_task(j % len(lanes), charge, lanes[j % len(lanes)], glob, inside, dtype,
                      reserve, shared=shared, batch_reads=batch_reads))
  shards = {}
  try:
    with readahead.ReadAhead(lim, work) as ahead:
      for j, key in enumerate(keys):
        host, charge = ahead.take(j)
        try:
          for d in groups[key]:
            shards[d] = jax.device_put(host, d)
          jax.block_until_ready([shards[d] for d in groups[key]])
          if tasks[j][3]:  # shared: the devices were to keep it
            _check_kept(host, [shards[d] for d in groups[key]])
        finally:
          del host  # placed: the restored array's now, outside the budget
          lim.release(charge)
        if j % TRIM_EVERY_TASKS == TRIM_EVERY_TASKS - 1:
          hostmem.release_free_memory()
  finally:
    for lane in lanes[1:]:
      lane.close()
  arrays = [shards[d] for d in sharding.addressable_devices_indices_map(tuple(shape))]
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def _inside(glob: slicing.Box, stored_shape) -> slicing.Box | None:
  """The part of `glob` inside the stored array (strict=False); None if none."""
  inside = tuple(slice(s.start, min(s.stop, n)) for s, n in zip(glob, stored_shape))
  return inside if all(s.stop > s.start for s in inside) else None


# Batches of small leaves read by Orbax's own reader at once, at most.
STOCK_BATCHES_IN_FLIGHT = 3
# Pieces from which a shard of over one piece is filled in place.
IN_PLACE_MIN_PIECE_BYTES = 16 << 20
# How often (in tasks read) a read trims glibc's arenas (~1 ms each).
TRIM_EVERY_TASKS = 16
# KD_CKPT_SHARE_HOST_BUFFERS=0, an escape hatch and a test switch: every
# restore charges host shards as if their devices copied them (as GPUs do).
SHARE_HOST_BUFFERS = os.environ.get('KD_CKPT_SHARE_HOST_BUFFERS', '1') != '0'
# Leaves read at once from a bucket, where `_side_by_side`.  The Gemma-like
# state through a 20 ms link (its small leaves read whole, /tmp timeline
# script, 4 alternating pairs): 3.76-4.04 s at 8 against 4.06-4.34 s at 4;
# 16 gave 3.84-3.93 s.
LEAVES_IN_FLIGHT = 8
# From a bucket, raw chunks of at least RANGED_FROM_BYTES are read in byte
# ranges of at most RANGE_BYTES, all sent at once (`Source.ranged`).
RANGED_FROM_BYTES = 4 << 20
RANGE_BYTES = 2 << 20
# Reader threads of one leaf at most: zstd decoding releases the GIL, and
# reads beyond the cores only contend.
MAX_READ_LANES = max(1, min(os.cpu_count() or 1, 4))
# Leaves read side by side from a local disk, each in its own part of the
# budget (`_fill_in_parts`), at most; a part is at least `MIN_PART_BYTES`
# (pieces of 1.25 MiB, `cost.restore_piece_bytes`).  The 24-leaf stock
# checkpoint of `bench/restore_stock.py --leaves 24` (1 GiB), 4 alternating
# reps in one process (a scratch script): at 128 MiB 0.71-0.83 s in two
# parts, against 1.25-1.66 s in one (parts of at least 80 MiB).  Parts of
# at least 32 MiB left one part at 64 MiB and below; at least 8 MiB, two
# (5 alternating reps, /tmp script, 2026-12-06): at 64 MiB 1.20 s against
# 1.87 s (1.15-1.26 s with parts of 12-16 MiB), at 48 MiB 1.25 s against
# 2.01 s.
MAX_LEAF_PARTS = max(1, min(os.cpu_count() or 1, 8))
MIN_PART_BYTES = 8 << 20


def _lanes(src: Source, keys, shape, max_lanes: int, task_bytes: int, *,
           interleaved: bool = True, max_read_bytes: int | None = None) -> list[Source]:
  """The readers of one leaf's shards: `src` and, where they fit, more.

  Shard j is read by lane j % len(lanes).  `interleaved`: in tile order
  (every shard's next piece in turn), so a lane keeps a decoder for each of
  its shards (`Source.keep_decoders`); else shard after shard, one decoder a
  lane.  Lanes beyond the first need their own decoders (chunkread), and
  must not share a stored chunk (each would decode it from its start).
  Decoders are held until the leaf is read, so n lanes are used only if,
  with all their decoders held, `task_bytes` (what the caller holds at once
  while it waits for a read, with that read) still fits: else that read
  would wait for bytes nothing releases until the leaf is read (a deadlock
  the limiter only reports after `STALL_SECS`).

  The most lanes whose decoders all fit are used, down to `src` alone; where
  it cannot keep them either, `src` alone with as many as the limiter has
  room for (at least 2); else the most lanes that fit, with fewer decoders
  than shards (`_fill_in_place` then fills the shards in passes of as many
  as the lanes keep decoders for).  Before,
  `src` alone kept the planned lanes' share: the `many_small` state's big
  leaf (8 zstd shards of 29 MiB from stock Orbax) restored at 144 MiB on
  devices that copy kept 4 decoders for 8 shards, restarted one for every
  read, and took 10.4 s; with 8 decoders 0.8 s.
  """
  per = lambda n: -(-len(keys) // n) if interleaved else 1
  plans = [n for n in range(max(1, min(max_lanes, len(keys))), 1, -1)
           if src.stored is None or _disjoint_chunks(src, keys, shape, n)]
  keep = dict(max_read_bytes=max_read_bytes)
  for n in plans:
    if (lanes := _open_lanes(src, n, per(n), task_bytes, True, **keep)) is not None:
      return lanes
  src.keep_decoders(per(1), **keep)
  if src.keeps(per(1)):
    src.hold_decoders()
    return [src]
  # The envelope of `cost.chunkread_piece_bytes` is sized for pieces that
  # the reads of small tiles leave mostly unused: as many decoders as the
  # limiter has room for beside a task.  The `many_small` state's big leaf
  # (8 shards) on devices that copy, one fresh process each: at 139 MiB
  # 20 s with one decoder, 4.9 s with 7; at 133 MiB 38 s, 26 s with 4.
  lim = src.ctx.limiter
  src.keep_decoders(per(1), room_bytes=(lim.capacity_bytes or 0) - lim.in_use_bytes - task_bytes,
                    **keep)
  if src.cursors > 1 and src.hold_decoders(wait=False):
    return [src]
  for n in plans:
    if (lanes := _open_lanes(src, n, per(n), task_bytes, False, **keep)) is not None:
      return lanes
  src.keep_decoders(1, **keep)
  src.hold_decoders()
  return [src]


def _open_lanes(src: Source, n: int, per_lane: int, task_bytes: int,
                keep_all: bool, **keep) -> list[Source] | None:
  """`src` and n - 1 more lanes holding `per_lane` decoders each where they
  fit (`keep_all`: else None), if a task of `task_bytes` still fits beside
  them all; else None, with nothing held (`src` stays open).  `keep`:
  `Source.keep_decoders`'s options."""
  lanes = [src]
  src.keep_decoders(per_lane, **keep)
  fits = (src.keeps(per_lane) or not keep_all) and src.hold_decoders(wait=False)
  while fits and len(lanes) < n:
    lanes.append(src.lane())
    lanes[-1].keep_decoders(per_lane, **keep)
    fits = (lanes[-1].keeps(per_lane) or not keep_all) and lanes[-1].hold_decoders(wait=False)
  if fits:
    try:
      fits = src.ctx.limiter.try_acquire(task_bytes)  # a task still fits beside them?
    except limiter_lib.RequestTooLargeError:
      fits = False  # more than the whole capacity
    if fits:
      src.ctx.limiter.release(task_bytes)
      return lanes
  for lane in lanes:
    lane.close()  # releases what it held
  return None


def _side_by_side(t: ts.TensorStore, ctx: ReadContext, shape, dtype, sharding, reserve,
                  ranged_kv: ts.KvStore | None = None) -> bool:
  """Whether `fill_array` fills this leaf from whole-shard reads that hold
  nothing between its tasks (no kept decoders, programs or Orbax limiter):
  such leaves may be filled side by side (`_fill_side_by_side`).

  Each task fits half the room (`_by_shard_tasks`), and every byte held is
  a task's, released once its read ends and its shard is placed: a leaf
  that waits for bytes waits only for reads in flight.
  """
  sharding, layout = _split_format(sharding)
  if (reserve is not None or layout is not None
      or getattr(sharding, 'memory_kind', None) not in (None, 'device')):
    return False
  stored = np.dtype(t.dtype.numpy_dtype)
  if math.prod(_stored_chunk(t)) * stored.itemsize > ctx.piece_bytes:
    return False  # read by chunkread, whose decoders are held for the leaf
  src = Source('', t, None, ctx, ranged_kv=ranged_kv)
  tasks = _by_shard_tasks(src, shape, np.dtype(dtype), _shard_groups(shape, sharding))
  # And every read batched (`_task`): reads run alone, in several lanes at
  # once, held more than their charges.
  return tasks is not None and all(
      inside is None or _batched_charge(src, glob, inside, dtype, shared, charge) is not None
      for glob, inside, charge, shared in tasks)


def _fill_side_by_side(fill, leaves) -> None:
  """`fill(j)` for every j of `leaves`, `LEAVES_IN_FLIGHT` at a time.

  From a bucket each request waits for the network before its bytes come:
  one leaf at a time, a leaf's reads ended before the next leaf's began.
  Restoring the Gemma-like state (1.1 GB) through a proxy that gave each
  request 20 ms and each connection 200 MB/s (/tmp script), its 32 leaves
  of 12 MiB took 0.12-0.27 s each, 5.2 s of a 8.6 s restore (Orbax: 4.2-6.7
  s).  The limiter bounds them together, as it bounds one.
  """
  with concurrent.futures.ThreadPoolExecutor(
      LEAVES_IN_FLIGHT, thread_name_prefix='kd_ckpt-leaf') as pool:
    futures = [pool.submit(fill, j) for j in leaves]
    try:
      for f in futures:
        f.result()
    except BaseException:
      for f in futures:
        f.cancel()
      raise


def _parts_can_read(leaves, piece_bytes: int, staleness_bound: float | None = None) -> bool:
  """Whether pieces of `piece_bytes` read every leaf (`fill_all`'s tuples).

  A chunk bigger than a piece is read by chunkread, whose decoder window
  does not shrink with the piece: a zstd frame of a big window (a high
  level) may need more than a part's pieces leave for it, where the whole
  budget's did (`Source` refuses it), or a layout chunkread does not read.
  Then the leaves are read one after another, with the whole room.
  """
  for info, _, t, kv, *_ in leaves:
    stored_itemsize = np.dtype(t.dtype.numpy_dtype).itemsize
    if math.prod(_stored_chunk(t)) * stored_itemsize <= piece_bytes:
      continue
    try:
      stored = chunkread.StoredArray.open(kv, info.name, staleness_bound=staleness_bound)
    except NotImplementedError:
      return False
    try:
      if cost.chunkread_piece_bytes(
          piece_bytes, lambda p, s=stored: s.state_bytes(p) + s.cursor_bytes(p),
          stored_itemsize) is None:
        return False
    finally:
      stored.close()
  return True


def _fill_in_parts(fill, num_leaves: int, parts: int, read: ReadContext,
                   part_bytes: int, max_lanes: int) -> None:
  """`fill(j, part_ctx, max_lanes)` for every leaf, `parts` leaves at a time.

  One leaf's stored chunk is decoded by one stream (TensorStore or
  chunkread), and a leaf of one shard is read by one lane: leaf after leaf,
  a restore of a stock checkpoint used one core.  Here `parts` threads each
  read leaves in turn (the next one not yet taken), each in a limiter
  carved from the read's (`HostLimiter.carve`): they share the budget, and
  none waits for bytes that another holds.  `python bench/restore_stock.py
  --leaves 24` (1 GiB in 24 leaves on one device, 2 cores): 1.15 s at 256
  MiB and 0.95 s at 1 GiB against Orbax's 1.44 s, from 2.73 s and 2.50 s
  leaf after leaf (with `STREAM_ZSTD_FROM_BYTES`).  On a 16-core GPU host
  (8 parts, before `STREAM_ZSTD_FROM_BYTES`) a 4 GB stock checkpoint of 24
  leaves restored in 2.8-3.0 s at 1 GiB, from 10.1 s
  (bench/results/gpu_profile.md).
  """
  taken = itertools.count()
  failed = threading.Event()

  def run_part(limiter):
    ctx = dataclasses.replace(read, limiter=limiter, capacity_bytes=part_bytes,
                              pieces_capacity_bytes=part_bytes)
    ctx.__dict__['ts_context'] = read.ts_context  # one OCDBT node cache
    while not failed.is_set() and (j := next(taken)) < num_leaves:
      try:
        fill(j, ctx, max_lanes)
      except BaseException:
        failed.set()
        raise

  with contextlib.ExitStack() as stack:
    # The first part waits for its bytes, as a read does; the others are
    # carved only if theirs are free now (another restore may hold them:
    # waiting for those would see no release while this one reads).
    limiters = [stack.enter_context(read.limiter.carve(part_bytes))]
    for _ in range(1, parts):
      if (more := stack.enter_context(read.limiter.carve(part_bytes, wait=False))) is None:
        break
      limiters.append(more)
    if len(limiters) == 1:
      run_part(limiters[0])
      return
    with concurrent.futures.ThreadPoolExecutor(
        len(limiters), thread_name_prefix='kd_ckpt-part') as pool:
      futures = [pool.submit(run_part, lim) for lim in limiters]
      for f in futures:
        f.result()


def _disjoint_chunks(src: Source, keys, shape, n: int, limit: int = 4096) -> bool:
  """Whether no stored chunk is read by two lanes (shard j on lane j % n)."""
  owner: dict[tuple, int] = {}
  for j, key in enumerate(keys):
    inside = _inside(slicing.from_pairs(key), src.shape)
    if inside is None:
      continue
    ranges = [range(s.start // c, (s.stop - 1) // c + 1) for s, c in zip(inside, src.chunk)]
    if math.prod(len(r) for r in ranges) > limit:
      return False
    for g in itertools.product(*ranges):
      if owner.setdefault(g, j % n) != j % n:
        return False
  return True


def _read_into(view: ts.TensorStore, out: np.ndarray, batch: ts.Batch | None = None):
  """Starts TensorStore's read of `view` straight into `out` (a numpy array
  or view of `view`'s shape and dtype); returns its future.

  A plain read returns a buffer of TensorStore's own (not aligned for the
  CPU devices to keep), which was then copied into the host piece: two
  fresh buffers and a copy per byte.  Read into the piece, it is one.
  384 MiB of raw 3 MiB chunks from the page cache, 12 MiB reads (a /tmp
  script, 3 alternating reps after a warm-up): 0.11-0.13 s and 0.13-0.18 s
  of system time, against 0.23-0.27 s and 0.30-0.35 s read and copied.
  """
  return ts.array(out, copy=False, write=True).write(
      view.translate_to[(0,) * out.ndim] if out.ndim else view, batch=batch)


def _read_host(src: Source, glob: slicing.Box, inside: slicing.Box | None, dtype,
               reserve, *, shared: bool = False) -> np.ndarray:
  """The stored values of `glob` in `dtype`, zeros beyond the saved array.

  The caller holds the read's bytes (`Source.read_charge`, prepaid) and,
  unless one stored piece covers `glob`, the host piece assembled here.
  `shared` (the host piece is the restored array: `_shared_read_charge`):
  TensorStore reads go in boxes of at most a piece, not the whole of
  `inside` at once.  chunkread decodes straight into the host piece, shared
  or not.
  """
  shape = tuple(s.stop - s.start for s in glob)
  if inside is None:  # strict=False: beyond the saved array, zeros
    return hostmem.zeros_aligned(shape, dtype)
  out, into = None, None
  boxes = [inside]
  itemsize = max(src.dtype.itemsize, np.dtype(dtype).itemsize)
  if _split_read(src, inside, dtype, shared):
    extent = tuple(s.stop - s.start for s in inside)
    grid = slicing.read_grid(extent, itemsize, src.ctx.piece_bytes)
    boxes = [slicing.offset(inside, box, src.shape)
             for box in slicing.boxes(extent, grid, itemsize, src.ctx.piece_bytes)]
  if src.stored is None and src.dtype == dtype:
    # TensorStore reads each box straight into the host piece (`_read_into`),
    # one box after another as before: the read's charge is unchanged.
    out = (hostmem.empty_aligned(shape, dtype) if inside == glob
           else hostmem.zeros_aligned(shape, dtype))
    with (reserve(slicing.nbytes(inside, src.dtype.itemsize)) if reserve
          else contextlib.nullcontext()):
      for box in boxes:
        _read_into(src.t[box], out[tuple(slice(a.start - b.start, a.stop - b.start)
                                         for a, b in zip(box, glob))]).result()
    return out
  if src.stored is not None and src.dtype == dtype and (
      shared or not (inside == glob and src.one_piece(inside))):
    # chunkread decodes into the host piece (where whole rows of the chunk
    # run contiguously in it), not into slabs copied there: the piece is
    # charged already, shared or not (`_read_task_charge`; a piece of one
    # stored slab is that slab, so nothing is decoded into).  A stock 1 GiB
    # leaf over 8 devices that copy, read by shard at 1 GiB (5 alternating
    # fresh processes): 0.84-1.25 s, against 1.44-2.28 s through slabs and
    # Orbax's 1.42-1.74 s.
    out = (hostmem.empty_aligned(shape, dtype) if inside == glob
           else hostmem.zeros_aligned(shape, dtype))
    into = out[tuple(slice(a.start - b.start, a.stop - b.start) for a, b in zip(inside, glob))]
  with (reserve(slicing.nbytes(inside, src.dtype.itemsize)) if reserve
        else contextlib.nullcontext()):
    for sub, data in (p for box in boxes for p in src.pieces(box, prepaid=True, out=into)):
      if out is None and tuple(data.shape) == shape and data.dtype == dtype:
        out = data  # the one piece, covering all of `glob`
        continue
      if out is None:  # zeros only where the saved array ends (strict=False)
        out = (hostmem.empty_aligned(shape, dtype) if inside == glob
               else hostmem.zeros_aligned(shape, dtype))
      out[tuple(slice(a.start - b.start, a.stop - b.start) for a, b in zip(sub, glob))] = data
      del data
  if shared:
    # TensorStore's own buffer (one piece) is copied here, in the read's
    # lane, not by the devices on the thread that places shards (the mixed
    # state's stock restore spent 1.1 of 1.6 s in those).  The piece is the
    # read's (charged); the aligned copy is the array's.
    out = _aligned(out, dtype)
  return out


def _split_read(src: Source, inside, dtype, shared: bool) -> bool:
  """Whether `_read_host` reads `inside` through TensorStore in several boxes."""
  itemsize = max(src.dtype.itemsize, np.dtype(dtype).itemsize)
  return (shared and inside is not None and src.stored is None
          and slicing.nbytes(inside, itemsize) > src.ctx.piece_bytes)


def _batchable(src: Source, reserve) -> bool:
  """Whether `src`'s reads may be started together (`_start_host`):
  TensorStore decodes its chunks (no chunkread) or they are read in byte
  ranges (`Source.ranged`; any other read then runs alone), and no Orbax
  byte limiter takes each read in turn."""
  return (src.stored is None or src.ranged is not None) and reserve is None


def _task(lane: int, charge: int, src: Source, glob, inside, dtype, reserve, *,
          shared: bool = False, batch_reads: bool) -> readahead.Task:
  """The read of `glob` as a readahead task: run alone (`_read_host`) or,
  with `batch_reads`, started into a batch (`_start_host`).

  A batched read also holds its stored bytes: TensorStore coalesces the
  batch's reads of one file into one request, whose response may live
  until the last of them is decoded.  A read for which that would be more
  than the room is run alone.
  """
  run = functools.partial(_read_host, src, glob, inside, dtype, reserve, shared=shared)
  if batch_reads and (batched := _batched_charge(src, glob, inside, dtype, shared, charge)):
    return readahead.Task(lane, batched, run, start=functools.partial(
        _start_host, src, glob, inside, dtype, shared=shared))
  return readahead.Task(lane, charge, run)


def _batched_charge(src: Source, glob, inside, dtype, shared: bool, charge: int) -> int | None:
  """What the read of `glob` holds started into a batch (`_start_host`), given
  its `charge` run alone; None where it is not started (split into several
  reads, or more than the room).

  A batch's TensorStore reads of zstd chunks also hold their stored bytes:
  the coalesced response lives until the last of them is decoded.  A raw
  chunk's stored bytes are what `cost.read_charge` counts as the chunk read
  (reads of 14.6 MiB raw chunks from the GCS emulator, fresh processes: 8 in
  one batch peaked at 1.4-1.5x their output, 2 at 1.5-2.5x; each is charged
  3x).  Ranged reads (`_ranged`) bound their own flight.
  """
  if inside is None:
    return None
  if not _ranged(src, glob, inside, dtype):
    if src.stored is not None or _split_read(src, inside, dtype, shared):
      return None  # chunkread's reads, or several boxes: run alone
    if _zstd_chunks(src.t):
      charge += slicing.nbytes(inside, src.dtype.itemsize)
  return charge if charge <= src.ctx.pieces_capacity_bytes else None


def _ranged(src: Source, glob: slicing.Box, inside: slicing.Box | None, dtype) -> bool:
  """Whether `_start_host` reads `glob` in byte ranges (`Source.ranged`)."""
  return (src.ranged is not None and inside is not None and inside == glob
          and np.dtype(dtype) == src.dtype and src.ranged.can_read_into(inside, RANGE_BYTES))


def _ranged_flight(src: Source, inside: slicing.Box) -> int:
  """Bytes of a ranged read in flight at once: the box, at most a piece."""
  return min(slicing.nbytes(inside, src.dtype.itemsize), src.ctx.piece_bytes)


def _ranged_charge(src: Source, inside: slicing.Box) -> int:
  """What a ranged read holds beyond its host buffer: its reads in flight,
  twice (TensorStore's response and the bytes it hands over), and the one
  being landed."""
  return cost.ranged_read_charge(_ranged_flight(src, inside), RANGE_BYTES)


def _start_host(src: Source, glob: slicing.Box, inside: slicing.Box | None, dtype, batch,
                *, shared: bool = False):
  """`_read_host` of one TensorStore read, issued into `batch`.

  Returns what waits for the read (once the batch is submitted) and returns
  the host piece `_read_host` would.  The caller holds the same bytes: the
  read (one box, as `_read_host` reads it) and the piece assembled from it.
  """
  shape = tuple(s.stop - s.start for s in glob)
  if inside is None:  # strict=False: beyond the saved array, zeros
    return lambda: hostmem.zeros_aligned(shape, dtype)
  if _ranged(src, glob, inside, dtype):
    out = hostmem.empty_aligned(shape, dtype)
    land = src.ranged.start_read_into(inside, out, RANGE_BYTES, _ranged_flight(src, inside))

    def finish_ranged() -> np.ndarray:
      land()
      return out
    return finish_ranged
  if inside == glob and np.dtype(dtype) == src.dtype:
    out = hostmem.empty_aligned(shape, dtype)
    written = _read_into(src.t[inside], out, batch)

    def finish_into() -> np.ndarray:
      written.result()
      return out
    return finish_into
  future = src.t[inside].read(batch=batch)

  def finish() -> np.ndarray:
    data = future.result()
    if tuple(data.shape) == shape and data.dtype == dtype:
      out = data
    else:
      out = (hostmem.empty_aligned(shape, dtype) if inside == glob
             else hostmem.zeros_aligned(shape, dtype))
      out[tuple(slice(a.start - b.start, a.stop - b.start) for a, b in zip(inside, glob))] = data
    del data
    return _aligned(out, dtype) if shared else out
  return finish


class _HostShard:
  """One target shard assembled on the host, then put on its devices.

  A shard that comes in one piece is transferred as it is; otherwise the
  pieces land in one host buffer, admitted through the limiter.  Nothing is
  compiled.
  """

  def __init__(self, shape, dtype, devices, key, memory_kind, layout, ctx):
    self.shape, self.dtype, self.key, self.ctx = shape, dtype, key, ctx
    self.lim = ctx.limiter
    self.memory_kind = memory_kind
    self.layout = layout
    self.devices = devices
    nbytes = math.prod(shape) * dtype.itemsize
    plain = memory_kind in (None, 'device') and layout is None
    # One piece covering the shard: the piece is the staging buffer.
    self.whole_piece = plain and nbytes <= ctx.piece_bytes
    self.staging = 0
    self.host = None
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
      nbytes = math.prod(self.shape) * self.dtype.itemsize
      self.lim.acquire(nbytes)
      self.staging = nbytes  # held only once acquired: a failed wait releases nothing
      self.host = hostmem.zeros_aligned(self.shape, self.dtype)

  def staged(self, box: slicing.Box) -> np.ndarray:
    """Where the global `box` lands in the staging buffer (admitted now)."""
    self._stage()
    return self.host[self._local(box)]

  def _local(self, box: slicing.Box) -> tuple[slice, ...]:
    return tuple(slice(s.start - a, s.stop - a) for s, (a, _) in zip(box, self.key))

  def place(self, data: np.ndarray, sub: slicing.Box) -> None:
    if self.whole_piece and tuple(data.shape) == tuple(self.shape):
      # The piece is already admitted; its cast and its device copy (host
      # RAM on the CPU backend, a staging buffer on GPUs) are admitted here.
      extra = data.nbytes if data.dtype == self.dtype else data.nbytes + data.size * self.dtype.itemsize
      with self.lim.hold_sync(extra):
        host = data if data.dtype == self.dtype else data.astype(self.dtype)
        self.direct = {d: jax.device_put(host, d) for d in self.devices}
        jax.block_until_ready(list(self.direct.values()))
      return
    self._stage()
    self.host[self._local(sub)] = data

  def result(self) -> dict:
    if self.direct is not None:
      return self.direct
    self._stage()  # zero-size, or nothing saved there (strict=False)
    out = {}
    if self.layout is not None:
      # Its program and the room its compile takes were admitted
      # (`_programs`); compiles run one at a time, each leaving garbage the
      # host memory is trimmed of (else 5-6x the shard stayed).
      key = _relayout_key(self.shape, self.dtype, self.layout)
      with _RELAYOUT_LOCK if key not in _COMPILED else contextlib.nullcontext():
        for d in self.devices:
          target = compat.make_format(
              self.layout, jax.sharding.SingleDeviceSharding(d, memory_kind=self.memory_kind))
          out[d] = jax.device_put(self.host, target)
          out[d].block_until_ready()
        if key not in _COMPILED:
          _COMPILED.add(key)
          hostmem.release_free_memory()
      return out
    for d in self.devices:
      target = jax.sharding.SingleDeviceSharding(d, memory_kind=self.memory_kind)
      out[d] = jax.device_put(self.host, target)
    jax.block_until_ready(list(out.values()))
    return out


def _admit_programs(ctx: ReadContext, leaves) -> tuple[ReadContext, set]:
  """The read's pieces, sized to leave room for the programs it will compile.

  `leaves`: (shape, dtype, itemsize, stored chunk, sharding, zstd chunks) per leaf.  Returns the
  context to read with and the keys of the new programs, whose bytes the
  caller holds for the rest of the read.  Smaller pieces can put more shards
  on their devices (more programs): iterates to a fixed point.
  """
  admitted = _admit(ctx, leaves)
  if isinstance(admitted, tuple):
    return admitted
  charge = _programs_charge(admitted)
  staged = max((_host_staged_bytes(*leaf) for leaf in leaves), default=0)
  relayouts = sum(1 for k in admitted if k[0] == 'relayout')
  raise plan_lib.BudgetTooSmallError(
      f'This restore compiles {len(admitted)} programs that XLA keeps'
      f' ({text.format_bytes(charge)} of host RAM: '
      + ', '.join(w for w in (
          f'{len(admitted) - relayouts} filling shards too big for its pieces on their devices'
          if len(admitted) > relayouts else '',
          f'{relayouts} relayouts onto custom layouts' if relayouts else '') if w)
      + ')'
      + (f' and stages shards of up to {text.format_bytes(staged)} whole on the host'
         ' (custom layouts, other memory kinds)' if staged else '')
      + f', and the budget leaves {text.format_bytes(max(ctx.pieces_capacity_bytes, 0))}'
      f' for them and the pieces read: {_raise_to(ctx, _least_budget(ctx, leaves))}'
      + (startup.unpaid_compiler_note(ctx.compiler_bytes)
         if ctx.compiler_bytes and ctx.compiler_estimated else
         f' This restore first paid {text.format_bytes(ctx.compiler_bytes)} for XLA\'s'
         ' compiler start-up (the first compile of the ops kd_ckpt uses in this'
         ' process): a process that has compiled a training step pays under 1 MiB of it.'
         if ctx.compiler_bytes else ''))


def _host_staged_bytes(shape, dtype, itemsize, chunk, sharding, streamed) -> int:
  """The largest shard of a leaf that `_HostShard` stages whole whatever its
  size (a custom layout, another memory kind); 0 for other leaves."""
  del itemsize, chunk, streamed
  sharding, layout = _split_format(sharding)
  if layout is None and getattr(sharding, 'memory_kind', None) in (None, 'device'):
    return 0
  return max((math.prod(b - a for a, b in key) for key in _shard_groups(shape, sharding)),
             default=0) * np.dtype(dtype).itemsize


def _admit(ctx: ReadContext, leaves) -> tuple[ReadContext, set] | set:
  """`_admit_programs`' fixed point, or the programs that did not fit.

  The room must also hold the largest shard staged whole beside the pieces
  (`_host_staged_bytes`): one bigger than the room left by the programs
  waited forever (a drawn state onto custom layouts, fuzz seed 91).
  """
  read = ctx
  staged = max((_host_staged_bytes(*leaf) for leaf in leaves), default=0)
  while True:
    new = set().union(*(_programs(*leaf, read.piece_bytes, ctx.partial_tiles)
                        for leaf in leaves)) - _COMPILED
    room = ctx.pieces_capacity_bytes - _programs_charge(new) - staged
    if room < cost.MIN_PIECES_BYTES and ctx.partial_tiles:
      # Short last pieces take a program each: where those do not fit, the
      # last pieces move back over their neighbours (read twice) as before
      # (the `zeros` test state from a bucket at 48 MiB fell 80 KiB short).
      return _admit(dataclasses.replace(ctx, partial_tiles=False), leaves)
    if room < cost.MIN_PIECES_BYTES:
      return new
    piece = min(ctx.piece_bytes, cost.restore_piece_bytes(room))
    if piece >= read.piece_bytes:
      return read, new
    read = dataclasses.replace(read, piece_bytes=piece)


def _compiles(ctx: ReadContext, leaves) -> bool:
  """Whether filling `leaves` (`_admit_programs`' tuples) at `ctx` compiles
  placement programs.  Refused for its programs, it does too: its refusal
  must name a budget that holds the compiler's start-up.
  """
  try:
    return bool(_admit_programs(ctx, leaves)[1])
  except plan_lib.BudgetTooSmallError:
    return True


def _custom_layout(sharding) -> bool:
  """Whether a target names a device-local layout (a `Format`, not a plain sharding)."""
  return sharding is not None and _split_format(sharding)[1] is not None


def _pay_compiler(ctx: ReadContext, held: contextlib.AsyncExitStack | None) -> ReadContext:
  """Starts XLA's compiler (if this process has not); returns `ctx` less
  what that took, which `held` holds for the rest of the read.

  Called where a local restore's fill first knows it compiles, before it
  holds any piece: the handler defers the start-up here only where no other
  read of the restore runs beside the fill (no numpy leaves; its small
  leaves are read before), so the RSS the start-up adds is its own.  A
  fresh process restoring leaves it places whole, or shard by shard,
  compiles nothing and pays nothing: a stock `mesh2d_prime` of 64 MiB at
  128 MiB, 0.13 s and 18-25 MiB beyond its arrays, against 0.23 s and 73-77
  MiB paying it up front (`bench/results/cold_restore.md`).
  """
  # A price (a refused restore) counts a start-up not yet paid without
  # paying it (`startup.pending_compiler_bytes`).
  estimated = startup.pending_compiler_bytes() if ctx.price_only else 0
  paid = estimated or startup.start_compiler()
  pieces = ctx.pieces_capacity_bytes - paid
  if held is not None and paid and pieces > 0:
    # Its RSS stays (jaxlib's code pages, mostly): held until the read ends.
    ctx.limiter.acquire(paid)  # fits: only the leaves' bookkeeping is held
    held.callback(ctx.limiter.release, paid)
  return dataclasses.replace(
      ctx, compiler_pending=False, compiler_bytes=ctx.compiler_bytes + paid,
      compiler_estimated=bool(estimated),
      startup_bytes=ctx.startup_bytes + paid, capacity_bytes=ctx.capacity_bytes - paid,
      pieces_capacity_bytes=pieces,
      piece_bytes=min(ctx.piece_bytes, cost.restore_piece_bytes(max(pieces, 1))))


def _least_budget(ctx: ReadContext, leaves, from_bytes: int = cost.MiB
                  ) -> tuple[int, int] | None:
  """(least budget, MiB above this one) whose pieces and programs fit; None
  if none within 1 GiB more.  `from_bytes`: the least raise tried.

  A larger budget makes larger pieces, which can take other programs than
  these (more, or fewer), so the shortfall alone is not the answer: the
  budgets above are tried in steps of 1 MiB (pieces' room grows byte for
  byte with the budget).  The next process measures its start-up apart from
  this one's (`cost.startup_spread_bytes`), so its room, and its pieces'
  programs, differ: a budget is named where every room within that spread
  fits (seed 90 of the fuzz: the budget priced in one process was refused
  by one of six others).
  """
  spread = cost.startup_spread_bytes(ctx.startup_bytes)
  shifts = sorted({int(spread * k / 4) for k in range(-4, 5)})
  for extra in range(from_bytes, 1024 * cost.MiB + 1, cost.MiB):
    def fits(shift):
      room = ctx.pieces_capacity_bytes + extra + shift
      if room <= 0:
        return False
      trial = dataclasses.replace(ctx, pieces_capacity_bytes=room, partial_tiles=True,
                                  piece_bytes=cost.restore_piece_bytes(room))
      return isinstance(_admit(trial, leaves), tuple)
    if all(fits(shift) for shift in shifts):
      # Every room within the spread fits: so does the floor (pieces' room is
      # what the budget leaves above it), with no more headroom to add.
      least = -(-(ctx.budget_bytes + extra) // cost.MiB) * cost.MiB
      return (least if ctx.budget_bytes else 0), -(-extra // cost.MiB)
  return None


def _raise_to(ctx: ReadContext, least: tuple[int, int] | None) -> str:
  """What to raise the budget to (`_least_budget`), in words."""
  if least is None:
    return 'raise host_ram_budget by 1 GiB or more.'
  if ctx.budget_bytes:
    return f'raise host_ram_budget to {text.budget_literal(least[0])} or more.'
  return f'raise host_ram_budget by {least[1]} MiB or more.'


def _uncoalesced(kv: ts.KvStore, context: ts.Context) -> ts.KvStore:
  """`kv` opened again without read coalescing.

  Orbax's spec for a bucket merges the reads of one file sent within 1 ms
  into one request: the byte ranges of a chunk (`Source.ranged`) would go
  out as one request again.
  """
  # With its context's resources named (the node cache among them): without,
  # the manifest was fetched again for every read (41-50 GETs restoring one
  # 400 MB leaf through a 20 ms link, each a round trip before its range).
  spec = {k: v for k, v in kv.spec(retain_context=True).to_json().items()
          if k != 'context' and not k.startswith('experimental_read_coalescing')}
  return ts.KvStore.open(spec, context=context).result()


def _open_many(infos, ctx: ReadContext, metadata_key) -> list[tuple[ts.TensorStore, ts.KvStore]]:
  """Each leaf's stored array and its checkpoint's kvstore, opened together.

  The opens are all started before any is awaited (each reads its metadata:
  one at a time they cost ~1 ms a leaf at 10,000 leaves), and leaves of one
  directory share one kvstore.  A leaf opened already for its metadata
  (`ctx.opened`, `keep_opened`) is taken from there, not opened again.
  """
  return _open_keyed(infos, ctx, metadata_key)[1]


def _open_keyed(infos, ctx: ReadContext, metadata_key):
  """`_open_many`, and each leaf's key in `ReadContext.opened`."""
  kept = ctx.opened if ctx.opened is not None else {}
  keys, pending, kvs = [], [], {}
  for info in infos:
    where = (info.parent_dir.as_posix(), bool(info.is_ocdbt_checkpoint))
    key = (*where, info.name, bool(getattr(info, 'use_zarr3', False)), metadata_key)
    keys.append(key)
    if key in kept:
      pending.append(kept.pop(key))
      continue
    spec = storage.without_read_gaps(compat.orbax.build_array_read_spec(
        info, use_ocdbt=info.is_ocdbt_checkpoint, metadata_key=metadata_key,
        raise_array_data_missing_error=info.raise_array_data_missing_error,
        target_dtype=None).json)
    if where not in kvs:
      # Without OCDBT the folder itself is the kvstore: with its trailing
      # slash, or keys ("big/0.0") would be read beside it ("<dir>big/0.0").
      kvs[where] = ts.KvStore.open(storage.without_read_gaps(
          compat.orbax.build_kvstore_tspec(where[0], use_ocdbt=True)
          if where[1] else storage.kvstore_spec(info.parent_dir)),
          context=ctx.ts_context)
    pending.append((ts.open(spec, open=True, context=ctx.ts_context), where))
  opened = {where: f.result() for where, f in kvs.items()}
  return keys, [got if isinstance(got[1], ts.KvStore) else (got[0].result(), opened[got[1]])
                for got in pending]


def keep_opened(infos, ctx: ReadContext, metadata_key) -> list[ts.TensorStore]:
  """The leaves' stored arrays, opened as `_open_many` opens them and kept
  in `ctx.opened` for the read that follows (where `ctx` keeps them).

  A restore without a target asks every leaf's metadata first: Orbax's
  `metadata` opened each array for it, then the read opened it again.
  2,000 leaves of 4 KiB restored without a target (8 devices, local disk):
  1.08-1.20 s, 0.46-0.48 s of it in `metadata`, against 0.49-0.73 s with a
  target; 0.79-0.92 s with the opened arrays kept (bench/results/shapes.md).
  """
  keys, got = _open_keyed(infos, ctx, metadata_key)
  if ctx.opened is not None:
    ctx.opened.update(zip(keys, got))
  return [t for t, _ in got]


def forget_opened(ctx: ReadContext, infos) -> None:
  """Drops what `keep_opened` kept of `infos` (a read that will not take it)."""
  if ctx.opened:
    names = {info.name for info in infos}
    for key in list(ctx.opened):  # one step: a read's thread may be taking some
      if key[2] in names:
        ctx.opened.pop(key, None)


async def _check_files(infos, handler) -> None:
  """Without OCDBT each array is its own folder: a missing one is FileNotFoundError."""
  for info in infos:
    if not info.is_ocdbt_checkpoint:
      await compat.orbax.assert_parameter_files_exist(
          info.parent_dir / info.name, compat.handler_option(handler, 'metadata_key'), info.use_zarr3)


def _orbax_reservation(byte_limiter, loop, capacity_bytes: int):
  """Orbax's own byte limiter (`restore_concurrent_gb`), honoured when set.

  It is an asyncio object of the restore's event loop; reads run in worker
  threads, so reservations are made on that loop.  A limit at least the
  read's capacity never binds (the limiter admits less at once): skipped.
  """
  limit = compat.byte_limit(byte_limiter)
  if limit is None or limit >= capacity_bytes:
    return None

  @contextlib.contextmanager
  def reserve(nbytes: int):
    asyncio.run_coroutine_threadsafe(byte_limiter.wait_for_bytes(nbytes), loop).result()
    try:
      yield
    finally:
      asyncio.run_coroutine_threadsafe(byte_limiter.release_bytes(nbytes), loop).result()

  return reserve


def _stock_charge(t: ts.TensorStore, shape, dtype, sharding) -> int:
  """What Orbax's own reader would hold to read this leaf (all its shards at once).

  It reads each distinct local target shard once, whole, decoding every
  stored chunk the shard touches (`cost.stock_read_charge`).
  """
  sharding, _ = _split_format(sharding)
  stored = np.dtype(t.dtype.numpy_dtype)
  chunk = _stored_chunk(t)
  saved = tuple(int(n) for n in t.shape)
  total = 0
  for key in _shard_groups(shape, sharding):
    # strict=False: the part of the shard beyond the saved array reads nothing.
    inside = tuple(slice(min(a, n), min(b, n)) for (a, b), n in zip(key, saved))
    chunks = (slicing.aligned_nbytes(inside, chunk, stored.itemsize)
              if all(s.stop > s.start for s in inside) else 0)
    total += cost.stock_read_charge(math.prod(b - a for a, b in key) * dtype.itemsize, chunks)
  return total


# The widest stored element (complex128): a leaf priced before it is opened
# may be stored in a wider dtype than it is restored in.
_MAX_STORED_ITEMSIZE = 16


def _stock_charge_bound(shape, dtype, sharding, strict: bool) -> int | None:
  """At least `_stock_charge`, from the restore args alone: the leaf unopened.

  A strict read's stored shape is the target's (Orbax refuses another
  before it reads).  Every Orbax release and kd_ckpt store chunks no bigger
  than the array in any dimension, so the chunks one shard touches span at
  most 2n - 1 elements of a dimension of n (a zarr edge chunk is stored
  whole), in at most `_MAX_STORED_ITEMSIZE` bytes an element.  None when
  the args do not say (no shape or dtype, or strict=False: the stored array
  may be bigger).
  """
  if not strict or shape is None or dtype is None:
    return None
  sharding, _ = _split_format(sharding)
  stored = math.prod(max(2 * n - 1, 0) for n in shape) * max(
      dtype.itemsize, _MAX_STORED_ITEMSIZE)
  return sum(cost.stock_read_charge(math.prod(b - a for a, b in key) * dtype.itemsize, stored)
             for key in _shard_groups(shape, sharding))


def _stock_batches(charges: dict[int, int], room: int) -> list[list[int]]:
  """Consecutive groups of the small leaves whose charges fit `room` together."""
  batches, batch, held = [], [], 0
  for i, c in charges.items():
    if batch and held + c > room:
      batches.append(batch)
      batch, held = [], 0
    batch.append(i)
    held += c
  return batches + [batch] if batch else batches


def _reads_whole(shape, sharding, strict: bool) -> bool:
  """Whether `_read_whole` may read a leaf: a strict read into a plain
  sharding of this process's devices.

  Other memory kinds, layouts and shardings other processes share are left
  to the readers that know them.
  """
  sharding, layout = _split_format(sharding)
  return (strict and layout is None
          and isinstance(sharding, jax.sharding.Sharding)
          and getattr(sharding, 'memory_kind', None) in (None, 'device')
          and sharding.is_fully_addressable
          and (shape is None or math.prod(shape) > 0))


def _whole_charge(shape, dtype, sharding, stored_itemsize: int, chunks_bytes: int) -> int:
  """`cost.whole_read_charge` of a leaf; no sharding: a numpy result, not placed."""
  size = math.prod(shape)
  placed = 0
  if sharding is not None:
    sharding, _ = _split_format(sharding)
    placed = sum(math.prod(b - a for a, b in key) for key in _shard_groups(shape, sharding))
  return cost.whole_read_charge(size * (stored_itemsize + dtype.itemsize), chunks_bytes,
                                placed * dtype.itemsize)


def _whole_charge_of(t: ts.TensorStore, shape, dtype, sharding) -> int:
  """What `_read_whole` holds to read the opened leaf `t`."""
  stored = np.dtype(t.dtype.numpy_dtype)
  whole = tuple(slice(0, int(n)) for n in t.shape)
  return _whole_charge(shape, dtype, sharding, stored.itemsize,
                       slicing.aligned_nbytes(whole, _stored_chunk(t), stored.itemsize))


def _whole_charge_bound(shape, dtype, sharding) -> int | None:
  """At least `_whole_charge_of` for a strict read, from the restore args alone
  (as `_stock_charge_bound`); None when they do not give a shape and dtype."""
  if shape is None or dtype is None:
    return None
  chunks = math.prod(max(2 * n - 1, 0) for n in shape) * _MAX_STORED_ITEMSIZE
  return _whole_charge(shape, dtype, sharding, _MAX_STORED_ITEMSIZE, chunks)


def _read_whole(leaves) -> list[jax.Array]:
  """Small leaves read whole, all at once, and placed by one `device_put`.

  `leaves`: (name, opened TensorStore, shape, dtype, sharding) each, their
  `_whole_charge_of` held by the caller.  Orbax's reader spends ~1.6 ms of
  Python a leaf here (asyncio tasks, a read per shard, a transfer per
  device); this is one TensorStore read a leaf and a share of one batched
  transfer.  A restore of 10,000 leaves of 4 KiB took 9.3 s against
  Orbax's 19.0 s (`bench/results/speed_leaves.md`).  From a bucket the same
  holds: 400 leaves of 64 KiB over 8 devices through a 20 ms link took
  1.2-1.4 s against 2.2-2.4 s through Orbax's reader, and the Gemma-like
  state 3.8-4.2 s against 4.5-4.8 s (`bench/gcs_requests.py`); the batch's
  coalesced responses are its stored bytes, which its charge counts twice
  (`cost.whole_read_charge`).  Casts are numpy's, as `fill_array`'s.
  """
  for name, t, shape, _, _ in leaves:
    check_shape(name, shape, t.shape, True)
  shardings = [_split_format(sharding)[0] for *_, sharding in leaves]
  reads = []
  for (_, t, _, dtype, _), sharding in zip(leaves, shardings):
    if (np.dtype(t.dtype.numpy_dtype) == np.dtype(dtype) and sharding.is_fully_replicated
        and _shares_host_buffers(sharding.addressable_devices, dtype)):
      # The buffer every device keeps, read into (`_read_into`), not copied.
      out = hostmem.empty_aligned(tuple(t.shape), dtype)
      reads.append((out, _read_into(t, out)))
    else:
      reads.append((None, t.read()))
  hosts = []
  for (out, done), leaf, sharding in zip(reads, leaves, shardings):
    got = done.result()
    hosts.append(_placeable(got if out is None else out, leaf[3], sharding))
  del reads
  placed = jax.device_put(hosts, shardings)
  return jax.block_until_ready(placed)


def _placeable(host: np.ndarray, dtype, sharding) -> np.ndarray:
  """`host` in `dtype`, ready for `jax.device_put` onto `sharding`: aligned
  (`_aligned`) where every device holds the whole leaf and keeps the buffer
  it is given; elsewhere numpy's cast, or `host` itself."""
  if sharding.is_fully_replicated and _shares_host_buffers(sharding.addressable_devices, dtype):
    return _aligned(host, dtype)
  return host if host.dtype == dtype else host.astype(dtype)


def _aligned(host: np.ndarray, dtype) -> np.ndarray:
  """`host` in `dtype`, in a C-order buffer aligned to `DEVICE_ALIGN_BYTES`.

  On the CPU backend a device keeps such a buffer as its array, but copies
  any other (TensorStore's own read buffers are not aligned): one copy per
  replica, 8 for a leaf replicated over 8 devices.  One copy (or cast) here,
  where needed, is shared by every replica instead.
  """
  dtype = np.dtype(dtype)
  if (host.dtype == dtype and host.flags.c_contiguous
      and host.ctypes.data % hostmem.DEVICE_ALIGN_BYTES == 0):
    return host
  out = hostmem.empty_aligned(host.shape, dtype)
  np.copyto(out, host, casting='unsafe')  # numpy's cast, as astype's
  return out


def _with_context(info, context: ts.Context, parent_dir=None):
  """`info` reading through `context` (the read's small OCDBT node cache),
  and from `parent_dir` if given (`_remembering`)."""
  info = copy.copy(info)
  info.ts_context = context
  if parent_dir is not None:
    info.parent_dir = parent_dir
  return info


def _remembering(path: epath.Path) -> epath.Path:
  """`path`, whose `exists()` and that of every path under it is asked once.

  Orbax's reader asks whether the checkpoint's sharding file exists at each
  call, and `read_arrays` calls it once per batch of small leaves.  From a
  bucket each ask is two requests (the object's metadata, then a listing),
  each a round trip: restoring the Gemma-like state (1.15 GB) through a
  link of 20 ms, 196 of kd_ckpt's 650 requests were these, against Orbax's
  one ask (bench/results/gcs.md).  Nothing changes a checkpoint while it is
  restored, so the first answer holds for the restore.
  """
  answers: dict[str, bool] = {}

  class Remembering(type(path)):
    def exists(self, *args, **kwargs) -> bool:
      key = os.fspath(self)
      if key not in answers:
        answers[key] = super().exists(*args, **kwargs)
      return answers[key]

  return Remembering(path)


async def read_arrays(handler, infos, args, ctx: ReadContext, stock_read=None) -> list[jax.Array]:
  """`ArrayHandler.deserialize`, bounded: Orbax's semantics, kd_ckpt's memory.

  A leaf read whole for less than one of our pieces costs is read whole,
  in batches whose summed charge the limiter holds (`_read_whole`).  Where
  that may not read it (`_reads_whole`), Orbax's own reader (`stock_read`,
  an `ArrayHandler.deserialize` without an array metadata store) reads it if
  that costs less than a piece (`_stock_charge`), also in held batches.
  Every other leaf is filled here, piece by piece.
  """
  if args is None:
    raise ValueError('Must provide ArrayRestoreArgs to restore as jax.Array.')
  ocp.type_handlers.check_input_arguments(infos, args)
  await asyncio.gather(*[info.await_path_creation() for info in infos])
  parent = _remembering(epath.Path(infos[0].parent_dir))
  await _check_files(infos, handler)
  sharding_file = await asyncio.to_thread((parent / compat.orbax.sharding_file_name).exists)
  shardings = await compat.orbax.deserialize_shardings(infos, args, sharding_file)
  loop = asyncio.get_running_loop()

  def spec_of(i):
    shape, dtype, sharding = compat.orbax.physical_read_spec(args[i], shardings[i])
    return (tuple(shape) if shape is not None else None,
            None if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            else np.dtype(dtype), sharding)

  def open_all(idx):
    leaves = []
    stores = _open_many([infos[i] for i in idx], ctx,
                        compat.handler_option(handler, 'metadata_key'))
    for i, (t, kv) in zip(idx, stores):
      info, arg = infos[i], args[i]
      shape, dtype, sharding = spec_of(i)
      stored = np.dtype(t.dtype.numpy_dtype)
      dtype = stored if dtype is None else dtype
      shape = shape if shape is not None else tuple(int(n) for n in t.shape)
      # Before any leaf is read, by us or by Orbax (whose error names no leaf).
      check_shape(info.name, shape, t.shape, getattr(arg, 'strict', True))
      leaves.append((info, arg, t, kv, shape, dtype, sharding,
                     max(dtype.itemsize, stored.itemsize)))
    return leaves

  # From a bucket, one reader thread a leaf, whose shard reads that fit at
  # once go out in one TensorStore batch (`batch_reads`, coalesced into
  # fewer requests): several lanes' reads in flight held more than their
  # charges (150 MiB beyond a 128 MiB budget).  Gemma-like state, 1.1 GB,
  # from the GCS emulator, 4 alternating reps in fresh processes (/tmp
  # script): restores of kd_ckpt's checkpoint 3.18 s batched against 3.68 s
  # not, of Orbax's 3.79 s against 4.48 s (Orbax itself: 2.62 s).  Leaves
  # whose reads are all batched are filled side by side (`_side_by_side`).
  remote = storage.is_remote(parent)
  lanes = 1 if remote else MAX_READ_LANES

  def admitted(leaves):
    """What `_admit_programs` takes of each opened leaf."""
    return [(shape, dtype, itemsize, _stored_chunk(t), sharding, _zstd_chunks(t))
            for _, _, t, _, shape, dtype, sharding, itemsize in leaves]

  def reserves_of(leaves):
    return [_orbax_reservation(info.byte_limiter, loop, ctx.capacity_bytes)
            for info, *_ in leaves]

  def plan(fctx, leaves, reserves):
    """(parts, read context, new programs) of the fill of `leaves` at `fctx`."""
    parts = 1 if remote or any(r is not None for r in reserves) else max(1, min(
        MAX_LEAF_PARTS, len(leaves), fctx.pieces_capacity_bytes // MIN_PART_BYTES))

    def sized(parts):
      # Each part's pieces are sized to its share of the room (programs are
      # held for all of them once, below).
      share = dataclasses.replace(
          fctx, pieces_capacity_bytes=fctx.pieces_capacity_bytes // parts,
          piece_bytes=min(fctx.piece_bytes,
                          cost.restore_piece_bytes(fctx.pieces_capacity_bytes // parts)))
      return _admit_programs(share, admitted(leaves))

    try:
      read, programs = sized(parts)
    except plan_lib.BudgetTooSmallError:
      if parts == 1:
        raise
      # Each part's share holds every program: one part may have room.
      parts = 1
      read, programs = sized(1)
    if parts > 1 and not _parts_can_read(leaves, read.piece_bytes, read.opened_secs):
      parts = 1
      read, programs = sized(1)
    return parts, read, programs

  def fill_all(leaves, fctx, planned=None):
    """Fills `leaves` at `fctx`; `planned`: their `plan` there, if made already."""
    reserves = reserves_of(leaves)
    return fill_planned(leaves, reserves, fctx, *(planned or plan(fctx, leaves, reserves)))

  def fill_planned(leaves, reserves, fctx, parts, read, programs):
    # The programs are held from the same limiter: what a leaf may take
    # beside them (`_by_shard_tasks`' room) is what they leave.  Counted in
    # full, a resharded bf16 leaf on devices that copy asked for 6.2 MiB
    # where 8.2 MiB of programs left 4.8 MiB, and waited forever (a drawn
    # state, `tools/fuzz_budget.py` seed 159).
    read = dataclasses.replace(read, pieces_capacity_bytes=(
        read.pieces_capacity_bytes - _programs_charge(programs)))
    out = [None] * len(leaves)
    ranged_kvs, ranged_lock = {}, threading.Lock()

    def ranged_kv(kv):
      """`kv` without read coalescing (`_uncoalesced`), opened once per restore."""
      with ranged_lock:
        if id(kv) not in ranged_kvs:
          ranged_kvs[id(kv)] = _uncoalesced(kv, read.ts_context)
        return ranged_kvs[id(kv)]

    def fill(j, read=read, max_lanes=lanes):
      info, arg, t, kv, shape, dtype, sharding, _ = leaves[j]
      with Source(info.name, t, kv, read, stream_zstd=not remote,
                  ranged_kv=ranged_kv(kv) if remote and kv is not None else None) as src:
        if remote and src.stored is not None and src.stored.compressed:
          # zstd chunks bigger than a piece stream through kept decoders,
          # whose windows in flight each lane's state holds (`_lanes`): from
          # a bucket one lane waited on the network a window at a time.  A
          # stock leaf of 400 MB (8 chunks of 50 MB) through a 20 ms link at
          # 256 MiB: 4.8 s with one lane, 3.0 s with two (Orbax: 4.1-4.6 s).
          max_lanes = MAX_READ_LANES
        out[j] = fill_array(
            src, shape, dtype, sharding, strict=getattr(arg, 'strict', True),
            max_lanes=max_lanes, batch_reads=remote, name=info.name, reserve=reserves[j])
      # Pieces below the mmap threshold are freed into glibc's arenas (one
      # per reader thread), between the restored arrays: trimmed after each
      # leaf, or they add up over the leaves (the Gemma-like state at 256
      # MiB peaked 190-275 MiB beyond its arrays, 27 MiB with this).
      hostmem.release_free_memory()

    with fctx.limiter.hold_sync(_programs_charge(programs)):
      if parts > 1:
        _fill_in_parts(fill, len(leaves), parts, read,
                       (fctx.pieces_capacity_bytes - _programs_charge(programs)) // parts,
                       max(1, lanes // parts))
        return out
      side = set()
      if remote:
        side = {j for j, (info, arg, t, kv, shape, dtype, sharding, _) in enumerate(leaves)
                if _side_by_side(t, read, shape, dtype, sharding,
                                 _orbax_reservation(info.byte_limiter, loop, fctx.capacity_bytes),
                                 ranged_kv(kv) if kv is not None else None)}
      for j in range(len(leaves)):
        if j not in side:
          fill(j)
      if side:
        _fill_side_by_side(fill, sorted(side))
    return out

  out = [None] * len(infos)
  # Reads block on TensorStore and on the limiter: off the event loop.  The
  # leaves' bookkeeping (specs, open TensorStores, results) is admitted first.
  with ctx.limiter.lease(ctx.capacity_bytes, mmap_threshold_bytes=hostmem.read_mmap_threshold(
      remote=storage.is_remote(infos[0].parent_dir), capacity_bytes=ctx.capacity_bytes)):
    async with ctx.limiter.hold(cost.leaves_charge(len(infos))), \
        contextlib.AsyncExitStack() as compiler_held:
      remote = storage.is_remote(parent)
      if ctx.compiler_pending and any(_custom_layout(spec_of(i)[2]) for i in range(len(infos))):
        # Placed onto a custom layout, a leaf compiles a relayout however it
        # is read (a device_put onto a `Format` compiled one program here):
        # the start-up first, before anything is read.
        ctx = _pay_compiler(ctx, compiler_held)

      def whole_ok(i, shape, sharding):
        return (_reads_whole(shape, sharding, getattr(args[i], 'strict', True))
                and _orbax_reservation(infos[i].byte_limiter, loop, ctx.capacity_bytes) is None)

      # Small leaves are read whole in batches (`_read_whole`) or, where it
      # may not, by Orbax's reader (`small`).  A leaf priced from its restore
      # args alone is not opened here: at 3,000 leaves the opens were a
      # seventh of the restore (py-spy); its batch opens it.  From a bucket
      # every leaf is opened (the opens go out together) and priced exactly:
      # the bound prices a sharded leaf as if each shard decoded the whole
      # array, and batches of two leaves of 64 KiB over 8 devices left
      # TensorStore little to coalesce.  400 such leaves through a 20 ms link
      # (`bench/gcs_requests.py`): 329 requests and 4.21 s, now 52 and 2.34 s
      # (Orbax's restore: 44-88 requests, 2.0-2.1 s).
      whole, whole_opened, small = {}, {}, {}
      for i in range(0 if remote else len(infos)):  # from a bucket, none unopened
        shape, dtype, sharding = spec_of(i)
        if whole_ok(i, shape, sharding):
          if (c := _whole_charge_bound(shape, dtype, sharding)) is not None and c <= ctx.piece_bytes:
            whole[i] = c
        elif stock_read is not None and not _custom_layout(sharding) and (c := _stock_charge_bound(
            shape, dtype, sharding, getattr(args[i], 'strict', True))) is not None \
            and c <= ctx.piece_bytes:
          small[i] = c
      opened = [i for i in range(len(infos)) if i not in small and i not in whole]
      leaves = await asyncio.to_thread(open_all, opened) if opened else []
      for i, (info, _, t, _, shape, dtype, sharding, _) in zip(opened, leaves):
        if whole_ok(i, shape, sharding):
          if (c := _whole_charge_of(t, shape, dtype, sharding)) <= ctx.piece_bytes:
            whole[i] = c
            whole_opened[i] = (info.name, t, shape, dtype, sharding)
        elif (stock_read is not None and not _custom_layout(sharding)
              and (c := _stock_charge(t, shape, dtype, sharding)) <= ctx.piece_bytes):
          small[i] = c
      rest = [i for i in range(len(infos)) if i not in small and i not in whole]
      # Orbax's reader opens its leaves itself: what their metadata opened goes.
      forget_opened(ctx, [infos[i] for i in small])
      leaves = [leaf for i, leaf in zip(opened, leaves) if i not in small and i not in whole]
      if ctx.price_only:  # nothing is read
        least = ctx.budget_bytes
        if rest:  # as one part (where parts do not fit, `fill_all` falls back to one)
          pctx = ctx
          if ctx.compiler_pending and _compiles(ctx, admitted(leaves)):
            pctx = _pay_compiler(ctx, None)  # the price holds it
          found = _least_budget(pctx, admitted(leaves), from_bytes=0)
          least = found[0] if found else ctx.budget_bytes + 1024 * cost.MiB
        raise Priced(least)

      async def read_batch(batch):
        async with ctx.limiter.hold(sum(small[i] for i in batch)):
          try:
            got = await stock_read([_with_context(infos[i], ctx.ts_context, parent) for i in batch],
                                   [args[i] for i in batch])
          except ValueError:
            # Leaves priced unopened: a stored shape other than the target's
            # fails in Orbax without the leaf's name.  Name it, else re-raise.
            await asyncio.to_thread(open_all, batch)
            raise
        for i, arr in zip(batch, got):
          out[i] = arr

      def open_and_read_whole(batch):
        need = [i for i in batch if i not in whole_opened]
        stores = dict(zip(need, (t for t, _ in _open_many(
            [infos[i] for i in need], ctx, compat.handler_option(handler, 'metadata_key')))))
        return _read_whole([whole_opened.get(i) or (infos[i].name, stores[i], *spec_of(i))
                            for i in batch])

      async def read_whole_batch(batch):
        # Held: the batch's bounds, at least what it reads (`_whole_charge_bound`).
        async with ctx.limiter.hold(sum(whole[i] for i in batch)):
          got = await asyncio.to_thread(open_and_read_whole, batch)
        for i, arr in zip(batch, got):
          out[i] = arr

      # Batches of a fraction of the room: while one waits on its slowest
      # leaf, the next ones read (the limiter admits what fits).
      # From a bucket the other leaves are filled meanwhile (every read waits
      # in the same limiter): the small leaves' requests and the big leaves'
      # overlap.  Restoring the Gemma-like state (1.1 GB) from the GCS
      # emulator, 3.1 s of reads were 1.5 s of small leaves, then 1.5 s of
      # the others.  From a local disk overlapping made no difference beyond
      # noise (4 states, 4 alternating reps): there the order stays.
      room = ctx.pieces_capacity_bytes // STOCK_BATCHES_IN_FLIGHT
      batches = [*[read_batch(b) for b in _stock_batches(small, room)],
                 *[read_whole_batch(b) for b in _stock_batches(whole, room)]]
      if not remote:
        await asyncio.gather(*batches)
        batches = []
      fill_ctx, planned = ctx, None
      if rest and ctx.compiler_pending and not batches:
        try:
          planned = plan(ctx, leaves, reserves_of(leaves))
        except plan_lib.BudgetTooSmallError:
          pass  # refused for its programs: it compiles, and names a budget that holds the start-up
        if planned is None or planned[2]:
          if startup.pending_compiler_bytes():
            # Refused even with the start-up's estimate: refused before paying
            # it, which could alone exceed a budget above the floor.
            _admit_programs(_pay_compiler(dataclasses.replace(ctx, price_only=True), None),
                            admitted(leaves))
          # Here, in the thread that runs Orbax's event loop (the caller's),
          # not in the fill's: started from a reader thread, whose malloc
          # arena is new, the same start-up measured 2-4 MiB more.
          fill_ctx, planned = _pay_compiler(ctx, compiler_held), None
      filled, *_ = await asyncio.gather(
          asyncio.to_thread(fill_all, leaves, fill_ctx, planned) if rest
          else asyncio.sleep(0, []), *batches)
      del leaves
  for i, arr in zip(rest, filled):
    out[i] = arr
  # Random keys are stored as their key data: wrapped again here, for every
  # leaf (`stock_read` reads without the store), with one read of the store.
  store = compat.handler_option(handler, 'array_metadata_store')
  if store is not None:
    metadatas = await store.read(checkpoint_dir=parent)
    if metadatas:
      out = compat.orbax.wrap_random_key_data(metadatas, infos, out)
  return out


async def read_numpy(handler, infos, args, ctx: ReadContext) -> list[np.ndarray]:
  """`NumpyHandler.deserialize`, bounded: small leaves read whole in held
  batches, every other result filled in pieces."""
  args = args or [ocp.type_handlers.RestoreArgs()] * len(infos)
  ocp.type_handlers.check_input_arguments(infos, args)
  await asyncio.gather(*[info.await_path_creation() for info in infos])
  await _check_files(infos, handler)
  if ctx.price_only:
    return [None] * len(infos)  # host arrays compile nothing: priced by the floor

  remote = storage.is_remote(infos[0].parent_dir)

  def read_all():
    out = [None] * len(infos)
    stores = _open_many(infos, ctx, compat.handler_option(handler, 'metadata_key'))
    dtypes = [np.dtype(arg.dtype) if getattr(arg, 'dtype', None) is not None
              else np.dtype(t.dtype.numpy_dtype) for arg, (t, _) in zip(args, stores)]
    # Small leaves: read whole, a batch at a time (as `read_arrays` does, and
    # one arena trim a batch, not ~1 ms a leaf).
    whole = {}
    for i, ((t, _), dtype) in enumerate(zip(stores, dtypes)):
      shape = tuple(int(n) for n in t.shape)
      if not remote and math.prod(shape) and (
          c := _whole_charge_of(t, shape, dtype, None)) <= ctx.piece_bytes:
        whole[i] = c
    for batch in _stock_batches(whole, ctx.pieces_capacity_bytes // STOCK_BATCHES_IN_FLIGHT):
      with ctx.limiter.hold_sync(sum(whole[i] for i in batch)):
        reads = [stores[i][0].read() for i in batch]
        for i, done in zip(batch, reads):
          host = done.result()
          out[i] = host if host.dtype == dtypes[i] else host.astype(dtypes[i])
        del reads, host
      hostmem.release_free_memory()
    for i, (info, (t, kv), dtype) in enumerate(zip(infos, stores, dtypes)):
      if i in whole:
        continue
      with Source(info.name, t, kv, ctx) as src:
        result = np.empty(src.shape, dtype)  # the restored value itself
        itemsize = max(dtype.itemsize, src.dtype.itemsize)
        grid = slicing.read_grid(src.shape, itemsize, ctx.piece_bytes)
        for box in slicing.boxes(src.shape, grid, itemsize, ctx.piece_bytes):
          for sub, data in src.pieces(box):
            result[sub] = data
      out[i] = result
      hostmem.release_free_memory()  # as `read_arrays` does after each leaf
    return out

  with ctx.limiter.lease(ctx.capacity_bytes, mmap_threshold_bytes=hostmem.read_mmap_threshold(
      remote=remote, capacity_bytes=ctx.capacity_bytes)), ctx.limiter.hold_sync(
          cost.leaves_charge(len(infos))):
    return await asyncio.to_thread(read_all)
