"""Tests for kd_ckpt.fingerprint (8 fake CPU devices, see conftest.py)."""

import random
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_dtypes
import numpy as np
import pytest

from kd_ckpt import fingerprint as fp

_INT4 = [jnp.int4, jnp.uint4] if hasattr(jnp, 'int4') else []
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8,
          jnp.bool_, jnp.int32, jnp.complex64, jnp.float8_e4m3fn] + _INT4
_M32 = 0xFFFFFFFF


def _mesh(*shape):
  names = ('a', 'b')[:len(shape)]
  return Mesh(np.array(jax.devices()[:np.prod(shape)]).reshape(shape), names)


def _sharded(a, spec=P('a'), mesh_shape=(8,)):
  return jax.device_put(a, NamedSharding(_mesh(*mesh_shape), spec))


def _values(dtype, shape, seed=0):
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  if dtype.kind in 'iu' or dtype in (np.dtype(ml_dtypes.int4),
                                     np.dtype(ml_dtypes.uint4)):
    info = ml_dtypes.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)
  if dtype.kind == 'c':
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
            ).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def _changed(v):
  """A value with other bits: flip a bool, the low bit of an int, a sign."""
  d = v.dtype
  if d == np.bool_:
    return ~v
  if d.kind in 'iu' or d.name in ('int4', 'uint4'):
    return (v.astype(np.int32) ^ 1).astype(d)
  return -v  # Floats (incl. bfloat16, float8) and complex; -0.0 != 0.0.


def _words(a: np.ndarray) -> np.ndarray:
  """Numpy reference of fingerprint._to_words, flattened."""
  if a.dtype == np.bool_:
    return a.astype(np.uint32).ravel()
  if a.dtype.name in ('int4', 'uint4'):
    return (a.astype(np.int8).astype(np.uint8) & 0xF).astype(np.uint32).ravel()
  if a.dtype.itemsize >= 4:
    return np.ascontiguousarray(a).view(np.uint32).ravel()
  return a.view(f'uint{8 * a.dtype.itemsize}').astype(np.uint32).ravel()


def _ref_lanes(a: np.ndarray) -> list[int]:
  w = _words(a).astype(np.uint64)
  i = np.arange(w.size, dtype=np.uint64)
  lanes = []
  for seed in fp._SEEDS:
    h = w ^ ((i * 0x9E3779B9 + int(seed)) & _M32)
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _M32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _M32
    lanes.append(int((h ^ (h >> 16)).sum()) & _M32)
  return lanes


def _lanes(x, box):
  starts = np.array([s.start for s in box], np.int32)
  sizes = tuple(s.stop - s.start for s in box)
  return [int(v) for v in np.asarray(fp._lane_sums(x, starts, sizes))]


def _pieces(x):
  return [(s.data, tuple(slice(0, n) for n in s.data.shape),
           tuple(slice(*i.indices(n)[:2]) for i, n in zip(s.index, x.shape)))
          for s in x.addressable_shards if s.replica_id == 0]


@pytest.mark.parametrize('dtype', DTYPES, ids=lambda d: np.dtype(d).name)
def test_lanes_match_numpy_reference(dtype):
  a = _values(dtype, (5, 7))
  x = jnp.asarray(a)
  assert _lanes(x, (slice(0, 5), slice(0, 7))) == _ref_lanes(a)
  box = (slice(1, 4), slice(2, 7))
  assert _lanes(x, box) == _ref_lanes(a[1:4, 2:7])


def test_x64_dtypes_match_reference():
  with jax.enable_x64(True):
    for dtype in (np.float64, np.int64, np.complex128):
      a = _values(dtype, (3, 4))
      assert _lanes(jnp.asarray(a), (slice(0, 3), slice(0, 4))) == (
          _ref_lanes(a))
      b = a.copy()
      b[2, 3] = _changed(b[2, 3])
      assert fp.fingerprint_array(jnp.asarray(a)) != fp.fingerprint_array(
          jnp.asarray(b))


def test_identical_content_identical_fingerprint():
  a = np.arange(48, dtype=np.float32).reshape(16, 3)
  f = fp.fingerprint_array(_sharded(a))
  assert len(f) == 32 and f == f.lower() and int(f, 16) >= 0
  assert fp.fingerprint_array(_sharded(a)) == f
  independent = jax.jit(lambda: jnp.arange(48, dtype=jnp.float32).reshape(
      16, 3), out_shardings=NamedSharding(_mesh(8), P('a')))()
  assert fp.fingerprint_array(independent) == f
  assert fp.fingerprint_array(jnp.asarray(a)) == fp.fingerprint_array(
      jnp.asarray(a.copy()))


@pytest.mark.parametrize('dtype', DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize('pos', [(0, 0), (15, 5), (7, 3), (2, 1)],
                         ids=['first', 'last', 'middle', 'shard2'])
def test_single_element_change(dtype, pos):
  a = _values(dtype, (16, 6))
  b = a.copy()
  b[pos] = _changed(a[pos])
  assert _words(a[pos][None]).tolist() != _words(b[pos][None]).tolist()
  xa, xb = _sharded(a), _sharded(b)
  assert fp.fingerprint_array(xa) != fp.fingerprint_array(xb)
  # The guarantee: a one-element change moves EVERY lane of its piece.
  shard = pos[0] // 2
  sa, sb = xa.addressable_shards[shard], xb.addressable_shards[shard]
  assert sa.index[0].start == 2 * shard
  box = (slice(0, 2), slice(0, 6))
  assert all(u != v for u, v in zip(_lanes(sa.data, box), _lanes(sb.data, box)))


def test_scalar_and_zero_size():
  assert fp.fingerprint_array(jnp.float32(1.5)) == fp.fingerprint_array(
      jnp.asarray(np.float32(1.5)))
  assert fp.fingerprint_array(jnp.float32(1.5)) != fp.fingerprint_array(
      jnp.float32(2.5))
  assert fp.fingerprint_array(jnp.float32(0.0)) != fp.fingerprint_array(
      jnp.float32(-0.0))
  empties = [jnp.zeros(s, d) for s in [(0,), (0, 3), (3, 0), (2, 0)]
             for d in (jnp.float32, jnp.int32)]
  fps = [fp.fingerprint_array(e) for e in empties]
  assert len(set(fps)) == len(fps)
  assert fps[0] == fp.fingerprint_array(jnp.zeros((0,), jnp.float32))
  assert fp.fingerprint_boxes([]) == '0' * 32


def test_swap_transpose_and_dtype():
  a = np.arange(64, dtype=np.float32).reshape(8, 8)
  base = fp.fingerprint_array(_sharded(a))
  s = a.copy()
  s[1, 2], s[6, 5] = a[6, 5], a[1, 2]
  assert fp.fingerprint_array(_sharded(s)) != base
  s = a.copy()
  s[0, 0], s[0, 1] = a[0, 1], a[0, 0]  # neighbours in one piece
  assert fp.fingerprint_array(_sharded(s)) != base
  assert fp.fingerprint_array(_sharded(np.ascontiguousarray(a.T))) != base
  x = jnp.asarray(a)
  as_int = jax.lax.bitcast_convert_type(x, jnp.int32)
  assert fp.fingerprint_array(as_int) != fp.fingerprint_array(x)
  assert fp.fingerprint_array(x.reshape(4, 16)) != fp.fingerprint_array(x)


def test_sharding_layout():
  """Same sharding => same value; replicated == unsharded; others differ."""
  a = _values(np.float32, (16, 8))
  layouts = {
      'sharded8': lambda: _sharded(a),
      'replicated': lambda: _sharded(a, P()),
      'mesh4x2': lambda: _sharded(a, P('a', 'b'), (4, 2)),
      'mesh4x2_cols': lambda: _sharded(a, P(None, 'a'), (4, 2)),
  }
  fps = {k: fp.fingerprint_array(make()) for k, make in layouts.items()}
  for k, make in layouts.items():
    assert fp.fingerprint_array(make()) == fps[k], k
  assert fps['replicated'] == fp.fingerprint_array(jnp.asarray(a))
  assert len(set(fps.values())) == len(fps)  # layout-dependent, by design
  x = layouts['mesh4x2']()
  assert fp.fingerprint_boxes(_pieces(x)) == fps['mesh4x2']


def test_replicated_costs_one_piece(monkeypatch):
  calls = []  # pieces hashed, alone or side by side with others
  real, spmd = fp._lane_sums, fp._spmd_lane_sums
  monkeypatch.setattr(fp, '_lane_sums',
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  monkeypatch.setattr(fp, '_spmd_lane_sums',
                      lambda m, s: calls.extend([1] * len(m)) or spmd(m, s))
  fp.fingerprint_array(_sharded(np.ones((16, 4), np.float32), P()))
  assert len(calls) == 1
  fp.fingerprint_array(_sharded(np.ones((16, 4), np.float32), P(None, 'b'),
                                (4, 2)))
  assert len(calls) == 1 + 2


def test_order_of_pieces_does_not_matter():
  x = _sharded(_values(np.float32, (16, 8)), P('a', 'b'), (4, 2))
  pieces = _pieces(x)
  want = fp.fingerprint_boxes(pieces)
  for seed in range(3):
    random.Random(seed).shuffle(pieces)
    assert fp.fingerprint_boxes(pieces) == want


def test_sub_boxes_and_global_boxes():
  a = _values(np.float32, (6, 5))
  x = jnp.asarray(a)
  box = (slice(1, 4), slice(0, 5))
  f = fp.fingerprint_boxes([(x, box, box)])
  # The same bytes from a different source array, at the same global box.
  y = jnp.asarray(a[1:4])
  assert fp.fingerprint_boxes([(y, (slice(0, 3), slice(0, 5)), box)]) == f
  # Same bytes, other global position: differs.
  other = (slice(2, 5), slice(0, 5))
  assert fp.fingerprint_boxes([(x, box, other)]) != f
  with pytest.raises(ValueError):
    fp.fingerprint_boxes([(x, box, (slice(0, 2), slice(0, 5)))])
  with pytest.raises(ValueError):
    fp.fingerprint_boxes([(x, (slice(0, 7), slice(0, 5)),
                           (slice(0, 7), slice(0, 5)))])
  with pytest.raises(TypeError, match='key_data'):
    fp.fingerprint_array(jax.random.key(0))
  assert fp.fingerprint_array(jax.random.key_data(jax.random.key(0)))


@pytest.mark.parametrize('shape', [(5, 4), (2, 9), (1, 1, 20)])
def test_large_pieces_split_like_explicit_sub_pieces(monkeypatch, shape):
  a = _values(np.float32, shape)
  x = jnp.asarray(a)
  full = tuple(slice(0, n) for n in shape)
  monkeypatch.setattr(fp, '_MAX_WORDS', 7)
  subs = list(fp._split(full, full, 1))
  assert len(subs) > 1
  assert all(np.prod([s.stop - s.start for s in sub]) < 7 for sub, _ in subs)
  assert sum(np.prod([s.stop - s.start for s in sub]) for sub, _ in subs) == (
      a.size)
  split = fp.fingerprint_boxes([(x, full, full)])
  b = a.copy()
  b.flat[-1] = -b.flat[-1]
  assert fp.fingerprint_boxes([(jnp.asarray(b), full, full)]) != split
  monkeypatch.setattr(fp, '_MAX_WORDS', 2**31)
  assert fp.fingerprint_boxes([(x, s, g) for s, g in subs]) == split
  assert fp.fingerprint_boxes([(x, full, full)]) != split


def test_no_full_size_temporaries():
  """Hashing 256 MiB of f32 (a box of a larger array) allocates < 8 MiB."""
  x = jax.ShapeDtypeStruct((2 * 8192, 8192), jnp.float32)
  starts = jax.ShapeDtypeStruct((2,), jnp.int32)
  compiled = fp._lane_sums.lower(x, starts, sizes=(8192, 8192)).compile()
  mem = compiled.memory_analysis()
  assert mem.temp_size_in_bytes < 8 * 2**20
  assert mem.output_size_in_bytes == 16


def _vm(key):
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


@pytest.mark.slow
def test_speed_and_host_memory_1gib():
  x = jax.jit(lambda: jnp.arange(2**28, dtype=jnp.float32).reshape(2**14, -1),
              out_shardings=NamedSharding(_mesh(8), P('a')))()
  x.block_until_ready()
  start = time.perf_counter()
  first = fp.fingerprint_array(x)  # Includes compiling.
  cold = time.perf_counter() - start
  with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # Resets VmHWM to the current RSS.
  base = _vm('VmRSS:')
  start = time.perf_counter()
  assert fp.fingerprint_array(x) == first
  warm = time.perf_counter() - start
  added = _vm('VmHWM:') - base
  print(f'\nfingerprint 1 GiB f32 over 8 CPU devices: {2**30 / warm / 1e9:.2f} '
        f'GB/s ({warm:.3f} s; first call {cold:.2f} s), host peak added '
        f'{added / 2**20:.2f} MiB')
  assert added < 32 * 2**20


# --- one program per device set (`_groups`, `_spmd_lane_sums`) ---------------

@pytest.mark.parametrize('dtype', DTYPES, ids=lambda d: np.dtype(d).name)
def test_pieces_on_several_devices_hash_to_the_reference_lanes(dtype):
  """Shards hashed side by side in one program: each device's lanes are its
  own box's, as `_lane_sums` and the numpy reference give them."""
  a = _values(dtype, (8 * 6, 7))
  x = _sharded(a)
  # Each shard's own sub-box (rows 1-4 of 6, columns 2-6), as replica-parallel
  # parts are: the starts differ from device to device in the global frame.
  box = (slice(1, 5), slice(2, 7))
  pieces = [(s.data, box, (slice(s.index[0].start + 1, s.index[0].start + 5), slice(2, 7)))
            for s in x.addressable_shards]
  [(key, members)] = fp._groups(pieces)
  assert len(members) == 8 and key[-1] == tuple(sorted(d.id for d in x.devices()))
  lanes = fp._spmd_lane_sums(members, key[3])
  for (data, _, glob), got in zip(members, lanes):
    r0 = glob[0].start
    assert [int(v) for v in np.asarray(got).ravel()] == _ref_lanes(a[r0:r0 + 4, 2:7])
  assert fp.fingerprint_boxes(pieces) == fp._collect(
      [(d.dtype, g, fp._lane_sums(d, np.array([1, 2], np.int32), (4, 5))) for d, _, g in pieces])


def test_a_sharded_leaf_compiles_one_program_not_one_per_device():
  x = _sharded(_values(np.float32, (8 * 13, 11)))
  spmd, single = fp._spmd_program._cache_size(), fp._lane_sums._cache_size()
  keys = fp.program_keys(_pieces(x))
  assert len(keys) == 1
  fp.fingerprint_array(x)
  assert (fp._spmd_program._cache_size() - spmd, fp._lane_sums._cache_size() - single) == (1, 0)
  assert not fp.new_programs(keys)
  # Another leaf of that shape over the same devices: nothing new.
  fp.fingerprint_array(_sharded(_values(np.float32, (8 * 13, 11), seed=3)))
  assert fp._spmd_program._cache_size() - spmd == 1


def test_split_pieces_on_several_devices_match_explicit_sub_pieces(monkeypatch):
  """A shard split into equal sub-pieces puts each in its own program over the
  devices (a device appears once per program); the value is the explicit
  sub-pieces' either way."""
  a = _values(np.float32, (8 * 4, 3))
  x = _sharded(a)
  pieces = _pieces(x)
  monkeypatch.setattr(fp, '_MAX_WORDS', 7)  # each 4x3 shard: 2 sub-pieces of 2x3
  groups = fp._groups(pieces)
  assert [len(m) for _, m in groups] == [8, 8]
  split = fp.fingerprint_boxes(pieces)
  subs = [(d, s, g) for d, src, glob in pieces for s, g in fp._split(src, glob, 1)]
  monkeypatch.setattr(fp, '_MAX_WORDS', 2**31)
  assert fp.fingerprint_boxes(subs) == split
  assert fp.fingerprint_boxes(pieces) != split
