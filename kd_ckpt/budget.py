"""The host-RAM budget: what users write, and the bytes it means.

`host_ram_budget` is a limit on the extra host RAM one save (or restore) may
add: its peak RSS (`VmHWM`, over the whole save, async commit included) minus
the RSS just before it.  The bounded paths (streaming save, every restore)
hold it by construction, through the host limiter; Orbax's own save is used
only when its worst case fits.  The smallest budget kd_ckpt can honour is
`cost.min_budget_bytes()` (30 MiB): a fixed floor plus a few slices.
Users write it as:

  "auto"            AUTO_FRACTION of the memory available to this process
  1 << 30           an int of bytes
  "512MiB", "8GB"   a string with a unit (binary or decimal)
  0.25              a float in (0, 1]: a fraction of available memory

Example:

  spec = budget.parse("512MiB")          # validates, nothing probed
  nbytes = budget.resolve(spec, hostmem.probe())
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

from absl import logging

from kd_ckpt import cost
from kd_ckpt import hostmem
from kd_ckpt import text

# Half of what is available: the training job keeps running beside an async
# save (data pipeline, evals, the next step's host buffers) and the page cache
# needs room for the files being written.  torchsnapshot uses 0.6 for the
# same reason; we are a little more careful because JAX hosts often run the
# input pipeline in the same process.
AUTO_FRACTION = 0.5

_UNITS = {
    '': 1,
    'b': 1,
    'k': 1000, 'kb': 1000, 'kib': 1 << 10,
    'm': 1000**2, 'mb': 1000**2, 'mib': 1 << 20,
    'g': 1000**3, 'gb': 1000**3, 'gib': 1 << 30,
    't': 1000**4, 'tb': 1000**4, 'tib': 1 << 40,
}
_PATTERN = re.compile(r'^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$', re.I)

BudgetLike = str | int | float


@dataclasses.dataclass(frozen=True)
class BudgetSpec:
  """A parsed budget: exactly one of `bytes` or `fraction` is set."""

  text: str
  bytes: int | None = None
  fraction: float | None = None


def parse(value: BudgetLike) -> BudgetSpec:
  """Parses a `host_ram_budget` value; raises ValueError naming the fix."""
  hint = (
      'Use "auto", a number of bytes (e.g. 536870912), a size string such as'
      ' "512MiB" or "8GB", or a fraction of available memory in (0, 1] such'
      ' as 0.25 (or "0.25", "25%").'
  )
  if isinstance(value, BudgetSpec):
    return value
  if isinstance(value, bool) or value is None:
    raise ValueError(f'Invalid host_ram_budget={value!r}. {hint}')
  if isinstance(value, numbers.Integral):  # numpy's integers too
    value = int(value)
    if value <= 0:
      raise ValueError(
          f'host_ram_budget={value!r} must be positive. {hint}'
      )
    return BudgetSpec(text=str(value), bytes=value)
  if isinstance(value, float):
    if not 0.0 < value <= 1.0:
      # Bytes given as a float (1.5 meaning 1.5 GiB?) get a string to write;
      # nan, inf and negatives no suggestion built from them.
      instead = (f' For bytes pass an int or a string such as "{value:g}GiB".'
                 if 1.0 < value < math.inf else '')
      raise ValueError(
          f'host_ram_budget={value!r}: a float budget is a fraction of'
          f' available memory and must be in (0, 1].{instead} {hint}'
      )
    return BudgetSpec(text=f'{value:g} of available', fraction=value)
  if isinstance(value, str):
    text = value.strip()
    if text.lower() == 'auto':
      return BudgetSpec(text='auto', fraction=AUTO_FRACTION)
    # A fraction written as text, as command lines pass it ('0.25', '25%'):
    # read as bytes, '0.25' was refused as "not positive".
    if (pct := re.fullmatch(r'([0-9]*\.?[0-9]+)\s*%', text)) is not None:
      return parse(float(pct.group(1)) / 100) if 0 < float(pct.group(1)) <= 100 else _refuse(
          value, f'a percentage of available memory must be in (0%, 100%]. {hint}')
    if re.fullmatch(r'[0-9]*\.[0-9]+', text):
      return parse(float(text)) if float(text) <= 1 else _refuse(
          value, 'a number with a decimal point and no unit is a fraction of available'
          f' memory and must be in (0, 1]. For bytes write "{text}GiB" or an integer. {hint}')
    m = _PATTERN.match(text)
    if not m or m.group(2).lower() not in _UNITS:
      raise ValueError(f'Cannot parse host_ram_budget={value!r}. {hint}')
    nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if nbytes <= 0:
      raise ValueError(f'host_ram_budget={value!r} must be positive. {hint}')
    return BudgetSpec(text=text, bytes=nbytes)
  raise ValueError(
      f'Invalid host_ram_budget={value!r} of type {type(value).__name__}. {hint}'
  )


def _refuse(value, why: str):
  raise ValueError(f'host_ram_budget={value!r}: {why}')


def resolve(spec: BudgetLike | BudgetSpec, mem: hostmem.HostMemory) -> int:
  """The budget in bytes for this process now; clamps to what exists.

  Args:
    spec: a budget as the user wrote it, or parsed.
    mem: the host memory probe to resolve fractions against.

  Returns:
    Bytes.  An explicit budget above this process's share of the host's
    total memory is clamped to that share, with a warning: promising more
    than exists would only move the OOM from the plan to the save.
  """
  spec = parse(spec)
  if spec.fraction is not None:
    nbytes = int(mem.available_share_bytes * spec.fraction)
    floor = cost.min_budget_bytes()
    if nbytes < floor:
      # "auto" shrinks with what is free; it never falls below what the
      # bounded writer needs, or a run could fail hours in at a save that
      # fits in a few slices anyway.
      logging.warning(
          'host_ram_budget=%s resolves to %s (%s available to this process);'
          ' using the smallest budget kd_ckpt honours, %s.', spec.text,
          text.format_bytes(nbytes), text.format_bytes(mem.available_share_bytes),
          text.format_bytes(floor))
      return floor
    return nbytes
  assert spec.bytes is not None
  limit = mem.total_share_bytes
  if spec.bytes > limit:
    logging.warning(
        'host_ram_budget=%s is more than this process can have (%s of %s'
        ' total, %d process(es) on this host); clamping to %s.',
        spec.text,
        text.format_bytes(limit),
        text.format_bytes(mem.total_bytes),
        mem.local_process_count,
        text.format_bytes(limit),
    )
    return limit
  return spec.bytes
