"""The benchmark's GB-scale states, its reuse runs and its two-process saves.

Used by bench/run.py (the worker side of `--part gb`, `--part reuse` and
`--part mp`).  Nothing here imports jax at module level: the parent process
and the tests import this module without starting a JAX backend.

States are generated on the devices by a jitted integer hash of the element
index (no host copy, ~1 s for 4 GB on 2 cores): uniform floats in [-0.5,
0.5) whose bytes do not compress, so Orbax's zstd gets no unfair help.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import measure

MiB, GiB = measure.MiB, measure.GiB

# --part gb: a single 4 GB f32 leaf (1e9 parameters) on one device, and a
# Gemma-like state of bf16 params + f32 Adam mu/nu over 8 devices.
BIG_BYTES = 31622 * 31622 * 4            # 3.9998e9 bytes, shape (31622, 31622)
GEMMA_GB_BYTES = 2_200_000_000           # >= 2 GB logical
GEMMA_GB_LAYERS = 16                     # 344 leaves
GB_STATES = ('big', 'gemma_gb')

# --part reuse: 1 GiB frozen + 16 MiB trainable (+ mu, nu, a step counter).
REUSE_FROZEN_BYTES = 1 * GiB
REUSE_TRAIN_BYTES = 16 * MiB
REUSE_SAVES = 10
REUSE_KEPT = 3
REUSE_BUDGET = 256 * MiB

# --part mp: 2 processes x 4 CPU devices, 96 MiB per process.
MP_SHARDED_SHAPE = (8192, 8192)     # f32, 256 MiB, over a 4x2 mesh
MP_REPLICATED_SHAPE = (4096, 2048)  # f32, 32 MiB, on all 8 devices (both processes)
MP_BUDGET = 96 * MiB
MP_DEVICES_PER_PROCESS = 4


# ==========================================================================
# Generated arrays.

_GEN_CACHE: dict[Any, Any] = {}


def gen_leaf(jax, shape, dtype, sharding, seed: int):
  """A jax.Array of `shape`/`dtype`/`sharding`, values a hash of (seed, index)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  shape = tuple(int(d) for d in shape)
  key = (shape, jnp.dtype(dtype).name, sharding)
  fn = _GEN_CACHE.get(key)
  if fn is None:
    def make(seed_u32):
      idx = jnp.zeros(shape, jnp.uint32)
      stride = 1
      for ax in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(
            stride % 2**32)
        stride *= shape[ax]
      x = idx * jnp.uint32(2654435761) + seed_u32 * jnp.uint32(0x9E3779B9)
      x = x ^ (x >> 15)
      x = x * jnp.uint32(0x85EBCA6B)
      x = x ^ (x >> 13)
      if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        return (x >> 8).astype(dtype)
      f = jax.lax.bitcast_convert_type(
          (x & jnp.uint32(0x007FFFFF)) | jnp.uint32(0x3F800000), jnp.float32) - 1.5
      return f.astype(dtype)

    fn = jax.jit(make, out_shardings=sharding)
    _GEN_CACHE[key] = fn
  return fn(np.uint32(seed % 2**32))



def add_one_state_args(ap, *, reps: int) -> None:
  """The arguments of the one-process save benches (ab_save, disk_timeline)."""
  ap.add_argument('--state', default='gemma_gb', choices=GB_STATES + ('leaves', 'zeros'),
                  help='leaves: --leaves f32 leaves of --leaf-bytes each, on one device;'
                  ' zeros: tests/states.py\'s `zeros` (noise beside large all-zero leaves)'
                  ' of --gb (default 0.5 GiB)')
  ap.add_argument('--gb', type=float, default=None, help='state size (default: the bench\'s)')
  ap.add_argument('--leaves', type=int, default=1000)
  ap.add_argument('--leaf-bytes', type=int, default=4096)
  ap.add_argument('--leaf-values', default='hashed', choices=('hashed', 'zeros'),
                  help='zeros: as a freshly initialised optimizer state (compressible)')
  ap.add_argument('--budget', default='256MiB')
  ap.add_argument('--reps', type=int, default=reps)
  ap.add_argument('--dir', default=None, help='where to write (default: a temp dir)')


def build_one_state(jax, args):
  """The state `add_one_state_args`'s arguments name, at their size."""
  if args.state == 'leaves':
    return build_leaves(jax, args.leaves, args.leaf_bytes, zeros=args.leaf_values == 'zeros')
  if args.state == 'zeros':
    from tests import states  # pylint: disable=g-import-not-at-top
    return states.make_state('zeros', int(args.gb * 1e9) if args.gb else 512 << 20)
  total = int(args.gb * 1e9) if args.gb else (
      GEMMA_GB_BYTES if args.state == 'gemma_gb' else BIG_BYTES)
  return build_gb_state(jax, args.state, total)

def _round(x, m):
  return max(m, int(round(x / m)) * m)


def shard_spec(shape, n, min_bytes, itemsize):
  """Shard the largest axis divisible by n; small leaves stay replicated."""
  if math.prod(shape) * itemsize < min_bytes:
    return (None,) * len(shape)
  best = None
  for ax, d in enumerate(shape):
    if d % n == 0 and (best is None or d > shape[best]):
      best = ax
  return tuple('d' if i == best else None for i in range(len(shape)))


def gemma_shapes(total_bytes: int, layers: int, n: int) -> dict[str, Any]:
  """Gemma-like parameter shapes for ~total_bytes of params + Adam mu/nu.

  bf16 params and f32 mu/nu: 10 bytes per parameter.  Per layer: q/kv/o
  attention, a gated MLP (F = 8 D), two RMS norms; an embedding; a final norm.
  """
  n_params = total_bytes / 10
  per_layer = 26.25  # in D^2: q 1 + kv 1/4 + o 1 + gating 16 + linear 8
  d = _round(math.sqrt(0.75 * n_params / (layers * per_layer)), 64)
  f, kvd = 8 * d, max(8, d // 8)
  vocab = _round(max(n_params - layers * per_layer * d * d, 64 * d) / d, 64)
  shapes: dict[str, Any] = {'embedder': {'input_embedding': (vocab, d)},
                            'final_norm': {'scale': (d,)}}
  for l in range(layers):
    shapes[f'layer_{l}'] = {
        'attn': {'q_einsum': (d, d), 'kv_einsum': (2, d, kvd), 'attn_vec_einsum': (d, d)},
        'mlp': {'gating_einsum': (2, d, f), 'linear': (f, d)},
        'pre_attention_norm': {'scale': (d,)},
        'pre_ffw_norm': {'scale': (d,)},
    }
  return shapes


def build_big(jax, total_bytes: int):
  """One f32 leaf on ONE device, as square as possible (31622^2 at 4 GB)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  side = max(8, int(math.isqrt(max(1, total_bytes // 4))))
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return {'w': jax.block_until_ready(gen_leaf(jax, (side, side), jnp.float32, sharding, 1))}


def build_gemma_gb(jax, total_bytes: int, layers: int = GEMMA_GB_LAYERS):
  """bf16 params + f32 Adam mu/nu, leaves >= 1 MiB sharded over all devices."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  n = len(devices)
  shapes = gemma_shapes(total_bytes, layers, n)
  counter = iter(range(100_000))

  def make(dtype):
    def one(shape):
      spec = shard_spec(shape, n, 1 * MiB, jnp.dtype(dtype).itemsize)
      return gen_leaf(jax, shape, dtype, NamedSharding(mesh, P(*spec)), next(counter))
    return jax.tree.map(one, shapes, is_leaf=lambda x: isinstance(x, tuple))

  params = make(jnp.bfloat16)
  mu, nu = make(jnp.float32), make(jnp.float32)
  rep = NamedSharding(mesh, P())
  count = jax.device_put(jnp.int32(1234), rep)
  state = {'params': params, 'opt_state': {'count': count, 'mu': mu, 'nu': nu},
           'step': jax.device_put(jnp.int32(1234), rep)}
  return jax.block_until_ready(state)


def abstract_gemma_gb(jax, total_bytes: int, layers: int = GEMMA_GB_LAYERS):
  """`build_gemma_gb`'s shapes, dtypes and shardings, with nothing allocated:
  the target of a restore in a fresh process (a resumed run)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  n = len(devices)
  shapes = gemma_shapes(total_bytes, layers, n)

  def make(dtype):
    def one(shape):
      spec = shard_spec(shape, n, 1 * MiB, jnp.dtype(dtype).itemsize)
      return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
    return jax.tree.map(one, shapes, is_leaf=lambda x: isinstance(x, tuple))

  scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
  return {'params': make(jnp.bfloat16),
          'opt_state': {'count': scalar, 'mu': make(jnp.float32), 'nu': make(jnp.float32)},
          'step': scalar}


def build_leaves(jax, num_leaves: int, leaf_bytes: int, zeros: bool = False):
  """`num_leaves` f32 leaves of `leaf_bytes` (hashed values, or zeros) on one device."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  if num_leaves < 1 or leaf_bytes < 4 or leaf_bytes % 4:
    raise ValueError(f'--leaves {num_leaves} --leaf-bytes {leaf_bytes}: need at least one'
                     ' leaf of a positive multiple of 4 bytes (f32).')
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  make = ((lambda i: jax.device_put(jnp.zeros((leaf_bytes // 4,), jnp.float32), sharding))
          if zeros else (lambda i: gen_leaf(jax, (leaf_bytes // 4,), jnp.float32, sharding, i)))
  return {f'l{i:05d}': jax.block_until_ready(make(i)) for i in range(num_leaves)}


def build_gb_state(jax, name: str, total_bytes: int):
  if name == 'big':
    return build_big(jax, total_bytes)
  if name == 'gemma_gb':
    return build_gemma_gb(jax, total_bytes)
  raise ValueError(f'unknown GB state {name!r}')


# ==========================================================================
# Reuse (issue 13): frozen part + trainable part + optimizer state.


def reuse_layout(frozen_bytes: int, train_bytes: int, n: int) -> dict[str, Any]:
  """{path: (shape, dtype, sharded?)}: frozen leaves sharded and replicated."""
  rows = lambda b, cols: _round(b / 4 / cols, n)
  frozen = {
      'embed': ((rows(frozen_bytes * 0.375, 1024), 1024), 'float32', True),
      'block_0': ((rows(frozen_bytes * 0.25, 1024), 1024), 'float32', True),
      'block_1': ((rows(frozen_bytes * 0.25, 1024), 1024), 'float32', True),
      'norm_0': ((rows(frozen_bytes * 0.0625, 1024), 1024), 'float32', False),
      'norm_1': ((rows(frozen_bytes * 0.0625, 1024), 1024), 'float32', False),
  }
  train = {
      'lora_a': ((rows(train_bytes / 2, 256), 256), 'float32', True),
      'lora_b': ((rows(train_bytes / 2, 256), 256), 'float32', False),
  }
  return {'frozen': frozen, 'train': train}


def _layout_bytes(layout: dict[str, Any]) -> int:
  import numpy as np  # pylint: disable=g-import-not-at-top
  return sum(math.prod(s) * np.dtype(d).itemsize for s, d, _ in layout.values())


def build_reuse_state(jax, frozen_bytes: int, train_bytes: int):
  """(state, sizes): frozen + trainable + {mu, nu} + step, on 8 devices."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  layout = reuse_layout(frozen_bytes, train_bytes, len(devices))
  shard = lambda sharded: NamedSharding(mesh, P('d', None) if sharded else P())

  def part(name, seed0):
    return {k: gen_leaf(jax, s, d, shard(sh), seed0 + i)
            for i, (k, (s, d, sh)) in enumerate(sorted(layout[name].items()))}

  state = {
      'frozen': part('frozen', 1000),
      'trainable': part('train', 0),
      'opt_state': {'mu': part('train', 100), 'nu': part('train', 200)},
      'step': jax.device_put(jnp.int32(0), NamedSharding(mesh, P())),
  }
  sizes = {'frozen_bytes': _layout_bytes(layout['frozen']),
           'changing_bytes': 3 * _layout_bytes(layout['train']) + 4}
  return jax.block_until_ready(state), (layout, mesh, sizes)


def reuse_step(jax, state, layout_mesh, i: int, rebuild_frozen: bool = False):
  """The next state: new trainable, mu, nu and step; the frozen part as is.

  `rebuild_frozen`: the frozen part as new arrays of the same bytes, as a
  train step that returns the whole state (Kauldron's) gives them: kd_ckpt
  then hashes them every save instead of reusing the live arrays' records.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  layout, mesh, _ = layout_mesh
  shard = lambda sharded: NamedSharding(mesh, P('d', None) if sharded else P())

  def part(seed0):
    return {k: gen_leaf(jax, s, d, shard(sh), seed0 + i * 1000 + j)
            for j, (k, (s, d, sh)) in enumerate(sorted(layout['train'].items()))}

  new = {
      'frozen': (jax.tree.map(jnp.copy, state['frozen']) if rebuild_frozen
                 else state['frozen']),
      'trainable': part(10),
      'opt_state': {'mu': part(110), 'nu': part(210)},
      'step': jax.device_put(jnp.int32(i), NamedSharding(mesh, P())),
  }
  return jax.block_until_ready(new)


def du_bytes(path: str) -> int | None:
  """`du -s` in bytes: hard links counted once (apparent sizes)."""
  try:
    out = subprocess.run(['du', '-s', '--apparent-size', '-B1', path],
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[0])
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return None


def warm_page_cache(path: str) -> int:
  """Reads every file under `path` once; returns the bytes read.

  Before a timed restore, so that every checkpoint is read from a warm page
  cache: kd_ckpt's local saves drop their pages as they write
  (`kd_ckpt.writeback`), Orbax's keep them, and a restore bench compares
  the restores, not the disk.
  """
  total = 0
  for d, _, names in os.walk(path):
    for n in names:
      with open(os.path.join(d, n), 'rb', buffering=0) as f:
        while chunk := f.read(8 << 20):
          total += len(chunk)
  return total


# PR_SET_THP_DISABLE (linux/prctl.h).
_PR_SET_THP_DISABLE = 41


def disable_thp() -> str:
  """Turns transparent huge pages off for this process and every worker it
  starts (the setting is inherited across fork and exec); returns a line
  for the results' header saying what was done.

  Why: on this project's VMs free memory goes back to the host in 2 MiB
  blocks within seconds (free page reporting), and a huge page is such a
  block, so its first touch is a host fault: ~26 ms a huge page (a 512 MiB
  restore spent 5.8-6.6 s in system time), against ~2 us a 4 KiB page
  (1.5 GiB of fresh anonymous memory touched in 0.70-0.93 s).  On the CPU backend XLA asks for huge pages on the
  buffers it allocates (`madvise(MADV_HUGEPAGE)` on each 511 MiB array of a
  512 MiB restore), and whichever library's restore allocates them first
  pays.  Measured 2026-12-04 (`/tmp` script, edge_chunks at 512 MiB, a
  stock checkpoint restored alternately, 2 runs each): with huge pages
  kd_ckpt 6.7-6.9 s then 0.74-0.75 s, Orbax 2.6-8.7 s then 3.1-3.2 s; with
  them off kd_ckpt 0.91-0.99 s, Orbax 1.63-1.67 s.  A GPU host's arrays are
  device memory, which this does not touch.  `KD_BENCH_THP=keep` leaves
  huge pages as the system sets them.

  Example:

    print(workloads.disable_thp())   # at the start of a bench's main()
  """
  if os.environ.get('KD_BENCH_THP') == 'keep':
    return 'transparent huge pages: as the system sets them (KD_BENCH_THP=keep)'
  import ctypes  # pylint: disable=g-import-not-at-top
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
      raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
  except (OSError, AttributeError) as e:
    return f'transparent huge pages: as the system sets them (prctl failed: {e})'
  return ('transparent huge pages: off for the bench\'s processes (prctl PR_SET_THP_DISABLE;'
          ' KD_BENCH_THP=keep leaves them on; see bench/workloads.py disable_thp)')


def make_work_dir(parent: str | None, prefix: str) -> str:
  """A new temporary folder for a bench's checkpoints, in `parent` (made if
  missing; None: the system's temporary folder)."""
  import tempfile  # pylint: disable=g-import-not-at-top
  if parent:
    os.makedirs(parent, exist_ok=True)
  return tempfile.mkdtemp(dir=parent, prefix=prefix)


def disk_stats(path: str) -> dict[str, int]:
  """Counters so far of the block device holding `path` (/proc/diskstats;
  zeros where there is none): bytes written, write requests, flushes, busy ms.

  A partition's counters are its disk's: `minor & ~0xf` finds the disk.
  """
  dev = os.stat(path).st_dev
  major, minor = os.major(dev), os.minor(dev)
  with open('/proc/diskstats') as f:
    for line in f:
      x = line.split()
      if int(x[0]) == major and int(x[1]) in (minor, minor & ~0xf):
        return {'written_bytes': int(x[9]) * 512, 'writes': int(x[7]), 'busy_ms': int(x[12]),
                'flushes': int(x[18]) if len(x) > 18 else 0}
  return {'written_bytes': 0, 'writes': 0, 'busy_ms': 0, 'flushes': 0}


def _report_save(report) -> dict[str, Any]:
  return {'strategy': report.strategy, 'settings': report.settings,
          'bytes_written': report.bytes_written, 'bytes_reused': report.bytes_reused,
          'leaves_reused': report.leaves_reused,
          'report_peak_extra_bytes': report.peak_extra_bytes,
          'report_seconds': report.seconds, 'budget_bytes': report.budget_bytes}


def worker_reuse(jax, spec: dict[str, Any]) -> dict[str, Any]:
  """`saves` saves of the reuse state; only trainable/opt/step change."""
  import gc  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import cost  # pylint: disable=g-import-not-at-top

  variant, budget, root = spec['variant'], spec['budget'], spec['workdir']
  kept = int(spec.get('kept', REUSE_KEPT))
  state, lm = build_reuse_state(jax, spec['frozen_bytes'], spec['train_bytes'])
  out: dict[str, Any] = {'variant': variant, 'budget_bytes': budget, 'kept': kept,
                         'floor_bytes': cost.FLOOR_BYTES, **lm[2],
                         'leaves': len(jax.tree.leaves(state)), 'enforced': True}
  ckdir = os.path.join(root, 'checkpoints')
  os.makedirs(ckdir, exist_ok=True)
  saves: list[dict[str, Any]] = []

  if variant.startswith('SafeCheckpointer'):
    from kauldron import kd  # pylint: disable=g-import-not-at-top
    import flax  # pylint: disable=g-import-not-at-top

    @flax.struct.dataclass
    class State(kd.ckpts.items.StandardCheckpointItem):
      frozen: Any
      trainable: Any
      opt_state: Any
      step: Any

    ckpt = kd_ckpt.SafeCheckpointer(
        workdir=root, save_interval_steps=1, host_ram_budget=budget,
        reuse_unchanged=True, max_to_keep=kept)
    # Warm-up: a tiny save with another checkpointer (imports, pools).
    warm = kd_ckpt.SafeCheckpointer(workdir=os.path.join(root, 'warm'),
                                    save_interval_steps=1, host_ram_budget=budget)
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    tiny = jax.device_put(jnp.ones((8, 128), jnp.float32))
    warm.save(State(frozen={'a': tiny}, trainable={'a': tiny}, opt_state={'a': tiny},
                     step=tiny), step=0)
    warm.close()
    shutil.rmtree(os.path.join(root, 'warm'), ignore_errors=True)
    ckdir = os.path.join(root, 'checkpoints')

    def save(st, i):
      ckpt.save(State(**st), step=i)
      ckpt.wait_until_finished()
      return ckpt.reports[-1]
  else:
    def save(st, i):
      prev = os.path.join(ckdir, f'ckpt_{i - 1}') if i > 0 else None
      path = os.path.join(ckdir, f'ckpt_{i}')
      report = kd_ckpt.save(path, st, host_ram_budget=budget, fingerprint=True,
                            reuse_from=prev)
      old = os.path.join(ckdir, f'ckpt_{i - kept}')
      if i >= kept:
        shutil.rmtree(old, ignore_errors=True)  # keep `kept`, like max_to_keep
      return report
    # Warm-up outside the checkpoints folder.
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    kd_ckpt.save(os.path.join(root, 'warm'), {'a': jax.device_put(jnp.ones((8, 128)))},
                 host_ram_budget=budget, fingerprint=True)
    shutil.rmtree(os.path.join(root, 'warm'), ignore_errors=True)

  for i in range(int(spec['saves'])):
    if i > 0:
      new = reuse_step(jax, state, lm, i, rebuild_frozen=variant.endswith('frozen rebuilt'))
      del state
      state = new
    gc.collect()
    measure.malloc_trim()
    with measure.Peak() as p:
      t0 = time.perf_counter()
      report = save(state, i)
      secs = time.perf_counter() - t0
    saves.append({'step': i, 'peak_extra_bytes': p.extra_bytes, 'seconds': secs,
                  **_report_save(report)})
  if variant.startswith('SafeCheckpointer'):
    ckpt.close()
  out['saves'] = saves
  out['disk_bytes'] = du_bytes(ckdir)
  out['checkpoints_kept'] = sorted(d for d in os.listdir(ckdir) if d.startswith('ckpt_'))
  return out


# --- The tiny Gemma LoRA through kauldron.main (parent side) --------------------

_SAVED_RE = None


def _parse_saved_line(line: str) -> dict[str, Any] | None:
  """One `kd_ckpt step N saved: ...` log line (SaveReport.summary())."""
  import re  # pylint: disable=g-import-not-at-top

  global _SAVED_RE
  if _SAVED_RE is None:
    size = r'(-?[\d.]+ (?:B|KiB|MiB|GiB|TiB))'
    _SAVED_RE = re.compile(
        r'kd_ckpt step (\d+) saved: (\w+) \(([^)]*)\): peak extra RSS ' + size
        + r' of budget ' + size + r'.*?, wrote ' + size
        + r'(?:, reused ' + size + r' \((\d+) leaves\))? in ([\d.]+) s')
  m = _SAVED_RE.search(line)
  if not m:
    return None
  step, strategy, settings, peak, budget, wrote, reused, leaves, secs = m.groups()
  return {'step': int(step), 'strategy': strategy, 'settings': settings,
          'report_peak_extra_bytes': _parse_size(peak),
          'budget_bytes': _parse_size(budget), 'bytes_written': _parse_size(wrote),
          'bytes_reused': _parse_size(reused) if reused else 0,
          'leaves_reused': int(leaves) if leaves else 0, 'seconds': float(secs)}


def _parse_size(text: str) -> int:
  num, unit = text.split()
  return int(float(num) * {'B': 1, 'KiB': 1 << 10, 'MiB': 1 << 20, 'GiB': 1 << 30,
                           'TiB': 1 << 40}[unit])


def run_kauldron_lora(repo: str, workdir: str, env: dict[str, str], steps: int,
                      log_path: str, timeout: float) -> dict[str, Any]:
  """The tiny Gemma LoRA through kauldron.main: one result in the reuse format.

  Per save: the `kd_ckpt step N saved` log line (every save), overridden by
  ckpt_N/kd_ckpt_report.json where that checkpoint is still kept (exact bytes).
  The peak is kd_ckpt's own (the report's: the whole async save, commit
  included, so it also counts what the training loop allocated meanwhile).
  """
  out: dict[str, Any] = {'variant': 'kauldron.main tiny Gemma LoRA', 'kept': 3,
                         'enforced': False, 'steps': steps}
  cmd = [sys.executable, '-m', 'kauldron.main', '--cfg=configs/gemma_lora.py',
         f'--cfg.workdir={workdir}', '--cfg.__args__.tiny=True',
         f'--cfg.num_train_steps={steps}']
  out['command'] = ' '.join(cmd[1:]).replace(workdir, 'DIR')
  t0 = time.perf_counter()
  try:
    with open(log_path, 'w') as log:
      proc = subprocess.run(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=timeout)
  except subprocess.TimeoutExpired:
    out['error'] = f'kauldron.main timed out after {timeout:.0f} s'
    return out
  out['wall_seconds'] = time.perf_counter() - t0
  with open(log_path) as f:
    text = f.read()
  if proc.returncode != 0:
    tail = text.strip().splitlines()[-1:] or ['no output']
    out['error'] = f'kauldron.main exit {proc.returncode}: {tail[0][:300]}'
    return out
  saves = {}
  for line in text.splitlines():
    s = _parse_saved_line(line)
    if s is not None:
      saves[s['step']] = s
  ckdir = os.path.join(workdir, 'checkpoints')
  for d in sorted(os.listdir(ckdir)) if os.path.isdir(ckdir) else []:
    rp = os.path.join(ckdir, d, 'kd_ckpt_report.json')
    if d.startswith('ckpt_') and os.path.exists(rp):
      with open(rp) as f:
        r = json.load(f)
      step = int(d.split('_')[1])
      saves.setdefault(step, {'step': step})
      saves[step].update(
          strategy=r['strategy'], settings=r['settings'], budget_bytes=r['budget_bytes'],
          bytes_written=r['bytes_written'], bytes_reused=r['bytes_reused'],
          leaves_reused=r['leaves_reused'], report_peak_extra_bytes=r['peak_extra_bytes'],
          seconds=r['seconds'], from_json=True)
  rows = [saves[k] for k in sorted(saves)]
  for s in rows:
    s['peak_extra_bytes'] = s.get('report_peak_extra_bytes')
  out['saves'] = rows
  if rows:
    out['budget_bytes'] = rows[0].get('budget_bytes')
    total = rows[0].get('bytes_written') or 0
    frozen = max((s.get('bytes_reused') or 0) for s in rows)
    out['frozen_bytes'] = frozen
    out['changing_bytes'] = max(0, total - frozen)
  from kd_ckpt import cost  # pylint: disable=g-import-not-at-top
  out['floor_bytes'] = cost.FLOOR_BYTES
  out['disk_bytes'] = du_bytes(ckdir)
  out['checkpoints_kept'] = sorted(d for d in os.listdir(ckdir) if d.startswith('ckpt_'))
  return out


# ==========================================================================
# Two processes (one save, per-process peaks).


def _hash_values(shape, seed: int, index) -> 'Any':
  """f32 values of leaf (shape, seed) at `index`: a hash of the flat index."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  ranges = [np.arange(n, dtype=np.uint32)[s] for s, n in zip(index, shape)]
  x = np.full([len(r) for r in ranges], np.uint32(seed * 0x9E3779B9 % 2**32))
  stride = 1
  for axis in reversed(range(len(shape))):
    x += ranges[axis].reshape([-1] + [1] * (len(shape) - 1 - axis)) * np.uint32(stride)
    stride *= shape[axis]
  x *= np.uint32(2654435761)
  x ^= x >> np.uint32(15)
  x *= np.uint32(0x85EBCA6B)
  x ^= x >> np.uint32(13)
  return ((x & 0x807FFFFF) | 0x3F800000).view(np.float32)


def mp_process(spec: dict[str, Any]) -> dict[str, Any]:
  """One of the processes of a two-process save (`run.py --mp-worker SPEC`)."""
  import gc  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  pid, nproc = int(spec['process_id']), int(spec['num_processes'])
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{spec['port']}",
                             num_processes=nproc, process_id=pid,
                             initialization_timeout=120)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top

  devs = np.array(jax.devices())
  mesh2 = jax.sharding.Mesh(devs.reshape(4, 2), ('a', 'b'))
  mesh1 = jax.sharding.Mesh(devs.reshape(-1), ('x',))
  leaves = {'sharded': (tuple(spec['sharded_shape']), NamedSharding(mesh2, P('a', 'b')), 1),
            'replicated': (tuple(spec['replicated_shape']), NamedSharding(mesh1, P()), 2)}
  state = {k: jax.make_array_from_callback(
      shape, sh, lambda idx, s=shape, sd=seed: _hash_values(s, sd, idx))
           for k, (shape, sh, seed) in leaves.items()}
  state = jax.block_until_ready(state)
  out: dict[str, Any] = {
      'process_index': pid, 'local_devices': len(jax.local_devices()),
      'global_devices': jax.device_count(),
      'resident_bytes': int(sum(s.data.nbytes for x in state.values()
                                for s in x.addressable_shards))}
  budget, strategy, root = int(spec['budget']), spec['strategy'], spec['workdir']
  multihost_utils.sync_global_devices('bench_mp_warm')
  warm = jax.make_array_from_callback((8, 128), NamedSharding(mesh1, P()),
                                      lambda idx: np.ones((8, 128), np.float32))
  kd_ckpt.save(os.path.join(root, 'warm'), {'a': warm}, host_ram_budget=budget,
               strategy=strategy)
  multihost_utils.sync_global_devices('bench_mp_warmed')
  path = os.path.join(root, 'ckpt')
  gc.collect()
  measure.malloc_trim()
  with measure.Peak() as whole:
    t0 = time.perf_counter()
    report = kd_ckpt.save(path, state, host_ram_budget=budget, strategy=strategy)
    out['save_seconds'] = time.perf_counter() - t0
  out.update(whole_save_peak_extra_bytes=whole.extra_bytes, exact_peak=whole.exact,
             report_peak_extra_bytes=report.peak_extra_bytes,
             predicted_peak_bytes=report.predicted_peak_bytes,
             budget_bytes=report.budget_bytes, strategy=report.strategy,
             settings=report.settings, bytes_written=report.bytes_written,
             report_seconds=report.seconds)
  multihost_utils.sync_global_devices('bench_mp_saved')
  target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            for k, x in state.items()}
  del state
  gc.collect()
  measure.malloc_trim()
  with measure.Peak() as p:
    t0 = time.perf_counter()
    back = jax.block_until_ready(kd_ckpt.restore(path, target, host_ram_budget=budget))
    out['restore_seconds'] = time.perf_counter() - t0
  out['restore_extra_bytes'] = p.extra_bytes
  out['restore_retained_bytes'] = p.retained_bytes
  out['restored_bytes'] = int(sum({s.data.unsafe_buffer_pointer(): s.data.nbytes  # shared once
                                   for x in back.values() for s in x.addressable_shards}.values()))
  ok = True
  for k, (shape, _, seed) in leaves.items():
    for s in back[k].addressable_shards:
      if np.asarray(s.data).tobytes() != _hash_values(shape, seed, s.index).tobytes():
        ok = False
  out['restore_ok'] = ok
  multihost_utils.sync_global_devices('bench_mp_restored')
  return out
