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

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import pathlib
import socket

import psutil

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


def _fmt(num_bytes: int | None) -> str:
  return 'n/a' if num_bytes is None else format_bytes(num_bytes)


def format_bytes(num_bytes: float) -> str:
  """`format_bytes(3 * 2**30) == '3.00 GiB'`."""
  sign = '-' if num_bytes < 0 else ''
  value = abs(float(num_bytes))
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if value < 1024 or unit == 'TiB':
      return f'{sign}{value:.0f} {unit}' if unit == 'B' else f'{sign}{value:.2f} {unit}'
    value /= 1024
  raise AssertionError('unreachable')


@dataclasses.dataclass(frozen=True)
class CgroupMemory:
  """A cgroup's memory limit and current usage (None: no limit found)."""

  version: int
  limit_bytes: int | None
  usage_bytes: int | None


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

  def tightest(base: pathlib.Path, rel: str, limit_name: str, usage_name: str):
    # Walk from the process's cgroup up to the root; the smallest limit rules.
    parts = [p for p in rel.split('/') if p]
    limit, usage = None, None
    for depth in range(len(parts), -1, -1):
      d = base.joinpath(*parts[:depth])
      lim = _read_int(d / limit_name)
      if usage is None:
        usage = _read_int(d / usage_name)
      if lim is not None and (limit is None or lim < limit):
        limit = lim
    return limit, usage

  if (root / 'cgroup.controllers').exists() or (root / 'memory.max').exists():
    limit, usage = tightest(root, v2_rel, 'memory.max', 'memory.current')
    return CgroupMemory(version=2, limit_bytes=limit, usage_bytes=usage)
  v1 = root / 'memory'
  if v1.is_dir():
    limit, usage = tightest(
        v1, v1_rel, 'memory.limit_in_bytes', 'memory.usage_in_bytes'
    )
    return CgroupMemory(version=1, limit_bytes=limit, usage_bytes=usage)
  return None


@functools.cache
def local_process_count() -> int:
  """How many JAX processes run on this host (1 unless told otherwise).

  Launcher environment variables are trusted first.  Failing those, in a
  multi-process JAX job the processes exchange a hash of their host name once
  (cached), so two processes on 127.0.0.1 know they share a host.
  """
  for name in _LOCAL_PROCESS_COUNT_ENV_VARS:
    value = os.environ.get(name, '')
    if value.isdigit() and int(value) > 0:
      return int(value)
  try:
    import jax  # pylint: disable=g-import-not-at-top

    if jax.process_count() <= 1:
      return 1
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top

    mine = hash(socket.gethostname()) & 0x7FFFFFFF
    everyone = np.asarray(
        multihost_utils.process_allgather(np.int64(mine))
    ).ravel()
    return max(1, int((everyone == mine).sum()))
  except Exception:  # pylint: disable=broad-except
    return 1


def current_rss_bytes() -> int:
  return psutil.Process().memory_info().rss


def probe(
    *,
    cgroup_root: str | os.PathLike[str] = '/sys/fs/cgroup',
    proc_cgroup: str | os.PathLike[str] = '/proc/self/cgroup',
    process_count: int | None = None,
) -> HostMemory:
  """Reads the host's memory now; see `HostMemory`."""
  vm = psutil.virtual_memory()
  total, available = int(vm.total), int(vm.available)
  cg = read_cgroup_memory(cgroup_root, proc_cgroup)
  if cg is not None and cg.limit_bytes is not None:
    total = min(total, cg.limit_bytes)
    used = cg.usage_bytes if cg.usage_bytes is not None else 0
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
    self.exact = reset_peak_rss()
    self.before_bytes = current_rss_bytes()
    return self

  def __exit__(self, *exc) -> None:
    self.after_bytes = current_rss_bytes()
    hwm = _read_status_kib('VmHWM')
    self.peak_bytes = max(hwm or 0, self.after_bytes, self.before_bytes)

  @property
  def extra_bytes(self) -> int:
    """Peak RSS during the block minus the RSS just before it."""
    return max(0, self.peak_bytes - self.before_bytes)

  @property
  def retained_bytes(self) -> int:
    """RSS after the block minus RSS before (what the block left behind)."""
    return self.after_bytes - self.before_bytes


def reset_peak_rss() -> bool:
  """Resets VmHWM to the current RSS; False where the kernel refuses."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


@functools.cache
def _libc():
  name = ctypes.util.find_library('c')
  try:
    return ctypes.CDLL(name or 'libc.so.6')
  except OSError:
    return None


def release_free_memory() -> bool:
  """Returns freed heap memory to the OS (glibc `malloc_trim(0)`).

  glibc keeps freed memory in its arenas, so RSS stays at the save's peak and
  ratchets up across saves; trimming gives it back.  False when not glibc.
  """
  libc = _libc()
  if libc is None or not hasattr(libc, 'malloc_trim'):
    return False
  return bool(libc.malloc_trim(0))


_M_MMAP_THRESHOLD = -3  # mallopt() parameter numbers, from glibc's malloc.h.


@functools.cache
def use_mmap_for_large_buffers(threshold_bytes: int = 1 << 20) -> bool:
  """Makes glibc serve allocations >= `threshold_bytes` with mmap.

  glibc raises its mmap threshold dynamically up to 32 MiB, after which freed
  slice buffers and TensorStore's encode buffers stay in the heap and RSS
  does not come down between slices.  A fixed threshold means big buffers go
  back to the OS the moment they are freed.  Done once per process.
  """
  libc = _libc()
  if libc is None or not hasattr(libc, 'mallopt'):
    return False
  return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))
