"""Measuring helpers for the benchmark: peak RSS, tables, thresholds.

Deliberately independent of kd_ckpt (the thing being measured): the peak is
read straight from the kernel, the same way `kd_ckpt.PeakRss` does it, so the
benchmark's numbers do not depend on kd_ckpt measuring itself correctly.

  with Peak() as p:          # resets VmHWM, reads it back afterwards
    save()
  p.extra_bytes              # peak RSS during the block minus RSS before

Everything here is plain Python (no jax import) so the tests stay fast.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import json
from typing import Any, Iterable, Sequence

MiB = 1 << 20
GiB = 1 << 30

# kd_ckpt's promises, as checked by the benchmark.  The budget is a hard
# limit for every kd_ckpt save and restore (auto, orbax, streaming): peak
# extra RSS <= budget, restore peak beyond the restored arrays <= budget, with
# this much measurement tolerance (VmHWM's page-granular accounting, the
# interpreter's own noise).
MEASUREMENT_TOLERANCE_BYTES = 8 * MiB
SOAK_DRIFT_LIMIT_BYTES = 16 * MiB
# Reuse (issue 13): per save after the first, bytes written <= this many times
# the changing part (trainable + optimizer state); seconds <= this fraction of
# the first (full) save; disk with 3 checkpoints kept <= this factor times
# 1x the frozen part + 3x the rest.  The peak target is the changing part
# plus kd_ckpt.cost.FLOOR_BYTES (read from the kd_ckpt being measured).
REUSE_WRITE_FACTOR = 2.0
REUSE_SECONDS_FRACTION = 0.10
REUSE_DISK_FACTOR = 1.10
SOAK_DRIFT_FROM = 5   # 1-based save numbers: drift = RSS after save 50 - after save 5
SOAK_DRIFT_TO = 50


# --------------------------------------------------------------------------
# RSS and peak RSS, from /proc.


def _status_bytes(field: str) -> int | None:
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def rss_bytes() -> int:
  """Current resident set size of this process (VmRSS)."""
  value = _status_bytes('VmRSS')
  if value is None:  # not Linux: fall back to psutil
    import psutil  # pylint: disable=g-import-not-at-top

    return int(psutil.Process().memory_info().rss)
  return value


def hwm_bytes() -> int | None:
  """Peak RSS since the last reset (VmHWM)."""
  return _status_bytes('VmHWM')


def reset_peak() -> bool:
  """Resets VmHWM to the current RSS. False where the kernel refuses."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


@functools.cache
def _libc():
  try:
    return ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
  except OSError:
    return None


def malloc_trim() -> bool:
  """Gives freed heap back to the OS (glibc only)."""
  libc = _libc()
  if libc is None or not hasattr(libc, 'malloc_trim'):
    return False
  return bool(libc.malloc_trim(0))


class _MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks',
      'uordblks', 'fordblks', 'keepcost')]


def heap_bytes() -> dict[str, int] | None:
  """glibc's heap, all arenas (`mallinfo2`); None where unavailable.

  in_use: bytes malloc has handed out and not got back (a leak grows this);
  free: freed bytes the heap keeps (fragmentation; only partly resident);
  footprint: heap obtained from the OS (arenas + mmapped chunks).
  """
  libc = _libc()
  fn = getattr(libc, 'mallinfo2', None) if libc is not None else None
  if fn is None:
    return None
  fn.restype = _MallInfo2
  m = fn()
  return {'in_use': int(m.uordblks + m.hblkhd), 'free': int(m.fordblks),
          'footprint': int(m.arena + m.hblkhd)}


class Peak:
  """Peak RSS of a block, exact (kernel high-water mark, no sampling).

  Attributes (after the block): before_bytes, peak_bytes, after_bytes,
  exact (False: the reset was refused, peak is the lifetime high-water mark).
  """

  def __init__(self):
    self.before_bytes = 0
    self.peak_bytes = 0
    self.after_bytes = 0
    self.exact = False

  def __enter__(self) -> 'Peak':
    self.exact = reset_peak()
    self.before_bytes = rss_bytes()
    return self

  def __exit__(self, *exc) -> None:
    self.after_bytes = rss_bytes()
    self.peak_bytes = max(hwm_bytes() or 0, self.after_bytes, self.before_bytes)

  @property
  def extra_bytes(self) -> int:
    return max(0, self.peak_bytes - self.before_bytes)

  @property
  def retained_bytes(self) -> int:
    return self.after_bytes - self.before_bytes


# --------------------------------------------------------------------------
# Sizes.

_UNITS = {
    '': 1, 'b': 1,
    'k': 1000, 'kb': 1000, 'kib': 1 << 10,
    'm': 1000**2, 'mb': 1000**2, 'mib': 1 << 20,
    'g': 1000**3, 'gb': 1000**3, 'gib': 1 << 30,
}


def parse_bytes(text: str | int) -> int:
  """'256MiB' -> 268435456, '1GB' -> 10**9, 42 -> 42."""
  if isinstance(text, int):
    return text
  s = text.strip().lower().replace(' ', '')
  num = s.rstrip('abcdefghijklmnopqrstuvwxyz')
  unit = s[len(num):]
  if unit not in _UNITS or not num:
    raise ValueError(f'not a size: {text!r}')
  return int(float(num) * _UNITS[unit])


def fmt_bytes(n: float | None) -> str:
  """Binary units, 3 significant-ish digits: 1.50 GiB, 64.0 MiB, 512 KiB."""
  if n is None or (isinstance(n, float) and math.isnan(n)):
    return '-'
  sign = '-' if n < 0 else ''
  v = abs(float(n))
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if v < 1024 or unit == 'TiB':
      if unit == 'B':
        return f'{sign}{v:.0f} B'
      return f'{sign}{v:.2f} {unit}' if v < 10 else (
          f'{sign}{v:.1f} {unit}' if v < 100 else f'{sign}{v:.0f} {unit}')
    v /= 1024
  raise AssertionError('unreachable')


def budget_label(budget: int | None) -> str:
  if budget is None:
    return '-'
  if budget % GiB == 0:
    return f'{budget // GiB} GiB'
  if budget % MiB == 0:
    return f'{budget // MiB} MiB'
  if budget % 10**9 == 0:
    return f'{budget // 10**9} GB'
  return fmt_bytes(budget)


# --------------------------------------------------------------------------
# Thresholds.


def kd_limit_bytes(budget: int) -> int:
  """Most peak extra RSS a kd_ckpt save (or restore, beyond the restored
  arrays) may use at `budget`: the budget plus the measurement tolerance."""
  return int(budget) + MEASUREMENT_TOLERANCE_BYTES


def soak_drift(rss_after_each: Sequence[int],
               first: int = SOAK_DRIFT_FROM,
               last: int = SOAK_DRIFT_TO) -> int | None:
  """RSS after save `last` minus after save `first` (1-based, clamped).

  With fewer saves than `last` the last one is used; with fewer than `first`,
  the first.  None when there are fewer than 2 saves.
  """
  n = len(rss_after_each)
  if n < 2:
    return None
  lo, hi = _drift_indices(n, first, last)
  return int(rss_after_each[hi]) - int(rss_after_each[lo])


def heap_drift(soak: dict[str, Any]) -> int | None:
  """Like `soak_drift`, for malloc's bytes in use (diagnostic, not enforced).

  RSS that grows while this stays flat is allocator slack (freed memory the
  heap keeps), not memory the save still holds.
  """
  return soak_drift(soak.get('heap_in_use_bytes') or [])


def is_kd(row: dict[str, Any]) -> bool:
  return str(row.get('variant', '')).startswith('kd_ckpt')


def restore_overhead_bytes(row: dict[str, Any]) -> int | None:
  """Restore peak extra RSS beyond the restored arrays (None: not measured).

  The restored arrays are counted as the smaller of their shards' bytes
  (`restored_bytes`) and what RSS kept after the restore
  (`restore_retained_bytes`, when recorded): where JAX lets devices share
  one host buffer the shards' sum over-counts, and a restore that leaves
  garbage behind must not have it counted as arrays.  Never under-reports
  the overhead.
  """
  extra, restored = row.get('restore_extra_bytes'), row.get('restored_bytes')
  if extra is None or restored is None:
    return None
  retained = row.get('restore_retained_bytes')
  arrays = int(restored) if retained is None else min(int(restored), int(retained))
  return int(extra) - arrays


def row_name(row: dict[str, Any]) -> str:
  return f"{row.get('state')}/{row.get('variant')}@{budget_label(row.get('budget_bytes'))}"


def check_rows(rows: Iterable[dict[str, Any]]) -> list[str]:
  """Threshold violations of kd_ckpt's save rows (empty list: all pass).

  Every kd_ckpt row (auto, orbax, streaming) must have succeeded, restored
  the saved values, and kept both its save's peak extra RSS and its
  restore's peak beyond the restored arrays <= budget + 8 MiB.  Orbax rows
  are reported, never enforced.
  """
  failures = []
  for row in rows:
    if not is_kd(row):
      continue
    name = row_name(row)
    if row.get('error'):
      failures.append(f'{name}: failed: {row["error"]}')
      continue
    budget = row.get('budget_bytes')
    peak = row.get('peak_extra_bytes')
    if budget is None or peak is None:
      failures.append(f'{name}: no budget/peak measured')
      continue
    limit = kd_limit_bytes(budget)
    if peak > limit:
      failures.append(
          f'{name}: save peak extra RSS {fmt_bytes(peak)} > limit'
          f' {fmt_bytes(limit)} (budget + {fmt_bytes(MEASUREMENT_TOLERANCE_BYTES)});'
          f' peak/budget {peak / budget:.2f}')
    over = restore_overhead_bytes(row)
    if over is None and not row.get('restore_skipped'):
      failures.append(f'{name}: no restore measured')
    elif over is None:
      pass  # not asked for (gpu_check's --restore-max)
    elif over > limit:
      failures.append(
          f'{name}: restore peak beyond the restored arrays {fmt_bytes(over)} >'
          f' limit {fmt_bytes(limit)}; restore peak/budget {over / budget:.2f}')
    if row.get('restore_ok') is False:
      failures.append(f'{name}: restored values differ from the saved ones')
  return failures


def budget_warnings(rows: Iterable[dict[str, Any]]) -> list[str]:
  """Orbax rows given a budget whose peak exceeds it: reported, not enforced."""
  out = []
  for row in rows:
    budget, peak = row.get('budget_bytes'), row.get('peak_extra_bytes')
    if (not is_kd(row) and budget and peak is not None and peak > budget
        and not row.get('error')):
      out.append(f'{row_name(row)}: peak {fmt_bytes(peak)} > budget'
                 f' ({peak / budget:.2f}x)')
  return out


def kd_within_tolerance(rows: Iterable[dict[str, Any]]) -> list[str]:
  """kd_ckpt rows over their budget but inside the measurement tolerance:
  they pass, and are listed, because a charge the writer gets wrong shows
  here first (the 4 GB leaf's edge chunk: 263 MiB at 256 MiB, 1.03x)."""
  out = []
  for row in rows:
    budget = row.get('budget_bytes')
    if not is_kd(row) or row.get('error') or not budget:
      continue
    for what, peak in (('save peak', row.get('peak_extra_bytes')),
                       ('restore peak beyond the arrays', restore_overhead_bytes(row))):
      if peak is not None and budget < peak <= kd_limit_bytes(budget):
        out.append(f'{row_name(row)}: {what} {fmt_bytes(peak)} > budget'
                   f' ({peak / budget:.2f}x), within the tolerance')
  return out


def check_soaks(soaks: Iterable[dict[str, Any]]) -> list[str]:
  """Threshold violations of kd_ckpt's soak runs (RSS drift, errors)."""
  failures = []
  for soak in soaks:
    if not is_kd(soak):
      continue
    name = f"soak/{soak.get('variant')}@{budget_label(soak.get('budget_bytes'))}"
    if soak.get('error'):
      failures.append(f'{name}: failed: {soak["error"]}')
      continue
    drift = soak_drift(soak.get('rss_after_bytes', []))
    if drift is None:
      failures.append(f'{name}: fewer than 2 saves recorded')
    elif drift > SOAK_DRIFT_LIMIT_BYTES:
      failures.append(
          f'{name}: RSS drift {fmt_bytes(drift)} > {fmt_bytes(SOAK_DRIFT_LIMIT_BYTES)}')
    budget, peaks = soak.get('budget_bytes'), soak.get('peak_extra_bytes') or []
    if budget and peaks and max(peaks) > kd_limit_bytes(budget):
      worst = max(peaks)
      failures.append(
          f'{name}: save {peaks.index(worst) + 1} peak extra RSS {fmt_bytes(worst)}'
          f' > limit {fmt_bytes(kd_limit_bytes(budget))}; peak/budget'
          f' {worst / budget:.2f}')
  return failures


# --------------------------------------------------------------------------
# Markdown.


def _ratio(num, den, digits=2) -> str:
  if num is None or not den:
    return '-'
  return f'{num / den:.{digits}f}'


def _secs(x) -> str:
  return '-' if x is None else f'{x:.2f}'


def _gbps(x) -> str:
  return '-' if x is None else f'{x:.2f}'


SAVE_COLUMNS = (
    'state', 'variant', 'budget', 'peak extra RSS', 'peak/budget', 'save s',
    'GB/s', 'x Orbax default', 'restore extra RSS', 'restore extra - restored',
    'restore peak/budget', 'restore s', 'notes',
)


def save_row_cells(row: dict[str, Any]) -> list[str]:
  """One results row as table cells (the order of SAVE_COLUMNS)."""
  err = row.get('error')
  notes = row.get('notes', '')
  if err:
    notes = (notes + '; ' if notes else '') + f'ERROR: {err}'
  budget = row.get('budget_bytes')
  restore_extra = row.get('restore_extra_bytes')
  restored = row.get('restored_bytes')
  return [
      str(row.get('state', '')),
      str(row.get('variant', '')),
      budget_label(budget),
      fmt_bytes(row.get('peak_extra_bytes')),
      _ratio(row.get('peak_extra_bytes'), budget),
      _secs(row.get('seconds')),
      _gbps(row.get('gb_per_sec')),
      _ratio(row.get('seconds'), row.get('orbax_default_seconds')),
      fmt_bytes(restore_extra),
      fmt_bytes(restore_overhead_bytes(row)),
      _ratio(restore_overhead_bytes(row), budget),
      _secs(row.get('restore_seconds')),
      notes.replace('|', '/').replace('\n', ' '),
  ]


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
  lines = ['| ' + ' | '.join(columns) + ' |',
           '|' + '|'.join(' --- ' for _ in columns) + '|']
  for r in rows:
    lines.append('| ' + ' | '.join(str(c) for c in r) + ' |')
  return '\n'.join(lines) + '\n'


def save_table(rows: Iterable[dict[str, Any]]) -> str:
  return markdown_table(SAVE_COLUMNS, (save_row_cells(r) for r in rows))


def _drift_indices(n: int, first: int = SOAK_DRIFT_FROM,
                   last: int = SOAK_DRIFT_TO) -> tuple[int, int]:
  """0-based (lo, hi) save indices `soak_drift` compares for n saves."""
  hi = min(last, n) - 1
  lo = min(first, n) - 1
  if lo >= hi:
    lo = 0
  return lo, hi


def soak_columns(n_saves: int) -> tuple[str, ...]:
  lo, hi = _drift_indices(max(n_saves, 2))
  return ('variant', 'budget', 'saves', 'RSS after save 1',
          f'after save {lo + 1}', f'after save {hi + 1}',
          f'drift ({lo + 1} -> {hi + 1})', 'max peak extra', 'max peak/budget',
          'mean save s', 'total save s', 'disk per checkpoint',
          'malloc in-use drift', 'verdict')


def soak_row_cells(soak: dict[str, Any]) -> list[str]:
  rss = soak.get('rss_after_bytes', [])
  drift = soak_drift(rss)
  peaks = soak.get('peak_extra_bytes', [])
  secs = soak.get('seconds', [])
  budget = soak.get('budget_bytes')
  if soak.get('error'):
    verdict = f"ERROR: {soak['error']}"
  elif not is_kd(soak):
    verdict = 'reference'
  elif check_soaks([soak]):
    verdict = 'FAIL'
  else:
    verdict = 'pass'
  lo, hi = _drift_indices(len(rss))
  ok = len(rss) >= 2
  return [
      str(soak.get('variant', '')),
      budget_label(soak.get('budget_bytes')),
      str(len(rss)),
      fmt_bytes(rss[0]) if rss else '-',
      fmt_bytes(rss[lo]) if ok else '-',
      fmt_bytes(rss[hi]) if ok else '-',
      fmt_bytes(drift),
      fmt_bytes(max(peaks)) if peaks else '-',
      _ratio(max(peaks), budget) if peaks else '-',
      _secs(sum(secs) / len(secs)) if secs else '-',
      _secs(sum(secs)) if secs else '-',
      fmt_bytes(soak.get('disk_bytes_per_checkpoint')),
      fmt_bytes(heap_drift(soak)),
      verdict.replace('|', '/'),
  ]


def soak_table(soaks: Iterable[dict[str, Any]]) -> str:
  soaks = list(soaks)
  n = max((len(s.get('rss_after_bytes', [])) for s in soaks), default=0)
  return markdown_table(soak_columns(n), (soak_row_cells(s) for s in soaks))


def attach_orbax_default_seconds(rows: list[dict[str, Any]]) -> None:
  """Sets row['orbax_default_seconds'] from the Orbax default row of its state."""
  ref = {r['state']: r.get('seconds') for r in rows
         if r.get('variant') == 'orbax default' and not r.get('error')}
  for r in rows:
    r['orbax_default_seconds'] = ref.get(r.get('state'))


def worker_result(stdout: str, stderr: str, returncode: int, prefix: str,
                  base: dict[str, Any]) -> dict[str, Any]:
  """The JSON a worker printed after `prefix`, or `base` with its error."""
  for line in reversed(stdout.splitlines()):
    if line.startswith(prefix):
      return json.loads(line[len(prefix):])
  tail = (stderr.strip().splitlines() or ['no output'])[-1]
  return {**base, 'error': f'worker exit {returncode}: {tail[:300]}'}


# --------------------------------------------------------------------------
# Two-process saves (bench/run.py --part mp).


def _proc_peak(p: dict[str, Any]) -> int | None:
  """A process's save peak: the larger of kd_ckpt's report and ours (whole save)."""
  vals = [p.get(k) for k in ('report_peak_extra_bytes', 'whole_save_peak_extra_bytes')]
  vals = [v for v in vals if v is not None]
  return max(vals) if vals else None


def check_mp(results: Iterable[dict[str, Any]]) -> list[str]:
  """Every process of every two-process kd_ckpt save: peaks <= budget + 8 MiB."""
  failures = []
  for res in results:
    name = f"mp/{res.get('variant')}@{budget_label(res.get('budget_bytes'))}"
    if res.get('error'):
      failures.append(f'{name}: failed: {res["error"]}')
      continue
    budget = res.get('budget_bytes')
    limit = kd_limit_bytes(budget)
    procs = res.get('processes') or []
    if len(procs) != res.get('num_processes', 2):
      failures.append(f'{name}: {len(procs)} process results')
    for p in procs:
      pname = f"{name} process {p.get('process_index')}"
      peak = _proc_peak(p)
      if peak is None or peak > limit:
        failures.append(f'{pname}: save peak extra RSS {fmt_bytes(peak)} > limit'
                        f' {fmt_bytes(limit)}')
      over = restore_overhead_bytes(p)
      if over is not None and over > limit:
        failures.append(f'{pname}: restore peak beyond restored {fmt_bytes(over)} >'
                        f' limit {fmt_bytes(limit)}')
      if p.get('restore_ok') is False:
        failures.append(f'{pname}: restored shards differ')
  return failures


def error_row(lead: list[Any], columns: Sequence[str], error: str) -> list[Any]:
  """A table row for a run that failed: its leading cells, dashes, the error."""
  return (list(lead) + ['-'] * (len(columns) - len(lead) - 1)
          + [f'ERROR: {error}'.replace('|', '/')])


MP_COLUMNS = ('variant', 'budget', 'process', 'settings', 'report peak extra RSS',
              'whole-save peak extra RSS', 'peak/budget', 'restore extra - restored',
              'restore peak/budget', 'wrote', 'save s', 'verdict')


def mp_table(results: Iterable[dict[str, Any]]) -> str:
  rows = []
  for res in results:
    if res.get('error'):
      rows.append(error_row([res.get('variant'), budget_label(res.get('budget_bytes'))],
                            MP_COLUMNS, res['error']))
      continue
    budget = res.get('budget_bytes')
    for p in res.get('processes') or []:
      sub = dict(res, processes=[p], num_processes=1)
      rows.append([
          res.get('variant'), budget_label(budget), str(p.get('process_index')),
          f"{p.get('strategy')} ({p.get('settings')})",
          fmt_bytes(p.get('report_peak_extra_bytes')),
          fmt_bytes(p.get('whole_save_peak_extra_bytes')),
          _ratio(_proc_peak(p), budget),
          fmt_bytes(restore_overhead_bytes(p)),
          _ratio(restore_overhead_bytes(p), budget),
          fmt_bytes(p.get('bytes_written')),
          _secs(p.get('save_seconds')),
          'FAIL' if check_mp([sub]) else 'pass'])
  return markdown_table(MP_COLUMNS, rows)


# --------------------------------------------------------------------------
# Reuse of unchanged leaves (bench/run.py --part reuse).


def reuse_targets(res: dict[str, Any]) -> dict[str, Any]:
  """The targets of one reuse run, from its sizes."""
  changing = int(res.get('changing_bytes') or 0)
  kept = int(res.get('kept') or 3)
  return {
      'write_bytes': REUSE_WRITE_FACTOR * changing,
      'peak_bytes': changing + int(res.get('floor_bytes') or 0),
      'seconds_fraction': REUSE_SECONDS_FRACTION,
      'ideal_disk_bytes': int(res.get('frozen_bytes') or 0) + kept * changing,
  }


def reuse_misses(res: dict[str, Any]) -> list[str]:
  """What one reuse run missed (its targets; see `reuse_targets`)."""
  name = f"reuse/{res.get('variant')}"
  if res.get('error'):
    return [f'{name}: failed: {res["error"]}']
  saves = res.get('saves') or []
  if len(saves) < 2:
    return [f'{name}: fewer than 2 saves recorded']
  t = reuse_targets(res)
  out = []
  first = saves[0]
  budget = res.get('budget_bytes')
  if budget and first.get('peak_extra_bytes') is not None and (
      first['peak_extra_bytes'] > kd_limit_bytes(budget)):
    out.append(f"{name} save 1 (full): peak {fmt_bytes(first['peak_extra_bytes'])} >"
               f' limit {fmt_bytes(kd_limit_bytes(budget))}')
  for i, s in enumerate(saves[1:], start=2):
    if s.get('bytes_written') is not None and s['bytes_written'] > t['write_bytes']:
      out.append(f"{name} save {i}: wrote {fmt_bytes(s['bytes_written'])} >"
                 f" {REUSE_WRITE_FACTOR:g} x changing = {fmt_bytes(t['write_bytes'])}")
    if s.get('peak_extra_bytes') is not None and s['peak_extra_bytes'] > t['peak_bytes']:
      out.append(f"{name} save {i}: peak extra RSS {fmt_bytes(s['peak_extra_bytes'])} >"
                 f" changing + floor = {fmt_bytes(t['peak_bytes'])}")
    if first.get('seconds') and s.get('seconds') is not None and (
        s['seconds'] > REUSE_SECONDS_FRACTION * first['seconds']):
      out.append(f"{name} save {i}: {s['seconds']:.2f} s ="
                 f" {s['seconds'] / first['seconds']:.2f} x the full save's"
                 f" {first['seconds']:.2f} s > {REUSE_SECONDS_FRACTION:g}")
  disk = res.get('disk_bytes')
  if disk is not None and t['ideal_disk_bytes'] and (
      disk > REUSE_DISK_FACTOR * t['ideal_disk_bytes']):
    out.append(f'{name}: disk with {res.get("kept")} kept {fmt_bytes(disk)} >'
               f" {REUSE_DISK_FACTOR:g} x (frozen + {res.get('kept')} x changing ="
               f" {fmt_bytes(t['ideal_disk_bytes'])})")
  return out


def check_reuse(results: Iterable[dict[str, Any]]) -> list[str]:
  """Misses of the reuse runs that are enforced (the Kauldron tiny run is not)."""
  out = []
  for res in results:
    if res.get('enforced', True):
      out += reuse_misses(res)
  return out


REUSE_SUMMARY_COLUMNS = (
    'variant', 'strategy', 'budget', 'frozen', 'changing (trainable+opt+step)',
    'saves', 'full save s', 'max wrote (save 2+)', 'target wrote',
    'max peak extra (save 2+)', 'target peak', 'max s / full s (save 2+)',
    'disk, kept ones (du -s)', 'ideal disk', 'disk / ideal', 'verdict')


def reuse_summary_table(results: Iterable[dict[str, Any]]) -> str:
  rows = []
  for res in results:
    if res.get('error'):
      rows.append(error_row([res.get('variant')], REUSE_SUMMARY_COLUMNS, res['error']))
      continue
    saves = res.get('saves') or []
    later = saves[1:]
    t = reuse_targets(res)
    first_s = saves[0].get('seconds') if saves else None
    mx = lambda k: max((s.get(k) for s in later if s.get(k) is not None), default=None)
    max_s = mx('seconds')
    misses = reuse_misses(res)
    verdict = ('pass' if not misses else f'MISS ({len(misses)})') + (
        '' if res.get('enforced', True) else ', not enforced')
    rows.append([
        res.get('variant'),
        ','.join(sorted({str(s.get('strategy')) for s in saves})) or '-',
        budget_label(res.get('budget_bytes')),
        fmt_bytes(res.get('frozen_bytes')), fmt_bytes(res.get('changing_bytes')),
        str(len(saves)), _secs(first_s),
        fmt_bytes(mx('bytes_written')), fmt_bytes(t['write_bytes']),
        fmt_bytes(mx('peak_extra_bytes')), fmt_bytes(t['peak_bytes']),
        _ratio(max_s, first_s),
        fmt_bytes(res.get('disk_bytes')), fmt_bytes(t['ideal_disk_bytes']),
        _ratio(res.get('disk_bytes'), t['ideal_disk_bytes']),
        verdict,
    ])
  return markdown_table(REUSE_SUMMARY_COLUMNS, rows)


REUSE_SAVE_COLUMNS = ('variant', 'save', 'step', 'strategy', 'wrote', 'reused',
                      'leaves reused', 'peak extra RSS', 'report peak', 'save s',
                      'x full save')


def reuse_saves_table(results: Iterable[dict[str, Any]]) -> str:
  rows = []
  for res in results:
    saves = res.get('saves') or []
    first_s = saves[0].get('seconds') if saves else None
    for i, s in enumerate(saves, start=1):
      rows.append([
          res.get('variant'), str(i), str(s.get('step', '-')), str(s.get('strategy')),
          fmt_bytes(s.get('bytes_written')), fmt_bytes(s.get('bytes_reused')),
          str(s.get('leaves_reused', '-')), fmt_bytes(s.get('peak_extra_bytes')),
          fmt_bytes(s.get('report_peak_extra_bytes')), _secs(s.get('seconds')),
          _ratio(s.get('seconds'), first_s)])
  return markdown_table(REUSE_SAVE_COLUMNS, rows)
