"""The budget is a limit, not a forecast (issue 11).

Every save and restore, measured in a fresh process on states whose shapes
the cost constants were never fitted on (prime extents, a replicated prime
leaf, a 2-D mesh, 2,000 small leaves, mixed dtypes), stays at or under its
budget: peak extra RSS (VmHWM during the whole save, async commit included,
minus RSS just before it) <= budget + 8 MiB of measurement tolerance.
Restores: the peak beyond the restored arrays, likewise.
"""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kd_ckpt
from kd_ckpt import cost
from kd_ckpt import estimate as estimate_lib
from kd_ckpt import hostmem
from kd_ckpt import plan as plan_lib
from tests import states

MiB = states.MiB
TOLERANCE = 8 * MiB
STATE_BYTES = 256 * MiB


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """saved(state, saved_by) -> a checkpoint of `state`, written once per
  module: the restore rows of each device path read the same one."""
  done = {}

  def get(state: str, saved_by: str) -> str:
    if (state, saved_by) not in done:
      d = str(tmp_path_factory.mktemp('saved') / 'c')
      if saved_by == 'stock':
        # Orbax stores one chunk per shard: a 255 MiB chunk, 5x the budget.
        states.run_worker('stock', d, state, str(STATE_BYTES))
      else:
        states.run_worker('save', d, state, str(STATE_BYTES), saved_by, str(256 * MiB))
      done[state, saved_by] = d
    return done[state, saved_by]

  return get


def _check(r, budget, what):
  peak = r['peak_extra_bytes']
  print(f'{what}: peak {peak / MiB:.1f} MiB of {budget / MiB:.0f} MiB'
        f' ({peak / budget:.2f}), {r.get("strategy", "")} {r.get("settings", "")}')
  assert peak <= budget + TOLERANCE, (what, r)


def _restore_holds(d, state, total, budget, env, what):
  """Restores `state` from `d` in a fresh process; its peak beyond the
  restored arrays must stay within `budget` (plus the suite's tolerance)."""
  r = states.run_worker('restore', d, state, total, str(budget), env=env)
  beyond = r['peak_extra_bytes'] - r['restored_bytes']
  print(f'{what}: {beyond / MiB:.1f} MiB beyond {r["restored_bytes"] / MiB:.0f} MiB')
  assert beyond <= budget + TOLERANCE, r


@pytest.mark.parametrize('strategy,budget', [('auto', 128 * MiB), ('streaming', 96 * MiB)])
def test_chunks_with_an_extent_of_one_are_charged_as_copied(tmp_path, strategy, budget):
  """TensorStore copies a chunk with a dim of 1 (a 1x1 conv kernel, one row a
  device) instead of referencing the host buffer: `auto` at 128 MiB chose
  Orbax's async save for this 256 MiB state, predicted zero-copy on CPU,
  and peaked at 216 MiB (1.69x).  The streaming writer held its budget
  through its RSS ceiling (73 MiB at 96), charged as referenced."""
  r = states.run_worker('save', str(tmp_path / 'c'), 'unit_dims', str(STATE_BYTES), strategy,
                        str(budget))
  _check(r, budget, f'save unit_dims {strategy}')
  est = estimate_lib.estimate_tree(states.make_state('unit_dims', 4 * MiB))
  assert all(l.unit_dim_chunks for l in est.leaves)


def test_slices_cut_on_the_devices_keep_few_programs(tmp_path):
  """The streaming writer cuts slices of packed leaves (int4, float4) on
  their devices on the CPU backend, as of every leaf on an accelerator.
  jnp's indexing compiled a program per shard shape, part shape and device,
  and XLA kept all of them: 120 int4 leaves of as many shapes saved at 48
  MiB peaked at 89.8 MiB, and this state (36 leaves, 240 programs) at 69.3
  MiB.  The writer keeps only those its budget has room for
  (`streaming._DevicePrograms`): 35.1 MiB."""
  budget = 48 * MiB
  r = states.run_worker('save', str(tmp_path / 'c'), 'packed_shapes', str(160 * MiB),
                        'streaming', str(budget))
  _check(r, budget, 'save packed_shapes')
  back = kd_ckpt.restore(str(tmp_path / 'c'))
  want = states.make_state('packed_shapes', 160 * MiB)
  for k, v in want.items():
    assert np.asarray(back[k]).tobytes() == np.asarray(v).tobytes(), k


def test_a_drawn_state_restored_onto_other_layouts_beside_its_programs(tmp_path):
  """`tools/fuzz_budget.py` seed 159: a state of 8 drawn leaves restored onto
  other layouts on devices that copy, at 38 MiB.  The 8 programs that fill
  its big shards in place are held for the whole read, and a bf16 leaf
  read by shard asked for 6.5 MiB where they left less: it waited on
  bytes nobody would release (a stall; 300 s in a library run)."""
  d = str(tmp_path / 'c')
  total = '186097443'
  states.run_worker('save', d, 'drawn:159', total, 'streaming', str(101423010))
  env = {**states.COPYING_DEVICES, 'KD_TEST_RESHARD': '159', 'KD_TEST_STALL_SECS': '20',
         'KD_TEST_WARM': '1'}  # no start-up paid inside: the same room every run
  _restore_holds(d, 'drawn:159', total, 38 * MiB, env, 'resharded restore')


def test_a_replicated_float8_leaf_filled_in_place_holds_the_budget(tmp_path):
  """`tools/fuzz_budget.py --gcs` seed 3034: a (359, 58, 1999) float8_e4m3fn
  leaf over a 4x2 mesh, P(None, 'b') (two shards of 20.8 MB, four replicas
  each), saved by Orbax's writer (a chunk a shard), restored on devices that
  copy at 54 MiB: its shards are filled in place.  XLA:CPU's SPMD update of
  a replicated float8 buffer held temporaries of most of the devices' bytes:
  172 MiB beyond the restored arrays, and 3 minutes (`reading._placement`)."""
  d, total = str(tmp_path / 'c'), '46400434'
  states.run_worker('save', d, 'drawn:3034', total, 'orbax', str(512 * MiB))
  env = {**states.COPYING_DEVICES, 'KD_TEST_STALL_SECS': '20'}
  _restore_holds(d, 'drawn:3034', total, 54 * MiB, env, 'float8 restore')


def test_a_cold_save_of_many_small_packed_leaves_holds_the_budget(tmp_path):
  """`tools/fuzz_budget.py --gcs` seed 8042: 162 leaves (10.3 MiB), 28 of
  them int4/float4 of as many shard shapes, each copied whole on its device
  before its transfer (`streaming.to_host`).  `jnp.array(copy=True)`
  compiled a program per shape, which XLA keeps: the streaming save at the
  58 MiB its refusal named peaked at 62.3-63.0 MiB (67 MiB on a bucket).
  The runtime's copy compiles nothing: 29.7 MiB.  Asserted without the
  suite's tolerance, since the overshoot was under it locally."""
  d, total, budget = str(tmp_path / 'c'), '10780289', 58 * MiB
  r = states.run_worker('save', d, 'drawn:8042', total, 'streaming', str(budget))
  print(f'packed leaves save: {r["peak_extra_bytes"] / MiB:.1f} MiB at {budget / MiB:.0f} MiB')
  assert r['peak_extra_bytes'] <= budget, r


@pytest.mark.parametrize('env', [{}, states.COPYING_DEVICES], ids=['shared', 'copying'])
def test_a_restore_refused_below_its_floor_names_a_budget_it_accepts(tmp_path, env):
  """Below its floor a restore was refused naming the floor, and in the next
  process refused again at it, naming a few MiB more: its programs (placing
  its pieces on their devices) did not fit there.  `tools/fuzz_budget.py`'s
  seed 0, saved by stock Orbax, restored at 16 MiB by a process that has
  compiled before: the floor, 28 MiB, was refused again (32 MiB is named
  now; 47 then 53 MiB in a process that pays the compiler's start-up).  The
  first refusal now prices the programs too."""
  import re  # pylint: disable=g-import-not-at-top
  d, total = str(tmp_path / 'c'), '21583158'
  states.run_worker('stock', d, 'drawn:0', total)
  env = {**env, 'KD_TEST_WARM': '1'}  # the same start-up (none) in both processes
  with pytest.raises(AssertionError, match='BudgetTooSmallError') as refused:
    states.run_worker('restore', d, 'drawn:0', total, str(16 * MiB), env=env)
  named = re.search(r"Raise host_ram_budget to '(\d+)MiB' or more", str(refused.value))
  assert named, str(refused.value)[-1500:]
  budget = int(named.group(1)) * MiB
  r = states.run_worker('restore', d, 'drawn:0', total, str(budget), env=env)
  beyond = r['peak_extra_bytes'] - r['restored_bytes']
  print(f'named {budget / MiB:.0f} MiB: {beyond / MiB:.1f} MiB beyond the restored arrays')
  assert beyond <= budget + TOLERANCE, r


@pytest.mark.slow
@pytest.mark.parametrize('state', states.UNSEEN)
@pytest.mark.parametrize('strategy,budget', [
    ('streaming', 64 * MiB), ('streaming', 160 * MiB), ('auto', 64 * MiB)])
def test_save_holds_the_budget_on_unseen_shapes(tmp_path, state, strategy, budget):
  if state == 'many_small':
    budget += 32 * MiB  # 2,000 leaves' bookkeeping is 47 MiB (cost.PER_LEAF_BYTES)
  r = states.run_worker('save', str(tmp_path / 'c'), state, str(STATE_BYTES), strategy,
                        str(budget))
  _check(r, budget, f'save {state} {strategy}')
  assert r['budget_bytes'] == budget


@pytest.mark.slow
def test_zero_leaves_are_stored_compressed_inside_the_budget(tmp_path):
  """zstd's encoder on zero leaves, written from zero pages without a copy,
  stays inside the budget; the checkpoint is a fraction of the state."""
  d, budget = str(tmp_path / 'c'), 64 * MiB
  r = states.run_worker('save', d, 'zeros', str(STATE_BYTES), 'streaming', str(budget))
  _check(r, budget, 'save zeros streaming')
  stored = states.stored_bytes(d)
  # Raw, the files would be the state's size; half its bytes are zeros.
  print(f'zeros: {stored / MiB:.1f} MiB stored of {r["bytes_written"] / MiB:.1f} MiB')
  assert stored < 0.7 * r['bytes_written'], (stored, r['bytes_written'])
  r = states.run_worker('restore', d, 'zeros', str(STATE_BYTES), str(48 * MiB))  # bit-exact
  assert r['peak_extra_bytes'] - r['restored_bytes'] <= 48 * MiB + TOLERANCE, r


@pytest.mark.slow
@pytest.mark.parametrize('state_mib', [120, 152, 190, 224])
def test_save_charges_edge_chunks_as_stored_whole(tmp_path, state_mib):
  """A slice that fills part of a chunk (the array's edge cuts it) makes
  TensorStore hold the whole chunk.  Charged as the slice alone, a leaf
  whose row bands each end in a thin edge chunk peaked at 287 MiB (1.12x)
  at 190 MiB of state and 0.98-0.99x at the other sizes: at 256 MiB the
  slices are big (36 MiB), and so are the edge chunks.  (Chunks along a
  whole dim are evened out since, `slicing.chunk_shape`: the edge chunks
  are 15810 of 15811 columns.)"""
  budget = 256 * MiB
  r = states.run_worker('save', str(tmp_path / 'c'), 'edge_chunks', str(state_mib * MiB),
                        'streaming', str(budget))
  _check(r, budget, f'save edge_chunks ({state_mib} MiB) streaming')


@pytest.mark.slow
@pytest.mark.parametrize('state', ['prime_rep', 'mixed_dtypes'])
def test_async_safe_checkpointer_report_covers_the_whole_save(tmp_path, state):
  """Orbax's async save is chosen only when its worst case fits, and measured to the commit."""
  budget = 512 * MiB
  r = states.run_worker('ckpt', str(tmp_path / 'w'), state, str(STATE_BYTES), 'auto',
                        str(budget))
  _check(r, budget, f'SafeCheckpointer {state}')
  assert r['whole_save_peak_extra_bytes'] <= budget + TOLERANCE, r
  if r['strategy'] == 'orbax':
    assert r['async_commit']
    # The report's peak is the peak until the commit: not a blocking-part figure.
    assert r['peak_extra_bytes'] >= 0.8 * r['whole_save_peak_extra_bytes'] - TOLERANCE, r


def _check_restore(d, state, saved_by, budget, devices, via='api'):
  """Restores checkpoint `d` of `state` in a fresh process: its peak beyond
  the restored arrays is within the budget."""
  r = states.run_worker('restore', d, state, str(STATE_BYTES), str(budget), via,
                        env=states.COPYING_DEVICES if devices == 'copying' else None)
  beyond = r['peak_extra_bytes'] - r['restored_bytes']
  print(f'restore {state} ({saved_by}, {devices}, {via}) at {budget / MiB:.0f} MiB:'
        f' {beyond / MiB:.1f} MiB beyond {r["restored_bytes"] / MiB:.0f} MiB restored')
  assert beyond <= budget + TOLERANCE, r


@pytest.mark.slow
@pytest.mark.parametrize('state,saved_by,devices', [
    ('many_small', 'streaming', 'cpu'), ('many_small', 'stock', 'copying'),
    ('mesh2d_prime', 'auto', 'cpu'), ('mixed_dtypes', 'stock', 'cpu')])
def test_restore_without_a_target_holds_the_budget(saved, state, saved_by, devices):
  """Without a target every leaf is opened for its metadata first, and what
  was opened is kept for the read (`reading.keep_opened`): held through it."""
  _check_restore(saved(state, saved_by), state, saved_by,
                 96 * MiB if state == 'many_small' else 48 * MiB, devices, via='none')


@pytest.mark.slow
@pytest.mark.parametrize('state,saved_by,devices', [
    ('prime', 'streaming', 'cpu'), ('prime', 'streaming', 'copying'),
    ('mesh2d_prime', 'auto', 'cpu'), ('mesh2d_prime', 'auto', 'copying'),
    ('many_small', 'streaming', 'cpu'),
    ('prime_rep', 'stock', 'cpu'), ('prime_rep', 'stock', 'copying'),
    ('many_medium', 'streaming', 'cpu'), ('many_medium', 'stock', 'cpu'),
    ('fsdp_dp', 'stock', 'copying'),
    ('quantized', 'stock', 'cpu'), ('quantized', 'streaming', 'cpu'),
    ('quantized', 'stock', 'copying')])
def test_restore_holds_the_budget(saved, state, saved_by, devices):
  """`devices='copying'`: as on GPUs, which copy the host shards they are
  given (big shards are then filled in place); 'cpu' keeps them."""
  # 2,000 leaves' bookkeeping alone is 47 MiB (cost.PER_LEAF_BYTES).  The
  # quantized state at 160 MiB: below it its 64 MiB int4 shard is filled on
  # its device piece by piece, and XLA:CPU rewrites a whole int4 buffer for
  # each update (~50 ms a piece; 0.5 s for a sharded leaf's): at 64 MiB the
  # restore took 21 s, 124 s before float4/float8 were updated as bits
  # (README, "Limits").  On devices that copy its float8 leaf (8 replicas)
  # is filled a shard at a time (`reading._placement`).
  budget = {'many_small': 96 * MiB, 'quantized': 160 * MiB}.get(state, 48 * MiB)
  _check_restore(saved(state, saved_by), state, saved_by, budget, devices)


@pytest.mark.slow
@pytest.mark.parametrize('state,budget,devices', [
    ('prime', 96 * MiB, 'copying'), ('prime', 128 * MiB, 'copying'),
    ('mesh2d_prime', 128 * MiB, 'copying'), ('prime', 512 * MiB, 'copying'),
    ('mesh2d_prime', 512 * MiB, 'copying'),
    ('prime', 96 * MiB, 'cpu'), ('mesh2d_prime', 128 * MiB, 'cpu')])
def test_parallel_reads_of_stock_shards_hold_the_budget(saved, state, budget, devices):
  """Shards bigger than a piece are read by several lanes at once (`readahead`).

  Stock Orbax stores one zstd chunk per shard (8 of ~32 MiB here).  On
  devices that copy the host shard (as GPUs do: `devices='copying'`), at
  96-128 MiB each is filled in place, its pieces decoded in worker threads
  while the consumer places the last ones; at 512 MiB shards are read whole
  (`reading._fill_by_shard`).  On the CPU backend, whose devices keep the
  host shard, shards are read whole at every budget.  Every read's buffers
  are admitted before they exist.
  """
  _check_restore(saved(state, 'stock'), state, 'stock', budget, devices)


@pytest.mark.slow
@pytest.mark.parametrize('state,saved_by,budget,devices', [
    ('mixed_dtypes', 'stock', 256 * MiB, 'copying'), ('mixed_dtypes', 'stock', 512 * MiB, 'cpu'),
    ('zeros', 'stock', 256 * MiB, 'cpu'), ('zeros', 'streaming', 384 * MiB, 'copying'),
    ('prime_rep', 'stock', 512 * MiB, 'copying'), ('mixed_dtypes', 'stock', 128 * MiB, 'copying'),
    ('zeros', 'stock', 96 * MiB, 'copying'), ('many_medium', 'stock', 96 * MiB, 'cpu'),
    ('fsdp_dp', 'stock', 256 * MiB, 'copying')])
def test_leaves_read_side_by_side_hold_the_budget(saved, state, saved_by, budget, devices):
  """From a local disk, leaves bigger than a piece are read several at once,
  each in its own part of the budget (`reading._fill_in_parts`, parts of at
  least 32 MiB): together they stay inside it."""
  _check_restore(saved(state, saved_by), state, saved_by, budget, devices)


@pytest.mark.slow
def test_safe_checkpointer_restore_holds_the_budget(tmp_path):
  """Kauldron's resume and eval path reads inside the budget too."""
  budget = 48 * MiB
  d = str(tmp_path / 'w')
  states.run_worker('ckpt', d, 'mixed_dtypes', str(STATE_BYTES), 'orbax', str(1 << 30))
  r = states.run_worker('restore', d, 'mixed_dtypes', str(STATE_BYTES), str(budget), 'ckpt')
  beyond = r['peak_extra_bytes'] - r['restored_bytes']
  print(f'SafeCheckpointer.restore: {beyond / MiB:.1f} MiB beyond the restored arrays')
  assert beyond <= budget + TOLERANCE, r


@pytest.mark.slow
def test_first_jit_of_the_process_is_paid_inside_the_budget(tmp_path):
  """A save or restore that is a fresh process's first jit pays XLA's start-up
  (~54 MiB) inside its budget, or refuses before anything is read or written."""
  d = str(tmp_path / 'c')
  total = 64 * MiB
  budget = 128 * MiB
  r = states.run_worker('cold_save', d, '-', str(total), 'streaming', str(budget))
  assert r['compiled'] and 'error' not in r, r
  assert r['startup_bytes'] > 16 * MiB, r  # the process was cold: the save paid it
  assert r['measured_peak_extra_bytes'] <= budget + TOLERANCE, r
  assert r['peak_extra_bytes'] <= budget + TOLERANCE, r
  r = states.run_worker('cold_restore', d, '-', str(total), str(96 * MiB))
  # Its replicated leaf (16 MiB) is filled on the devices, in pieces: that compiles.
  assert r['compiled'] and 'error' not in r and r['unpaid_compiles'] == 0, r
  beyond = r['measured_peak_extra_bytes'] - r['restored_bytes']
  print(f'cold restore: {beyond / MiB:.1f} MiB beyond {r["restored_bytes"] / MiB:.0f} MiB')
  assert beyond <= 96 * MiB + TOLERANCE, r
  # Too small once the start-up is paid: refused, naming it and the fix.
  r = states.run_worker('cold_restore', d, '-', str(total), str(64 * MiB))
  assert "XLA's compiler start-up" in r['error'], r
  assert 'raise host_ram_budget to' in r['error'].lower(), r
  assert r['measured_peak_extra_bytes'] <= 64 * MiB + TOLERANCE, r
  r = states.run_worker('cold_save', str(tmp_path / 'small'), '-', str(total), 'streaming',
                        str(64 * MiB))
  assert "XLA's compiler start-up" in r['error'], r
  assert not os.path.exists(tmp_path / 'small'), 'nothing written'


@pytest.mark.slow
def test_a_cold_call_refused_anyway_pays_no_start_up(tmp_path):
  """A fresh process's save or restore that its budget refuses even before
  XLA's start-up (~54 MiB) refuses without paying it: at 16 MiB they had
  peaked at 52-58 MiB to be refused.  The budget named counts the start-up's
  estimate (`cost.COMPILER_STARTUP_BYTES`) and holds in the next fresh
  process.  The restore is of a checkpoint with numpy leaves, which pays the
  start-up up front (a restore of jax.Arrays alone defers it to its fill)."""
  import re as re_lib  # pylint: disable=g-import-not-at-top
  total, small = 16 * MiB, 16 * MiB
  named = lambda r: int(re_lib.search(r"to '(\d+)MiB' or more", r['error']).group(1)) * MiB
  r = states.run_worker('cold_save', str(tmp_path / 'small'), '-', str(total), 'streaming',
                        str(small))
  assert "56.00 MiB for XLA's compiler start-up" in r['error'], r
  assert not r['compiled'] and r['measured_peak_extra_bytes'] <= small + TOLERANCE, r
  assert not os.path.exists(tmp_path / 'small'), 'nothing written'
  budget = named(r)
  r = states.run_worker('cold_save', str(tmp_path / 'c'), '-', str(total), 'streaming',
                        str(budget))
  assert 'error' not in r and r['compiled'], r
  assert r['measured_peak_extra_bytes'] <= budget + TOLERANCE, r
  d = str(tmp_path / 'm')
  states.run_worker('save', d, 'mixed:3', str(total), 'streaming', str(256 * MiB))
  r = states.run_worker('cold_restore', d, '-', str(total), str(small))
  assert "56.00 MiB for XLA's compiler start-up" in r['error'], r
  assert not r['compiled'] and r['measured_peak_extra_bytes'] <= small + TOLERANCE, r
  budget = named(r)
  r = states.run_worker('cold_restore', d, '-', str(total), str(budget))
  assert 'error' not in r and r['compiled'] and r['unpaid_compiles'] == 0, r
  beyond = r['measured_peak_extra_bytes'] - r['restored_bytes']
  print(f'refused at 16 MiB paying nothing; then {beyond / MiB:.1f} MiB beyond the arrays'
        f' at the {budget / MiB:.0f} MiB named')
  assert beyond <= budget + TOLERANCE, r
  # Onto a custom layout (relayouts: paid up front) at 40 MiB, above the
  # floor: it had paid the start-up (~54 MiB) to be refused.
  import json as json_lib, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  code = """
import json, sys, jax, numpy as np, kd_ckpt
from jax.experimental import layout
from kd_ckpt import hostmem, startup
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
if sys.argv[2] == "save":
  kd_ckpt.save(sys.argv[1], {"w": jax.device_put(np.ones((64, 1031), np.float32), one)})
  sys.exit()
fmt = layout.Format(layout.Layout(major_to_minor=(1, 0)), one)
with hostmem.PeakRss() as peak:
  try:
    kd_ckpt.restore(sys.argv[1], {"w": jax.ShapeDtypeStruct((64, 1031), np.float32, sharding=fmt)},
                    host_ram_budget=40 << 20, support_layout=True)
    error = ""
  except kd_ckpt.BudgetTooSmallError as e:
    error = str(e)
print(json.dumps({"error": error, "peak": peak.extra_bytes, "started": startup._started}))
"""
  d = str(tmp_path / 'l')
  for mode in ('save', 'restore'):
    proc = subprocess.run([sys.executable, '-c', code, d, mode], capture_output=True, text=True,
                          timeout=300, cwd=states.REPO, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    assert proc.returncode == 0, proc.stderr[-3000:]
  r = json_lib.loads(proc.stdout.strip().splitlines()[-1])
  assert "56.00 MiB for XLA's compiler start-up" in r['error'], r
  assert not r['started'] and r['peak'] <= 40 * MiB + TOLERANCE, r


@pytest.mark.slow
def test_a_process_that_compiled_before_importing_kd_ckpt_is_warm(tmp_path):
  """A training script that jits its step and only then imports kd_ckpt has
  paid XLA's start-up (but for 0.2-12 MiB): its restore of a 64 MiB stock
  leaf at 48 MiB holds the budget, where it was refused as cold (naming 93
  MiB).  The same
  restore in a process that compiled nothing is still refused, without
  paying the start-up."""
  import json as json_lib, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  code = """
import json, sys, jax, jax.numpy as jnp, numpy as np
want = np.arange(4096 * 4096, dtype=np.float32).reshape(4096, 4096)
if sys.argv[2] == "save":
  import orbax.checkpoint as ocp
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(sys.argv[1], {"w": jnp.asarray(want), "b": jnp.arange(1000.0)})
  ckptr.wait_until_finished()
  sys.exit()
if sys.argv[2] == "warm":  # the training step, compiled before kd_ckpt is imported
  jax.block_until_ready(jax.jit(lambda a: a * 2 + 1)(jnp.ones((256, 256))))
import kd_ckpt
from kd_ckpt import hostmem
from tests import states
states._settle()
with hostmem.PeakRss() as peak:
  try:
    back = jax.block_until_ready(kd_ckpt.restore(sys.argv[1], host_ram_budget=48 << 20))
    out = {"error": "", "same": bool((np.asarray(back["w"]) == want).all()),
           "restored": states.resident_bytes(back)}
  except kd_ckpt.BudgetTooSmallError as e:
    out = {"error": str(e), "restored": 0}
out["peak"] = peak.extra_bytes
print(json.dumps(out))
"""
  d = str(tmp_path / 'stock')
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ''}
  runs = {}
  for mode in ('save', 'warm', 'cold'):
    proc = subprocess.run([sys.executable, '-c', code, d, mode], capture_output=True, text=True,
                          timeout=300, cwd=states.REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if mode != 'save':
      runs[mode] = json_lib.loads(proc.stdout.strip().splitlines()[-1])
  warm, cold = runs['warm'], runs['cold']
  print(f'warm: {(warm["peak"] - warm["restored"]) / MiB:.1f} MiB beyond the arrays;'
        f' cold: refused at a peak of {cold["peak"] / MiB:.1f} MiB')
  assert not warm['error'] and warm['same'], warm
  assert warm['peak'] - warm['restored'] <= 48 * MiB + TOLERANCE, warm
  assert "56.00 MiB for XLA's compiler start-up" in cold['error'], cold
  assert cold['peak'] <= 48 * MiB + TOLERANCE, cold


@pytest.mark.slow
@pytest.mark.parametrize('state', ['mesh2d_prime', 'many_medium'])
def test_a_cold_restore_that_compiles_nothing_pays_no_start_up(tmp_path, state):
  """A fresh process whose restore places every shard whole compiles nothing,
  and so pays no compiler start-up (~54 MiB, `test_first_jit_of...` above):
  the whole budget is its pieces'.  Shapes with prime dims, on a 2-D mesh;
  many leaves of 1-4 MiB."""
  d = str(tmp_path / 'c')
  total, budget = 64 * MiB, 48 * MiB
  states.run_worker('save', d, state, str(total), 'streaming', str(256 * MiB))
  r = states.run_worker('cold_restore', d, '-', str(total), str(budget))
  assert 'error' not in r, r
  assert not r['compiled'] and r['unpaid_compiles'] == 0, r
  beyond = r['measured_peak_extra_bytes'] - r['restored_bytes']
  print(f'{state}: cold restore {beyond / MiB:.1f} MiB beyond {r["restored_bytes"] / MiB:.0f} MiB')
  # Paid, the start-up alone would be over 40 MiB of it.
  assert beyond <= 40 * MiB, r


@pytest.mark.slow
@pytest.mark.parametrize('way', ['orbax', 'kd_ckpt'])
def test_a_cold_restore_onto_a_custom_layout_pays_the_start_up_first(tmp_path, way):
  """Placing onto a custom layout compiles a relayout: a fresh process that
  restores onto one (`support_layout`: Orbax's inside `within_budget`, or
  `kd_ckpt.restore`'s) starts the compiler before it reads, inside the
  budget, and no compile runs before that."""
  import subprocess, sys, json as json_lib  # pylint: disable=g-import-not-at-top,multiple-imports
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  save = """
import sys, jax, numpy as np, kd_ckpt
from jax.sharding import NamedSharding as NS, PartitionSpec as P, Mesh
m = Mesh(np.array(jax.devices()), ("x",))
kd_ckpt.save(sys.argv[1], {"w": jax.device_put(
    np.arange(64 * 1031, dtype=np.float32).reshape(64, 1031), NS(m, P("x")))},
    host_ram_budget=128 << 20)
"""
  restore = """
import json, sys, jax, numpy as np, kd_ckpt
import orbax.checkpoint as ocp
from jax.experimental import layout
from jax.sharding import NamedSharding as NS, PartitionSpec as P, Mesh
from kd_ckpt import hostmem, startup
from tests import states
unpaid = states._count_unpaid_compiles(startup)
m = Mesh(np.array(jax.devices()), ("x",))
fmt = layout.Format(layout.Layout(major_to_minor=(1, 0)), NS(m, P("x")))  # column-major
target = {"w": jax.ShapeDtypeStruct((64, 1031), np.float32, sharding=fmt)}
with hostmem.PeakRss() as peak:
  if sys.argv[2] == "orbax":
    with kd_ckpt.within_budget(96 << 20):
      back = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
          sys.argv[1], args=ocp.args.StandardRestore(target, support_layout=True))
  else:
    back = kd_ckpt.restore(sys.argv[1], target, host_ram_budget=96 << 20, support_layout=True)
  jax.block_until_ready(back)
want = np.arange(64 * 1031, dtype=np.float32).reshape(64, 1031)
print(json.dumps({"unpaid": unpaid[0], "started": startup._started, "peak": peak.extra_bytes,
                  "same": bool((np.asarray(back["w"]) == want).all()),
                  "layout": str(back["w"].format.layout.major_to_minor)}))
"""
  d = str(tmp_path / 'c')
  for code in (save, restore):
    proc = subprocess.run([sys.executable, '-c', code, d, way], capture_output=True, text=True,
                          timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
  r = json_lib.loads(proc.stdout.strip().splitlines()[-1])
  assert r['same'] and r['layout'] == '(1, 0)', r
  assert r['started'] and r['unpaid'] == 0, r
  assert r['peak'] <= 96 * MiB + TOLERANCE, r


def test_restores_that_read_numpy_arrays_start_the_compiler_up_front():
  """Numpy results are read by the numpy handler beside the arrays' fill: the
  fill cannot then measure the start-up alone (b6ddee7 stalled), so such
  restores pay it before they read, as before."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from kd_ckpt import handler  # pylint: disable=g-import-not-at-top
  arr = jax.ShapeDtypeStruct((3,), jnp.float32)
  assert handler._reads_numpy(ocp.args.StandardRestore({'a': arr, 'b': np.zeros(3)}))
  assert not handler._reads_numpy(ocp.args.StandardRestore({'a': arr, 'n': 3}))
  assert not handler._reads_numpy(ocp.args.StandardRestore(None))
  assert handler._reads_numpy(ocp.args.PyTreeRestore(
      item={'a': arr}, restore_args={'a': ocp.RestoreArgs(restore_type=np.ndarray)}))
  assert not handler._reads_numpy(ocp.args.PyTreeRestore(
      item={'a': arr}, restore_args={'a': ocp.ArrayRestoreArgs(sharding=None)}))


# --- the bugs of issue 11 -----------------------------------------------------

def test_one_write_bigger_than_a_third_of_the_budget_is_planned_validly():
  """Orbax raises when one write reaches its concurrency limit: never plan that.

  A 7.8 GB Gemma-like state on one GPU at 3 GiB: no Orbax setting's worst
  case fits, so it streams (bounded), in slices well under the budget.
  """
  big = {'embed': jax.ShapeDtypeStruct((262144, 2560), jnp.bfloat16),  # 1.25 GiB, one write
         'layers': jax.ShapeDtypeStruct((34, 2560, 40960), jnp.bfloat16)}  # 6.6 GiB
  plan = kd_ckpt.plan_save(big, host_ram_budget='3GiB', platform='gpu')
  assert plan.strategy == 'streaming' and plan.enforced
  assert plan.slice_bytes <= cost.limiter_capacity(plan.budget_bytes) // 2
  assert all(c.orbax is None or c.orbax.save_concurrent_bytes is None for c in plan.candidates)


@pytest.mark.slow
def test_a_leaf_bigger_than_a_third_of_the_budget_saves_within_it(tmp_path):
  r = states.run_worker('save', str(tmp_path / 'c'), 'one_replicated', str(96 * MiB), 'auto',
                        str(64 * MiB))
  _check(r, 64 * MiB, 'one 96 MiB leaf at 64 MiB')


def test_auto_budget_ignores_reclaimable_page_cache(tmp_path):
  """Under cgroup v2, memory.current counts the page cache of files just written."""
  root = tmp_path / 'cg'
  root.mkdir()
  (root / 'cgroup.controllers').write_text('memory\n')
  (root / 'memory.max').write_text(str(8 << 30))
  (root / 'memory.current').write_text(str(7 << 30))  # 6 GiB of it is cache
  (root / 'memory.stat').write_text(f'anon {1 << 30}\nfile {6 << 30}\ninactive_file {6 << 30}\n')
  proc = tmp_path / 'cgroup'
  proc.write_text('0::/\n')
  mem = hostmem.probe(cgroup_root=root, proc_cgroup=proc, process_count=1)
  assert mem.cgroup.working_set_bytes == 1 << 30
  assert mem.available_bytes >= min(7 << 30, hostmem.probe().available_bytes) - (64 << 20)
  # "auto" never drops below what the bounded writer needs.
  tiny = hostmem.HostMemory(total_bytes=1 << 30, available_bytes=1 << 20, rss_bytes=0)
  assert kd_ckpt.budget.resolve('auto', tiny) == cost.min_budget_bytes()


def test_local_process_count_is_never_a_collective(monkeypatch):
  """Probes run inside restore and verify: no exchange, the same answer everywhere."""
  from kd_ckpt import exchange  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(exchange, 'agree', lambda *a, **k: pytest.fail('collective in a probe'))
  for name in ('KD_CKPT_LOCAL_PROCESSES', 'LOCAL_WORLD_SIZE', 'SLURM_NTASKS_PER_NODE',
               'OMPI_COMM_WORLD_LOCAL_SIZE', 'MPI_LOCALNRANKS'):
    monkeypatch.delenv(name, raising=False)
  assert hostmem.probe().local_process_count == 1
  monkeypatch.setenv('LOCAL_WORLD_SIZE', '4')
  assert hostmem.probe().local_process_count == 4


def test_items_of_one_save_share_one_limiter(tmp_path, monkeypatch):
  """Two StandardSave items in one save: one plan, one budget, one limiter."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from kd_ckpt import limiter as limiter_lib  # pylint: disable=g-import-not-at-top
  from kd_ckpt import session as session_lib  # pylint: disable=g-import-not-at-top
  # Every admission, by limiter: with a limiter per item the bytes admitted
  # at once, summed over limiters, could reach twice one capacity.
  admitted = {}
  seen_caps = set()
  real_try = limiter_lib.HostLimiter.try_acquire

  def spying_try(self, nbytes):
    ok = real_try(self, nbytes)
    if ok:
      admitted[id(self)] = self.in_use_bytes
      seen_caps.add(self.capacity_bytes)
      spying_try.max_sum = max(spying_try.max_sum, sum(admitted.values()))
    return ok

  spying_try.max_sum = 0
  monkeypatch.setattr(limiter_lib.HostLimiter, 'try_acquire', spying_try)
  m1, _ = states.meshes()
  items = {'a': {'w': states.filled((4096, 1024), states.NS(m1, states.P('x')))},
           'b': {'w': states.filled((4096, 1024), states.NS(m1, states.P()), seed=1)}}
  s = session_lib.MeasuredSave(tmp_path / 'step', items, host_ram_budget='64MiB',
                               strategy='streaming')
  assert s.plan.total_bytes == 32 * MiB  # one plan over both items
  mgr = ocp.CheckpointManager(
      tmp_path / 'mgr', item_handlers={k: kd_ckpt.SafePyTreeHandler() for k in items})
  with s.running():
    mgr.save(0, args=ocp.args.Composite(**{k: s.save_args(k) for k in items}))
    mgr.wait_until_finished()
  report = s.complete()
  assert report.bytes_written == 32 * MiB
  assert report.peak_extra_bytes <= 64 * MiB + TOLERANCE, str(report)
  assert len(admitted) == 1, f'{len(admitted)} limiters admitted bytes in one save'
  assert len(seen_caps) == 1 and spying_try.max_sum <= min(seen_caps), (
      spying_try.max_sum, seen_caps)
  back = mgr.restore(0, args=ocp.args.Composite(**{k: kd_ckpt.SafeRestore(None) for k in items}))
  for k in items:
    np.testing.assert_array_equal(np.asarray(back[k]['w']), np.asarray(items[k]['w']))


def test_limiter_never_admits_more_than_its_capacity():
  import asyncio  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  from kd_ckpt import limiter  # pylint: disable=g-import-not-at-top
  lim = limiter.HostLimiter()
  seen = []

  async def user(n):
    for _ in range(20):
      async with lim.hold(n):
        seen.append(lim.in_use_bytes)
        await asyncio.sleep(0)

  def thread_user():
    for _ in range(20):
      with lim.hold_sync(3):
        seen.append(lim.in_use_bytes)

  with lim.lease(10):
    t = threading.Thread(target=thread_user)
    t.start()
    async def users():
      # gather() inside a running loop: outside one it needs a current loop,
      # which an earlier test may have closed.
      await asyncio.wait_for(asyncio.gather(user(4), user(5), user(6)), 30)
    asyncio.run(users())
    t.join()
    with pytest.raises(limiter.RequestTooLargeError, match='Raise host_ram_budget'):
      lim.acquire(11)
  assert max(seen) <= 10 and lim.in_use_bytes == 0
  with pytest.raises(RuntimeError, match='outside a lease'):
    lim.acquire(1)


def test_too_many_leaves_for_the_budget_is_refused_before_writing(tmp_path):
  """Per-leaf bookkeeping counts: 2,000 leaves do not fit a 64 MiB budget."""
  tree = {f'l{i}': np.full((4,), i, np.float32) for i in range(2000)}
  with pytest.raises(kd_ckpt.BudgetTooSmallError, match=r'2000 leaves.*Raise host_ram_budget'):
    kd_ckpt.save(tmp_path / 'c', tree, host_ram_budget='64MiB', strategy='streaming')
  assert not (tmp_path / 'c').exists()


def test_packed_dtypes_host_copies_are_charged_as_real_copies_on_cpu():
  """numpy unpacks int4 (two elements a byte on the devices): on CPU its host
  copy is no view.  Orbax's path is charged 2.5x its host bytes there (a 64
  MiB int4 copy peaked at 160 MiB), an int8 leaf nothing; 1.5x on a GPU."""
  x4 = estimate_lib.estimate_leaf('w', jax.ShapeDtypeStruct((4096, 4096), jnp.int4))
  x8 = estimate_lib.estimate_leaf('w', jax.ShapeDtypeStruct((4096, 4096), jnp.int8))
  assert x4.packed and not x8.packed and x4.write_bytes == x8.write_bytes == 16 * MiB
  assert not estimate_lib.packed_on_device('float8_e4m3fn')
  assert estimate_lib.packed_on_device('float4_e2m1fn')
  copies = lambda leaf, platform: cost.predict_orbax_async(
      estimate_lib.TreeEstimate(leaves=(leaf,), platform=platform, process_index=0,
                                process_count=1),
      use_replica_parallel=False, enable_pinned_host_transfer=False).host_copy_bytes
  assert copies(x8, 'cpu') == 0 and copies(x4, 'cpu') == 40 * MiB
  assert copies(x8, 'gpu') == 16 * MiB and copies(x4, 'gpu') == 24 * MiB


def test_streaming_prediction_is_an_upper_bound_by_construction():
  est = estimate_lib.estimate_tree(states.make_state('mixed', 64 * MiB))
  for budget in (48 * MiB, 64 * MiB, 1 << 30):
    layout = cost.streaming_layout(budget)
    assert cost.predict_streaming(est, layout) <= budget
    assert layout.capacity_bytes + cost.FLOOR_BYTES == budget
  with pytest.raises(plan_lib.BudgetTooSmallError, match='smallest budget kd_ckpt'):
    plan_lib.plan_from_estimate(est, budget_bytes=cost.min_budget_bytes() - 1,
                                strategy='streaming')


@pytest.mark.slow
def test_trees_without_jax_arrays_pay_no_compiler_start_up(tmp_path):
  """numpy arrays and scalars compile nothing: a cold process saves them at 64 MiB (issue 19)."""
  import subprocess, sys, json as json_lib  # pylint: disable=g-import-not-at-top,multiple-imports
  code = '''
import json, sys
import numpy as np
import kd_ckpt
from kd_ckpt import hostmem, startup
tree = {"w": np.arange(1 << 20, dtype=np.float32), "n": 3, "x": 2.5}
hostmem.release_free_memory()
with hostmem.PeakRss() as peak:
  r = kd_ckpt.save(sys.argv[1], tree, strategy="streaming", host_ram_budget=64 << 20)
back = kd_ckpt.restore(sys.argv[1], host_ram_budget=40 << 20)
print(json.dumps({"startup": r.startup_bytes, "peak": peak.extra_bytes,
                  "compiled": startup._started, "same": bool((back["w"] == tree["w"]).all())}))
'''
  proc = subprocess.run([sys.executable, '-c', code, str(tmp_path / 'c')], capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json_lib.loads(proc.stdout.strip().splitlines()[-1])
  assert r['startup'] == 0 and not r['compiled'] and r['same'], r
  assert r['peak'] <= 64 * MiB + TOLERANCE, r


def test_async_report_is_frozen_at_commit_not_at_the_next_call(tmp_path):
  """Memory the training loop allocates after the commit is not the save's (issue 19)."""
  import time  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  @flax.struct.dataclass
  class State(kd.ckpts.items.StandardCheckpointItem):
    params: dict

  ckpt = kd_ckpt.SafeCheckpointer(workdir=tmp_path, save_interval_steps=1,
                                  host_ram_budget=512 * MiB, strategy='orbax')
  state = State(params={'w': jnp.ones((1024, 1024))})
  ckpt.save(state, step=1)
  _, session = ckpt._kd['pending']  # pylint: disable=protected-access
  assert session.async_commit
  deadline = time.monotonic() + 60
  while session._end is None and time.monotonic() < deadline:  # pylint: disable=protected-access
    time.sleep(0.05)
  assert session._end is not None  # pylint: disable=protected-access
  after_commit = np.ones(256 * MiB // 8)  # the next training steps' memory
  ckpt.wait_until_finished()
  report = ckpt.reports[-1]
  assert report.async_commit
  assert report.peak_extra_bytes < 128 * MiB, str(report)
  assert report.retained_bytes < 128 * MiB, str(report)
  del after_commit
  ckpt.close()


def test_async_report_covers_memory_the_background_commit_allocates(tmp_path, monkeypatch):
  """The report of an async save counts what its commit holds after save() returns.

  On the CPU backend Orbax's own async save of device arrays adds ~0.2 MiB,
  so the states of test_async_safe_checkpointer_report_covers_the_whole_save
  cannot tell a report that ends at save() from one that ends at the commit.
  Here the background write itself holds 128 MiB, as a GPU host's host
  copies would, and only after save() has returned.
  """
  import threading  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  from kauldron import kd  # pylint: disable=g-import-not-at-top
  from kd_ckpt import orbax_writer  # pylint: disable=g-import-not-at-top

  @flax.struct.dataclass
  class State(kd.ckpts.items.StandardCheckpointItem):
    params: dict

  returned = threading.Event()
  held = {}
  write = orbax_writer.compat.async_replica_slice_writer

  async def write_holding_memory(*args, **kwargs):
    # Only once save() has returned: this is the background commit.
    assert returned.wait(60), 'save() did not return before its commit wrote'
    buf = np.ones(128 * MiB // 8)  # touched: resident
    held['bytes'] = buf.nbytes
    del buf
    return await write(*args, **kwargs)

  monkeypatch.setattr(orbax_writer.compat, 'async_replica_slice_writer', write_holding_memory)
  ckpt = kd_ckpt.SafeCheckpointer(workdir=tmp_path, save_interval_steps=1,
                                  host_ram_budget=512 * MiB, strategy='orbax')
  state = State(params={'w': jnp.ones((1024, 1024))})
  # Earlier tests' garbage, collected during the save and trimmed after it,
  # would take RSS under the report's baseline before the commit allocates.
  import gc  # pylint: disable=g-import-not-at-top
  gc.collect()
  ckpt.save(state, step=1)
  returned.set()
  ckpt.wait_until_finished()
  report = ckpt.reports[-1]
  assert held['bytes'] == 128 * MiB
  assert report.async_commit
  assert report.peak_extra_bytes >= 120 * MiB, str(report)
  ckpt.close()


@pytest.mark.parametrize('leaf_shape,devices', [((32768, 1024), 1), ((4099, 1031), 1),
                                                ((2 * 8191, 1024), 2)])
def test_a_budget_beyond_a_small_states_needs_changes_only_its_headroom(leaf_shape, devices):
  """Slices of at most an eighth of the state (`cost.STATE_SLICES`): every
  budget from the one the state fills up plans the same slices and groups
  (a larger one was slower: its buffers were all fresh pages), and the
  limiter's capacity is still the budget's."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ('d',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('d'))
  tree = {'w': jax.ShapeDtypeStruct(leaf_shape, jnp.float32, sharding=sharding)}
  state_bytes = math.prod(leaf_shape) * 4
  plans = {b: kd_ckpt.plan_save(tree, host_ram_budget=b, strategy='streaming')
           for b in ('128MiB', '256MiB', '1GiB', '4GiB')}
  layouts = {(p.layout.slice_bytes, p.layout.group_bytes) for p in plans.values()}
  assert len(layouts) == 1, layouts
  [(slice_bytes, group_bytes)] = layouts
  assert slice_bytes <= state_bytes / cost.STATE_SLICES < slice_bytes + MiB
  assert group_bytes == cost.TARGET_SLICES_PER_GROUP * slice_bytes
  for p in plans.values():
    assert p.layout.capacity_bytes == cost.limiter_capacity(p.budget_bytes)
    assert p.predicted_peak_bytes <= p.budget_bytes
  # A state bigger than the room keeps the budget's slices.
  big = {'w': jax.ShapeDtypeStruct((1 << 28,), jnp.float32)}
  assert kd_ckpt.plan_save(big, host_ram_budget='256MiB', strategy='streaming').layout == (
      cost.streaming_layout(256 * MiB, 1))


@pytest.mark.parametrize('num_leaves', [0, 1, 400, 2000, 10_000])
def test_the_smallest_budget_named_in_errors_is_one_that_plans(num_leaves):
  """The budget `BudgetTooSmallError` tells users to raise to is feasible; less is not."""
  need = cost.min_budget_bytes(num_leaves)
  assert cost.streaming_layout(need, num_leaves).feasible
  assert not cost.streaming_layout(need - 64 * 1024, num_leaves).feasible


def test_drawn_states_hold_the_budget():
  """`tools/fuzz_budget.py` on a few seeds, so the tool keeps working: 0
  (through SafeCheckpointer), 9 and 11 (refused twice on restore, then
  held at the budget named), 75 (a leaf with an extent of 1 under
  strategy='orbax') and 159 (resharded onto devices that copy, beside
  placement programs); 11 and 75 save with reuse (after a save of the
  state with every other array leaf zeroed: both held, the fingerprints'
  programs charged); 91 restores onto custom layouts (a 13.5 MB shard
  staged whole beside the relayouts' charge: it waited forever at the
  budget first named, and is now priced in); 1029 (seeds from 1000 draw
  quantized leaves: one int4 leaf of 128 MiB over 8 devices, whose host
  copies are no views on CPU; its `auto` save at 54 MiB peaked at 236 MiB).
  `make fuzz-budget` runs 100 seeds."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run(
      [sys.executable, os.path.join(states.REPO, 'tools', 'fuzz_budget.py'),
       '--seeds', '0,9,11,75,91,159,1029'],
      cwd=states.REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  assert '7/7 held' in proc.stdout, proc.stdout[-2000:]
  assert 'custom layouts' in proc.stdout, proc.stdout[-2000:]


def test_drawn_states_hold_the_budget_over_two_processes():
  """`tools/fuzz_budget.py --processes 2`: each case's save and restore run in
  two JAX processes joined on 127.0.0.1 (4 CPU devices each), each process
  held to the budget.  Seeds 1 (a streaming save with reuse, refused, then
  held at the budget named, both processes reusing leaves; restored on
  devices that copy), 2 (`auto`; a restore onto
  other layouts, refused, then held), 3 (`mixed`: typed keys, numpy arrays
  and scalars beside the arrays, saved by stock Orbax), 7 (`mixed`, a
  streaming save of a single key and sharded key batches) and 90 (`mixed`,
  restored onto other shardings with custom device-local layouts, each
  checked on return: refused, then held)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run(
      [sys.executable, os.path.join(states.REPO, 'tools', 'fuzz_budget.py'),
       '--processes', '2', '--seeds', '1,2,3,7,90', '-v'],
      cwd=states.REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  assert '5/5 held' in proc.stdout, proc.stdout[-2000:]
  # 4 kd_ckpt saves (seed 3's is stock Orbax's, unmeasured) and 5 restores.
  assert proc.stdout.count('(most of 2)') == 9, proc.stdout[-2000:]
  assert 'restore shared resharded custom layouts @' in proc.stdout, proc.stdout[-2000:]
  [reused] = re.findall(r', (\d+) leaves reused', proc.stdout)
  assert int(reused) > 0, proc.stdout[-2000:]


@pytest.mark.slow
def test_a_restore_onto_custom_layouts_holds_its_relayouts(tmp_path):
  """Each shard shape relayed out onto a custom layout compiles a program XLA
  keeps (2.3-2.5 MiB measured) and takes ~10 MiB compiling.  Uncharged, 100
  leaf shapes at 48 MiB peaked 118-200 MiB beyond the arrays.  Now they are
  charged before anything is read: at 48 MiB the restore is refused, and
  a fresh process holds the budget the refusal names, with the values on
  the layout asked for (`bench/relayout_restore.py`'s worker)."""
  import importlib.util, json as json_lib, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  spec = importlib.util.spec_from_file_location(
      'relayout_restore', os.path.join(states.REPO, 'bench', 'relayout_restore.py'))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  d = str(tmp_path / 'c')
  run = lambda budget: bench._run(d, 20, 40, budget, 1)  # pylint: disable=protected-access
  bench._run(d, 20, 40, 0, 0)  # pylint: disable=protected-access  (saves)
  refused = run(48 * MiB)
  assert 'named' in refused and refused['beyond'] <= 48 * MiB + TOLERANCE, refused
  held = run(refused['named'])
  assert 'named' not in held and held['layout'] == '(1, 0)', held
  assert held['beyond'] <= refused['named'] + TOLERANCE, (held, refused)
  print(f"40 shapes: refused at 48 MiB, {held['beyond'] / MiB:.1f} MiB beyond the arrays"
        f" at {refused['named'] / MiB:.0f} MiB")
