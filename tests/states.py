"""Test states on 8 fake CPU devices, and a subprocess runner for measurements.

Each measured save runs in a fresh process (`python -m tests.states ...`), so
one test's heap never flatters or spoils another's peak.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from tests import zygote

P = jax.sharding.PartitionSpec
NS = jax.sharding.NamedSharding
MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def meshes():
  devs = np.array(jax.devices())
  return (jax.sharding.Mesh(devs.reshape(8), ('x',)),
          jax.sharding.Mesh(devs.reshape(4, 2), ('a', 'b')))


def small_leaves(rng, n: int) -> dict:
  """`n` small f32 leaves on one device, and one each replicated, on a 2-D
  mesh with prime extents, and to be cast (`cast`): what a restore reads
  whole (`reading._read_whole`)."""
  _, m2 = meshes()
  tree = {f'v{i:03d}': jnp.asarray(rng.standard_normal((i % 7 + 1, 3)), jnp.float32)
          for i in range(n)}
  tree.update({
      'rep': jax.device_put(rng.standard_normal((37, 11)).astype(np.float32), NS(m2, P())),
      'mesh': jax.device_put(rng.standard_normal((4 * 13, 2 * 7)).astype(np.float32),
                             NS(m2, P('a', 'b'))),
      'cast': jnp.asarray(rng.standard_normal((29, 31)), jnp.float32),
  })
  return tree


def filled(shape, sharding, dtype=jnp.float32, seed=0):
  """A deterministic array made on its devices (no host copy, no temporaries).

  One compiled program per (shape, sharding, dtype): the seed is an argument,
  so the 16 leaves of a `layout` compile at most 4 (each compile ~0.2 s).
  """
  return _filler(tuple(int(n) for n in shape), sharding, jnp.dtype(dtype))(
      np.float32(seed))


@functools.cache
def _filler(shape, sharding, dtype):
  n = int(np.prod(shape))

  def f(seed):
    # Hash noise (murmur3's finalizer of index and seed): as incompressible
    # as trained weights' mantissas, and fused by XLA into one pass (no
    # temporaries beside the output).  Integer ops: a replicated state is
    # computed on every device, and `sin` made a 1.5 GB one take 22 s.
    h = jax.lax.iota(jnp.uint32, n) + seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    u = (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))  # uniform in [0, 1)
    if jnp.issubdtype(dtype, jnp.integer):
      return (u * 255 - 128).reshape(shape).astype(dtype)
    return ((u - 0.5) * 4).reshape(shape).astype(dtype)

  return jax.jit(f, out_shardings=sharding)


def layout(name: str, total_bytes: int = 256 * MiB, n: int = 16):
  """sharded | replicated | mixed | mesh2d: n leaves of total_bytes."""
  m1, m2 = meshes()
  shs = {
      'sharded': [NS(m1, P('x'))],
      'replicated': [NS(m1, P())],
      'mesh2d': [NS(m2, P('a', 'b'))],
      'mixed': [NS(m1, P('x')), NS(m1, P()), NS(m2, P('a', 'b')), NS(m2, P(None, 'b'))],
  }[name]
  dts = [jnp.float32, jnp.bfloat16, jnp.float32, jnp.int8] if name == 'mixed' else [jnp.float32]
  tree = {}
  for i in range(n):
    dt = dts[i % len(dts)]
    rows = total_bytes // n // jnp.dtype(dt).itemsize // 1024 // 8 * 8
    tree[f'l{i:02d}'] = filled((rows, 1024), shs[i % len(shs)], dt, i)
  return tree


def one_replicated(total_bytes: int):
  m1, _ = meshes()
  return {'w': filled((total_bytes // 4 // 1024, 1024), NS(m1, P()))}


def unseen(name: str, total_bytes: int):
  """States whose shapes the cost constants were never fitted on (issue 11).

  prime:        prime rows per shard (sharded over 8) and prime columns
  prime_rep:    one replicated leaf of prime dims
  mesh2d_prime: a 4x2 mesh, prime extents per shard on both axes
  edge_chunks:  one leaf on one device whose chunks do not tile it (31621
                columns, odd): each row band ends in an edge chunk, stored whole
  many_small:   2,000 small leaves of mixed dtypes (plus one big one)
  mixed_dtypes: bf16 / int8 / f32 / bool leaves on several layouts
  zeros:        weights beside zero moments (sharded f32, replicated bf16)
                and a leaf whose first quarter is zero
  many_medium:  64 leaves of 1-6 MiB on four layouts (Gemma-like)
  fsdp_dp:      one leaf sharded over 'b' and replicated over 'a' (FSDP x data
                parallel): stock Orbax's replica-parallel save stores each
                shard as 4 chunks of rows, one a replica
  interleaved:  layers of a 4 KiB bias and a 0.94 MiB kernel on one device:
                at small budgets the biases are read whole in one batch and
                the kernels filled apart, so from a bucket the biases' reads
                (coalesced when under 1 MB apart) may span the kernels
  """
  m1, m2 = meshes()
  if name == 'prime':
    cols = 1031
    rows = _prime_below(max(3, total_bytes // 4 // cols // 8)) * 8  # prime rows per shard
    return {'w': filled((rows, cols), NS(m1, P('x')))}
  if name == 'prime_rep':
    cols = 1031
    rows = _prime_below(max(3, total_bytes // 4 // cols))
    return {'w': filled((rows, cols), NS(m1, P()))}
  if name == 'mesh2d_prime':
    b = 521
    a = _prime_below(max(3, total_bytes // 4 // 8 // b))
    return {'g': filled((4 * a, 2 * b), NS(m2, P('a', 'b')))}
  if name == 'edge_chunks':
    cols = 31621  # odd: halves of 15811 leave an edge chunk of 15810
    rows = max(12, total_bytes // 4 // cols // 12 * 12)
    return {'w': filled((rows, cols), jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
  if name == 'many_small':
    # Made on the host and put on the devices: 2,000 compiled fills would
    # take a minute.
    dts = [np.float32, jnp.bfloat16, np.int8, np.float32]
    rng = np.random.default_rng(0)
    base = rng.standard_normal((127, 31)).astype(np.float32) * 50
    tree = {f's{i:04d}': jax.device_put((base + i).astype(dts[i % 4]), NS(m1, P()))
            for i in range(2000)}
    rest = max(0, total_bytes - 2000 * 127 * 31 * 3)
    tree['big'] = filled((max(8, rest // 4 // 1024 // 8 * 8), 1024), NS(m1, P('x')))
    return tree
  if name == 'fsdp_dp':
    cols = 2053  # prime
    rows = max(8, total_bytes // 4 // cols // 8 * 8)
    return {'w': filled((rows, cols), NS(m2, P('b')))}
  if name == 'interleaved':
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rows = 240  # a 0.94 MiB kernel: under Orbax's 1 MB coalescing gap
    layers = max(8, total_bytes // (rows * 1024 * 4 + 4096))
    return {f'l{i:03d}': {'a_bias': filled((1024,), one, seed=2 * i),
                          'b_kernel': filled((rows, 1024), one, seed=2 * i + 1)}
            for i in range(layers)}
  if name == 'many_medium':
    # Gemma-like: 64 leaves of 1-6 MiB (bf16 and f32), sharded, replicated
    # and on a 2-D mesh, restored one after another (issue 20's gb bench).
    shs = [NS(m1, P('x')), NS(m1, P()), NS(m2, P('a', 'b')), NS(m1, P(None, 'x'))]
    tree = {}
    for i in range(64):
      dt = jnp.bfloat16 if i % 3 else jnp.float32
      cols = 1024 + 8 * (i % 5)
      rows = max(8, int(total_bytes / 64 * (0.25 + 1.5 * (i % 4) / 3)) // cols
                 // jnp.dtype(dt).itemsize // 8 * 8)
      tree[f'm{i:02d}'] = filled((rows, cols), shs[i % 4], dt, i)
    return tree
  if name == 'zeros':
    # A run's first checkpoint: weights beside optimizer moments still at
    # zero (stored zstd, `arrays.ZSTD_ZERO_LEAVES_FROM_BYTES`), and a leaf
    # whose first quarter is zero and the rest noise (raw: the writers look
    # at the whole leaf; the streaming writer looked at its first slice only
    # before 2b485df and stored it zstd).
    cols = 1031
    rows = _prime_below(max(3, total_bytes // 4 // 4 // cols // 8)) * 8
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    zeros = lambda shape, sh, dt: jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sh)()
    head = filled((rows, cols), one, jnp.float32, 1)
    return {
        'w': filled((rows, cols), NS(m1, P('x'))),
        'mu': zeros((rows, cols), NS(m1, P('x')), jnp.float32),
        'nu': zeros((rows + 1, cols), NS(m1, P()), jnp.bfloat16),
        'head': jax.jit(lambda x: x.at[:rows // 4].set(0), out_shardings=one,
                        donate_argnums=0)(head),
    }
  if name == 'unit_dims':
    # Chunks with an extent of 1 (a 1x1 conv kernel, per-layer scales, one
    # row a device), which TensorStore copies rather than reference
    # (`estimate.LeafEstimate.unit_dim_chunks`).
    q = total_bytes // 4 // 4  # f32 elements in a quarter
    return {
        'conv1x1': filled((1, 1, 1024, 2 * q // 1024 // 8 * 8), NS(m1, P(None, None, None, 'x'))),
        'rows': filled((8, q // 8), NS(m1, P('x')), seed=1),
        'scale': filled((16, 1, q // 16), NS(m1, P()), seed=2),
    }
  if name == 'wide_mesh2d':
    # Issue 18's case scaled: rows:cols 3:2 on a 4x2 mesh (24576x16384 at 1.5 GiB).
    cols = max(2, int((total_bytes / 4 / 1.5) ** 0.5)) // 2 * 2
    rows = max(4, total_bytes // 4 // cols) // 4 * 4
    return {'w': filled((rows, cols), NS(m2, P('a', 'b')))}
  if name == 'mixed_dtypes':
    q = total_bytes // 4
    return {
        'bf16': filled((q // 2 // 1024 // 8 * 8, 1024), NS(m2, P('a', 'b')), jnp.bfloat16, 1),
        'i8': filled((q // 1024 // 8 * 8, 1024), NS(m1, P()), jnp.int8, 2),
        'f32': filled((q // 4 // 1018, 1018), NS(m2, P(None, None)), jnp.float32, 3),
        'mask': jax.device_put(np.arange(q // 8) % 3 == 0, NS(m1, P('x'))),
    }
  if name == 'quantized':
    # Quantized weights: int4 (packed two to a byte on the devices, a byte an
    # element on the host and on disk) on a 2-D mesh with a prime extent and
    # whole on one device, float8 replicated, float4 sharded.  Made on the
    # host.
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(4)
    q = total_bytes // 4  # elements (a byte each on the host) in a quarter
    cols = 2053  # prime
    host = lambda shape, dt: (rng.standard_normal(shape, np.float32) * 4).astype(dt)
    # A process that saves has run its step: the compiler's start-up is paid.
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.float32(0)))
    return {
        'w4': jax.device_put(host((max(8, q // cols // 8 * 8), cols), ml_dtypes.int4),
                             NS(m2, P('a', None))),
        'one4': jax.device_put(host((q // 1024, 1024), ml_dtypes.int4),
                               jax.sharding.SingleDeviceSharding(jax.devices()[3])),
        'fp8': jax.device_put(host((q // 1031, 1031), ml_dtypes.float8_e4m3fn), NS(m1, P())),
        'fp4': jax.device_put(host((q // 1024 // 8 * 8, 1024), ml_dtypes.float4_e2m1fn),
                              NS(m2, P('a', 'b'))),
    }
  if name == 'packed_shapes':
    # 36 int4 and float4 leaves of as many shapes, on one device or (a
    # third) sharded by rows over 8, every shard of ~1/120 of the state: at
    # small budgets each is cut in a few slices on its device, one program
    # per shard shape, part shape and device (`streaming._DevicePrograms`).
    # Made on the host.
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(5)
    cols, n = 2048, 36
    rows = max(16, total_bytes // 120 // cols)  # per shard
    host = lambda shape, dt: (rng.standard_normal(shape, np.float32) * 4).astype(dt)
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.float32(0)))  # the step's compile
    out = {}
    for i in range(n):
      dt = ml_dtypes.int4 if i % 2 else ml_dtypes.float4_e2m1fn
      if i % 3:
        out[f'p{i:02d}'] = jax.device_put(host((rows + i, cols), dt), jax.devices()[i % 8])
      else:
        out[f'p{i:02d}'] = jax.device_put(host((8 * (rows + i), cols), dt), NS(m1, P('x')))
    return out
  raise KeyError(name)


def _prime_below(n: int) -> int:
  n = max(3, n)
  while any(n % p == 0 for p in range(2, int(n ** 0.5) + 1)):
    n -= 1
  return n


UNSEEN = ('prime', 'prime_rep', 'mesh2d_prime', 'edge_chunks', 'many_small', 'mixed_dtypes',
          'quantized')
OTHER = ('wide_mesh2d', 'zeros')
# Only some restore budget tests' (`interleaved`: from a bucket, where reads
# of one file coalesce).
RESTORE_ONLY = ('many_medium', 'fsdp_dp', 'interleaved')
# Only their own tests'.
SAVE_ONLY = ('unit_dims', 'packed_shapes')


def host_made(total_bytes: int):
  """Made on the host and put on the devices: nothing compiled (a cold process stays cold).

  A prime-row leaf sharded over 8 devices, a replicated one of prime dims and
  60 small leaves of 60 distinct shapes.
  """
  m1, _ = meshes()
  rng = np.random.default_rng(0)
  cols = 1031
  rows = _prime_below(max(3, total_bytes // 2 // 4 // cols // 8)) * 8
  tree = {'w': jax.device_put(rng.standard_normal((rows, cols), np.float32), NS(m1, P('x'))),
          'r': jax.device_put(rng.standard_normal(
              (_prime_below(max(3, total_bytes // 4 // 4 // cols)), cols), np.float32),
                              NS(m1, P()))}
  for i in range(60):
    tree[f's{i:02d}'] = jax.device_put(
        rng.standard_normal((17 + i, 29 + 2 * i)).astype(np.float32), NS(m1, P()))
  return tree


# Layouts `drawn` picks from: (mesh index, spec per rank); None = one device.
_DRAWN_LAYOUTS = (
    None, (0, ()), (0, ('x',)), (0, (None, 'x')), (1, ('a', 'b')), (1, ('a',)),
    (1, (None, 'b')), (1, (('a', 'b'),)), (1, ('b', 'a')), (1, ()),
)
_DRAWN_DTYPES = ('float32', 'bfloat16', 'float16', 'int8', 'int32', 'uint8', 'bool')


def _devices_over(layout, axes) -> int:
  """How many devices a spec entry (`None`, an axis or a tuple of them) splits a dim over."""
  sizes = ({'x': 8}, {'a': 4, 'b': 2})[layout[0]]  # `meshes()`
  return math.prod(sizes[a] for a in (axes if isinstance(axes, tuple) else (axes,) if axes else ()))


def _drawn_sharding(layout, rng):
  """The sharding of one of `_DRAWN_LAYOUTS` (a drawn device for None).

  With several processes a leaf on one device would be a different array in
  each (not one global state): it is replicated instead (the draw is made
  all the same, so that the rest of the state stays as drawn).
  """
  if layout is None:
    device = jax.devices()[int(rng.integers(8))]
    if jax.process_count() > 1:
      return NS(meshes()[0], P())
    return jax.sharding.SingleDeviceSharding(device)
  return NS(meshes()[layout[0]], P(*layout[1]))


def place(host: np.ndarray, sharding) -> jax.Array:
  """`host` on `sharding`: `device_put` in one process; with several, each
  process puts its own shards (every process holds the same `host`)."""
  if jax.process_count() == 1:
    return jax.device_put(host, sharding)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def drawn(seed: int, total_bytes: int):
  """A state nobody designed: leaves, shapes, dtypes and layouts drawn from `seed`.

  For `tools/fuzz_budget.py` (state name `drawn:SEED`).  1 to 200 leaves of
  ranks 0-4 whose byte sizes split `total_bytes` unevenly; sharded extents are
  a multiple of their mesh axes, often a prime one; the rest prime, power of
  two or anything.  Values are made on the host and put on the devices:
  nothing is compiled, and the host copies are gone before a measurement.
  Seeds from `QUANTIZED_FROM_SEED` up draw int4 and float8/float4 leaves too.
  """
  rng = np.random.default_rng(seed)
  tree = {}
  for name, host, sharding in _drawn_leaves(rng, total_bytes, seed):
    tree[name] = place(host, sharding)
    del host
  if rng.random() < 0.8:
    # Most processes that save have run a jitted step: the compiler's
    # start-up is behind them (the rest pay it inside the budget).
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.float32(seed)))
  return tree


def drawn_on_host(seed: int, total_bytes: int):
  """`drawn`'s leaves as (name, host values, sharding), one at a time."""
  yield from _drawn_leaves(np.random.default_rng(seed), total_bytes, seed)


def _drawn_dtype(rng) -> np.dtype:
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  name = _DRAWN_DTYPES[int(rng.integers(len(_DRAWN_DTYPES)))]
  return np.dtype(ml_dtypes.bfloat16) if name == 'bfloat16' else np.dtype(name)


# From this seed up, `drawn` also quantizes: each one-byte leaf (int8, uint8)
# becomes int4, float8_e4m3fn or float4_e2m1fn (stored a byte an element)
# two times in three, drawn from a generator of its own, so that the states
# of smaller seeds, which tests name, stay as they were.
QUANTIZED_FROM_SEED = 1000
_QUANTIZED_DTYPES = (None, 'int4', 'float8_e4m3fn', 'float4_e2m1fn')


def _drawn_leaves(rng, total_bytes: int, seed: int = 0):
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  qrng = np.random.default_rng([seed, 4]) if seed >= QUANTIZED_FROM_SEED else None
  n = int(rng.choice([1, int(rng.integers(2, 9)), int(rng.integers(9, 201))]))
  shares = rng.dirichlet(np.full(n, 0.3)) * total_bytes
  primes = [p for p in range(2, 2000) if all(p % q for q in range(2, int(p ** 0.5) + 1))]
  for i in range(n):
    dt = _drawn_dtype(rng)
    layout = _DRAWN_LAYOUTS[int(rng.integers(len(_DRAWN_LAYOUTS)))]
    spec = () if layout is None else layout[1]
    rank = int(rng.integers(len(spec), 5)) if spec or n == 1 or rng.random() < 0.9 else 0
    rank = max(rank, 1) if n == 1 else rank
    elems = max(1, int(shares[i]) // dt.itemsize)
    shape = []
    for d in range(rank):
      mult = _devices_over(layout, spec[d]) if d < len(spec) else 1
      left = max(1, elems // max(1, math.prod(shape)) // mult)
      per_dim = max(1, round(left ** (1 / (rank - d))))
      kind = rng.random()
      if kind < 0.4:
        k = max([p for p in primes if p <= per_dim] or [1])
      elif kind < 0.6:
        k = 1 << max(0, int(math.log2(per_dim)))
      else:
        k = int(rng.integers(1, per_dim + 1))
      shape.append(k * mult)
    shape = tuple(shape)
    sharding = _drawn_sharding(layout, rng)
    if dt == np.bool_:
      host = rng.integers(0, 2, shape).astype(bool)
    elif np.issubdtype(dt, np.integer):
      info = np.iinfo(dt)
      host = rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    else:
      host = rng.standard_normal(shape, np.float32).astype(dt)
    if qrng is not None and dt.itemsize == 1 and dt != np.bool_:
      quantized = _QUANTIZED_DTYPES[int(qrng.integers(len(_QUANTIZED_DTYPES)))]
      if quantized:
        host = (host.astype(np.float32) / 16).astype(getattr(ml_dtypes, quantized))
    yield f'd{i:03d}', host, sharding


def mixed(seed: int, total_bytes: int):
  """`drawn(seed)` beside what else a training state holds, drawn from `seed` too.

  For `tools/fuzz_budget.py` (state name `mixed:SEED`): `{'arrays': drawn
  leaves, 'extra': mixed_extra(...)}`.  The drawn leaves are those of
  `drawn(seed, total_bytes)`.
  """
  extra = mixed_extra(seed, total_bytes)
  return {'arrays': drawn(seed, total_bytes), 'extra': extra}


def mixed_extra(seed: int, total_bytes: int):
  """`mixed`'s leaves beside the drawn arrays: typed PRNG keys (threefry or
  rbg, one or a batch, on one device, replicated or sharded), numpy arrays on
  the host (up to half as many bytes again), and numpy and Python scalars.

  With several processes every key is one global array (a key on one device
  is replicated instead, as `_drawn_sharding` does for arrays).
  """
  rng = np.random.default_rng([seed, 1])  # not drawn's stream: its leaves stay
  host_share = float(rng.uniform(0.05, 0.5)) if rng.random() < 0.7 else 0.0
  keys, host = {}, {}
  for i in range(int(rng.integers(0, 4))):
    impl = 'threefry2x32' if rng.random() < 0.75 else 'rbg'
    key = jax.random.key(seed + i, impl=impl)
    kind = rng.random()
    if kind < 0.3:
      # One key, as a train state's `rng`.
      keys[f'k{i}'] = key if jax.process_count() == 1 else _placed_keys(key, NS(meshes()[0], P()))
      continue
    n = 8 * int(rng.integers(1, 2049))
    batch = jax.random.split(key, n)
    layout = (None, (0, ('x',)), (0, ()))[int(rng.integers(3))]
    keys[f'k{i}'] = _placed_keys(batch, _drawn_sharding(layout, rng))
  n_host = int(rng.integers(1, 6)) if host_share else 0
  shares = rng.dirichlet(np.full(max(n_host, 1), 0.5)) * total_bytes * host_share
  for i in range(n_host):
    dt = _drawn_dtype(rng)
    elems = max(1, int(shares[i]) // dt.itemsize)
    rank = int(rng.integers(0, 4)) if elems > 1 else 0
    shape, left = [], elems
    for d in range(rank):
      k = max(1, round(left ** (1 / (rank - d))) + int(rng.integers(-1, 2)))
      shape.append(k)
      left = max(1, left // k)
    values = rng.integers(0, 2, shape).astype(dt) if dt == np.bool_ else (
        rng.standard_normal(shape, np.float32).astype(dt))
    host[f'h{i}'] = np.asarray(values)
  scalars = {'step': int(rng.integers(0, 1 << 40)), 'lr': float(rng.uniform(0, 1e-3))}
  if rng.random() < 0.5:
    scalars['loss'] = np.float32(rng.standard_normal())
    scalars['count'] = np.int32(rng.integers(0, 1 << 30))
  return {'keys': keys, 'host': host, 'scalars': scalars}


def _placed_keys(keys: jax.Array, sharding) -> jax.Array:
  """Typed `keys` on `sharding`: `device_put` in one process; with several,
  their key data placed by `place` and wrapped again."""
  if jax.process_count() == 1:
    return jax.device_put(keys, sharding)
  data = place(np.asarray(jax.random.key_data(keys)), NS(sharding.mesh, sharding.spec))
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys))


def abstract_of(tree):
  """The restore target of `tree`: shapes, dtypes and shardings of its device
  arrays (PRNG keys included); numpy leaves as unallocated arrays of their
  shape (their pages are never touched), scalars as themselves."""
  def one(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, (np.ndarray, np.number)):
      # numpy scalars are stored as 0-d arrays, and a target takes them so
      # (Orbax's StandardRestore refuses np.number leaves, as kd_ckpt does).
      return np.empty(np.shape(x), x.dtype)
    return x
  return jax.tree.map(one, tree)


def custom_layouts(abstract, seed: int):
  """`abstract` with about half its arrays of rank 2 or more (keys aside) on a
  device-local layout other than the default, drawn from `seed` (a
  permutation of the dims, major to minor): a restore target for
  `support_layout=True`.  Returns it and {leaf path: major_to_minor}."""
  from jax.experimental import layout  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng([seed, 9])
  formats = {}

  def one(path, x):
    if (not isinstance(x, jax.ShapeDtypeStruct) or len(x.shape) < 2
        or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) or rng.random() < 0.5):
      return x
    order = tuple(int(d) for d in rng.permutation(len(x.shape)))
    if order == tuple(range(len(x.shape))):
      order = order[::-1]
    formats[jax.tree_util.keystr(path)] = order
    fmt = layout.Format(layout.Layout(major_to_minor=order), x.sharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fmt)
  return jax.tree_util.tree_map_with_path(one, abstract), formats


def redrawn(tree, seed: int):
  """`tree` put on other layouts drawn from `seed` (each one its shape divides).

  For restores onto another sharding than the saved one
  (`KD_TEST_RESHARD=SEED` in a `restore` worker; `tools/fuzz_budget.py`).
  """
  shardings = redrawn_shardings({k: x.shape for k, x in tree.items()}, seed)
  return {k: jax.device_put(x, shardings[k]) for k, x in tree.items()}


def redrawn_shardings(shapes: dict, seed: int) -> dict:
  """`redrawn`'s shardings for leaves of `shapes` (name -> shape)."""
  rng = np.random.default_rng(seed)

  def fits(layout, shape):
    if layout is None:
      return True
    return len(layout[1]) <= len(shape) and all(
        shape[d] % _devices_over(layout, axes) == 0 for d, axes in enumerate(layout[1]))

  out = {}
  for k, shape in shapes.items():
    choices = [l for l in _DRAWN_LAYOUTS if fits(l, shape)]
    out[k] = _drawn_sharding(choices[int(rng.integers(len(choices)))], rng)
  return out


def reshaped(tree, seed: int):
  """`tree` with some leaves' extents changed, drawn from `seed`: the saved
  values truncated, or padded with zeros, on the same shardings.

  For restores with `strict=False` (`KD_TEST_LOOSE=SEED` in a `restore`
  worker; `tools/fuzz_budget.py`): what such a restore must return.  A
  changed extent stays a multiple of the devices its dim is sharded over.
  """
  rng = np.random.default_rng([seed, 3])
  ranked = [k for k, x in tree.items() if x.ndim]
  picked = {k for k in ranked if rng.random() < 0.4}
  if ranked and not picked:  # at least one leaf changes
    picked = {ranked[int(rng.integers(len(ranked)))]}
  out = {}
  for k, x in tree.items():
    if k not in picked:
      out[k] = x
      continue
    d = int(rng.integers(x.ndim))
    spec = getattr(x.sharding, 'spec', ())
    mult = 1
    if d < len(spec) and spec[d] is not None:
      names = spec[d] if isinstance(spec[d], tuple) else (spec[d],)
      mult = math.prod(x.sharding.mesh.shape[a] for a in names)
    step = int(rng.choice([-3, -2, -1, 1, 2, 3]))
    shape = list(x.shape)
    shape[d] = max(mult, x.shape[d] + step * mult * int(rng.integers(1, 4)))
    host = np.zeros(shape, x.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(x.shape, shape))
    host[common] = np.asarray(x)[common]
    out[k] = jax.device_put(host, x.sharding)
    del host
  return out


def every_other_leaf_zeroed(tree):
  """`tree` with every other array leaf zeros on its own sharding (keys kept):
  a previous step's state that a reusing save takes the other leaves from."""
  flat, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [i for i, x in enumerate(flat)
            if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
  prev = list(flat)
  for i in arrays[::2]:
    prev[i] = jax.jit(jnp.zeros_like, out_shardings=flat[i].sharding)(flat[i])
  return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, prev))


def make_state(name: str, total_bytes: int):
  if name.startswith('drawn:'):
    return drawn(int(name.split(':', 1)[1]), total_bytes)
  if name.startswith('mixed:'):
    return mixed(int(name.split(':', 1)[1]), total_bytes)
  if name == 'one_replicated':
    return one_replicated(total_bytes)
  if name in UNSEEN + OTHER + RESTORE_ONLY + SAVE_ONLY:
    return unseen(name, total_bytes)
  return layout(name, total_bytes)


def stored_bytes(path) -> int:
  """Bytes of the files under `path` (a checkpoint's size on disk)."""
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def resident_bytes(tree) -> int:
  """Host RAM the arrays of `tree` hold on the CPU backend: each device buffer
  once (devices may share one, e.g. Orbax's `device_put` of one host shard)."""
  seen, other = {}, 0
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)  # a view of the key array's buffers
    if isinstance(x, np.ndarray):
      other += x.nbytes  # a numpy leaf restored on the host
    for s in getattr(x, 'addressable_shards', ()):
      seen[s.data.unsafe_buffer_pointer()] = s.data.nbytes
  return sum(seen.values()) + other


# Restores on devices that copy a host shard instead of keeping it (GPUs):
# the CPU backend keeps it (`reading._shares_host_buffers`) unless told not to.
def counting_calls(fn, pause_secs: float = 0.0):
  """(wrapper of `fn`, [most calls of it running at once]): how many leaves a
  restore fills at a time (patched over `reading.fill_array`).  `pause_secs`
  in each call lets calls that run side by side meet, however fast the reads."""
  lock, now, most = threading.Lock(), [0], [0]

  @functools.wraps(fn)
  def counted(*args, **kwargs):
    with lock:
      now[0] += 1
      most[0] = max(most[0], now[0])
    try:
      time.sleep(pause_secs)
      return fn(*args, **kwargs)
    finally:
      with lock:
        now[0] -= 1

  return counted, most


COPYING_DEVICES = {'KD_CKPT_SHARE_HOST_BUFFERS': '0'}


def run_worker(*args: str, timeout: int = 600, env: dict | None = None) -> dict:
  """Runs `python -m tests.states ARGS` in a fresh process; returns its JSON.

  The process is forked from this test process's zygote (`tests.zygote`:
  numpy, jax, TensorStore and Orbax imported, nothing started), or started
  from nothing when `env` sets more than KD_* variables or
  KD_TEST_EXEC_WORKERS=1.  `env`: variables set for it on top of this
  process's.
  """
  extra = dict(env or {})
  base = dict(os.environ)
  base['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  base['JAX_PLATFORMS'] = 'cpu'
  base['PYTHONPATH'] = REPO + os.pathsep + base.get('PYTHONPATH', '')
  rc = None
  if os.environ.get('KD_TEST_EXEC_WORKERS') != '1' and zygote.forkable_env(extra):
    try:
      rc, out, err = _zygote(base).run(list(args), extra, timeout)
    except zygote.ZygoteError:
      rc = None  # started from nothing below
  if rc is None:
    proc = subprocess.run(
        [sys.executable, '-m', 'tests.states', *args], cwd=REPO, env={**base, **extra},
        capture_output=True, text=True, timeout=timeout,
    )
    rc, out, err = proc.returncode, proc.stdout, proc.stderr
  if rc != 0:
    raise AssertionError(f'worker {args} failed (exit {rc}):\n{err[-4000:]}')
  return json.loads(out.strip().splitlines()[-1])


_ZYGOTE: 'zygote.Zygote | None' = None


def _zygote(env: dict) -> 'zygote.Zygote':
  """This process's zygote, started with `env` (again when a test changed it:
  e.g. the object-storage tests point the storage clients at their server)."""
  global _ZYGOTE
  if _ZYGOTE is not None and (not _ZYGOTE.alive() or _ZYGOTE.env != env):
    _ZYGOTE.close()
    _ZYGOTE = None
  if _ZYGOTE is None:
    _ZYGOTE = zygote.Zygote(env)
    atexit.register(_ZYGOTE.close)
  return _ZYGOTE


def _digests(tree) -> dict[str, str]:
  """sha256 of each leaf's shards, by path and shard index.

  Read through zero-copy views of the device buffers (CPU backend): no host
  copy is made, so the RSS measured after this is not disturbed.
  """
  import hashlib  # pylint: disable=g-import-not-at-top
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      name += f':key<{jax.random.key_impl(x)}>'  # restored typed, of its impl
      x = jax.random.key_data(x)
    shards = getattr(x, 'addressable_shards', None)
    if shards is None:
      host = np.ascontiguousarray(x)
      name += f':{host.dtype}{host.shape}'
      out[name] = hashlib.sha256(host.reshape(-1).view(np.uint8)).hexdigest()
      continue
    for sh in shards:
      index = tuple((s.start, s.stop) for s in sh.index)
      view = np.asarray(sh.data)  # zero-copy on the CPU backend
      out[f'{name}{index}'] = hashlib.sha256(
          np.ascontiguousarray(view).reshape(-1).view(np.uint8)).hexdigest()
      del view
  return out


def _settle() -> None:
  """Frees what the set-up left before a measurement's baseline is taken.

  Arrays left in reference cycles (a resharding `device_put` leaves some: a
  drawn state's 178 MiB) are otherwise freed by the collector inside the
  measured call, which then reuses their pages: a resharded restore read
  159 MiB below its restored arrays.
  """
  import gc  # pylint: disable=g-import-not-at-top
  gc.collect()
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top
  hostmem.release_free_memory()


# `restore` VIAs that load through a checkpointer the caller builds (`_worker`).
LOADERS = ('standard', 'orbax', 'gemma', 'gemma_stock', 'pytree', 'pytree_stock')


def _count_unpaid_compiles(startup) -> list[int]:
  """[n]: XLA compiles from here on that ran before kd_ckpt paid the start-up
  (`startup.start_compiler`, its own compile excepted): 0 unless a compile
  escaped the budget's accounting."""
  import jax.monitoring  # pylint: disable=g-import-not-at-top
  unpaid, inside, start = [0], [False], startup.start_compiler

  def start_compiler():
    inside[0] = True
    try:
      return start()
    finally:
      inside[0] = False

  startup.start_compiler = start_compiler

  def listen(event, *unused_args, **unused_kwargs):
    if event == '/jax/core/compile/backend_compile_duration' and not (
        startup._started or inside[0]):  # pylint: disable=protected-access
      unpaid[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listen)
  return unpaid


def _worker(argv):
  """MODE DIR STATE TOTAL_BYTES [ARGS]: one measured operation, JSON on stdout.

    save    STRATEGY BUDGET  kd_ckpt.save
    ckpt    STRATEGY BUDGET  SafeCheckpointer.save (async when the plan is
                             Orbax's) + wait; also the peak over the whole save
    orbax                    Orbax's default async save (StandardCheckpointer)
    stock                    the same, unmeasured (a checkpoint to restore)
    restore BUDGET [VIA]     kd_ckpt.restore (VIA=ckpt: SafeCheckpointer.restore
                             of a `ckpt` save; VIA=none: no target;
                             VIA=standard: Orbax's StandardCheckpointer inside
                             kd_ckpt.within_budget, VIA=gemma: Gemma's
                             gm.ckpts.load_params inside it, VIA=pytree: Orbax's
                             PyTreeCheckpointer inside it (MaxText's loader);
                             VIA=simple: Kauldron's SimpleCheckpointLoader of
                             a `ckpt` save's step 1 in InitWithinBudget;
                             VIA=orbax, gemma_stock, pytree_stock and
                             simple_stock: the same
                             without kd_ckpt, the budget unused); peak and the
                             restored bytes
    reuse   STRATEGY BUDGET  kd_ckpt.save(fingerprint=True) of the state with
                             every other array leaf zeroed, into DIR.prev,
                             then kd_ckpt.save of the state into DIR reusing
                             it; the peak is the larger of the two (both
                             measured), the second save's report is returned
    cold_save STRATEGY BUDGET    kd_ckpt.save as the process's first jit
                             (STATE is ignored: `host_made`)
    cold_restore BUDGET [orbax]  kd_ckpt.restore, no target, as the first jit
                             (orbax: Orbax's StandardCheckpointer instead)
  """
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import budget as budget_lib  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top

  mode, directory, state, total = argv[0], argv[1], argv[2], int(argv[3])
  if os.environ.get('KD_TEST_STALL_SECS'):
    from kd_ckpt import limiter  # pylint: disable=g-import-not-at-top
    # A wait on bytes nobody releases fails this soon (a deadlock, not a hang).
    limiter.STALL_SECS = float(os.environ['KD_TEST_STALL_SECS'])
  as_budget = lambda b: int(b) if b.isdigit() else b
  if mode.startswith('cold_'):
    out = {}
    if mode == 'cold_save':
      tree = host_made(total)
      jax.block_until_ready(tree)
      assert not startup._started  # pylint: disable=protected-access
      _settle()
      with hostmem.PeakRss() as peak:
        try:
          r = kd_ckpt.save(directory, tree, host_ram_budget=as_budget(argv[5]),
                           strategy=argv[4])
          out = r.to_json_dict()
        except kd_ckpt.BudgetTooSmallError as e:
          out['error'] = str(e)
    else:
      assert not startup._started  # pylint: disable=protected-access
      unpaid = _count_unpaid_compiles(startup)
      _settle()
      with hostmem.PeakRss() as peak:
        start = time.monotonic()
        try:
          if argv[5:] == ['orbax']:  # Orbax's own restore, for comparison
            back = ocp.StandardCheckpointer().restore(directory)
          else:
            back = kd_ckpt.restore(directory, host_ram_budget=as_budget(argv[4]))
          jax.block_until_ready(back)
          out['seconds'] = time.monotonic() - start
          out['restored_bytes'] = resident_bytes(back)
        except kd_ckpt.BudgetTooSmallError as e:
          out['error'] = str(e)
    out['measured_peak_extra_bytes'] = peak.extra_bytes
    out['compiled'] = startup._started  # pylint: disable=protected-access
    if mode == 'cold_restore':
      out['unpaid_compiles'] = unpaid[0]
    print(json.dumps(out))
    return
  tree = make_state(state, total)
  jax.block_until_ready(tree)
  if os.environ.get('KD_TEST_COLD_STORAGE') != '1':
    # A training process has listed its bucket long before it saves: the
    # storage clients' one-time start-up is not this save's (see the cold case).
    startup.start_storage(directory)
  if mode == 'save':
    # Measured from outside kd_ckpt: the whole call, not the report's own figure.
    _settle()
    with hostmem.PeakRss() as peak:
      start = time.monotonic()
      r = kd_ckpt.save(directory, tree, host_ram_budget=as_budget(argv[5]), strategy=argv[4])
      seconds = time.monotonic() - start
    out = r.to_json_dict()
    out['report_peak_extra_bytes'] = out['peak_extra_bytes']
    out['peak_extra_bytes'] = peak.extra_bytes
    out['call_seconds'] = seconds
  elif mode == 'reuse':
    # The previous step's checkpoint differs in every other array leaf (zeros,
    # on the leaf's own sharding), so the second save reuses some leaves and
    # writes the others; what is restored from DIR is the state as drawn.
    prev = every_other_leaf_zeroed(tree)
    peaks = []
    from etils import epath  # pylint: disable=g-import-not-at-top
    if epath.Path(directory + '.prev').exists():  # left by a refused attempt
      epath.Path(directory + '.prev').rmtree()
    for target, item, reuse_from in ((directory + '.prev', prev, None),
                                     (directory, tree, directory + '.prev')):
      _settle()
      with hostmem.PeakRss() as peak:
        r = kd_ckpt.save(target, item, host_ram_budget=as_budget(argv[5]), strategy=argv[4],
                         fingerprint=True, reuse_from=reuse_from)
      peaks.append(peak.extra_bytes)
    del prev
    out = r.to_json_dict()
    out['peak_extra_bytes'] = max(peaks)
    out['peaks'] = peaks
  elif mode == 'ckpt':
    from kauldron import kd  # pylint: disable=g-import-not-at-top
    import flax  # pylint: disable=g-import-not-at-top

    @flax.struct.dataclass
    class State(kd.ckpts.items.StandardCheckpointItem):
      params: dict

    ckpt = kd_ckpt.SafeCheckpointer(workdir=directory, save_interval_steps=1,
                                    host_ram_budget=as_budget(argv[5]), strategy=argv[4])
    item = State(params=tree)
    ckpt.save(item, step=0)  # warm-up (imports, thread pools), as in training
    ckpt.wait_until_finished()
    _settle()
    with hostmem.PeakRss() as whole:
      ckpt.save(item, step=1)
      ckpt.wait_until_finished()
    out = ckpt.reports[-1].to_json_dict()
    out['whole_save_peak_extra_bytes'] = whole.extra_bytes
  elif mode in ('orbax', 'stock'):
    _settle()
    with hostmem.PeakRss() as peak:
      start = time.monotonic()
      ckptr = ocp.StandardCheckpointer()
      ckptr.save(directory, tree)
      ckptr.wait_until_finished()
      seconds = time.monotonic() - start
    out = {'peak_extra_bytes': peak.extra_bytes, 'seconds': seconds}
  elif mode == 'restore':
    budget = as_budget(argv[4])
    via = argv[5] if len(argv) > 5 else 'api'
    if os.environ.get('KD_TEST_WARM') == '1':
      startup.start_compiler()  # paid before, as a training process has
    # A `mixed` state's drawn arrays are under 'arrays'; its keys, numpy
    # arrays and scalars stay as saved.
    arrays_of = ((lambda fn, t: {**t, 'arrays': fn(t['arrays'])}) if state.startswith('mixed:')
                 else (lambda fn, t: fn(t)))
    if os.environ.get('KD_TEST_RESHARD'):
      seed = int(os.environ['KD_TEST_RESHARD'])
      tree = jax.block_until_ready(arrays_of(lambda t: redrawn(t, seed), tree))
    strict = not os.environ.get('KD_TEST_LOOSE')
    if not strict:  # strict=False: other extents, truncated or padded
      seed = int(os.environ['KD_TEST_LOOSE'])
      tree = jax.block_until_ready(arrays_of(lambda t: reshaped(t, seed), tree))
    abstract = abstract_of(tree)
    formats = {}
    if os.environ.get('KD_TEST_LAYOUT'):  # onto custom layouts (support_layout)
      abstract, formats = custom_layouts(abstract, int(os.environ['KD_TEST_LAYOUT']))
    want = _digests(tree)  # every restore is checked bit-exact, after measuring
    del tree
    _settle()
    if via == 'ckpt':
      from kauldron import kd  # pylint: disable=g-import-not-at-top
      import flax  # pylint: disable=g-import-not-at-top

      @flax.struct.dataclass
      class State(kd.ckpts.items.StandardCheckpointItem):  # pylint: disable=function-redefined
        params: dict

      ckpt = kd_ckpt.SafeCheckpointer(workdir=directory, save_interval_steps=1,
                                      host_ram_budget=budget)
      with hostmem.PeakRss() as peak:
        back = ckpt.restore(State(params=abstract), step=1, donate=False)
        jax.block_until_ready(back)
    elif via in ('simple', 'simple_stock'):
      # A fine-tune's start from another Kauldron run (a `ckpt` save here):
      # Kauldron's `SimpleCheckpointLoader` (an Orbax CheckpointManager), in
      # `InitWithinBudget` ('simple') or alone.
      from kauldron import kd  # pylint: disable=g-import-not-at-top
      import flax  # pylint: disable=g-import-not-at-top

      @flax.struct.dataclass
      class State(kd.ckpts.items.StandardCheckpointItem):  # pylint: disable=function-redefined
        params: dict

      loader = kd.ckpts.SimpleCheckpointLoader(workdir=directory, step=1)
      if via == 'simple':
        loader = kd_ckpt.InitWithinBudget(wrapped=loader, host_ram_budget=budget)
      with hostmem.PeakRss() as peak:
        back = loader.transform(State(params=abstract))
        jax.block_until_ready(back)
    elif via in LOADERS:
      # Code that builds its own Orbax checkpointer (a weights loader).
      scope = (kd_ckpt.within_budget(budget) if via in ('standard', 'gemma', 'pytree')
               else contextlib.nullcontext())
      if via.startswith('gemma'):
        from gemma import gm  # pylint: disable=g-import-not-at-top
        import tempfile  # pylint: disable=g-import-not-at-top
        # Gemma imports much lazily (TensorFlow among it, ~700 MiB) on its
        # first load, and a Kauldron run has compiled its model by its init
        # transform: one tiny load first, so that neither is measured here.
        with tempfile.TemporaryDirectory() as tiny:
          gm.ckpts.save_params({'w': jnp.ones((3,))}, tiny + '/c', wait_until_finished=True)
          with (kd_ckpt.within_budget(budget) if via == 'gemma' else contextlib.nullcontext()):
            gm.ckpts.load_params(tiny + '/c')
        _settle()
        load = lambda: gm.ckpts.load_params(directory, params=abstract)
      elif via.startswith('pytree'):
        # MaxText's `load_params_from_path`: Orbax's PyTree handler, restore args
        # from the target (only what the target names is read).
        load = lambda: ocp.PyTreeCheckpointer().restore(
            directory, item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(
                abstract))
      else:
        load = lambda: ocp.StandardCheckpointer().restore(directory, abstract)
      with hostmem.PeakRss() as peak:
        start = time.monotonic()
        with scope:
          back = load()
        jax.block_until_ready(back)
        seconds = time.monotonic() - start
    elif via == 'none':  # no target: shapes, dtypes and shardings as saved
      with hostmem.PeakRss() as peak:
        back = kd_ckpt.restore(directory, host_ram_budget=budget, strict=strict)
        jax.block_until_ready(back)
    else:
      with hostmem.PeakRss() as peak:
        back = kd_ckpt.restore(directory, abstract, host_ram_budget=budget, strict=strict,
                               support_layout=bool(formats))
        jax.block_until_ready(back)
    for path, leaf in jax.tree_util.tree_flatten_with_path(back)[0]:
      want_layout = formats.get(jax.tree_util.keystr(path))
      if want_layout is not None and leaf.format.layout.major_to_minor != want_layout:
        raise SystemExit(f'{jax.tree_util.keystr(path)} came back in layout'
                         f' {leaf.format.layout.major_to_minor}, not {want_layout}')
    out = {'peak_extra_bytes': peak.extra_bytes, 'restored_bytes': resident_bytes(back),
           'budget_bytes': budget_lib.resolve(budget, hostmem.probe())}
    if via in LOADERS:
      out['seconds'] = seconds
    got = _digests(back.params if via in ('ckpt', 'simple', 'simple_stock') else back)
    if got != want:
      bad = sorted(k for k in want if got.get(k) != want[k])
      raise SystemExit(f'restored values differ from the saved ones: {bad[:5]}')
  else:
    raise SystemExit(f'unknown mode {mode!r}')
  print(json.dumps(out))


if __name__ == '__main__':
  _worker(sys.argv[1:])
