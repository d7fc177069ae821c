"""The README and the examples run as written.

Every fenced ```python / ```sh block of README.md and examples/*.md runs,
unless the line above it says why not (`<!-- not run: reason -->`): the python
blocks of one file run in order in one fresh interpreter (8 CPU devices), its
sh blocks after them with `python` meaning this interpreter.  Paths under
/tmp/ are moved under pytest's tmp_path.  Every examples/*.py runs too, with
small arguments, and must have an entry in EXAMPLE_RUNS.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ['README.md'] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'examples', '*.md')))
_FENCE = re.compile(r'^```(\w*)\s*$')
_NOT_RUN = re.compile(r'<!--\s*not run:\s*(\S.*?)\s*-->')

# Each example with arguments small enough for CI; {tmp} is pytest's tmp_path.
EXAMPLE_RUNS = {
    'peak_demo.py': ['--state-mib=32', '--budget=64MiB', '--out={tmp}/plot'],
    'seed000_orbax_vs_kd_ckpt.py': ['--params=4e6', '--host-ram-budget=64MiB'],
    'orbax_manager_loop.py': [
        '--ckpt-dir={tmp}/loop', '--steps=6', '--save-interval-steps=2',
        '--max-to-keep=2', '--host-ram-budget=64MiB'],
    'gemma_weights.py': ['{tmp}/weights'],
}
# What each example's output must show (a run that prints nothing useful fails).
EXAMPLE_EXPECT = {
    'peak_demo.py': r'stock Orbax .*MiB',
    'seed000_orbax_vs_kd_ckpt.py': r'restored bit-exact: True',
    'orbax_manager_loop.py': r'done at step 6; kept steps \[4, 6\]',
    'gemma_weights.py': r'wrote 8 leaves of DummyGemma weights',
}


@dataclasses.dataclass(frozen=True)
class Block:
  path: str
  line: int
  lang: str
  text: str
  skip_reason: str | None


def blocks(path: str) -> list[Block]:
  """The fenced python/sh blocks of a markdown file, with their skip markers."""
  lines = open(os.path.join(ROOT, path)).read().splitlines()
  out, i = [], 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    start, lang = i, m.group(1)
    j = i + 1
    while j < len(lines) and not lines[j].startswith('```'):
      j += 1
    prev = next((l for l in reversed(lines[:start]) if l.strip()), '')
    skip = _NOT_RUN.search(prev)
    if lang in ('python', 'sh'):
      out.append(Block(path, start + 1, lang, '\n'.join(lines[start + 1:j]),
                       skip.group(1) if skip else None))
    elif lang == '':
      raise AssertionError(f'{path}:{start + 1}: a fence without a language')
    i = j + 1
  return out


def _env(tmp_path) -> dict[str, str]:
  env = dict(os.environ)
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
  env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
  env['TMPDIR'] = str(tmp_path)
  return env


def _run(cmd: list[str], tmp_path, what: str) -> str:
  proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True,
                        text=True, timeout=600)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, f'{what} failed (exit {proc.returncode}):\n{out[-6000:]}'
  return out


def test_every_block_runs_or_says_why_not():
  for path in DOCS:
    for b in blocks(path):
      if b.skip_reason is not None:
        assert len(b.skip_reason) > 10, f'{path}:{b.line}: say why the block does not run'
  assert any(b.skip_reason is None for b in blocks('README.md'))


@pytest.mark.parametrize('path', DOCS)
def test_markdown_blocks_run(path, tmp_path):
  todo = [b for b in blocks(path) if b.skip_reason is None]
  if not todo:
    pytest.skip(f'{path}: every block says why it does not run')
  move = lambda s: s.replace('/tmp/', f'{tmp_path}/')
  py = [b for b in todo if b.lang == 'python']
  if py:
    script = tmp_path / 'blocks.py'
    script.write_text('\n\n'.join(
        f'# --- {b.path}:{b.line}\n{move(b.text)}' for b in py))
    _run([sys.executable, str(script)], tmp_path, f'python blocks of {path}')
  for b in todo:
    if b.lang == 'sh':
      _run(['bash', '-euo', 'pipefail', '-c', move(b.text)], tmp_path,
           f'{path}:{b.line} (sh)')


def test_every_example_has_a_run():
  scripts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, 'examples', '*.py')))
  assert scripts == sorted(EXAMPLE_RUNS), 'add the new example to EXAMPLE_RUNS'


@pytest.mark.parametrize('name', sorted(EXAMPLE_RUNS))
def test_example_runs(name, tmp_path):
  args = [a.format(tmp=tmp_path) for a in EXAMPLE_RUNS[name]]
  out = _run([sys.executable, os.path.join(ROOT, 'examples', name), *args], tmp_path, name)
  assert re.search(EXAMPLE_EXPECT[name], out), out[-4000:]
