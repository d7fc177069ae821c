"""kd_ckpt.SafeCheckpointer inside real Kauldron training (`kauldron.main`).

The tiny variant of configs/gemma_lora.py (dummy Gemma + LoRA, synthetic
tokens, 4 steps, a save every 2) runs on 8 fake CPU devices:

* with SafeCheckpointer: ckpt_0/2/4, each with a kd_ckpt report;
* with the stock kd.ckpts.Checkpointer: the same steps;
* both start from the same pretrained weights (a stock Orbax checkpoint
  loaded by Gemma's `LoadCheckpoint`; with SafeCheckpointer through
  `kd_ckpt.InitWithinBudget`, inside the budget);
* the SafeCheckpointer run again to step 6: it resumes from ckpt_4;
* checkpoints restore bit-exact across the two checkpointers, and the two
  runs trained to the same parameters.

About 3 minutes on 2 cores (each kauldron.main run costs ~60 s; the first
two run side by side).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import kd_ckpt
from kd_ckpt import report as report_lib

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / 'configs' / 'gemma_lora.py'
NUM_DEVICES = 8  # the tiny batch (8) must divide it
TIMEOUT_SECS = 480


def _start(workdir: pathlib.Path, *flags: str) -> subprocess.Popen:
  """Starts the tiny config through `python -m kauldron.main`."""
  env = {
      **os.environ,
      'XLA_FLAGS': f'--xla_force_host_platform_device_count={NUM_DEVICES}',
      'JAX_PLATFORMS': 'cpu',
      'PYTHONPATH': str(REPO),
  }
  log_file = workdir / f'train_{len(list(workdir.glob("train_*.log")))}.log'
  with log_file.open('w') as log:
    proc = subprocess.Popen(
        [
            sys.executable, '-m', 'kauldron.main',
            f'--cfg={CONFIG}',
            f'--cfg.workdir={workdir}',
            '--cfg.__args__.tiny=True',
            *flags,
        ],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
  proc.log_file = log_file
  return proc


def _wait(proc: subprocess.Popen) -> str:
  """Waits for a run; returns its log, fails the test with its tail."""
  try:
    proc.wait(timeout=TIMEOUT_SECS)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  return _check(proc)


def _check(proc: subprocess.Popen) -> str:
  log = proc.log_file.read_text()
  if proc.returncode != 0:
    # Orbax errors print whole pytrees: keep the ends of the last lines.
    tail = '\n'.join(l[:300] for l in log.splitlines()[-60:])
    pytest.fail(f'kauldron.main failed (exit {proc.returncode}), log'
                f' {proc.log_file}:\n{tail}', pytrace=False)
  return log


def _train(workdir: pathlib.Path, *flags: str) -> str:
  return _wait(_start(workdir, *flags))


def _step_dirs(workdir: pathlib.Path) -> dict[int, pathlib.Path]:
  ckpts = workdir / 'checkpoints'
  return {
      int(p.name.removeprefix('ckpt_')): p
      for p in ckpts.iterdir()
      if re.fullmatch(r'ckpt_\d+', p.name)
  }


def _orbax_params(step_dir: pathlib.Path) -> dict[str, np.ndarray]:
  """The params of a step, read by plain Orbax (no Kauldron, no kd_ckpt)."""
  with ocp.StandardCheckpointer() as c:
    tree = c.restore(step_dir / 'default')
  return _flat_params(tree['params'])


def _flat_params(params) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {
      jax.tree_util.keystr(p, simple=True, separator='.'): np.asarray(x)
      for p, x in flat
  }


def _assert_bit_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    assert a[k].shape == b[k].shape, k
    # Bit-exact, NaN-safe: compare the raw bytes.
    assert a[k].tobytes() == b[k].tobytes(), k


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory) -> pathlib.Path:
  """The tiny model's weights in Gemma's published layout (stock Orbax)."""
  path = tmp_path_factory.mktemp('pretrained') / 'weights'
  subprocess.run([sys.executable, str(REPO / 'examples' / 'gemma_weights.py'), str(path)],
                 check=True, cwd=REPO,
                 env={**os.environ, 'JAX_PLATFORMS': 'cpu'}, timeout=TIMEOUT_SECS,
                 capture_output=True)
  return path


@pytest.fixture(scope='module')
def first_runs(tmp_path_factory, pretrained):
  """Both 4-step runs, side by side (start-up is mostly one core each)."""
  workdirs = {k: tmp_path_factory.mktemp(k) for k in ('safe', 'stock')}
  load = f'--cfg.__args__.pretrained={pretrained}'
  procs = {
      'safe': _start(workdirs['safe'], '--cfg.__args__.safe_ckpt=True', load),
      'stock': _start(workdirs['stock'], '--cfg.__args__.safe_ckpt=False', load),
  }
  try:
    for proc in procs.values():
      proc.wait(timeout=TIMEOUT_SECS)
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return {k: (workdirs[k], procs[k]) for k in procs}


@pytest.fixture(scope='module')
def safe_run(first_runs):
  workdir, proc = first_runs['safe']
  return workdir, _check(proc)


@pytest.fixture(scope='module')
def stock_run(first_runs):
  workdir, proc = first_runs['stock']
  return workdir, _check(proc)


@pytest.fixture(scope='module')
def safe_params_4(safe_run):
  """ckpt_4's params, read before the resume test trains further."""
  return _orbax_params(_step_dirs(safe_run[0])[4])


@pytest.fixture(scope='module')
def stock_params_4(stock_run):
  return _orbax_params(_step_dirs(stock_run[0])[4])


def test_safe_checkpointer_saves_every_interval_with_a_report(safe_run):
  workdir, log = safe_run
  steps = _step_dirs(workdir)
  assert sorted(steps) == [0, 2, 4]
  assert not list((workdir / 'checkpoints').glob('*.orbax-checkpoint-tmp*'))
  for step, step_dir in steps.items():
    assert (step_dir / 'default' / '_METADATA').is_file()
    report = json.loads((step_dir / report_lib.REPORT_FILE_NAME).read_text())
    assert report['strategy'] in ('orbax', 'streaming')
    assert report['budget_bytes'] > 0
    # Measured over the whole save (async commit included), not predicted.
    assert report['peak_extra_bytes'] <= report['budget_bytes'] + 8 * 2**20, report
    # What the report says was written is what the checkpoint holds.
    info = kd_ckpt.inspect(step_dir)
    assert info.step == step
    assert info.saved_by == 'kd_ckpt'
    assert report['bytes_written'] + report['bytes_reused'] == info.total_bytes
    # The one INFO line of each save: choice, budget, prediction, measured peak.
    assert len(re.findall(rf'kd_ckpt step {step} saved: ', log)) == 1, step
    assert re.search(
        rf'kd_ckpt step {step} saved: (orbax|streaming) \(.*\): peak extra RSS .* of'
        r' budget .* \(predicted .*\)', log), step


def test_stock_checkpointer_run(stock_run):
  workdir, log = stock_run
  steps = _step_dirs(workdir)
  assert sorted(steps) == [0, 2, 4]
  for step_dir in steps.values():
    assert (step_dir / 'default' / '_METADATA').is_file()
    assert not (step_dir / report_lib.REPORT_FILE_NAME).exists()
  assert 'kd_ckpt step' not in log


def test_both_checkpointers_saved_the_same_training(safe_params_4, stock_params_4):
  # Same seed, same data, same devices: the checkpointer changes nothing.
  _assert_bit_equal(safe_params_4, stock_params_4)
  assert any('lora' in k for k in safe_params_4)


@pytest.mark.parametrize('run', ['safe', 'stock'])
def test_both_runs_start_from_the_pretrained_weights(run, request, pretrained):
  """ckpt_0 (before any step) holds the loaded weights, and fresh LoRA weights."""
  with ocp.StandardCheckpointer() as c:
    stored = c.restore(pretrained)
  want = {'.'.join([*module.split('/')[1:], *([] if module.endswith(('/mlp/linear', '/mlp/gating_einsum')) else [name])]): np.asarray(x)
          for module, leaves in stored.items() for name, x in leaves.items()}
  got = _orbax_params(_step_dirs(request.getfixturevalue(f'{run}_run')[0])[0])
  lora = {k for k in got if 'lora' in k}
  assert lora and got.keys() - lora == want.keys()
  _assert_bit_equal({k: got[k] for k in want}, want)
  log = request.getfixturevalue(f'{run}_run')[1]
  # The safe run's weights came through kd_ckpt (`kd_ckpt.InitWithinBudget`).
  assert (run == 'safe') == bool(re.search(
      r'kd_ckpt init: SkipLoRA.transform read through kd_ckpt inside host_ram_budget=auto:'
      r' peak extra RSS ', log)), run


@pytest.fixture(scope='module')
def tiny_state_specs(tmp_path_factory):
  """The tiny trainer's abstract TrainState, with shardings (as train does)."""
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  spec = importlib.util.spec_from_file_location('gemma_lora_cfg_integ', CONFIG)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  cfg = module.get_config(module.ConfigArgs(tiny=True))
  cfg.workdir = str(tmp_path_factory.mktemp('unused_workdir'))
  trainer = kd.konfig.resolve(cfg)
  assert jax.device_count() == NUM_DEVICES  # tests/conftest.py
  return trainer.state_specs


@pytest.mark.parametrize('saved_by', ['safe', 'stock'])
@pytest.mark.parametrize('restored_by', ['safe', 'stock'])
def test_restore_across_checkpointers_is_bit_exact(
    saved_by, restored_by, request, tiny_state_specs,
):
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top

  workdir = request.getfixturevalue(f'{saved_by}_run')[0]
  expected = request.getfixturevalue(f'{saved_by}_params_4')
  cls = {'safe': kd_ckpt.SafeCheckpointer, 'stock': kd.ckpts.Checkpointer}[restored_by]
  ckpt = cls(workdir=str(workdir), save_interval_steps=2)
  state = ckpt.restore(tiny_state_specs, step=4)
  ckpt.close()
  assert int(state.step) == 4
  leaf = jax.tree.leaves(state.params)[0]
  assert isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) == NUM_DEVICES
  _assert_bit_equal(_flat_params(state.params), expected)


def test_safe_checkpointer_resumes_from_last_step(safe_run, safe_params_4):
  workdir, _ = safe_run
  log = _train(
      workdir, '--cfg.__args__.safe_ckpt=True', '--cfg.num_train_steps=6'
  )
  # Restored ckpt_4 rather than starting over.
  assert 'Starting training loop at step 4' in log
  assert 'kd_ckpt step 0 saved' not in log
  assert re.search(r'kd_ckpt step 6 saved: ', log)
  steps = _step_dirs(workdir)
  assert sorted(steps) == [2, 4, 6]  # max_to_keep=3
  assert (steps[6] / report_lib.REPORT_FILE_NAME).is_file()
  with ocp.StandardCheckpointer() as c:
    tree = c.restore(steps[6] / 'default')
  assert int(tree['step']) == 6
  # Training went on from step 4: the LoRA weights moved.
  after = _flat_params(tree['params'])
  before = safe_params_4
  moved = [k for k in before if before[k].tobytes() != after[k].tobytes()]
  assert moved and all('lora' in k for k in moved)
