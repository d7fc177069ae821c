"""Crash safety: saves killed by SIGKILL never cost a checkpoint.

Real processes (tests/crash_worker.py) save steps 0 and 1, then are killed
with SIGKILL while saving step 2, at several points of the save and with both
strategies:

  d2h      the first device-to-host copy
  write    data half written (streaming: in the middle of a leaf)
  merge    the handler's finalize (OCDBT merge)
  rename   all written, commit_success.txt included, before the final rename
  renamed  just after the rename (the step is complete: it must count)

After each kill, in this (fresh) process:

* the earlier steps restore bit-exact;
* Orbax's CheckpointManager and Kauldron's `kd.ckpts.Checkpointer` list only
  complete steps (`all_steps`, `latest_step`, `restore(step=-1)`), although
  the partial `ckpt_2.orbax-checkpoint-tmp` is on disk;
* saving again works: the killed step over its leftover (Orbax replaces it),
  or later steps beside it (ignored, also by max_to_keep's deletions);
* `kd_ckpt.save(DIR)` retried into the same DIR after a kill succeeds.

Last, real training: `python -m kauldron.main` (tiny Gemma LoRA) is killed
just before committing its third checkpoint, then restarted: it resumes from
the last complete step, saves the killed step again and goes on.

The kill workers (~4 s of CPU each) run two at a time, or one at a time
beside the killed kauldron.main run when that test is selected.  The whole
file takes about 2 minutes on 2 idle cores, the two kauldron.main runs
(~1 min each, one after the other) being most of it; `-m "not slow"` leaves
them out (~40 s).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import crash_worker as cw

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / 'configs' / 'gemma_lora.py'
TMP = '.orbax-checkpoint-tmp'
WORKER_TIMEOUT_SECS = 180
TRAIN_TIMEOUT_SECS = 480

# (api, strategy, kill point).  'ckpt': kd_ckpt.SafeCheckpointer (an Orbax
# CheckpointManager, Kauldron's layout); 'api': kd_ckpt.save(DIR/step).
SCENARIOS = [
    ('ckpt', 'orbax', 'd2h'),
    ('ckpt', 'streaming', 'd2h'),
    ('ckpt', 'orbax', 'write'),
    ('ckpt', 'streaming', 'write'),
    ('ckpt', 'streaming', 'merge'),
    ('ckpt', 'orbax', 'rename'),
    ('ckpt', 'streaming', 'rename'),
    ('ckpt', 'orbax', 'renamed'),
    ('api', 'streaming', 'write'),
    ('api', 'orbax', 'rename'),
    ('ckpt', 'streaming', 'reuse'),
    ('api', 'orbax', 'reuse'),
]


def _env() -> dict[str, str]:
  return {
      **os.environ,
      'XLA_FLAGS': '--xla_force_host_platform_device_count=8',
      'JAX_PLATFORMS': 'cpu',
      'PYTHONPATH': str(REPO),
  }


def _popen(args: list[str], log_file: pathlib.Path) -> subprocess.Popen:
  with log_file.open('w') as log:
    proc = subprocess.Popen(
        [sys.executable, '-m', 'tests.crash_worker', *args],
        cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
  proc.log_file = log_file
  return proc


def _finish(proc: subprocess.Popen, timeout: float) -> str:
  try:
    proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  return proc.log_file.read_text()


def _tail(log: str, n: int = 40) -> str:
  # Orbax errors print whole pytrees: keep the ends of the last lines.
  return '\n'.join(l[:300] for l in log.splitlines()[-n:])


def _assert_killed_at(proc: subprocess.Popen, log: str, point: str) -> None:
  """Died by our SIGKILL at `point`, not by an error or at another point."""
  assert proc.returncode == -9 and f'{cw.KILL_MARK} {point}' in log, (
      f'exit {proc.returncode}, expected -9 at {point!r}; log'
      f' {proc.log_file}:\n{_tail(log)}')


def test_streaming_checkpointer_writes_only_into_created_directories(tmp_path, caplog):
  """Streaming through a CheckpointManager waits for Orbax's directories.

  The manager creates `ckpt_N.orbax-checkpoint-tmp` in a background thread
  while the handler runs; the streaming handler writes during the handler
  call.  It used to write first: Orbax then found the directory, deleted it
  with the data, and the save failed, was retried by Kauldron, or hung.
  """
  ckpt = cw.checkpointer(tmp_path, 'streaming')
  for step in range(3):
    ckpt.save(cw.State(tree=cw.make_tree(step)), step=step)
    ckpt.wait_until_finished()
  assert list(ckpt.all_steps) == [0, 1, 2]
  problems = [r.getMessage()[:300] for r in caplog.records
              if r.levelno >= 40
              or (r.levelno >= 30 and 'already exists' in r.getMessage())]
  assert not problems
  assert [r.strategy for r in ckpt.reports] == ['streaming'] * 3
  for step in range(3):
    _assert_tree_bytes_equal(_kd_restore(ckpt, step), cw.make_tree(step))
  ckpt.close()


# --- The killed saves ----------------------------------------------------------


def _kauldron_main_selected(request) -> bool:
  return any(i.name.startswith('test_kauldron_main') and i.path == request.path
             for i in request.session.items)


@pytest.fixture(scope='module')
def killed_saves(request, tmp_path_factory):
  """Runs every scenario's worker: {scenario: (dir, proc, log)}."""
  # kauldron.main mostly keeps one core busy for a minute: start it first and
  # run the workers one at a time beside it, else two at a time.
  parallel = 2
  if _kauldron_main_selected(request):
    request.getfixturevalue('killed_train')
    parallel = 1
  root = tmp_path_factory.mktemp('killed')
  pending = list(SCENARIOS)
  running, done = {}, {}
  deadline = time.monotonic() + WORKER_TIMEOUT_SECS * len(SCENARIOS) / parallel
  while pending or running:
    while pending and len(running) < parallel:
      sc = pending.pop(0)
      d = root / '-'.join(sc)
      running[sc] = (d, _popen(['save', *sc, str(d)], root / ('-'.join(sc) + '.log')))
    for sc, (d, proc) in list(running.items()):
      if proc.poll() is not None or time.monotonic() > deadline:
        done[sc] = (d, proc, _finish(proc, 1))
        del running[sc]
    time.sleep(0.1)
  return done


def _abstract(tree):
  return jax.tree.map(
      lambda x: (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                 if isinstance(x, jax.Array) else x), tree)


def _assert_tree_bytes_equal(got, want) -> None:
  got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
  want_flat = jax.tree_util.tree_flatten_with_path(want)[0]
  assert [p for p, _ in got_flat] == [p for p, _ in want_flat]
  for (path, g), (_, w) in zip(got_flat, want_flat):
    g, w = np.asarray(g), np.asarray(w)
    assert (g.dtype, g.shape) == (w.dtype, w.shape), jax.tree_util.keystr(path)
    # Bit-exact, NaN-safe.
    assert g.tobytes() == w.tobytes(), jax.tree_util.keystr(path)


def _kd_restore(ckpt, step: int):
  """Restores `step` (-1: latest) through a Kauldron checkpointer."""
  want = cw.make_tree(max(step, 0))
  state = ckpt.restore(cw.State(tree=_abstract(want)), step=step)
  return state.tree


def _listed_steps(ckpt_dir: pathlib.Path) -> tuple[list[int], int | None]:
  """What stock Orbax sees: (all_steps, latest_step)."""
  with ocp.CheckpointManager(
      ckpt_dir, options=ocp.CheckpointManagerOptions(
          step_prefix='ckpt', read_only=True)) as mgr:
    return sorted(mgr.all_steps()), mgr.latest_step()


def _check_checkpointer_scenario(workdir, strategy, point):
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  ckpts = workdir / 'checkpoints'
  names = set(os.listdir(ckpts))
  killed = f'ckpt_{cw.KILLED_STEP}'
  complete = [0, 1, 2] if point == 'renamed' else [0, 1]
  leftover = killed + TMP in names
  if point == 'renamed':
    assert killed in names and not leftover, names
  else:
    assert killed not in names, names
    # The partial save is on disk: the kill hit mid-save.  (Orbax creates the
    # directory in a background thread: a kill in the first device-to-host
    # copy may come before it.)
    assert leftover or point == 'd2h', names
  if point == 'rename':
    # The most complete-looking leftover: only the rename was missing.
    assert (ckpts / (killed + TMP) / 'commit_success.txt').exists()

  # Stock Orbax's and Kauldron's views: only complete steps.
  assert _listed_steps(ckpts) == (complete, complete[-1])
  stock = kd.ckpts.Checkpointer(workdir=str(workdir), save_interval_steps=1)
  assert list(stock.all_steps) == complete
  assert stock.latest_step == complete[-1]
  # restore(step=-1) picks the last complete step; every step is bit-exact.
  for step in (-1, *complete):
    want = cw.make_tree(complete[-1] if step == -1 else step)
    _assert_tree_bytes_equal(_kd_restore(stock, step), want)
  stock.close()

  # Save again, as a restarted run does, with the leftover still there.
  ckpt = cw.checkpointer(workdir, strategy)
  if point == 'd2h':
    # Later steps beside the leftover: ignored, also by max_to_keep=3,
    # which deletes step 0.
    new, expected = [3, 4], [1, 3, 4]
  elif point == 'renamed':
    new, expected = [3], [1, 2, 3]
  else:
    # The killed step again: Orbax replaces its leftover.
    new, expected = [cw.KILLED_STEP], [0, 1, 2]
  for step in new:
    tree = cw.make_tree(step)
    ckpt.save(cw.State(tree=tree), step=step)
    ckpt.wait_until_finished()
  assert list(ckpt.all_steps) == expected
  ckpt.close()
  left = sorted(n for n in os.listdir(ckpts) if TMP in n)
  assert left == ([killed + TMP] if point == 'd2h' and leftover else []), left
  assert _listed_steps(ckpts) == (expected, expected[-1])
  fresh = kd.ckpts.Checkpointer(workdir=str(workdir), save_interval_steps=1)
  _assert_tree_bytes_equal(_kd_restore(fresh, -1), cw.make_tree(expected[-1]))
  fresh.close()


def _check_api_scenario(root, strategy, point):
  import kd_ckpt  # pylint: disable=g-import-not-at-top

  killed = str(cw.KILLED_STEP)
  names = set(os.listdir(root))
  assert killed not in names and killed + TMP in names, names
  # A plain Orbax user's step listing (one folder per step) skips it.
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(
      read_only=True)) as mgr:
    assert sorted(mgr.all_steps()) == [0, 1]
    assert mgr.latest_step() == 1
  for step in (0, 1):
    want = cw.make_tree(step)
    _assert_tree_bytes_equal(kd_ckpt.restore(root / str(step), _abstract(want)), want)
  if point == 'write':
    with pytest.raises((ValueError, FileNotFoundError)):
      kd_ckpt.restore(root / (killed + TMP))

  # The same call again, into the same directory: works, leftover gone.
  want = cw.make_tree(cw.KILLED_STEP)
  kd_ckpt.save(root / killed, want, host_ram_budget=cw.BUDGETS[strategy],
               strategy=strategy)
  assert sorted(os.listdir(root)) == ['0', '1', '2']
  _assert_tree_bytes_equal(kd_ckpt.restore(root / killed, _abstract(want)), want)


@pytest.mark.integration
@pytest.mark.parametrize('api,strategy,point', SCENARIOS,
                         ids=['-'.join(s) for s in SCENARIOS])
def test_killed_save(api, strategy, point, killed_saves):
  directory, proc, log = killed_saves[(api, strategy, point)]
  _assert_killed_at(proc, log, point)
  assert 'ARMED' in log  # steps 0 and 1 were saved before
  if api == 'ckpt':
    _check_checkpointer_scenario(directory, strategy, point)
  else:
    _check_api_scenario(directory, strategy, point)


# --- kauldron.main killed, then restarted -------------------------------------

TRAIN_KILLED_STEP = 4  # the third save (ckpt_0, ckpt_2 complete)


def _train_args(workdir: pathlib.Path, *flags: str) -> list[str]:
  return [f'--cfg={CONFIG}', f'--cfg.workdir={workdir}',
          '--cfg.__args__.tiny=True', *flags]


@pytest.fixture(scope='module')
def killed_train(tmp_path_factory):
  """kauldron.main (streaming saves) killed before committing ckpt_4.

  Started here, waited for by the test: the kill workers run meanwhile.
  """
  workdir = tmp_path_factory.mktemp('train')
  proc = _popen(
      ['train', str(TRAIN_KILLED_STEP), 'rename',
       *_train_args(workdir, '--cfg.__args__.strategy=streaming')],
      workdir / 'train_killed.log')
  yield workdir, proc
  if proc.poll() is None:
    proc.kill()
    proc.wait()


def _step_dirs(workdir: pathlib.Path) -> list[int]:
  return sorted(int(m.group(1)) for n in os.listdir(workdir / 'checkpoints')
                if (m := re.fullmatch(r'ckpt_(\d+)', n)))


def _params(step_dir: pathlib.Path) -> dict[str, bytes]:
  """A step's params as raw bytes, read by plain Orbax."""
  with ocp.StandardCheckpointer() as c:
    tree = c.restore(step_dir / 'default')
  flat = jax.tree_util.tree_flatten_with_path(tree['params'])[0]
  return {jax.tree_util.keystr(p): np.asarray(x).tobytes() for p, x in flat}


@pytest.mark.integration
@pytest.mark.slow
def test_kauldron_main_killed_mid_save_resumes(killed_train):
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  workdir, proc = killed_train
  log = _finish(proc, TRAIN_TIMEOUT_SECS)
  _assert_killed_at(proc, log, 'rename')
  assert f'ARMED step {TRAIN_KILLED_STEP}' in log
  ckpts = workdir / 'checkpoints'
  leftover = ckpts / f'ckpt_{TRAIN_KILLED_STEP}{TMP}'
  assert (leftover / 'commit_success.txt').exists()  # all written but the rename
  assert _step_dirs(workdir) == [0, 2]
  stock = kd.ckpts.Checkpointer(workdir=str(workdir), save_interval_steps=2)
  assert (list(stock.all_steps), stock.latest_step) == ([0, 2], 2)
  stock.close()
  params_2 = _params(ckpts / 'ckpt_2')

  # A real restart, further: resumes from ckpt_2 and saves ckpt_4 again over
  # the leftover, then ckpt_6.
  restart = subprocess.run(
      [sys.executable, '-m', 'kauldron.main',
       *_train_args(workdir, '--cfg.num_train_steps=6')],
      cwd=REPO, env=_env(), capture_output=True, text=True,
      timeout=TRAIN_TIMEOUT_SECS)
  log = restart.stdout + restart.stderr
  (workdir / 'train_restart.log').write_text(log)
  assert restart.returncode == 0, _tail(log, 60)
  assert 'Starting training loop at step 2' in log
  for step in (4, 6):
    assert re.search(rf'kd_ckpt step {step} saved: ', log), step
  assert 'kd_ckpt step 2 saved' not in log
  assert _step_dirs(workdir) == [2, 4, 6]  # max_to_keep=3
  assert not [n for n in os.listdir(ckpts) if TMP in n]
  assert _params(ckpts / 'ckpt_2') == params_2  # untouched, bit-exact
  with ocp.StandardCheckpointer() as c:
    assert int(c.restore(ckpts / 'ckpt_6' / 'default')['step']) == 6
