"""Estimate a save from shapes, dtypes and shardings, before anything is copied.

Works on `jax.Array`s and on `jax.ShapeDtypeStruct`s that carry a sharding
(e.g. `jax.eval_shape` output), so a multi-hour run can be checked for free.

The cost model, per leaf, for the bytes `W` this host writes (replicas
deduplicated the way Orbax does):

  Orbax, accelerator:  W (device->host copy; JAX caches it on the array)
                       + W when pinned-host staging is on
                       + ENCODE_FACTOR * W when zstd is on (TensorStore keeps
                         the encoded chunk until the write is durable)
  Orbax, CPU backend:  the device->host copy is zero-copy, except for
                       replica-parallel slices, which `lax.slice_in_dim`
                       materialises as new buffers; + the encode buffers.
  Streaming:           a fixed floor + the slices in flight (see `streaming`).

The factors were measured on this project's CI machine (CPU backend, 8 fake
devices, orbax-checkpoint 0.12.8); tests/test_estimate.py checks predictions
against measured peaks within 25%.

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
import numpy as np

from kd_ckpt import hostmem

# zstd level 3 (Orbax's zarr3 default) on float weights: mantissa bits are
# close to noise, so encoded chunks are 0.8-0.95 of the raw bytes (0.81
# measured on random normals).  0.9 sits in the middle of that range.
ENCODE_FACTOR = 0.9
# Without zstd TensorStore references the caller's buffer instead of copying:
# 0.01 GiB extra was measured for a 1 GiB array.
UNCOMPRESSED_ENCODE_FACTOR = 0.02
# What any Orbax save costs beyond its arrays: TensorStore and OCDBT
# contexts, thread stacks and arenas, metadata (4-16 MiB measured for states
# of 0.1-13 MiB).
ORBAX_FLOOR_BYTES = 16 << 20


def keystr(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator='.') or '<root>'


@dataclasses.dataclass(frozen=True)
class LeafEstimate:
  """What one leaf costs this host.

  Attributes:
    path: the leaf's key path, dotted.
    shape: global shape.
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

  def host_bytes(self, use_replica_parallel: bool) -> int:
    return (
        self.write_bytes_replica_parallel
        if use_replica_parallel
        else self.write_bytes
    )


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

  @property
  def largest_shard_bytes(self) -> int:
    return max((l.shard_bytes for l in self.leaves), default=0)

  def largest(self, n: int = 8) -> list[LeafEstimate]:
    return sorted(self.leaves, key=lambda l: -l.global_bytes)[:n]

  def __str__(self) -> str:
    fb = hostmem.format_bytes
    head = (
        f'{self.num_leaves} leaves, {fb(self.global_bytes)} global,'
        f' {fb(self.total_bytes(True))} written by process'
        f' {self.process_index}/{self.process_count} ({self.platform})'
    )
    rows = [('leaf', 'shape', 'dtype', 'bytes', 'shard', 'replicas', 'this host')]
    for l in self.largest(8):
      rows.append((
          l.path, str(l.shape), l.dtype, fb(l.global_bytes), fb(l.shard_bytes),
          str(l.num_replicas), fb(l.host_bytes(True)),
      ))
    return head + '\n' + _table(rows)


def _table(rows: list[tuple[str, ...]]) -> str:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, '  '.join('-' * w for w in widths))
  return '\n'.join(lines)


def _is_array_like(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def _sharding_of(x: Any) -> jax.sharding.Sharding:
  sharding = getattr(x, 'sharding', None)
  if sharding is None:
    # A ShapeDtypeStruct without sharding: JAX would put it on one device.
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return sharding


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
  if not _is_array_like(x):
    arr = np.asarray(x)
    nbytes = int(arr.nbytes)
    if arr.size == 0:
      raise ValueError(
          f'Leaf {path!r} is a zero-size numpy array {arr.shape}, which Orbax'
          ' cannot save. Pass it as a jax.Array (jnp.asarray(x)): kd_ckpt'
          ' stores zero-size jax.Arrays. Or drop the leaf.')
    return LeafEstimate(
        path=path, shape=tuple(arr.shape), dtype=str(arr.dtype),
        global_bytes=nbytes, shard_bytes=nbytes, num_replicas=1,
        # Orbax writes host values from process 0 only.
        write_bytes=nbytes if jax.process_index() == 0 else 0,
        write_bytes_replica_parallel=nbytes if jax.process_index() == 0 else 0,
        replica_parallel_applies=False, is_array=False,
    )
  if isinstance(x, jax.Array) and x.is_deleted():
    raise ValueError(
        f'Leaf {path!r} is a deleted jax.Array (donated or deleted before the'
        ' save). Save before the step that donates it, or pass a tree of live'
        ' arrays.'
    )
  shape = tuple(int(d) for d in x.shape)
  dtype = np.dtype(x.dtype) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else None
  itemsize = dtype.itemsize if dtype is not None else 8
  dtype_name = str(x.dtype)
  sharding = _sharding_of(x)
  global_bytes = math.prod(shape) * itemsize
  shard_shape = tuple(sharding.shard_shape(shape))
  shard_bytes = math.prod(shard_shape) * itemsize
  ids = _replica_ids(sharding, shape)
  num_replicas = max(r for r, _ in ids.values()) + 1 if ids else 1
  local = [d for d in ids if d.process_index == jax.process_index()]
  single = sum(shard_bytes for d in local if ids[d][0] == 0)
  rp_axis = next(
      (a for a, n in enumerate(shard_shape) if num_replicas > 1 and n % num_replicas == 0),
      None,
  )
  rp_applies = rp_axis is not None and shard_bytes > 0
  if rp_applies:
    rp = sum(shard_bytes // num_replicas for d in local if ids[d][0] < num_replicas)
  else:
    rp = single
  return LeafEstimate(
      path=path, shape=shape, dtype=dtype_name, global_bytes=global_bytes,
      shard_bytes=shard_bytes, num_replicas=num_replicas, write_bytes=single,
      write_bytes_replica_parallel=rp, replica_parallel_applies=rp_applies,
  )


def estimate_tree(tree: Any, *, platform: str | None = None) -> TreeEstimate:
  """Estimates every leaf of `tree`; raises for deleted arrays."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  leaves = tuple(estimate_leaf(keystr(p), x) for p, x in flat)
  return TreeEstimate(
      leaves=leaves,
      platform=platform or jax.default_backend(),
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  )


@dataclasses.dataclass(frozen=True)
class OrbaxCost:
  """Predicted peak extra host RAM of one Orbax save, by component."""

  host_copy_bytes: int
  pinned_staging_bytes: int
  encode_bytes: int

  floor_bytes: int = ORBAX_FLOOR_BYTES

  @property
  def peak_bytes(self) -> int:
    return (self.host_copy_bytes + self.pinned_staging_bytes + self.encode_bytes
            + self.floor_bytes)


def predict_orbax(
    est: TreeEstimate,
    *,
    use_replica_parallel: bool,
    enable_pinned_host_transfer: bool,
    use_compression: bool,
    save_concurrent_bytes: int | None = None,
    save_device_host_concurrent_bytes: int | None = None,
) -> OrbaxCost:
  """Predicts the peak extra host RAM of an Orbax save under these settings.

  Async and sync saves peak alike: Orbax copies every array to host before
  `save()` returns either way; async only moves the encode and write into a
  background thread, where the host copies stay alive until the commit ends.
  """
  on_cpu = est.platform == 'cpu'
  copies, encodes = [], []
  for leaf in est.leaves:
    w = leaf.host_bytes(use_replica_parallel)
    if not leaf.is_array:
      copy = 0  # Already host memory.
    elif on_cpu:
      sliced = use_replica_parallel and leaf.replica_parallel_applies
      copy = w if sliced else 0
    else:
      copy = w
    copies.append(copy)
    encodes.append(
        w * (ENCODE_FACTOR if use_compression else UNCOMPRESSED_ENCODE_FACTOR)
    )
  copy_total = sum(copies)
  if save_device_host_concurrent_bytes is not None and copies:
    # Whole arrays are batched up to the limit; one batch is in flight while
    # the previous one finishes writing.
    copy_total = min(copy_total, save_device_host_concurrent_bytes + max(copies))
  encode_total = sum(encodes)
  if save_concurrent_bytes is not None:
    encode_total = min(encode_total, save_concurrent_bytes)
  pinned = 0
  if enable_pinned_host_transfer and not on_cpu:
    pinned = copy_total
  return OrbaxCost(
      host_copy_bytes=int(copy_total),
      pinned_staging_bytes=int(pinned),
      encode_bytes=int(encode_total),
  )
