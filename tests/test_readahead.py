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
