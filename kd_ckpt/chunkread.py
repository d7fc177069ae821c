"""Bounded reads of Orbax-saved arrays: any box, in pieces, never a whole chunk.

Stock Orbax stores each saved shard as one zarr chunk, and TensorStore decodes
a whole chunk to read any part of it, so a 4 GiB chunk cannot be restored in a
256 MiB host budget through TensorStore's array API.  This module reads the
chunk bytes straight from the checkpoint's OCDBT kvstore instead:

  * raw chunks: only the byte ranges the box needs (`KvStore.read(byte_range=)`);
  * zstd chunks: streaming decompression from the chunk's start, fed windows of
    the compressed value; bytes before and after the box are dropped;
  * zarr3 `sharding_indexed`: the shard index is read from the shard's end, and
    each inner chunk is a byte range of the shard value.

Supported: zarr v2 (compressor null or zstd, filters null, order C or F) and
zarr3 (codecs `[bytes, zstd?]`, or `sharding_indexed` with those inner codecs
and index codecs `[bytes, crc32c?]`), of bool/int/uint/float/complex dtypes in
either byte order, bfloat16 and float8.  Anything else (blosc, filters,
transpose, strings, ...) raises `NotImplementedError` naming the array: read
that one with TensorStore.  Absent chunks read as the fill value (null: 0).

Memory, with L = max(max_piece_bytes, itemsize): each piece holds at most L
bytes.  While building one, a call also holds the reads or slab it is cut
from: raw reads in flight of at most max(L/4, 64 KiB) bytes, each of at most
4 MiB (TensorStore keeps ~3 copies of a read while it lands, so ~0.75 L), or
the decoded zstd slab of at most L (a piece of whole rows *is* the slab).  Plus a constant: a
compressed window of <= 2 MiB (also ~3 copies), a <= 1 MiB skip buffer, zstd's
window (2 MiB at Orbax's zarr3 level 3, 512 KiB at its zarr v2 level 1), one
zarr3 shard index (16 bytes per inner chunk).  So the peak is about
2 L + 12 MiB whatever the chunk size (20-25 MiB measured for a 512 MiB chunk
read in 8 MiB pieces), plus the pieces the caller still holds: drop each
before asking for the next.  For the same reason only chunks of at most L/4
bytes are read whole in one kvstore read.

Example:

  kv = ts.KvStore.open({'driver': 'ocdbt', 'base': 'file:///ckpt/1/'}).result()
  w = StoredArray.open(kv, 'params.w')
  for box, data in w.read_pieces((slice(0, 4096), slice(None)), 64 << 20):
    host_buffer[box] = data
    del data       # else it stays alive while the next piece is read
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import math
from typing import Any, Callable, Iterator, NamedTuple

import ml_dtypes
import numpy as np
import tensorstore as ts

from kd_ckpt import hostmem
from kd_ckpt import integrity


def _zstd():
  try:
    import zstandard  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        'Reading a zstd chunk bigger than the restore budget allows needs the'
        ' zstandard package: pip install zstandard (a kd_ckpt dependency).') from e
  return zstandard

_MIN_READ = 64 << 10  # kvstore reads are at least this long (when possible)
_MAX_WINDOW = 2 << 20  # compressed bytes per kvstore read when streaming
# Reads in flight beyond the one being decompressed (each a window).
_READ_AHEAD = 2
_MAX_SKIP = 1 << 20  # buffer for decompressed bytes that are dropped
# A zstd decoder context beyond its window (zstd's DCtx is ~100 KiB), with
# the stream reader's own buffers.
_DCTX_BYTES = 256 << 10
_MAX_READS = 4096  # raw byte-range reads in flight
# Raw byte-range reads are at most this long: each lands in a Python bytes
# object, which at half the reads' mmap threshold (hostmem.
# READ_MMAP_THRESHOLD_BYTES) glibc reuses from its heap; above it every read
# faulted in fresh pages (0.5-0.8 GB/s against 4-5.6 GB/s at 4 MiB).
_MAX_READ = 4 << 20
_SMALL_ROW = 4096  # raw: rows up to this size are read whole (fewer reads)
_ABSENT = 2**64 - 1  # sharding index entry of an absent inner chunk

Box = tuple[slice, ...]
Bounds = tuple[tuple[int, ...], tuple[int, ...]]


class _Blob(NamedTuple):
  """A stored chunk: `size` bytes of `key`'s value from `offset` (None: all)."""
  key: str
  offset: int = 0
  size: int | None = None


def _zstd_window(limit: int) -> int:
  """Compressed bytes fed to a zstd decoder per kvstore read, for pieces of `limit`."""
  return min(max(limit // 4, _MIN_READ), _MAX_WINDOW)


def _fresh(staleness_bound: float | None) -> dict[str, float]:
  """`KvStore.read`'s keyword for reads that accept what was cached after
  `staleness_bound` (`StoredArray.staleness_bound`); none for its default."""
  return {} if staleness_bound is None else {'staleness_bound': staleness_bound}


def _unsupported(name: str, what: str) -> NotImplementedError:
  return NotImplementedError(
      f'array {name!r}: {what} is not supported by kd_ckpt.chunkread; read '
      'this array with TensorStore instead.')


def _dtype(name: Any, array: str) -> np.dtype:
  if isinstance(name, str) and isinstance(getattr(ml_dtypes, name, None), type):
    # bfloat16, float8_*, float4_e2m1fn, int4, int2: TensorStore stores one
    # byte (two for bfloat16) an element, as numpy holds them.
    try:
      dtype = np.dtype(getattr(ml_dtypes, name))
    except TypeError:
      dtype = None
    if dtype is not None and dtype.name == name:
      return dtype
  try:
    dtype = np.dtype(name) if isinstance(name, str) else None
  except TypeError:
    dtype = None
  if dtype is None or dtype.kind not in 'biufc':
    raise _unsupported(array, f'dtype {name!r}')
  return dtype


def _fill(value: Any, dtype: np.dtype) -> np.ndarray:
  if value is None:
    return np.zeros((), dtype)
  if isinstance(value, str) and value.startswith('0x'):  # zarr3 bit pattern
    return np.array(int(value, 16), f'u{dtype.itemsize}').view(dtype)
  if isinstance(value, str):  # 'NaN', 'Infinity', '-Infinity'
    value = float(value.replace('Infinity', 'inf'))
  if isinstance(value, list):  # zarr3 complex
    value = complex(*value)
  return np.array(value, dtype)


def _level(extents, itemsize: int, limit: int) -> tuple[int, int]:
  """(k, q): q rows along axis k, each whole over axes > k, fit in `limit`."""
  k, unit = len(extents) - 1, itemsize
  while k > 0 and unit * extents[k] <= limit:
    unit *= extents[k]
    k -= 1
  return k, max(1, limit // unit)


def _split(lo, hi, k: int, q: int) -> Iterator[Bounds]:
  """Sub-boxes of [lo, hi) in C order: single indices on axes < k, q on k."""
  if k < 0:
    yield tuple(lo), tuple(hi)
    return
  for o in itertools.product(*(range(lo[j], hi[j]) for j in range(k))):
    for a in range(lo[k], hi[k], q):
      yield (o + (a,) + tuple(lo[k + 1:]),
             tuple(i + 1 for i in o) + (min(a + q, hi[k]),) + tuple(hi[k + 1:]))


def _run_axis(lo, hi, shape) -> int:
  """The innermost axis where [lo, hi) is not all of `shape`; -1 if none."""
  return max((j for j, (a, b, c) in enumerate(zip(lo, hi, shape))
              if (a, b) != (0, c)), default=-1)


class StoredArray:
  """A stored zarr array in an OCDBT checkpoint, opened for bounded reads.

  Attributes:
    name: the array's key prefix in the kvstore (Orbax's leaf name).
    shape, dtype: the array's shape and (native byte order) dtype.
    chunk_shape: the chunk shape reads decode: the inner chunk of a zarr3
      shard, else the zarr chunk.
    shard_shape: the zarr3 shard (grid chunk) shape; `chunk_shape` otherwise.
    chunk_nbytes: decoded bytes of one chunk of `chunk_shape`.
    compressed: whether chunks are zstd-compressed (else raw).
    order: 'C' or 'F', the element order inside a chunk.
    fill_value: 0-d array, the value of absent chunks.
  """

  # Reads accept what the kvstore cached after this time (seconds since
  # the epoch; None: TensorStore's default, revalidated at each read).  An
  # OCDBT kvstore revalidates its manifest for each read otherwise: from a
  # bucket, a round trip before each.
  staleness_bound: float | None = None

  def __init__(self, kvstore: ts.KvStore, name: str, meta: dict[str, Any]):
    self._kv, self.name, self.shape = kvstore, name, tuple(meta['shape'])
    self._shard = None  # (inner chunks per shard, index at end, has crc32c)
    self.order, fill = meta.get('order', 'C'), meta.get('fill_value')
    if meta.get('zarr_format') == 2:
      if meta.get('filters'):
        raise _unsupported(name, f'zarr filters {meta["filters"]}')
      compressor = (meta.get('compressor') or {}).get('id')
      stored = _dtype(meta['dtype'], name)
      self.chunk_shape = self.shard_shape = tuple(meta['chunks'])
      sep, v2_keys = meta.get('dimension_separator', '.'), True
    else:
      grid = meta['chunk_grid']
      if grid['name'] != 'regular':
        raise _unsupported(name, f'chunk grid {grid["name"]!r}')
      self.chunk_shape = self.shard_shape = tuple(
          grid['configuration']['chunk_shape'])
      codecs = meta['codecs']
      if codecs and codecs[0]['name'] == 'sharding_indexed':
        cfg = codecs[0]['configuration']
        index = [c['name'] for c in cfg.get('index_codecs', [])]
        if len(codecs) > 1 or index not in (['bytes'], ['bytes', 'crc32c']):
          raise _unsupported(name, f'codecs {codecs}')
        self.chunk_shape = tuple(cfg['chunk_shape'])
        per = tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape))
        end = cfg.get('index_location', 'end') == 'end'
        self._shard = (per, end, index[-1] == 'crc32c')
        codecs = cfg['codecs']
      names = [c['name'] for c in codecs]
      if names not in (['bytes'], ['bytes', 'zstd']):
        raise _unsupported(name, f'codecs {names} (only bytes, zstd)')
      compressor = 'zstd' if 'zstd' in names else None
      endian = codecs[0].get('configuration', {}).get('endian', 'little')
      stored = _dtype(meta['data_type'], name)
      stored = stored.newbyteorder('<' if endian == 'little' else '>')
      enc = meta.get('chunk_key_encoding', {'name': 'default'})
      v2_keys = enc['name'] == 'v2'
      sep = enc.get('configuration', {}).get('separator', '.' if v2_keys else '/')
    if v2_keys:
      self._key = lambda g: f'{name}/' + (sep.join(map(str, g)) or '0')
    else:
      self._key = lambda g: f'{name}/c' + ''.join(sep + str(i) for i in g)
    if compressor not in (None, 'zstd'):
      raise _unsupported(name, f'compressor {compressor!r} (only zstd or none)')
    if self.order not in ('C', 'F'):
      raise _unsupported(name, f'order {self.order!r}')
    self.compressed = compressor == 'zstd'
    self._stored = stored
    self.dtype = stored.newbyteorder('=') if stored.byteorder in '<>' else stored
    self.fill_value = _fill(fill, self.dtype)
    self.chunk_nbytes = math.prod(self.chunk_shape) * stored.itemsize
    self._storage_shape = self.chunk_shape[::-1 if self.order == 'F' else 1]
    self._index_cache = (None, None)
    self._present: set = set()  # keys of big unsharded chunks known to exist
    # zstd decoders kept between `read_pieces` calls (most recent last): a
    # read at or after a decoder's position resumes it instead of
    # decompressing the chunk again from its start.
    self._cursors: collections.OrderedDict[Any, _Cursor] = collections.OrderedDict()
    self.max_cursors = 1

  @classmethod
  def open(cls, kvstore: ts.KvStore, name: str, *,
           staleness_bound: float | None = None) -> StoredArray:
    """Opens array `name` of the checkpoint whose root OCDBT kvstore is given.

    `staleness_bound`: its reads (this one's too) accept what the kvstore
    cached after this time (`StoredArray.staleness_bound`).
    """
    name = name.strip('/')
    for key in (f'{name}/.zarray', f'{name}/zarr.json'):
      r = kvstore.read(key, **_fresh(staleness_bound)).result()
      if r.state == 'value':
        stored = cls(kvstore, name, json.loads(r.value))
        stored.staleness_bound = staleness_bound
        return stored
    raise FileNotFoundError(
        f'No array {name!r} in this kvstore (neither {name}/.zarray nor '
        f'{name}/zarr.json); pass the checkpoint root OCDBT kvstore and the '
        'leaf name as Orbax stores it, e.g. "params.w".')

  def read_pieces(self, box: Box, max_piece_bytes: int, *, out: np.ndarray | None = None
                  ) -> Iterator[tuple[Box, np.ndarray]]:
    """Yields (sub_box, data) covering `box` exactly once, in any order.

    Each `data` is a C-contiguous, writeable array of at most
    L = max(max_piece_bytes, itemsize) bytes; the call's peak memory is about
    2 L + 12 MiB (see the module docstring), whatever the chunk size, as long
    as the caller drops each piece before asking for the next.

    `out` (the box's shape, this array's dtype): zstd slabs that are a
    contiguous run of it are decoded straight into it, and not yielded (no
    piece is allocated, filled and copied); the caller copies the rest.

    Args:
      box: one slice (step 1) per dimension, in global coordinates.
      max_piece_bytes: the bound on each piece.
      out: where the caller assembles `box`, if anywhere.
    """
    lo, hi = self._bounds(box)
    if out is not None and (tuple(out.shape) != tuple(b - a for a, b in zip(lo, hi))
                            or out.dtype != self.dtype):
      raise ValueError(f'out has shape {out.shape} and dtype {out.dtype}; reading'
                       f' {box} of array {self.name!r} needs'
                       f' {tuple(b - a for a, b in zip(lo, hi))} and {self.dtype}.')
    # Freed buffers above the threshold leave RSS at once.
    with hostmem.mmap_large_buffers(hostmem.READ_MMAP_THRESHOLD_BYTES):
      yield from self._pieces(box, max_piece_bytes, out)

  def _pieces(self, box: Box, max_piece_bytes: int, out: np.ndarray | None = None
              ) -> Iterator[tuple[Box, np.ndarray]]:
    lo, hi = self._bounds(box)
    limit = max(int(max_piece_bytes), self.dtype.itemsize)
    grid = [range(a // c, (b - 1) // c + 1) if b > a else range(0)
            for a, b, c in zip(lo, hi, self.chunk_shape)]
    for g in itertools.product(*grid):
      origin = [i * c for i, c in zip(g, self.chunk_shape)]
      clo = tuple(max(a, o) - o for a, o in zip(lo, origin))
      chi = tuple(min(b, o + c) - o
                  for b, o, c in zip(hi, origin, self.chunk_shape))
      into = None if out is None else out[tuple(
          slice(o + a - b0, o + b - b0) for o, a, b, b0 in zip(origin, clo, chi, lo))
                                          or ...]  # a 0-d view, not a scalar
      for (plo, phi), data in self._chunk(g, clo, chi, limit, into):
        yield tuple(slice(o + a, o + b)
                    for o, a, b in zip(origin, plo, phi)), data
        del data

  def can_read_into(self, box: Box, range_bytes: int) -> bool:
    """Whether `start_read_into` reads `box`: raw chunks in C order and the
    native byte order, whose rows (all but the first axis) fit a range, and
    which `box` covers whole on every axis but the first, but where the
    array ends: the padding read there is at most a quarter of the box."""
    if (self.compressed or self.order != 'C' or self._stored != self.dtype or not self.shape
        or math.prod(self.chunk_shape[1:]) * self.dtype.itemsize > range_bytes):
      return False
    lo, hi = self._bounds(box)
    if any(a % c or (b % c and b != n)
           for a, b, c, n in zip(lo[1:], hi[1:], self.chunk_shape[1:], self.shape[1:])):
      return False
    read = math.prod(-(-(b - a) // c) * c for a, b, c in zip(lo[1:], hi[1:], self.chunk_shape[1:]))
    return 4 * read <= 5 * math.prod(b - a for a, b in zip(lo[1:], hi[1:]))

  def start_read_into(self, box: Box, out: np.ndarray, range_bytes: int,
                      flight_bytes: int) -> Callable[[], None]:
    """Sends the first reads of `box` now; what it returns lands them all in `out`.

    Each stored chunk's rows in `box` are a run of its bytes, read in byte
    ranges of whole rows of at most `range_bytes`, with up to `flight_bytes`
    of them in flight at once: from a bucket one request a range, each on a
    connection of its own, where TensorStore reads a chunk in one request.
    A 14.6 MiB raw chunk through a link of 20 ms and 200 MB/s a connection
    (/tmp script, 3 reads a mode, fresh processes): 0.21 s in one
    TensorStore read, 0.09-0.11 s in 4-8 ranges at once, peaking 24-27 MiB
    beyond nothing (the first read of a process 34-37 MiB), against 28 MiB
    (43 MiB) for TensorStore's read.  The call holds `out`, the reads in
    flight and the one being landed (`cost.ranged_read_charge`).

    Only boxes `can_read_into` accepts; others raise NotImplementedError
    before anything is read (read them with `read_pieces` or TensorStore).

    Example:

      out = hostmem.empty_aligned((rows, cols), w.dtype)
      finish = w.start_read_into((slice(0, rows), slice(0, cols)), out, 2 << 20, 32 << 20)
      ...                # other reads go out meanwhile
      finish()           # out holds the box
    """
    if not self.can_read_into(box, range_bytes):
      raise _unsupported(self.name, f'reading {box} straight into a buffer (zstd, F'
                         ' order, a foreign byte order, 0-d, rows over a range, or'
                         ' chunks the box cuts on an axis other than the first)')
    lo, hi = self._bounds(box)
    if (tuple(out.shape) != tuple(b - a for a, b in zip(lo, hi)) or out.dtype != self.dtype):
      raise ValueError(f'out has shape {out.shape} and dtype {out.dtype}; reading'
                       f' {box} of array {self.name!r} needs'
                       f' {tuple(b - a for a, b in zip(lo, hi))} of {self.dtype}.')
    c = self.chunk_shape
    row = math.prod(c[1:]) * self.dtype.itemsize
    step = max(range_bytes // row, 1)  # rows a range

    def jobs():
      """(destination view, kept part of the stored rows, bytes, future-maker)."""
      grid = [range(a // n, (b - 1) // n + 1) for a, b, n in zip(lo, hi, c)]
      for g in itertools.product(*grid):
        origin = [i * n for i, n in zip(g, c)]
        first, last = max(lo[0], origin[0]), min(hi[0], origin[0] + c[0])
        keep = tuple(slice(0, min(n, b - o)) for o, b, n in zip(origin[1:], hi[1:], c[1:]))
        cols = tuple(slice(o - a, o - a + k.stop) for o, a, k in zip(origin[1:], lo[1:], keep))
        blob = self._locate(g)
        for r in range(first, last, step):
          n = min(step, last - r)
          dst = out[(slice(r - lo[0], r - lo[0] + n), *cols)]
          at = (r - origin[0]) * row
          yield dst, keep, n * row, (None if blob is None else
                                     functools.partial(self._read, blob, at, at + n * row))

    pending: collections.deque = collections.deque()
    todo = jobs()
    state = {'in_flight': 0}

    def send() -> None:
      for dst, keep, size, read in todo:
        pending.append((dst, keep, size, None if read is None else read()))
        state['in_flight'] += size
        if state['in_flight'] >= flight_bytes:
          return

    def finish() -> None:
      while pending:
        dst, keep, size, future = pending.popleft()
        r = future.result() if future is not None else None
        del future
        state['in_flight'] -= size
        if r is None or r.state == 'missing':  # an absent chunk: the fill value
          dst[...] = self.fill_value
        else:
          value = r.value if r.state == 'value' else b''  # a copy each time it is asked
          del r
          if len(value) != size:
            raise ValueError(f'array {self.name!r}: a stored chunk is shorter than its'
                             ' shape says; the checkpoint is corrupt or being rewritten.')
          dst[...] = np.frombuffer(value, self.dtype).reshape(
              -1, *self.chunk_shape[1:])[(slice(None), *keep)]
          del value
        if state['in_flight'] < flight_bytes:
          send()

    send()
    return finish

  def state_bytes(self, max_piece_bytes: int) -> int:
    """What a `read_pieces` call holds beyond its 2 pieces (bytes), at most.

    Raw: byte-range reads in flight (TensorStore keeps ~3 copies while one
    lands).  zstd: ~3 copies of the compressed window, the reads in flight
    ahead of it (`_READ_AHEAD` windows), the skip buffer, and the decoder's
    window, read from the stored frame header (zstd sizes its
    buffer from it: 512 KiB at Orbax's zarr v2 level 1).
    """
    limit = max(int(max_piece_bytes), self.dtype.itemsize)
    if not self.compressed:
      return 3 * max(limit // 4, _MIN_READ)
    return ((3 + _READ_AHEAD) * _zstd_window(limit) + min(limit, _MAX_SKIP)
            + self._decoder_window())

  def cursor_bytes(self, max_piece_bytes: int) -> int:
    """What one decoder kept between calls holds (bytes), at most; 0 if raw.

    Its window, the last compressed read it was fed and the reads in flight
    ahead of it, its context.  Up to `max_cursors` are kept (`_cursor`).
    """
    if not self.compressed:
      return 0
    limit = max(int(max_piece_bytes), self.dtype.itemsize)
    return self._decoder_window() + (1 + _READ_AHEAD) * _zstd_window(limit) + _DCTX_BYTES

  def close(self) -> None:
    """Closes the decoders kept between calls (their memory goes)."""
    while self._cursors:
      self._cursors.popitem()[1].close()

  def _cursor(self, blob: '_Blob', start: int, window: int) -> '_Cursor':
    """The kept decoder of `blob` if it is at or before `start`, else a new one."""
    key = (blob.key, blob.offset)
    cur = self._cursors.get(key)
    if cur is not None and cur.pos > start:
      del self._cursors[key]
      cur.close()
      cur = None
    if cur is None:
      # When all are taken, one that has decoded its whole chunk goes (a
      # reader that moves on from a chunk it read to the end); else the
      # newest: reading k chunks in turn with c < k kept, the first c - 1
      # keep theirs and only the others restart ((k - c + 1) / k of the
      # reads).  Least recently used first, every read restarted.
      while len(self._cursors) >= max(1, self.max_cursors):
        done = next((k for k, c in self._cursors.items() if c.pos >= self.chunk_nbytes), None)
        (self._cursors.pop(done) if done is not None
         else self._cursors.popitem(last=True)[1]).close()
      cur = _Cursor(self, blob, window)
      self._cursors[key] = cur
    return cur

  def _decoder_window(self) -> int:
    """zstd window of this array's frames (first chunk); 8 MiB if unknown."""
    if getattr(self, '_window', None) is None:
      self._window = 8 << 20  # zstd's default window bound up to level 19
      blob = self._locate((0,) * len(self.shape))
      if blob is not None:
        try:
          head = self._read(blob, 0, 18).result().value
          self._window = int(_zstd().get_frame_parameters(head).window_size) or self._window
        except (ValueError, _zstd().ZstdError):
          pass
    return self._window

  def _bounds(self, box: Box) -> Bounds:
    if len(box) != len(self.shape):
      raise ValueError(f'box {box} has {len(box)} dimensions; array '
                       f'{self.name!r} has shape {self.shape}.')
    ranges = [s.indices(n) for s, n in zip(box, self.shape)]
    if any(step != 1 for _, _, step in ranges):
      raise ValueError(f'box {box}: slices must have step 1.')
    return (tuple(a for a, _, _ in ranges),
            tuple(max(a, b) for a, b, _ in ranges))

  def _read(self, blob: _Blob, a: int = 0, b: int | None = None):
    """Future of bytes [a, b) of `blob` (b=None: to its end)."""
    if b is None and blob.size is not None:
      b = blob.size
    fresh = _fresh(self.staleness_bound)
    if a == 0 and b is None and blob.offset == 0:
      return self._kv.read(blob.key, **fresh)
    stop = None if b is None else blob.offset + b
    return self._kv.read(blob.key, byte_range=slice(blob.offset + a, stop), **fresh)

  def _locate(self, g) -> _Blob | None:
    """Where chunk `g` is stored; None if known to be absent."""
    if self._shard is None:
      return _Blob(self._key(g))
    per, end, crc = self._shard
    key = self._key([i // p for i, p in zip(g, per)])
    # One tuple read once: a ranged read (`start_read_into`) locates chunks
    # from its reader's thread and from the thread that lands its ranges.
    cached = self._index_cache
    if cached[0] != key:
      n = math.prod(per)
      size = 16 * n + 4 * crc
      r = self._kv.read(key, byte_range=slice(-size, None) if end
                        else slice(0, size), **_fresh(self.staleness_bound)).result()
      index = None
      if r.state == 'value':
        raw = r.value
        if crc and integrity.available() and integrity.crc32c(
            np.frombuffer(raw[:-4], np.uint8)) != int.from_bytes(
            raw[-4:], 'little'):
          raise ValueError(f'array {self.name!r}: shard {key} has a bad index '
                           'checksum; the checkpoint is corrupt.')
        index = np.frombuffer(raw, '<u8', count=2 * n).reshape(n, 2)
      cached = self._index_cache = (key, index)
    index = cached[1]
    if index is None:
      return None
    i = np.ravel_multi_index([i % p for i, p in zip(g, per)], per) if per else 0
    offset, nbytes = (int(x) for x in index[i])
    return None if offset == _ABSENT else _Blob(key, offset, nbytes)

  def _chunk(self, g, lo, hi, limit: int, into: np.ndarray | None = None
             ) -> Iterator[tuple[Bounds, np.ndarray]]:
    """Pieces of chunk `g` over chunk-local [lo, hi), in user axis order.

    `into`: [lo, hi) of the caller's buffer; slabs decoded into it directly
    are not yielded.
    """
    blob, value = self._locate(g), None
    small = self.chunk_nbytes <= max(limit // 4, self._stored.itemsize)
    if blob is not None and (small or (blob.size is None and blob.key not in self._present)):
      # Small chunk: read it whole.  Big unsharded one: does the key exist?
      # (Asked once: a read in pieces comes back to the same chunk.)
      r = (self._read(blob) if small else self._read(blob, 0, 0)).result()
      blob, value = (blob if r.state == 'value' else None), r.value
      del r
      if blob is not None and not small:
        self._present.add(blob.key)
    if blob is None:
      for plo, phi in _split(lo, hi, *_level(
          [b - a for a, b in zip(lo, hi)], self.dtype.itemsize, limit)):
        yield (plo, phi), np.full([b - a for a, b in zip(plo, phi)],
                                  self.fill_value, self.dtype)
      return
    f = self.order == 'F'
    slo, shi = (lo[::-1], hi[::-1]) if f else (lo, hi)
    if small:
      if self.compressed:
        value = _zstd().ZstdDecompressor().decompress(
            value, max_output_size=self.chunk_nbytes)
      if len(value) != self.chunk_nbytes:
        raise ValueError(f'array {self.name!r}: chunk {g} holds {len(value)} '
                         f'bytes, expected {self.chunk_nbytes}; the checkpoint '
                         'is corrupt.')
      whole = np.frombuffer(value, self._stored).reshape(self._storage_shape)
      pieces = iter([((slo, shi), whole[(*map(slice, slo, shi), ...)])])
      del value, whole
    elif self.compressed:
      direct = into is not None and not f and self._stored == self.dtype
      pieces = self._zstd(blob, slo, shi, limit, into if direct else None)
    else:
      pieces = self._raw(blob, slo, shi, limit)
    for (plo, phi), view in pieces:
      data = np.asarray(view.T if f else view, order='C')
      del view
      if data.dtype != self.dtype:
        data = data.astype(self.dtype)
      elif not data.flags.writeable:
        data = data.copy()
      yield ((plo[::-1], phi[::-1]) if f else (plo, phi)), data
      del data

  def _raw(self, blob: _Blob, lo, hi, limit: int):
    """Pieces of a raw chunk, each from the byte ranges it covers."""
    c, n, s = self._storage_shape, len(lo), self._stored.itemsize
    stride = [s * math.prod(c[j + 1:]) for j in range(n)]
    flight = max(limit // 4, _MIN_READ) // s * s  # bytes of reads in flight
    most = min(flight, max(_MAX_READ // s, 1) * s)  # bytes per read
    level = _level([b - a for a, b in zip(lo, hi)], s, limit)
    for plo, phi in _split(lo, hi, *level):
      piece = hostmem.empty_aligned([b - a for a, b in zip(plo, phi)], self._stored)
      flat = piece.reshape(-1).view(np.uint8)
      # Read box: the piece, widened to whole rows where that merges reads
      # without reading more than twice the bytes (or rows <= _SMALL_ROW).
      elo, ehi, m = list(plo), list(phi), _run_axis(plo, phi, c)
      while m > 0 and math.prod(piece.shape[:m]) > 1:
        run, whole = (ehi[m] - elo[m]) * stride[m], c[m] * stride[m]
        if whole > most or (whole > 2 * run and whole > _SMALL_ROW):
          break
        elo[m], ehi[m] = 0, c[m]
        m = _run_axis(elo, ehi, c)
      r0 = max(m, 0)  # runs: one per index on axes < r0, contiguous after
      if stride[r0] > most:  # too long to read in groups of rows: no widening
        elo, ehi, r0 = plo, phi, max(_run_axis(plo, phi, c), 0)
      widened = tuple(elo) != plo or tuple(ehi) != phi
      rows, row = phi[r0] - plo[r0], stride[r0]  # E = the piece on axis r0
      run_bytes = rows * row
      cut = (slice(None),) + tuple(
          slice(plo[j] - elo[j], phi[j] - elo[j]) for j in range(r0 + 1, n))
      pending, in_flight, g = [], 0, max(most // row, 1)
      for o in itertools.product(*(range(plo[j], phi[j]) for j in range(r0))):
        start = sum(i * st for i, st in zip(o, stride)) + plo[r0] * row
        rel = tuple(i - a for i, a in zip(o, plo))
        if widened:  # reads of g whole rows (<= most bytes), cut to the piece
          jobs = [(piece[rel + (slice(x, x + g),)],
                   (min(g, rows - x),) + tuple(c[r0 + 1:]), cut,
                   start + x * row, min(g, rows - x) * row)
                  for x in range(0, rows, g)]
        else:  # a contiguous part of the piece, in reads of <= most bytes
          d = sum(i * st for i, st in zip(rel, piece.strides))
          jobs = [(flat[d + x:d + min(x + most, run_bytes)], None, None,
                   start + x, min(most, run_bytes - x))
                  for x in range(0, run_bytes, most)]
        for dst, shape, sel, a, size in jobs:
          if pending and (in_flight + size > flight or len(pending) >= _MAX_READS):
            self._land(pending)
            in_flight = 0
          pending.append((dst, shape, sel, self._read(blob, a, a + size)))
          in_flight += size
      self._land(pending)
      del flat
      yield (plo, phi), piece
      del piece

  def _land(self, pending) -> None:
    """Copies finished reads into their destinations, freeing each at once."""
    for i, (dst, shape, sel, future) in enumerate(pending):
      pending[i] = None
      r = future.result()
      del future
      if r.state != 'value':
        raise FileNotFoundError(f'array {self.name!r}: a chunk vanished while '
                                'being read; is the checkpoint being deleted?')
      value = r.value
      del r
      if shape is None:
        dst[:] = np.frombuffer(value, np.uint8)
      else:
        dst[...] = np.frombuffer(value, self._stored).reshape(shape)[sel]
      del value
    pending.clear()

  def _zstd(self, blob: _Blob, lo, hi, limit: int, into: np.ndarray | None = None):
    """Pieces of a zstd chunk, stream-decompressed from its start.

    `into` (C order, [lo, hi) of the caller's buffer): a slab of whole rows
    that is a contiguous run of it is decoded there, and not yielded.
    """
    c, n, s = self._storage_shape, len(lo), self._stored.itemsize
    stride = [s * math.prod(c[j + 1:]) for j in range(n)]
    k, q = _level(c, s, limit)
    cut = (slice(None),) * (k + 1) + tuple(
        slice(lo[j], hi[j]) for j in range(k + 1, n))
    whole_rows = all(lo[j] == 0 and hi[j] == c[j] for j in range(k + 1, n))
    window = _zstd_window(limit)
    skip = memoryview(bytearray(min(limit, _MAX_SKIP)))
    cur = None
    for plo, phi in _split(lo, hi, k, q):
      start = sum(plo[j] * stride[j] for j in range(k + 1))
      cur = cur or self._cursor(blob, start, window)
      target = None
      if into is not None and whole_rows:
        target = into[tuple(plo[j] - lo[j] for j in range(k))
                      + (slice(plo[k] - lo[k], phi[k] - lo[k]),)]
        if not (target.flags.c_contiguous and target.flags.writeable):
          target = None
      try:
        while cur.pos < start:  # decompress and drop the bytes before the slab
          cur.pos += self._fill_from(cur.reader, skip[:min(len(skip), start - cur.pos)])
        slab = target if target is not None else hostmem.empty_aligned(
            (1,) * k + (phi[k] - plo[k],) + tuple(c[k + 1:]), self._stored)
        cur.pos += self._fill_from(cur.reader, slab.reshape(-1).view(np.uint8))
      except BaseException:
        # Its position is unknown now: never resume it.
        self._cursors.pop((blob.key, blob.offset), None)
        cur.close()
        raise
      if target is None:
        yield (plo, phi), slab[cut]
      del slab, target

  def _fill_from(self, reader, buf) -> int:
    done, view = 0, memoryview(buf)
    while done < len(view):
      got = reader.readinto(view[done:])
      if not got:
        raise ValueError(f'array {self.name!r}: a zstd chunk ended early; the '
                         'checkpoint is corrupt.')
      done += got
    return done


class _Cursor:
  """A zstd chunk's stream decoder and how far into the chunk it has decoded."""

  def __init__(self, array: StoredArray, blob: '_Blob', window: int):
    self.source = _Source(array, blob)
    self.reader = _zstd().ZstdDecompressor().stream_reader(self.source, read_size=window)
    self.pos = 0

  def close(self) -> None:
    self.reader.close()
    self.source.close()  # drops its reads in flight


class _Source:
  """A blob as a file for zstandard: each read() is one byte-range read.

  The next `_READ_AHEAD` reads are in flight while the decoder works on the
  last one (zstandard asks for `read_size` bytes at a time, from the start):
  reading and decompressing overlap instead of taking turns.
  """

  def __init__(self, array: StoredArray, blob: _Blob):
    self._array, self._blob, self._pos, self._end = array, blob, 0, blob.size
    self._ahead: collections.deque = collections.deque()  # (start, stop, future)
    self._next = 0  # where the next read-ahead starts

  def _issue(self, n: int) -> None:
    stop = self._next + n if self._end is None else min(self._next + n, self._end)
    if stop > self._next:
      read = self._array._read  # pylint: disable=protected-access
      self._ahead.append((self._next, stop, read(self._blob, self._next, stop)))
      self._next = stop

  def close(self) -> None:
    self._ahead.clear()

  def read(self, n: int = -1) -> bytes:
    if self._end is not None:
      n = min(n, self._end - self._pos)
    if n <= 0:
      return b''
    if not self._ahead or self._ahead[0][0] != self._pos or self._ahead[0][1] - self._pos != n:
      self._ahead.clear()
      self._next = self._pos
    while len(self._ahead) < 1 + _READ_AHEAD and (self._end is None or self._next < self._end):
      self._issue(n)
    _, _, future = self._ahead.popleft()
    try:
      value = future.result().value
    except ValueError as e:  # the value ends before pos + n: read the rest
      if 'OUT_OF_RANGE' not in str(e) or self._end is not None:
        raise
      self._ahead.clear()
      value = self._array._read(self._blob, self._pos).result().value  # pylint: disable=protected-access
      self._end = self._pos + len(value)
    del future
    self._pos += len(value)
    return value


def read_box(kvstore: ts.KvStore, name: str, box: Box,
             max_piece_bytes: int) -> np.ndarray:
  """Reads `box` of array `name` into one new array, piece by piece."""
  array = StoredArray.open(kvstore, name)
  lo, hi = array._bounds(box)  # pylint: disable=protected-access
  out = np.empty([b - a for a, b in zip(lo, hi)], array.dtype)
  for sub, data in array.read_pieces(box, max_piece_bytes):
    out[tuple(slice(s.start - a, s.stop - a) for s, a in zip(sub, lo))] = data
  return out
