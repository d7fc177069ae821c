"""Runs Orbax's own handler test suites, with stock Orbax or kd_ckpt plugged in.

  python tools/orbax_peer.py --orbax-src=DIR --mode=stock [--json OUT] [-k EXPR]
  python tools/orbax_peer.py --orbax-src=DIR --mode=all --json OUT
  python tools/orbax_peer.py --compare OUT.stock.json OUT.streaming.json

DIR is a google/orbax checkout, or what `tools/fetch_orbax_tests.sh DIR`
extracts of one (nothing of Orbax's is vendored here).  Each suite
(standard_checkpoint_handler_test.py, pytree_checkpoint_handler_test.py) runs
under pytest against the *installed* orbax-checkpoint, as Orbax's CI runs it:
`--processes` (default 2) JAX processes joined by `jax.distributed` on
localhost, 8 fake CPU devices in all.  Only test helpers the wheel lacks
(orbax.checkpoint._src.testing.multiprocess_test, oss/multiprocess_test) come
from DIR.  A test passes if it passes in one process and fails in none.

`--mode=streaming|orbax|auto` first calls `kd_ckpt.testing.install_orbax_peer(mode)`
(kd_ckpt's jax.Array type handler registered globally, StandardCheckpointHandler
resolving to kd_ckpt's) from a pytest plugin written to a temporary folder.
`--mode=all` runs stock, streaming, orbax and auto (`--json OUT`: OUT.stock.json, ...)
and, as `--compare` does, lists the tests passing with stock Orbax but not
with kd_ckpt.

Exit status: 0 the suites ran (whatever their outcomes); 1 a test passing with
stock Orbax does not pass with kd_ckpt; 2 bad arguments, no kd_ckpt.testing,
a suite that did not run to its end (crash, timeout, pytest error), or a
kd_ckpt mode whose jax.Array handler or StandardCheckpointHandler (checked
before and after the suite) was not kd_ckpt's.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

SUITES = {
    'standard': 'standard_checkpoint_handler_test.py',
    'pytree': 'pytree_checkpoint_handler_test.py',
}
MODES = ('stock', 'streaming', 'orbax', 'auto')
DEVICES = 8
# A test's outcome over the processes: the first of these that one of them has.
_RANK = ('error', 'failed', 'xpassed', 'passed', 'xfailed', 'skipped')
_OK_EXITS = (0, 1, 5)  # pytest: all passed, some failed, -k selected none.
_PLUGIN = 'kd_orbax_peer_plugin'
_PLUGIN_SOURCE = '''\
"""Written by kd_ckpt's tools/orbax_peer.py, which documents it."""
import importlib.abc, importlib.util, json, os, sys
import pytest

_ENV = os.environ
_OUT = open(_ENV['KD_PEER_RESULTS'], 'a', buffering=1)
_HANDLERS = []


class _MissingTestHelpers(importlib.abc.MetaPathFinder):
  """Last on sys.meta_path: orbax.checkpoint._src.testing.* the wheel lacks."""

  def find_spec(self, name, path=None, target=None):
    parts = name.split('.')
    file = os.path.join(_ENV['KD_PEER_PKG'], *parts[2:]) + '.py'
    if parts[:4] == ['orbax', 'checkpoint', '_src', 'testing'] and len(
        parts) > 4 and os.path.isfile(file):
      return importlib.util.spec_from_file_location(name, file)


def pytest_configure(config):
  from absl import flags
  import jax
  flags.FLAGS.mark_as_parsed()  # As Orbax's own conftest.py does.
  sys.meta_path.append(_MissingTestHelpers())
  jax.distributed.initialize(_ENV['KD_PEER_COORDINATOR'],
                             int(_ENV['KD_PEER_PROCESSES']),
                             int(_ENV['KD_PEER_PROCESS_ID']))
  if (mode := _ENV['KD_PEER_MODE']) != 'stock':
    try:
      from kd_ckpt.testing import install_orbax_peer
    except ImportError as e:
      raise pytest.UsageError(f'--mode={mode} needs kd_ckpt.testing.'
                              f'install_orbax_peer: {e!r}') from e
    install_orbax_peer(mode)
  _HANDLERS.append(_handlers())


def _handlers():
  """The jax.Array type handler and StandardCheckpointHandler in use."""
  import jax
  from orbax.checkpoint._src.handlers import standard_checkpoint_handler
  from orbax.checkpoint._src.serialization import type_handler_registry
  registry = type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY
  return [f'{c.__module__}.{c.__qualname__}' for c in (
      type(registry.get(jax.Array)),
      standard_checkpoint_handler.StandardCheckpointHandler)]


def pytest_sessionfinish(session):
  _OUT.write(json.dumps(dict(id='', when='handlers', at_start=_HANDLERS[0],
                             at_end=_handlers())) + '\\n')


def _log(report, when, outcome):
  crash, longrepr = getattr(report.longrepr, 'reprcrash', None), report.longrepr
  msg = crash.message if crash else (
      longrepr[2] if isinstance(longrepr, tuple) else str(longrepr or ''))
  _OUT.write(json.dumps(dict(id=report.nodeid, when=when, outcome=outcome,
                             duration=getattr(report, 'duration', 0.0),
                             message=msg[:400])) + '\\n')


def pytest_runtest_logreport(report):
  if type(report).__name__ == 'SubtestReport':
    if report.failed:  # A failed subTest fails its test.
      _log(report, 'subtest', 'failed')
  elif hasattr(report, 'wasxfail'):
    _log(report, report.when, 'xfailed' if report.skipped else 'xpassed')
  else:
    _log(report, report.when, report.outcome)


def pytest_collectreport(report):
  if report.failed:
    _log(report, 'collect', 'error')
'''


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _package_dir(src: pathlib.Path) -> pathlib.Path:
  """Returns the orbax/checkpoint folder of DIR that holds the suites."""
  for sub in ('checkpoint/orbax/checkpoint', 'orbax/checkpoint', '.'):
    pkg = (src / sub).resolve()
    if all((pkg / '_src/handlers' / f).is_file() for f in SUITES.values()):
      return pkg
  _fail(f'--orbax-src={src} lacks checkpoint/orbax/checkpoint/_src/handlers/'
        f'*_test.py\nhint: tools/fetch_orbax_tests.sh {src}')


def _require_kd_testing(mode: str) -> None:
  """Exits with a clear message if there is no kd_ckpt.testing yet."""
  spec = importlib.util.find_spec('kd_ckpt')  # Does not run kd_ckpt.
  dirs = [pathlib.Path(d) for d in spec.submodule_search_locations or []
          ] if spec else []
  if not any((d / 'testing.py').is_file() or (d / 'testing').is_dir()
             for d in dirs):
    _fail(f'--mode={mode} needs kd_ckpt.testing.install_orbax_peer(mode), '
          f'and {sys.executable} finds no kd_ckpt.testing (kd_ckpt: '
          f'{", ".join(map(str, dirs)) or "not installed"}).')


def _outcome(records: list[dict[str, Any]], processes: int) -> dict[str, Any]:
  """One test's outcome from its reports (phases x processes).

  In one process: error if its setup, teardown or collection failed; failed
  if a subTest failed; else the call's outcome.  Over the processes: the
  first in _RANK (a test only process 0 runs, skipped by the others, passes).
  """
  finals, by_process = [], collections.defaultdict(list)
  for r in records:
    by_process[r['process']].append(r)
  for recs in by_process.values():
    bad = [r for r in recs
           if r['when'] != 'call' and r['outcome'] not in ('passed', 'skipped')]
    call = [r for r in recs if r['when'] == 'call']
    if bad:
      kind = 'failed' if bad[0]['when'] == 'subtest' else 'error'
      finals.append(dict(bad[0], outcome=kind))
    elif call or recs[0]['outcome'] == 'skipped':
      finals.append((call or recs)[0])
    else:
      finals.append(dict(recs[0], outcome='error', message='no call (crash?)'))
  first = min(finals, key=lambda r: _RANK.index(r['outcome']))
  total = sum(r['duration'] for r in records)
  out = dict(outcome=first['outcome'], message=first['message'],
             duration=round(total / processes, 3))
  if len(by_process) < processes and first['when'] != 'collect':
    missing = sorted(set(range(processes)) - set(by_process))
    out.update(outcome='error', message=f'no result from process(es) {missing}')
  return out


def run_suite(mode: str, suite: str, pkg: pathlib.Path, work: pathlib.Path,
              args: argparse.Namespace) -> tuple[dict[str, Any], dict]:
  """Runs one suite in `args.processes` pytest processes."""
  n = args.processes
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  xla = [f for f in os.environ.get('XLA_FLAGS', '').split()
         if not f.startswith('--xla_force_host_platform_device_count')]
  xla.append(f'--xla_force_host_platform_device_count={DEVICES // n}')
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=' '.join(xla),
             PYTHONPATH=os.pathsep.join(filter(None, [
                 str(work), os.environ.get('PYTHONPATH')])),
             PYTHONDONTWRITEBYTECODE='1', KD_PEER_PKG=str(pkg),
             KD_PEER_MODE=mode, KD_PEER_PROCESSES=str(n),
             KD_PEER_COORDINATOR=f'localhost:{port}',
             TEST_TMPDIR=tempfile.mkdtemp(prefix=f'{suite}-', dir=work))
  handlers = pkg / '_src/handlers'
  cmd = [sys.executable, '-P', '-m', 'pytest', str(handlers / SUITES[suite]),
         '-p', _PLUGIN, '-c', str(work / 'pytest.ini'), '--rootdir',
         str(handlers), '--import-mode=importlib', '--noconftest',
         '-p', 'no:cacheprovider', '-q', '--tb=short', '--disable-warnings']
  cmd += (['-k', args.k] if args.k else []) + args.pytest_args
  # `-P` keeps the cwd off sys.path.  The tests open
  # orbax/checkpoint/testing/*.checkpoint relative to the cwd: the wheel's.
  cwd = pathlib.Path(
      importlib.util.find_spec('orbax').submodule_search_locations[0]).parent
  logs = [pathlib.Path(args.log_dir) / f'{mode}-{suite}.p{i}.log'
          for i in range(n)]
  results = [work / f'{mode}-{suite}.p{i}.jsonl' for i in range(n)]
  print(f'[{mode}] {suite}: {n} process(es), log {logs[0]}', flush=True)
  start, procs = time.monotonic(), []
  for i in range(n):
    with open(logs[i], 'w') as log:
      procs.append(subprocess.Popen(
          cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=dict(
              env, KD_PEER_PROCESS_ID=str(i), KD_PEER_RESULTS=str(results[i]))))
  while any(p.poll() is None for p in procs):
    time.sleep(0.2)
    late = time.monotonic() - start > args.timeout
    if late or any(p.poll() not in (None, *_OK_EXITS) for p in procs):
      for p in procs:  # The others would wait at Orbax's barriers.
        if p.poll() is None:
          p.kill()
          p.wait()
          p.returncode = 'timeout' if late else 'killed'
  records, handlers = collections.defaultdict(list), {}
  for i, path in enumerate(results):
    for line in path.read_text().splitlines() if path.exists() else []:
      if (rec := json.loads(line))['when'] != 'handlers':
        records[rec['id']].append(dict(rec, process=i))
      elif not handlers:
        handlers = {k: rec[k] for k in ('at_start', 'at_end')}
  tests = {t: _outcome(r, n) for t, r in records.items()}
  exits = [p.returncode for p in procs]
  # The log of the first process that broke (before those killed after it).
  for i in sorted((i for i, rc in enumerate(exits) if rc not in _OK_EXITS),
                  key=lambda i: isinstance(exits[i], str))[:1]:
    tail = logs[i].read_text(errors='replace')[-2000:]
    print(f'[{mode}] {suite}: process {i} did not run to its end '
          f'({exits[i]}); {logs[i]} ends:\n{tail}', file=sys.stderr)
  # A kd_ckpt mode proves nothing unless kd_ckpt's handlers were in use.
  peer_ok = mode == 'stock' or all(h.startswith('kd_ckpt') for h in (
      handlers.get('at_start', []) + handlers.get('at_end', [])))
  if not peer_ok:
    print(f'[{mode}] {suite}: error: not kd_ckpt\'s (jax.Array type handler, '
          f'StandardCheckpointHandler) {handlers}', file=sys.stderr)
  return dict(file=SUITES[suite], exits=exits, logs=list(map(str, logs)),
              handlers=handlers, peer_ok=peer_ok,
              duration_s=round(time.monotonic() - start, 1), counts=dict(
                  collections.Counter(r['outcome'] for r in tests.values()))
              ), tests


def run_mode(mode: str, pkg: pathlib.Path, args: argparse.Namespace) -> dict:
  """Runs the selected suites in one mode; returns the JSON-able result."""
  rev = next((p / 'ORBAX_REVISION' for p in pkg.parents
              if (p / 'ORBAX_REVISION').is_file()), None)
  result = dict(mode=mode, orbax_src=str(pkg), k=args.k,
                processes=args.processes,
                orbax_checkpoint=importlib.metadata.version('orbax-checkpoint'),
                orbax_revision=rev.read_text().strip() if rev else None,
                suites={}, tests={})
  with tempfile.TemporaryDirectory(prefix='kd_orbax_peer_') as work:
    work = pathlib.Path(work)
    (work / f'{_PLUGIN}.py').write_text(_PLUGIN_SOURCE)
    (work / 'pytest.ini').write_text('[pytest]\n')
    for suite in args.suite or SUITES:
      result['suites'][suite], tests = run_suite(mode, suite, pkg, work, args)
      result['tests'].update(tests)
  print(f'{mode}: suite     passed failed skipped errors  seconds')
  for suite, s in result['suites'].items():
    c = collections.Counter(s['counts'])
    broken = set(s['exits']) - set(_OK_EXITS)
    print(f'{mode}: {suite:<9}{c["passed"]:>7}{c["failed"]:>7}{c["skipped"]:>8}'
          f'{c["error"]:>7}{s["duration_s"]:>9.0f}' +
          (f'  (pytest exits {s["exits"]})' if broken else ''))
  return result


def compare(stock: dict, kd: dict) -> list[str]:
  """Prints and returns the tests passing in `stock` but not in `kd`."""
  if (stock['k'], set(stock['suites'])) != (kd['k'], set(kd['suites'])):
    print('warning: the two runs selected different tests (-k, --suite).')
  ok = lambda run, t: run['tests'].get(t, {}).get('outcome') == 'passed'
  lost = sorted(t for t in stock['tests'] if ok(stock, t) and not ok(kd, t))
  gained = [t for t in kd['tests'] if ok(kd, t) and not ok(stock, t)]
  print(f'\n{kd["mode"]}: {len(lost)} test(s) pass with {stock["mode"]} but '
        f'not with {kd["mode"]}; {len(gained)} the other way round.')
  for t in lost:
    r = kd['tests'].get(t, dict(outcome='not run', message=''))
    message = ' '.join(r['message'].split())[:200]
    print(f'  {r["outcome"]:<8} {t}\n    {message}')
  return lost


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--orbax-src', help='google/orbax checkout or extract')
  parser.add_argument('--mode', choices=MODES + ('all',), default='stock')
  parser.add_argument('--json', help='write the per-test outcomes here')
  parser.add_argument('-k', help='pytest -k expression')
  parser.add_argument('--suite', action='append', choices=list(SUITES),
                      help='only this suite (repeatable; default: both)')
  parser.add_argument('--compare', nargs=2, metavar=('STOCK_JSON', 'KD_JSON'))
  parser.add_argument('--processes', type=int, choices=(1, 2, 4, 8), default=2,
                      help=f'JAX processes sharing the {DEVICES} CPU devices')
  parser.add_argument('--timeout', type=int, default=1800,
                      help='seconds per suite (default 1800)')
  parser.add_argument('--log-dir', help='pytest logs (default: a temp dir)')
  parser.add_argument('pytest_args', nargs='*', help='after --: to pytest')
  args = parser.parse_args(argv)
  if args.compare:
    stock, kd = (json.loads(pathlib.Path(p).read_text()) for p in args.compare)
    return 1 if compare(stock, kd) else 0
  if not args.orbax_src:
    parser.error('--orbax-src=DIR is required (tools/fetch_orbax_tests.sh DIR)')
  pkg = _package_dir(pathlib.Path(args.orbax_src))
  modes = MODES if args.mode == 'all' else (args.mode,)
  for mode in set(modes) - {'stock'}:
    _require_kd_testing(mode)
  args.log_dir = args.log_dir or tempfile.mkdtemp(prefix='kd_orbax_peer_logs_')
  os.makedirs(args.log_dir, exist_ok=True)
  results = {mode: run_mode(mode, pkg, args) for mode in modes}
  for mode, result in results.items() if args.json else ():
    out = pathlib.Path(args.json)
    if args.mode == 'all':
      out = out.with_name(f'{out.stem}.{mode}{out.suffix or ".json"}')
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + '\n')
    print(f'{mode}: per-test outcomes in {out}')
  lost = [t for m in modes[1:] for t in compare(results['stock'], results[m])]
  ran = all(set(s['exits']) <= set(_OK_EXITS) and s['peer_ok']
            for r in results.values() for s in r['suites'].values())
  return 1 if lost else 0 if ran else 2


if __name__ == '__main__':
  sys.exit(main())
