"""Tests for the benchmark harness (bench/measure.py) and smoke runs of bench/."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / 'bench'
sys.path.insert(0, str(BENCH))
import measure  # pylint: disable=g-import-not-at-top,wrong-import-position

MiB = measure.MiB


# --------------------------------------------------------------------------
# Peak RSS.


def test_peak_sees_a_100mb_allocation():
  # Earlier tests' cyclic garbage, collected inside the block, would lower
  # RSS under the baseline: collect it first, then trim.
  gc.collect()
  measure.malloc_trim()
  with measure.Peak() as p:
    a = np.empty(100 * 10**6, dtype=np.uint8)
    a[::4096] = 1  # touch every page
    del a
  assert p.exact, 'clear_refs reset refused: peak is the lifetime HWM'
  assert p.extra_bytes >= 90 * 10**6, p.extra_bytes
  assert p.extra_bytes < 200 * 10**6, p.extra_bytes


def test_peak_is_reset_between_blocks():
  with measure.Peak():
    a = np.ones(100 * MiB, dtype=np.uint8)
    del a
  gc.collect()
  measure.malloc_trim()
  with measure.Peak() as q:
    b = np.ones(1 * MiB, dtype=np.uint8)
    del b
  # The earlier 100 MiB peak must not show up in this block.
  assert q.extra_bytes < 20 * MiB, q.extra_bytes


def test_peak_retained_bytes_sees_kept_memory():
  gc.collect()  # as in test_peak_sees_a_100mb_allocation
  measure.malloc_trim()
  with measure.Peak() as p:
    kept = np.ones(50 * MiB, dtype=np.uint8)
  assert p.retained_bytes >= 45 * MiB
  assert p.extra_bytes >= 45 * MiB
  del kept


def test_heap_bytes_sees_an_allocation():
  # Garbage of earlier tests freed between the two readings (a collection
  # the allocation triggers) would hide part of it: none is left, and none
  # is collected meanwhile.
  gc.collect()
  gc.disable()
  try:
    before = measure.heap_bytes()
    if before is None:
      pytest.skip('no glibc mallinfo2')
    a = np.ones(20 * MiB, dtype=np.uint8)
    after = measure.heap_bytes()
  finally:
    gc.enable()
  assert after['in_use'] - before['in_use'] >= 19 * MiB
  assert after['footprint'] >= after['in_use']
  del a


# --------------------------------------------------------------------------
# Sizes.


@pytest.mark.parametrize('text,want', [
    ('64MiB', 64 * MiB), ('1GiB', 1 << 30), ('256 MiB', 256 * MiB),
    ('1GB', 10**9), ('512', 512), (42, 42), ('1.5GiB', 3 << 29),
])
def test_parse_bytes(text, want):
  assert measure.parse_bytes(text) == want


def test_parse_bytes_rejects_junk():
  with pytest.raises(ValueError):
    measure.parse_bytes('lots')


@pytest.mark.parametrize('n,want', [
    (0, '0 B'), (512, '512 B'), (64 * MiB, '64.0 MiB'), (1.5 * MiB, '1.50 MiB'),
    (300 * MiB, '300 MiB'), (3 << 30, '3.00 GiB'), (-2 * MiB, '-2.00 MiB'),
    (None, '-'),
])
def test_fmt_bytes(n, want):
  assert measure.fmt_bytes(n) == want


# --------------------------------------------------------------------------
# Tables.


def _rows():
  return [
      {'state': 'sharded', 'variant': 'orbax default', 'budget_bytes': None,
       'peak_extra_bytes': 512 * MiB, 'seconds': 2.0, 'gb_per_sec': 0.25,
       'restore_extra_bytes': 600 * MiB, 'restored_bytes': 512 * MiB,
       'restore_seconds': 1.5, 'notes': 'async'},
      {'state': 'sharded', 'variant': 'kd_ckpt streaming', 'budget_bytes': 64 * MiB,
       'peak_extra_bytes': 32 * MiB, 'seconds': 4.0, 'gb_per_sec': 0.125,
       'restore_extra_bytes': 520 * MiB, 'restored_bytes': 512 * MiB,
       'restore_seconds': 3.0, 'notes': 'a|b'},
      {'state': 'sharded', 'variant': 'kd_ckpt auto', 'budget_bytes': 256 * MiB,
       'error': 'BudgetTooSmallError: nope'},
  ]


def _parse_md(md: str) -> list[list[str]]:
  lines = [l for l in md.strip().splitlines() if l.startswith('|')]
  return [[c.strip() for c in l.strip('|').split('|')] for l in lines]


def test_save_table_values():
  rows = _rows()
  measure.attach_orbax_default_seconds(rows)
  table = _parse_md(measure.save_table(rows))
  assert table[0] == list(measure.SAVE_COLUMNS)
  assert set(table[1]) == {'---'}
  body = [dict(zip(measure.SAVE_COLUMNS, r)) for r in table[2:]]
  assert len(body) == 3
  default, stream, auto = body
  assert default['variant'] == 'orbax default'
  assert default['budget'] == '-'
  assert default['peak extra RSS'] == '512 MiB'
  assert default['peak/budget'] == '-'
  assert default['x Orbax default'] == '1.00'
  assert default['restore extra - restored'] == '88.0 MiB'
  assert default['restore peak/budget'] == '-'
  assert stream['budget'] == '64 MiB'
  assert stream['peak extra RSS'] == '32.0 MiB'
  assert stream['peak/budget'] == '0.50'
  assert stream['save s'] == '4.00'
  assert stream['GB/s'] == '0.12'  # 0.125 rounds half-to-even
  assert stream['x Orbax default'] == '2.00'
  assert stream['restore extra RSS'] == '520 MiB'
  assert stream['restore extra - restored'] == '8.00 MiB'
  assert stream['restore peak/budget'] == '0.12'
  assert stream['restore s'] == '3.00'
  assert stream['notes'] == 'a/b'  # a pipe would break the table
  assert auto['peak extra RSS'] == '-'
  assert 'ERROR: BudgetTooSmallError: nope' in auto['notes']


def test_restore_overhead_counts_the_smaller_of_shards_and_retained():
  row = {'restore_extra_bytes': 600 * MiB, 'restored_bytes': 512 * MiB}
  assert measure.restore_overhead_bytes(row) == 88 * MiB
  # Shards that share one host buffer: their sum over-counts the arrays.
  assert measure.restore_overhead_bytes(dict(row, restore_retained_bytes=400 * MiB)) == 200 * MiB
  # RSS kept more than the arrays (garbage): the arrays are still 512 MiB.
  assert measure.restore_overhead_bytes(dict(row, restore_retained_bytes=550 * MiB)) == 88 * MiB
  assert measure.restore_overhead_bytes({'restore_extra_bytes': 1}) is None


def test_soak_table_values():
  mb = MiB
  soaks = [
      {'variant': 'orbax default', 'budget_bytes': None,
       'rss_after_bytes': [(1000 + 10 * i) * mb for i in range(50)],
       'peak_extra_bytes': [100 * mb] * 50, 'seconds': [1.0] * 50},
      {'variant': 'kd_ckpt streaming', 'budget_bytes': 256 * mb,
       'rss_after_bytes': [1000 * mb] * 4 + [1002 * mb] * 46,
       'peak_extra_bytes': [40 * mb] * 50, 'seconds': [2.0] * 50},
  ]
  table = _parse_md(measure.soak_table(soaks))
  assert table[0][4:7] == ['after save 5', 'after save 50', 'drift (5 -> 50)']
  orbax, kd = table[2], table[3]
  assert orbax[2] == '50'
  assert orbax[4] == measure.fmt_bytes(1040 * mb)
  assert orbax[5] == measure.fmt_bytes(1490 * mb)
  assert orbax[6] == '450 MiB'
  assert orbax[-1] == 'reference'
  cols = measure.soak_columns(50)
  kd = dict(zip(cols, kd))
  assert kd['drift (5 -> 50)'] == '0 B'
  assert kd['max peak extra'] == '40.0 MiB'
  assert kd['max peak/budget'] == '0.16'
  assert kd['mean save s'] == '2.00'
  assert kd['total save s'] == '100.00'
  assert kd['disk per checkpoint'] == '-'  # not recorded
  assert kd['malloc in-use drift'] == '-'  # no malloc figures recorded
  assert kd['verdict'] == 'pass'
  with_heap = dict(soaks[1], heap_in_use_bytes=[500 * mb] * 5 + [501 * mb] * 45,
                   disk_bytes_per_checkpoint=512 * mb)
  got = dict(zip(cols, _parse_md(measure.soak_table([with_heap]))[2]))
  assert got['malloc in-use drift'] == '1.00 MiB'
  assert got['disk per checkpoint'] == '512 MiB'
  over = dict(soaks[1], peak_extra_bytes=[40 * mb] * 49 + [265 * mb])
  assert dict(zip(cols, _parse_md(measure.soak_table([over]))[2]))['verdict'] == 'FAIL'


# --------------------------------------------------------------------------
# Thresholds.


def test_kd_limit_is_budget_plus_8_mib():
  assert measure.kd_limit_bytes(64 * MiB) == 72 * MiB
  assert measure.kd_limit_bytes(1 << 30) == (1 << 30) + 8 * MiB


def _kd_row(variant, budget, peak, restore_over=0):
  restored = 512 * MiB
  return {'state': 's', 'variant': variant, 'budget_bytes': budget,
          'peak_extra_bytes': peak, 'restored_bytes': restored,
          'restore_extra_bytes': restored + restore_over, 'restore_ok': True}


@pytest.mark.parametrize('variant', ['kd_ckpt auto', 'kd_ckpt orbax', 'kd_ckpt streaming'])
def test_check_rows_enforces_every_kd_row_save_and_restore(variant):
  budget = 64 * MiB
  limit = measure.kd_limit_bytes(budget)
  ok = _kd_row(variant, budget, limit, restore_over=limit)
  assert measure.check_rows([ok]) == []
  bad_save = _kd_row(variant, budget, limit + 1)
  failures = measure.check_rows([ok, bad_save])
  assert len(failures) == 1 and f's/{variant}@64 MiB' in failures[0], failures
  assert 'peak/budget 1.13' in failures[0]
  bad_restore = _kd_row(variant, budget, 1 * MiB, restore_over=limit + 1)
  failures = measure.check_rows([bad_restore])
  assert len(failures) == 1 and 'restore' in failures[0], failures
  no_restore = {k: v for k, v in ok.items() if not k.startswith('restore')}
  assert 'no restore measured' in measure.check_rows([no_restore])[0]
  # gpu_check skips the restores of its biggest states (--restore-max).
  assert measure.check_rows([dict(no_restore, restore_skipped=True)]) == []
  assert 'differ' in measure.check_rows([dict(ok, restore_ok=False)])[0]


def test_kd_rows_over_budget_inside_the_tolerance_are_listed():
  """They pass check_rows, and are named: the 4 GB leaf's save at 263 MiB
  under 256 MiB passed unnoticed until a charge was found wrong."""
  budget = 64 * MiB
  rows = [_kd_row('kd_ckpt streaming', budget, budget + 1, restore_over=budget),
          _kd_row('kd_ckpt auto', budget, budget, restore_over=budget + 2 * MiB),
          _kd_row('kd_ckpt orbax', budget, budget),
          {'state': 's', 'variant': 'orbax tuned', 'budget_bytes': budget,
           'peak_extra_bytes': budget + MiB}]
  assert measure.check_rows(rows[:3]) == []
  close = measure.kd_within_tolerance(rows)
  assert len(close) == 2, close
  assert 'kd_ckpt streaming' in close[0] and 'save peak' in close[0]
  assert 'kd_ckpt auto' in close[1] and 'restore' in close[1] and '1.03x' in close[1]


def test_check_rows_ignores_orbax_but_not_kd_errors():
  rows = [
      {'state': 's', 'variant': 'orbax default', 'budget_bytes': None,
       'peak_extra_bytes': 10 << 30},
      {'state': 's', 'variant': 'orbax tuned', 'budget_bytes': 64 * MiB,
       'error': 'ValueError: Requested more bytes'},
      {'state': 's', 'variant': 'orbax memory regulator', 'budget_bytes': 64 * MiB,
       'error': 'ValueError: min_memory_limit_gib must be less than target memory'},
  ]
  assert measure.check_rows(rows) == []
  rows.append({'state': 's', 'variant': 'kd_ckpt auto', 'budget_bytes': 64 * MiB,
               'error': 'RuntimeError: boom'})
  failures = measure.check_rows(rows)
  assert len(failures) == 1 and 'boom' in failures[0]


def test_soak_drift_and_check():
  flat = [500 * MiB] * 50
  assert measure.soak_drift(flat) == 0
  growing = [500 * MiB + i * MiB for i in range(50)]
  assert measure.soak_drift(growing) == 45 * MiB  # save 50 minus save 5
  assert measure.soak_drift([1, 2, 3]) == 2  # short soak: last minus first
  assert measure.soak_drift([1]) is None
  assert measure.check_soaks([{'variant': 'kd_ckpt auto', 'rss_after_bytes': flat}]) == []
  assert measure.check_soaks([{'variant': 'orbax default', 'rss_after_bytes': growing}]) == []
  failures = measure.check_soaks([{'variant': 'kd_ckpt streaming',
                                   'budget_bytes': 256 * MiB,
                                   'rss_after_bytes': growing}])
  assert len(failures) == 1 and 'drift' in failures[0]


# --------------------------------------------------------------------------
# Smoke runs (subprocesses; slow).


def _run(cmd, timeout):
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
  return proc


@pytest.mark.slow
def test_bench_run_smoke(tmp_path):
  """Every part but reuse at tiny scale (~1 min on 2 cores)."""
  out = tmp_path / 'out'
  proc = _run([sys.executable, str(BENCH / 'run.py'), '--part', 'grid,gb,soak,mp',
               '--scale', 'tiny', '--budgets', '64MiB', '--gb-budgets', '64MiB',
               '--soak-saves', '3', '--jobs', '2', '--out', str(out)], timeout=300)
  log = proc.stdout[-4000:] + proc.stderr[-4000:]
  for name in ('results.json', 'results.md', 'peaks.png', 'gb_peaks.png', 'soak.png'):
    assert (out / name).exists(), f'{name} missing\n{log}'
    if name.endswith('.png'):
      assert (out / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  res = json.loads((out / 'results.json').read_text())
  assert res['config']['parts'] == ['grid', 'gb', 'soak', 'mp']
  got = {(r['state'], r['variant'], r.get('budget_bytes')) for r in res['rows']}
  want = set()
  for st in ('replicated', 'sharded', 'gemma'):
    want |= {(st, 'orbax default', None), (st, 'orbax tuned', 64 * MiB),
             (st, 'kd_ckpt auto', 64 * MiB), (st, 'kd_ckpt streaming', 64 * MiB),
             (st, 'dd (disk ceiling)', None)}
  assert got == want
  got_gb = {(r['state'], r['variant'], r.get('budget_bytes')) for r in res['gb_rows']}
  want_gb = set()
  for st in ('big', 'gemma_gb'):
    want_gb |= {(st, 'orbax default', None), (st, 'orbax tuned', 64 * MiB),
                (st, 'orbax memory regulator', 64 * MiB),
                (st, 'orbax memory regulator', 14 * 10**9),
                (st, 'kd_ckpt auto', 64 * MiB), (st, 'kd_ckpt streaming', 64 * MiB),
                (st, 'dd (disk ceiling)', None)}
  assert got_gb == want_gb
  big = [r for r in res['gb_rows'] if r['state'] == 'big' and r.get('leaves')]
  assert big and all(r['leaves'] == 1 for r in big)
  for r in res['rows'] + res['gb_rows']:
    if r['variant'] == 'orbax memory regulator' and r['budget_bytes'] == 64 * MiB:
      # Orbax 0.12.8 refuses a regulator max under ~13.4 GB.
      assert 'min_memory_limit_gib' in r.get('error', ''), r
      continue
    if r['variant'] != 'orbax tuned':  # may legitimately fail (Orbax limits)
      assert not r.get('error'), r
    if r['variant'] != 'dd (disk ceiling)' and not r.get('error'):
      assert r['peak_extra_bytes'] >= 0 and r['seconds'] > 0
      assert r['restore_ok'], r
  assert [s['variant'] for s in res['soak']] == [
      'orbax default', 'kd_ckpt auto', 'kd_ckpt orbax', 'kd_ckpt streaming']
  assert all(len(s['rss_after_bytes']) == 3 for s in res['soak'])
  assert all(s['disk_bytes_per_checkpoint'] > 0 for s in res['soak'])
  assert [m['variant'] for m in res['mp']] == ['kd_ckpt streaming', 'kd_ckpt auto']
  for m in res['mp']:
    assert not m.get('error'), m
    assert [p['process_index'] for p in m['processes']] == [0, 1]
    assert all(p['local_devices'] == 4 and p['global_devices'] == 8 and p['restore_ok']
               for p in m['processes'])
  md = (out / 'results.md').read_text()
  assert '| sharded | kd_ckpt streaming | 64 MiB |' in md
  assert '| gemma | dd (disk ceiling) |' in md
  assert '| big | orbax memory regulator | 14 GB |' in md
  for section in ('## GB scale', '## Small grid', '## Soak', '## Two processes',
                  '## Verdict', 'wall '):
    assert section in md, section
  assert proc.returncode == (1 if res['violations'] else 0), log
  # --replot rebuilds the Markdown and plots from results.json alone.
  (out / 'results.md').unlink()
  replot = _run([sys.executable, str(BENCH / 'run.py'), '--replot', '--out', str(out)],
                timeout=60)
  assert replot.returncode == proc.returncode, replot.stderr[-2000:]
  assert (out / 'results.md').read_text() == md
  # Every kd_ckpt row, save and restore, within budget + 8 MiB at tiny scale.
  assert res['violations'] == [], res['violations']


@pytest.mark.slow
def test_bench_reuse_smoke(tmp_path):
  """`--part reuse` at tiny scale: 3 saves per variant, 4 Kauldron steps."""
  out = tmp_path / 'out'
  proc = _run([sys.executable, str(BENCH / 'run.py'), '--part', 'reuse',
               '--scale', 'tiny', '--reuse-saves', '3', '--kauldron-steps', '4',
               '--out', str(out)], timeout=240)
  log = proc.stdout[-4000:] + proc.stderr[-4000:]
  assert (out / 'results.json').exists(), log
  assert (out / 'reuse.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  res = json.loads((out / 'results.json').read_text())
  runs = {r['variant']: r for r in res['reuse']}
  assert list(runs) == ['kd_ckpt.save', 'SafeCheckpointer', 'SafeCheckpointer, frozen rebuilt',
                        'kauldron.main tiny Gemma LoRA']
  for name, r in runs.items():
    assert not r.get('error'), r
    saves = r['saves']
    assert saves[0]['bytes_reused'] == 0
    assert all(s['bytes_reused'] > 0 and s['leaves_reused'] > 0 for s in saves[1:]), r
    assert len(r['checkpoints_kept']) == 3 and r['disk_bytes'] > 0
  for name in ('kd_ckpt.save', 'SafeCheckpointer', 'SafeCheckpointer, frozen rebuilt'):
    r = runs[name]
    assert len(r['saves']) == 3 and r['enforced']
    assert r['frozen_bytes'] == 64 * MiB  # 4 x the 16 MiB tiny scale
    # Only the changing part is written again, and the peak stays small.
    t = measure.reuse_targets(r)
    for s in r['saves'][1:]:
      assert s['bytes_written'] <= t['write_bytes'], s
      assert s['peak_extra_bytes'] <= t['peak_bytes'], s
    assert r['disk_bytes'] <= measure.REUSE_DISK_FACTOR * t['ideal_disk_bytes'], r
  kauldron = runs['kauldron.main tiny Gemma LoRA']
  assert not kauldron['enforced']
  assert [s['step'] for s in kauldron['saves']] == [0, 2, 4]
  assert kauldron['checkpoints_kept'] == ['ckpt_0', 'ckpt_2', 'ckpt_4']
  md = (out / 'results.md').read_text()
  assert '## Reuse of unchanged leaves' in md and '| kd_ckpt.save | 2 | 1 |' in md
  # At this size the seconds target measures fixed costs: the exit status
  # follows the violations, whichever they are.
  assert proc.returncode == (1 if res['violations'] else 0), log


# What the GPU machine lacks (issue 12): Kauldron, and the C-extension pins
# kd_ckpt can do without.  Imports of these fail in the dry run's processes.
_GPU_MACHINE_LACKS = ('kauldron', 'gemma', 'google_crc32c', 'zstandard', 'psutil')


def _without(tmp_path, modules) -> str:
  """A PYTHONPATH entry whose sitecustomize makes `modules` unimportable."""
  d = tmp_path / 'block'
  d.mkdir()
  (d / 'sitecustomize.py').write_text(
      'import importlib.abc, sys\n'
      f'BLOCKED = {tuple(modules)!r}\n'
      'class _Block(importlib.abc.MetaPathFinder):\n'
      '  def find_spec(self, name, path=None, target=None):\n'
      "    if name.split('.')[0] in BLOCKED:\n"
      "      raise ModuleNotFoundError(f'No module named {name!r} (blocked)', name=name)\n"
      'sys.meta_path.insert(0, _Block())\n')
  return str(d)


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
  """bench/gpu_check.py as the GPU machine runs it: no Kauldron, no C pins."""
  env = dict(os.environ, OUT=str(tmp_path),
             PYTHONPATH=_without(tmp_path, _GPU_MACHINE_LACKS))
  proc = subprocess.run([sys.executable, str(BENCH / 'gpu_check.py'), '--dry-run'],
                        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  log = proc.stdout[-4000:] + proc.stderr[-4000:]
  md = tmp_path / 'gpu_check.md'
  assert md.exists(), log
  text = md.read_text()
  for variant in ('orbax default, pinned on, replica-parallel on',
                  'orbax default, pinned off, replica-parallel off',
                  'kd_ckpt auto', 'kd_ckpt streaming', 'dd (disk ceiling)'):
    assert f'| {variant} |' in text, text
  res = json.loads((tmp_path / 'gpu_check.json').read_text())
  assert res['dry_run'] is True
  assert 'Versions: python' in text and 'orbax-checkpoint' in text
  kd = [r for r in res['rows'] if r['variant'].startswith('kd_ckpt')]
  assert kd and all(not r.get('error') for r in kd), kd
  # kd_ckpt restores the first Orbax row's checkpoint at each --stock-budgets.
  stock, = [r for r in res['rows'] if r.get('stock_restores')]
  assert stock['variant'] == 'orbax default, pinned on, replica-parallel on'
  assert [s['budget_bytes'] for s in stock['stock_restores']] == [256 * MiB, 1024 * MiB]
  assert all(s['ok'] and s['seconds'] > 0 for s in stock['stock_restores']), stock
  assert '| 4.00 MiB | 256 MiB |' in text and '| 4.00 MiB | 1 GiB |' in text, text


def test_device_programs_measures_each_kind(tmp_path):
  """bench/device_programs.py (run first by bench/gpu_check.sh) as the GPU
  machine runs it: one row per kind of program, with their counts."""
  env = dict(os.environ, PYTHONPATH=_without(tmp_path, _GPU_MACHINE_LACKS),
             XLA_FLAGS='--xla_force_host_platform_device_count=8')
  out = tmp_path / 'device_programs.md'
  proc = subprocess.run([sys.executable, str(BENCH / 'device_programs.py'), '--programs', '4',
                         '--out', str(out)],
                        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = {r[0]: r for r in _parse_md(out.read_text())[2:]}
  assert set(rows) == {'cut', 'zero', 'slice'}, rows
  assert (rows['cut'][1], rows['zero'][1], rows['slice'][1]) == ('4', '4', '32')


def test_gpu_check_stock_table_flags_a_restore_over_its_budget():
  import gpu_check  # pylint: disable=g-import-not-at-top
  rows = [{'state': 's', 'restore_seconds': 2.0, 'stock_restores': [
      {'budget_bytes': 64 * MiB, 'seconds': 1.0, 'extra_bytes': 60 * MiB, 'ok': True},
      {'budget_bytes': 64 * MiB, 'seconds': 3.0, 'extra_bytes': 128 * MiB, 'ok': True},
      {'budget_bytes': 64 * MiB, 'seconds': 3.0, 'extra_bytes': 1 * MiB, 'ok': False},
      {'budget_bytes': 64 * MiB, 'error': 'BudgetTooSmallError: raise it'}]}]
  table, failures = gpu_check.stock_table(rows)
  assert '| s | 64 MiB | 1.00 | 0.50x |' in table and '| s | 64 MiB | 3.00 | 1.50x |' in table
  assert len(failures) == 3, failures
  assert 'peak beyond the restored arrays 128' in failures[0]
  assert 'differ' in failures[1] and 'BudgetTooSmallError' in failures[2]


def test_budget_warnings_only_for_orbax_rows_over_budget():
  rows = [
      {'state': 's', 'variant': 'kd_ckpt auto', 'budget_bytes': 64 * MiB,
       'peak_extra_bytes': 128 * MiB},  # a violation (check_rows), not a warning
      {'state': 's', 'variant': 'orbax tuned', 'budget_bytes': 64 * MiB,
       'peak_extra_bytes': 128 * MiB},
      {'state': 's', 'variant': 'orbax tuned', 'budget_bytes': 64 * MiB,
       'peak_extra_bytes': 32 * MiB},
  ]
  warnings = measure.budget_warnings(rows)
  assert len(warnings) == 1 and '2.00x' in warnings[0] and 'orbax tuned' in warnings[0]


# --------------------------------------------------------------------------
# Two processes and reuse: checks and tables (no processes).


def _mp(peak=50 * MiB, whole=60 * MiB, over=10 * MiB):
  return {'variant': 'kd_ckpt streaming', 'budget_bytes': 96 * MiB, 'num_processes': 2,
          'processes': [
              {'process_index': i, 'strategy': 'streaming', 'settings': 'x',
               'report_peak_extra_bytes': peak, 'whole_save_peak_extra_bytes': whole,
               'restore_extra_bytes': 128 * MiB + over, 'restored_bytes': 128 * MiB,
               'bytes_written': 64 * MiB, 'save_seconds': 1.0, 'restore_ok': True}
              for i in range(2)]}


def test_check_mp():
  assert measure.check_mp([_mp()]) == []
  limit = measure.kd_limit_bytes(96 * MiB)
  assert measure.check_mp([_mp(whole=limit)]) == []
  assert len(measure.check_mp([_mp(whole=limit + 1)])) == 2  # both processes
  assert len(measure.check_mp([_mp(over=limit + 1)])) == 2
  one = _mp()
  one['processes'] = one['processes'][:1]
  assert measure.check_mp([one])  # a process's result is missing
  assert 'boom' in measure.check_mp([{'variant': 'kd_ckpt auto', 'budget_bytes': 1,
                                      'error': 'boom'}])[0]
  table = _parse_md(measure.mp_table([_mp()]))
  assert table[0] == list(measure.MP_COLUMNS)
  row = dict(zip(measure.MP_COLUMNS, table[2]))
  assert row['peak/budget'] == '0.62' and row['verdict'] == 'pass'
  assert row['restore extra - restored'] == '10.0 MiB'


def _reuse(n=10, wrote=48 * MiB, peak=40 * MiB, secs=0.2, disk=None):
  frozen, changing = 1 << 30, 48 * MiB + 4
  saves = [{'step': 0, 'bytes_written': frozen + changing, 'bytes_reused': 0,
            'peak_extra_bytes': 100 * MiB, 'seconds': 4.0, 'strategy': 'orbax'}]
  saves += [{'step': i, 'bytes_written': wrote, 'bytes_reused': frozen,
             'peak_extra_bytes': peak, 'seconds': secs, 'strategy': 'orbax'}
            for i in range(1, n)]
  return {'variant': 'kd_ckpt.save', 'budget_bytes': 256 * MiB, 'kept': 3,
          'frozen_bytes': frozen, 'changing_bytes': changing, 'floor_bytes': 24 * MiB,
          'saves': saves,
          'disk_bytes': frozen + 3 * changing if disk is None else disk}


def test_reuse_targets_and_misses():
  t = measure.reuse_targets(_reuse())
  assert t['write_bytes'] == 2 * (48 * MiB + 4)
  assert t['peak_bytes'] == 72 * MiB + 4
  assert t['ideal_disk_bytes'] == (1 << 30) + 3 * (48 * MiB + 4)
  assert measure.reuse_misses(_reuse()) == []
  assert len(measure.reuse_misses(_reuse(wrote=200 * MiB))) == 9
  assert len(measure.reuse_misses(_reuse(peak=73 * MiB))) == 9
  assert len(measure.reuse_misses(_reuse(secs=0.41))) == 9  # > 10% of 4 s
  assert len(measure.reuse_misses(_reuse(disk=2 << 30))) == 1
  assert measure.reuse_misses(_reuse(n=1))  # too few saves
  # The Kauldron run is reported, not enforced.
  assert measure.check_reuse([dict(_reuse(secs=3.0), enforced=False)]) == []
  assert measure.check_reuse([_reuse(secs=3.0)])


def test_reuse_tables():
  res = [_reuse(), dict(_reuse(secs=1.0), variant='SafeCheckpointer')]
  summary = _parse_md(measure.reuse_summary_table(res))
  assert summary[0] == list(measure.REUSE_SUMMARY_COLUMNS)
  a = dict(zip(measure.REUSE_SUMMARY_COLUMNS, summary[2]))
  b = dict(zip(measure.REUSE_SUMMARY_COLUMNS, summary[3]))
  assert a['verdict'] == 'pass' and a['max s / full s (save 2+)'] == '0.05'
  assert a['disk / ideal'] == '1.00' and a['frozen'] == '1.00 GiB'
  assert b['verdict'] == 'MISS (9)'
  per_save = _parse_md(measure.reuse_saves_table(res))
  assert len(per_save) == 2 + 20
  assert dict(zip(measure.REUSE_SAVE_COLUMNS, per_save[3]))['x full save'] == '0.05'


def test_parse_kauldron_saved_line():
  sys.path.insert(0, str(BENCH))
  import workloads  # pylint: disable=g-import-not-at-top

  line = ('I1130 23:48:58.503572 140662388267904 session.py:175] kd_ckpt step 18 saved:'
          ' orbax (async,raw,single-replica): peak extra RSS 18.69 MiB of budget 11.07'
          ' GiB (predicted 25.31 MiB) (async, commit included), wrote 24.01 KiB, reused'
          ' 89.03 KiB (24 leaves) in 0.17 s (0.00 GB/s)')
  got = workloads._parse_saved_line(line)  # pylint: disable=protected-access
  assert got['step'] == 18 and got['strategy'] == 'orbax'
  assert got['settings'] == 'async,raw,single-replica'
  assert got['report_peak_extra_bytes'] == int(18.69 * MiB)
  assert got['bytes_written'] == int(24.01 * 1024)
  assert got['bytes_reused'] == int(89.03 * 1024) and got['leaves_reused'] == 24
  assert got['seconds'] == 0.17
  first = workloads._parse_saved_line(  # pylint: disable=protected-access
      'kd_ckpt step 0 saved: streaming (slices of 6.00 MiB, limiter 40.00 MiB): peak extra'
      ' RSS 1.00 GiB of budget 2.00 GiB (predicted 1.5 GiB), wrote 113.04 KiB in 0.20 s'
      ' (0.00 GB/s)')
  assert first['bytes_reused'] == 0 and first['report_peak_extra_bytes'] == 1 << 30
  assert first['settings'] == 'slices of 6.00 MiB, limiter 40.00 MiB'


@pytest.mark.slow
def test_restore_stock_smoke(tmp_path):
  """bench/restore_stock.py: a stock Orbax checkpoint restored by Orbax and
  by kd_ckpt below the shard size, bit-exact (the script checks), one row each."""
  out = tmp_path / 'r.md'
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'restore_stock.py'), '--gib', '0.0625',
       '--budgets', '48MiB', '--leaves', '3', '--out', str(out)],
      capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [l for l in out.read_text().splitlines() if l.startswith('| 1 device') or
          l.startswith('| 8 devices')]
  assert [r.split('|')[2].strip() for r in rows] == ['Orbax', 'kd_ckpt @48MiB'] * 3
  assert [r.split('|')[1].strip() for r in rows][-1] == '1 device, 3 leaves'
  beyond = [float(r.split('|')[5].split()[0]) for r in rows if 'kd_ckpt' in r]
  assert all(b <= 48 + 8 for b in beyond), rows  # the budget, + the tests' tolerance


def test_load_weights_smoke(tmp_path):
  """bench/load_weights.py: one state, Orbax's reader and kd_ckpt's, a row each,
  bit-exact (the worker checks), kd_ckpt's peak within the budget."""
  out = tmp_path / 'w.md'
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'load_weights.py'), '--states', 'mesh2d_prime',
       '--mib', '48', '--budget', '64MiB', '--loaders', 'orbax,standard', '--out', str(out)],
      capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [l.split('|') for l in out.read_text().splitlines() if l.startswith('| mesh2d_prime')]
  assert [r[2].strip() for r in rows] == [
      'StandardCheckpointer, Orbax', 'StandardCheckpointer, kd_ckpt.within_budget']
  assert rows[0][4].strip() == '1.00x' and rows[1][4].strip().endswith('x')
  assert float(rows[1][5].split()[0]) <= 64 + 8, rows  # the budget, + the tests' tolerance


def test_cold_restore_smoke(tmp_path):
  """bench/cold_restore.py: one state, Orbax's restore and kd_ckpt's, a row
  each; kd_ckpt's peak within the budget, and on a state it places shard by
  shard, no compiler start-up."""
  out = tmp_path / 'c.md'
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'cold_restore.py'), '--states', 'mesh2d_prime',
       '--mib', '32', '--budget', '64MiB', '--reps', '1', '--out', str(out)],
      capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [l.split('|') for l in out.read_text().splitlines() if l.startswith('| mesh2d_prime')]
  assert [r[2].strip() for r in rows] == ['Orbax StandardCheckpointer', 'kd_ckpt.restore'], rows
  assert rows[0][4].strip() == '1.00x' and rows[1][4].strip().endswith('x')
  assert float(rows[1][5].split(' to ')[-1].split()[0]) <= 64 + 8, rows  # budget + tolerance
  assert rows[1][6].strip() == 'no', rows


def test_profile_save_times_every_part(tmp_path):
  """bench/profile_save.py at 64 MiB: every part timed, in one table, nothing left behind."""
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'profile_save.py'), '--gib', '0.0625', '--budget', '64MiB',
       '--dir', str(tmp_path)],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {l.split('|')[1].strip(): l for l in proc.stdout.splitlines() if l.startswith('| ')}
  assert set(rows) >= {'dd', 'copy', 'crc32c', 'ts write', 'kd_ckpt', 'orbax'}, proc.stdout
  for name in ('dd', 'copy', 'crc32c', 'ts write', 'kd_ckpt', 'orbax'):
    # GB/s, finite and positive: the part was timed.  (Its seconds can print
    # as 0.00 at this size: CRC32C of 64 MiB took 4.6 ms in one run.)
    seconds, gbps = (float(c) for c in rows[name].split('|')[2:4])
    assert seconds >= 0 and 0 < gbps < float('inf'), rows[name]
  assert '| kd_ckpt |' in proc.stdout and '100%' in rows['kd_ckpt']
  assert not list(tmp_path.iterdir()), 'the profile left files behind'



@pytest.mark.slow
def test_disk_timeline_marks_every_step(tmp_path):
  """bench/disk_timeline.py on a 50 MB state: a timeline whose buckets cover
  the save, with its commits, its fsync pass and nothing left behind."""
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'disk_timeline.py'), '--gb', '0.05', '--budget', '64MiB',
       '--reps', '1', '--dir', str(tmp_path)],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  head = [l for l in proc.stdout.splitlines() if l.startswith('save 0:')]
  assert head and 'commits, the first at' in head[0], proc.stdout
  secs = float(head[0].split()[2])
  buckets = [l for l in proc.stdout.splitlines() if l[:6].strip().replace('.', '').isdigit()]
  # The buckets run from 0 to the end of the save (secs is printed rounded).
  starts = [float(l.split()[0]) for l in buckets]
  assert starts == [i * 0.25 for i in range(len(starts))], proc.stdout
  assert starts[-1] <= secs + 0.005 < starts[-1] + 0.25 + 0.01, proc.stdout
  assert 'fsync pass:' in proc.stdout, proc.stdout
  assert any(len(l.split()) == 4 and 'F' in l.split()[3] for l in buckets), proc.stdout
  assert not list(tmp_path.iterdir()), 'the timeline left files behind'

def _md_tables(text: str) -> dict[str, list[dict[str, str]]]:
  """'### Title' -> the rows of the markdown table under it, as {header: cell}."""
  tables, title, header = {}, None, None
  for line in text.splitlines():
    if line.startswith('### '):
      title, header = line[4:], None
      tables[title] = []
    elif title and line.startswith('| ') and not line.startswith('| ---'):
      cells = [c.strip() for c in line.strip().strip('|').split('|')]
      if header is None:
        header = cells
      else:
        assert len(cells) == len(header), line
        # Repeated headers ('x Orbax' for save and restore) get their position.
        tables[title].append({f'{h}#{i}': c for i, (h, c) in enumerate(zip(header, cells))})
  return tables


def test_line_fit_finds_a_fixed_cost_and_the_size_off_the_line():
  """speed.line_fit: seconds = fixed + GB x slope, on relative error."""
  import speed  # pylint: disable=g-import-not-at-top
  gbs = [0.134, 0.537, 1.07, 2.15, 4.29]
  assert speed.line_fit([(g, 0.05 + 0.9 * g) for g in gbs]) == (
      '0.05 s + 0.90 s/GB, off <= 0% (128 MiB)')
  # The 512 MiB save 30% slower than the line through the others: named, and
  # the fit (weighted by relative error) still finds the others' line.
  bent = [(g, (0.05 + 0.9 * g) * (1.3 if g == 0.537 else 1)) for g in gbs]
  m = re.fullmatch(r'([0-9.-]+) s \+ ([0-9.]+) s/GB, off <= (\d+)% \(512 MiB\)',
                   speed.line_fit(bent))
  assert m, speed.line_fit(bent)
  assert 0.8 <= float(m.group(2)) <= 1.0 and int(m.group(3)) >= 15, m.groups()


@pytest.mark.slow
def test_speed_smoke(tmp_path):
  """bench/speed.py at tiny sizes (~40 s on 2 cores): its three tables, a row per
  variant, every ratio finite and > 0, every restore checked, nothing left behind."""
  import speed  # pylint: disable=g-import-not-at-top
  out, work = tmp_path / 'speed.md', tmp_path / 'work'
  work.mkdir()
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'speed.py'), '--stall-size', '8MiB', '--steps', '4',
       '--every', '2', '--scale-sizes', '4MiB,8MiB', '--leaf-counts', '10,100',
       '--dir', str(work), '--out', str(out)],
      cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not list(work.iterdir()), 'speed.py left files behind'
  tables = _md_tables(out.read_text())
  stall, = [v for k, v in tables.items() if k.startswith('Stall')]
  scale, = [v for k, v in tables.items() if k.startswith('Scaling')]
  leaves, = [v for k, v in tables.items() if k.startswith('Per-leaf')]
  assert [r['variant#0'] for r in stall] == list(speed.STALL_VARIANTS)
  assert [r['size#0'] for r in scale] == ['4.00 MiB', '8.00 MiB']
  assert [(r['leaves#0'], r['variant#1'].split(' @')[0]) for r in leaves] == [
      (n, v) for n in ('10', '100') for v in speed.LEAF_VARIANTS]

  for name, rows in (('stall', stall), ('scale', scale), ('leaves', leaves)):
    ratios = [(k, r[k]) for r in rows for k in r
              if k.startswith('x ') or k.split('#')[0].endswith(' x Orbax')]
    assert len(ratios) >= 2 * len(rows), (name, rows)
    for k, cell in ratios:
      assert cell.endswith('x'), (name, k, cell)
      value = float(cell[:-1])
      assert np.isfinite(value) and value > 0, (name, k, cell)
  for r in stall:
    assert r['restored ok#11'] == 'True' and r['saves#1'] == '2', r
    assert float(r['blocked s (sum)#2']) > 0 and float(r['loop s#7']) > 0, r
    done, steps = r['steps not donated#10'].split('/')
    assert 0 <= int(done) <= int(steps) == 4, r
  assert stall[0]['x Orbax blocked#5'] == '1.00x'
  for r in scale:
    # dd of 4 MiB may round to 0.00 s (CI saw "0.00 (0.01, 0.00)"); its ratio,
    # from the unrounded seconds, is checked finite and positive above.
    assert float(r['dd s#1']) >= 0 and float(r['Orbax save s#2']) > 0, r
    for i, k in enumerate(('streaming', 'auto')):
      assert float(r[f'{k} s/GB#{7 + i}']) > 0, r
      secs, x_dd = r[f'{k} save s (x dd)#{3 + i}'].split()
      assert float(secs) >= 0 and x_dd.startswith('(') and x_dd.endswith('x)'), r
      assert float(x_dd[1:-2]) > 0, r
      assert r[f'{k} restore s (x Orbax)#{10 + i}'].endswith('x)'), r
    # Quick rows: a median of several saves each, which the notes give, and
    # at least a round per variant (each in every place of the order once).
    for who in ('streaming', 'auto', 'Orbax default'):
      m = re.search(rf'(?:^|; ){who}: (\d+) saves', r['notes#12'])
      assert m and int(m.group(1)) >= 3, (who, r)
    assert re.search(r'dd: \d+ runs', r['notes#12']), r
  text = out.read_text()
  for who in ('kd_ckpt streaming', 'kd_ckpt auto', 'Orbax default', 'dd'):
    flat = re.search(rf'{who}: ([0-9.]+) \(', text.split('Flatness', 1)[1])
    assert flat and float(flat.group(1)) >= 1.0, who
  for r in leaves:
    assert float(r['save s#2']) > 0 and float(r['restore s#6']) > 0, r
  assert out.read_text() in proc.stdout  # printed too


@pytest.mark.slow
def test_shapes_smoke(tmp_path):
  """bench/shapes.py at 8 MiB, one rep (~30 s): both tables have a row per
  state with finite ratios, the raw file every rep, nothing left behind."""
  out, raw, work = tmp_path / 'shapes.md', tmp_path / 'raw.jsonl', tmp_path / 'work'
  work.mkdir()
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'shapes.py'), '--mib', '8', '--reps', '1',
       '--states', 'sharded,zeros', '--dir', str(work), '--out', str(out), '--raw', str(raw)],
      cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not list(work.iterdir()), 'shapes.py left files behind'
  text = out.read_text()
  assert 'failed' not in text, text
  rows = [l for l in text.splitlines() if l.startswith('| sharded ') or l.startswith('| zeros ')]
  assert len(rows) == 4, text  # a wall-time row and a CPU row per state
  for i, row in enumerate(rows):
    cells = [c.strip() for c in row.strip('|').split('|')]
    # Wall-time rows have every ratio; a CPU ratio over 0 ticks reads '-'.
    numbers = [c for c in cells[2:8] if re.fullmatch(r'[0-9]+\.[0-9]+', c)]
    assert len(numbers) == 6 if i < 2 else len(numbers) + cells[2:8].count('-') == 6, row
    assert all(np.isfinite(float(x)) for x in numbers), row
  assert text.index('| sharded ') < text.index('user CPU seconds') < text.rindex('| zeros ')
  lines = [json.loads(l) for l in raw.read_text().splitlines()]
  assert [r['state'] for r in lines] == ['sharded', 'zeros']
  for r in lines:
    assert set(r['secs']) == set(r['user_secs']) == set(r['median_minor_faults'])
    assert all(len(v) == 1 and v[0] > 0 for v in r['secs'].values()), r['secs']


def test_slow_link_delays_each_request_and_caps_each_connection():
  """bench/slow_link.py: a request waits the latency, a response flows at
  the rate, the bytes arrive unchanged, and requests are counted."""
  import http.server  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  import slow_link  # pylint: disable=g-import-not-at-top
  body = os.urandom(400_000)

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def do_GET(self):  # pylint: disable=invalid-name
      self.send_response(200)
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    def get(port):
      t = time.monotonic()
      with urllib.request.urlopen(f'http://127.0.0.1:{port}/x', timeout=30) as r:
        got = r.read()
      return got, time.monotonic() - t

    _, bare_secs = get(server.server_address[1])
    with slow_link.SlowLink(server.server_address[1], latency_secs=0.2,
                            rate_bytes_per_sec=1e6) as link:
      sent = time.time()
      got, secs = get(link.port)
      assert got == body
      # When the request reached the link: before the server had it.
      assert link.request_lines == ['GET /x'], link.request_lines
      assert sent <= link.request_times[0] <= sent + secs - 0.2, (sent, link.request_times, secs)
      # 0.2 s before the server sees the request, then 400 KB at 1 MB/s.
      assert secs >= 0.2 + 0.4 * 0.9, (secs, bare_secs)
      assert link.requests == 1 and link.connections == 1, (link.requests, link.connections)
      assert link.down_bytes > len(body)
  finally:
    server.shutdown()


def test_ab_save_ts_alone_writes_the_states_bytes(tmp_path):
  """bench/ab_save.py's `ts-alone` row: TensorStore writes as many bytes as the save does."""
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'ab_save.py'), '--state', 'leaves', '--leaves', '20',
       '--leaf-bytes', str(1 << 20), '--reps', '1', '--variants', 'now,ts-alone', '--no-dd',
       '--dir', str(tmp_path)],
      cwd=REPO, capture_output=True, text=True, timeout=600,
      env={**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=8'})
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = {line.split('|')[1].strip(): [c.strip() for c in line.split('|')[1:-1]]
          for line in proc.stdout.splitlines() if line.startswith('| ') and '---' not in line}
  saved_mb, alone_mb = float(rows['now'][-1]), float(rows['ts-alone'][-1])
  assert 20 * (1 << 20) / 1e6 <= alone_mb <= saved_mb * 1.01, (saved_mb, alone_mb)
  assert rows['ts-alone'][-2] == '0.00', rows  # no device-to-host copies


def test_fingerprint_programs_smoke():
  """bench/fingerprint_programs.py: shard by shard, 8 programs a shape; side by
  side, one."""
  proc = subprocess.run(
      [sys.executable, str(BENCH / 'fingerprint_programs.py'), '--shapes', '2'],
      capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {l[:14].strip(): l[14:].split() for l in proc.stdout.splitlines()[2:]}
  assert rows['per device'][0] == '16' and rows['side by side'][0] == '2', proc.stdout
