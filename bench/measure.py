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

# kd_ckpt's promises, as checked by the benchmark.
STREAMING_BUDGET_FACTOR = 1.10
STREAMING_BUDGET_SLACK_BYTES = 32 * MiB
SOAK_DRIFT_LIMIT_BYTES = 16 * MiB
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
  return fmt_bytes(budget)


# --------------------------------------------------------------------------
# Thresholds.


def streaming_limit_bytes(budget: int) -> int:
  """Most peak extra RSS a kd_ckpt streaming save may use at `budget`."""
  return int(budget * STREAMING_BUDGET_FACTOR + STREAMING_BUDGET_SLACK_BYTES)


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


def check_rows(rows: Iterable[dict[str, Any]]) -> list[str]:
  """Threshold violations of kd_ckpt's save rows (empty list: all pass).

  Rules: every kd_ckpt row must have succeeded; every streaming row's peak
  extra RSS must be <= budget * 1.10 + 32 MiB.
  """
  failures = []
  for row in rows:
    if not is_kd(row):
      continue
    name = f"{row.get('state')}/{row.get('variant')}@{budget_label(row.get('budget_bytes'))}"
    if row.get('error'):
      failures.append(f'{name}: failed: {row["error"]}')
      continue
    if row.get('variant') == 'kd_ckpt streaming':
      budget = row.get('budget_bytes')
      peak = row.get('peak_extra_bytes')
      if budget is None or peak is None:
        failures.append(f'{name}: no budget/peak measured')
        continue
      limit = streaming_limit_bytes(budget)
      if peak > limit:
        failures.append(
            f'{name}: peak extra RSS {fmt_bytes(peak)} > limit'
            f' {fmt_bytes(limit)} (budget*{STREAMING_BUDGET_FACTOR:.2f}'
            f' + {fmt_bytes(STREAMING_BUDGET_SLACK_BYTES)})')
  return failures


def budget_warnings(rows: Iterable[dict[str, Any]]) -> list[str]:
  """kd_ckpt auto rows whose peak exceeds the budget: reported, not enforced."""
  out = []
  for row in rows:
    budget, peak = row.get('budget_bytes'), row.get('peak_extra_bytes')
    if (row.get('variant') == 'kd_ckpt auto' and budget and peak is not None
        and peak > budget):
      out.append(f"{row.get('state')}/kd_ckpt auto@{budget_label(budget)}: peak"
                 f' {fmt_bytes(peak)} > budget ({peak / budget:.2f}x)')
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
    'restore s', 'notes',
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
      (fmt_bytes(restore_extra - restored)
       if restore_extra is not None and restored is not None else '-'),
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
          f'drift ({lo + 1} -> {hi + 1})', 'max peak extra', 'mean save s',
          'malloc in-use drift', 'verdict')


def soak_row_cells(soak: dict[str, Any]) -> list[str]:
  rss = soak.get('rss_after_bytes', [])
  drift = soak_drift(rss)
  peaks = soak.get('peak_extra_bytes', [])
  secs = soak.get('seconds', [])
  if soak.get('error'):
    verdict = f"ERROR: {soak['error']}"
  elif not is_kd(soak):
    verdict = 'reference'
  elif drift is not None and drift <= SOAK_DRIFT_LIMIT_BYTES:
    verdict = 'pass'
  else:
    verdict = 'FAIL'
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
      _secs(sum(secs) / len(secs)) if secs else '-',
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
