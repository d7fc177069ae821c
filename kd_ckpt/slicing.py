"""Slice geometry shared by the writer and the reader: chunk grids and slice boxes.

A stored array's zarr chunk grid decides what can be read or written without
touching neighbours: the streaming writer chooses chunks of at most one slice
that never straddle two shards (two writers on one chunk would race), and
cuts each shard into slices of whole chunks; the reader cuts a target shard
the same way.

Example:

  chunk = slicing.chunk_shape((4096, 1024), 4, 8 << 20)     # (2048, 1024)
  for box in slicing.boxes((4096, 1024), chunk, 4, 8 << 20):
    ...                                                    # 2 slices of 8 MiB
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from typing import Sequence

Box = tuple[slice, ...]


# A shard that no divisor cuts into chunks near the slice (prime on every
# axis another writer shares: 3547 x 4729 floats could only be chunked in
# rows of 19 KB, 28,000 chunks where Orbax writes 8) is one chunk when it is
# at most two slices: it is then written as one slice, charged whole, which
# the capacity holds (`cost.streaming_layout` sizes slices so that two with
# TensorStore's copy fit).
TINY_CHUNK_FRACTION = 16
WHOLE_SHARD_SLICES = 2


def chunk_shape(
    local_shape: Sequence[int], itemsize: int, slice_bytes: int, *,
    global_shape: Sequence[int] | None = None, rows_first: bool = False,
    up_to_bytes: int = 0,
) -> tuple[int, ...]:
  """A zarr chunk shape that tiles `local_shape` in pieces of <= slice_bytes.

  Every chunk dim divides the shard's, so no chunk straddles two shards (two
  writers on one chunk would race).  Greedy: while the chunk is too big,
  step the one dim whose next smaller divisor keeps the chunk largest.  A
  dim one shard spans whole is cut into chunks of even size (the array's
  end cuts the last one, which is stored whole, padding included), or of
  its divisor where one is at least 3/4 of that size (no chunk cut).  A
  shard whose chunks would all be tiny (under 1/16 of a slice) is one chunk
  if it is at most two slices.
  Orbax's own chooser always splits the largest dim first, which for a dim
  with no small divisor (e.g. 1907 rows, prime) falls straight to 1: 4 KiB
  chunks, 250,000 OCDBT keys for 1 GB, 5x slower and +100 MiB of B-tree.

  `rows_first` (the streaming writer): bands of whole trailing dims first
  (`_row_band`), where such a band of at least half a slice tiles the
  shard; the greedy chooser otherwise.

  `up_to_bytes` (a save whose slices the state made smaller than its budget
  allows, `cost.streaming_layout`): where the chunks of `slice_bytes` would
  be under half of it (no divisor near it on a shared axis: a shard of
  32191 x 521 floats in 16 MiB gets 1-column chunks), those of up to
  `up_to_bytes`, as the budget alone would give.
  """
  if up_to_bytes > slice_bytes:
    chunk = chunk_shape(local_shape, itemsize, slice_bytes, global_shape=global_shape,
                        rows_first=rows_first)
    if 2 * math.prod(chunk) * itemsize >= slice_bytes or chunk == tuple(
        max(1, int(d)) for d in local_shape):
      return chunk
    return chunk_shape(local_shape, itemsize, up_to_bytes, global_shape=global_shape,
                       rows_first=rows_first)
  shape = tuple(int(d) for d in local_shape)
  whole = tuple(int(g) == n for g, n in zip(global_shape or (), shape)) or (False,) * len(shape)
  if not shape:
    return ()
  if math.prod(shape) * itemsize <= slice_bytes or 0 in shape:
    return tuple(max(1, d) for d in shape)
  if rows_first:
    band = _row_band(shape, whole, itemsize, slice_bytes)
    if band is not None:
      return band
  chunk = list(shape)
  while math.prod(chunk) * itemsize > slice_bytes:
    best = None
    for a, n in enumerate(shape):
      smaller = _next_smaller_divisor(n, chunk[a])
      if whole[a] and chunk[a] > 1:
        # One shard spans this dim: chunks need not divide it (the last
        # one is cut by the array's end, not by another writer's shard).
        rest = math.prod(chunk) // chunk[a] * itemsize
        fit = max(1, min(chunk[a] - 1, slice_bytes // max(1, rest)))
        smaller = max(smaller or 1, fit)
      if smaller is None:
        continue
      size = math.prod(chunk) // chunk[a] * smaller
      # Largest resulting chunk; on ties split the leading dim (slices stay
      # long contiguous runs in C order).
      key = (size, -a)
      if best is None or key > best[0]:
        best = (key, a, smaller)
    if best is None:
      break
    chunk[best[1]] = best[2]
  if (math.prod(chunk) * itemsize * TINY_CHUNK_FRACTION < slice_bytes
      and math.prod(shape) * itemsize <= WHOLE_SHARD_SLICES * slice_bytes):
    return shape
  for a, n in enumerate(shape):
    if whole[a] and chunk[a] < n:
      # As many chunks along the dim, evened out: the last one is stored
      # whole, so a chunk of 1030 of 1031 columns stored (and wrote) the
      # leaf twice; 2 x 516 stores one column more.
      even = -(-n // -(-n // chunk[a]))
      # Unless a divisor of the dim is nearly as big: then no chunk is cut.
      # TensorStore writes a cut chunk by filling a whole one and copying
      # the slice in (0.06 s for 36 MiB here), where a whole chunk is taken
      # as it is: 4 leaves of 2**26 zeros, 0.42 s with 9586981 (one cut
      # chunk a leaf) against 0.17 s with 2**23.
      divisor = _next_smaller_divisor(n, chunk[a] + 1)
      chunk[a] = divisor if 4 * divisor >= 3 * even else even
  return tuple(chunk)


def read_grid(extent: Sequence[int], itemsize: int, piece_bytes: int) -> tuple[int, ...]:
  """Boxes of at most `piece_bytes` that tile `extent`, for a reader filling one buffer.

  `chunk_shape`'s grid, unless that made the extent one chunk bigger than a
  piece (`WHOLE_SHARD_SLICES`: a writer charges such a shard whole, but a
  read of it is held beside the buffer it lands in: a (1031, 1031) f32
  shard in pieces of 2.2 MiB, staged on the host, needed 5.4 pieces where
  the capacity holds 5, and the restore waited forever).  One reader may
  cut anywhere: every dim is then cut evenly, as a dim one shard spans
  whole is.

    slicing.read_grid((1031, 1031), 4, 2_350_080)   # (516, 1031)
  """
  grid = chunk_shape(extent, itemsize, piece_bytes)
  if math.prod(grid) * itemsize <= piece_bytes:
    return grid
  return chunk_shape(extent, itemsize, piece_bytes, global_shape=extent)


def _row_band(shape: tuple[int, ...], whole: Sequence[bool], itemsize: int,
              slice_bytes: int) -> tuple[int, ...] | None:
  """Chunks of whole trailing dims: each one C-order run of the shard.

  A slice of such chunks is one contiguous copy off the device and one
  contiguous chunk for TensorStore, where the greedy chooser's column cuts
  (it keeps the chunk largest) make strided copies.  At 256 MiB (32 MiB
  slices; `bench/ab_save.py --variants now,cols`, alternating in one
  process, bench/results/ab_save_rows.md): a 128 MiB leaf saved in 0.25 s
  against 0.32 s, a 1.07 GB leaf 1.01 s against 1.29 s; the 4 GB leaf
  (264, 31622) chunks against (528, 15811) and the Gemma-like state were
  within the reps' spread (2.58 / 2.51 s, 2.11 / 1.99 s).

  None (the greedy chooser decides) where no band of at least half a slice
  tiles the shard: a shared dim without a divisor near the rows that fit,
  or a last dim bigger than a slice.  The dims before the band's are cut
  to 1; a dim one shard spans whole is cut evenly, its last chunk cut by
  the array's end, unless a divisor is nearly as big (as in `chunk_shape`).
  """
  k = 0
  while k < len(shape) - 1 and math.prod(shape[k + 1:]) * itemsize > slice_bytes:
    k += 1
  if k == len(shape) - 1:
    return None  # the last dim alone is more than a slice: the greedy cuts it
  run = math.prod(shape[k + 1:]) * itemsize
  fit = min(shape[k], slice_bytes // run)
  rows = _next_smaller_divisor(shape[k], fit + 1) or 1
  if whole[k]:
    even = -(-shape[k] // -(-shape[k] // fit))
    rows = rows if 4 * rows >= 3 * even else even
  if 2 * rows * run < slice_bytes:
    return None
  return (1,) * k + (rows,) + shape[k + 1:]


def _next_smaller_divisor(n: int, current: int) -> int | None:
  """The largest divisor of n below `current`; None if there is none."""
  divs = _divisors(n)
  i = bisect.bisect_left(divs, current)
  return divs[i - 1] if i else None


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
  """n's divisors, ascending, by trial division up to sqrt(n).

  Not a scan down from the current chunk: that was O(n) Python steps, 4.7 s
  to choose the chunks of one 1-D leaf of 2**26 floats (20 s at 2**28)
  before a byte was written or read; this is 8,192 steps for the former.
  """
  low, high = [], []
  for d in range(1, math.isqrt(n) + 1):
    if n % d == 0:
      low.append(d)
      if d != n // d:
        high.append(n // d)
  return tuple(low + high[::-1])


def boxes(
    local_shape: Sequence[int], chunk: Sequence[int], itemsize: int, slice_bytes: int
):
  """Yields tuples of python slices covering `local_shape`, each whole chunks.

  Consecutive chunks along the last axis the chunk cuts are grouped up to
  `slice_bytes` (chunks are smaller than a slice when dims divide poorly).
  """
  shape = list(local_shape)
  if not shape:
    yield ()
    return
  split = max((a for a in range(len(shape)) if chunk[a] != shape[a]), default=None)
  if split is None:
    yield tuple(slice(0, n) for n in shape)
    return
  chunk_bytes = math.prod(chunk) * itemsize
  step = chunk[split] * max(1, slice_bytes // max(1, chunk_bytes))
  grids = [range(0, shape[a], chunk[a]) for a in range(split)]
  for starts in itertools.product(*grids):
    head = tuple(slice(st, min(st + chunk[a], shape[a])) for a, st in enumerate(starts))
    for start in range(0, shape[split], step):
      yield (
          head
          + (slice(start, min(shape[split], start + step)),)
          + tuple(slice(0, n) for n in shape[split + 1:])
      )


def _row_cut(shape: Sequence[int], itemsize: int, slice_bytes: int) -> tuple[int, int]:
  """(axis, rows): the first axis whose trailing run fits, and its rows per box."""
  k = 0
  while k < len(shape) - 1 and math.prod(shape[k + 1:]) * itemsize > slice_bytes:
    k += 1
  return k, max(1, min(shape[k], slice_bytes // max(1, math.prod(shape[k + 1:]) * itemsize)))


def row_box_shape(local_shape: Sequence[int], itemsize: int, slice_bytes: int
                  ) -> tuple[int, ...]:
  """A C-order run of <= slice_bytes: whole trailing dims, as many rows as fit."""
  shape = [int(n) for n in local_shape]
  if not shape or 0 in shape:
    return tuple(shape)
  k, rows = _row_cut(shape, itemsize, slice_bytes)
  return (1,) * k + (rows,) + tuple(shape[k + 1:])


def tile_shape(local_shape: Sequence[int], chunk: Sequence[int], itemsize: int,
               tile_bytes: int) -> tuple[int, ...]:
  """The largest box of <= tile_bytes made of whole stored chunks (or one
  C-order run inside a chunk, when a chunk is bigger), clipped to the shard.

  Reads of whole chunks decode nothing twice; trailing axes grow first.

    slicing.tile_shape((4096, 1024), (512, 1024), 4, 8 << 20)  # (2048, 1024)
  """
  shape = [int(n) for n in local_shape]
  if not shape or 0 in shape:
    return tuple(shape)
  unit = [max(1, min(int(c), n)) for c, n in zip(chunk, shape)]
  if math.prod(unit) * itemsize > tile_bytes:
    return row_box_shape(unit, itemsize, tile_bytes)
  box = list(unit)
  for a in reversed(range(len(box))):
    fit = tile_bytes // (math.prod(box) * itemsize)
    box[a] = min(shape[a], box[a] * max(1, fit))
  return tuple(box)


def even_tile(local_shape: Sequence[int], tile: Sequence[int], chunk: Sequence[int],
              max_steps: int = 4096) -> tuple[int, ...]:
  """`tile`, shrunk by at most half on each axis to divide the shard evenly.

  `tiles` moves the last tile back over its neighbour when the tile does
  not divide the shard; a stream decoder would then decode the chunk again
  from its start.  Whole stored chunks stay whole.

    slicing.even_tile((1000, 8), (300, 8), (1000, 8))  # (250, 8)
  """
  out = []
  for n, t, c in zip(local_shape, tile, chunk):
    n, t, c = int(n), int(t), int(c)
    best = t
    if t and n % t:
      for d in range(t, max(t // 2, t - max_steps, 1) - 1, -1):
        if n % d == 0 and (c >= n or c > t or d % c == 0):
          best = d
          break
    out.append(best)
  return tuple(out)


def tiles(local_shape: Sequence[int], tile: Sequence[int], *, partial: bool = False):
  """Boxes of shape `tile` covering `local_shape`; the last one along each
  axis is moved back to end at the shard's end (overlapping its neighbour),
  so every box has one shape.  `partial`: the last one is cut short at the
  shard's end instead (no overlap; boxes of up to two extents an axis).

    list(tiles((10, 4), (4, 4)))  # rows 0-4, 4-8, 6-10
    list(tiles((10, 4), (4, 4), partial=True))  # rows 0-4, 4-8, 8-10
  """
  shape = [int(n) for n in local_shape]
  if partial:
    bounds = [[(s, min(s + t, n)) for s in range(0, n, t)] for n, t in zip(shape, tile)]
    for corner in itertools.product(*bounds):
      yield tuple(slice(a, b) for a, b in corner)
    return
  starts = [sorted({min(s, n - t) for s in range(0, n, t)}) for n, t in zip(shape, tile)]
  for corner in itertools.product(*starts):
    yield tuple(slice(s, s + t) for s, t in zip(corner, tile))


def tile_shapes(local_shape: Sequence[int], tile: Sequence[int], *,
                partial: bool = False) -> set[tuple[int, ...]]:
  """The shapes of `tiles(local_shape, tile, partial=...)`'s boxes.

    tile_shapes((10, 4), (4, 4), partial=True)  # {(4, 4), (2, 4)}
  """
  if not partial:
    return {tuple(int(t) for t in tile)}
  extents = [{int(t)} | ({int(n) % int(t)} if int(n) % int(t) else set())
             for n, t in zip(local_shape, tile)]
  return set(itertools.product(*extents))


def offset(index: tuple[slice, ...], box: tuple[slice, ...], shape) -> tuple[slice, ...]:
  """`box` (relative to a shard) moved to global coordinates of `index`."""
  out = []
  for s, b, n in zip(index, box, shape):
    start = (s.start or 0) if isinstance(s, slice) else 0
    out.append(slice(start + b.start, start + b.stop))
  return tuple(out)


def pairs(index: Sequence[object], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  """A tuple of python slices (open ends allowed) as ((start, stop), ...)."""
  out = []
  for s, n in zip(index, shape):
    if isinstance(s, slice):
      start, stop, _ = s.indices(int(n))
    else:
      start, stop = int(s), int(s) + 1
    out.append((int(start), int(stop)))
  return tuple(out)


def from_pairs(box: Sequence[Sequence[int]]) -> Box:
  return tuple(slice(int(a), int(b)) for a, b in box)


def nbytes(box: Box, itemsize: int) -> int:
  return math.prod(s.stop - s.start for s in box) * itemsize


def aligned_nbytes(box: Box, chunk: Sequence[int], itemsize: int) -> int:
  """Bytes of the whole chunks of grid `chunk` that `box` touches (what a read decodes)."""
  return math.prod((-(-s.stop // max(1, c)) - s.start // max(1, c)) * max(1, c)
                   for s, c in zip(box, chunk)) * itemsize


def num_chunks(box: Box, chunk: Sequence[int]) -> int:
  """Chunks of grid `chunk` that `box` (aligned to it) touches."""
  return math.prod(-(-(s.stop - s.start) // max(1, c)) for s, c in zip(box, chunk))


def contiguous(chunk: Sequence[int], box: Box) -> bool:
  """Whether each chunk is one contiguous run of a C-order buffer of `box`.

  True when the chunk is partial along at most one axis, then whole along
  the rest: TensorStore can then reference the buffer instead of copying it
  into per-chunk buffers.  Never for a chunk with an extent of 1 on any
  axis: TensorStore copies those, wherever the dim is (tensorstore 0.1.x,
  `can_reference_source_data_indefinitely`: 64 MiB written in chunks of
  (1, 4096) or (4096, 1, 2048) took 68-78 MiB; in chunks of (1024, 4096),
  4.6 MiB).
  """
  if 1 in chunk:
    return False
  dims = [s.stop - s.start for s in box]
  axes = [a for a in range(len(dims)) if chunk[a] < dims[a]]
  if not axes:
    return True
  first = next((a for a in range(len(dims)) if min(chunk[a], dims[a]) > 1), len(dims))
  return all(chunk[a] >= dims[a] for a in range(first + 1, len(dims)))


def interleaved(chunk: Sequence[int], local_shape: Sequence[int],
                global_shape: Sequence[int]) -> bool:
  """Whether a shard's chunk keys interleave with other shards' in the stored order.

  True when the shard covers part of the array's last axis and is cut into
  several chunks along a leading one: in C order (zarr's chunk keys, OCDBT's
  B-tree) each of its chunk rows then sits between other shards' chunks.
  Measured to cost TensorStore/OCDBT about as much per staged byte as a copy
  (`cost.STAGED_COPY_FACTOR`): a 4x2 mesh whose shards are prime on both
  axes (1-row chunks) peaked at 1.4x a 160 MiB budget charged as contiguous.
  """
  if not local_shape or len(local_shape) < 2:
    return False
  partial_last = int(local_shape[-1]) < int(global_shape[-1])
  cut_leading = any(int(c) < int(n) for c, n in zip(chunk[:-1], local_shape[:-1]))
  return partial_last and cut_leading
