"""Human output: byte sizes and tables, the same everywhere kd_ckpt prints.

Example:

  text.format_bytes(3 * 2**30)                       # '3.00 GiB'
  print(text.table([('leaf', 'bytes'), ('w', '4.00 MiB')]))
"""

from __future__ import annotations

from typing import Sequence


def format_bytes(num_bytes: float | None) -> str:
  """`format_bytes(3 * 2**30) == '3.00 GiB'`; None prints as 'n/a'."""
  if num_bytes is None:
    return 'n/a'
  sign = '-' if num_bytes < 0 else ''
  value = abs(float(num_bytes))
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if value < 1024 or unit == 'TiB':
      return f'{sign}{value:.0f} {unit}' if unit == 'B' else f'{sign}{value:.2f} {unit}'
    value /= 1024
  raise AssertionError('unreachable')


def budget_literal(num_bytes: int) -> str:
  """A budget, rounded up to a whole MiB, as the string to pass: `budget_literal(47 << 20) == "'47MiB'"`."""
  mib = -(-int(num_bytes) // (1 << 20))
  return f"'{mib // 1024}GiB'" if mib % 1024 == 0 else f"'{mib}MiB'"


def table(rows: Sequence[Sequence[str]], *, align_right: Sequence[int] = ()) -> str:
  """Rows of strings as aligned columns; the first row is the header."""
  rows = [tuple(str(c) for c in r) for r in rows]
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

  def line(r):
    cells = [c.rjust(w) if i in align_right else c.ljust(w)
             for i, (c, w) in enumerate(zip(r, widths))]
    return '  '.join(cells).rstrip()

  out = [line(rows[0]), '  '.join('-' * w for w in widths)]
  out += [line(r) for r in rows[1:]]
  return '\n'.join(out)


def key_values(rows: Sequence[tuple[str, str]]) -> str:
  """'key  value' lines, keys padded to one width (report-style tables)."""
  width = max(len(k) for k, _ in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)
