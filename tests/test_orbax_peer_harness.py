"""tools/orbax_peer.py: Orbax's handler test suites, run against kd_ckpt.

  KD_ORBAX_SRC=/tmp/orbax_src pytest -q tests/test_orbax_peer_harness.py

The run needs a google/orbax checkout (`tools/fetch_orbax_tests.sh DIR`
extracts what it needs) named by $KD_ORBAX_SRC, else it is skipped; the full
comparison is `make test-orbax-peer ORBAX_SRC=DIR`.  The other tests check how
the harness reads pytest's reports, without running any.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
HARNESS = REPO / 'tools' / 'orbax_peer.py'


def _harness():
  spec = importlib.util.spec_from_file_location('orbax_peer', HARNESS)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _rec(process, when, outcome, message=''):
  return dict(process=process, when=when, outcome=outcome, duration=0.5,
              message=message)


def test_outcome_over_phases_and_processes():
  outcome = _harness()._outcome
  ok = [_rec(p, w, 'passed') for p in (0, 1) for w in ('setup', 'call',
                                                       'teardown')]
  assert outcome(ok, 2)['outcome'] == 'passed'
  # Run by the primary process only: skipped by the other, still a pass.
  primary_only = ok[:3] + [_rec(1, 'setup', 'passed'), _rec(1, 'call',
                                                            'skipped')]
  assert outcome(primary_only, 2)['outcome'] == 'passed'
  # pytest reports the call passed even when a subTest failed.
  sub = ok + [_rec(1, 'subtest', 'failed', 'AssertionError: 1 != 2')]
  assert outcome(sub, 2) == dict(outcome='failed', duration=1.75,
                                 message='AssertionError: 1 != 2')
  teardown = ok[:5] + [_rec(1, 'teardown', 'failed')]
  assert outcome(teardown, 2)['outcome'] == 'error'
  assert outcome(ok[:3], 2)['outcome'] == 'error'  # Process 1 crashed.


def test_compare_lists_lost_tests(tmp_path):
  def run(mode, **outcomes):
    path = tmp_path / f'{mode}.json'
    path.write_text(json.dumps(dict(mode=mode, k=None, suites={'pytree': {}},
                                    tests={t: dict(outcome=o, message='boom')
                                           for t, o in outcomes.items()})))
    return str(path)

  stock = run('stock', a='passed', b='passed', c='failed')
  same = run('streaming', a='passed', b='passed', c='passed')
  lost = run('orbax', a='passed', b='error')
  main = _harness().main
  assert main(['--compare', stock, same]) == 0
  assert main(['--compare', stock, lost]) == 1


@pytest.mark.slow
def test_stock_orbax_passes_a_few_tests(tmp_path):
  src = os.environ.get('KD_ORBAX_SRC')
  if not src:
    pytest.skip('set KD_ORBAX_SRC to a google/orbax checkout '
                '(tools/fetch_orbax_tests.sh DIR); the full run is '
                '`make test-orbax-peer ORBAX_SRC=DIR`')
  out = tmp_path / 'stock.json'
  proc = subprocess.run(
      [sys.executable, str(HARNESS), f'--orbax-src={src}', '--mode=stock',
       '--suite=standard', '-k', 'test_basic', f'--json={out}',
       f'--log-dir={tmp_path}'],
      capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  result = json.loads(out.read_text())
  assert result['suites']['standard']['counts'].get('passed', 0) > 0, result
  assert {t['outcome'] for t in result['tests'].values()} == {'passed'}
