"""Save and restore speed against Orbax, as ratios measured in one run (issue 20).

This machine's disk is noisy (dd of the same bytes took 1.2 s to 12 s in
consecutive runs), so every figure that matters is a ratio against Orbax
(and dd) measured in the same run.  Every row (in the leaves part, every
leaf count, its variants' saves taking turns) runs in a fresh process
(`--worker JSON`, 8 CPU devices via XLA_FLAGS) that starts XLA's compiler
first (`kd_ckpt.startup.start_compiler()`), as a training process has.
States are `workloads.gen_leaf`'s hashed floats: their bytes do not compress,
so Orbax's zstd gets no unfair help.

Three parts (`--part stall,scale,leaves`, default all):

  stall   A training loop: a 512 MiB f32 state (`--stall-size`, 8 leaves
          sharded over the 8 devices with NamedSharding), a jitted step that
          donates the state, 12 steps (`--steps`), a save every 4 (`--every`).
          Variants: Orbax default (async `CheckpointManager`, `StandardSave`,
          keep 2), the same manager with `kd_ckpt.SafePyTreeHandler(
          host_ram_budget=256MiB, strategy='auto' | 'streaming')` and
          `kd_ckpt.SafeSave` (what a plain Orbax user swaps in), and
          `kd_ckpt.save(f'{dir}/{step}', strategy='streaming')` (blocks until
          durable).  Per variant: the seconds save() kept the loop waiting
          (state ready before the call, so no step time is in it; sum, first
          save, the largest), their ratio to Orbax default's, the final
          `wait_until_finished`, the loop's wall time (final wait included)
          beside the same steps without saves in the same process, the steps
          whose input JAX could not donate (while a save holds a host view of
          a buffer the step copies it instead; silently on CPU; any donation
          warnings go in the notes), and whether the last checkpoint restores
          to the state it was given (bit checksums).
  scale   Seconds per GB of one f32 leaf on one device at 128 MiB .. 4 GiB
          (`--scale-sizes`): `kd_ckpt.save(strategy='streaming' | 'auto',
          host_ram_budget=256MiB)` and `ocp.StandardCheckpointer().save` +
          `wait_until_finished`, the three in one process per size, their
          saves taking turns (each round in a rotated order), each round
          after a `dd if=/dev/zero bs=16M conv=fsync` of the same bytes (x dd =
          a variant's median save over dd's median); then each restores its
          own checkpoint (`kd_ckpt.restore` at the budget,
          `ocp.StandardCheckpointer().restore`), checked bit-exact, in
          rounds as well (the median).  At least one round per variant, so
          each takes every place in the order once.  Flatness: the largest
          s/GB over the smallest, per variant; and a line through the sizes
          (fixed s + s/GB, `line_fit`) with the size furthest off it: cost
          that grows linearly beside a save's fixed work.
  leaves  Per-leaf overhead: 10 .. 10,000 leaves of 4 KiB (`--leaf-counts`,
          `--leaf-bytes`) on one device, saved by kd_ckpt streaming, kd_ckpt
          auto (both at the budget) and Orbax default, each restored by its
          own library, the three in one process, their saves taking
          turns.  ms/leaf is the time over the leaves, and over the
          leaves beyond the first count ((t - t_first) / (n - n_first)).
          kd_ckpt refuses a budget below 24 MiB + 24 KiB per leaf (and a
          little more for a streaming plan) before writing anything: 10,000
          leaves need over 263 MiB.  Such a row runs at the smallest whole
          MiB `kd_ckpt.plan_save` accepts (found before the timed save), and
          says so.

scale and leaves rows do a tiny warm-up save + restore first, of each
variant in the process (one-time
imports and thread pools); stall rows do not (a loop's first save pays them).
Restores read files the save just wrote (page cache), for both libraries.

  make bench-speed    # = .venv/bin/python bench/speed.py --out bench/results/speed.md
  .venv/bin/python bench/speed.py --part scale --scale-sizes 1GiB,4GiB
  .venv/bin/python bench/speed.py --stall-size 8MiB --steps 4 --every 2 \\
      --scale-sizes 4MiB,8MiB --leaf-counts 10,100 --out /tmp/speed.md   # smoke

Time on 2 cores: the smoke line above took 33 s (most of it the 14
workers' start-up).  The full run took 273 s at 87733da with one save per
leaves row; three (`--leaf-saves`, the default since) add about as much
again as the leaves rows' saves took (~75 s), more when the disk is slow.
Exit 1 if a worker failed, a save
raised or a restore came back different (the tables are written either way,
the error in the row's notes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import measure  # pylint: disable=g-import-not-at-top,wrong-import-position

MiB = measure.MiB
GB = 1e9
DEVICES = 8
PARTS = ('stall', 'scale', 'leaves')
ORBAX = 'Orbax default'
STALL_VARIANTS = (ORBAX, 'kd_ckpt auto (manager)', 'kd_ckpt streaming (manager)',
                  'kd_ckpt.save streaming')
LEAF_VARIANTS = ('kd_ckpt streaming', 'kd_ckpt auto', ORBAX)
# A leaves row saves at least --leaf-saves times, and more (up to
# MAX_LEAF_SAVES) until its saves have taken LEAF_SAVE_SECS.
LEAF_SAVE_SECS = 2.0
MAX_LEAF_SAVES = 15
# A scale row (kd_ckpt's and Orbax's alike) saves on the same way, at most
# MAX_SCALE_SAVES times: a single 128 MiB save took 0.11-0.24 s on this VM,
# the spread in kernel (page cache) time, which made the flatness figure
# the noise of one sample (2026-12-04, thirteenth session).
MAX_SCALE_SAVES = 7
KEEP = 2
_FAILED: list[str] = []  # rows whose worker failed, raised or restored wrong: exit 1


# ==========================================================================
# Worker side (a fresh process per row).


def _jax():
  import jax  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  startup.start_compiler()
  return jax


def _dd_secs(path: str, nbytes: int) -> float:
  """`dd if=/dev/zero conv=fsync` of `nbytes` to `path` (removed after)."""
  if nbytes % (16 * MiB) == 0:
    bs, count = '16M', nbytes // (16 * MiB)
  else:
    bs, count = '1M', -(-nbytes // MiB)
  start = time.perf_counter()
  subprocess.run(['dd', 'if=/dev/zero', f'of={path}', f'bs={bs}', f'count={count}',
                  'conv=fsync'], check=True, capture_output=True)
  secs = time.perf_counter() - start
  os.remove(path)
  return secs


def _abstract(jax, tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


def _delete(jax, tree) -> None:
  for x in jax.tree.leaves(tree):
    x.delete()


def _error(e: BaseException) -> str:
  return f'{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ""}'


class _Saver:
  """One stall variant's save(step, state), finish() and where step's item is."""

  def __init__(self, variant: str, root: str, budget: str):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    import kd_ckpt  # pylint: disable=g-import-not-at-top
    self._ocp, self._kd = ocp, kd_ckpt
    self.variant, self.root, self.budget = variant, root, budget
    self._mngr = None
    self._steps: list[int] = []
    options = ocp.CheckpointManagerOptions(max_to_keep=KEEP, enable_async_checkpointing=True)
    if variant == ORBAX:
      self._mngr = ocp.CheckpointManager(root, options=options)
    elif variant.endswith('(manager)'):
      strategy = variant.split()[1]
      self._mngr = ocp.CheckpointManager(
          root, options=options,
          item_handlers=kd_ckpt.SafePyTreeHandler(host_ram_budget=budget, strategy=strategy))

  def save(self, step: int, state) -> None:
    if self.variant == ORBAX:
      self._mngr.save(step, args=self._ocp.args.StandardSave(state))
    elif self._mngr is not None:
      self._mngr.save(step, args=self._kd.SafeSave(state))
    else:
      self._kd.save(os.path.join(self.root, str(step)), state, strategy='streaming',
                    host_ram_budget=self.budget)
      self._steps.append(step)
      for old in self._steps[:-KEEP]:  # keep 2, as the managers do
        shutil.rmtree(os.path.join(self.root, str(old)))
      self._steps = self._steps[-KEEP:]

  def finish(self) -> None:
    if self._mngr is not None:
      self._mngr.wait_until_finished()

  def close(self) -> None:
    if self._mngr is not None:
      self._mngr.close()

  def item_dir(self, step: int) -> str:
    d = os.path.join(self.root, str(step))
    return os.path.join(d, 'default') if os.path.isdir(os.path.join(d, 'default')) else d


def _stall_worker(spec: dict) -> dict:
  """The training loop of one stall variant: steps alone, then with saves."""
  import warnings  # pylint: disable=g-import-not-at-top
  jax = _jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import workloads  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('d',))
  n = spec['leaves']
  rows = max(len(jax.devices()), spec['bytes'] // n // 4096 // len(jax.devices())
             * len(jax.devices()))
  sharding = NamedSharding(mesh, P('d', None))
  state = {f'w{i}': workloads.gen_leaf(jax, (rows, 1024), jnp.float32, sharding, i)
           for i in range(n)}
  step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.999 + 0.001, s), donate_argnums=0)
  bits = jax.jit(lambda s: jax.tree.map(
      lambda x: jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint32), dtype=jnp.uint32), s))
  state = jax.block_until_ready(step_fn(state))  # compiles both
  jax.block_until_ready(bits(state))
  out: dict[str, Any] = {'state_bytes': n * rows * 1024 * 4, 'leaf_shape': [rows, 1024]}
  steps, every = spec['steps'], spec['every']
  save_steps = [i for i in range(1, steps + 1) if i % every == 0]

  def loop(saver):
    nonlocal state
    blocked, sums, side_secs = [], None, 0.0
    start = time.perf_counter()
    for i in range(1, steps + 1):
      before = jax.tree.leaves(state)
      state = step_fn(state)  # donates the previous state: never read again
      # is_deleted() reads no data: False when JAX could not donate (on CPU it
      # then copies silently, e.g. while a save holds a host view of a buffer).
      if saver is not None and not all(x.is_deleted() for x in before):
        out['steps_not_donated'] += 1
      del before
      if i % every:
        continue
      jax.block_until_ready(state)
      if saver is None:
        continue
      if i == save_steps[-1]:  # what the last checkpoint must hold
        t = time.perf_counter()
        sums = {k: int(v) for k, v in bits(state).items()}
        side_secs += time.perf_counter() - t
      t = time.perf_counter()
      saver.save(i, state)
      blocked.append(time.perf_counter() - t)
    jax.block_until_ready(state)
    t = time.perf_counter()
    if saver is not None:
      saver.finish()
    wait = time.perf_counter() - t
    return blocked, wait, time.perf_counter() - start - side_secs, sums

  _, _, out['steps_only_secs'], _ = loop(None)
  saver = _Saver(spec['variant'], spec['dir'], spec['budget'])
  out['steps_not_donated'] = 0
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    try:
      blocked, out['final_wait_secs'], out['loop_secs'], sums = loop(saver)
      out['blocked_secs'] = blocked
    except Exception as e:  # pylint: disable=broad-except
      out['error'] = _error(e)
      sums = None
    finally:
      saver.close()
  donation = [str(w.message) for w in caught if 'donat' in str(w.message).lower()]
  out['donation_warnings'] = len(donation)
  if donation:
    out['donation_warning'] = donation[0][:300]
  if sums is not None:
    try:
      back = ocp.StandardCheckpointer().restore(saver.item_dir(save_steps[-1]),
                                                _abstract(jax, state))
      out['restored_ok'] = {k: int(v) for k, v in bits(back).items()} == sums
    except Exception as e:  # pylint: disable=broad-except
      out['restored_ok'] = False
      out['restore_error'] = _error(e)
  return out


def _accepted_budget(kd_ckpt, tree, strategy: str, budget: str) -> str | None:
  """None if kd_ckpt plans `tree` at `budget`; else the smallest whole MiB it accepts.

  Planning only (nothing is copied or written), before the timed save.
  Starts at `kd_ckpt.cost.min_budget_bytes` (what BudgetTooSmallError names)
  and steps up: the streaming plan can need a little more than that.
  """
  from kd_ckpt import cost  # pylint: disable=g-import-not-at-top
  try:
    kd_ckpt.plan_save(tree, host_ram_budget=budget, strategy=strategy)
    return None
  except kd_ckpt.BudgetTooSmallError:
    pass
  mib = -(-max(cost.min_budget_bytes(len(tree)), measure.parse_bytes(budget)) // MiB)
  for _ in range(64):
    try:
      kd_ckpt.plan_save(tree, host_ram_budget=f'{mib}MiB', strategy=strategy)
      return f'{mib}MiB'
    except kd_ckpt.BudgetTooSmallError:
      mib += max(1, mib // 32)
  raise kd_ckpt.BudgetTooSmallError(f'no budget up to {mib} MiB accepted for {len(tree)} leaves')


def _save_restore_worker(spec: dict) -> dict:
  """scale and leaves rows: save a generated state, restore it, check it bit-exact.

  `spec['variants']` (leaves rows): every variant in this one process, their
  saves alternating; returns {variant: row}.  Otherwise `spec['variant']`
  alone, and its row.
  """
  jax = _jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  import workloads  # pylint: disable=g-import-not-at-top

  variants = list(spec.get('variants') or [spec['variant']])
  root = spec['dir']
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if spec['part'] == 'scale':
    shapes = {'w': (spec['bytes'] // 4096, 1024)}
  else:
    shapes = {f'l{i:05d}': (spec['leaf_bytes'] // 4,) for i in range(spec['leaves'])}

  def make():
    return {k: workloads.gen_leaf(jax, s, jnp.float32, sharding, i)
            for i, (k, s) in enumerate(shapes.items())}

  def save(who, path, tree, budget_now):
    if who == ORBAX:
      with ocp.StandardCheckpointer() as c:
        c.save(path, tree)
        c.wait_until_finished()
    else:
      kd_ckpt.save(path, tree, strategy=who.split()[1], host_ram_budget=budget_now)

  def restore(who, path, target, budget_now):
    if who == ORBAX:
      with ocp.StandardCheckpointer() as c:
        return c.restore(path, target)
    return kd_ckpt.restore(path, target, host_ram_budget=budget_now)

  # Warm-up: Orbax's and kd_ckpt's one-time imports, thread pools, programs.
  tiny = {'w': workloads.gen_leaf(jax, (1024,), jnp.float32, sharding, 0)}
  for i, who in enumerate(variants):
    save(who, os.path.join(root, f'warm{i}'), tiny, spec['budget'])
    jax.block_until_ready(restore(who, os.path.join(root, f'warm{i}'),
                                  _abstract(jax, tiny), spec['budget']))

  outs: dict[str, dict[str, Any]] = {who: {} for who in variants}
  budgets = {who: spec['budget'] for who in variants}
  state = jax.block_until_ready(make())
  target = _abstract(jax, state)
  paths = {who: os.path.join(root, f'ckpt{i}') for i, who in enumerate(variants)}
  for who in variants:
    if who != ORBAX:
      raised = _accepted_budget(kd_ckpt, state, who.split()[1], spec['budget'])
      if raised:
        outs[who]['budget_used'] = budgets[who] = raised
  # Scale rows run `dd` of the same bytes at the start of every round, so
  # that the disk's minute-to-minute swings (dd of 128 MiB: 0.10 s in one
  # run, 0.27-0.41 s in another) land on dd and the saves alike.
  dd = spec['part'] == 'scale'
  dd_each: list[float] = []
  # Each variant saves `saves` times (the median is reported): one save of
  # tiny leaves takes ~0.03-15 s, where a single sample varies by ~10%.
  # Quick rows save on until LEAF_SAVE_SECS have passed (at most
  # MAX_LEAF_SAVES): three saves of 0.04 s told 1.12x from 0.94x apart no
  # better than a coin (2026-12-04).  Several variants take turns, each
  # round in a rotated order, so the disk's and the machine's drift land on
  # all of them alike: at 10 leaves a process a variant gave kd_ckpt
  # 1.08-1.17x Orbax's time, turns in one process 0.85-0.89x
  # (bench/results/ab_save_leaves.md).
  each = {who: [] for who in variants}
  saves = max(1, spec.get('saves', 1))
  cap = {'leaves': MAX_LEAF_SAVES, 'scale': MAX_SCALE_SAVES}.get(spec['part'], 1)
  rounds = 0
  while True:
    k = rounds % len(variants)
    if dd:
      dd_each.append(_dd_secs(os.path.join(root, 'dd.bin'), spec['bytes']))
    for who in variants[k:] + variants[:k]:
      dest = f'{paths[who]}.{len(each[who])}'
      start = time.perf_counter()
      save(who, dest, state, budgets[who])
      each[who].append(time.perf_counter() - start)
    rounds += 1
    # Scale rows: every variant saves in every place of the order once.
    least = max(saves, len(variants) if spec['part'] == 'scale' else 1)
    more = rounds < least or (max(map(sum, each.values())) < LEAF_SAVE_SECS and rounds < cap)
    for who in variants:
      dest = f'{paths[who]}.{rounds - 1}'
      if more:
        shutil.rmtree(dest)
      else:
        os.rename(dest, paths[who])
    if not more:
      break
  for who in variants:
    outs[who]['save_secs'] = _median(each[who])
    if len(each[who]) > 1:
      outs[who]['save_secs_each'] = each[who]
  if dd:
    for who in variants:
      outs[who]['dd_secs'] = _median(dd_each)
      outs[who]['dd_secs_each'] = dd_each
  _delete(jax, state)
  del state
  want = make()
  for who in variants:
    workloads.warm_page_cache(paths[who])  # kd_ckpt's save dropped its pages, Orbax's kept them
  # Scale rows restore in rounds too, each in a rotated order, at least one
  # round per variant so that each takes every place once: on this VM the
  # restore after Orbax's (3.7 GiB freed beyond a 4 GiB state) or the
  # process's first pays for fresh pages (one 4 GiB checkpoint of kd_ckpt's
  # restored in 9.4 s first, 5.6 s after Orbax's and 2.2-2.6 s otherwise).
  restore_each = {who: [] for who in variants}
  rounds = 0
  while True:
    k = rounds % len(variants)
    for who in variants[k:] + variants[:k]:
      out = outs[who]
      start = time.perf_counter()
      back = jax.block_until_ready(restore(who, paths[who], target, budgets[who]))
      restore_each[who].append(time.perf_counter() - start)
      ok = all(bool(jnp.array_equal(back[key], want[key])) for key in shapes)
      out['restored_ok'] = out.get('restored_ok', True) and ok
      if not ok:
        out['error'] = 'restored values differ from the saved ones'
      _delete(jax, back)
      del back
    rounds += 1
    if spec['part'] != 'scale' or (rounds >= len(variants) and (
        max(map(sum, restore_each.values())) >= LEAF_SAVE_SECS or rounds >= MAX_SCALE_SAVES)):
      break
  for who in variants:
    outs[who]['restore_secs'] = _median(restore_each[who])
    if len(restore_each[who]) > 1:
      outs[who]['restore_secs_each'] = restore_each[who]
  return outs if spec.get('variants') else outs[variants[0]]


def _worker(spec: dict) -> dict:
  os.makedirs(spec['dir'], exist_ok=True)
  if spec['part'] == 'stall':
    return _stall_worker(spec)
  return _save_restore_worker(spec)


# ==========================================================================
# Parent side: one subprocess per row, then the tables.


def _run(spec: dict, root: str) -> dict:
  """Runs one row in a fresh process; its folder is removed after."""
  spec = dict(spec, dir=tempfile.mkdtemp(dir=root, prefix=f'{spec["part"]}_'))
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={DEVICES}',
             PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  start = time.perf_counter()
  try:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), '--worker',
                           json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=1800, check=False)
  finally:
    shutil.rmtree(spec['dir'], ignore_errors=True)
  wall = time.perf_counter() - start
  if proc.returncode:
    tail = proc.stderr.strip().splitlines()[-1:] or ['(no output)']
    _FAILED.append(f'{spec["part"]} {spec["variant"]}')
    print(f'worker {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}',
          file=sys.stderr, flush=True)
    return {'error': f'worker exit {proc.returncode}: {tail[0][:300]}', 'worker_secs': wall}
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  result['worker_secs'] = wall
  if 'error' in result or result.get('restored_ok') is False:
    _FAILED.append(f'{spec["part"]} {spec["variant"]}: {result.get("error", "restore differs")}')
  return result


def _f(x: float | None, fmt: str = '.2f') -> str:
  return '-' if x is None or not math.isfinite(x) else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> str:
  return f'{a / b:.2f}x' if a is not None and b else '-'


def _stall_part(args, root: str) -> tuple[list[str], list[dict]]:
  budget = args.budget
  spec = dict(part='stall', bytes=measure.parse_bytes(args.stall_size),
              leaves=args.stall_leaves, steps=args.steps, every=args.every, budget=budget)
  results = []
  for variant in STALL_VARIANTS:
    r = _run(dict(spec, variant=variant), root)
    r['variant'] = variant
    results.append(r)
    print(f'stall {variant}: {json.dumps(r)}', flush=True)
  ref = results[0]
  ref_blocked = sum(ref['blocked_secs']) if 'blocked_secs' in ref else None
  state_bytes = next((r['state_bytes'] for r in results if 'state_bytes' in r),
                     spec['bytes'])
  lines = [
      '### Stall: seconds a training loop waits in save()', '',
      f'{measure.fmt_bytes(state_bytes)} f32 state, {args.stall_leaves} leaves sharded'
      f' over {DEVICES} CPU devices (NamedSharding); jitted step, state donated;'
      f' {args.steps} steps, a save every {args.every}; kd_ckpt at {budget}; keep {KEEP}.'
      ' "blocked": save() call to return, state ready before the call.'
      ' "loop": the whole loop with saves (final wait included) vs the same steps'
      ' without saves in the same process.', '',
      '| variant | saves | blocked s (sum) | first save s | max save s | x Orbax blocked |'
      ' final wait s | loop s | steps only s | x Orbax loop | steps not donated |'
      ' restored ok | notes |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  for r in results:
    blocked = r.get('blocked_secs')
    total = sum(blocked) if blocked else None
    notes = r.get('error') or r.get('restore_error') or ''
    if r.get('donation_warnings'):
      notes += (f'{"; " if notes else ""}{r["donation_warnings"]} donation warning(s):'
                f' {r["donation_warning"]}')
    not_donated = r.get('steps_not_donated')
    lines.append(
        f'| {r["variant"]} | {len(blocked) if blocked else "-"} | {_f(total)} |'
        f' {_f(blocked[0] if blocked else None)} | {_f(max(blocked) if blocked else None)} |'
        f' {_ratio(total, ref_blocked)} | {_f(r.get("final_wait_secs"))} |'
        f' {_f(r.get("loop_secs"))} | {_f(r.get("steps_only_secs"))} |'
        f' {_ratio(r.get("loop_secs"), ref.get("loop_secs"))} |'
        f' {"-" if not_donated is None else f"{not_donated}/{args.steps}"} |'
        f' {r.get("restored_ok", "-")} |'
        f' {notes.replace("|", "/")} |')
  return lines, results


def _median(secs) -> float:
  """The median of the times a row reports; of an even count, the upper of
  the middle two (a time that was measured, as the results so far give)."""
  return sorted(secs)[len(secs) // 2]


def _each_note(each, unit: str = 'saves') -> str:
  """The saves (runs) a median came from: each (up to 5) or their count and range."""
  if 1 < len(each) <= 5:
    return ' / '.join(f'{t:.2f}' for t in each)
  if len(each) > 5:
    return f'{len(each)} {unit}, {min(each):.3f}-{max(each):.3f}'
  return ''


SCALE_VARIANTS = ('kd_ckpt streaming', 'kd_ckpt auto', ORBAX)


def _scale_part(args, root: str) -> tuple[list[str], list[dict]]:
  budget = args.budget
  rows, results = [], []
  # s/GB per size, for the flatness line: each variant's, dd's and Orbax's;
  # (GB, s) per size for the fit line.
  per_gb: dict[str, list[float]] = {}
  points: dict[str, list[tuple[float, float]]] = {}
  kds = [v for v in SCALE_VARIANTS if v != ORBAX]
  for size in args.scale_sizes.split(','):
    nbytes = measure.parse_bytes(size) // 4096 * 4096
    # The variants of a size share one process, their saves taking turns
    # after a dd of the same bytes each round (`_save_restore_worker`).
    got = _run(dict(part='scale', bytes=nbytes, budget=budget, variant='all',
                    variants=list(SCALE_VARIANTS)), root)
    by = {}
    for variant in SCALE_VARIANTS:
      r = got.get(variant, got)  # the worker's failure, for each of them
      if r is not got and ('error' in r or r.get('restored_ok') is False):
        _FAILED.append(f'scale {size} {variant}: {r.get("error", "restore differs")}')
      by[variant] = r
    results.append({'bytes': nbytes, **by})
    print(f'scale {size}: {json.dumps(results[-1])}', flush=True)
    ob = by[ORBAX]
    dd = next((r['dd_secs'] for r in by.values() if 'dd_secs' in r), None)
    for who, secs in [(v, by[v].get('save_secs')) for v in SCALE_VARIANTS] + [('dd', dd)]:
      if secs:
        per_gb.setdefault(who, []).append(secs / (nbytes / GB))
        points.setdefault(who, []).append((nbytes / GB, secs))
    dd_each = next((r['dd_secs_each'] for r in by.values() if 'dd_secs_each' in r), ())
    notes = '; '.join(
        [f'{w}: {n}' for w, r in [(v.replace('kd_ckpt ', ''), by[v]) for v in SCALE_VARIANTS]
         for n in (_each_note(r.get('save_secs_each', ())), r.get('error')) if n]
        + ([f'dd: {_each_note(dd_each, "runs")}'] if _each_note(dd_each) else []))

    def cells(key, *, vs_dd=False):
      out = []
      for v in kds:
        t = by[v].get(key)
        out.append(f'{_f(t)} ({_ratio(dd, t) if vs_dd else _ratio(t, ob.get(key))})')
      return ' | '.join(out)

    rows.append(
        f'| {measure.fmt_bytes(nbytes)} | {_f(dd)} | {_f(ob.get("save_secs"))} |'
        f' {cells("save_secs", vs_dd=True)} |'
        f' {" | ".join(_ratio(by[v].get("save_secs"), ob.get("save_secs")) for v in kds)} |'
        f' {" | ".join(_f(by[v]["save_secs"] / (nbytes / GB)) if by[v].get("save_secs") else "-" for v in kds)} |'
        f' {_f(ob.get("restore_secs"))} | {cells("restore_secs")} | {notes} |')
  flats = []
  for who, v in per_gb.items():
    if len(v) > 1:
      flats.append(f'{who}: {_f(max(v) / min(v))} ({_f(min(v))} .. {_f(max(v))} s/GB)')
  fits = [f'{who}: {line_fit(v)}' for who, v in points.items() if len(v) > 2]
  kd_names = [v.replace('kd_ckpt ', '') for v in kds]
  lines = [
      '### Scaling: one f32 leaf on one device', '',
      f'kd_ckpt: `kd_ckpt.save(strategy=..., host_ram_budget="{budget}")`,'
      f' then `kd_ckpt.restore` at {budget}; Orbax: `ocp.StandardCheckpointer()`'
      ' save + `wait_until_finished`, then its restore; each restores its own checkpoint,'
      ' checked bit-exact.  The variants of a size run in one fresh process, their'
      ' saves taking turns (each round in a rotated order, at least one round per'
      ' variant), every round after'
      ' `dd if=/dev/zero bs=16M conv=fsync` of the same bytes.  save s: the median of'
      f' the rounds, run until one variant\'s saves took {LEAF_SAVE_SECS:g} s (at most'
      f' {MAX_SCALE_SAVES}; the notes give each, or their count and range); x dd:'
      ' throughput, dd\'s median time over the save\'s.  restore s: the median of'
      ' rounds of restores taken the same way.  GB = 1e9 bytes.', '',
      '| size | dd s | Orbax save s | '
      + ' | '.join(f'{k} save s (x dd)' for k in kd_names) + ' | '
      + ' | '.join(f'{k} x Orbax' for k in kd_names) + ' | '
      + ' | '.join(f'{k} s/GB' for k in kd_names)
      + ' | Orbax restore s | ' + ' | '.join(f'{k} restore s (x Orbax)' for k in kd_names)
      + ' | notes |',
      '| --- ' * (5 + 4 * len(kds)) + '|',
      *rows, '',
      'Flatness (max s/GB over min s/GB across sizes): ' + '; '.join(flats)]
  if fits:
    lines += ['', 'Linear fit (least squares over the sizes, seconds = fixed + GB x s/GB;'
              ' off: the size whose median save is furthest from the fit, by how much of'
              ' it): ' + '; '.join(fits)]
  return lines, results


def line_fit(points: list[tuple[float, float]]) -> str:
  """'0.05 s + 0.92 s/GB, off <= 12% (128 MiB)' for (GB, seconds) points.

  Whether cost grows linearly (issue 20, item 5) apart from a save's fixed
  work: seconds per GB alone are not flat when a fixed 0.05 s sits on a
  0.13 s save.  Least squares on relative error (weights 1/s^2), so a 4 GiB
  row's noise of a second does not swamp a 128 MiB row of 0.15 s.
  """
  w = [1 / (y * y) for _, y in points]
  sw = sum(w)
  mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
  my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
  sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
  slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points)) / sxx
  fixed = my - slope * mx
  worst = max(points, key=lambda p: abs(p[1] - (fixed + slope * p[0])) / p[1])
  off = abs(worst[1] - (fixed + slope * worst[0])) / worst[1]
  return (f'{_f(fixed)} s + {_f(slope)} s/GB, off <= {off:.0%}'
          f' ({measure.fmt_bytes(round(worst[0] * GB))})')


def _leaves_part(args, root: str) -> tuple[list[str], list[dict]]:
  budget = args.budget
  leaf_bytes = measure.parse_bytes(args.leaf_bytes) // 4 * 4
  counts = [int(c) for c in args.leaf_counts.split(',')]
  table: dict[tuple[int, str], dict] = {}
  for n in counts:
    # The variants of a count share one process, their saves alternating
    # (`_save_restore_worker`).
    got = _run(dict(part='leaves', leaves=n, leaf_bytes=leaf_bytes, budget=budget,
                    variant='all', variants=list(LEAF_VARIANTS), saves=args.leaf_saves), root)
    for variant in LEAF_VARIANTS:
      r = got.get(variant, got)  # the worker's failure, for each of them
      if r is not got and ('error' in r or r.get('restored_ok') is False):
        _FAILED.append(f'leaves {n} {variant}: {r.get("error", "restore differs")}')
      table[n, variant] = r
      print(f'leaves {n} {variant}: {json.dumps(r)}', flush=True)

  def per_leaf(n, variant, key, over_first):
    t = table[n, variant].get(key)
    if t is None:
      return None
    if not over_first:
      return 1e3 * t / n
    t0 = table[counts[0], variant].get(key)
    return 1e3 * (t - t0) / (n - counts[0]) if n != counts[0] and t0 is not None else None

  rows = []
  for n in counts:
    ob = table[n, ORBAX]
    for variant in LEAF_VARIANTS:
      r = table[n, variant]
      notes = '; '.join(n for n in (_each_note(r.get('save_secs_each', ())),
                                    r.get('error', '')) if n)
      if 'budget_used' in r:
        notes = (f'refused at {budget}; ran at {r["budget_used"]}, the smallest whole MiB'
                 ' kd_ckpt plans' + (f'; {notes}' if notes else ''))
      label = variant if variant == ORBAX else f'{variant} @{r.get("budget_used", budget)}'
      rows.append(
          f'| {n:,} | {label} | {_f(r.get("save_secs"))} |'
          f' {_f(per_leaf(n, variant, "save_secs", False), ".3f")} |'
          f' {_f(per_leaf(n, variant, "save_secs", True), ".3f")} |'
          f' {_ratio(r.get("save_secs"), ob.get("save_secs"))} |'
          f' {_f(r.get("restore_secs"))} |'
          f' {_f(per_leaf(n, variant, "restore_secs", True), ".3f")} |'
          f' {_ratio(r.get("restore_secs"), ob.get("restore_secs"))} | {notes} |')
  lines = [
      f'### Per-leaf overhead: leaves of {measure.fmt_bytes(leaf_bytes)} f32 on one device',
      '',
      f'kd_ckpt `save(strategy=...)` and `restore` at {budget}; Orbax:'
      ' `ocp.StandardCheckpointer()` save + `wait_until_finished`, then its restore.'
      ' The three variants of a leaf count run in one fresh process, their saves taking'
      ' turns (each round in a rotated order).'
      f' save s: the median of at least {args.leaf_saves} saves,'
      f' more until one variant\'s took {LEAF_SAVE_SECS:g} s (at most {MAX_LEAF_SAVES};'
      ' the notes give each, or their count and range); restore: one, of the last save.'
      ' ms/leaf: t / n; "over first": (t - t at'
      f' {counts[0]:,} leaves) / (n - {counts[0]:,}), the marginal cost of a leaf.', '',
      '| leaves | variant | save s | save ms/leaf | save ms/leaf over first | x Orbax save |'
      ' restore s | restore ms/leaf over first | x Orbax restore | notes |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |', *rows]
  return lines, [{'leaves': n, 'variant': v, **r} for (n, v), r in table.items()]


def _git_commit() -> str:
  try:
    return subprocess.run(['git', 'describe', '--always', '--dirty'], cwd=REPO,
                          capture_output=True, text=True, timeout=10,
                          check=False).stdout.strip() or '?'
  except OSError:
    return '?'


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--part', default=','.join(PARTS), help='comma list of stall, scale, leaves')
  p.add_argument('--out', default='', help='also write the markdown tables to this file')
  p.add_argument('--dir', default=None, help='where checkpoints go (default: a temp dir)')
  p.add_argument('--budget', default='256MiB', help="kd_ckpt's host_ram_budget in every part")
  p.add_argument('--stall-size', default='512MiB')
  p.add_argument('--stall-leaves', type=int, default=8)
  p.add_argument('--steps', type=int, default=12)
  p.add_argument('--every', type=int, default=4, help='a save every this many steps')
  p.add_argument('--scale-sizes', default='128MiB,512MiB,1GiB,2GiB,4GiB')
  p.add_argument('--leaf-counts', default='10,100,1000,10000')
  p.add_argument('--leaf-saves', type=int, default=3,
                 help='saves per leaves row at least (quick rows save on, see'
                 ' LEAF_SAVE_SECS), in one process; the median is reported')
  p.add_argument('--leaf-bytes', default='4KiB')
  p.add_argument('--worker', default='', help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.leaf_saves < 1:
    p.error(f'--leaf-saves {args.leaf_saves}: needs to be at least 1')
  if args.worker:
    print(json.dumps(_worker(json.loads(args.worker))))
    return 0

  parts = [x.strip() for x in args.part.split(',') if x.strip()]
  unknown = set(parts) - set(PARTS)
  if unknown:
    p.error(f'unknown --part {sorted(unknown)}; choose from {",".join(PARTS)}')
  if args.steps < args.every:
    p.error('--steps must be >= --every (no save would run)')
  import workloads  # pylint: disable=g-import-not-at-top
  thp = workloads.disable_thp()  # before any worker starts: they inherit it
  load_start, start = os.getloadavg(), time.perf_counter()
  sections = []
  root = workloads.make_work_dir(args.dir, 'kd_speed_')
  try:
    for part in PARTS:
      if part in parts:
        lines, _ = {'stall': _stall_part, 'scale': _scale_part,
                          'leaves': _leaves_part}[part](args, root)
        sections.append('\n'.join(lines))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  wall = time.perf_counter() - start
  load_end = os.getloadavg()
  header = (f'## Speed against Orbax (`python bench/speed.py'
            f'{" " + " ".join(argv if argv is not None else sys.argv[1:])}`)\n\n'
            f'kd_ckpt {_git_commit()}, {os.cpu_count()} cores; wall {wall:.0f} s; load average'
            f' {load_start[0]:.2f} at start, {load_end[0]:.2f} at end.  Every row ran in its'
            f' own process (the leaves part: every leaf count, its variants taking turns);'
            f' ratios compare rows of this run only; {thp}.')
  text = '\n\n'.join([header, *sections]) + '\n'
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
      f.write(text)
  print(text)
  if _FAILED:
    print(f'{len(_FAILED)} row(s) failed:\n  ' + '\n  '.join(_FAILED), file=sys.stderr)
  return 1 if _FAILED else 0


if __name__ == '__main__':
  sys.exit(main())
