"""Tests for kd_ckpt.readahead: reads ahead of their consumer, inside the limiter."""

from __future__ import annotations

import threading
import time

import pytest

from kd_ckpt import limiter as limiter_lib
from kd_ckpt import readahead

MiB = 1 << 20


def _tasks(n, lanes, charge, log, sleep=0.0, fail_at=None):
  def run(i):
    log.append(('start', i, threading.current_thread().name))
    time.sleep(sleep)
    if i == fail_at:
      raise OSError(f'disk gone at {i}')
    return i * 10
  return [readahead.Task(i % lanes, charge, lambda i=i: run(i)) for i in range(n)]


def test_results_come_in_order_and_every_charge_is_released():
  lim = limiter_lib.HostLimiter()
  with lim.lease(100 * MiB):
    log = []
    with readahead.ReadAhead(lim, _tasks(20, 3, 10 * MiB, log)) as ahead:
      for i in range(20):
        value, charge = ahead.take(i)
        assert value == i * 10
        assert charge == 10 * MiB
        lim.release(charge)
    assert lim.in_use_bytes == 0
    assert len({name for _, _, name in log}) == 3  # three lanes ran


def test_tasks_run_ahead_only_as_far_as_the_limiter_admits():
  lim = limiter_lib.HostLimiter()
  with lim.lease(35 * MiB):
    seen = []
    with readahead.ReadAhead(lim, _tasks(12, 4, 10 * MiB, [], sleep=0.01)) as ahead:
      for i in range(12):
        time.sleep(0.02)  # a slow consumer: the lanes fill what fits
        seen.append(lim.in_use_bytes)
        _, charge = ahead.take(i)
        lim.release(charge)
    assert max(seen) <= 35 * MiB
    assert max(seen) >= 20 * MiB, seen  # more than one task was in flight
    assert lim.in_use_bytes == 0


def test_a_budget_for_one_task_at_a_time_still_finishes():
  # Each task needs the whole capacity: they must run strictly one by one
  # (task i+1 waits for the consumer to release task i), with no deadlock.
  lim = limiter_lib.HostLimiter()
  with lim.lease(10 * MiB):
    with readahead.ReadAhead(lim, _tasks(8, 4, 10 * MiB, [])) as ahead:
      for i in range(8):
        value, charge = ahead.take(i)
        assert value == i * 10
        assert lim.in_use_bytes == 10 * MiB
        lim.release(charge)
    assert lim.in_use_bytes == 0


def test_a_failed_task_fails_the_read_and_releases_everything():
  lim = limiter_lib.HostLimiter()
  with lim.lease(100 * MiB):
    with pytest.raises(OSError, match='disk gone at 5'):
      with readahead.ReadAhead(lim, _tasks(12, 2, 10 * MiB, [], fail_at=5)) as ahead:
        for i in range(12):
          _, charge = ahead.take(i)
          lim.release(charge)
    assert lim.in_use_bytes == 0


def test_closing_early_releases_what_was_read_but_not_taken():
  lim = limiter_lib.HostLimiter()
  with lim.lease(50 * MiB):
    with readahead.ReadAhead(lim, _tasks(30, 2, 10 * MiB, [])) as ahead:
      _, charge = ahead.take(0)
      lim.release(charge)
      time.sleep(0.1)  # lanes fill the limiter, then wait
      assert lim.in_use_bytes > 0
    assert lim.in_use_bytes == 0


def test_a_task_larger_than_the_capacity_is_an_error_not_a_hang():
  lim = limiter_lib.HostLimiter()
  with lim.lease(10 * MiB):
    with pytest.raises(limiter_lib.RequestTooLargeError):
      with readahead.ReadAhead(lim, _tasks(3, 1, 20 * MiB, [])) as ahead:
        ahead.take(0)
    assert lim.in_use_bytes == 0


# --- tasks started into TensorStore batches (reads from a bucket) -------------


def _started(n, charge, batches, fail_at=None):
  """Tasks that only start: each records the batch it was issued into."""
  def start(i, batch):
    batches.append(batch)
    def finish():
      if i == fail_at:
        raise OSError(f'bucket gone at {i}')
      return i * 10
    return finish
  return [readahead.Task(0, charge, lambda: pytest.fail('started tasks are not run'),
                         start=lambda b, i=i: start(i, b)) for i in range(n)]


def test_tasks_that_fit_at_once_go_out_in_one_batch():
  lim = limiter_lib.HostLimiter()
  with lim.lease(100 * MiB):
    batches = []
    with readahead.ReadAhead(lim, _started(8, 10 * MiB, batches)) as ahead:
      time.sleep(0.1)  # all eight fit: gathered before the first is taken
      for i in range(8):
        value, charge = ahead.take(i)
        assert value == i * 10
        lim.release(charge)
    assert len(batches) == 8 and all(b is batches[0] for b in batches)
    assert lim.in_use_bytes == 0


def test_a_batch_is_submitted_before_its_lane_waits_for_bytes():
  # Three tasks fit at once: a lane that kept its batch open while it waited
  # for the fourth's bytes would wait forever (the caller waits for the
  # first three, which only the submit ends).
  lim = limiter_lib.HostLimiter()
  with lim.lease(35 * MiB):
    batches, seen = [], []
    with readahead.ReadAhead(lim, _started(12, 10 * MiB, batches)) as ahead:
      for i in range(12):
        time.sleep(0.01)
        seen.append(lim.in_use_bytes)
        _, charge = ahead.take(i)
        lim.release(charge)
    assert max(seen) <= 35 * MiB
    sizes = [sum(1 for b in batches if b is x) for x in {id(b): b for b in batches}.values()]
    assert max(sizes) <= 3 and sum(sizes) == 12, sizes
    assert lim.in_use_bytes == 0


def test_a_lane_starts_more_reads_while_earlier_ones_are_in_flight():
  # Two tasks fit at once.  Task 1's read is slow (a bucket): once task 0
  # is taken, the lane must start task 2 while task 1 is still in flight,
  # not wait for task 1 before it asks for task 2's bytes.
  lim = limiter_lib.HostLimiter()
  slow, started = threading.Event(), threading.Event()

  def start(i, batch):
    del batch
    if i == 2:
      started.set()
    def finish():
      if i == 1:
        assert slow.wait(10), 'task 1 was never let finish'
      return i
    return finish

  tasks = [readahead.Task(0, 10 * MiB, lambda: pytest.fail('started tasks are not run'),
                          start=lambda b, i=i: start(i, b)) for i in range(4)]
  with lim.lease(25 * MiB):
    with readahead.ReadAhead(lim, tasks) as ahead:
      value, charge = ahead.take(0)
      lim.release(charge)
      in_flight = started.wait(5)  # task 1 still unfinished
      slow.set()
      got = [value]
      for i in range(1, 4):
        value, charge = ahead.take(i)
        got.append(value)
        lim.release(charge)
    assert in_flight, 'task 2 started only after task 1 had finished'
    assert got == [0, 1, 2, 3]
    assert lim.in_use_bytes == 0


def test_started_and_run_tasks_mix_in_one_lane():
  lim = limiter_lib.HostLimiter()
  with lim.lease(100 * MiB):
    batches = []
    tasks = _started(6, MiB, batches)
    tasks[3] = readahead.Task(0, MiB, lambda: 30)  # run alone, between batches
    with readahead.ReadAhead(lim, tasks) as ahead:
      got = []
      for i in range(6):
        value, charge = ahead.take(i)
        got.append(value)
        lim.release(charge)
    assert got == [0, 10, 20, 30, 40, 50]
    assert batches[0] is batches[2] and batches[3] is not batches[0]
    assert lim.in_use_bytes == 0


def test_a_failed_batched_read_fails_the_read_and_releases_everything():
  lim = limiter_lib.HostLimiter()
  with lim.lease(100 * MiB):
    with pytest.raises(OSError, match='bucket gone at 2'):
      with readahead.ReadAhead(lim, _started(6, 10 * MiB, [], fail_at=2)) as ahead:
        for i in range(6):
          _, charge = ahead.take(i)
          lim.release(charge)
    assert lim.in_use_bytes == 0


def test_batched_tensorstore_reads_are_submitted_and_read_back():
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  t = ts.open({'driver': 'zarr', 'kvstore': 'memory://'}, create=True, dtype=ts.float32,
              shape=[8, 4], chunk_layout=ts.ChunkLayout(read_chunk_shape=[1, 4])).result()
  values = np.arange(32, dtype=np.float32).reshape(8, 4)
  t.write(values).result()
  tasks = []
  for i in range(8):
    def start(batch, i=i):
      future = t[i].read(batch=batch)  # waits for the batch's submit
      return lambda: future.result()
    tasks.append(readahead.Task(0, MiB, lambda: pytest.fail('not run'), start=start))
  lim = limiter_lib.HostLimiter()
  with lim.lease(4 * MiB):
    with readahead.ReadAhead(lim, tasks) as ahead:
      for i in range(8):
        row, charge = ahead.take(i)
        np.testing.assert_array_equal(row, values[i])
        lim.release(charge)
    assert lim.in_use_bytes == 0
