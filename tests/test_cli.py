"""`python -m kd_ckpt plan|inspect` and tools/find_python.sh.

The plan of the full Gemma 3 4B LoRA config is checked against a train state
built here independently (the config module loaded directly, the real batch
shape of its data pipeline), not against numbers copied from a run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import kd_ckpt
from kd_ckpt import cli

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / 'configs' / 'gemma_lora.py'
P = jax.sharding.PartitionSpec

# Gemma 3 4B: ~3.88e9 bf16 parameters (7.8 GB); LoRA rank 4 adds a few
# million, adafactor's factored second moments of the LoRA weights a few more.
GEMMA3_4B_LORA_BYTES_RANGE = (7.5e9, 8.5e9)


def _run_cli(args, capsys) -> tuple[int, str, str]:
  code = cli.main([str(a) for a in args])
  out, err = capsys.readouterr()
  return code, out, err


def _run_module(args, timeout=300) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, '-m', 'kd_ckpt', *map(str, args)],
      cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
      env={**os.environ, 'PYTHONPATH': str(REPO)},
  )


def _load_config_module():
  spec = importlib.util.spec_from_file_location('gemma_lora_cfg_test', CONFIG)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


# ---------------------------------------------------------------------------
# plan: the full Gemma 3 4B LoRA config.


@pytest.fixture(scope='module')
def full_plan():
  """`plan --json` of the full config (in-process: imports are shared)."""
  out, err = io.StringIO(), io.StringIO()
  start = time.monotonic()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main([
        'plan', f'--cfg={CONFIG}', '--host-ram-budget=16GiB', '--json',
    ])
  seconds = time.monotonic() - start
  assert code == 0, err.getvalue()
  return json.loads(out.getvalue()), seconds


@pytest.fixture(scope='module')
def independent_state():
  """The config's abstract train state, built without kd_ckpt.cli."""
  from etils import enp  # pylint: disable=g-import-not-at-top
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  module = _load_config_module()
  cfg = module.get_config(module.ConfigArgs())
  cfg.workdir = '/tmp/kd_ckpt_test_unused_workdir'
  trainer = kd.konfig.resolve(cfg)
  # The batch `Seq2SeqTask(max_length=512)` yields for batch_size=16.
  elem_spec = {'input': enp.ArraySpec(shape=(16, 512), dtype=np.int32)}
  return jax.eval_shape(functools.partial(
      trainer.init_state, skip_transforms=True, element_spec=elem_spec
  ))


def _nbytes(x) -> int:
  return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def test_plan_full_gemma_config_total_bytes(full_plan, independent_state):
  plan, seconds = full_plan
  leaves = jax.tree.leaves(independent_state)
  expected_bytes = sum(_nbytes(x) for x in leaves)
  params_bytes = sum(_nbytes(x) for x in jax.tree.leaves(independent_state.params))

  assert plan['total_bytes'] == expected_bytes
  assert plan['global_bytes'] == expected_bytes
  assert plan['num_leaves'] == len(leaves)
  lo, hi = GEMMA3_4B_LORA_BYTES_RANGE
  assert lo <= plan['total_bytes'] <= hi
  # ~3.88e9 bf16 parameters dominate; the rest is LoRA + optimizer state.
  assert 3.8e9 <= params_bytes / 2 <= 3.95e9
  assert plan['total_bytes'] - params_bytes < 0.05e9
  # Planned, not loaded: well under a minute even on 2 busy cores.
  assert seconds < 90, f'plan took {seconds:.0f} s'


def test_plan_full_gemma_config_json_fields(full_plan):
  plan, _ = full_plan
  for key in ('strategy', 'budget_bytes', 'predicted_peak_bytes', 'total_bytes',
              'num_leaves', 'orbax', 'candidates', 'largest_leaves'):
    assert key in plan
  assert plan['budget_bytes'] == 16 * 2**30
  assert plan['strategy'] in ('orbax', 'streaming')
  # Streaming only when no Orbax variant fits; Orbax only when one does.
  orbax_fits = [c['fits'] for c in plan['candidates'] if c['strategy'] == 'orbax']
  assert orbax_fits and any(orbax_fits) == (plan['strategy'] == 'orbax'), plan['candidates']
  for c in plan['candidates']:
    assert c['fits'] == (c['predicted_peak_bytes'] <= plan['budget_bytes']), c
  largest = plan['largest_leaves'][0]
  assert largest['path'] == 'params.embedder.input_embedding'
  assert largest['shape'] == [262144, 2560]
  assert largest['bytes'] == 262144 * 2560 * 2
  source = plan['source']
  assert source['checkpointer'] == 'SafeCheckpointer'
  assert source['batch_spec_from'] == 'model'
  assert source['batch_spec'] == {'input': 'int32[16, 1]'}


# ---------------------------------------------------------------------------
# plan: the tiny config, flags, errors.


def test_plan_tiny_batch_from_data_matches_model(capsys):
  base = ['plan', f'--cfg={CONFIG}', '--cfg.__args__.tiny=True', '--json']
  code, out, err = _run_cli(base, capsys)
  assert code == 0, err
  from_model = json.loads(out)
  code, out, err = _run_cli(base + ['--batch-spec=data'], capsys)
  assert code == 0, err
  from_data = json.loads(out)
  code, out, err = _run_cli(base + ['--batch-spec=input=int32[8,16]'], capsys)
  assert code == 0, err
  from_flag = json.loads(out)

  assert from_data['source']['batch_spec'] == {
      'input': 'int32[8, 16]',
      'loss_mask': 'bool[8, 16, 1]',
      'target': 'int32[8, 16, 1]',
  }
  assert from_flag['source']['batch_spec_from'] == 'flag'
  # Parameter shapes do not depend on the batch: same plan input.
  assert from_model['total_bytes'] == from_data['total_bytes'] == from_flag['total_bytes']
  assert from_model['num_leaves'] == from_data['num_leaves'] == 42


def test_plan_budget_and_strategy_from_config_args(capsys):
  code, out, err = _run_cli([
      'plan', f'--cfg={CONFIG}', '--cfg.__args__.tiny=True',
      '--cfg.__args__.host_ram_budget=64MiB',
      '--cfg.__args__.strategy=streaming', '--json',
  ], capsys)
  assert code == 0, err
  plan = json.loads(out)
  assert plan['budget_bytes'] == 64 * 2**20
  assert plan['strategy'] == 'streaming'
  # Explicit flags win over the config.
  code, out, err = _run_cli([
      'plan', f'--cfg={CONFIG}', '--cfg.__args__.tiny=True',
      '--cfg.__args__.host_ram_budget=64MiB', '--host-ram-budget=1GiB',
      '--json',
  ], capsys)
  assert code == 0, err
  assert json.loads(out)['budget_bytes'] == 2**30
  # A fraction of available memory, as the help says (it was refused as not positive).
  from kd_ckpt import budget as budget_lib  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top
  for fraction in ('0.25', '25%'):
    code, out, err = _run_cli([
        'plan', f'--cfg={CONFIG}', '--cfg.__args__.tiny=True', f'--host-ram-budget={fraction}',
        '--json'], capsys)
    assert code == 0, err
    want = budget_lib.resolve(0.25, hostmem.probe())
    assert abs(json.loads(out)['budget_bytes'] - want) < want / 5, (out[:300], want)


@pytest.mark.parametrize('args,message', [
    (['--cfg=configs/no_such_config.py'], 'config file not found'),
    ([f'--cfg={CONFIG}', '--cfg.__args__.tiny=True',
      '--cfg.model.model.no_such_field=3'], 'config error'),
    ([f'--cfg={CONFIG}', '--cfg.__args__.strategy=fastest'], 'strategy'),
    ([f'--cfg={CONFIG}', '--host-ram-budget=lots'], "host_ram_budget='lots'"),
    ([f'--cfg={CONFIG}', '--cfg.__args__.tiny=True', '--batch-spec=input=int32'],
     'bad --batch-spec'),
    ([], 'plan needs a config'),
    ([f'--cfg={CONFIG}', '--num-devices=3'], 'already runs with 8 devices'),
])
def test_plan_errors_are_clean(args, message, capsys):
  assert jax.device_count() == 8  # started (tests/conftest.py), as in-process
  code, out, err = _run_cli(['plan', *args], capsys)
  assert code == 2
  assert message in err
  assert 'Traceback' not in err
  assert not out


def test_plan_budget_too_small_exits_1(capsys):
  code, _, err = _run_cli([
      'plan', f'--cfg={CONFIG}', '--cfg.__args__.tiny=True',
      '--host-ram-budget=1KiB',
  ], capsys)
  assert code == 1
  assert 'Raise host_ram_budget' in err


def test_python_m_kd_ckpt_plan_with_konfig_overrides():
  """The entry point, with --cfg flags as kauldron.main takes them."""
  proc = _run_module([
      'plan', '--cfg', str(CONFIG), '--cfg.__args__.tiny=True',
      '--cfg.checkpointer='
      'py::kd_ckpt.SafeCheckpointer(save_interval_steps=2, host_ram_budget="48MiB")',
      '--num-devices=2', '--platform=gpu',
  ])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'checkpointer  SafeCheckpointer' in proc.stdout
  assert 'devices       2 (cpu); planned for gpu' in proc.stdout
  assert 'budget            48.00 MiB (48MiB)' in proc.stdout
  assert 'kd_ckpt save plan' in proc.stdout


# ---------------------------------------------------------------------------
# inspect.


def _tree():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  w = jax.device_put(
      jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32),
      jax.sharding.NamedSharding(mesh, P('x')),
  )
  return {
      'params': {'w': w, 'b': jnp.ones((10,), jnp.bfloat16)},
      'step': jnp.asarray(7, jnp.int32),
  }


EXPECTED_LEAVES = [
    {'path': 'params.b', 'shape': [10], 'dtype': 'bfloat16', 'bytes': 20},
    {'path': 'params.w', 'shape': [64, 32], 'dtype': 'float32', 'bytes': 8192},
    {'path': 'step', 'shape': [], 'dtype': 'int32', 'bytes': 4},
]


def test_inspect_kd_ckpt_checkpoint(tmp_path, capsys):
  report = kd_ckpt.save(tmp_path / 'ckpt', _tree(), host_ram_budget='256MiB')
  code, out, err = _run_cli(['inspect', tmp_path / 'ckpt', '--json'], capsys)
  assert code == 0, err
  info = json.loads(out)
  assert info['leaves'] == EXPECTED_LEAVES
  assert info['num_leaves'] == 3
  assert info['total_bytes'] == 20 + 8192 + 4
  assert info['disk_bytes'] > 0
  assert info['saved_by'] == 'kd_ckpt'
  assert info['step'] is None
  assert info['report']['strategy'] == report.strategy
  assert info['report']['settings'] == report.settings
  assert info['report']['budget_bytes'] == 256 * 2**20
  assert info['report']['bytes_written'] == report.bytes_written


def _kauldron_workdir(root: pathlib.Path) -> pathlib.Path:
  """workdir/checkpoints/ckpt_{1,3}/default like Kauldron's, + a tmp dir."""
  ckpts = root / 'checkpoints'
  small = {'step': jnp.asarray(1, jnp.int32), 'w': jnp.zeros((4,), jnp.float32)}
  with ocp.StandardCheckpointer() as c:
    c.save(ckpts / 'ckpt_1' / 'default', small)
    c.save(ckpts / 'ckpt_3' / 'default', _tree())
  # An unfinished save (Orbax's tmp name) and an unrelated folder are skipped.
  (ckpts / 'ckpt_5.orbax-checkpoint-tmp-123' / 'default').mkdir(parents=True)
  (ckpts / 'ckpt_9').mkdir()
  (ckpts / 'ckpt_3' / kd_ckpt.report.REPORT_FILE_NAME).write_text(json.dumps({
      'strategy': 'streaming', 'settings': 'slices of 1.00 MiB, 2 in flight',
      'budget_bytes': 2**20, 'peak_extra_bytes': 12345,
  }))
  return root


@pytest.mark.parametrize('where,step', [
    ('.', 3), ('checkpoints', 3), ('checkpoints/ckpt_3', 3),
    ('checkpoints/ckpt_3/default', 3), ('checkpoints/ckpt_1', 1),
])
def test_inspect_kauldron_layouts(tmp_path, capsys, where, step):
  workdir = _kauldron_workdir(tmp_path)
  code, out, err = _run_cli(['inspect', workdir / where, '--json'], capsys)
  assert code == 0, err
  info = json.loads(out)
  assert info['step'] == step
  assert info['directory'] == str(workdir / 'checkpoints' / f'ckpt_{step}' / 'default')
  if step == 3:
    assert info['leaves'] == EXPECTED_LEAVES
    assert info['saved_by'] == 'kd_ckpt'
    assert info['report']['strategy'] == 'streaming'
    assert info['report']['peak_extra_bytes'] == 12345
  else:
    assert info['leaves'] == [
        {'path': 'step', 'shape': [], 'dtype': 'int32', 'bytes': 4},
        {'path': 'w', 'shape': [4], 'dtype': 'float32', 'bytes': 16},
    ]
    assert info['saved_by'] == 'orbax'
    assert info['report'] is None


def test_inspect_step_numbered_folder(tmp_path, capsys):
  """A loop's `kd_ckpt.save(f'{root}/{step}', ...)` folders: the latest."""
  for step in (5, 10):
    kd_ckpt.save(tmp_path / str(step), _tree(), host_ram_budget='256MiB')
  (tmp_path / '15.orbax-checkpoint-tmp-1').mkdir()  # unfinished
  code, out, err = _run_cli(['inspect', tmp_path, '--json'], capsys)
  assert code == 0, err
  info = json.loads(out)
  assert info['step'] == 10
  assert info['directory'] == str(tmp_path / '10')
  assert info['leaves'] == EXPECTED_LEAVES
  assert info['saved_by'] == 'kd_ckpt'


def test_inspect_text_through_python_m(tmp_path):
  workdir = _kauldron_workdir(tmp_path)
  proc = _run_module(['inspect', workdir])
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0] == f'checkpoint  {workdir}/checkpoints/ckpt_3/default'
  assert lines[1] == 'step        3'
  assert lines[2].startswith('leaves      3, 8.02 KiB (')  # 8216 B
  assert 'saved by    kd_ckpt, strategy streaming (slices of 1.00 MiB, 2 in flight)' in lines
  rows = [l.split() for l in lines[lines.index('') + 3:]]  # after the header and rule
  assert rows == [
      ['params.b', '(10,)', 'bfloat16', '20', 'B'],
      ['params.w', '(64,', '32)', 'float32', '8.00', 'KiB'],
      ['step', '()', 'int32', '4', 'B'],
  ]


def test_inspect_errors(tmp_path, capsys):
  code, _, err = _run_cli(['inspect', tmp_path], capsys)
  assert code == 2
  assert 'no checkpoint in' in err
  code, _, err = _run_cli(['inspect', tmp_path / 'missing'], capsys)
  assert code == 2
  assert 'no such directory' in err


# ---------------------------------------------------------------------------
# tools/find_python.sh


def _find_python(env) -> subprocess.CompletedProcess:
  return subprocess.run(
      ['/bin/bash', str(REPO / 'tools' / 'find_python.sh')],
      capture_output=True, text=True, env=env, check=False, timeout=60,
  )


def test_find_python_honours_kd_python():
  proc = _find_python({'PATH': os.environ['PATH'], 'KD_PYTHON': sys.executable})
  assert proc.returncode == 0, proc.stderr
  found = pathlib.Path(proc.stdout.strip())
  ok = subprocess.run([found, '-c', 'import sys; print(sys.version_info >= (3, 12))'],
                      capture_output=True, text=True, check=True)
  assert ok.stdout.strip() == 'True'


def test_find_python_explains_failure(tmp_path):
  old = tmp_path / 'python3'
  old.write_text('#!/bin/sh\necho "Python 3.11.2"\nexit 1\n')
  old.chmod(0o755)
  env = {'PATH': f'{tmp_path}:/usr/bin:/bin', 'HOME': str(tmp_path)}
  for name in ('python3.12', 'python3.13'):
    if any((pathlib.Path(d) / name).exists() for d in ('/usr/bin', '/bin')):
      pytest.skip(f'{name} is installed system-wide')
  proc = _find_python(env)
  assert proc.returncode == 1
  for looked_at in ('python3.13', 'python3.12', 'versions/3.1[2-9]*/bin/python3',
                    'python3 on PATH'):
    assert looked_at in proc.stderr
  proc = _find_python({**env, 'KD_PYTHON': str(old)})
  assert proc.returncode == 1
  assert f'KD_PYTHON={old}' in proc.stderr
