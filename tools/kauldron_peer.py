"""Kauldron's own checkpointer test suite, with stock Kauldron and with kd_ckpt.

  tools/fetch_kauldron_tests.sh /tmp/kauldron_src
  .venv/bin/python tools/kauldron_peer.py --kauldron-src=/tmp/kauldron_src

Runs `kauldron/checkpoints/checkpointer_test.py` once per mode, each in its
own pytest process:

  stock       kd.ckpts.Checkpointer as Kauldron ships it
  streaming   every `checkpoints.Checkpointer(...)` the suite builds is a
  orbax       kd_ckpt.SafeCheckpointer(strategy=MODE, ...)
  auto

and exits 1 listing every test that passes with stock Kauldron but not
with a kd_ckpt strategy.  Nothing is vendored: the suite comes from a
google-research/kauldron checkout (or what the fetch script extracts).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
SUITE = 'kauldron/checkpoints/checkpointer_test.py'
MODES = ('stock', 'streaming', 'orbax', 'auto')

# Loaded by pytest (`-p kd_peer_plugin`) before the suite imports Kauldron.
PLUGIN = '''
import functools, os
strategy = os.environ['KD_PEER_STRATEGY']
if strategy != 'stock':
  from kauldron import checkpoints
  import kd_ckpt
  checkpoints.Checkpointer = functools.partial(kd_ckpt.SafeCheckpointer, strategy=strategy)
'''


def run(src: pathlib.Path, mode: str, tmp: pathlib.Path) -> dict[str, str]:
  report = tmp / f'{mode}.json'
  env = {**os.environ, 'KD_PEER_STRATEGY': mode,
         'PYTHONPATH': os.pathsep.join([str(tmp), str(REPO), os.environ.get('PYTHONPATH', '')]),
         'JAX_PLATFORMS': 'cpu'}
  proc = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-p', 'kd_peer_plugin', '-p', 'no:cacheprovider',
       f'--rootdir={tmp}', '-o', 'addopts=', str(src / SUITE),
       '--junitxml', str(tmp / f'{mode}.xml')],
      cwd=tmp, env=env, capture_output=True, text=True, timeout=1200)
  outcomes = _junit(tmp / f'{mode}.xml')
  report.write_text(json.dumps(outcomes))
  if not outcomes:
    print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
  return outcomes


def _junit(path: pathlib.Path) -> dict[str, str]:
  import xml.etree.ElementTree as ET  # pylint: disable=g-import-not-at-top
  if not path.exists():
    return {}
  out = {}
  for case in ET.parse(path).getroot().iter('testcase'):
    name = case.get('name')
    if case.find('failure') is not None or case.find('error') is not None:
      out[name] = 'failed'
    elif case.find('skipped') is not None:
      out[name] = 'skipped'
    else:
      out[name] = 'passed'
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--kauldron-src', required=True, type=pathlib.Path)
  ap.add_argument('--json', type=pathlib.Path, default=None)
  args = ap.parse_args()
  if not (args.kauldron_src / SUITE).exists():
    print(f'error: no {SUITE} under {args.kauldron_src}; run'
          ' tools/fetch_kauldron_tests.sh DIR first', file=sys.stderr)
    return 2
  results = {}
  with tempfile.TemporaryDirectory(prefix='kd_kauldron_peer_') as tmp:
    tmp = pathlib.Path(tmp)
    (tmp / 'kd_peer_plugin.py').write_text(PLUGIN)
    for mode in MODES:
      results[mode] = run(args.kauldron_src, mode, tmp)
      n = sum(v == 'passed' for v in results[mode].values())
      print(f'{mode:<10} {n}/{len(results[mode])} passed', flush=True)
  stock_ok = {t for t, v in results['stock'].items() if v == 'passed'}
  bad = 0
  for mode in MODES[1:]:
    missing = sorted(t for t in stock_ok if results[mode].get(t) != 'passed')
    print(f'{len(missing)} test(s) pass with stock but not with {mode}'
          + (f': {missing}' if missing else ''))
    bad += len(missing)
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
  return 1 if bad or not stock_ok else 0


if __name__ == '__main__':
  sys.exit(main())
