"""Probe host memory: total, available, RSS, peak RSS, cgroup limits.

Everything kd_ckpt decides starts from what this module reads.  It honours
container limits (cgroup v2 and v1), because inside a container
`/proc/meminfo` shows the whole machine while the OOM killer enforces the
cgroup's `memory.max`.

Example:

  mem = hostmem.probe()
  print(mem)                       # a small table
  with hostmem.PeakRss() as peak:  # exact peak, no sampling thread
    do_save()
  print(peak.extra_bytes)
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import os
import pathlib
import threading
import weakref
from typing import Iterator

import numpy as np

try:
  import psutil  # pylint: disable=g-import-not-at-top
except ImportError:  # e.g. a bare GPU image: Linux's /proc says the same
  psutil = None

from kd_ckpt import text

_UNLIMITED_THRESHOLD_BYTES = 1 << 60  # cgroup v1 reports "no limit" as ~2^63.

# Launchers that start several processes per host export how many.  The first
# one set wins; `KD_CKPT_LOCAL_PROCESSES` lets a user override them all.
_LOCAL_PROCESS_COUNT_ENV_VARS = (
    'KD_CKPT_LOCAL_PROCESSES',
    'LOCAL_WORLD_SIZE',
    'SLURM_NTASKS_PER_NODE',
    'OMPI_COMM_WORLD_LOCAL_SIZE',
    'MPI_LOCALNRANKS',
)


def format_bytes(num_bytes: float | None) -> str:
  return text.format_bytes(num_bytes)


_fmt = format_bytes


@dataclasses.dataclass(frozen=True)
class CgroupMemory:
  """A cgroup's memory limit and usage (None: not found).

  Attributes:
    version: 1 or 2.
    limit_bytes: the tightest memory limit on the way to the root.
    usage_bytes: `memory.current` (v2) / `memory.usage_in_bytes` (v1), which
      count the page cache: every checkpoint written raises them.
    reclaimable_bytes: the inactive file cache (`inactive_file` in
      `memory.stat`), which the kernel reclaims before it OOM-kills; what
      Kubernetes subtracts for its working set.
  """

  version: int
  limit_bytes: int | None
  usage_bytes: int | None
  reclaimable_bytes: int = 0

  @property
  def working_set_bytes(self) -> int | None:
    if self.usage_bytes is None:
      return None
    return max(0, self.usage_bytes - self.reclaimable_bytes)


@dataclasses.dataclass(frozen=True)
class HostMemory:
  """What the host can give this process.

  Attributes:
    total_bytes: physical memory, or the cgroup limit when lower.
    available_bytes: memory that can still be allocated without swapping or
      hitting the cgroup limit.
    rss_bytes: resident set of this process now.
    local_process_count: JAX processes sharing this host.
    cgroup: the cgroup limit that applies, if any.
  """

  total_bytes: int
  available_bytes: int
  rss_bytes: int
  local_process_count: int = 1
  cgroup: CgroupMemory | None = None

  @property
  def available_share_bytes(self) -> int:
    """This process's share of the available memory."""
    return self.available_bytes // max(1, self.local_process_count)

  @property
  def total_share_bytes(self) -> int:
    return self.total_bytes // max(1, self.local_process_count)

  def __str__(self) -> str:
    limit = 'none'
    if self.cgroup is not None and self.cgroup.limit_bytes is not None:
      limit = f'{_fmt(self.cgroup.limit_bytes)} (cgroup v{self.cgroup.version})'
    rows = [
        ('total', _fmt(self.total_bytes)),
        ('available', _fmt(self.available_bytes)),
        ('container limit', limit),
        ('processes on host', str(self.local_process_count)),
        ('available per process', _fmt(self.available_share_bytes)),
        ('this process RSS', _fmt(self.rss_bytes)),
    ]
    width = max(len(k) for k, _ in rows)
    return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)


def _read_int(path: pathlib.Path) -> int | None:
  try:
    text = path.read_text().strip()
  except (OSError, ValueError):
    return None
  if text in ('', 'max'):
    return None
  try:
    value = int(text)
  except ValueError:
    return None
  return None if value >= _UNLIMITED_THRESHOLD_BYTES else value


def read_cgroup_memory(
    cgroup_root: str | os.PathLike[str] = '/sys/fs/cgroup',
    proc_cgroup: str | os.PathLike[str] = '/proc/self/cgroup',
) -> CgroupMemory | None:
  """Reads the memory limit of this process's cgroup, v2 first, then v1.

  The process's own cgroup path comes from `/proc/self/cgroup`; inside a
  container that path is usually `/`, so the root files are the limit.
  Nested cgroups may each set a limit: the tightest one wins.

  Args:
    cgroup_root: where the cgroup filesystem is mounted (tests pass a fake).
    proc_cgroup: the `/proc/self/cgroup` file to read the process's path from.

  Returns:
    The limit and usage, or None when no cgroup memory controller is found.
  """
  root = pathlib.Path(cgroup_root)
  v2_rel, v1_rel = '/', '/'
  try:
    for line in pathlib.Path(proc_cgroup).read_text().splitlines():
      hier, controllers, path = line.split(':', 2)
      if hier == '0' and controllers == '':
        v2_rel = path or '/'
      elif 'memory' in controllers.split(','):
        v1_rel = path or '/'
  except (OSError, ValueError):
    pass

  def tightest(base: pathlib.Path, rel: str, limit_name: str, usage_name: str,
               inactive_key: str):
    # Walk from the process's cgroup up to the root; the smallest limit rules,
    # and the usage is that of the limiting cgroup.
    parts = [p for p in rel.split('/') if p]
    limit, usage, reclaimable = None, None, 0
    for depth in range(len(parts), -1, -1):
      d = base.joinpath(*parts[:depth])
      lim = _read_int(d / limit_name)
      if usage is None or (lim is not None and (limit is None or lim < limit)):
        u = _read_int(d / usage_name)
        if u is not None:
          usage, reclaimable = u, _read_stat(d / 'memory.stat', inactive_key)
      if lim is not None and (limit is None or lim < limit):
        limit = lim
    return limit, usage, reclaimable

  if (root / 'cgroup.controllers').exists() or (root / 'memory.max').exists():
    limit, usage, rec = tightest(root, v2_rel, 'memory.max', 'memory.current',
                                 'inactive_file')
    return CgroupMemory(version=2, limit_bytes=limit, usage_bytes=usage,
                        reclaimable_bytes=rec)
  v1 = root / 'memory'
  if v1.is_dir():
    limit, usage, rec = tightest(
        v1, v1_rel, 'memory.limit_in_bytes', 'memory.usage_in_bytes',
        'total_inactive_file')
    return CgroupMemory(version=1, limit_bytes=limit, usage_bytes=usage,
                        reclaimable_bytes=rec)
  return None


def _read_stat(path: pathlib.Path, key: str) -> int:
  """One counter of a cgroup `memory.stat` file (0 when absent)."""
  try:
    for line in path.read_text().splitlines():
      name, _, value = line.partition(' ')
      if name == key and value.strip().isdigit():
        return int(value)
  except OSError:
    pass
  return 0


_exchanged_local_count: int | None = None


def note_local_process_count(count: int) -> None:
  """Records what the save exchange found (`exchange.agree`): reused by probes."""
  global _exchanged_local_count
  _exchanged_local_count = max(1, int(count))


def local_process_count() -> int:
  """How many JAX processes share this host; never a collective.

  In order: a launcher's environment variable (`KD_CKPT_LOCAL_PROCESSES`
  overrides them all), what the last save's exchange found (every process
  sends its host name there), else 1.  A probe runs inside restore and
  verify, which must work on a single process of a multi-process checkpoint,
  so it never talks to other processes itself.
  """
  for name in _LOCAL_PROCESS_COUNT_ENV_VARS:
    value = os.environ.get(name, '')
    if value.isdigit() and int(value) > 0:
      return int(value)
  return _exchanged_local_count or 1


_PAGE_BYTES = os.sysconf('SC_PAGE_SIZE') if hasattr(os, 'sysconf') else 4096


def current_rss_bytes() -> int:
  """This process's resident bytes now.

  Called before every slice a streaming save stages: one `pread` of
  /proc/self/statm on a descriptor kept open (~2 us; opening the file each
  time took ~14 us, and `psutil.Process()` parses /proc/self/stat for the
  process's identity each time it is built, ~1-5 ms: 10 s of a 3,000-leaf
  save).
  """
  global _statm
  pid = os.getpid()
  try:
    if _statm is None or _statm[0] != pid:  # first call, or a forked child
      _statm = (pid, os.open('/proc/self/statm', os.O_RDONLY | os.O_CLOEXEC))
    return int(os.pread(_statm[1], 256, 0).split()[1]) * _PAGE_BYTES
  except OSError:  # not Linux
    return _process().memory_info().rss


# (pid, descriptor of /proc/self/statm): /proc/self is resolved at open, so a
# forked child opens its own.
_statm: tuple[int, int] | None = None


@functools.cache
def _process():
  return psutil.Process()


def _virtual_memory() -> tuple[int, int]:
  """(total, available) bytes of the machine."""
  if psutil is not None:
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)
  info = {}
  with open('/proc/meminfo') as f:
    for line in f:
      key, _, value = line.partition(':')
      info[key] = int(value.split()[0]) * 1024
  return info['MemTotal'], info.get('MemAvailable', info['MemFree'])


def probe(
    *,
    cgroup_root: str | os.PathLike[str] = '/sys/fs/cgroup',
    proc_cgroup: str | os.PathLike[str] = '/proc/self/cgroup',
    process_count: int | None = None,
) -> HostMemory:
  """Reads the host's memory now; see `HostMemory`."""
  total, available = _virtual_memory()
  cg = read_cgroup_memory(cgroup_root, proc_cgroup)
  if cg is not None and cg.limit_bytes is not None:
    total = min(total, cg.limit_bytes)
    # Reclaimable page cache (e.g. the checkpoints just written) is not used.
    used = cg.working_set_bytes or 0
    available = max(0, min(available, cg.limit_bytes - used))
  return HostMemory(
      total_bytes=total,
      available_bytes=available,
      rss_bytes=current_rss_bytes(),
      local_process_count=(
          local_process_count() if process_count is None else process_count
      ),
      cgroup=cg,
  )


def peak_rss_bytes() -> int:
  """The process's RSS high-water mark (`VmHWM`; since the last reset)."""
  return _read_status_kib('VmHWM') or current_rss_bytes()


def _read_status_kib(field: str) -> int | None:
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


class PeakRss:
  """Measures the exact peak RSS of a block, through the kernel's high-water mark.

  Writing `5` to `/proc/self/clear_refs` resets `VmHWM` to the current RSS; the
  peak is read back from `/proc/self/status` afterwards.  This catches spikes a
  sampling thread would miss.  Where the reset is not allowed it falls back to
  the lifetime peak, and `exact` says so.

  The high-water mark is one per process, so measurements may overlap
  (nested, or in other threads): before any of them resets it, the mark so
  far is folded into every measurement still open, and none under-reports
  the others.

  Example:

    with PeakRss() as peak:
      save()
    print(peak.extra_bytes)   # peak RSS during the block minus RSS before it
  """

  def __init__(self):
    self.before_bytes = 0
    self.peak_bytes = 0
    self.after_bytes = 0
    self.exact = False

  def __enter__(self) -> 'PeakRss':
    with _open_lock:
      self.exact = reset_peak_rss()
      self.before_bytes = current_rss_bytes()
      _open.add(self)
    return self

  def __exit__(self, *exc) -> None:
    with _open_lock:
      _open.discard(self)
      self.after_bytes = current_rss_bytes()
      self.sample()

  def sample(self) -> int:
    """Folds the high-water mark so far into `peak_bytes` (any thread)."""
    self.peak_bytes = max(self.peak_bytes, peak_rss_bytes(), self.after_bytes,
                          self.before_bytes)
    return self.peak_bytes

  @property
  def extra_bytes(self) -> int:
    """Peak RSS during the block minus the RSS just before it."""
    return max(0, self.peak_bytes - self.before_bytes)

  @property
  def retained_bytes(self) -> int:
    """RSS after the block minus RSS before (what the block left behind)."""
    return self.after_bytes - self.before_bytes


# The PeakRss blocks now open in this process (any thread), and the lock that
# orders their resets.
_open: 'weakref.WeakSet[PeakRss]' = weakref.WeakSet()
_open_lock = threading.RLock()


def reset_peak_rss() -> bool:
  """Resets VmHWM to the current RSS; False where the kernel refuses.

  The mark so far is first folded into every open `PeakRss`, which would
  otherwise lose the peaks before the reset.
  """
  with _open_lock:
    for m in list(_open):
      m.sample()
    return _clear_refs()


def _clear_refs() -> bool:
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


@functools.cache
def libc() -> ctypes.CDLL | None:
  """The C library, loaded once; None where there is none to load."""
  name = ctypes.util.find_library('c')
  try:
    return ctypes.CDLL(name or 'libc.so.6')
  except OSError:
    return None


# XLA's CPU client adopts a host buffer aligned to this many bytes (device_put
# without a copy); numpy aligns to 16.
DEVICE_ALIGN_BYTES = 64


def empty_aligned(shape, dtype) -> np.ndarray:
  """`np.empty`, its data aligned to `DEVICE_ALIGN_BYTES`.

  Restore pieces are made so: on the CPU backend `jax.device_put` of such an
  array shares it instead of copying (measured: the 1 GiB of copies of an
  8-device restore took 1.2 of its 2.4 s), and on GPUs nothing changes.

  >>> empty_aligned((3, 5), np.float32).ctypes.data % DEVICE_ALIGN_BYTES
  0
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + DEVICE_ALIGN_BYTES, np.uint8)
  start = -raw.ctypes.data % DEVICE_ALIGN_BYTES
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def zeros_aligned(shape, dtype) -> np.ndarray:
  out = empty_aligned(shape, dtype)
  out.fill(0)
  return out


def release_free_memory() -> bool:
  """Returns freed heap memory to the OS (glibc `malloc_trim(0)`).

  glibc keeps freed memory in its arenas, so RSS stays at the save's peak and
  ratchets up across saves; trimming gives it back.  False when not glibc.
  """
  c = libc()
  if c is None or not hasattr(c, 'malloc_trim'):
    return False
  return bool(c.malloc_trim(0))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt() parameters, glibc's malloc.h.
# While kd_ckpt holds host buffers: slices and encode buffers are 1-64 MiB.
_OPERATION_MMAP_THRESHOLD_BYTES = 1 << 20
# Reads: their pieces, decoded slabs and device copies recur at one size per
# leaf, and come and go hundreds of times a second from several threads.
# Mapped and unmapped each time, their page faults and the kernel's mm lock
# took 2.1 of 3.4 s of a 1 GiB restore on 8 devices (0.6 s at 8 MiB, where
# glibc reuses them); buffers above it still leave RSS when freed, and the
# restore trims the heap as it goes (`release_free_memory`).
READ_MMAP_THRESHOLD_BYTES = 8 << 20
# After: the ceiling of glibc's own dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX
# on 64-bit), where a process that has freed any large buffer ends up anyway.
_RESTING_MMAP_THRESHOLD_BYTES = 32 << 20
# Setting the mmap threshold freezes glibc's trim threshold (free bytes an
# arena keeps at its top) wherever it was: 128 KiB in a fresh process.  Each
# scope sets it too, at glibc's own 2x the mmap threshold, except reads: their
# 4 MiB byte-range reads (chunkread._MAX_READ), freed by several threads, were
# given back and faulted in again at every read, and the kernel's mm lock
# held up every other thread's page faults (a 1 GiB restore: 2.4-3.1 s at
# 128 KiB, 1.95 s at 16 MiB, 0.71 s at 32 MiB).  The restore trims every
# arena as it goes (`release_free_memory`).
_TRIM_THRESHOLD_BYTES = {READ_MMAP_THRESHOLD_BYTES: 32 << 20}
# Buffers under the mmap threshold, freed, stay in the arena of the thread
# that freed them until the next trim, outside the limiter: with several
# reader threads, each arena's.  At small budgets that was over the budget:
# the zeros state (256 MiB, 8 MiB shards, tests/states.py) restored at 96
# MiB on devices that copy peaked 54-121 MiB beyond the restored arrays
# (tests/test_budget.py).  So a read's threshold is at most this share of
# its capacity (from 8 MiB at 128 MiB of capacity down to 1 MiB), and its
# trim threshold (2x) with it.
READ_HEAP_SHARE = 16
# From a bucket the HTTP clients' response buffers, freed in many threads'
# arenas, were kept there at 8 MiB (150 MiB beyond the restored arrays for a
# 128 MiB budget, tests/test_object_storage.py), so a bucket read's threshold
# is a smaller share, at most 4 MiB.  At 1 MiB for every budget, each byte
# range (`reading.RANGE_BYTES`, 2 MiB, handed over as one bytes object) was
# mapped, faulted in and unmapped.  The Gemma-like state from a bucket
# through a 20 ms link at 256 MiB (`bench/gcs_requests.py --state gemma`,
# 3 runs alternating with the 1 MiB code): 3.85-4.07 s and 3.62-3.90 CPU s,
# against 4.06-4.52 s and 3.93-4.45 CPU s; 136-160 MiB beyond the restored
# arrays, against 130-136 MiB.
REMOTE_READ_MMAP_THRESHOLD_BYTES = 4 << 20
REMOTE_READ_HEAP_SHARE = 64
_mmap_scopes: collections.Counter = collections.Counter()  # threshold -> open scopes
_mmap_current: int | None = None
_mmap_lock = threading.Lock()


def read_mmap_threshold(*, remote: bool, capacity_bytes: int | None = None) -> int:
  """glibc's mmap threshold for a read (`mmap_large_buffers`).

  `READ_MMAP_THRESHOLD_BYTES` from local disks, and at most a
  `READ_HEAP_SHARE`th of the read's capacity.  From a bucket
  `REMOTE_READ_MMAP_THRESHOLD_BYTES` at most, a `REMOTE_READ_HEAP_SHARE`th
  of the capacity (1 MiB, as for saves, when the capacity is unknown).
  Never under 1 MiB.

  Example:

    hostmem.read_mmap_threshold(remote=True, capacity_bytes=232 << 20)  # 3.6 MiB
  """
  most, share = ((REMOTE_READ_MMAP_THRESHOLD_BYTES, REMOTE_READ_HEAP_SHARE) if remote
                 else (READ_MMAP_THRESHOLD_BYTES, READ_HEAP_SHARE))
  if capacity_bytes is None:
    return _OPERATION_MMAP_THRESHOLD_BYTES if remote else most
  return min(most, max(_OPERATION_MMAP_THRESHOLD_BYTES, int(capacity_bytes) // share))


def _user_tuned_malloc() -> bool:
  """Whether the user set glibc's mmap threshold themselves (then it is theirs)."""
  return ('MALLOC_MMAP_THRESHOLD_' in os.environ
          or 'mmap_threshold' in os.environ.get('GLIBC_TUNABLES', ''))


def _set_mmap_threshold(nbytes: int) -> bool:
  c = libc()
  if c is None or not hasattr(c, 'mallopt'):
    return False
  trim = _TRIM_THRESHOLD_BYTES.get(int(nbytes), 2 * int(nbytes))
  return bool(c.mallopt(_M_MMAP_THRESHOLD, int(nbytes))
              and c.mallopt(_M_TRIM_THRESHOLD, trim))


@contextlib.contextmanager
def mmap_large_buffers(threshold_bytes: int = _OPERATION_MMAP_THRESHOLD_BYTES
                       ) -> Iterator[None]:
  """While open (any thread, nested): glibc serves allocations >= `threshold_bytes` with mmap.

  glibc raises its mmap threshold dynamically up to 32 MiB, after which freed
  slice buffers and TensorStore's encode buffers stay in the heap and RSS
  does not come down between slices.  With a fixed 1 MiB threshold big
  buffers go back to the OS the moment they are freed.  Reads open it at
  `READ_MMAP_THRESHOLD_BYTES`; with scopes of several thresholds open, the
  smallest holds.

  The setting is process-wide, so it lasts only while a kd_ckpt operation
  holds buffers (`HostLimiter.lease` opens this).  glibc cannot go back to
  its dynamic threshold once one is set, so the last scope to close leaves it
  at that threshold's ceiling (32 MiB), where the process's own large
  allocations behave as glibc would have them.  A threshold the user set
  (`MALLOC_MMAP_THRESHOLD_`, `GLIBC_TUNABLES`) is never touched.

  Example:

    with hostmem.mmap_large_buffers():
      write_slices()
  """
  if _user_tuned_malloc():
    yield
    return
  threshold_bytes = int(threshold_bytes)
  with _mmap_lock:
    _mmap_scopes[threshold_bytes] += 1
    _apply_mmap_threshold()
  try:
    yield
  finally:
    with _mmap_lock:
      _mmap_scopes[threshold_bytes] -= 1
      if not _mmap_scopes[threshold_bytes]:
        del _mmap_scopes[threshold_bytes]
      _apply_mmap_threshold()


def _apply_mmap_threshold() -> None:
  """Sets the smallest open scope's threshold (or the resting one); with the lock."""
  global _mmap_current
  want = min(_mmap_scopes) if _mmap_scopes else _RESTING_MMAP_THRESHOLD_BYTES
  if want != _mmap_current:
    _set_mmap_threshold(want)
    _mmap_current = want
