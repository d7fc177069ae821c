#!/usr/bin/env python
"""Benchmark: host RAM and speed of Orbax vs kd_ckpt saves (CPU, 8 fake devices).

  .venv/bin/python bench/run.py          # default: 128 MiB states, soaks at once
  .venv/bin/python bench/run.py --full   # 512 MiB states, soaks one at a time
  .venv/bin/python bench/run.py --scale tiny --budgets 64MiB --soak-saves 3

Every measured variant runs in a fresh process, forked from a zygote that
has only imported jax/orbax/kd_ckpt (`--exec-workers`: a new interpreter,
`run.py --worker SPEC`), so nothing (heap, thread pools, JAX caches) leaks
between rows.  Writes results.json, results.md, peaks.png, soak.png to --out
(default bench/out/) and exits 1 when kd_ckpt misses a threshold (see
bench/measure.py: streaming peak <= budget*1.10 + 32 MiB, soak drift <= 16 MiB).
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


def _shard_spec(shape, n, min_bytes, itemsize):
  """Shard the largest axis divisible by n; small leaves stay replicated."""
  if math.prod(shape) * itemsize < min_bytes:
    return (None,) * len(shape)
  best = None
  for ax, d in enumerate(shape):
    if d % n == 0 and (best is None or d > shape[best]):
      best = ax
  return tuple('d' if i == best else None for i in range(len(shape)))


def _round(x, m):
  return max(m, int(round(x / m)) * m)


def build_state(name: str, total_bytes: int):
  """The benchmark's states, ~total_bytes of logical (unreplicated) data."""
  jax = _jax()
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
    n_params = total_bytes / 10
    layers = 4
    per_layer = 26.25  # in D^2: q 1 + kv 1/4 + o 1 + gating 16 + linear 8
    d = _round(math.sqrt(0.75 * n_params / (layers * per_layer)), 64)
    f, kvd = 8 * d, max(8, d // 8)
    vocab = _round(max(n_params - layers * per_layer * d * d, 64 * d) / d, 64)
    shapes = {'embedder': {'input_embedding': (vocab, d)}, 'final_norm': {'scale': (d,)}}
    for l in range(layers):
      shapes[f'layer_{l}'] = {
          'attn': {'q_einsum': (d, d), 'kv_einsum': (2, d, kvd), 'attn_vec_einsum': (d, d)},
          'mlp': {'gating_einsum': (2, d, f), 'linear': (f, d)},
          'pre_attention_norm': {'scale': (d,)},
          'pre_ffw_norm': {'scale': (d,)},
      }
    counter = iter(range(10_000))

    def make(dtype):
      def one(shape):
        itemsize = jnp.dtype(dtype).itemsize
        return _leaf(jax, mesh, shape, dtype,
                     _shard_spec(shape, n, 1 * MiB, itemsize), next(counter))
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
  return int(sum(s.data.nbytes for x in jax.tree.leaves(tree)
                 for s in x.addressable_shards))


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

  def path(self, step: int) -> str:
    return os.path.join(self.workdir, f'step_{step}')

  def save(self, tree, step: int) -> None:
    ocp = self.ocp
    if self.variant == 'orbax default':
      t0 = time.perf_counter()
      self._mngr.save(step, args=ocp.args.StandardSave(tree))
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
    if self.variant == 'orbax default':
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
  state = build_state(spec['state'], spec['bytes'])
  nbytes = logical_bytes(state)
  row.update(state_bytes=nbytes, state_resident_bytes=resident_bytes(state),
             leaves=len(jax.tree.leaves(state)))
  target = abstract(state)
  fp_before = fingerprint(state)
  saver = _Saver(spec['variant'], spec.get('budget'), spec['workdir'])
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

  # Restore into the same shardings, with the saved state gone.
  del state
  gc.collect()
  measure.malloc_trim()
  with measure.Peak() as p:
    t0 = time.perf_counter()
    restored = saver.restore(target, 1)
    jax.block_until_ready(restored)
    row['restore_seconds'] = time.perf_counter() - t0
  row.update(restore_extra_bytes=p.extra_bytes, restored_bytes=resident_bytes(restored),
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
  for step in range(1, spec['saves'] + 1):
    with measure.Peak() as p:
      t0 = time.perf_counter()
      saver.save(state, step)
      secs.append(time.perf_counter() - t0)
    if step > 2:
      saver.delete(step - 2)  # keep 2, like max_to_keep=2
    peaks.append(p.extra_bytes)
    rss.append(measure.rss_bytes())
    heap = measure.heap_bytes()  # diagnostic: leak (in use) or slack (free)?
    if heap is not None:
      heap_used.append(heap['in_use'])
      heap_free.append(heap['free'])
  out.update(rss_after_bytes=rss, peak_extra_bytes=peaks, seconds=secs)
  if heap_used:
    out.update(heap_in_use_bytes=heap_used, heap_free_bytes=heap_free)
  saver.close()
  return out


def worker_main(spec_json: str, result_path: str | None = None) -> int:
  spec = json.loads(spec_json)
  try:
    result = worker_soak(spec) if spec['kind'] == 'soak' else worker_save(spec)
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
  out: list[tuple[str, int | None]] = [('orbax default', None)]
  out += [('orbax tuned', b) for b in budgets]
  out += [('kd_ckpt auto', b) for b in budgets]
  out += [('kd_ckpt streaming', b) for b in budgets]
  return out


def plot_peaks(rows, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  states = list(dict.fromkeys(r['state'] for r in rows))
  fig, axes = plt.subplots(len(states), 1, figsize=(12, 3.6 * len(states)), squeeze=False)
  for ax, st in zip(axes[:, 0], states):
    rs = [r for r in rows if r['state'] == st and r.get('variant', '').split()[0] != 'dd']
    labels, vals, colors = [], [], []
    for r in rs:
      labels.append(r["variant"].replace(" ", "\n", 1) + "\n" + measure.budget_label(r.get("budget_bytes")))
      vals.append((r.get('peak_extra_bytes') or 0) / MiB)
      colors.append('tab:red' if r.get('error') else
                    'tab:blue' if r['variant'].startswith('kd_ckpt') else 'tab:gray')
    xs = range(len(rs))
    ax.bar(xs, [max(v, 0.06) for v in vals], color=colors)
    for x, r in zip(xs, rs):
      b = r.get('budget_bytes')
      if b:
        ax.hlines(b / MiB, x - 0.4, x + 0.4, colors='k', linestyles='-',
                  label='budget' if x == min(i for i, q in enumerate(rs) if q.get('budget_bytes')) else None)
        if r['variant'] == 'kd_ckpt streaming':
          ax.hlines(measure.streaming_limit_bytes(b) / MiB, x - 0.4, x + 0.4,
                    colors='tab:red', linestyles=':',
                    label='streaming limit' if r is next(q for q in rs if q['variant'] == 'kd_ckpt streaming') else None)
      if r.get('error'):
        ax.text(x, 0.07, 'error', ha='center', va='bottom', rotation=90, fontsize=7)
    ax.set_yscale('log')
    ax.set_ylim(bottom=0.05)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel('peak extra RSS (MiB)')
    sb = next((r.get('state_bytes') for r in rs if r.get('state_bytes')), None)
    ax.set_title(f'{st} state ({measure.fmt_bytes(sb)})')
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
          ' process, but "mean save s" includes the contention.', '']


def write_markdown(path, rows, soaks, violations, config) -> str:
  lines = [
      '# kd_ckpt benchmark',
      '',
      f"kd_ckpt {kd_desc(config)}; {config['machine']}; {config['devices']}"
      f" fake CPU devices; states of"
      f" {measure.fmt_bytes(config['state_bytes'])} (logical); wall"
      f" {config['wall_seconds']:.0f} s; 1-min load average"
      f" {config['loadavg_1min_start_end'][0]:.1f} at start,"
      f" {config['loadavg_1min_start_end'][1]:.1f} at end (other processes"
      " share the CPUs: timings are only as quiet as the machine).",
      'Peak extra RSS = VmHWM during the save minus RSS just before it; every'
      ' row in a fresh process, after a tiny warm-up save.  GB/s = logical'
      ' state bytes / seconds until durable (Orbax: until wait_until_finished).',
      'On CPU, device buffers are host RAM and np.asarray(jax.Array) is'
      ' zero-copy, so Orbax\'s device->host copy costs nothing here (it does on'
      ' GPU/TPU); restored arrays also live in host RAM, hence "restore extra -'
      ' restored".',
      '',
      '## Saves',
      '',
      measure.save_table(rows),
      f'## Soak ({config["soak_saves"]} saves of'
      f' {measure.fmt_bytes(config["soak_bytes"])}, keep 2)',
      '',
      *_soak_note(config),
      measure.soak_table(soaks) if soaks else '(skipped)\n',
      '## Thresholds',
      '',
      f'kd_ckpt streaming peak <= budget*{measure.STREAMING_BUDGET_FACTOR:.2f}'
      f' + {measure.fmt_bytes(measure.STREAMING_BUDGET_SLACK_BYTES)}; soak drift'
      f' (RSS after save {measure.SOAK_DRIFT_FROM} -> after save {measure.SOAK_DRIFT_TO})'
      f' <= {measure.fmt_bytes(measure.SOAK_DRIFT_LIMIT_BYTES)}.',
      '',
  ]
  if violations:
    lines += ['**FAIL**', ''] + [f'- {v}' for v in violations]
  else:
    lines += ['**PASS**: kd_ckpt met every threshold.']
  warnings = measure.budget_warnings(rows)
  if warnings:
    lines += ['', 'Not enforced (kd_ckpt auto over its budget):', ''] + [
        f'- {w}' for w in warnings]
  text = '\n'.join(lines) + '\n'
  with open(path, 'w') as f:
    f.write(text)
  return text


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--worker', help=argparse.SUPPRESS)
  p.add_argument('--zygote', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--full', action='store_true',
                 help=f'the full sweep (~20 min on 2 cores): {FULL_SCALE} scale states,'
                 ' soaks one at a time')
  p.add_argument('--scale', default=None,
                 help=f'state size: {", ".join(f"{k}={measure.fmt_bytes(v)}" for k, v in SCALES.items())}'
                 f' or a size like 768MiB (default: {QUICK_SCALE}; {FULL_SCALE} with --full)')
  p.add_argument('--states', default=','.join(STATES), help='comma list of ' + ','.join(STATES))
  p.add_argument('--budgets', default=DEFAULT_BUDGETS, help='comma list of host-RAM budgets')
  p.add_argument('--soak-saves', type=int, default=50, help='0 skips the soak')
  p.add_argument('--soak-size', default=None,
                 help='soak state size (default 512MiB; with an explicit --scale, the'
                 ' state size if smaller)')
  p.add_argument('--soak-budget', default='256MiB')
  p.add_argument('--out', default=os.path.join(HERE, 'out'))
  p.add_argument('--workdir', default=None, help='where checkpoints go (default: a temp dir)')
  p.add_argument('--jobs', type=int, default=1,
                 help='save-row workers at a time (>1 only for smoke runs: timings then'
                 ' interfere)')
  p.add_argument('--soak-jobs', type=int, default=None,
                 help='soaks at a time (default: all at once; 1 with --full).  Soaks'
                 ' measure RSS; their save seconds then include contention')
  p.add_argument('--worker-timeout', type=float, default=1200)
  p.add_argument('--exec-workers', action='store_true',
                 help='start every worker as a new interpreter (+~4 s of imports a'
                 ' row) instead of forking it from a process that has only imported'
                 ' jax/orbax/kd_ckpt')
  p.add_argument('--replot', action='store_true',
                 help='only rebuild results.md and the plots from --out/results.json')
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    return worker_main(args.worker)
  if args.zygote:
    return zygote_main()
  if args.replot:
    return replot(args.out)
  t_start = time.perf_counter()
  load_start = os.getloadavg()[0]
  scale = args.scale or (FULL_SCALE if args.full else QUICK_SCALE)
  state_bytes = SCALES.get(scale) or measure.parse_bytes(scale)
  budgets = [measure.parse_bytes(b) for b in args.budgets.split(',') if b]
  states = [s for s in args.states.split(',') if s]
  for s in states:
    if s not in STATES:
      raise SystemExit(f'unknown state {s!r}')
  if args.soak_size:
    soak_bytes = measure.parse_bytes(args.soak_size)
  elif args.scale:  # an explicit (e.g. tiny smoke) scale shrinks the soak too
    soak_bytes = min(SOAK_BYTES, state_bytes)
  else:
    soak_bytes = SOAK_BYTES
  soak_budget = measure.parse_bytes(args.soak_budget)
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

  jobs = []
  for st in states:
    for variant, budget in variants(budgets):
      jobs.append({'kind': 'save', 'state': st, 'variant': variant, 'budget': budget,
                   'bytes': state_bytes, 'workdir': wd()})
  soak_jobs = []
  if args.soak_saves > 0:
    for variant, budget in (('orbax default', None), ('kd_ckpt auto', soak_budget),
                            ('kd_ckpt streaming', soak_budget)):
      soak_jobs.append({'kind': 'soak', 'state': 'sharded', 'variant': variant,
                        'budget': budget, 'bytes': soak_bytes,
                        'saves': args.soak_saves, 'workdir': wd()})

  def progress(res):
    if 'rss_after_bytes' in res:
      d = measure.soak_drift(res['rss_after_bytes'])
      msg = (f"soak {res['variant']}: RSS drift {measure.fmt_bytes(d)}, malloc"
             f" in-use drift {measure.fmt_bytes(measure.heap_drift(res))}")
    else:
      msg = (f"{res['state']:<10} {res['variant']:<18}"
             f" {measure.budget_label(res.get('budget_bytes')):>8}:"
             f" peak {measure.fmt_bytes(res.get('peak_extra_bytes')):>10}"
             f"  {res.get('seconds') or 0:6.2f} s")
    if res.get('error'):
      msg += f"  ERROR {res['error']}"
    print(f'[{time.perf_counter() - t_start:6.0f} s] {msg}', flush=True)
    return res

  soak_par = max(1, args.soak_jobs or (1 if args.full else len(soak_jobs) or 1))
  print(f'kd_ckpt bench: {len(jobs)} save rows + {len(states)} dd rows +'
        f' {len(soak_jobs)} soaks ({min(soak_par, len(soak_jobs))} at a time);'
        f' states {measure.fmt_bytes(state_bytes)}, soak {measure.fmt_bytes(soak_bytes)};'
        f' checkpoints under {workroot}', flush=True)
  rows: list[dict[str, Any]] = []
  soaks: list[dict[str, Any]] = []

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

  try:
    for st in states:
      rows.append(progress(run_dd(st, state_bytes, wd())))
    if args.jobs > 1:  # smoke runs: everything shares one pool
      results = run_all(jobs + soak_jobs, args.jobs)
      save_results, soaks = results[:len(jobs)], results[len(jobs):]
    else:
      save_results = run_all(jobs, 1)
      soaks = run_all(soak_jobs, soak_par)
  finally:
    for z in started:
      z.close()
    if not args.workdir:
      shutil.rmtree(workroot, ignore_errors=True)
  # Table order: per state, the variants, then dd.
  dd_rows = {r['state']: r for r in rows}
  rows = []
  for st in states:
    rows += [r for r in save_results if r.get('state') == st]
    rows.append(dd_rows[st])
  measure.attach_orbax_default_seconds(rows)
  violations = measure.check_rows(rows) + measure.check_soaks(soaks)
  wall = time.perf_counter() - t_start
  config = {
      'mode': 'full' if args.full else 'default',
      'scale': scale, 'state_bytes': state_bytes, 'budgets': budgets,
      'states': states, 'soak_saves': args.soak_saves, 'soak_bytes': soak_bytes,
      'soak_budget': soak_budget, 'devices': N_DEVICES, 'jobs': args.jobs,
      'workers': 'exec' if args.exec_workers else 'forked from a zygote',
      'soak_jobs': (args.jobs if args.jobs > 1 else min(soak_par, len(soak_jobs))),
      'machine': f'{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs,'
                 f' {measure.fmt_bytes(_total_ram())} RAM',
      'wall_seconds': wall,
      'loadavg_1min_start_end': [load_start, os.getloadavg()[0]],
      'kd_ckpt': kd_version,
  }
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump({'config': config, 'rows': rows, 'soak': soaks,
               'violations': violations}, f, indent=1)
  md = write_markdown(os.path.join(args.out, 'results.md'), rows, soaks, violations, config)
  plot_peaks(rows, os.path.join(args.out, 'peaks.png'))
  if soaks:
    plot_soak(soaks, os.path.join(args.out, 'soak.png'))
  print()
  print(md)
  print(f'wrote {args.out}/results.json, results.md, peaks.png'
        f'{", soak.png" if soaks else ""} in {wall:.0f} s')
  return 1 if violations else 0


def replot(out: str) -> int:
  with open(os.path.join(out, 'results.json')) as f:
    res = json.load(f)
  rows, soaks, config = res['rows'], res['soak'], res['config']
  config.setdefault('loadavg_1min_start_end', [float('nan')] * 2)
  violations = measure.check_rows(rows) + measure.check_soaks(soaks)
  print(write_markdown(os.path.join(out, 'results.md'), rows, soaks, violations, config))
  plot_peaks(rows, os.path.join(out, 'peaks.png'))
  if soaks:
    plot_soak(soaks, os.path.join(out, 'soak.png'))
  return 1 if violations else 0


def _total_ram() -> int:
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError):
    return 0


if __name__ == '__main__':
  sys.exit(main())
