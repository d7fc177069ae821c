"""The host-byte limiter's waits end: on progress, on a stall, or when their lease ends (issue 19)."""

import asyncio
import threading
import time

import pytest

from kd_ckpt import limiter as limiter_lib


def test_a_wait_whose_lease_ends_gets_a_clear_error():
  lim = limiter_lib.HostLimiter()
  errors = []
  ended = threading.Event()

  def waiter():
    try:
      lim.acquire(80)
    except Exception as e:  # pylint: disable=broad-exception-caught
      errors.append(e)
    ended.set()

  with lim.lease(100):
    lim.acquire(50)
    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    assert not ended.is_set()  # it waits for room
  assert ended.wait(10)
  assert len(errors) == 1 and isinstance(errors[0], limiter_lib.LimiterStalledError), errors
  assert 'lease' in str(errors[0])


def test_a_wait_that_sees_no_release_fails_instead_of_hanging(monkeypatch):
  monkeypatch.setattr(limiter_lib, 'STALL_SECS', 0.5)
  lim = limiter_lib.HostLimiter()
  with lim.lease(100):
    lim.acquire(60)
    start = time.monotonic()
    with pytest.raises(limiter_lib.LimiterStalledError, match='wedged'):
      lim.acquire(60)
    assert time.monotonic() - start < 10

    async def wait_async():
      await lim.acquire_async(60)

    with pytest.raises(limiter_lib.LimiterStalledError, match='wedged'):
      asyncio.run(wait_async())
    lim.release(60)
    assert lim.in_use_bytes == 0


def test_releases_keep_a_slow_wait_alive(monkeypatch):
  monkeypatch.setattr(limiter_lib, 'STALL_SECS', 0.6)
  lim = limiter_lib.HostLimiter()
  with lim.lease(100):
    lim.acquire(90)
    lim.acquire(1)

    def trickle():
      # Small releases, each well inside STALL_SECS; the big one after 1.5 s.
      for _ in range(5):
        time.sleep(0.3)
        lim.release(1)
        lim.acquire(1)
      lim.release(1)
      lim.release(90)

    t = threading.Thread(target=trickle)
    t.start()
    lim.acquire(60)  # waits ~1.5 s in all, never 0.6 s without a release
    t.join()
    lim.release(60)


def test_a_carved_part_is_held_by_its_parent_and_bounds_only_its_own_bytes():
  lim = limiter_lib.HostLimiter()
  with lim.lease(100):
    with lim.carve(60) as part:
      assert lim.in_use_bytes == 60 and part.capacity_bytes == 60
      with lim.carve(60, wait=False) as none:
        assert none is None and lim.in_use_bytes == 60  # does not fit now: nothing carved
      with lim.carve(40, wait=False) as other:
        assert other is not None and lim.in_use_bytes == 100
        part.acquire(60)  # a part's bytes are its own: no wait on `other`
        with pytest.raises(limiter_lib.RequestTooLargeError):
          other.acquire(41)
        part.release(60)
      assert lim.in_use_bytes == 60
    assert lim.in_use_bytes == 0
