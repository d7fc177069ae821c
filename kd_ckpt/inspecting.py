"""Find a checkpoint from whatever folder a user points at, and describe it.

Accepts a PyTree checkpoint (it has `_METADATA`), a Kauldron step `ckpt_N`
(it has `default/`), a `checkpoints/` folder or a workdir (its latest step),
or a folder of step-numbered `kd_ckpt.save` checkpoints.

Example:

  info = kd_ckpt.inspect('/tmp/lora')        # latest step of a workdir
  print(info)                                # table: leaves, how it was saved
  info.report.bytes_reused if info.report else None
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from kd_ckpt import report as report_lib
from kd_ckpt import storage
from kd_ckpt import text
from kd_ckpt import tree as tree_lib

# Kauldron's `ckpt_<N>`, or a bare `<N>` (one kd_ckpt.save per step).
_STEP_DIR_RE = re.compile(r'^(?:ckpt_)?(\d+)$')


class NoCheckpointError(ValueError):
  """The given folder is not a checkpoint kd_ckpt can read (nor holds one)."""


def checkpoint_dir(directory) -> epath.Path:
  """`directory` if it is a PyTree checkpoint; else an error saying what to pass."""
  path = storage.as_path(directory)
  storage.forget_listings(path)
  # On a bucket each question is a round trip (or two): asked together, the
  # answers come back in one.  Read in the same order as locally.
  exists, unfinished, has_metadata = storage.ask_together(
      path.exists, lambda: storage.is_unfinished(path, exists=True),
      (path / '_METADATA').exists, remote=storage.is_remote(path))
  if not exists():
    raise FileNotFoundError(
        f'No checkpoint at {os.fspath(directory)!r}. Check the path (for a'
        ' Kauldron step, point at its item folder, e.g. ckpt_100/default).')
  if unfinished():
    # Even with a complete _METADATA (killed just before the rename or the
    # commit file), an unfinished save is never a checkpoint: nothing vouches
    # for it.
    what = ('Orbax temporary directory' if storage.TMP_MARKER in path.name else
            f'no {storage.COMMIT_FILE}, which Orbax writes last on {storage.scheme(path)}://')
    raise ValueError(
        f'{path} is an unfinished save ({what}), never a checkpoint. Restore'
        ' a finished step (`python -m kd_ckpt inspect` finds the latest), or an'
        ' earlier one.')
  if has_metadata():
    return path
  hint = ''
  if (path / 'default' / '_METADATA').exists():
    hint = f' It looks like a Kauldron step: pass its item folder {path / "default"}.'
  else:
    # A manager's or a workdir's root: name the checkpoint to pass (the
    # latest step), not restore it silently.
    try:
      found, _ = find_checkpoint(path)
      hint = (f' The latest checkpoint under it is {found}: pass that (it is'
              f' `kd_ckpt.find_checkpoint({os.fspath(directory)!r})[0]`).')
    except (NoCheckpointError, OSError):
      pass
  raise NoCheckpointError(
      f'{path} is not an Orbax PyTree checkpoint (no _METADATA).{hint}'
      ' `python -m kd_ckpt inspect DIR` finds the checkpoints under a folder.')


def _is_step_dir(path: epath.Path) -> bool:
  return (path / 'default' / '_METADATA').is_file() and not storage.is_unfinished(path)


def find_checkpoint(directory) -> tuple[epath.Path, epath.Path | None]:
  """(PyTree checkpoint dir, Kauldron/kd_ckpt step dir or None) for `directory`."""
  path = storage.as_path(directory)
  storage.forget_listings(path)  # Steps other processes wrote since we last looked.
  if not path.is_dir():
    raise FileNotFoundError(f'no such directory: {os.fspath(directory)!r}')
  if (path / '_METADATA').is_file():
    if _is_step_dir(path.parent):
      return path, path.parent
    return path, (path if _STEP_DIR_RE.match(path.name) else None)
  if _is_step_dir(path):
    return path / 'default', path
  if (path / 'checkpoints').is_dir():
    path = path / 'checkpoints'
  # Finished steps only: Orbax renames `<name>.orbax-checkpoint-tmp*` at the
  # end (local), or writes `commit_success.txt` last (gs://).
  steps = sorted(
      (int(m.group(1)), p) for p in path.iterdir()
      if (m := _STEP_DIR_RE.match(p.name))
      and (_is_step_dir(p) or ((p / '_METADATA').is_file() and not storage.is_unfinished(p))))
  if steps:
    step_dir = steps[-1][1]
    return (step_dir / 'default', step_dir) if _is_step_dir(step_dir) else (step_dir, step_dir)
  raise NoCheckpointError(
      f'no checkpoint in {os.fspath(directory)!r}: expected a PyTree'
      ' checkpoint (with _METADATA), a Kauldron step (ckpt_N/default/), a'
      ' checkpoints/ folder, a workdir holding ckpt_N steps, or a folder of'
      ' step-numbered checkpoints (e.g. kd_ckpt.save(f"{root}/{step}", ...)).')


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
  """One stored leaf, from Orbax's metadata (no array data read)."""

  path: str
  shape: tuple[int, ...] | None
  dtype: str | None
  nbytes: int | None


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  """What `kd_ckpt.inspect` found; `str()` is the table the CLI prints.

  Attributes:
    directory: the PyTree checkpoint folder.
    step_directory: its Kauldron/kd_ckpt step folder, if any.
    step: the step number, if the folder names one.
    leaves: every stored leaf.
    disk_bytes: bytes on disk under `directory` (hard-linked reused files
      count once per checkpoint; `du` shows what is shared).
    report: kd_ckpt's report of the save, if kd_ckpt saved it.
  """

  directory: str
  step_directory: str | None
  step: int | None
  leaves: tuple[StoredLeaf, ...]
  disk_bytes: int
  report: report_lib.SaveReport | None

  @property
  def total_bytes(self) -> int:
    return sum(l.nbytes or 0 for l in self.leaves)

  @property
  def saved_by(self) -> str:
    return 'kd_ckpt' if self.report is not None else 'orbax'

  def to_json_dict(self) -> dict[str, Any]:
    return {
        'directory': self.directory, 'step_directory': self.step_directory,
        'step': self.step, 'num_leaves': len(self.leaves),
        'total_bytes': self.total_bytes, 'disk_bytes': self.disk_bytes,
        'leaves': [{'path': l.path, 'shape': list(l.shape) if l.shape is not None else None,
                    'dtype': l.dtype, 'bytes': l.nbytes} for l in self.leaves],
        'saved_by': self.saved_by,
        'report': self.report.to_json_dict() if self.report else None,
    }

  def __str__(self) -> str:
    fb = text.format_bytes
    lines = [f'checkpoint  {self.directory}']
    if self.step is not None:
      lines.append(f'step        {self.step}')
    lines.append(f'leaves      {len(self.leaves)}, {fb(self.total_bytes)}'
                 f' ({fb(self.disk_bytes)} on disk)')
    r = self.report
    if r is None:
      lines.append('saved by    Orbax (no kd_ckpt report)')
    else:
      lines.append(f'saved by    kd_ckpt, strategy {r.strategy} ({r.settings})')
      for label, value in (
          ('budget', fb(r.budget_bytes)),
          ('predicted peak extra RSS', fb(r.predicted_peak_bytes)),
          ('measured peak extra RSS', fb(r.peak_extra_bytes)
           + (' (async commit included)' if r.async_commit else '')),
          ('RSS retained after save', fb(r.retained_bytes)),
          ('bytes written', fb(r.bytes_written)),
          ('bytes reused', f'{fb(r.bytes_reused)} ({r.leaves_reused} leaves)'),
          ('seconds', f'{r.seconds:.2f} ({r.gb_per_sec:.2f} GB/s)'),
      ):
        lines.append(f'  {label:<26}{value}')
    rows = [('path', 'shape', 'dtype', 'bytes')]
    rows += [(l.path, 'n/a' if l.shape is None else str(l.shape), l.dtype or 'n/a',
              fb(l.nbytes)) for l in self.leaves]
    return '\n'.join(lines) + '\n\n' + text.table(rows, align_right=(3,))


def read_leaves(item_dir) -> tuple[StoredLeaf, ...]:
  """The leaves of a PyTree checkpoint, from Orbax's metadata only."""
  metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(item_dir))
  tree = getattr(metadata, 'tree', metadata)
  out = []
  for leaf in tree_lib.leaves(tree):
    shape = getattr(leaf.value, 'shape', None)
    dtype = getattr(leaf.value, 'dtype', None)
    shape = tuple(int(d) for d in shape) if shape is not None else None
    nbytes = None
    if dtype is not None:
      dtype = np.dtype(dtype) if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else None
    if dtype is not None:
      nbytes = math.prod(shape) * dtype.itemsize if shape is not None else None
      dtype = dtype.name
    out.append(StoredLeaf(leaf.name, shape, dtype, nbytes))
  return tuple(out)


def read_report(item_dir, step_dir=None) -> report_lib.SaveReport | None:
  """kd_ckpt's report of this save: in the checkpoint or its step folder."""
  for d in (item_dir, step_dir):
    f = epath.Path(d) / report_lib.REPORT_FILE_NAME if d is not None else None
    if f is not None and f.is_file():
      data = json.loads(f.read_text())
      # Reports of other kd_ckpt versions may lack fields: zero them.
      fields = {k.name: k for k in dataclasses.fields(report_lib.SaveReport)}
      values = {k: v for k, v in data.items() if k in fields}
      for name, field in fields.items():
        if name not in values and field.default is dataclasses.MISSING:
          values[name] = '' if field.type in ('str', str) else 0
      return report_lib.SaveReport(**values)
  return None


def inspect(directory) -> CheckpointInfo:
  """Describes the checkpoint at (or under) `directory`; reads no array data."""
  item_dir, step_dir = find_checkpoint(directory)
  m = _STEP_DIR_RE.match(step_dir.name) if step_dir is not None else None
  return CheckpointInfo(
      directory=os.fspath(item_dir),
      step_directory=os.fspath(step_dir) if step_dir is not None else None,
      step=int(m.group(1)) if m else None,
      leaves=read_leaves(item_dir), disk_bytes=storage.total_bytes(item_dir),
      report=read_report(item_dir, step_dir))
