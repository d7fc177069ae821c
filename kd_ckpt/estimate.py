"""Estimate a save from shapes, dtypes and shardings, before anything is copied.

Works on `jax.Array`s and on `jax.ShapeDtypeStruct`s that carry a sharding
(e.g. `jax.eval_shape` output), so a multi-hour run can be checked for free.
For each leaf: its bytes, its shards, and the bytes *this* process writes,
with replicas deduplicated the way Orbax does (replica 0 of each shard, or
1/R of it with replica parallelism).  What those bytes cost in host memory
is `cost`'s business.

Example:

  est = estimate.estimate_tree(jax.eval_shape(init_fn, rng))
  print(est)   # per-leaf table
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kd_ckpt import text
from kd_ckpt import tree as tree_lib


@dataclasses.dataclass(frozen=True)
class LeafEstimate:
  """What one leaf costs this host.

  Attributes:
    path: the leaf's name (Orbax's parameter name).
    shape: global shape (of the stored key data for PRNG keys).
    dtype: dtype name.
    global_bytes: bytes of the whole array.
    shard_bytes: bytes of one shard (one device's piece).
    num_replicas: devices holding each shard.
    write_bytes: bytes this host writes without replica parallelism (the
      shards whose replica 0 lives here).
    write_bytes_replica_parallel: bytes this host writes when each replica
      writes 1/R of its shard (Orbax's `use_replica_parallel`).
    replica_parallel_applies: whether Orbax can split this leaf's shards
      (more than one replica and an axis that divides by the replica count).
    is_array: False for numpy arrays and Python scalars (already on host).
    unit_dim_chunks: whether a chunk Orbax writes has an extent of 1 (a shard
      or replica slice with a dim of 1: a 1x1 conv kernel, a (layers, 1, d)
      scale).  TensorStore copies such a chunk into a buffer of its own
      instead of referencing the host copy (tensorstore 0.1.x; measured
      with `can_reference_source_data_indefinitely`: a 64 MiB write of
      (4096, 1, 4096) took 68 MiB, of (4096, 2, 2048) 4.6 MiB), so its bytes
      are paid twice where a host copy exists, and once on CPU where none does.
    slice_programs: the programs replica parallelism compiles on this host
      to cut this leaf's shards (`lax.slice_in_dim`, one per shard shape,
      dtype, slice and device: `slice_program_key`), which XLA keeps for
      the process's life; empty where it does not apply.
  """

  path: str
  shape: tuple[int, ...]
  dtype: str
  global_bytes: int
  shard_bytes: int
  num_replicas: int
  write_bytes: int
  write_bytes_replica_parallel: int
  replica_parallel_applies: bool
  is_array: bool = True
  unit_dim_chunks: bool = False
  slice_programs: tuple[tuple, ...] = ()

  @property
  def packed(self) -> bool:
    """Under a byte an element on the devices (`packed_on_device`)."""
    return packed_on_device(self.dtype)

  def host_bytes(self, use_replica_parallel: bool) -> int:
    return (self.write_bytes_replica_parallel if use_replica_parallel
            else self.write_bytes)


@dataclasses.dataclass(frozen=True)
class TreeEstimate:
  """Per-leaf estimates for a whole tree, plus the platform they are for."""

  leaves: tuple[LeafEstimate, ...]
  platform: str
  process_index: int = 0
  process_count: int = 1

  @property
  def num_leaves(self) -> int:
    return len(self.leaves)

  @property
  def global_bytes(self) -> int:
    return sum(l.global_bytes for l in self.leaves)

  def total_bytes(self, use_replica_parallel: bool = True) -> int:
    """Bytes this host writes."""
    return sum(l.host_bytes(use_replica_parallel) for l in self.leaves)

  def largest_write_bytes(self, use_replica_parallel: bool = True) -> int:
    return max((l.host_bytes(use_replica_parallel) for l in self.leaves), default=0)

  def largest(self, n: int = 8) -> list[LeafEstimate]:
    return sorted(self.leaves, key=lambda l: -l.global_bytes)[:n]

  def __str__(self) -> str:
    fb = text.format_bytes
    head = (
        f'{self.num_leaves} leaves, {fb(self.global_bytes)} global,'
        f' {fb(self.total_bytes(True))} written by process'
        f' {self.process_index}/{self.process_count} ({self.platform})'
    )
    rows = [('leaf', 'shape', 'dtype', 'bytes', 'shard', 'replicas', 'this host')]
    for l in self.largest(8):
      rows.append((l.path, str(l.shape), l.dtype, fb(l.global_bytes), fb(l.shard_bytes),
                   str(l.num_replicas), fb(l.host_bytes(True))))
    return head + '\n' + text.table(rows)


def _sharding_of(x: Any) -> jax.sharding.Sharding:
  sharding = getattr(x, 'sharding', None)
  if sharding is None:
    # A ShapeDtypeStruct without sharding: JAX would put it on one device.
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return sharding


_PACKED_NAMES = ('int4', 'uint4', 'int2', 'uint2', 'float4_e2m1fn')


def packed_on_device(dtype: Any) -> bool:
  """Whether JAX holds `dtype` in under a byte an element (int4, int2, float4).

  Numpy holds such arrays a byte an element, so every host copy unpacks
  them: on the CPU backend it is a real copy, never a view of the device
  buffer, and jax keeps it on the array it converted.  (A 128 MiB int4 leaf
  over 8 CPU devices peaked at 156 MiB in a 54 MiB streaming save when its
  shards were read as views.)

    packed_on_device('int4')     # True
    packed_on_device('float8_e4m3fn')  # False
  """
  try:
    bits = getattr(jax.dtypes, 'itemsize_bits', None)
    if bits is not None:
      return bits(jnp.dtype(dtype)) < 8
    return jnp.dtype(dtype).name in _PACKED_NAMES
  except (TypeError, ValueError):  # not a dtype jax knows (strings): not packed
    return False


def _replica_ids(sharding: jax.sharding.Sharding, shape) -> dict[Any, tuple[int, Any]]:
  """device -> (replica id, index), in the order JAX numbers replicas."""
  seen: dict[Any, int] = collections.defaultdict(int)
  out = {}
  for device, index in sharding.devices_indices_map(tuple(shape)).items():
    key = tuple((s.start, s.stop, s.step) for s in index)
    out[device] = (seen[key], index)
    seen[key] += 1
  return out


def estimate_leaf(path: str, x: Any) -> LeafEstimate:
  """Estimates one leaf (array, ShapeDtypeStruct, numpy array or scalar)."""
  if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    arr = np.asarray(x)
    nbytes = int(arr.nbytes)
    if arr.size == 0:
      raise ValueError(
          f'Leaf {path!r} is a zero-size numpy array {arr.shape}, which Orbax'
          ' cannot save. Pass it as a jax.Array (jnp.asarray(x)): kd_ckpt'
          ' stores zero-size jax.Arrays. Or drop the leaf.')
    mine = nbytes if jax.process_index() == 0 else 0  # Orbax: process 0 only.
    return LeafEstimate(
        path=path, shape=tuple(arr.shape), dtype=str(arr.dtype), global_bytes=nbytes,
        shard_bytes=nbytes, num_replicas=1, write_bytes=mine,
        write_bytes_replica_parallel=mine, replica_parallel_applies=False, is_array=False,
        unit_dim_chunks=1 in arr.shape)
  if isinstance(x, jax.Array) and x.is_deleted():
    raise ValueError(
        f'Leaf {path!r} is a deleted jax.Array (donated or deleted before the'
        ' save). Save before the step that donates it, or pass a tree of live'
        ' arrays.')
  if tree_lib.is_prng_key(x):
    # Stored as its key data: uint32 with trailing dims (Orbax's format).
    sharding = _sharding_of(x)
    x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    shape = tuple(int(d) for d in x.shape)
    sharding = _key_data_sharding(sharding, len(shape))
  else:
    shape = tuple(int(d) for d in x.shape)
    sharding = _sharding_of(x)
  itemsize = np.dtype(x.dtype).itemsize
  global_bytes = math.prod(shape) * itemsize
  shard_shape = tuple(sharding.shard_shape(shape))
  shard_bytes = math.prod(shard_shape) * itemsize
  ids = _replica_ids(sharding, shape)
  num_replicas = max(r for r, _ in ids.values()) + 1 if ids else 1
  local = [d for d in ids if d.process_index == jax.process_index()]
  single = sum(shard_bytes for d in local if ids[d][0] == 0)
  rp_axis = next(
      (a for a, n in enumerate(shard_shape) if num_replicas > 1 and n % num_replicas == 0),
      None)
  rp_applies = rp_axis is not None and shard_bytes > 0
  rp = (sum(shard_bytes // num_replicas for d in local if ids[d][0] < num_replicas)
        if rp_applies else single)
  size = shard_shape[rp_axis] // num_replicas if rp_applies else 0
  programs = tuple(sorted({
      slice_program_key(shard_shape, x.dtype, rp_axis, ids[d][0] * size, (ids[d][0] + 1) * size,
                        d.id)
      for d in local})) if rp_applies else ()
  return LeafEstimate(
      path=path, shape=shape, dtype=str(np.dtype(x.dtype)), global_bytes=global_bytes,
      shard_bytes=shard_bytes, num_replicas=num_replicas, write_bytes=single,
      write_bytes_replica_parallel=rp, replica_parallel_applies=rp_applies,
      unit_dim_chunks=1 in shard_shape or (
          rp_applies and shard_shape[rp_axis] // num_replicas == 1),
      slice_programs=programs)


# Slice programs this process has compiled (`slice_program_key`): a later
# save finds them, so its plan does not charge them again.
_COMPILED_SLICE_PROGRAMS: set[tuple] = set()


def compiled_slice_programs() -> frozenset[tuple]:
  """The replica-slice programs this process has compiled (`note_slice_programs`)."""
  return frozenset(_COMPILED_SLICE_PROGRAMS)


def note_slice_programs(keys) -> None:
  """Records replica-slice programs as compiled (by the writer, once it cut them)."""
  _COMPILED_SLICE_PROGRAMS.update(keys)


def slice_program_key(shard_shape, dtype, axis: int, start: int, stop: int,
                      device_id: int) -> tuple:
  """The program `lax.slice_in_dim` compiles to cut a replica slice of a shard.

  Orbax's replica parallelism cuts each replica's part of a shard on its
  device with an eager `lax.slice_in_dim`: XLA compiles one program per
  shard shape, dtype, slice and device and keeps it.

  Example:

    slice_program_key((1024, 512), 'float32', 0, 256, 512, 3)
  """
  return (tuple(int(n) for n in shard_shape), str(np.dtype(dtype)), int(axis), int(start),
          int(stop), int(device_id))


def _key_data_sharding(sharding, ndim: int):
  """A key array's sharding extended to its key data's trailing dims."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:ndim]))
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


def estimate_tree(tree: Any, *, platform: str | None = None) -> TreeEstimate:
  """Estimates every leaf of `tree`; raises for deleted arrays."""
  # A model repeats a few (shape, dtype, sharding) many times: each is
  # worked out once (~20 us a leaf, 0.05 s of a 2,000-leaf save).
  seen: dict[Any, LeafEstimate] = {}

  def one(path: str, x: Any) -> LeafEstimate:
    if not isinstance(x, jax.Array) or tree_lib.is_prng_key(x):
      return estimate_leaf(path, x)
    if x.is_deleted():
      return estimate_leaf(path, x)  # raises, naming the leaf
    key = (x.shape, x.dtype, x.sharding)
    try:
      hit = seen.get(key)
    except TypeError:  # a sharding that cannot be hashed: no sharing
      return estimate_leaf(path, x)
    if hit is None:
      hit = seen[key] = estimate_leaf(path, x)
    return hit if hit.path == path else dataclasses.replace(hit, path=path)

  return TreeEstimate(
      leaves=tuple(one(l.name, l.value) for l in tree_lib.leaves(tree)),
      platform=platform or jax.default_backend(),
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  )
