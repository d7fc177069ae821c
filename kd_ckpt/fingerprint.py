"""Fingerprint: an on-device 128-bit hash of the bytes a leaf would write.

kd_ckpt skips re-writing a leaf whose bytes did not change since the previous
save.  Deciding "unchanged" must be safe, and cheap enough to do every save:
the hash runs ON DEVICE as one fused XLA reduction per piece (the leaf is
never copied to the host, no full-size temporary is made), and only 16 bytes
per piece come back.

Design, and why:

  * Words.  Each element is reinterpreted (`lax.bitcast_convert_type`) as an
    unsigned integer of its own width (4-bit -> uint4, 8 -> uint8, 16 ->
    uint16, 32 -> uint32; bool via uint8), then widened to uint32; 8-byte
    dtypes (x64 only) and complex numbers become 2 or 4 uint32 words.  Equal
    bits <=> equal words, so -0.0 != 0.0 and NaN payloads count: this hashes
    bytes, not values.  Typed PRNG keys are refused: pass
    `jax.random.key_data(key)`.
  * Lanes.  4 independent 32-bit lanes; lane L = sum (mod 2^32) over words of
    fmix32(word ^ k_L(i)), k_L(i) = i * 0x9E3779B9 + seed_L, where i is the
    word's linear index (C order) INSIDE the piece and fmix32 is MurmurHash3's
    finalizer.  A sum is one reduction XLA fuses with the mixing (no
    temporaries, one read of the data) and may compute in any order.  fmix32
    is a bijection, so A CHANGE CONFINED TO ONE ELEMENT (for 64-bit and
    complex dtypes: to one 32-bit word) ALWAYS CHANGES EVERY LANE of its
    piece.  Other changes (swaps, transposes, many elements) collide with
    probability ~2^-128 under the usual random-mixing assumption.  This
    guards against accidents, not against an adversary crafting collisions.
  * Size.  Pieces of >= 2^31 words are split (along axis 0, then further
    axes) into sub-pieces with their own global boxes, so i never wraps and
    no two words of a piece have keys that differ by the constant 2^31.
  * Pieces.  On the host, blake2b-128 mixes each piece's 4 lane sums with its
    global box (hence its shape and every element's global position) and its
    dtype name; the fingerprint is the SUM mod 2^128 of the pieces' values, so
    the order of pieces does not matter.  Zero-size pieces skip the device
    and still contribute their box and dtype.
  * Programs.  Each (shape, dtype, box extents, device set) compiles one
    XLA program, which XLA keeps (~1 MiB of host RAM): the pieces of a leaf
    on different devices run side by side in one program (`_groups`), and a
    save charges the programs it will compile to its budget
    (`program_keys`, `reuse.fingerprint_programs`).
  * Layout.  Indices are local to a piece, so the fingerprint depends on how
    the array is cut into pieces: the same values under the same sharding
    give the same fingerprint; under another sharding they (almost surely)
    do not.  That is the safe direction for change detection (a resharded
    leaf is re-written) and keeps every index below 2^31 without 64-bit
    arithmetic on device.

Example:

  fp = fingerprint_array(x)  # 32 lowercase hex chars
  if fp == previous_fps.get(name):  # Same sharding and bytes: skip the write.
    ...
  # Rows 0-3 of the shard that holds global rows 8-15 of an (N, 4) array:
  shard = x.addressable_shards[1]
  fingerprint_boxes([(shard.data, (slice(0, 4), slice(0, 4)),
                      (slice(8, 12), slice(0, 4)))])
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from kd_ckpt import compat

Box = tuple[slice, ...]
Piece = tuple[jax.Array, Box, Box]

_MAX_WORDS = 2**31  # Words per (sub-)piece are kept strictly below this.
_GOLDEN = np.uint32(0x9E3779B9)
_SEEDS = tuple(np.uint32(s) for s in (
    0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344))  # digits of pi
_PERSON = b'kd_ckpt.fp/1'
# `program_keys` of every piece this process hashed on device: compiled.
_compiled: set = set()
_compiled_lock = threading.Lock()
_UNSIGNED = {2: getattr(jnp, 'uint2', None), 4: jnp.uint4, 8: jnp.uint8,
             16: jnp.uint16, 32: jnp.uint32}


def _words_per_element(dtype: np.dtype) -> int:
  """How many uint32 words one element becomes (see `_to_words`)."""
  bits = jax.dtypes.itemsize_bits(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return 2 * max(1, bits // 64)
  return max(1, bits // 32)


def _to_words(x: jax.Array) -> jax.Array:
  """Bit-exact uint32 words of x: shape x.shape, or x.shape + (n,)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8).astype(jnp.uint32)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  bits = jax.dtypes.itemsize_bits(x.dtype)
  if bits >= 32:  # 32-bit: same shape; 64-bit: trailing axis of 2 words.
    return lax.bitcast_convert_type(x, jnp.uint32)
  return lax.bitcast_convert_type(x, _UNSIGNED[bits]).astype(jnp.uint32)


def _fmix32(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _lane_sums_body(x: jax.Array, starts: jax.Array, sizes: tuple[int, ...]):
  """uint32[4]: the 4 lane sums of x[starts : starts + sizes]."""
  if tuple(x.shape) != sizes:  # Otherwise the box is all of x.
    x = lax.dynamic_slice(x, [starts[d] for d in range(x.ndim)], sizes)
  w = _to_words(x)
  index = jnp.zeros(w.shape, jnp.uint32)  # C-order position in the piece.
  for d in range(w.ndim):
    stride = np.uint32(math.prod(w.shape[d + 1:]))
    index = index + lax.broadcasted_iota(jnp.uint32, w.shape, d) * stride
  keys = index * _GOLDEN
  # One variadic reduce: a single pass computing all lanes.  (XLA:CPU rewrites
  # a plain large sum into a tree of reduce-windows over a materialised
  # operand; it leaves variadic reduces alone, fused with their producers.)
  lanes = lax.reduce(tuple(_fmix32(w ^ (keys + s)) for s in _SEEDS),
                     (np.uint32(0),) * len(_SEEDS),
                     lambda a, b: tuple(u + v for u, v in zip(a, b)),
                     tuple(range(w.ndim)))
  return jnp.stack(lanes)


_lane_sums = jax.jit(_lane_sums_body, static_argnames=('sizes',))


def _check_box(box: Box, shape: Sequence[int] | None) -> tuple[int, ...]:
  """The extents of `box`, after checking it (inside `shape` if given)."""
  ints = all(isinstance(v, (int, np.integer)) for s in box
             for v in (s.start, s.stop))
  if (not ints or (shape is not None and len(box) != len(shape)) or
      any(s.step not in (None, 1) or not 0 <= s.start <= s.stop or
          (shape is not None and s.stop > shape[d])
          for d, s in enumerate(box))):
    raise ValueError(f'bad box {box} (of shape {shape})')
  return tuple(int(s.stop - s.start) for s in box)


def _split(src: Box, glob: Box, words: int):
  """Yields (src, glob) sub-boxes of < _MAX_WORDS words each."""
  sizes = [s.stop - s.start for s in src]
  if math.prod(sizes) * words < _MAX_WORDS:
    yield src, glob
    return
  d = next(d for d, n in enumerate(sizes) if n > 1)
  step = max(1, (_MAX_WORDS - 1) // (math.prod(sizes[d + 1:]) * words))
  def cut(box, a):
    end = min(box[d].start + a + step, box[d].stop)
    return box[:d] + (slice(box[d].start + a, end),) + box[d + 1:]
  for a in range(0, sizes[d], step):
    yield from _split(cut(src, a), cut(glob, a), words)


def _mix(dtype: np.dtype, glob: Box, lanes: np.ndarray) -> int:
  h = hashlib.blake2b(digest_size=16, person=_PERSON)
  h.update(np.dtype(dtype).name.encode() + b'\0')
  h.update(struct.pack(f'<Q{2 * len(glob)}q', len(glob),
                       *(v for s in glob for v in (s.start, s.stop))))
  h.update(np.asarray(lanes, '<u4').tobytes())
  return int.from_bytes(h.digest(), 'little')


def fingerprint_many(leaves: Sequence[Sequence[Piece]]) -> list[str]:
  """`fingerprint_boxes` of several leaves, all dispatched before any is read."""
  pending = [_dispatch(pieces) for pieces in leaves]
  return [_collect(p) for p in pending]


def fingerprint_boxes(pieces: Sequence[Piece]) -> str:
  """128-bit fingerprint (32 hex chars) of boxes of single-device arrays.

  Args:
    pieces: (array, src_box, global_box) triples: `array` lives on ONE device
      (e.g. `shard.data`); `src_box` is a tuple of slices with int start/stop
      (step None) selecting a region of it; `global_box` is that region in
      global coordinates of the logical array (same extents).

  Returns:
    Lowercase hex; depends on every region's bytes, each element's position,
    the global boxes and the dtype, but not on the order of `pieces`.
  """
  return _collect(_dispatch(pieces))


def _sub_pieces(pieces: Sequence[Piece]):
  """(array, src, glob, sizes) of every sub-piece (`_split`), checked."""
  for array, src, glob in pieces:
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
      raise TypeError('typed PRNG keys: pass jax.random.key_data(key)')
    sizes = _check_box(tuple(src), array.shape)
    if _check_box(tuple(glob), None) != sizes:
      raise ValueError(f'src_box {src} and global_box {glob} differ in size')
    for sub_src, sub_glob in _split(tuple(src), tuple(glob), _words_per_element(array.dtype)):
      yield array, sub_src, sub_glob, tuple(int(s.stop - s.start) for s in sub_src)


def _groups(pieces: Sequence[Piece]) -> list[tuple[tuple, list]]:
  """Sub-pieces hashed by one program each: (program key, [(array, src, glob)]).

  The sub-pieces of one shape, dtype and box extents on different devices
  (a sharded leaf's shards, a replicated leaf's replica-parallel parts) go
  to one program over those devices (`_spmd_lane_sums`): XLA compiles one
  program per device set rather than one per device (30 leaf shapes over 8
  CPU devices: 30 programs kept 26.1 MiB and took 2.4 s, against 240, 102
  MiB and 12.8 s; a later hash of the same leaves, 0.055 s against 0.031:
  `bench/fingerprint_programs.py`).  Zero-size sub-pieces need no program
  (key None).
  """
  by_kind: dict[tuple, list] = {}
  out = []
  for array, src, glob, sizes in _sub_pieces(pieces):
    if math.prod(sizes) == 0:
      out.append((None, [(array, src, glob)]))
      continue
    kind = (tuple(array.shape), np.dtype(array.dtype).name,
            bool(getattr(array, 'weak_type', False)), sizes)
    by_kind.setdefault(kind, []).append((array, src, glob))
  for kind, members in by_kind.items():
    # A device appears once per program: its n-th sub-piece of a kind goes to
    # the n-th group (a shard split by `_split` into equal sub-pieces).
    rounds: list[dict] = []
    for m in members:
      dev = next(iter(m[0].devices()))
      slot = next((r for r in rounds if dev.id not in r), None)
      if slot is None:
        rounds.append(slot := {})
      slot[dev.id] = m
    for r in rounds:
      ids = tuple(sorted(r))
      # Rank 0 has no axis to lay the devices along: one program each.
      if len(ids) > 1 and len(kind[0]) == 0:
        out.extend(((*kind, (i,)), [r[i]]) for i in ids)
      else:
        out.append(((*kind, ids), [r[i] for i in ids]))
  return out


def program_keys(pieces: Sequence[Piece]) -> set:
  """The device programs hashing `pieces` runs, compiled already or not.

  One per (shape, dtype, box extents, device set) (`_groups`): XLA compiles
  each and keeps it (~0.9-1.1 MiB of host RAM, `cost.
  FINGERPRINT_PROGRAM_BYTES`) for the life of the process.  A save that
  fingerprints charges the new ones to its budget (`new_programs`).
  """
  return {key for key, _ in _groups(pieces) if key is not None}


def new_programs(keys: set) -> set:
  """Those of `keys` (from `program_keys`) this process has not compiled yet."""
  with _compiled_lock:
    return set(keys) - _compiled


def _dispatch(pieces: Sequence[Piece]) -> list:
  pending = []  # Dispatch everything first: devices work in parallel.
  for key, members in _groups(pieces):
    if key is None:
      [(array, _, glob)] = members
      pending.append((array.dtype, glob, np.zeros(4, np.uint32)))
      continue
    sizes = key[3]
    if len(members) == 1:
      [(array, src, glob)] = members
      lanes = [_lane_sums(array, np.array([s.start for s in src], np.int32), sizes)]
      lanes[0].copy_to_host_async()
    else:
      lanes = _spmd_lane_sums(members, sizes)
    for lane, (array, _, glob) in zip(lanes, members):
      pending.append((array.dtype, glob, lane))
    with _compiled_lock:
      _compiled.add(key)
  return pending


def _spmd_lane_sums(members: list, sizes: tuple[int, ...]) -> list:
  """`_lane_sums` of sub-pieces on distinct devices, as one program over them.

  The arrays (each of one shape, on its own device) are laid side by side
  along axis 0 of one global array, without a copy, and each device hashes
  its own box: the lanes are the same numbers `_lane_sums` gives each piece.
  Returns each member's lanes (`_Row`s of the program's (k, 4) result).
  """
  arrays = [a for a, _, _ in members]
  mesh, rows = _side_by_side(tuple(next(iter(a.devices())) for a in arrays))
  shape = tuple(arrays[0].shape)
  side_by_side = jax.make_array_from_single_device_arrays(
      (len(arrays) * shape[0],) + shape[1:], rows, arrays)
  out = _spmd_program(side_by_side, _starts(rows, tuple(tuple(s.start for s in src)
                                                         for _, src, _ in members)),
                      sizes, mesh)
  out.copy_to_host_async()  # read once every leaf is dispatched (`_collect`)
  return [_Row(out, i) for i in range(len(members))]


@functools.lru_cache(maxsize=None)
def _side_by_side(devices: tuple) -> tuple:
  """The mesh and row sharding laying one array per device along axis 0."""
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  return mesh, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('d'))


@functools.lru_cache(maxsize=4096)
def _starts(rows, starts: tuple) -> jax.Array:
  """Each device's box start, on its device (a few bytes, kept: saves repeat them)."""
  return jax.device_put(np.array(starts, np.int32), rows)


class _Row:
  """Row `i` of a program's (k, 4) lanes, read on the host when collected."""

  def __init__(self, out: jax.Array, i: int):
    self.out, self.i = out, i

  def __array__(self, dtype=None, copy=None):
    del copy
    row = np.asarray(self.out)[self.i]  # one host copy of `out`, cached on it
    return row if dtype is None else row.astype(dtype)


@functools.partial(jax.jit, static_argnames=('sizes', 'mesh'))
def _spmd_program(x: jax.Array, starts: jax.Array, sizes: tuple[int, ...], mesh):
  def local(xl, sl):
    return _lane_sums_body(xl, sl[0], sizes)[None]
  spec = jax.sharding.PartitionSpec('d')
  return compat.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec)(x, starts)


def _collect(pending: list) -> str:
  total = sum(_mix(dtype, glob, np.asarray(lanes))
              for dtype, glob, lanes in pending)
  return f'{total % 2**128:032x}'


def fingerprint_array(x: jax.Array) -> str:
  """Fingerprint of x: replica 0 of each shard this process can address.

  On one process that is all of x, and a replicated array costs one pass;
  with several processes, each covers the replica-0 shards it holds.  The
  value depends on x's sharding (see the module docstring).
  """
  if not isinstance(x, jax.Array):
    x = jnp.asarray(x)
  pieces = []
  for shard in x.addressable_shards:
    if shard.replica_id != 0:
      continue
    glob = tuple(slice(*s.indices(n)[:2]) for s, n in zip(shard.index, x.shape))
    src = tuple(slice(0, n) for n in shard.data.shape)
    pieces.append((shard.data, src, glob))
  return fingerprint_boxes(pieces)
