"""The host-byte limiter: every host buffer a bounded save or restore makes is admitted here first.

A budget is a limit, not a forecast.  One `HostLimiter` per process holds the
bytes the running operation may still allocate: the budget less the measured
fixed floor (`cost.FLOOR_BYTES`).  Before the streaming writer copies a slice
to the host, before the reader fetches a piece, before a stored chunk is
decoded, the bytes it will allocate (and what TensorStore will allocate for
it, `cost.*_FACTOR`) are acquired; they are released when the buffer is gone.
Whatever the state's shapes, the admitted bytes never exceed the capacity:
a caller that cannot get its bytes waits, and a request larger than the
whole capacity is an error (the plan sizes slices so that never happens).

All items of one save (Orbax saves a Kauldron step's items concurrently)
share the one limiter, so they share the one budget.

Example:

  lim = limiter.process_limiter()
  with lim.lease(capacity_bytes=200 << 20):
    async with lim.hold(slice_bytes):       # waits until it fits
      buf = copy_slice_to_host()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from typing import AsyncIterator, Iterator

from kd_ckpt import hostmem


class RequestTooLargeError(ValueError):
  """One buffer needs more than the limiter's whole capacity."""


class LimiterStalledError(RuntimeError):
  """A wait saw no bytes released for `STALL_SECS`, or its operation's lease ended."""


# A wait fails when nothing at all is released for this long: bytes held by
# something that will never give them back (a bug, a wedged write) must
# fail the save with a message, not hang the training loop.  Any release
# restarts the clock, so a slow but moving save (a big upload) never trips it.
STALL_SECS = 300.0


@dataclasses.dataclass(frozen=True)
class LimiterStats:
  """What one lease saw: the most bytes admitted at once, and waits."""

  capacity_bytes: int
  peak_admitted_bytes: int
  waits: int


class HostLimiter:
  """A byte semaphore shared by threads and asyncio tasks of one process."""

  def __init__(self, capacity_bytes: int | None = None):
    """`capacity_bytes`: a lease for the limiter's whole life (`carve`'s parts)."""
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)
    self._leases: list[int] = [] if capacity_bytes is None else [int(capacity_bytes)]
    self._in_use = 0
    self._peak = 0
    self._waits = 0
    self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
    self._releases = 0  # Bumped by every release: a waiter's sign of progress.

  def __deepcopy__(self, memo) -> 'HostLimiter':
    return self  # One per process: copies of handlers share it.

  @property
  def capacity_bytes(self) -> int | None:
    with self._lock:
      return min(self._leases) if self._leases else None

  @property
  def in_use_bytes(self) -> int:
    with self._lock:
      return self._in_use

  @contextlib.contextmanager
  def lease(self, capacity_bytes: int, *,
            mmap_threshold_bytes: int | None = None) -> Iterator['HostLimiter']:
    """Sets the capacity for the duration of an operation (nested: the smallest).

    `mmap_threshold_bytes`: glibc's mmap threshold meanwhile
    (`hostmem.mmap_large_buffers`; default 1 MiB, reads pass
    `hostmem.READ_MMAP_THRESHOLD_BYTES`).
    """
    if capacity_bytes <= 0:
      raise ValueError(f'capacity_bytes={capacity_bytes} must be positive.')
    with self._lock:
      self._leases.append(int(capacity_bytes))
      if len(self._leases) == 1:
        self._peak, self._waits = self._in_use, 0
    try:
      # Buffers this limiter admits go back to the OS when freed.
      with (hostmem.mmap_large_buffers() if mmap_threshold_bytes is None
            else hostmem.mmap_large_buffers(mmap_threshold_bytes)):
        yield self
    finally:
      with self._lock:
        self._leases.remove(int(capacity_bytes))
      self._wake()

  def stats(self) -> LimiterStats:
    with self._lock:
      cap = min(self._leases) if self._leases else 0
      return LimiterStats(cap, self._peak, self._waits)

  def _check(self, nbytes: int) -> None:
    cap = min(self._leases) if self._leases else None
    if cap is None:
      raise LimiterStalledError(
          'HostLimiter used outside a lease() (or the operation it belonged to'
          ' has ended): nothing bounds it.')
    if nbytes > cap:
      raise RequestTooLargeError(
          f'A single host buffer of {hostmem.format_bytes(nbytes)} is more than'
          f' the whole budget left for buffers ({hostmem.format_bytes(cap)}).'
          ' Raise host_ram_budget, or save/restore with a smaller slice.')

  def try_acquire(self, nbytes: int) -> bool:
    """Takes `nbytes` if they fit now; never waits."""
    nbytes = int(nbytes)
    with self._lock:
      self._check(nbytes)
      if self._in_use + nbytes > min(self._leases):
        return False
      self._in_use += nbytes
      self._peak = max(self._peak, self._in_use)
      return True

  def _stalled(self, nbytes: int) -> LimiterStalledError:
    return LimiterStalledError(
        f'Waited {STALL_SECS:.0f} s for {hostmem.format_bytes(nbytes)} of host'
        f' buffers while {hostmem.format_bytes(self._in_use)} stayed held and none'
        ' was released: a write or read is wedged (storage unreachable?). The'
        ' operation fails rather than hang; earlier checkpoints are untouched.')

  def acquire(self, nbytes: int) -> None:
    """Takes `nbytes`, blocking the calling thread until they fit.

    Raises:
      LimiterStalledError: nothing was released for `STALL_SECS`, or the
        lease this wait belonged to ended.
    """
    nbytes = int(nbytes)
    with self._cond:
      self._check(nbytes)
      if self._in_use + nbytes > min(self._leases):
        self._waits += 1
      seen, since = self._releases, time.monotonic()
      while True:
        self._check(nbytes)  # The lease may have ended while we waited.
        if self._in_use + nbytes <= min(self._leases):
          break
        if self._releases != seen:
          seen, since = self._releases, time.monotonic()
        left = STALL_SECS - (time.monotonic() - since)
        if left <= 0:
          raise self._stalled(nbytes)
        self._cond.wait(timeout=min(left, 5.0))
      self._in_use += nbytes
      self._peak = max(self._peak, self._in_use)

  async def acquire_async(self, nbytes: int) -> None:
    """Takes `nbytes`, suspending the calling task until they fit."""
    nbytes = int(nbytes)
    loop = asyncio.get_running_loop()
    counted = False
    seen, since = None, time.monotonic()
    while True:
      with self._lock:
        self._check(nbytes)
        if self._in_use + nbytes <= min(self._leases):
          self._in_use += nbytes
          self._peak = max(self._peak, self._in_use)
          return
        if not counted:
          self._waits += 1
          counted = True
        if self._releases != seen:
          seen, since = self._releases, time.monotonic()
        left = STALL_SECS - (time.monotonic() - since)
        if left <= 0:
          raise self._stalled(nbytes)
        fut = loop.create_future()
        self._waiters.append((loop, fut))
      try:
        await asyncio.wait_for(asyncio.shield(fut), timeout=min(left, 5.0))
      except asyncio.TimeoutError:
        pass

  def release(self, nbytes: int) -> None:
    with self._lock:
      self._in_use -= int(nbytes)
      self._releases += 1
      assert self._in_use >= 0, 'released more than acquired'
    self._wake()

  def _wake(self) -> None:
    with self._cond:
      waiters, self._waiters = self._waiters, []
      self._cond.notify_all()
    for loop, fut in waiters:
      try:
        loop.call_soon_threadsafe(_resolve, fut)
      except RuntimeError:  # Its loop is closed: nobody waits on it any more.
        pass

  @contextlib.asynccontextmanager
  async def hold(self, nbytes: int) -> AsyncIterator[None]:
    await self.acquire_async(nbytes)
    try:
      yield
    finally:
      self.release(nbytes)

  @contextlib.contextmanager
  def hold_sync(self, nbytes: int) -> Iterator[None]:
    self.acquire(nbytes)
    try:
      yield
    finally:
      self.release(nbytes)

  @contextlib.contextmanager
  def carve(self, nbytes: int, *, wait: bool = True) -> Iterator['HostLimiter | None']:
    """A limiter of its own over `nbytes`, which this one holds meanwhile.

    Readers that run side by side, each in a carved part, wait only for
    bytes of their own part: none can wait on bytes another holds until it
    ends (a reader keeps a leaf's decoders until the leaf is read), so no
    two of them deadlock, and together they admit no more than this one.
    `wait=False`: None (nothing carved) unless the bytes fit now.

      with lim.carve(lim.capacity_bytes // 2) as part:
        with part.hold_sync(piece_bytes):
          ...
    """
    if wait:
      self.acquire(nbytes)
    elif not self.try_acquire(nbytes):
      yield None
      return
    try:
      yield HostLimiter(nbytes)
    finally:
      self.release(nbytes)


def _resolve(fut: asyncio.Future) -> None:
  if not fut.done():
    fut.set_result(None)


_PROCESS_LIMITER = HostLimiter()


def process_limiter() -> HostLimiter:
  """The limiter of this process (one per process, shared by every operation)."""
  return _PROCESS_LIMITER
