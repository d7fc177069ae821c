"""What a save did, measured: the value `kd_ckpt.save` returns and every save logs.

Example:

  report = kd_ckpt.save('/tmp/ckpt', state, host_ram_budget='1GiB')
  print(report)          # table
  report.peak_extra_bytes <= report.budget_bytes
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from etils import epath

from kd_ckpt import text

# Written next to kd_ckpt's checkpoints (never inside Orbax's item folders):
# `python -m kd_ckpt inspect` reads it to say which strategy wrote a step.
REPORT_FILE_NAME = 'kd_ckpt_report.json'


@dataclasses.dataclass(frozen=True)
class SaveReport:
  """A finished save, with measured numbers.

  Attributes:
    directory: the checkpoint directory written.
    strategy: 'orbax' or 'streaming'.
    settings: the Orbax settings or streaming layout used, as a short string.
    budget_bytes: the resolved host-RAM budget.
    predicted_peak_bytes: the plan's prediction of peak extra RSS (an upper
      bound the limiter enforces for streaming; Orbax's worst case otherwise).
    peak_extra_bytes: measured peak RSS during the whole save (for an async
      save, until its background commit finished) minus RSS just before it
      (`/proc/self/clear_refs` + `VmHWM`).
    retained_bytes: RSS after the save (and the memory release) minus before.
    bytes_written: bytes of array data this host wrote (uncompressed).
    bytes_reused: bytes of unchanged leaves taken by reference from the
      previous checkpoint instead of being written.
    leaves_reused: how many leaves (this host's parts) were reused.
    seconds: wall time of the save, until durable on disk (async: until the
      background commit finished).
    async_commit: True when the save returned before its commit finished;
      the numbers then cover the commit too.
    exact_peak: False where the kernel refused the peak reset (then the
      peak is the process's lifetime high-water mark).
    startup_bytes: part of the peak this save paid for XLA's compiler
      start-up, because it was the process's first jit (`kd_ckpt.startup`).
  """

  directory: str
  strategy: str
  settings: str
  budget_bytes: int
  predicted_peak_bytes: int
  peak_extra_bytes: int
  retained_bytes: int
  bytes_written: int
  seconds: float
  bytes_reused: int = 0
  leaves_reused: int = 0
  async_commit: bool = False
  exact_peak: bool = True
  startup_bytes: int = 0

  @property
  def gb_per_sec(self) -> float:
    return self.bytes_written / 1e9 / self.seconds if self.seconds > 0 else 0.0

  @property
  def within_budget(self) -> bool:
    return self.peak_extra_bytes <= self.budget_bytes

  def to_json_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d['gb_per_sec'] = self.gb_per_sec
    d['within_budget'] = self.within_budget
    return d

  def write_json(self, path) -> None:
    """Writes the report to `path` (a local path or a gs:// URL)."""
    epath.Path(path).write_text(json.dumps(self.to_json_dict(), indent=2))

  def summary(self) -> str:
    fb = text.format_bytes
    reused = (f', reused {fb(self.bytes_reused)} ({self.leaves_reused} leaves)'
              if self.leaves_reused else '')
    when = ' (async, commit included)' if self.async_commit else ''
    return (
        f'{self.strategy} ({self.settings}): peak extra RSS'
        f' {fb(self.peak_extra_bytes)} of budget {fb(self.budget_bytes)}'
        f' (predicted {fb(self.predicted_peak_bytes)}){when},'
        f' wrote {fb(self.bytes_written)}{reused} in {self.seconds:.2f} s'
        f' ({self.gb_per_sec:.2f} GB/s)')

  def __str__(self) -> str:
    fb = text.format_bytes
    rows = [
        ('directory', self.directory),
        ('strategy', f'{self.strategy} ({self.settings})'),
        ('budget', fb(self.budget_bytes)),
        ('predicted peak extra RSS', fb(self.predicted_peak_bytes)),
        ('measured peak extra RSS',
         fb(self.peak_extra_bytes) + ('' if self.exact_peak else ' (lifetime HWM)')
         + (' (async commit included)' if self.async_commit else '')),
        *([('of which XLA start-up', fb(self.startup_bytes))] if self.startup_bytes else []),
        ('peak / budget', f'{self.peak_extra_bytes / max(1, self.budget_bytes):.2f}'),
        ('RSS retained after save', fb(self.retained_bytes)),
        ('bytes written', fb(self.bytes_written)),
        ('bytes reused', f'{fb(self.bytes_reused)} ({self.leaves_reused} leaves)'),
        ('seconds', f'{self.seconds:.2f}'),
        ('throughput', f'{self.gb_per_sec:.2f} GB/s'),
    ]
    return text.key_values(rows)
