"""Read ahead of placement: worker threads read the next pieces inside the limiter.

A bounded restore is a sequence of reads (stored bytes -> a host piece) and
placements (host piece -> device, one update per tile).  Done in turn, the
disk, the zstd decoder and the device copy take turns on a 2-core host; done
here, reads run in worker threads ("lanes", one per group of shards whose
stored chunks no other lane touches) while the caller places what is read.

Every task's bytes (its host piece, its read, its device copies) are
acquired from the limiter *in task order*, before the task runs, and the
caller releases them as it consumes the task.  Task i can only wait for
bytes held by tasks before it, which the caller consumes first: no
deadlock, and at any time the bytes held are those of the tasks in flight.
A task that fits the budget alone runs as it would in turn; when the budget
has room for several, they overlap.  So time falls as the budget grows,
and the peak never passes it.

A task may also be started rather than run (`Task.start`): given a
TensorStore batch, it issues its reads into it and returns what finishes
them.  A lane gathers the consecutive tasks it can admit without waiting
into one batch, submits it, then finishes them: the reads of one batch go
out together, and TensorStore coalesces those of neighbouring byte ranges
of one file into one request (Orbax's read spec asks it to, from a
bucket).  Restoring the Gemma-like state from the GCS emulator, batches of
8 shard reads went out in 1-8 requests, mostly 1-3, where one read at a
time made 8.  A lane that would have to wait (for bytes, or for another
lane's turn) submits what it has gathered first: the bytes it waits for
are freed only as the caller takes tasks, and the caller waits for the
gathered ones.  A submitted batch is finished (its reads waited for, its
results handed over) on a thread of its own (`_Finisher`), so the lane
starts the next reads as soon as their bytes are free, while earlier ones
are still in flight.

Example:

  tasks = [Task(lane=i % 2, charge_bytes=n, run=functools.partial(read, i)) for i in ...]
  with ReadAhead(lim, tasks) as ahead:
    for i in range(len(tasks)):
      piece, charge = ahead.take(i)
      place(piece)
      lim.release(charge)
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Callable, Sequence

import tensorstore as ts

from kd_ckpt import limiter as limiter_lib


@dataclasses.dataclass(frozen=True)
class Task:
  """One read: the lane (thread) it runs on, what it holds, what it does."""

  lane: int
  charge_bytes: int
  run: Callable[[], Any]
  # start(batch) issues the task's reads into the TensorStore batch and
  # returns a callable that waits for them (once the batch is submitted)
  # and returns what `run` would.  None: the task is only run.
  start: Callable[[Any], Callable[[], Any]] | None = None


class ReadAhead:
  """Runs `tasks` ahead of the caller; `take(i)` returns task i's result.

  Tasks of one lane run in their order on that lane's thread.  The caller
  must take the tasks in order and release each task's charge (returned by
  `take`) when done with its result.  `close()` (or leaving the `with`
  block) stops the lanes and releases what was read but not taken.
  """

  def __init__(self, lim: limiter_lib.HostLimiter, tasks: Sequence[Task]):
    self._lim = lim
    self._tasks = list(tasks)
    self._cond = threading.Condition()
    self._turn = 0  # the next task to acquire its bytes
    self._done: dict[int, tuple[Any, int]] = {}
    self._failed: dict[int, BaseException] = {}
    self._stop = False
    lanes: dict[int, list[int]] = {}
    for i, t in enumerate(self._tasks):
      lanes.setdefault(t.lane, []).append(i)
    self._threads = [threading.Thread(target=self._lane, args=(ids,), daemon=True,
                                      name=f'kd_ckpt-read-{lane}')
                     for lane, ids in lanes.items()]
    for th in self._threads:
      th.start()

  def __enter__(self) -> 'ReadAhead':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _lane(self, ids: list[int]) -> None:
    finisher = _Finisher(self)
    try:
      self._start_or_run(ids, finisher)
    finally:
      finisher.close()  # every submitted read delivered, or its bytes back

  def _start_or_run(self, ids: list[int], finisher: '_Finisher') -> None:
    gathered: list[tuple[int, Callable[[], Any]]] = []  # started, not submitted
    batch = None
    for i in ids:
      task = self._tasks[i]
      if gathered and (task.start is None or not self._my_turn(i)
                       or not self._fits(task.charge_bytes)):
        # About to wait, or to run a task alone: what was gathered goes
        # first, and is finished meanwhile by the finisher.
        finisher.submit(batch, gathered)
        gathered, batch = [], None
        acquired = False
      else:
        acquired = bool(gathered)
      if not acquired:
        with self._cond:
          while self._turn != i and not self._stop:
            self._cond.wait()
          if self._stop:
            return
        try:
          # In task order: only tasks before this one hold bytes it waits for.
          self._lim.acquire(task.charge_bytes)
        except BaseException as e:  # pylint: disable=broad-exception-caught
          self._fail(i, e)
          return
      with self._cond:
        self._turn = i + 1
        self._cond.notify_all()
        if self._stop:  # closed while this one waited: nobody will take it
          self._lim.release(task.charge_bytes)
          finisher.submit(batch, gathered)
          return
      if task.start is not None:
        if batch is None:
          batch = ts.Batch()
        try:
          gathered.append((i, task.start(batch)))
        except BaseException as e:  # pylint: disable=broad-exception-caught
          self._lim.release(task.charge_bytes)
          self._fail(i, e)
          finisher.submit(batch, gathered)
          return
        continue
      try:
        result = task.run()
      except BaseException as e:  # pylint: disable=broad-exception-caught
        self._lim.release(task.charge_bytes)
        self._fail(i, e)
        return
      if not self._deliver(i, result):
        return
    finisher.submit(batch, gathered)

  def _fits(self, nbytes: int) -> bool:
    """Acquires `nbytes` if they fit now (a request too large waits, and fails, alone)."""
    try:
      return self._lim.try_acquire(nbytes)
    except limiter_lib.RequestTooLargeError:
      return False

  def _my_turn(self, i: int) -> bool:
    with self._cond:
      return self._turn == i

  def finish_batch(self, gathered) -> bool:
    """Delivers the results of `gathered` (started, their batch submitted);
    False if stopped."""
    ok = True
    for i, finish in gathered:
      if not ok:
        # Stopped or failed: wait for the read all the same (its buffers
        # are TensorStore's until it ends), then give its bytes back.
        try:
          finish()
        except BaseException:  # pylint: disable=broad-exception-caught
          pass
        self._lim.release(self._tasks[i].charge_bytes)
        continue
      try:
        result = finish()
      except BaseException as e:  # pylint: disable=broad-exception-caught
        self._lim.release(self._tasks[i].charge_bytes)
        self._fail(i, e)
        ok = False
        continue
      ok = self._deliver(i, result)
    return ok

  def _deliver(self, i: int, result) -> bool:
    """Hands task i's result to the caller; False (and its bytes back) if stopped."""
    with self._cond:
      if self._stop:
        del result
        self._lim.release(self._tasks[i].charge_bytes)
        return False
      self._done[i] = (result, self._tasks[i].charge_bytes)
      self._cond.notify_all()
    return True

  def _fail(self, i: int, error: BaseException) -> None:
    """Task i failed: record why and stop every lane."""
    with self._cond:
      self._failed[i] = error
      self._stop = True
      self._cond.notify_all()

  def take(self, i: int) -> tuple[Any, int]:
    """Task i's (result, charge): the caller releases the charge when done."""
    with self._cond:
      while i not in self._done and not self._failed:
        if self._stop and not any(th.is_alive() for th in self._threads):
          raise RuntimeError(f'read task {i} was never run (the read was stopped)')
        self._cond.wait(timeout=1.0)
      if i in self._done:
        return self._done.pop(i)
      # A task failed: the read fails with its error (later tasks stopped).
      raise self._failed[min(self._failed)]

  def close(self) -> None:
    """Stops the lanes (after their current task) and releases what is left."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
      # Before joining: a lane may be waiting in the limiter for these bytes.
      for _, charge in self._done.values():
        self._lim.release(charge)
      self._done.clear()
    for th in self._threads:
      th.join()


class _Finisher:
  """A lane's batches, submitted, finished in order on a thread of their own.

  The lane goes on starting the next tasks as bytes free up: from a bucket,
  reads stay in flight while earlier ones are decoded and placed, not one
  batch at a time.  Restoring the Gemma-like state (1.1 GB) through a
  proxy that gave each request 20 ms and each connection 200 MB/s, the
  lane's reads had been one connection's most of the time: 9.8-10.5 s,
  against Orbax's 4.2-6.7 s.
  """

  def __init__(self, ahead: ReadAhead):
    self._ahead = ahead
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._thread = None

  def submit(self, batch, gathered) -> None:
    """Submits `batch`; its tasks (`gathered`) are finished on the thread."""
    if batch is not None:
      batch.submit()
    if not gathered:
      return
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, daemon=True,
                                      name=threading.current_thread().name + '-finish')
      self._thread.start()
    self._queue.put(gathered)

  def _run(self) -> None:
    while (gathered := self._queue.get()) is not None:
      self._ahead.finish_batch(gathered)

  def close(self) -> None:
    """Waits until every submitted task is delivered or its bytes released."""
    if self._thread is not None:
      self._queue.put(None)
      self._thread.join()
