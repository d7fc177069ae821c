"""Where checkpoints live: local folders and `gs://` buckets, through one layer.

kd_ckpt touches a checkpoint path only through etils.epath (folders, small
files) and TensorStore kvstores (array data), as Orbax does; never through
`os`, `open()` or `shutil`, which see a `gs://` URL as a relative local path.
This module holds what differs between the two kinds of storage:

  * which URLs can be written: what stock Orbax writes, local absolute paths
    and `gs://`.  Anything else (`s3://`, ...) is refused before anything is
    written (Orbax would take it for a local path and leave an `s3:` folder);
  * what "finished" means: locally Orbax writes `<name>.orbax-checkpoint-tmp*`
    and renames it at the end; on `gs://` it writes in place and marks the
    end with `commit_success.txt`.  An unfinished save is never a checkpoint,
    and it is removed before the same directory is saved again;
  * the checks before a save: a probe file where the checkpoint goes (a
    missing bucket or a read-only folder fails at once), and, on a local
    disk, free space.  A bucket has no counterpart to free space: it has no
    capacity to run out of, and a quota error arrives as the write's error;
  * copying a previous checkpoint's files for reuse: hard links on a local
    disk, server-side copies (GCS rewrite) in a bucket, so unchanged bytes
    are never uploaded again;
  * sizes and listings (epath walks either).

The few local-only calls are marked `# local-only:` with their reason;
tests/test_storage.py scans the package for any other.

Example:

  storage.check_supported('s3://b/ckpt')       # UnsupportedStorageError
  storage.check_writable('gs://bucket/ckpt/1') # PermissionError/FileNotFoundError
  storage.is_finished('gs://bucket/ckpt/1')    # commit_success.txt there?
  storage.copy_files(src, dst, keep=lambda rel: rel.startswith('d/'))
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import posixpath
import re
import shutil
import uuid
from typing import Any, Callable, Iterator

from etils import epath
import tensorstore as ts

from kd_ckpt import text

# What stock Orbax writes (tensorstore_utils gives only gs:// a cloud driver).
SUPPORTED_SCHEMES = ('gs',)
# Orbax writes `<name>.orbax-checkpoint-tmp[-<n>]` and renames it at the end.
TMP_MARKER = '.orbax-checkpoint-tmp'
# Orbax's mark of a finished checkpoint on GCS (atomicity.CommitFileTemporaryPath).
COMMIT_FILE = 'commit_success.txt'
PROBE_PREFIX = '.kd_ckpt_probe_'
_SCHEME = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*)://')
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How TensorStore reports ENOSPC/EDQUOT inside its ValueError text.
_FULL_TEXTS = ('No space left on device', "os_error_code='28'",
               'Disk quota exceeded', "os_error_code='122'")


class UnsupportedStorageError(ValueError):
  """A checkpoint URL stock Orbax cannot write (e.g. `s3://`)."""


class DiskFullError(OSError):
  """The checkpoint's filesystem ran out of space (errno ENOSPC)."""

  # True when raised by the free-space check, before the bytes were written:
  # its message is final (a failure while writing gets the save's totals).
  checked_before_writing = False

  @classmethod
  def during_save(cls, directory, needed_bytes: int | None) -> 'DiskFullError':
    free = free_bytes(directory)
    needed = (f' the save needed about {text.format_bytes(needed_bytes)} (uncompressed), and'
              if needed_bytes is not None else '')
    now = (f' {text.format_bytes(free)} is free now that its partial files are removed.'
           if free is not None else ' Its partial files are removed.')
    return cls(errno.ENOSPC, (
        f'Disk full while saving {os.fspath(directory)!r}:{needed}{now}'
        ' Earlier checkpoints are untouched. Free space (e.g. a lower'
        ' max_to_keep) or save elsewhere, then save again.'))


# --- URLs ------------------------------------------------------------------------


# A bucket request that fails is retried 0.5+1+2+4+8+8+8+8 s apart, so an
# outage fails the save in about 40 s per request in flight (TensorStore's
# default, 32 retries up to 32 s apart, stalls a training loop for a quarter
# of an hour before the save fails).  KD_CKPT_BUCKET_RETRIES changes the count.
BUCKET_RETRIES = 8
BUCKET_RETRIES_ENV = 'KD_CKPT_BUCKET_RETRIES'


def bucket_retries() -> dict:
  """TensorStore's `gcs_request_retries` for kd_ckpt's own bucket writes.

  `KD_CKPT_BUCKET_RETRIES=N` retries a failed request N times (0: fail at
  once): more rides out longer outages, fewer fails sooner.

  >>> bucket_retries()['max_retries']
  8
  """
  value = os.environ.get(BUCKET_RETRIES_ENV, '').strip()
  retries = BUCKET_RETRIES
  if value:
    try:
      retries = int(value)
    except ValueError:
      retries = -1
    if retries < 0:
      raise ValueError(
          f'{BUCKET_RETRIES_ENV}={value!r} is not a count of retries: set it to a whole'
          f' number >= 0 (the default is {BUCKET_RETRIES}), or unset it.')
  return {'max_retries': retries, 'initial_delay': '0.5s', 'max_delay': '8s'}


def scheme(path) -> str | None:
  """'gs' for `gs://b/x`, None for a local path."""
  m = _SCHEME.match(os.fspath(path))
  return m.group(1).lower() if m else None


def is_remote(path) -> bool:
  return scheme(path) is not None


def as_path(directory) -> epath.Path:
  """`directory` as the Path a save or read goes through: a URL as given, a
  local path made absolute.

  Orbax's TensorStore specs take absolute paths only: a relative one failed
  mid-save, after its folders were made ('Checkpoint path should be
  absolute'), and `python -m kd_ckpt verify ckpt/1` called every leaf
  unreadable.  A relative path is taken from the working directory, as
  `open()` takes it.

  Example:

    storage.as_path('gs://b/run/1')   # epath.Path('gs://b/run/1')
    storage.as_path('ckpt/1')         # epath.Path(os.getcwd() + '/ckpt/1')

  Raises ValueError for an empty path (before anything is written).
  """
  text = os.fspath(directory)
  if not str(text).strip():
    raise ValueError(
        f'The checkpoint directory is empty ({text!r}). Pass the folder to save'
        ' into or read from, e.g. "/ckpts/step_100" or "gs://bucket/run/step_100".')
  if is_remote(text):
    return epath.Path(directory)
  # local-only: a URL returned above; a local path is made absolute here.
  return epath.Path(os.path.abspath(text))


def absolute(value):
  """`as_path(value)` for a non-empty str or path; anything else as given
  (Orbax's own path objects, a config reference not resolved yet), for the
  code that passes paths on rather than taking them from a user."""
  if isinstance(value, (str, os.PathLike)) and os.fspath(value).strip():
    return as_path(value)
  return value


def check_supported(path) -> None:
  """Raises UnsupportedStorageError for a URL stock Orbax cannot write, or
  ValueError for a bad `KD_CKPT_BUCKET_RETRIES` with a bucket; writes nothing."""
  s = scheme(path)
  if s in SUPPORTED_SCHEMES:
    bucket_retries()
  if s is None or s in SUPPORTED_SCHEMES:
    return
  raise UnsupportedStorageError(
      f'Cannot save to {os.fspath(path)!r}: {s}:// is not supported.'
      ' orbax-checkpoint writes array data through TensorStore with a cloud'
      ' driver only for gs://; it would take this URL for a relative local'
      f' path (and leave a local folder named "{s}:"). Nothing was written.'
      ' Save to a gs:// bucket or a local (or mounted) absolute path.')


# --- finished or not ---------------------------------------------------------------


def is_unfinished(path, *, exists: bool = False) -> bool:
  """Whether `path` is what a save left before it finished (never a checkpoint).

  Local: Orbax's temporary name.  gs://: no `commit_success.txt` in the
  folder or in its step folder (Orbax writes it last).  `exists`: the
  caller asks whether `path` exists itself, and heeds that answer first
  (on a bucket, one round trip fewer); a missing `path` is then "unfinished".
  """
  p = epath.Path(path)
  if TMP_MARKER in p.name:
    return True
  if not is_remote(p):
    return False
  if not exists:
    forget_listings(p)
    if not p.exists():
      return False
  return not ((p / COMMIT_FILE).exists() or (p.parent / COMMIT_FILE).exists())


def ask_together(*questions: Callable[[], Any], remote: bool) -> list[Callable[[], Any]]:
  """Each question's answer, as a call that returns it (or raises what asking raised).

  On a bucket (`remote`) the questions go out at once, in threads: each is
  a request or two, and one after the other they wait a round trip each.
  Locally they are asked in turn, when their answers are called for.

  Example:

    exists, done = storage.ask_together(path.exists, (path / COMMIT_FILE).exists,
                                        remote=storage.is_remote(path))
    if exists() and done(): ...
  """
  if not remote:
    return list(questions)
  with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
    futures = [pool.submit(q) for q in questions]
    concurrent.futures.wait(futures)
  return [f.result for f in futures]


def answers(path) -> bool:
  """Whether the storage of `path` answers one request now, without retrying.

  Local storage always does.  A bucket is asked once for `path`'s commit
  file (found or not, it answered): a cleanup after an outage would
  otherwise retry each request for half a minute (gcsfs's backoff).
  """
  if not is_remote(path):
    return True
  try:
    kv = ts.KvStore.open(kvstore_spec(path), context=ts.Context(
        {'gcs_request_retries': {'max_retries': 0}})).result()
    kv.read(COMMIT_FILE).result()
  except Exception:  # pylint: disable=broad-exception-caught
    return False
  return True


def remove_unfinished(directory) -> list[str]:
  """Removes what unfinished saves of `directory` left; returns what it removed.

  Local: `<name>.orbax-checkpoint-tmp*` siblings of this exact target.
  gs://: `directory` itself when it has no commit file.  A finished
  checkpoint, or another step's save, is never touched.
  """
  d = epath.Path(directory)
  removed = []
  if is_remote(d):
    if is_unfinished(d):
      d.rmtree(missing_ok=True)
      removed.append(os.fspath(d))
    return removed
  if not d.parent.exists():
    return removed
  # Matching names only: a workdir may keep hundreds of checkpoints, and an
  # epath for each (`iterdir`) took 1.4 ms of every save beside 100 of them.
  for p in d.parent.glob(re.sub(r'([*?[])', r'[\1]', d.name + TMP_MARKER) + '*'):
    try:
      p.rmtree()
    except OSError:
      pass  # Best effort: another process may be removing it too.
    removed.append(os.fspath(p))
  return removed


# --- before a save -----------------------------------------------------------------


def nearest_existing(path) -> epath.Path:
  """The deepest existing folder on the way to `path` (a bucket's root at most)."""
  p = epath.Path(path)
  if not is_remote(p):
    p = epath.Path(posixpath.normpath(posixpath.join(os.getcwd(), os.fspath(p))))
  while not p.exists() and p != p.parent:
    p = p.parent
  return p


def check_writable(directory) -> None:
  """Raises unless files can be created where `directory` goes; leaves nothing behind.

  Writes and removes a probe file: mode bits say nothing for root, a
  read-only mount, a quota, or a bucket's permissions.
  """
  d = epath.Path(directory)
  if is_remote(d):
    bucket = epath.Path(f'{scheme(d)}://{_bucket(d)}')
    if not bucket.exists():
      raise FileNotFoundError(
          f'Cannot save to {os.fspath(directory)!r}: bucket {os.fspath(bucket)!r}'
          ' does not exist or cannot be listed. Create it, or check the name and'
          ' your credentials.')
    base = d.parent  # Objects need no folder: probe beside the checkpoint.
  else:
    base = nearest_existing(d)
    if not base.is_dir():
      raise NotADirectoryError(
          f'Cannot save to {os.fspath(directory)!r}: {os.fspath(base)!r} is a file,'
          ' not a folder. Pick another checkpoint directory.')
  probe = base / f'{PROBE_PREFIX}{uuid.uuid4().hex}'
  try:
    probe.write_bytes(b'')
    probe.unlink()
  except OSError as e:
    if e.errno in _FULL_ERRNOS:
      raise DiskFullError(e.errno, (
          f'Disk full at {os.fspath(base)!r}: not even an empty file can be'
          ' created there. Free space or save elsewhere.')) from e
    raise PermissionError(e.errno, (
        f'Cannot write to {os.fspath(base)!r} (needed to create'
        f' {os.fspath(directory)!r}): {e.strerror or e}. Pick a directory you can'
        ' write to, or fix its permissions / mount.')) from e


def free_bytes(directory) -> int | None:
  """Free bytes of the filesystem `directory` goes on; None for a bucket (no capacity)."""
  if is_remote(directory):
    return None
  # local-only: free space is a filesystem query; epath has none, and buckets have no capacity.
  return shutil.disk_usage(os.fspath(nearest_existing(directory))).free


def check_free_space(directory, needed_bytes: int) -> None:
  """Raises DiskFullError before writing when `needed_bytes` cannot fit (local disks)."""
  free = free_bytes(directory)
  if free is not None and needed_bytes > free:
    e = DiskFullError(errno.ENOSPC, (
        f'Not enough disk space for {os.fspath(directory)!r}: the save needs'
        f' about {text.format_bytes(needed_bytes)} and'
        f' {text.format_bytes(free)} is free on'
        f' {os.fspath(nearest_existing(directory))!r}. Nothing was written.'
        ' Free space (e.g. a lower max_to_keep) or save elsewhere.'))
    e.checked_before_writing = True
    raise e


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


# --- files --------------------------------------------------------------------------


def files(directory) -> Iterator[tuple[str, epath.Path]]:
  """(path relative to `directory`, path) of every file under it."""
  top = epath.Path(directory)
  forget_listings(top)
  for root, _, names in top.walk():
    rel_root = _relative(root, top)
    base = top / rel_root if rel_root else top
    for name in names:
      yield posixpath.join(rel_root, name) if rel_root else name, base / name


def total_bytes(directory) -> int:
  """Bytes of every file under `directory` (what it occupies on disk or in the bucket)."""
  return sum(int(p.stat().length or 0) for _, p in files(directory))


def copy_files(src, dst, keep: Callable[[str], bool]) -> int:
  """Copies the files under `src` whose relative path `keep` accepts to `dst`; returns bytes.

  Local: hard links (no byte is copied; a file lives while one checkpoint
  links it).  gs://: server-side copies (GCS rewrite: the bytes never pass
  through this host).  Either way the copy is independent of `src`:
  deleting `src` afterwards changes nothing under `dst`.

  Raises:
    OSError: a link or copy was refused (e.g. another filesystem).
  """
  src, dst = epath.Path(src), epath.Path(dst)
  if is_remote(src) != is_remote(dst) or (
      is_remote(src) and scheme(src) != scheme(dst)):
    raise OSError(errno.EXDEV, f'{src} and {dst} are on different storage')
  copy = _server_side_copy(src) if is_remote(src) else None
  copied = 0
  for rel, path in files(src):
    if not keep(rel):
      continue
    out = dst / rel
    if copy is not None:
      copy(path, out)
    else:
      out.parent.mkdir(parents=True, exist_ok=True)
      if out.exists():
        continue
      # local-only: a hard link shares the bytes; epath has no link().
      os.link(os.fspath(path), os.fspath(out))
    copied += int(path.stat().length or 0)
  return copied


def remove_files(paths) -> None:
  for p in paths:
    epath.Path(p).unlink(missing_ok=True)


# --- TensorStore --------------------------------------------------------------------


def kvstore_spec(directory) -> dict:
  """The TensorStore kvstore of a folder (`file` or `gcs`), with its trailing slash."""
  d = os.fspath(directory)
  if is_remote(d):
    check_supported(d)
    return {'driver': 'gcs', 'bucket': _bucket(d),
            'path': _key(d).rstrip('/') + '/' if _key(d) else ''}
  return {'driver': 'file', 'path': d.rstrip('/') + '/'}


GAP_KEY = 'experimental_read_coalescing_threshold_bytes'


def without_read_gaps(spec: dict) -> dict:
  """`spec` (a TensorStore spec's JSON) whose coalesced reads fetch no bytes between them.

  Orbax's spec for a bucket merges reads of one file sent within 1 ms and
  under 1 MB apart into one request, the bytes between them included.  A
  bounded restore reads a file in parts at different times: whole small
  leaves in one batch, the bigger leaves between them filled apart.  Each
  merged request then downloaded the leaves between its reads too, bytes no
  read asked for and no limiter charged: restoring 200 layers of a 4 KiB
  bias and a 0.94 MiB kernel at 56 MiB took 322-349 MiB down for 191 MiB.
  With the gap at 0, reads of touching ranges still merge, and a response
  carries only what was asked for (more requests: 393-406 against 235-263
  for that state through `bench/gcs_requests.py`).

  Example:

    ts.open(storage.without_read_gaps(spec), context=ctx)
  """
  def walk(node):
    if isinstance(node, dict):
      return {k: 0 if k == GAP_KEY else walk(v) for k, v in node.items()}
    if isinstance(node, list):
      return [walk(v) for v in node]
    return node
  return walk(spec)


def forget_listings(path) -> None:
  """Drops gcsfs's cached listings under `path` (no-op locally).

  gcsfs caches folder listings; TensorStore, other processes and other hosts
  write objects it never hears of.  Decisions (finished or not, what to
  list, link or remove) must see the bucket as it is.
  """
  if not is_remote(path):
    return
  try:
    fs = _fsspec(path)
  except ImportError:
    return  # No gcsfs: epath uses tf.io.gfile, which caches no listings.
  # `invalidate_cache` drops the path and its parents; folders below it
  # (e.g. a workdir's checkpoints/) must go too.
  fs.invalidate_cache(os.fspath(path))
  key = fs._strip_protocol(os.fspath(path)).rstrip('/')  # pylint: disable=protected-access
  for k in [k for k in list(fs.dircache) if k.startswith(key + '/')]:
    fs.dircache.pop(k, None)


def warm_up(directory) -> None:
  """Touches `directory`'s storage clients once (imports, sessions, transports)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  bucket = epath.Path(f'{scheme(directory)}://{_bucket(directory)}')

  def transport():
    kv = ts.KvStore.open(kvstore_spec(directory)).result()
    kv.list(ts.KvStore.KeyRange(b'\xff', b'\xff\x00')).result()
  for answer in ask_together(bucket.exists, transport, remote=True):
    answer()


# --- helpers ------------------------------------------------------------------------


def _bucket(path) -> str:
  return os.fspath(path).split('://', 1)[1].split('/', 1)[0]


def _key(path) -> str:
  rest = os.fspath(path).split('://', 1)[1]
  return rest.split('/', 1)[1] if '/' in rest else ''


def _relative(path: epath.Path, top: epath.Path) -> str:
  p, t = os.fspath(path).rstrip('/'), os.fspath(top).rstrip('/')
  if is_remote(t) and not is_remote(p):
    p = f'{scheme(t)}://{p}'  # fsspec's walk yields paths without the scheme.
  if p == t:
    return ''
  if not p.startswith(t + '/'):
    raise ValueError(f'{p} is not under {t}')
  return p[len(t) + 1:]


def _fsspec(path):
  """The fsspec filesystem etils.epath uses for `path` (gcsfs for gs://).

  The same instance (fsspec caches one per arguments): epath asks for
  `fsspec.filesystem('gcs', finalize_on_close=True)`, and its listing cache
  is the one that must be forgotten.
  """
  import fsspec  # pylint: disable=g-import-not-at-top
  if scheme(path) == 'gs':
    return fsspec.filesystem('gcs', finalize_on_close=True)
  return fsspec.filesystem(scheme(path))


def _server_side_copy(path) -> Callable[[epath.Path, epath.Path], None]:
  """A copy of one object to another that never moves the bytes through this host.

  With gcsfs (etils.epath's fsspec backend), fsspec's `copy` is GCS's
  rewrite; epath's own `copy()` there would download and upload.  Without
  gcsfs, epath uses tf.io.gfile, whose `copy()` is a rewrite too.

  Raises:
    OSError: neither client is installed (reuse then writes everything).
  """
  try:
    fs = _fsspec(path)
    return lambda src, dst: fs.copy(os.fspath(src), os.fspath(dst))
  except ImportError:
    pass
  try:
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    return lambda src, dst: epath.Path(src).copy(dst, overwrite=True)
  except ImportError as e:
    raise OSError(errno.ENOTSUP, f'no server-side copy for {path}: install gcsfs') from e
