"""How a local save's bytes reach the disk: one flush per save, not per commit.

TensorStore's file kvstore fsyncs every file an OCDBT commit writes (data
file, B-tree nodes, manifest, directories).  Each fsync is a cache flush of
the whole device: a 2.2 GB Gemma-like save at 256 MiB made ~175 of them, and
its commits waited on each.  A streaming save instead writes with
`file_io_sync: false` and, through `Writeback`:

  * after each commit (at most every `START_EVERY_BYTES`), asks the kernel
    to start writing the new bytes (`sync_file_range(SYNC_FILE_RANGE_WRITE)`),
    and waits until the bytes it started last time are written (no device
    flush).  A thread of its own does both, so the save copies its next
    slices while the disk catches up; the save waits only when `DEPTH`
    starts are queued behind the thread, so dirty page cache stays about
    `(DEPTH + 2) x START_EVERY_BYTES` (256 MiB);
  * drops the pages it has waited for from the page cache
    (`posix_fadvise(POSIX_FADV_DONTNEED)`: they are clean, on the device):
    the save cycles through a few hundred MiB of page cache instead of
    leaving the whole checkpoint there, and the kernel writes each commit
    into pages just freed rather than into fresh ones;
  * at the end, fsyncs every file and directory under the checkpoint (and
    drops the files' pages), before Orbax renames the temporary directory:
    the checkpoint is as durable as before when it becomes visible, and a
    crash before that leaves only a temporary directory, as always.

Why drop the pages: the page cache is host memory too.  In a container it
is charged to the job's memory cgroup, and on a host with little free RAM
the checkpoint's pages push out the ones the job reads (its dataset) or
send the kernel reclaiming.  And it is faster: the kernel's copy into the
page cache (`copy_folio_from_iter_atomic`, 54% of a streaming save's CPU
samples under `perf`) is cheaper into pages it just freed.  Gemma-like 2.2
GB at 256 MiB, 6 alternating reps in one process (/tmp script, `perf
record` for the profile): 2.67-3.75 s with the pages dropped, 4.55-6.28 s
without (`dd` of the same bytes: 2.73-7.56 s); system CPU 1.2-1.5 s against
3.3-4.6 s; page cache grew 118-179 MiB against 2.1 GB.  The cost: reading
the checkpoint back right away reads the disk.
`KD_CKPT_DROP_PAGE_CACHE=0` keeps the pages.

Orbax's own writer (the `orbax` strategy, and `auto` where it picks it)
fsyncs as TensorStore does; `PageDropper` drops its clean pages as it goes,
from a thread that looks at the checkpoint's files every `DROP_EVERY_SECS`.

Measured with `bench/ab_save.py` (Gemma-like 2.2 GB at 256 MiB, alternating
in one process): 166 device flushes per save with fsync per commit, 58 with
this; 10.29 s against 8.92 s (median of 3).  The waits in a thread of their
own, with the slabs of `streaming` (`bench/ab_save.py --variants now,prev,auto,orbax`,
`prev` being the writer before both, bench/results/ab_save.md): Gemma-like 2.2 GB
2.22 s against 2.32 s (median of 5), one 4 GB leaf 3.19 s against 3.90 s
(median of 3).  Two commits in flight instead of one gained nothing on top.

Every OCDBT commit writes a new manifest and renames it over the old one.
On ext4 mounted with `discard` (as cloud images often mount their disks,
and this project's machines) the old manifest's inode is freed inside that
rename, with a synchronous discard of its block, queued behind the writeback
just started: the commit waited 20-45 ms for the disk, once or twice in a
128 MiB save, 14 times (0.27 s in all) in three Gemma-like 2.2 GB saves
(`strace -T`; kernel stacks sampled from /proc/self/task/*/stack:
`do_renameat2` -> `evict` -> `ext4_free_blocks` -> `blkdev_issue_discard` ->
`submit_bio_wait`).  Held open: one rename over 5 ms (9 ms) in three.
So `Writeback` holds each new manifest open from the moment it is renamed
in (inotify, `_ManifestHolder`): the rename that replaces it then only
unlinks it, and its inode is freed when the writeback thread closes it,
after the writes started before are done, or at the end.  (Holding it open
before each commit would miss some: a group's commit may rename two.)

Example:

  wb = writeback.Writeback('/ckpt/step_10.orbax-checkpoint-tmp/default')
  try:
    ...  # after each commit:
    wb.committed(nbytes)
    ...  # when every array is written:
    wb.finish()
  finally:
    wb.close()  # a failed save: stops the thread, fsyncs nothing
"""

from __future__ import annotations

import ctypes
import os
import queue
import select
import struct
import threading

from kd_ckpt import hostmem
from kd_ckpt import storage

# <linux/fs.h>
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4
# Writeback is started once this many bytes were committed since the last
# start (and at the end): a save of many small leaves, with many small
# commits, does not walk its directory after each of them.
START_EVERY_BYTES = 64 << 20
# Starts queued behind the writeback thread before `committed` waits.
DEPTH = 2
# KD_CKPT_DROP_PAGE_CACHE=0 keeps a save's pages in the page cache.
DROP_PAGE_CACHE = os.environ.get('KD_CKPT_DROP_PAGE_CACHE', '1') != '0'
# The file an OCDBT commit replaces (written beside it, then renamed over it),
# in the directory `Writeback` watches (one process: the root database,
# `streaming.ocdbt_subdir`).
REPLACED_NAME = 'manifest.ocdbt'
# Manifests held open at most; beyond, the holder frees the replaced ones itself.
MAX_HELD_MANIFESTS = 64
# How often `PageDropper` looks at the files of a save Orbax writes.
DROP_EVERY_SECS = 0.05


def _libc_sync_file_range():
  fn = getattr(hostmem.libc(), 'sync_file_range', None)
  if fn is None:
    return None  # not Linux: per-file fsync at the end only
  fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
  fn.restype = ctypes.c_int
  return fn


_sync_file_range = _libc_sync_file_range()


def _walk(root: str):
  """(files, directories) under root, root included."""
  files, dirs = [], []
  for d, _, names in os.walk(root):
    dirs.append(d)
    files.extend(os.path.join(d, n) for n in names)
  return files, dirs


class Writeback:
  """Starts writeback after each commit, in a thread; fsyncs everything once at the end.

  One save's pipeline calls it, one call at a time; the thread it starts
  runs `started` and nothing else touches that state.  An error there is
  raised by the next `committed` or by `finish`.
  """

  def __init__(self, root: str, *, depth: int = DEPTH,
               start_every_bytes: int = START_EVERY_BYTES):
    if storage.is_remote(root):
      raise ValueError(f'Writeback is for local directories, not {root!r}:'
                       ' a bucket makes its writes durable itself.')
    self.root = root
    self.start_every_bytes = start_every_bytes
    self._started: dict[str, int] = {}  # path -> bytes whose writeback was started
    self._last: list[str] = []          # files started at the previous call
    self._pending_bytes = 0
    self.fsynced = 0
    self._room = threading.Semaphore(depth)
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    # Holds each new manifest open (`_ManifestHolder`) from the first start
    # of writeback (before it no write is queued for a discard to wait
    # behind); stays None where inotify is not to be had (not Linux, a
    # sandbox), which costs only the waits.
    self._holder: _ManifestHolder | None = None

  def committed(self, nbytes: int) -> None:
    """After a commit of nbytes: starts writeback every `start_every_bytes`.

    Returns at once unless `DEPTH` starts are still queued.
    """
    self._raise()
    self._pending_bytes += nbytes
    if self._pending_bytes < self.start_every_bytes or _sync_file_range is None:
      return
    self._pending_bytes = 0
    self._room.acquire()  # released by the thread, error or not
    if self._thread is None:
      self._holder = _ManifestHolder.start(self.root)
      self._thread = threading.Thread(target=self._run, daemon=True,
                                      name='kd_ckpt-writeback')
      self._thread.start()
    self._queue.put(True)

  def _run(self) -> None:
    while self._queue.get():
      try:
        if self._error is None:
          self.started()
      except BaseException as e:  # pylint: disable=broad-exception-caught
        self._error = e
      finally:
        self._room.release()

  def _raise(self) -> None:
    if self._error is not None:
      raise self._error

  def close(self) -> None:
    """Waits for the thread's queued starts and stops it (idempotent).

    Closes the manifests held open too (`_ManifestHolder`).
    """
    self._stop_thread()
    self._release_replaced(everything=True)

  def _stop_thread(self) -> None:
    if self._thread is not None:
      self._queue.put(False)
      self._thread.join()
      self._thread = None

  def _release_replaced(self, *, everything: bool = False) -> None:
    if self._holder is None:
      return
    if everything:
      self._holder.stop()  # and closes every one held
      self._holder = None
    else:
      self._holder.release()

  def started(self) -> None:
    """Waits for the previous call's writes; starts writing what is new."""
    if _sync_file_range is None:
      return
    for path in self._last:
      # Written: its pages are clean and may go (`DROP_PAGE_CACHE`).
      _range(path, _WAIT_BEFORE | _WRITE | _WAIT_AFTER, drop=DROP_PAGE_CACHE)
    self._last = []
    # The writes started last time are done: free the manifests replaced since.
    self._release_replaced()
    files, _ = _walk(self.root)
    for path in files:
      try:
        size = os.stat(path).st_size
      except FileNotFoundError:
        continue  # replaced by a later commit (OCDBT's manifest)
      if self._started.get(path) != size and _range(path, _WRITE):
        self._started[path] = size
        self._last.append(path)

  def finish(self) -> None:
    """fsyncs every file, then every directory (deepest first), under root.

    Then frees the manifests held open, with nothing queued before them.
    """
    self._stop_thread()
    try:
      self._raise()
      files, dirs = _walk(self.root)
      drop = set(files) if DROP_PAGE_CACHE else set()
      for path in files + sorted(dirs, key=len, reverse=True):
        try:
          fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
          continue  # another writer's lock or temporary file, gone since
        try:
          os.fsync(fd)
          if path in drop:
            _drop(fd)
        finally:
          os.close(fd)
        self.fsynced += 1
    finally:
      self._release_replaced(everything=True)


# <sys/inotify.h>
_IN_MOVED_TO, _IN_CLOEXEC, _IN_NONBLOCK = 0x80, 0o2000000, 0o4000
_EVENT = struct.Struct('iIII')  # wd, mask, cookie, len; then the name


class _ManifestHolder:
  """Holds every manifest renamed into `root` open until `release` (see the module doc).

  A thread reads the directory's inotify events and opens each new
  `REPLACED_NAME` at once (and, once, the one there already); `release`
  closes those replaced since (their last reference: the caller frees the
  inode then).  Missing one (renamed over before the thread opened it, or
  no descriptor left) costs only its wait.
  """

  def __init__(self, root: str, fd: int):
    self.root = root
    self._fd = fd
    self._stop_r, self._stop_w = os.pipe()
    self._held: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> fd
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._run, daemon=True, name='kd_ckpt-manifests')
    self._thread.start()
    self._hold(os.path.join(root, REPLACED_NAME))  # the one renamed in before the watch

  @classmethod
  def start(cls, root: str) -> '_ManifestHolder | None':
    libc = hostmem.libc()
    if libc is None or not hasattr(libc, 'inotify_init1'):
      return None
    libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    fd = libc.inotify_init1(_IN_CLOEXEC | _IN_NONBLOCK)
    if fd < 0:
      return None
    if libc.inotify_add_watch(fd, os.fsencode(root), _IN_MOVED_TO) < 0:
      os.close(fd)
      return None
    return cls(root, fd)

  def _run(self) -> None:
    name = os.fsencode(REPLACED_NAME)
    while True:
      ready, _, _ = select.select([self._fd, self._stop_r], [], [])
      if self._stop_r in ready:
        return
      try:
        data = os.read(self._fd, 64 * 1024)
      except BlockingIOError:
        continue
      pos = 0
      while pos + _EVENT.size <= len(data):
        _, _, _, n = _EVENT.unpack_from(data, pos)
        if data[pos + _EVENT.size:pos + _EVENT.size + n].rstrip(b'\0') == name:
          self._hold(os.path.join(self.root, REPLACED_NAME))
        pos += _EVENT.size + n

  def _hold(self, path: str) -> None:
    try:
      fd = os.open(path, os.O_RDONLY)
    except OSError:
      return  # replaced already, or no descriptor left: not held
    st = os.fstat(fd)
    with self._lock:
      held = (st.st_dev, st.st_ino) not in self._held
      if held:
        self._held[(st.st_dev, st.st_ino)] = fd
      full = len(self._held) > MAX_HELD_MANIFESTS
    if not held:
      os.close(fd)
    if full:
      # Many commits between two starts of writeback (many small leaves,
      # each batch of them created in commits of their own): the replaced
      # ones are freed here, in this thread, rather than hold descriptors
      # the save's own files need.
      self.release()

  def release(self, *, everything: bool = False) -> None:
    """Closes the held manifests a commit has replaced (every one with `everything`)."""
    with self._lock:
      done = [k for k, fd in self._held.items() if everything or os.fstat(fd).st_nlink == 0]
      fds = [self._held.pop(k) for k in done]
    for fd in fds:
      os.close(fd)

  def stop(self) -> None:
    """Stops the thread; closes the inotify descriptor and whatever is held."""
    os.write(self._stop_w, b'x')
    self._thread.join()
    for fd in (self._fd, self._stop_r, self._stop_w):
      os.close(fd)
    self.release(everything=True)


def _drop(fd: int) -> bool:
  """Drops the file's clean pages from the page cache (a hint: never loses data)."""
  try:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  except (OSError, AttributeError):  # not Linux, or a filesystem without it
    return False
  return True


def _range(path: str, flags: int, *, drop: bool = False) -> bool:
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return False
  try:
    ok = _sync_file_range(fd, 0, 0, flags) == 0
    return ok and (not drop or _drop(fd))
  finally:
    os.close(fd)


class PageDropper:
  """While open, drops the clean pages of the files under `root` from the page cache.

  For writers that fsync as they go (Orbax's, through TensorStore): a thread
  looks at the files every `DROP_EVERY_SECS` and drops the pages of those
  that grew (`POSIX_FADV_DONTNEED`; pages still dirty then stay, until the
  file grows again or the block ends).  Leaving the block drops every
  file's pages once more.  Nothing when
  `KD_CKPT_DROP_PAGE_CACHE=0`.

  Example:

    with writeback.PageDropper('/ckpt/step_10.orbax-checkpoint-tmp/default'):
      await orbax_write()
  """

  def __init__(self, root: str):
    if storage.is_remote(root):
      raise ValueError(f'PageDropper is for local directories, not {root!r}.')
    self.root = root
    self._sizes: dict[str, int] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name='kd_ckpt-page-dropper')

  def __enter__(self) -> 'PageDropper':
    if DROP_PAGE_CACHE:
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    if not DROP_PAGE_CACHE:
      return
    self._stop.set()
    self._thread.join()
    self.drop(everything=True)

  def _run(self) -> None:
    while not self._stop.wait(DROP_EVERY_SECS):
      self.drop()

  def drop(self, *, everything: bool = False) -> None:
    """Drops the pages of the files that grew since the last look (or of all)."""
    files, _ = _walk(self.root)
    for path in files:
      try:
        size = os.stat(path).st_size
        if not everything and self._sizes.get(path) == size:
          continue
        fd = os.open(path, os.O_RDONLY)
      except FileNotFoundError:
        continue  # replaced since (OCDBT's manifest, a temporary file)
      try:
        if _drop(fd):
          self._sizes[path] = size
      finally:
        os.close(fd)
