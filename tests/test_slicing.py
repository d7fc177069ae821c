"""Chunk grids for shards of any size: exact, and chosen without scanning a dim."""

import itertools
import math
import signal

import pytest

from kd_ckpt import slicing


def _scan(n: int, current: int):
  """The definition: the largest divisor of n below current, by scanning."""
  return next((d for d in range(current - 1, 0, -1) if n % d == 0), None)


@pytest.mark.parametrize('n', [1, 2, 3, 12, 97, 360, 1024, 1907, 2310, 4093 * 2, 9973, 65536,
                               720720, 1_000_003])
def test_next_smaller_divisor_is_the_scan(n):
  currents = sorted({1, 2, 3, n // 3 + 1, n // 2, n // 2 + 1, n - 1, n, n + 5} - {0})
  if n <= 2_500:
    currents = range(1, n + 2)
  for c in currents:
    assert slicing._next_smaller_divisor(n, c) == _scan(n, c), (n, c)  # pylint: disable=protected-access


@pytest.mark.parametrize('shape,whole', [
    ((2**26,), True), ((2**26,), False), ((2 * 33_554_393,), False),  # 2 x a prime
    ((1_000_003, 7), False), ((31_622, 31_622), True), ((3, 2**25), False),
])
def test_chunks_of_a_huge_dim_tile_the_shard_within_the_slice(shape, whole):
  # Before, each step of the chooser scanned a dim downward one value at a
  # time: 4.7 s for 2**26 floats, ~2 h for 2**34.  The alarm turns a return
  # to that into a failure rather than a hung worker.
  def hung(*_):
    raise TimeoutError('chunk_shape took over 60 s: is a dim scanned value by value again?')
  old = signal.signal(signal.SIGALRM, hung)
  signal.alarm(60)
  try:
    for n in (shape, tuple(2**8 * d for d in shape)):
      chunk = slicing.chunk_shape(n, 4, 38 << 20, global_shape=n if whole else None)
      assert math.prod(chunk) * 4 <= 38 << 20, (n, chunk)
      for c, d in zip(chunk, n):
        assert 1 <= c <= d
        # A dim another writer shares must be tiled exactly (no chunk
        # straddles two shards); a whole one may end in a cut chunk.
        assert whole or d % c == 0, (n, chunk)
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_chunk_grids_of_shapes_a_save_meets():
  # The grids the scan chose (the faster search chooses the same), except
  # where a whole dim has a divisor at least 3/4 of the even cut: that one
  # now, so no chunk is cut by the array's end (2**26 was 9,586,981, one cut
  # chunk; 262,144 rows were 4855).  31,622 = 2 x 97 x 163: its divisor
  # below 621 is 326, so the even cut stays.
  assert slicing.chunk_shape((2**26,), 4, 38 << 20, global_shape=(2**26,)) == (2**23,)
  assert slicing.chunk_shape((31_622, 31_622), 4, 38 << 20,
                             global_shape=(31_622, 31_622)) == (621, 15_811)
  assert slicing.chunk_shape((262_144, 2048), 4, 38 << 20,
                             global_shape=(262_144, 2048)) == (4096, 2048)
  assert slicing.chunk_shape((4096, 1024), 4, 8 << 20) == (2048, 1024)
  assert slicing.chunk_shape((1907, 4096), 4, 8 << 20) == (1907, 1024)


def test_a_shard_prime_on_both_axes_is_one_chunk_when_it_fits_two_slices():
  """Its divisors make chunks of one row (19 KB: 28,000 chunks for 512 MiB,
  a streaming save at 1.22x Orbax's time) or one column; as one chunk it is
  written as one slice (0.64x).  Beyond two slices it stays in rows: the
  capacity is sized for two slices (`cost.streaming_layout`).  The budget
  holds with such chunks: tests/test_budget.py saves mesh2d_prime at 160 MiB
  in shards of 32 MiB, one chunk each, slices of 20 MiB."""
  shard, whole = (3547, 4729), (4 * 3547, 2 * 4729)
  assert slicing.chunk_shape(shard, 4, 38 << 20, global_shape=whole) == shard  # 64 MiB
  assert slicing.chunk_shape(shard, 4, 31 << 20, global_shape=whole) == (1, 4729)
  assert slicing.chunk_shape((32191, 521), 4, 38 << 20) == (32191, 521)
  assert slicing.chunk_shape((32191, 521), 4, 16 << 20) == (32191, 1)
  # Chunks of a slice's 1/16 or more are kept: (640, 4729) rows of 12 MiB.
  assert slicing.chunk_shape((1280, 4729), 4, 13 << 20) == (640, 4729)


def test_slices_cut_for_a_small_state_keep_the_budgets_chunks_where_theirs_are_tiny():
  """A state smaller than the pipeline's room is cut in slices of an eighth
  of it (`cost.STATE_SLICES`); where a shard's chunks at that slice would be
  under half of it, the budget's slice decides instead (`up_to_bytes`)."""
  # Prime on both shared axes: 1-column chunks at 16 MiB, one chunk at 38.
  assert slicing.chunk_shape((32191, 521), 4, 16 << 20, up_to_bytes=38 << 20) == (32191, 521)
  # Chunks of at least half the small slice are kept: rows of 8 MiB, not
  # the whole 16 MiB shard the bigger slice would take.
  assert slicing.chunk_shape((4096, 1024), 4, 8 << 20, global_shape=(4096, 1024),
                             rows_first=True, up_to_bytes=32 << 20) == (2048, 1024)
  # Neither bigger nor better than the budget alone gives.
  assert slicing.chunk_shape((32191, 521), 4, 16 << 20, up_to_bytes=16 << 20) == (32191, 1)


@pytest.mark.parametrize('shape,tile', [((10, 4), (4, 4)), ((4099, 7), (1000, 3)),
                                        ((8, 8), (4, 8)), ((5,), (5,)), ((13, 9, 2), (4, 9, 1))])
def test_tiles_cover_the_shard_once_when_partial_and_overlap_only_at_the_end_otherwise(
    shape, tile):
  cover = {}
  for box in slicing.tiles(shape, tile, partial=True):
    for cell in itertools.product(*(range(s.start, s.stop) for s in box)):
      cover[cell] = cover.get(cell, 0) + 1
  assert len(cover) == math.prod(shape) and set(cover.values()) == {1}
  assert {tuple(s.stop - s.start for s in box)
          for box in slicing.tiles(shape, tile, partial=True)} == slicing.tile_shapes(
              shape, tile, partial=True)
  moved = list(slicing.tiles(shape, tile))
  assert {tuple(s.stop - s.start for s in box) for box in moved} == slicing.tile_shapes(
      shape, tile) == {tuple(tile)}
  assert len(moved) == len(list(slicing.tiles(shape, tile, partial=True)))
  # Boxes in order along each axis: a stream decoder reads them front to back.
  firsts = [box[0].start for box in slicing.tiles(shape, tile, partial=True)]
  assert firsts == sorted(firsts)
