"""Verify: re-read a checkpoint within a budget and check every leaf's CRC32C.

The leaves come from the checkpoint's own metadata (`_METADATA`), not from
the checksum records, so a leaf nobody checksummed is reported `unchecked`
rather than silently skipped.  Each box a save recorded (see
`kd_ckpt.integrity`) is read back in pieces of at most the budget's piece
size, in C order, so the running CRC32C equals the one taken at save time
without ever holding the box; stored chunks bigger than a piece are read in
byte ranges or streamed through zstd (`reading`).

Example:

  report = kd_ckpt.verify('/ckpt/step_100', host_ram_budget='256MiB')
  print(report)            # one row per leaf: ok / CORRUPT / unreadable
  if not report.ok:
    raise SystemExit(1)

  # or on the command line (exit status 1 when any leaf is corrupt, and when
  # one is unchecked unless --allow-unchecked):
  #   python -m kd_ckpt verify /ckpt/step_100
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

from etils import epath
import numpy as np

from kd_ckpt import arrays as arrays_lib
from kd_ckpt import budget as budget_lib
from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import hostmem
from kd_ckpt import inspecting
from kd_ckpt import integrity
from kd_ckpt import reading
from kd_ckpt import slicing
from kd_ckpt import storage
from kd_ckpt import text

# Orbax stores these as arrays in the OCDBT database (strings go elsewhere).
_STORED_TYPES = ('jax.Array', 'np.ndarray', 'scalar')


class CorruptCheckpointError(ValueError):
  """A checkpoint's bytes do not match the checksums recorded when it was saved."""


class NoChecksumsError(ValueError):
  """`restore(verify=True)` found leaves without a recorded checksum (e.g. stock Orbax's)."""


OK, CORRUPT, UNREADABLE, INCOMPLETE, UNCHECKED = (
    'ok', 'CORRUPT', 'unreadable', 'incomplete', 'unchecked')


@dataclasses.dataclass(frozen=True)
class LeafCheck:
  """One stored array: ok, CORRUPT, unreadable, incomplete or unchecked.

  `unchecked`: the checkpoint stores the leaf, but no checksum was recorded
  for it (saved by stock Orbax or an older kd_ckpt), so nothing vouches for it.
  """

  name: str
  path: str
  status: str
  checked_bytes: int
  detail: str = ''


@dataclasses.dataclass(frozen=True)
class VerifyReport:
  """Every leaf's check; `str()` is a table, `ok` is the verdict."""

  directory: str
  leaves: tuple[LeafCheck, ...]
  seconds: float
  peak_extra_bytes: int

  @property
  def ok(self) -> bool:
    """No leaf is corrupt, unreadable or incomplete (unchecked ones aside)."""
    return all(l.status in (OK, UNCHECKED) for l in self.leaves)

  @property
  def bad(self) -> tuple[LeafCheck, ...]:
    return tuple(l for l in self.leaves if l.status not in (OK, UNCHECKED))

  @property
  def unchecked(self) -> tuple[LeafCheck, ...]:
    return tuple(l for l in self.leaves if l.status == UNCHECKED)

  @property
  def checked_bytes(self) -> int:
    return sum(l.checked_bytes for l in self.leaves)

  def to_json_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d['ok'] = self.ok
    return d

  def summary(self) -> str:
    if not self.ok:
      verdict = f'{len(self.bad)} BAD: ' + ', '.join(
          l.path for l in self.bad[:5]) + (' ...' if len(self.bad) > 5 else '')
    elif self.unchecked:
      verdict = f'{len(self.unchecked)} UNCHECKED (no checksum recorded): ' + ', '.join(
          l.path for l in self.unchecked[:5]) + (' ...' if len(self.unchecked) > 5 else '')
    else:
      verdict = 'all OK'
    return (f'{len(self.leaves)} leaves, {text.format_bytes(self.checked_bytes)}'
            f' checked in {self.seconds:.2f} s: {verdict}')

  def __str__(self) -> str:
    rows = [('leaf', 'bytes', 'status', 'detail')]
    rows += [(l.path, text.format_bytes(l.checked_bytes), l.status, l.detail)
             for l in self.leaves]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f'verify {self.directory}: {self.summary()}']
    for r in rows:
      lines.append('  '.join(c.ljust(w) for c, w in zip(r[:3], widths)) + ('  ' + r[3] if r[3] else ''))
    return '\n'.join(lines)


def _crc_box(src: reading.Source, box: integrity.Box, dtype: np.dtype, limit: int,
             crc: int = 0, axis: int = 0) -> int:
  """CRC32C of `box` in C order, reading pieces of at most ~`limit` bytes.

  Dims before `axis` are one index wide, so concatenating the pieces along
  `axis` in order gives the box's C-order bytes.
  """
  dims = [b - a for a, b in box]
  if math.prod(dims) * dtype.itemsize <= limit or axis >= len(box):
    with src.assembled(slicing.from_pairs(box)) as data:
      return integrity.crc32c(data if data.dtype == dtype else data.astype(dtype), crc)
  inner = math.prod(dims[axis + 1:]) * dtype.itemsize
  a0, b0 = box[axis]
  if inner <= limit:
    step = max(1, limit // max(1, inner))
    for s in range(a0, b0, step):
      piece = box[:axis] + ((s, min(b0, s + step)),) + box[axis + 1:]
      crc = _crc_box(src, piece, dtype, limit, crc, len(box))
    return crc
  for s in range(a0, b0):
    crc = _crc_box(src, box[:axis] + ((s, s + 1),) + box[axis + 1:], dtype, limit, crc, axis + 1)
  return crc


def check_leaf(directory: epath.Path, rec: integrity.LeafRecord, ctx: reading.ReadContext) -> LeafCheck:
  """Re-reads every recorded box of one array and compares CRCs."""
  dtype = np.dtype(rec.dtype)
  try:
    src = reading.open_stored(directory, rec.name, ctx)
  except Exception as e:  # pylint: disable=broad-exception-caught
    return LeafCheck(rec.name, rec.path, UNREADABLE, 0, f'cannot open: {_short(e)}')
  with src:  # its kept decoders go when the leaf is checked
    return _check_boxes(src, rec, dtype, ctx)


def _check_boxes(src: reading.Source, rec: integrity.LeafRecord, dtype,
                 ctx: reading.ReadContext) -> LeafCheck:
  if tuple(src.shape) != tuple(rec.shape):
    return LeafCheck(rec.name, rec.path, CORRUPT, 0,
                     f'stored shape {tuple(src.shape)} != recorded {tuple(rec.shape)}')
  checked = 0
  for box, want in rec.boxes:
    try:
      got = _crc_box(src, box, dtype, ctx.piece_bytes)
    except Exception as e:  # pylint: disable=broad-exception-caught
      return LeafCheck(rec.name, rec.path, UNREADABLE, checked,
                       f'read of box {_box_text(box)} failed: {_short(e)}')
    if got != want:
      return LeafCheck(rec.name, rec.path, CORRUPT, checked,
                       f'box {_box_text(box)}: crc32c {got:08x} != saved {want:08x}')
    checked += math.prod(b - a for a, b in box) * dtype.itemsize
  volume = math.prod(rec.shape) * dtype.itemsize
  # Boxes of one array never overlap (each byte has one writer), so a sum
  # short of the volume means a process's checksum file is missing.
  if checked < volume:
    return LeafCheck(rec.name, rec.path, INCOMPLETE, checked,
                     f'checksums cover {checked} of {volume} bytes (a process file missing?)')
  return LeafCheck(rec.name, rec.path, OK, checked)


def verify(
    directory: str | os.PathLike[str],
    *,
    host_ram_budget: budget_lib.BudgetLike = 'auto',
) -> VerifyReport:
  """Re-reads a kd_ckpt checkpoint and checks every leaf against its CRC32C.

  Args:
    directory: the checkpoint folder (`kd_ckpt.save`'s directory, or a
      Kauldron step's item folder `ckpt_N/default`).
    host_ram_budget: extra host RAM the re-read may use.

  Returns:
    A VerifyReport; `report.ok` is False when any leaf is corrupt,
    unreadable or not fully covered.  Leaves with no recorded checksum
    (every leaf of a stock Orbax checkpoint) are listed `unchecked`: the
    CLI and `restore(verify=True)` refuse them unless allowed.

  Raises:
    FileNotFoundError: nothing at `directory`.
    NoCheckpointError: `directory` holds no checkpoint (the error names the
      one to pass when it is a Kauldron step or a workdir).
    ValueError: `directory` is an unfinished save.
  """
  # The checks and messages of a restore: a folder without _METADATA had
  # raised FileNotFoundError for its '_METADATA'.
  path = inspecting.checkpoint_dir(directory)
  no_sums = not integrity.has_checksums(path)
  why_unchecked = (
      f'no kd_ckpt checksums ({integrity.FILE_PREFIX}.process_*.json): saved by'
      ' stock Orbax or without checksums' if no_sums else 'no checksum recorded')
  budget_bytes = budget_lib.resolve(budget_lib.parse(host_ram_budget), hostmem.probe())
  ctx = arrays_lib.read_context_for(cost.limiter_capacity(budget_bytes))
  hostmem.release_free_memory()
  with hostmem.PeakRss() as peak, ctx.limiter.lease(
      ctx.capacity_bytes,
      mmap_threshold_bytes=hostmem.read_mmap_threshold(remote=storage.is_remote(directory),
                                                      capacity_bytes=ctx.capacity_bytes)):
    start = time.monotonic()
    records = integrity.read(path)
    checks = []
    # Every leaf the checkpoint stores, from its own metadata.
    for name, value_type in sorted(compat.stored_params(path)):
      if value_type not in _STORED_TYPES:
        continue
      rec = records.get(name)
      if rec is None:
        checks.append(LeafCheck(name, name, UNCHECKED, 0, why_unchecked))
      else:
        checks.append(check_leaf(path, rec, ctx))
    seconds = time.monotonic() - start
  hostmem.release_free_memory()
  return VerifyReport(os.fspath(directory), tuple(checks), seconds, peak.extra_bytes)


def _box_text(box: integrity.Box) -> str:
  return '[' + ', '.join(f'{a}:{b}' for a, b in box) + ']'


def _short(e: BaseException) -> str:
  text = f'{type(e).__name__}: {e}'.replace('\n', ' ')
  return text if len(text) < 200 else text[:197] + '...'
