#!/usr/bin/env python
"""Benchmark: host RAM and speed of Orbax vs kd_ckpt saves and restores (CPU).

  .venv/bin/python bench/run.py                 # every part (`make bench`, ~10 min)
  .venv/bin/python bench/run.py --part gb       # one part: grid, gb, soak, mp, reuse
  .venv/bin/python bench/run.py --full          # the small grid at 512 MiB
  .venv/bin/python bench/run.py --scale tiny --budgets 64MiB --gb-budgets 64MiB \
      --soak-saves 3 --reuse-saves 3 --kauldron-steps 4 --jobs 2   # ~1 min smoke

Parts: `grid` (3 states of 128 MiB x Orbax/kd_ckpt variants x budgets),
`gb` (a 4 GB single-device leaf and a 2.2 GB Gemma-like state at 256 MiB and
1 GiB, with Orbax's memory regulator among the peers), `soak` (50 saves of
512 MiB per strategy), `mp` (two processes joined by jax.distributed), `reuse`
(unchanged frozen leaves reused, issue 13; plus the tiny Gemma LoRA through
kauldron.main).  Every measured row runs in a fresh process, forked from a
zygote that has only imported jax/orbax/kd_ckpt (`--exec-workers`: a new
interpreter, `run.py --worker SPEC`), so nothing (heap, thread pools, JAX
caches) leaks between rows.  Writes results.json, results.md, peaks.png,
gb_peaks.png, soak.png, reuse.png to --out (default bench/out/) and exits 1
when kd_ckpt misses a target (bench/measure.py: every kd_ckpt save peak and
restore peak beyond the restored arrays <= budget + 8 MiB, soak drift <= 16
MiB, the reuse targets).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import measure  # pylint: disable=g-import-not-at-top,wrong-import-position
import workloads  # pylint: disable=g-import-not-at-top,wrong-import-position

N_DEVICES = 8
RESULT_PREFIX = 'BENCH_RESULT '
MiB, GiB = measure.MiB, measure.GiB

SCALES = {'tiny': 16 * MiB, 'small': 128 * MiB, 'default': 512 * MiB, 'large': 1 * GiB}
STATES = ('replicated', 'sharded', 'gemma')
DEFAULT_BUDGETS = '64MiB,256MiB,1GiB'
SOAK_BYTES = 512 * MiB
SOAK_BUDGET = 256 * MiB
# The default run fits a 2-core machine in a few minutes: the comparison grid
# at QUICK_SCALE, then the three 512 MiB soaks side by side (they measure RSS,
# not speed).  --full is the long sweep: 512 MiB states, one soak at a time.
QUICK_SCALE = 'small'
FULL_SCALE = 'default'


def worker_env(pkg_root: str | None = None) -> dict[str, str]:
  """Environment of a worker; `pkg_root` holds the kd_ckpt snapshot to use."""
  env = dict(os.environ)
  flag = f'--xla_force_host_platform_device_count={N_DEVICES}'
  if flag not in env.get('XLA_FLAGS', ''):
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' ' + flag).strip()
  env.setdefault('JAX_PLATFORMS', 'cpu')
  env['PYTHONPATH'] = (pkg_root or REPO) + os.pathsep + env.get('PYTHONPATH', '')
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  return env


def snapshot_kd_ckpt(dest_root: str) -> dict[str, Any]:
  """Copies kd_ckpt/ so that every row of a run measures the same code."""
  import hashlib  # pylint: disable=g-import-not-at-top

  src = os.path.join(REPO, 'kd_ckpt')
  dst = os.path.join(dest_root, 'kd_ckpt')
  shutil.rmtree(dst, ignore_errors=True)
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
  h = hashlib.sha256()
  for root, dirs, files in os.walk(dst):
    dirs.sort()
    for f in sorted(files):
      with open(os.path.join(root, f), 'rb') as fh:
        h.update(os.path.relpath(os.path.join(root, f), dst).encode() + fh.read())

  def git(*a):
    try:
      return subprocess.run(['git', *a], cwd=REPO, capture_output=True, text=True,
                            timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return ''

  return {'commit': git('rev-parse', '--short', 'HEAD') or '?',
          'dirty': bool(git('status', '--porcelain', '--', 'kd_ckpt')),
          'sha256': h.hexdigest()[:12]}


# ==========================================================================
# Worker side (runs in a subprocess; the only place jax is imported).


def _jax():
  os.environ.update({k: v for k, v in worker_env().items()
                     if k in ('XLA_FLAGS', 'JAX_PLATFORMS')})
  import jax  # pylint: disable=g-import-not-at-top

  return jax


_POOLS: dict[Any, Any] = {}


def _pool(dtype):
  """16 MiB of normal floats, in `dtype` (zstd sees no repeats inside a chunk)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  key = np.dtype(dtype)
  if key not in _POOLS:
    base = np.random.default_rng(0).standard_normal(4 * MiB // 1, dtype=np.float32)
    _POOLS[key] = base.astype(key) if key.kind == 'f' or key.name == 'bfloat16' else (
        (base * 1000).astype(key))
  return _POOLS[key]


def _fill(shape, dtype, seed: int):
  import numpy as np  # pylint: disable=g-import-not-at-top

  n = math.prod(shape)
  pool = _pool(dtype)
  out = np.empty(n, dtype=pool.dtype)
  off = (seed * 1_000_003) % len(pool)
  pos = 0
  while pos < n:
    take = min(n - pos, len(pool) - off)
    out[pos:pos + take] = pool[off:off + take]
    pos += take
    off = 0
  return out.reshape(shape)


def _leaf(jax, mesh, shape, dtype, spec, seed):
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  sharding = NamedSharding(mesh, P(*spec))

  def cb(index):
    start = sum((s.start or 0) * (i + 1) for i, s in enumerate(index))
    return _fill(tuple(len(range(*s.indices(d))) for s, d in zip(index, shape)),
                 dtype, seed * 7919 + start)

  return jax.make_array_from_callback(tuple(shape), sharding, cb)


def _round(x, m):
  return max(m, int(round(x / m)) * m)


def build_state(name: str, total_bytes: int):
  """The benchmark's states, ~total_bytes of logical (unreplicated) data."""
  jax = _jax()
  if name in workloads.GB_STATES:
    return workloads.build_gb_state(jax, name, total_bytes)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  n = len(devices)
  if name == 'replicated':
    rows = _round(total_bytes / 4 / 1024, n)
    return {'w': _leaf(jax, mesh, (rows, 1024), jnp.float32, (None, None), 1)}
  if name == 'sharded':
    # 32 leaves, sizes 1..4 units, all sharded on axis 0 over every device.
    weights = [1 + (i % 4) for i in range(32)]
    unit = total_bytes / sum(weights)
    state = {}
    for i, w in enumerate(weights):
      rows = _round(unit * w / 4 / 512, n)
      state[f'layer_{i:02d}'] = _leaf(jax, mesh, (rows, 512), jnp.float32,
                                      ('d', None), 100 + i)
    return state
  if name == 'gemma':
    # Gemma-like: bf16 params, Adam mu/nu in f32 (10 bytes per parameter),
    # 4 layers: q/kv/o attention, gated MLP (F = 8 D), RMS norms, embedding.
    shapes = workloads.gemma_shapes(total_bytes, 4, n)
    counter = iter(range(10_000))

    def make(dtype):
      def one(shape):
        itemsize = jnp.dtype(dtype).itemsize
        return _leaf(jax, mesh, shape, dtype,
                     workloads.shard_spec(shape, n, 1 * MiB, itemsize), next(counter))
      return jax.tree.map(one, shapes, is_leaf=lambda x: isinstance(x, tuple))

    params = make(jnp.bfloat16)
    mu, nu = make(jnp.float32), make(jnp.float32)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    count = jax.device_put(jnp.int32(1234), rep)
    return {'params': params, 'opt_state': {'count': count, 'mu': mu, 'nu': nu},
            'step': jax.device_put(jnp.int32(1234), rep)}
  raise ValueError(f'unknown state {name!r}')


def logical_bytes(tree) -> int:
  jax = _jax()
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def resident_bytes(tree) -> int:
  """Bytes the arrays hold on all local devices (host RAM on CPU)."""
  jax = _jax()
  # Counted once per buffer: on the CPU backend replicas restored from one
  # aligned host buffer share it.
  return int(sum({s.data.unsafe_buffer_pointer(): s.data.nbytes for x in jax.tree.leaves(tree)
                  for s in x.addressable_shards}.values()))


def abstract(tree):
  jax = _jax()
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def fingerprint(tree) -> dict[str, list[float]]:
  """Per saved shard: sum, sum of squares, strided sum (float64, on host).

  Reads each shard through `np.asarray(shard.data)`, chunk by chunk, so no jit
  compile and no cached host copy is left on the arrays themselves.
  """
  jax = _jax()
  import numpy as np  # pylint: disable=g-import-not-at-top

  out = {}
  chunk = 4 * MiB
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    for s in x.addressable_shards:
      if s.replica_id != 0:
        continue
      flat = np.asarray(s.data).reshape(-1)
      acc = np.zeros(3)
      for i in range(0, flat.size, chunk):
        c = flat[i:i + chunk].astype(np.float64)
        acc += (c.sum(), np.dot(c, c), c[::97].sum())
      out[jax.tree_util.keystr(path) + str(s.index)] = acc.tolist()
  return out


def _same_fingerprint(a, b) -> bool:
  import numpy as np  # pylint: disable=g-import-not-at-top

  return a.keys() == b.keys() and all(
      np.allclose(a[k], b[k], rtol=1e-9, atol=1e-9) for k in a)


class _Saver:
  """One variant's save + restore, with Orbax objects made once (outside timing)."""

  def __init__(self, variant: str, budget: int | None, workdir: str):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    self.ocp, self.variant, self.budget, self.workdir = ocp, variant, budget, workdir
    self.notes: list[str] = []
    self.report = None
    self._mngr = None
    if variant == 'orbax default':
      self._mngr = ocp.CheckpointManager(
          os.path.join(workdir, 'orbax_default'),
          options=ocp.CheckpointManagerOptions(max_to_keep=2,
                                               enable_async_checkpointing=True))
    elif variant == 'orbax tuned':
      self._tuned_setup()
    elif variant == 'orbax memory regulator':
      self._regulator_setup()

  def _tuned_setup(self):
    """Orbax tuned by hand: both concurrency limits at the budget, no pinned
    host staging, and every key deprioritized so that
    `save_device_host_concurrent_gb` applies (0.12.x batches only those)."""
    ocp = self.ocp
    from orbax.checkpoint._src.serialization import types as stypes  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top

    class Deprioritize(stypes.DefaultSerializationStatusCallback):

      def key_priority(self, _):
        return stypes.TransferPriority.ASYNCHRONOUS_DEPRIORITIZED

    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(callback=Deprioritize()),
        override=True)
    gb = self.budget / 1e9
    self._handler_kwargs = dict(save_concurrent_gb=gb,
                                save_device_host_concurrent_gb=gb,
                                enable_pinned_host_transfer=False)
    self.notes.append('sync, d2h+concurrent limits=budget, pinned off, all keys deprioritized')

  def _regulator_setup(self):
    """Orbax's memory regulator, as its docs configure it: a PyTree handler
    with save_device_host_concurrent_gb='auto' and MemoryLimitOptions
    (max_transfer_concurrent_gb = the budget), in an async CheckpointManager.

    Orbax 0.12.8 builds a MemoryRegulator(max_memory_limit_gib=...) with its
    default min_memory_limit_gib=10, and refuses (ValueError) any max whose
    0.8 x is not above 10 GiB: below ~13.4 GB the constructor raises, and
    that error is the row's result.
    """
    ocp = self.ocp
    gb = self.budget / 1e9
    self._regulator_handler = ocp.PyTreeCheckpointHandler(
        save_device_host_concurrent_gb='auto',
        memory_limit_options=ocp.options.MemoryLimitOptions(max_transfer_concurrent_gb=gb))
    self._mngr = ocp.CheckpointManager(
        os.path.join(self.workdir, 'orbax_default'),
        options=ocp.CheckpointManagerOptions(max_to_keep=2,
                                             enable_async_checkpointing=True),
        item_handlers=self._regulator_handler)
    self.notes.append(f"save_device_host_concurrent_gb='auto',"
                      f' max_transfer_concurrent_gb={gb:g}, async')

  def regulator_limit_bytes(self) -> int | None:
    impl = getattr(getattr(self, '_regulator_handler', None), '_handler_impl', None)
    return getattr(impl, '_current_device_host_limit_bytes', None)

  def path(self, step: int) -> str:
    return os.path.join(self.workdir, f'step_{step}')

  def save(self, tree, step: int) -> None:
    ocp = self.ocp
    if self.variant == 'orbax default':
      t0 = time.perf_counter()
      self._mngr.save(step, args=ocp.args.StandardSave(tree))
      self.blocked_seconds = time.perf_counter() - t0
      self._mngr.wait_until_finished()
    elif self.variant == 'orbax memory regulator':
      t0 = time.perf_counter()
      self._mngr.save(step, args=ocp.args.PyTreeSave(tree))
      self.blocked_seconds = time.perf_counter() - t0
      self._mngr.wait_until_finished()
    elif self.variant == 'orbax tuned':
      ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**self._handler_kwargs))
      ckptr.save(self.path(step), args=ocp.args.PyTreeSave(tree))
      ckptr.close()
    else:
      import kd_ckpt  # pylint: disable=g-import-not-at-top

      strategy = self.variant.split()[-1]
      self.report = kd_ckpt.save(self.path(step), tree,
                                 host_ram_budget=self.budget, strategy=strategy)

  def restore(self, target, step: int):
    ocp = self.ocp
    if self.variant == 'orbax default':
      return self._mngr.restore(step, args=ocp.args.StandardRestore(target))
    if self.variant == 'orbax memory regulator':
      return self._mngr.restore(step, args=ocp.args.PyTreeRestore(
          item=target,
          restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    if self.variant == 'orbax tuned':
      ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
      out = ckptr.restore(self.path(step), args=ocp.args.PyTreeRestore(
          item=target,
          restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
      ckptr.close()
      return out
    import kd_ckpt  # pylint: disable=g-import-not-at-top

    return kd_ckpt.restore(self.path(step), target, host_ram_budget=self.budget)

  def delete(self, step: int) -> None:
    if self._mngr is not None:
      return  # max_to_keep=2 does it
    shutil.rmtree(self.path(step), ignore_errors=True)

  def close(self):
    if self._mngr is not None:
      self._mngr.close()


def _warm_up(saver: _Saver, jax) -> None:
  """Imports, thread pools, TensorStore contexts: paid once, outside timing."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  tiny = {'a': jax.device_put(jnp.ones((8, 128), jnp.float32))}
  saver.save(tiny, 0)
  saver.restore(abstract(tiny), 0)
  saver.delete(0)
  del tiny


def _report_fields(report) -> dict[str, Any]:
  if report is None:
    return {}
  return {
      'kd_strategy': report.strategy,
      'kd_settings': report.settings,
      'kd_budget_bytes': report.budget_bytes,
      'kd_predicted_peak_bytes': report.predicted_peak_bytes,
      'kd_self_peak_extra_bytes': report.peak_extra_bytes,
      'kd_retained_bytes': report.retained_bytes,
      'kd_bytes_written': report.bytes_written,
      'kd_bytes_reused': report.bytes_reused,
      'kd_seconds': report.seconds,
  }


def _du(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for f in files:
      try:
        total += os.path.getsize(os.path.join(root, f))
      except OSError:
        pass
  return total


def worker_save(spec: dict[str, Any]) -> dict[str, Any]:
  jax = _jax()
  import gc  # pylint: disable=g-import-not-at-top

  row: dict[str, Any] = {k: spec[k] for k in ('state', 'variant')}
  row['budget_bytes'] = spec.get('budget')
  # The saver first: a configuration Orbax refuses fails before the state
  # is built.
  saver = _Saver(spec['variant'], spec.get('budget'), spec['workdir'])
  state = build_state(spec['state'], spec['bytes'])
  nbytes = logical_bytes(state)
  row.update(state_bytes=nbytes, state_resident_bytes=resident_bytes(state),
             leaves=len(jax.tree.leaves(state)))
  target = abstract(state)
  fp_before = fingerprint(state)
  _warm_up(saver, jax)
  gc.collect()
  measure.malloc_trim()

  with measure.Peak() as p:
    t0 = time.perf_counter()
    saver.save(state, 1)
    seconds = time.perf_counter() - t0
  row.update(peak_extra_bytes=p.extra_bytes, exact_peak=p.exact,
             rss_before_bytes=p.before_bytes, retained_bytes=p.retained_bytes,
             seconds=seconds, gb_per_sec=nbytes / 1e9 / seconds,
             disk_bytes=_du(saver.path(1) if saver._mngr is None  # pylint: disable=protected-access
                            else os.path.join(spec['workdir'], 'orbax_default', '1')))
  notes = list(saver.notes)
  if saver.regulator_limit_bytes() is not None:
    row['regulator_limit_bytes'] = saver.regulator_limit_bytes()
    notes.append(f'device->host limit the regulator set:'
                 f' {measure.fmt_bytes(row["regulator_limit_bytes"])}')
  if hasattr(saver, 'blocked_seconds'):
    row['save_blocked_seconds'] = saver.blocked_seconds
    notes.append(f'async, save() blocked {saver.blocked_seconds:.2f} s')
  if saver.report is not None:
    import kd_ckpt  # pylint: disable=g-import-not-at-top

    row['kd_ckpt_file'] = kd_ckpt.__file__
    r = saver.report
    row.update(_report_fields(r))
    notes.append(f'{r.strategy} ({r.settings}); predicted'
                 f' {measure.fmt_bytes(r.predicted_peak_bytes)}, self-measured'
                 f' {measure.fmt_bytes(r.peak_extra_bytes)}')

  # Restore into the same shardings, with the saved state gone, from a warm
  # page cache (kd_ckpt's local saves drop their pages, Orbax's keep them).
  workloads.warm_page_cache(saver.path(1) if saver._mngr is None  # pylint: disable=protected-access
                            else os.path.join(spec['workdir'], 'orbax_default', '1'))
  del state
  gc.collect()
  measure.malloc_trim()
  with measure.Peak() as p:
    t0 = time.perf_counter()
    restored = saver.restore(target, 1)
    jax.block_until_ready(restored)
    row['restore_seconds'] = time.perf_counter() - t0
  row.update(restore_extra_bytes=p.extra_bytes, restored_bytes=resident_bytes(restored),
             restore_retained_bytes=p.retained_bytes,
             restore_rss_before_bytes=p.before_bytes)
  row['restore_ok'] = _same_fingerprint(fp_before, fingerprint(restored))
  if not row['restore_ok']:
    notes.append('RESTORED DATA DIFFERS')
  row['notes'] = '; '.join(notes)
  saver.close()
  return row


def worker_soak(spec: dict[str, Any]) -> dict[str, Any]:
  jax = _jax()
  import gc  # pylint: disable=g-import-not-at-top

  out: dict[str, Any] = {'variant': spec['variant'], 'budget_bytes': spec.get('budget'),
                         'state': spec['state']}
  state = build_state(spec['state'], spec['bytes'])
  out['state_bytes'] = logical_bytes(state)
  saver = _Saver(spec['variant'], spec.get('budget'), spec['workdir'])
  _warm_up(saver, jax)
  gc.collect()
  measure.malloc_trim()
  out['rss_start_bytes'] = measure.rss_bytes()
  rss, peaks, secs, heap_used, heap_free = [], [], [], [], []
  strategies: set[str] = set()
  for step in range(1, spec['saves'] + 1):
    with measure.Peak() as p:
      t0 = time.perf_counter()
      saver.save(state, step)
      secs.append(time.perf_counter() - t0)
    if step > 2:
      saver.delete(step - 2)  # keep 2, like max_to_keep=2
    peaks.append(p.extra_bytes)
    rss.append(measure.rss_bytes())
    if saver.report is not None:
      strategies.add(f'{saver.report.strategy} ({saver.report.settings})')
    heap = measure.heap_bytes()  # diagnostic: leak (in use) or slack (free)?
    if heap is not None:
      heap_used.append(heap['in_use'])
      heap_free.append(heap['free'])
  out.update(rss_after_bytes=rss, peak_extra_bytes=peaks, seconds=secs,
             kd_strategies=sorted(strategies))
  last = spec['saves']
  out['disk_bytes_per_checkpoint'] = _du(
      saver.path(last) if saver._mngr is None  # pylint: disable=protected-access
      else os.path.join(spec['workdir'], 'orbax_default', str(last)))
  out['disk_bytes_kept'] = workloads.du_bytes(spec['workdir'])
  if heap_used:
    out.update(heap_in_use_bytes=heap_used, heap_free_bytes=heap_free)
  saver.close()
  return out


def worker_main(spec_json: str, result_path: str | None = None) -> int:
  spec = json.loads(spec_json)
  try:
    if spec['kind'] == 'soak':
      result = worker_soak(spec)
    elif spec['kind'] == 'reuse':
      result = workloads.worker_reuse(_jax(), spec)
    else:
      result = worker_save(spec)
  except Exception as e:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top

    traceback.print_exc()
    result = {k: spec.get(k) for k in ('state', 'variant')}
    result['budget_bytes'] = spec.get('budget')
    result['error'] = f'{type(e).__name__}: {str(e)[:300]}'
  sys.stdout.write(RESULT_PREFIX + json.dumps(result) + '\n')
  sys.stdout.flush()
  if result_path:
    with open(result_path, 'w') as f:
      f.write(json.dumps(result))
  return 0


# What a zygote imports before it forks workers: the slow part of a fresh
# worker's start (~4 s of the ~5 s on 2 cores).  Importing starts no JAX
# backend and no JAX/TensorStore threads, so each forked worker still builds
# its own backend, thread pools and heap from nothing.
ZYGOTE_PRELOAD = ('numpy', 'jax', 'jax.numpy', 'tensorstore', 'orbax.checkpoint',
                  'kd_ckpt')


def zygote_main() -> int:
  """Forks one worker per request line ({spec, log, result}) from stdin.

  Replies one JSON line per request: {"rc": exit status, "timed_out": bool}.
  The worker's stdout and stderr go to the request's log file.
  """
  import importlib  # pylint: disable=g-import-not-at-top

  for name in ZYGOTE_PRELOAD:
    importlib.import_module(name)
  ready = {'ready': True, 'jax_backends_initialized': _backends_initialized()}
  sys.stdout.write(json.dumps(ready) + '\n')
  sys.stdout.flush()
  for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the worker
      code = 1
      try:
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(req['log'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = worker_main(req['spec'], req['result'])
      except BaseException:  # pylint: disable=broad-except
        import traceback  # pylint: disable=g-import-not-at-top

        traceback.print_exc()
      finally:
        try:
          sys.stdout.flush()
          sys.stderr.flush()
        finally:
          os._exit(code)  # pylint: disable=protected-access
    deadline = time.monotonic() + float(req['timeout'])
    timed_out = False
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      if time.monotonic() > deadline and not timed_out:
        timed_out = True
        os.kill(pid, 9)
      time.sleep(0.05)
    sys.stdout.write(json.dumps({'rc': os.waitstatus_to_exitcode(status),
                                 'timed_out': timed_out}) + '\n')
    sys.stdout.flush()
  return 0


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

    return bool(xla_bridge._backends)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return False


# ==========================================================================
# Parent side.


class Zygote:
  """A `run.py --zygote` process: imports once, forks a worker per row."""

  def __init__(self, pkg_root: str | None):
    self.proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), '--zygote'],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=worker_env(pkg_root), cwd=REPO)
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f'zygote failed to start (exit {self.proc.wait()})')
    if json.loads(line).get('jax_backends_initialized'):
      raise RuntimeError('zygote initialized a JAX backend before forking')

  def run(self, spec: dict[str, Any], log_path: str, timeout: float):
    result_path = os.path.join(spec['workdir'], 'bench_result.json')
    self.proc.stdin.write(json.dumps({'spec': json.dumps(spec), 'log': log_path,
                                      'result': result_path,
                                      'timeout': timeout}) + '\n')
    self.proc.stdin.flush()
    reply = self.proc.stdout.readline()
    if not reply:
      raise RuntimeError(f'zygote died (exit {self.proc.wait()})')
    reply = json.loads(reply)
    result = None
    if os.path.exists(result_path):
      with open(result_path) as f:
        result = json.load(f)
    return reply, result

  def close(self):
    if self.proc.poll() is None:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()


def run_worker_forked(zygote: Zygote, spec: dict[str, Any], log_dir: str,
                      timeout: float) -> dict[str, Any]:
  """`run_worker`, with the worker forked from `zygote` instead of exec'd."""
  name = _worker_name(spec)
  base = {k: spec.get(k) for k in ('state', 'variant')}
  base['budget_bytes'] = spec.get('budget')
  os.makedirs(spec['workdir'], exist_ok=True)
  log_path = os.path.join(log_dir, name + '.log')
  try:
    reply, result = zygote.run(spec, log_path, timeout)
  finally:
    shutil.rmtree(spec['workdir'], ignore_errors=True)
  if result is not None:
    return result
  if reply.get('timed_out'):
    return {**base, 'error': f'worker timed out after {timeout:.0f} s'}
  try:
    with open(log_path) as f:
      tail = (f.read().strip().splitlines() or ['no output'])[-1]
  except OSError:
    tail = 'no log'
  return {**base, 'error': f"worker exit {reply.get('rc')}: {tail[:300]}"}


def _worker_name(spec: dict[str, Any]) -> str:
  name = '_'.join(str(spec.get(k)) for k in ('kind', 'state', 'variant', 'budget'))
  return ''.join(c if c.isalnum() or c in '._-' else '_' for c in name)


def run_worker(spec: dict[str, Any], log_dir: str, timeout: float,
               pkg_root: str | None = None) -> dict[str, Any]:
  name = _worker_name(spec)
  base = {k: spec.get(k) for k in ('state', 'variant')}
  base['budget_bytes'] = spec.get('budget')
  os.makedirs(spec['workdir'], exist_ok=True)
  try:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), '--worker', json.dumps(spec)],
        capture_output=True, text=True, env=worker_env(pkg_root), timeout=timeout,
        cwd=REPO)
  except subprocess.TimeoutExpired as e:
    return {**base, 'error': f'worker timed out after {timeout:.0f} s',
            'stderr_tail': (e.stderr or '')[-2000:] if isinstance(e.stderr, str) else ''}
  finally:
    shutil.rmtree(spec['workdir'], ignore_errors=True)
  with open(os.path.join(log_dir, name + '.log'), 'w') as f:
    f.write(proc.stdout + '\n--- stderr ---\n' + proc.stderr)
  return measure.worker_result(proc.stdout, proc.stderr, proc.returncode, RESULT_PREFIX, base)


def run_dd(state: str, nbytes: int, workdir: str) -> dict[str, Any]:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, 'dd.bin')
  bs = 1 * MiB
  count = max(1, math.ceil(nbytes / bs))
  t0 = time.perf_counter()
  proc = subprocess.run(['dd', 'if=/dev/zero', f'of={path}', f'bs={bs}',
                         f'count={count}', 'conv=fsync'], capture_output=True, text=True)
  seconds = time.perf_counter() - t0
  shutil.rmtree(workdir, ignore_errors=True)
  row = {'state': state, 'variant': 'dd (disk ceiling)', 'budget_bytes': None,
         'state_bytes': count * bs, 'notes': f'dd bs=1M count={count} conv=fsync'}
  if proc.returncode != 0:
    row['error'] = proc.stderr.strip()[-300:]
    return row
  row.update(seconds=seconds, gb_per_sec=count * bs / 1e9 / seconds)
  return row


def variants(budgets: list[int]) -> list[tuple[str, int | None]]:
  """The small grid's rows for one state."""
  out: list[tuple[str, int | None]] = [('orbax default', None)]
  out += [('orbax tuned', b) for b in budgets]
  out += [('kd_ckpt auto', b) for b in budgets]
  out += [('kd_ckpt streaming', b) for b in budgets]
  return out


# The smallest max_transfer_concurrent_gb Orbax 0.12.8's memory regulator
# accepts (its min_memory_limit_gib=10 must be < 0.8 x the max in GiB).
REGULATOR_SMALLEST_VALID_BYTES = 14 * 10**9


def gb_variants(budgets: list[int]) -> list[tuple[str, int | None]]:
  """The GB-scale part's rows for one state: the peers, then kd_ckpt."""
  out: list[tuple[str, int | None]] = [('orbax default', None)]
  out += [('orbax tuned', b) for b in budgets]
  out += [('orbax memory regulator', b) for b in budgets]
  out += [('orbax memory regulator', REGULATOR_SMALLEST_VALID_BYTES)]
  out += [('kd_ckpt auto', b) for b in budgets]
  out += [('kd_ckpt streaming', b) for b in budgets]
  return out


SOAK_VARIANTS = ('orbax default', 'kd_ckpt auto', 'kd_ckpt orbax', 'kd_ckpt streaming')
MP_STRATEGIES = ('streaming', 'auto')
REUSE_VARIANTS = ('kd_ckpt.save', 'SafeCheckpointer', 'SafeCheckpointer, frozen rebuilt')
PARTS = ('grid', 'gb', 'soak', 'mp', 'reuse')


def plot_peaks(rows, path: str, title: str = '') -> None:
  """Save peaks (bars) and restore peaks beyond the restored arrays (hatched)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  states = list(dict.fromkeys(r['state'] for r in rows))
  fig, axes = plt.subplots(len(states), 1, figsize=(13, 3.8 * len(states)), squeeze=False)
  for ax, st in zip(axes[:, 0], states):
    rs = [r for r in rows if r['state'] == st and r.get('variant', '').split()[0] != 'dd']
    labels = []
    first_budget = first_limit = True
    for x, r in enumerate(rs):
      labels.append(r['variant'].replace('memory regulator', 'mem. regulator')
                    .replace(' ', '\n', 1) + '\n'
                    + measure.budget_label(r.get('budget_bytes')))
      color = ('tab:red' if r.get('error') else
               'tab:blue' if measure.is_kd(r) else 'tab:gray')
      save = (r.get('peak_extra_bytes') or 0) / MiB
      over = measure.restore_overhead_bytes(r)
      ax.bar(x - 0.2, max(save, 0.06), width=0.4, color=color,
             label='save peak extra RSS' if x == 0 else None)
      if over is not None:
        ax.bar(x + 0.2, max(over / MiB, 0.06), width=0.4, color=color, alpha=0.45,
               hatch='//', label='restore peak beyond restored' if x == 0 else None)
      b = r.get('budget_bytes')
      if b and b < 100 * GiB:
        ax.hlines(b / MiB, x - 0.45, x + 0.45, colors='k',
                  label='budget' if first_budget else None)
        first_budget = False
        if measure.is_kd(r):
          ax.hlines(measure.kd_limit_bytes(b) / MiB, x - 0.45, x + 0.45,
                    colors='tab:red', linestyles=':',
                    label='kd_ckpt limit (budget + 8 MiB)' if first_limit else None)
          first_limit = False
      if r.get('error'):
        ax.text(x, 0.07, 'error', ha='center', va='bottom', rotation=90, fontsize=7)
    ax.set_yscale('log')
    ax.set_ylim(bottom=0.05)
    ax.set_xticks(list(range(len(rs))))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel('MiB')
    sb = next((r.get('state_bytes') for r in rs if r.get('state_bytes')), None)
    ax.set_title(f'{title}{st} state ({measure.fmt_bytes(sb)})')
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def plot_soak(soaks, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(9, 4.5))
  for s in soaks:
    rss = s.get('rss_after_bytes') or []
    if rss:
      ax.plot(range(1, len(rss) + 1), [v / MiB for v in rss], marker='.',
              label=f"{s['variant']} {measure.budget_label(s.get('budget_bytes'))}")
  ax.set_xlabel('save #')
  ax.set_ylabel('RSS after save (MiB)')
  sb = next((s.get('state_bytes') for s in soaks if s.get('state_bytes')), None)
  ax.set_title(f'RSS over consecutive saves ({measure.fmt_bytes(sb)} state, keep 2)')
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def plot_reuse(reuse, path: str) -> None:
  """Per save: bytes written and peak extra RSS, against their targets."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  runs = [r for r in reuse if r.get('saves')]
  if not runs:
    return
  fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
  for ax, r in zip(axes[0], runs):
    saves = r['saves']
    xs = range(1, len(saves) + 1)
    t = measure.reuse_targets(r)
    ax.plot(xs, [(s.get('bytes_written') or 0) / MiB for s in saves], 'o-',
            label='bytes written')
    ax.plot(xs, [max((s.get('peak_extra_bytes') or 0) / MiB, 0.01) for s in saves], 's-',
            label='peak extra RSS (floored at 0.01 MiB)')
    ax.axhline(t['write_bytes'] / MiB, color='tab:blue', ls=':', label='target written')
    ax.axhline(t['peak_bytes'] / MiB, color='tab:orange', ls=':', label='target peak')
    ax.set_yscale('log')
    ax.set_xlabel('save #')
    ax.set_ylabel('MiB')
    ax.set_title(r['variant'], fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def kd_desc(config) -> str:
  v = config.get('kd_ckpt') or {}
  if not v:
    return '(version not recorded)'
  return (f"{v.get('commit')}{'+uncommitted changes' if v.get('dirty') else ''}"
          f" (snapshot sha256 {v.get('sha256')})")


def _soak_note(config) -> list[str]:
  n = config.get('soak_jobs') or 1
  if n <= 1:
    return []
  return [f'The soaks ran {n} at a time (each in its own process): RSS is per'
          ' process, but the save seconds include the contention.', '']


def _fmt_wall(seconds: float) -> str:
  return f'{seconds:.0f} s ({int(seconds // 60)} min {seconds % 60:.0f} s)'


def write_markdown(path, res: dict[str, Any]) -> str:
  """results.md from results.json's content (every part that ran)."""
  config = res['config']
  rows, gb_rows = res.get('rows') or [], res.get('gb_rows') or []
  soaks, mp, reuse = res.get('soak') or [], res.get('mp') or [], res.get('reuse') or []
  violations = res.get('violations') or []
  load = config.get('loadavg_start_end') or [[float('nan')] * 3] * 2
  lines = [
      '# kd_ckpt benchmark',
      '',
      f"kd_ckpt {kd_desc(config)}; {config['machine']}; {config['devices']}"
      f" fake CPU devices; parts: {', '.join(config.get('parts') or PARTS)};"
      f" **wall {_fmt_wall(config['wall_seconds'])}**"
      + (' (' + ', '.join(f'{k} {v:.0f} s' for k, v in config['part_seconds'].items())
         + ')' if config.get('part_seconds') else '') + ';'

      f" load average (1/5/15 min) {' '.join(f'{v:.2f}' for v in load[0])} at"
      f" start, {' '.join(f'{v:.2f}' for v in load[1])} at end (other processes"
      " share the CPUs: timings are only as quiet as the machine).",
      '',
      'Peak extra RSS = VmHWM during the save minus RSS just before it; every'
      ' row in a fresh process, after a tiny warm-up save.  GB/s = logical'
      ' state bytes / seconds until durable (Orbax: until wait_until_finished).'
      ' "restore extra - restored" = restore peak beyond the restored arrays'
      ' (which live in host RAM on CPU).  kd_ckpt rows must keep both'
      f' <= budget + {measure.fmt_bytes(measure.MEASUREMENT_TOLERANCE_BYTES)}'
      ' (peak/budget <= 1.00 up to that tolerance); Orbax rows are reported only.',
      'On CPU, device buffers are host RAM and np.asarray(jax.Array) is'
      ' zero-copy, so Orbax\'s device->host copy costs nothing here (it does on'
      ' GPU/TPU).',
      '',
  ]
  if gb_rows:
    lines += [
        '## GB scale (`--part gb`)',
        '',
        'big = one f32 leaf of 1e9 parameters on ONE device; gemma_gb = bf16'
        ' params + f32 Adam mu/nu sharded over 8 devices.  Restores at the same'
        ' budget.  "x Orbax default" = save seconds / Orbax default\'s in this'
        ' run; the dd row is the disk\'s ceiling for the same bytes.'
        '  Orbax memory regulator: `PyTreeCheckpointHandler(save_device_host_'
        "concurrent_gb='auto', memory_limit_options=MemoryLimitOptions("
        'max_transfer_concurrent_gb=budget))` in an async CheckpointManager;'
        ' Orbax refuses any max below ~13.4 GB (its regulator\'s minimum limit'
        ' is 10 GiB), so the rows at our budgets are its ValueError and one row'
        ' runs it at the smallest max it accepts (14 GB).',
        '',
        measure.save_table(gb_rows),
    ]
  if rows:
    lines += [
        f"## Small grid (`--part grid`, states of {measure.fmt_bytes(config.get('state_bytes'))})",
        '',
        measure.save_table(rows),
    ]
  if soaks:
    lines += [
        f'## Soak (`--part soak`: {config["soak_saves"]} saves of'
        f' {measure.fmt_bytes(config["soak_bytes"])}, keep 2)',
        '',
        f'RSS drift = RSS after save {measure.SOAK_DRIFT_TO} - after save'
        f' {measure.SOAK_DRIFT_FROM}; target <='
        f' {measure.fmt_bytes(measure.SOAK_DRIFT_LIMIT_BYTES)} for every kd_ckpt'
        ' strategy, and every save\'s peak <= budget + 8 MiB.  Disk per checkpoint'
        ' = one kept step.',
        '',
        *_soak_note(config),
        measure.soak_table(soaks),
    ]
  if mp:
    lines += [
        '## Two processes (`--part mp`)',
        '',
        f"{mp[0].get('num_processes', 2)} JAX processes on 127.0.0.1"
        f" (`jax.distributed.initialize`), {workloads.MP_DEVICES_PER_PROCESS} CPU"
        f" devices each; state: a {config.get('mp_sharded_shape')} f32 leaf"
        f" sharded over a 4x2 mesh plus a {config.get('mp_replicated_shape')} f32"
        ' leaf replicated on all 8 devices (both processes); `kd_ckpt.save` then'
        ' `kd_ckpt.restore` at the budget, per process.  "report peak" is'
        ' kd_ckpt\'s own measure, "whole-save peak" the benchmark\'s around'
        ' `kd_ckpt.save`.',
        '',
        measure.mp_table(mp),
    ]
  if reuse:
    lines += [
        '## Reuse of unchanged leaves (`--part reuse`, issue 13)',
        '',
        'A frozen part (sharded and replicated leaves) + a trainable part +'
        ' Adam-like mu/nu of its size + a step counter; between saves only the'
        ' trainable part, mu, nu and the step change.  `kd_ckpt.save(...,'
        ' fingerprint=True, reuse_from=previous)` (the oldest deleted after each'
        ' save beyond 3), and `SafeCheckpointer(reuse_unchanged=True,'
        ' max_to_keep=3)`.  Targets after the first (full) save: bytes written'
        f' <= {measure.REUSE_WRITE_FACTOR:g} x changing; peak extra RSS <='
        ' changing + kd_ckpt.cost.FLOOR_BYTES; seconds <='
        f' {measure.REUSE_SECONDS_FRACTION:g} x the full save; `du -s` of the'
        f' checkpoints folder (hard links once) <= {measure.REUSE_DISK_FACTOR:g} x'
        ' (frozen + 3 x changing).  The Kauldron run (`'
        + next((r.get('command', '') for r in reuse if r.get('command')), 'kauldron.main')
        + '`, 8 fake devices, a save every 2 steps) is reported against the same'
        ' targets but not enforced: its state is 113 KiB, and its peaks are'
        ' kd_ckpt\'s report (async: until the commit, while training goes on).',
        '',
        measure.reuse_summary_table(reuse),
        '',
        measure.reuse_saves_table(reuse),
    ]
  lines += ['## Verdict', '']
  if violations:
    lines += [f'**FAIL**: {len(violations)} kd_ckpt target(s) missed:', ''] + [
        f'- {v}' for v in violations]
  else:
    lines += ['**PASS**: kd_ckpt met every enforced target.']
  notes = measure.budget_warnings(gb_rows + rows)
  kauldron_misses = [m for r in reuse if not r.get('enforced', True)
                     for m in measure.reuse_misses(r)]
  if kauldron_misses:
    lines += ['', 'Reported, not enforced (the tiny Kauldron run):', ''] + [
        f'- {m}' for m in kauldron_misses]
  close = measure.kd_within_tolerance(gb_rows + rows)
  if close:
    lines += ['', 'kd_ckpt rows over their budget by less than the measurement'
              ' tolerance (passed; look at these):', ''] + [f'- {c}' for c in close]
  if notes:
    lines += ['', 'Orbax rows over the budget they were given (reported only):', ''] + [
        f'- {w}' for w in notes]
  text = '\n'.join(lines) + '\n'
  with open(path, 'w') as f:
    f.write(text)
  return text


def all_violations(res: dict[str, Any]) -> list[str]:
  return (measure.check_rows(res.get('gb_rows') or [])
          + measure.check_rows(res.get('rows') or [])
          + measure.check_soaks(res.get('soak') or [])
          + measure.check_mp(res.get('mp') or [])
          + measure.check_reuse(res.get('reuse') or []))


def write_outputs(out: str, res: dict[str, Any]) -> str:
  md = write_markdown(os.path.join(out, 'results.md'), res)
  if res.get('rows'):
    plot_peaks(res['rows'], os.path.join(out, 'peaks.png'))
  if res.get('gb_rows'):
    plot_peaks(res['gb_rows'], os.path.join(out, 'gb_peaks.png'), 'GB scale: ')
  if res.get('soak'):
    plot_soak(res['soak'], os.path.join(out, 'soak.png'))
  if res.get('reuse'):
    plot_reuse(res['reuse'], os.path.join(out, 'reuse.png'))
  return md


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--worker', help=argparse.SUPPRESS)
  p.add_argument('--mp-worker', help=argparse.SUPPRESS)
  p.add_argument('--zygote', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--part', default='all',
                 help=f'comma list of parts to run: {",".join(PARTS)} (default: all)')
  p.add_argument('--full', action='store_true',
                 help=f'the small grid at {FULL_SCALE} scale')
  p.add_argument('--scale', default=None,
                 help=f'grid state size: {", ".join(f"{k}={measure.fmt_bytes(v)}" for k, v in SCALES.items())}'
                 f' or a size like 768MiB (default: {QUICK_SCALE}; {FULL_SCALE} with --full).'
                 '  An explicit --scale also shrinks the other parts (smoke runs)')
  p.add_argument('--states', default=','.join(STATES), help='comma list of ' + ','.join(STATES))
  p.add_argument('--budgets', default=DEFAULT_BUDGETS, help='grid: comma list of host-RAM budgets')
  p.add_argument('--gb-states', default=','.join(workloads.GB_STATES))
  p.add_argument('--gb-budgets', default='256MiB,1GiB', help='gb: comma list of budgets')
  p.add_argument('--gb-size', default=None,
                 help='gb: override both GB states\' size (default: big 4 GB, gemma_gb'
                 ' 2.2 GB; with an explicit --scale, that size)')
  p.add_argument('--soak-saves', type=int, default=50, help='0 skips the soak')
  p.add_argument('--soak-size', default=None,
                 help='soak state size (default 512MiB; with an explicit --scale, the'
                 ' state size if smaller)')
  p.add_argument('--soak-budget', default='256MiB')
  p.add_argument('--mp-budget', default=None, help='mp: budget per process (default 96MiB)')
  p.add_argument('--reuse-saves', type=int, default=None,
                 help=f'reuse: saves per run (default {workloads.REUSE_SAVES})')
  p.add_argument('--reuse-frozen', default=None, help='reuse: frozen bytes (default 1GiB)')
  p.add_argument('--reuse-train', default=None, help='reuse: trainable bytes (default 16MiB)')
  p.add_argument('--kauldron-steps', type=int, default=None,
                 help='reuse: train steps of the tiny Gemma LoRA (default 20; 0 skips)')
  p.add_argument('--out', default=os.path.join(HERE, 'out'))
  p.add_argument('--workdir', default=None, help='where checkpoints go (default: a temp dir)')
  p.add_argument('--jobs', type=int, default=1,
                 help='row workers at a time (>1 only for smoke runs: timings then'
                 ' interfere)')
  p.add_argument('--soak-jobs', type=int, default=None,
                 help='soaks at a time (default 1, so that their seconds are not'
                 ' contended; 4 saves ~3 min on 2 cores)')
  p.add_argument('--worker-timeout', type=float, default=1200)
  p.add_argument('--exec-workers', action='store_true',
                 help='start every worker as a new interpreter (+~4 s of imports a'
                 ' row) instead of forking it from a process that has only imported'
                 ' jax/orbax/kd_ckpt')
  p.add_argument('--replot', action='store_true',
                 help='only rebuild results.md and the plots from --out/results.json')
  return p.parse_args(argv)


def _free_port() -> int:
  import socket  # pylint: disable=g-import-not-at-top

  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def mp_worker_main(spec_json: str) -> int:
  spec = json.loads(spec_json)
  try:
    result = workloads.mp_process(spec)
  except Exception as e:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top

    traceback.print_exc()
    result = {'process_index': spec.get('process_id'),
              'error': f'{type(e).__name__}: {str(e)[:300]}'}
  sys.stdout.write(RESULT_PREFIX + json.dumps(result) + '\n')
  sys.stdout.flush()
  # jax.distributed's shutdown waits for the other process; do not hang on it.
  os._exit(0)  # pylint: disable=protected-access


def run_mp(strategy: str, budget: int, sharded_shape, replicated_shape, pkg_root: str,
           workdir: str, log_dir: str, timeout: float) -> dict[str, Any]:
  """One two-process save: both processes side by side, one result."""
  nproc = 2
  res: dict[str, Any] = {'variant': f'kd_ckpt {strategy}', 'budget_bytes': budget,
                         'num_processes': nproc}
  env = worker_env(pkg_root)
  env['XLA_FLAGS'] = ' '.join(
      [f for f in env.get('XLA_FLAGS', '').split()
       if not f.startswith('--xla_force_host_platform_device_count')]
      + [f'--xla_force_host_platform_device_count={workloads.MP_DEVICES_PER_PROCESS}'])
  os.makedirs(workdir, exist_ok=True)
  port = _free_port()
  procs = []
  for pid in range(nproc):
    spec = {'process_id': pid, 'num_processes': nproc, 'port': port, 'strategy': strategy,
            'budget': budget, 'workdir': workdir, 'sharded_shape': list(sharded_shape),
            'replicated_shape': list(replicated_shape)}
    log = open(os.path.join(log_dir, f'mp_{strategy}_{pid}.log'), 'w+')
    procs.append((subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), '--mp-worker', json.dumps(spec)],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log))
  deadline = time.monotonic() + timeout
  try:
    while any(p.poll() is None for p, _ in procs):
      if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p, _ in procs):
        break
      time.sleep(0.2)
  finally:
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    shutil.rmtree(workdir, ignore_errors=True)
  results = []
  for pid, (p, log) in enumerate(procs):
    log.seek(0)
    text = log.read()
    log.close()
    got = [l for l in text.splitlines() if l.startswith(RESULT_PREFIX)]
    if got:
      results.append(json.loads(got[-1][len(RESULT_PREFIX):]))
    else:
      tail = (text.strip().splitlines() or ['no output'])[-1]
      results.append({'process_index': pid,
                      'error': f'exit {p.returncode}: {tail[:300]}'})
  errors = [f"process {r.get('process_index')}: {r['error']}" for r in results
            if r.get('error')]
  if errors:
    res['error'] = '; '.join(errors)
  res['processes'] = [r for r in results if not r.get('error')]
  return res


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    return worker_main(args.worker)
  if args.mp_worker:
    return mp_worker_main(args.mp_worker)
  if args.zygote:
    return zygote_main()
  if args.replot:
    return replot(args.out)
  t_start = time.perf_counter()
  load_start = list(os.getloadavg())
  parts = PARTS if args.part in ('all', '') else tuple(
      p for p in args.part.split(',') if p)
  for p in parts:
    if p not in PARTS:
      raise SystemExit(f'unknown part {p!r} (parts: {", ".join(PARTS)})')
  smoke = args.scale is not None  # an explicit scale shrinks every part
  scale = args.scale or (FULL_SCALE if args.full else QUICK_SCALE)
  state_bytes = SCALES.get(scale) or measure.parse_bytes(scale)
  budgets = [measure.parse_bytes(b) for b in args.budgets.split(',') if b]
  gb_budgets = [measure.parse_bytes(b) for b in args.gb_budgets.split(',') if b]
  states = [s for s in args.states.split(',') if s]
  gb_states = [s for s in args.gb_states.split(',') if s]
  for s in states:
    if s not in STATES:
      raise SystemExit(f'unknown state {s!r}')
  for s in gb_states:
    if s not in workloads.GB_STATES:
      raise SystemExit(f'unknown GB state {s!r}')
  if args.gb_size:
    gb_sizes = dict.fromkeys(gb_states, measure.parse_bytes(args.gb_size))
  elif smoke:
    gb_sizes = dict.fromkeys(gb_states, state_bytes)
  else:
    gb_sizes = {'big': workloads.BIG_BYTES, 'gemma_gb': workloads.GEMMA_GB_BYTES}
  if args.soak_size:
    soak_bytes = measure.parse_bytes(args.soak_size)
  elif smoke:
    soak_bytes = min(SOAK_BYTES, state_bytes)
  else:
    soak_bytes = SOAK_BYTES
  soak_budget = measure.parse_bytes(args.soak_budget)
  mp_budget = measure.parse_bytes(args.mp_budget or workloads.MP_BUDGET)
  if smoke and state_bytes < SCALES['small']:
    mp_shapes = ((1024, 1024), (512, 512))
  else:
    mp_shapes = (workloads.MP_SHARDED_SHAPE, workloads.MP_REPLICATED_SHAPE)
  reuse_saves = args.reuse_saves or workloads.REUSE_SAVES
  reuse_frozen = measure.parse_bytes(args.reuse_frozen) if args.reuse_frozen else (
      min(workloads.REUSE_FROZEN_BYTES, 4 * state_bytes) if smoke
      else workloads.REUSE_FROZEN_BYTES)
  reuse_train = measure.parse_bytes(args.reuse_train) if args.reuse_train else (
      max(1 * MiB, min(workloads.REUSE_TRAIN_BYTES, reuse_frozen // 64)))
  kauldron_steps = 20 if args.kauldron_steps is None else args.kauldron_steps

  os.makedirs(args.out, exist_ok=True)
  log_dir = os.path.join(args.out, 'logs')
  os.makedirs(log_dir, exist_ok=True)
  workroot = args.workdir or tempfile.mkdtemp(prefix='kd_ckpt_bench_')
  os.makedirs(workroot, exist_ok=True)
  pkg_root = os.path.join(workroot, 'pkg')
  kd_version = snapshot_kd_ckpt(pkg_root)
  counter = iter(range(1_000_000))

  def wd():
    return os.path.join(workroot, f'w{next(counter)}')

  grid_jobs = []
  if 'grid' in parts:
    for st in states:
      for variant, budget in variants(budgets):
        grid_jobs.append({'kind': 'save', 'state': st, 'variant': variant,
                          'budget': budget, 'bytes': state_bytes, 'workdir': wd()})
  gb_jobs = []
  if 'gb' in parts:
    for st in gb_states:
      for variant, budget in gb_variants(gb_budgets):
        gb_jobs.append({'kind': 'save', 'state': st, 'variant': variant,
                        'budget': budget, 'bytes': gb_sizes[st], 'workdir': wd()})
  soak_jobs = []
  if 'soak' in parts and args.soak_saves > 0:
    for variant in SOAK_VARIANTS:
      soak_jobs.append({'kind': 'soak', 'state': 'sharded', 'variant': variant,
                        'budget': None if variant.startswith('orbax') else soak_budget,
                        'bytes': soak_bytes, 'saves': args.soak_saves, 'workdir': wd()})
  reuse_jobs = []
  if 'reuse' in parts:
    for variant in REUSE_VARIANTS:
      reuse_jobs.append({'kind': 'reuse', 'state': 'reuse', 'variant': variant,
                         'budget': workloads.REUSE_BUDGET, 'frozen_bytes': reuse_frozen,
                         'train_bytes': reuse_train, 'saves': reuse_saves,
                         'kept': workloads.REUSE_KEPT, 'workdir': wd()})

  def progress(res):
    elapsed = f'[{time.perf_counter() - t_start:6.0f} s]'
    if 'rss_after_bytes' in res:
      d = measure.soak_drift(res['rss_after_bytes'])
      msg = (f"soak {res['variant']}: RSS drift {measure.fmt_bytes(d)}, malloc"
             f" in-use drift {measure.fmt_bytes(measure.heap_drift(res))}")
    elif 'saves' in res:
      msg = f"reuse {res['variant']}: " + (
          '; '.join(measure.reuse_misses(res)) or 'met every target')
    elif 'processes' in res:
      msg = f"mp {res['variant']}: " + ', '.join(
          f"process {p['process_index']} peak"
          f" {measure.fmt_bytes(measure._proc_peak(p))}"  # pylint: disable=protected-access
          for p in res['processes'])
    else:
      over = measure.restore_overhead_bytes(res)
      msg = (f"{res.get('state', ''):<10} {res.get('variant', ''):<22}"
             f" {measure.budget_label(res.get('budget_bytes')):>8}:"
             f" peak {measure.fmt_bytes(res.get('peak_extra_bytes')):>10}"
             f"  {res.get('seconds') or 0:6.2f} s"
             + (f"  restore +{measure.fmt_bytes(over)}" if over is not None else ''))
    if res.get('error'):
      msg += f"  ERROR {res['error']}"
    print(f'{elapsed} {msg}', flush=True)
    return res

  soak_par = max(1, args.soak_jobs or 1)
  print(f"kd_ckpt bench: parts {','.join(parts)}; {len(grid_jobs)} grid rows"
        f' ({measure.fmt_bytes(state_bytes)} states), {len(gb_jobs)} GB rows, '
        f'{len(soak_jobs)} soaks ({min(soak_par, max(1, len(soak_jobs)))} at a time,'
        f' {measure.fmt_bytes(soak_bytes)}), {len(reuse_jobs)} reuse runs;'
        f' checkpoints under {workroot}; load average {load_start}', flush=True)

  zygotes: queue.SimpleQueue = queue.SimpleQueue()
  started: list[Zygote] = []

  def one(job):
    if args.exec_workers:
      return run_worker(job, log_dir, args.worker_timeout, pkg_root)
    try:
      z = zygotes.get_nowait()
    except queue.Empty:
      z = Zygote(pkg_root)
      started.append(z)
    try:
      return run_worker_forked(z, job, log_dir, args.worker_timeout)
    finally:
      zygotes.put(z)

  def run_all(batch, parallel):
    if parallel <= 1:
      return [progress(one(j)) for j in batch]
    out: list[Any] = [None] * len(batch)
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
      futs = {pool.submit(one, j): i for i, j in enumerate(batch)}
      for f in concurrent.futures.as_completed(futs):
        out[futs[f]] = progress(f.result())
    return out

  res: dict[str, Any] = {}
  dd: dict[str, dict[str, Any]] = {}
  part_seconds: dict[str, float] = {}
  try:
    for st in (states if grid_jobs else []):
      dd[st] = progress(run_dd(st, state_bytes, wd()))
    for st in (gb_states if gb_jobs else []):
      dd[st] = progress(run_dd(st, gb_sizes[st], wd()))
    if args.jobs > 1:  # smoke runs: the forked workers share one pool
      results = run_all(gb_jobs + grid_jobs + soak_jobs + reuse_jobs, args.jobs)
      n1, n2, n3 = len(gb_jobs), len(gb_jobs) + len(grid_jobs), len(
          gb_jobs) + len(grid_jobs) + len(soak_jobs)
      gb_results, grid_results = results[:n1], results[n1:n2]
      soaks, reuse = results[n2:n3], results[n3:]
    else:
      t0 = time.perf_counter()
      gb_results = run_all(gb_jobs, 1)
      part_seconds['gb'] = time.perf_counter() - t0
      t0 = time.perf_counter()
      grid_results = run_all(grid_jobs, 1)
      part_seconds['grid'] = time.perf_counter() - t0
      t0 = time.perf_counter()
      soaks = run_all(soak_jobs, soak_par)
      part_seconds['soak'] = time.perf_counter() - t0
      t0 = time.perf_counter()
      reuse = run_all(reuse_jobs, 1)
      part_seconds['reuse'] = time.perf_counter() - t0
    if 'reuse' in parts and kauldron_steps > 0:
      t0 = time.perf_counter()
      kd_wd = wd()
      env = worker_env(pkg_root)
      reuse.append(progress(workloads.run_kauldron_lora(
          REPO, kd_wd, env, kauldron_steps, os.path.join(log_dir, 'kauldron_lora.log'),
          args.worker_timeout)))
      shutil.rmtree(kd_wd, ignore_errors=True)
      part_seconds['reuse'] = part_seconds.get('reuse', 0.0) + time.perf_counter() - t0
    mp = []
    if 'mp' in parts:
      t0 = time.perf_counter()
      for strategy in MP_STRATEGIES:
        mp.append(progress(run_mp(strategy, mp_budget, *mp_shapes, pkg_root, wd(),
                                  log_dir, timeout=min(600, args.worker_timeout))))
      part_seconds['mp'] = time.perf_counter() - t0
  finally:
    for z in started:
      z.close()
    if not args.workdir:
      shutil.rmtree(workroot, ignore_errors=True)

  def with_dd(results, names):
    out = []
    for st in names:
      out += [r for r in results if r.get('state') == st]
      if st in dd:
        out.append(dd[st])
    measure.attach_orbax_default_seconds(out)
    return out

  res['rows'] = with_dd(grid_results, states) if grid_jobs else []
  res['gb_rows'] = with_dd(gb_results, gb_states) if gb_jobs else []
  res['soak'], res['mp'], res['reuse'] = soaks, mp, reuse
  res['violations'] = all_violations(res)
  wall = time.perf_counter() - t_start
  res['config'] = {
      'parts': list(parts), 'mode': 'full' if args.full else 'default',
      'scale': scale, 'state_bytes': state_bytes, 'budgets': budgets,
      'states': states, 'gb_states': gb_states, 'gb_sizes': gb_sizes,
      'gb_budgets': gb_budgets, 'soak_saves': args.soak_saves, 'soak_bytes': soak_bytes,
      'soak_budget': soak_budget, 'mp_budget': mp_budget,
      'mp_sharded_shape': list(mp_shapes[0]), 'mp_replicated_shape': list(mp_shapes[1]),
      'reuse_saves': reuse_saves, 'reuse_frozen_bytes': reuse_frozen,
      'reuse_train_bytes': reuse_train, 'kauldron_steps': kauldron_steps,
      'devices': N_DEVICES, 'jobs': args.jobs,
      'workers': 'exec' if args.exec_workers else 'forked from a zygote',
      'soak_jobs': (args.jobs if args.jobs > 1 else min(soak_par, max(1, len(soak_jobs)))),
      'machine': f'{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs,'
                 f' {measure.fmt_bytes(_total_ram())} RAM',
      'wall_seconds': wall,
      'part_seconds': {k: part_seconds[k] for k in PARTS if k in part_seconds and k in parts},
      'loadavg_start_end': [load_start, list(os.getloadavg())],
      'loadavg_1min_start_end': [load_start[0], os.getloadavg()[0]],
      'kd_ckpt': kd_version,
  }
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(res, f, indent=1)
  md = write_outputs(args.out, res)
  print()
  print(md)
  print(f'wrote {args.out}/results.json, results.md and plots in {_fmt_wall(wall)}')
  return 1 if res['violations'] else 0


def replot(out: str) -> int:
  with open(os.path.join(out, 'results.json')) as f:
    res = json.load(f)
  res.setdefault('rows', [])
  config = res['config']
  if 'loadavg_start_end' not in config:
    one = config.get('loadavg_1min_start_end') or [float('nan')] * 2
    config['loadavg_start_end'] = [[one[0]] * 3, [one[1]] * 3]
  res['violations'] = all_violations(res)
  print(write_outputs(out, res))
  return 1 if res['violations'] else 0


def _total_ram() -> int:
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError):
    return 0


if __name__ == '__main__':
  sys.exit(main())
