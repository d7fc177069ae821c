#!/usr/bin/env python
"""Host RAM of Orbax vs kd_ckpt saves with the state on a CUDA device.

On CPU the device buffers *are* host RAM and `np.asarray(jax.Array)` is
zero-copy, so bench/run.py cannot see Orbax's device->host copies or pinned
staging.  This script runs the same comparison where they are real:

  states: 4 GB and 16 GB on the device (bf16 params + f32 Adam mu/nu, sharded
          over every local device)
  rows:   Orbax default (CheckpointManager, async) with pinned host transfer
          on/off x replica parallel on/off; kd_ckpt auto and streaming at
          1 GiB; dd of the same bytes (disk ceiling)
  stock:  kd_ckpt restoring the checkpoint the first Orbax row wrote, at
          --stock-budgets (a resumed run begun under stock Orbax; issue 20
          asks for Orbax's restore time there), in that row's process

Each row runs in a fresh subprocess (the XLA pinned-host pool is never given
back to the OS, so rows must not share a process).  A deadline (default
450 s of rows, so the whole script stays under 8 minutes) skips what would not
fit.  Writes gpu_check.md and gpu_check.json to $OUT when set, else ./gpu_out.

  python bench/gpu_check.py                 # on the GPU machine
  python bench/gpu_check.py --dry-run       # CPU, tiny states: smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
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

RESULT_PREFIX = 'GPU_CHECK_RESULT '
MiB, GiB = measure.MiB, measure.GiB


def orbax_variants() -> list[dict[str, Any]]:
  return [{'variant': 'orbax default', 'pinned': p, 'replica_parallel': rp}
          for p in (True, False) for rp in (True, False)]


def all_variants(budget: int) -> list[dict[str, Any]]:
  return orbax_variants() + [
      {'variant': 'kd_ckpt auto', 'budget': budget},
      {'variant': 'kd_ckpt streaming', 'budget': budget},
  ]


def label(v: dict[str, Any]) -> str:
  if v['variant'].startswith('orbax'):
    return (f"orbax default, pinned {'on' if v['pinned'] else 'off'},"
            f" replica-parallel {'on' if v['replica_parallel'] else 'off'}")
  return v['variant']


# ==========================================================================
# Worker (fresh process per row).


def build_state(jax, total_bytes: int):
  """bf16 params + f32 mu/nu (10 bytes/param), 8 leaves each, made on device."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  devices = jax.local_devices()
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  n = len(devices)
  sharding = NamedSharding(mesh, P('d', None))
  cols = 4096
  per_leaf = total_bytes / 10 / 8  # params per leaf
  rows = max(n, int(round(per_leaf / cols / n)) * n)

  # One program per dtype: a jit per leaf compiled 24 times (6 of a dry-run
  # row's 8 s).
  make = {dtype: jax.jit(lambda k, dtype=dtype: jax.random.normal(k, (rows, cols), dtype),
                         out_shardings=sharding) for dtype in (jnp.bfloat16, jnp.float32)}

  def leaf(seed, dtype):
    return make[dtype](jax.random.key(seed))

  params = {f'layer_{i}': leaf(i, jnp.bfloat16) for i in range(8)}
  mu = {f'layer_{i}': leaf(100 + i, jnp.float32) for i in range(8)}
  nu = {f'layer_{i}': leaf(200 + i, jnp.float32) for i in range(8)}
  state = {'params': params, 'opt_state': {'mu': mu, 'nu': nu}}
  jax.block_until_ready(state)
  return state


def fingerprint(jax, tree):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def fp(x):
    x = x.astype(jnp.float32)
    return jnp.stack([jnp.sum(x), jnp.sum(x * x)])

  out = jax.jit(lambda t: jax.tree.map(fp, t))(tree)
  return [[float(v) for v in leaf] for leaf in jax.tree.leaves(out)]


def host_resident_bytes(jax, tree) -> int:
  """Bytes of `tree`'s arrays in host RAM: only on the CPU backend (shared buffers once)."""
  if jax.default_backend() != 'cpu':
    return 0
  return int(sum({s.data.unsafe_buffer_pointer(): s.data.nbytes
                  for x in jax.tree.leaves(tree) for s in x.addressable_shards}.values()))


def same_values(fp_before, fp_after) -> bool:
  import numpy as np  # pylint: disable=g-import-not-at-top
  return len(fp_before) == len(fp_after) and all(
      np.allclose(a, b, rtol=1e-5) for a, b in zip(fp_before, fp_after))


def worker(spec: dict[str, Any]) -> dict[str, Any]:
  import gc  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  row: dict[str, Any] = {'state': spec['state_label'], 'variant': label(spec),
                         'budget_bytes': spec.get('budget'),
                         'backend': jax.default_backend(),
                         'devices': len(jax.local_devices())}
  state = build_state(jax, spec['bytes'])
  nbytes = int(sum(x.nbytes for x in jax.tree.leaves(state)))
  row['state_bytes'] = nbytes
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  fp_before = fingerprint(jax, state)
  workdir = spec['workdir']
  is_kd = spec['variant'].startswith('kd_ckpt')

  if is_kd:
    import kd_ckpt  # pylint: disable=g-import-not-at-top

    strategy = spec['variant'].split()[-1]

    def save(tree, step):
      return kd_ckpt.save(os.path.join(workdir, f'step_{step}'), tree,
                          host_ram_budget=spec['budget'], strategy=strategy)

    def restore(tgt, step):
      return kd_ckpt.restore(os.path.join(workdir, f'step_{step}'), tgt,
                             host_ram_budget=spec['budget'])
  else:
    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(use_replica_parallel=spec['replica_parallel']),
        override=True)
    handler = ocp.PyTreeCheckpointHandler(enable_pinned_host_transfer=spec['pinned'])
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(None, ocp.args.PyTreeSave, handler)
    registry.add(None, ocp.args.PyTreeRestore, handler)
    mngr = ocp.CheckpointManager(
        os.path.join(workdir, 'orbax'),
        options=ocp.CheckpointManagerOptions(max_to_keep=2,
                                             enable_async_checkpointing=True),
        handler_registry=registry)

    def save(tree, step):
      t0 = time.perf_counter()
      mngr.save(step, args=ocp.args.PyTreeSave(tree))
      row['save_blocked_seconds'] = time.perf_counter() - t0
      mngr.wait_until_finished()

    def restore(tgt, step):
      return mngr.restore(step, args=ocp.args.PyTreeRestore(
          item=tgt, restore_args=ocp.checkpoint_utils.construct_restore_args(tgt)))

  # Warm-up on a tiny tree: imports, thread pools, pinned allocator init.
  tiny = {'a': jax.device_put(np.ones((8, 128), np.float32))}
  save(tiny, 0)
  tiny_target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tiny)
  restore(tiny_target, 0)
  del tiny
  gc.collect()
  measure.malloc_trim()

  with measure.Peak() as p:
    t0 = time.perf_counter()
    report = save(state, 1)
    seconds = time.perf_counter() - t0
  row.update(peak_extra_bytes=p.extra_bytes, retained_bytes=p.retained_bytes,
             seconds=seconds, gb_per_sec=nbytes / 1e9 / seconds, exact_peak=p.exact)
  notes = []
  if 'save_blocked_seconds' in row:
    notes.append(f"async, save() blocked {row['save_blocked_seconds']:.2f} s")
  if report is not None:
    row.update(kd_strategy=report.strategy, kd_settings=report.settings,
               kd_predicted_peak_bytes=report.predicted_peak_bytes,
               kd_self_peak_extra_bytes=report.peak_extra_bytes)
    notes.append(f'{report.strategy} ({report.settings}); predicted'
                 f' {measure.fmt_bytes(report.predicted_peak_bytes)}')
  notes.append(f'retained {measure.fmt_bytes(p.retained_bytes)}')
  # What the saved arrays still hold on the host (e.g. a cached _npy_value).
  gc.collect()
  measure.malloc_trim()
  row['retained_after_trim_bytes'] = measure.rss_bytes() - p.before_bytes

  row['restore_skipped'] = not spec.get('restore', True)
  if not row['restore_skipped']:
    del state
    gc.collect()
    measure.malloc_trim()
    with measure.Peak() as p:
      t0 = time.perf_counter()
      restored = restore(target, 1)
      jax.block_until_ready(restored)
      row['restore_seconds'] = time.perf_counter() - t0
    row['restore_extra_bytes'] = p.extra_bytes
    row['restored_bytes'] = host_resident_bytes(jax, restored)
    ok = same_values(fp_before, fingerprint(jax, restored))
    row['restore_ok'] = ok
    if not ok:
      notes.append('RESTORED DATA DIFFERS')
    del restored
    if spec.get('stock_budgets'):
      row['stock_restores'] = stock_restores(jax, os.path.join(workdir, 'orbax'), target,
                                             spec['stock_budgets'], fp_before, tiny_target)
  row['notes'] = '; '.join(notes)
  if not is_kd:
    mngr.close()
  return row


def stock_restores(jax, root: str, target, budgets, fp_before,
                   warm_target) -> list[dict[str, Any]]:
  """kd_ckpt.restore of the checkpoint Orbax wrote at step 1, at each budget,
  after an untimed one of its warm-up checkpoint (step 0): kd_ckpt's one-time
  costs in the process, as Orbax's own restore had them paid."""
  import gc  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top

  def item(step):  # the manager's item directory (`default` for an unnamed handler)
    d = os.path.join(root, str(step))
    return next(os.path.join(d, x) for x in sorted(os.listdir(d))
                if os.path.exists(os.path.join(d, x, '_METADATA')))

  jax.block_until_ready(kd_ckpt.restore(item(0), warm_target, host_ram_budget=budgets[0]))
  out = []
  for budget in budgets:
    gc.collect()
    measure.malloc_trim()
    res: dict[str, Any] = {'budget_bytes': budget}
    try:
      with measure.Peak() as p:
        t0 = time.perf_counter()
        restored = jax.block_until_ready(
            kd_ckpt.restore(item(1), target, host_ram_budget=budget))
        res['seconds'] = time.perf_counter() - t0
      res['extra_bytes'] = p.extra_bytes
      res['restored_bytes'] = host_resident_bytes(jax, restored)
      res['ok'] = same_values(fp_before, fingerprint(jax, restored))
      del restored
    except Exception as e:  # pylint: disable=broad-except
      res['error'] = f'{type(e).__name__}: {str(e)[:300]}'
    out.append(res)
  return out


def stock_table(rows) -> tuple[str, list[str]]:
  """The stock-restore rows as a table, and their budget violations."""
  lines = ['| state | kd_ckpt budget | seconds | x Orbax\'s restore | peak beyond arrays'
           ' | / budget | values |', '| --- | --- | --- | --- | --- | --- | --- |']
  failures = []
  for r in rows:
    for s in r.get('stock_restores') or ():
      budget = s['budget_bytes']
      name = f"{r['state']} stock restore @{measure.budget_label(budget)}"
      if s.get('error'):
        lines.append(f"| {r['state']} | {measure.budget_label(budget)} | - | - | - | - |"
                     f" ERROR: {s['error'].replace('|', '/')} |")
        failures.append(f'{name}: failed: {s["error"]}')
        continue
      over = s['extra_bytes'] - s.get('restored_bytes', 0)
      own = r.get('restore_seconds')
      ratio = f"{s['seconds'] / own:.2f}x" if own else '-'
      lines.append(
          f"| {r['state']} | {measure.budget_label(budget)} | {s['seconds']:.2f} | {ratio} |"
          f' {measure.fmt_bytes(over)} | {over / budget:.2f} |'
          f" {'ok' if s.get('ok') else 'DIFFER'} |")
      if over > measure.kd_limit_bytes(budget):
        failures.append(f'{name}: peak beyond the restored arrays {measure.fmt_bytes(over)}'
                        f' > limit {measure.fmt_bytes(measure.kd_limit_bytes(budget))}')
      if not s.get('ok'):
        failures.append(f'{name}: restored values differ from the saved ones')
  return '\n'.join(lines), failures


def worker_main(spec_json: str) -> int:
  spec = json.loads(spec_json)
  try:
    result = worker(spec)
  except Exception as e:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top

    traceback.print_exc()
    result = {'state': spec['state_label'], 'variant': label(spec),
              'budget_bytes': spec.get('budget'),
              'error': f'{type(e).__name__}: {str(e)[:300]}'}
  print(RESULT_PREFIX + json.dumps(result), flush=True)
  return 0


# ==========================================================================
# Driver.


def run_one(spec, env, timeout, log_path) -> dict[str, Any]:
  os.makedirs(spec['workdir'], exist_ok=True)
  base = {'state': spec['state_label'], 'variant': label(spec),
          'budget_bytes': spec.get('budget')}
  try:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), '--worker', json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=max(1, timeout), cwd=REPO)
  except subprocess.TimeoutExpired:
    return {**base, 'error': f'timed out after {timeout:.0f} s'}
  finally:
    shutil.rmtree(spec['workdir'], ignore_errors=True)
  with open(log_path, 'w') as f:
    f.write(proc.stdout + '\n--- stderr ---\n' + proc.stderr)
  return measure.worker_result(proc.stdout, proc.stderr, proc.returncode, RESULT_PREFIX, base)


def run_dd(state_label, nbytes, workdir, timeout) -> dict[str, Any]:
  os.makedirs(workdir, exist_ok=True)
  count = max(1, math.ceil(nbytes / MiB))
  row = {'state': state_label, 'variant': 'dd (disk ceiling)', 'budget_bytes': None,
         'notes': f'dd bs=1M count={count} conv=fsync'}
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(['dd', 'if=/dev/zero', f'of={workdir}/dd.bin', 'bs=1M',
                           f'count={count}', 'conv=fsync'],
                          capture_output=True, text=True, timeout=max(1, timeout))
  except subprocess.TimeoutExpired:
    row['error'] = f'timed out after {timeout:.0f} s'
    return row
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  secs = time.perf_counter() - t0
  if proc.returncode:
    row['error'] = proc.stderr.strip()[-300:]
  else:
    row.update(seconds=secs, gb_per_sec=count * MiB / 1e9 / secs)
  return row


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--worker', help=argparse.SUPPRESS)
  p.add_argument('--sizes', default='4GB,16GB', help='device state sizes')
  p.add_argument('--budget', default='1GiB', help='kd_ckpt host-RAM budget')
  p.add_argument('--deadline', type=float, default=None,
                 help='seconds for all rows; later rows are skipped past it'
                 ' (default 450, dry run 900)')
  p.add_argument('--stock-budgets', default='256MiB,1GiB',
                 help='kd_ckpt restores the first Orbax row\'s checkpoint at each'
                 ' (states up to --restore-max; empty: none)')
  p.add_argument('--restore-max', default='4GB',
                 help='measure restores only for states up to this size')
  p.add_argument('--dry-run', action='store_true',
                 help='CPU backend (2 fake devices), one 4 MiB state: smoke test')
  p.add_argument('--out', default=None, help='default: $OUT, else ./gpu_out')
  args = p.parse_args(argv)
  if args.worker:
    return worker_main(args.worker)

  t_start = time.perf_counter()
  out = args.out or os.environ.get('OUT') or os.path.join(os.getcwd(), 'gpu_out')
  os.makedirs(out, exist_ok=True)
  log_dir = os.path.join(out, 'gpu_logs')
  os.makedirs(log_dir, exist_ok=True)
  env = dict(os.environ)
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  sizes = [measure.parse_bytes(s) for s in args.sizes.split(',') if s]
  if args.dry_run:
    env['JAX_PLATFORMS'] = 'cpu'
    flags = [f for f in env.get('XLA_FLAGS', '').split()
             if not f.startswith('--xla_force_host_platform_device_count')]
    env['XLA_FLAGS'] = ' '.join(flags + ['--xla_force_host_platform_device_count=2'])
    if args.sizes == p.get_default('sizes'):
      sizes = [4 * MiB]
  if args.deadline is None:
    args.deadline = 900.0 if args.dry_run else 450.0
  budget = measure.parse_bytes(args.budget)
  restore_max = measure.parse_bytes(args.restore_max)
  stock_budgets = [measure.parse_bytes(b) for b in args.stock_budgets.split(',') if b]
  workroot = tempfile.mkdtemp(prefix='kd_gpu_check_')
  rows: list[dict[str, Any]] = []
  k = 0
  try:
    for nbytes in sizes:
      state_label = measure.fmt_bytes(nbytes) if nbytes % 10**9 else f'{nbytes // 10**9} GB'
      for v in all_variants(budget):
        k += 1
        left = args.deadline - (time.perf_counter() - t_start)
        spec = {**v, 'bytes': nbytes, 'state_label': state_label,
                'workdir': os.path.join(workroot, f'w{k}'),
                'restore': nbytes <= restore_max}
        if (nbytes <= restore_max and v == all_variants(budget)[0]
            and not v['variant'].startswith('kd_ckpt')):
          spec['stock_budgets'] = stock_budgets
        if left < 20:
          row = {'state': state_label, 'variant': label(v),
                 'budget_bytes': v.get('budget'), 'error': 'skipped: deadline'}
        else:
          row = run_one(spec, env, left, os.path.join(log_dir, f'row{k:02d}.log'))
        rows.append(row)
        print(f'[{time.perf_counter() - t_start:5.0f} s] {state_label} {row["variant"]}:'
              f' peak {measure.fmt_bytes(row.get("peak_extra_bytes"))},'
              f' {row.get("seconds") or 0:.2f} s {row.get("error", "")}', flush=True)
        write_outputs(out, rows, budget, restore_max, args.dry_run,
                      time.perf_counter() - t_start, final=False)
      left = args.deadline - (time.perf_counter() - t_start)
      rows.append(run_dd(state_label, nbytes, os.path.join(workroot, f'dd{k}'), left)
                  if left > 10 else {'state': state_label, 'variant': 'dd (disk ceiling)',
                                     'error': 'skipped: deadline'})
  finally:
    shutil.rmtree(workroot, ignore_errors=True)

  wall = time.perf_counter() - t_start
  md, violations = write_outputs(out, rows, budget, restore_max, args.dry_run, wall,
                                 final=True)
  print(md)
  return 1 if violations else 0


VERSIONED = ('jax', 'jaxlib', 'orbax-checkpoint', 'tensorstore', 'numpy', 'flax',
             'optax', 'google-crc32c', 'zstandard', 'psutil', 'kauldron')


def versions() -> dict[str, str]:
  """What this check runs with: the machine's packages, kd_ckpt from this tree.

  The GPU machine comes with its own jax/orbax and no Kauldron; kd_ckpt is
  imported from the checkout (PYTHONPATH), and adapts to what is missing
  (no google-crc32c: no checksums; no psutil: /proc).
  """
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  out = {'python': platform.python_version()}
  for name in VERSIONED:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = 'not installed'
  out['kd_ckpt'] = f'{REPO} (this tree)'
  return out


def write_outputs(out, rows, budget, restore_max, dry_run, wall, final):
  """Writes gpu_check.md/.json (also after every row, in case of a kill)."""
  rows = [dict(r) for r in rows]
  ref = {r['state']: r.get('seconds') for r in rows
         if r.get('variant') == 'orbax default, pinned on, replica-parallel on'
         and not r.get('error')}
  for r in rows:
    r['orbax_default_seconds'] = ref.get(r['state'])
  violations = measure.check_rows(rows)
  stock, stock_failures = stock_table(rows)
  violations += stock_failures
  backend = next((r.get('backend') for r in rows if r.get('backend')), '?')
  vers = versions()
  md = '\n'.join([
      '# kd_ckpt GPU check' + ('' if final else ' (PARTIAL: still running or killed)'),
      '',
      'Versions: ' + ', '.join(f'{k} {v}' for k, v in vers.items()),
      '',
      f'{platform.node()}; backend {backend}{" (DRY RUN)" if dry_run else ""};'
      f' kd_ckpt budget {measure.budget_label(budget)}; wall {wall:.0f} s.',
      'Peak extra RSS = host VmHWM during the save minus RSS before (the state'
      ' lives on the device, so restored arrays are not in host RAM: restore'
      ' extra is all overhead there). "x Orbax default" is against pinned on +'
      ' replica parallel on (what Orbax does on GPU unless JAX_PLATFORMS names'
      f' cuda/gpu). Restores of states over {restore_max / 1e9:g} GB'
      ' skipped for time.',
      '',
      measure.save_table(rows),
      '',
      'kd_ckpt restoring the checkpoint of the first Orbax row (stock Orbax\'s format:'
      ' one zstd chunk per shard), in that row\'s process after Orbax\'s own restore'
      ' and an untimed kd_ckpt restore of the warm-up checkpoint;'
      ' x Orbax\'s restore = these seconds / that restore\'s:',
      '',
      stock,
      '',
      ('**FAIL**\n\n' + '\n'.join(f'- {v}' for v in violations)) if violations
      else '**PASS**: kd_ckpt streaming within budget*1.10 + 32 MiB.',
      '',
  ])
  with open(os.path.join(out, 'gpu_check.md'), 'w') as f:
    f.write(md)
  with open(os.path.join(out, 'gpu_check.json'), 'w') as f:
    json.dump({'rows': rows, 'violations': violations, 'wall_seconds': wall,
               'dry_run': dry_run, 'final': final, 'versions': vers}, f, indent=1)
  return md, violations


if __name__ == '__main__':
  sys.exit(main())
