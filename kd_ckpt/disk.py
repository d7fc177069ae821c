"""Disk: is the destination writable, is there room, and was a failure a full disk.

Checked before a save writes anything, so a typo'd or read-only path fails
at once with the fix named, and an unfinished save never leaves its
temporary directory behind to fill the disk further.

Example:

  disk.check_writable(path)                   # PermissionError naming the folder
  disk.check_free_space(path, needed_bytes)   # DiskFullError before writing
  try:
    save()
  except Exception as e:
    disk.remove_unfinished(path)
    if disk.is_disk_full(e):
      raise disk.DiskFullError.during_save(path, needed_bytes) from e
    raise
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

from etils import epath

from kd_ckpt import text

# Orbax writes `<name>.orbax-checkpoint-tmp[-<n>]` and renames it at the end.
TMP_MARKER = '.orbax-checkpoint-tmp'
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How TensorStore reports ENOSPC/EDQUOT inside its ValueError text.
_FULL_TEXTS = ('No space left on device', "os_error_code='28'",
               'Disk quota exceeded', "os_error_code='122'")


class DiskFullError(OSError):
  """The checkpoint's filesystem ran out of space (errno ENOSPC)."""

  @classmethod
  def during_save(cls, directory, needed_bytes: int | None) -> 'DiskFullError':
    free = free_bytes(directory)
    needed = (f' the save needed about {text.format_bytes(needed_bytes)} (uncompressed), and'
              if needed_bytes is not None else '')
    return cls(errno.ENOSPC, (
        f'Disk full while saving {os.fspath(directory)!r}:{needed}'
        f' {text.format_bytes(free)} is free now that its partial files are'
        ' removed. Earlier checkpoints are untouched. Free space (e.g. a lower'
        ' max_to_keep) or save elsewhere, then save again.'))


def nearest_existing(path: epath.PathLike) -> epath.Path:
  p = epath.Path(os.path.abspath(os.fspath(path)))
  while not p.exists() and p != p.parent:
    p = p.parent
  return p


def check_writable(directory: epath.PathLike) -> None:
  """Raises PermissionError unless files can be created where `directory` goes.

  Creates and removes a probe file in the nearest existing ancestor: mode
  bits alone say nothing for root, a read-only mount or a quota.
  """
  base = nearest_existing(directory)
  if not base.is_dir():
    raise NotADirectoryError(
        f'Cannot save to {os.fspath(directory)!r}: {os.fspath(base)!r} is a file,'
        ' not a folder. Pick another checkpoint directory.')
  try:
    fd, probe = tempfile.mkstemp(prefix='.kd_ckpt_probe_', dir=os.fspath(base))
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    if e.errno in _FULL_ERRNOS:
      raise DiskFullError(e.errno, (
          f'Disk full at {os.fspath(base)!r}: not even an empty file can be'
          ' created there. Free space or save elsewhere.')) from e
    raise PermissionError(e.errno, (
        f'Cannot write to {os.fspath(base)!r} (needed to create'
        f' {os.fspath(directory)!r}): {e.strerror}. Pick a directory you can'
        ' write to, or fix its permissions / mount.')) from e


def free_bytes(directory: epath.PathLike) -> int:
  return shutil.disk_usage(os.fspath(nearest_existing(directory))).free


def check_free_space(directory: epath.PathLike, needed_bytes: int) -> None:
  """Raises DiskFullError before writing when `needed_bytes` cannot fit."""
  free = free_bytes(directory)
  if needed_bytes > free:
    raise DiskFullError(errno.ENOSPC, (
        f'Not enough disk space for {os.fspath(directory)!r}: the save needs'
        f' about {text.format_bytes(needed_bytes)} and'
        f' {text.format_bytes(free)} is free on'
        f' {os.fspath(nearest_existing(directory))!r}. Nothing was written.'
        ' Free space (e.g. a lower max_to_keep) or save elsewhere.'))


def is_disk_full(exc: BaseException) -> bool:
  """Whether `exc` (or anything in its cause chain) is ENOSPC/EDQUOT."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
      return True
    if any(t in str(exc) for t in _FULL_TEXTS):
      return True
    exc = exc.__cause__ or exc.__context__
  return False


def remove_unfinished(directory: epath.PathLike) -> list[str]:
  """Removes Orbax temporary directories of `directory` (unfinished saves).

  Only `<name>.orbax-checkpoint-tmp*` siblings of this exact target: a
  finished checkpoint, or another step's save, is never touched.
  """
  d = epath.Path(directory)
  removed = []
  if not d.parent.exists():
    return removed
  for p in d.parent.iterdir():
    if p.name.startswith(d.name + TMP_MARKER):
      shutil.rmtree(os.fspath(p), ignore_errors=True)
      removed.append(os.fspath(p))
  return removed
