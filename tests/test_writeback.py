"""Writeback: the waits for the disk run in a thread of their own, bounded."""

import os
import threading

import pytest

from kd_ckpt import writeback


def _files(root, n=3):
  os.makedirs(root / 'd', exist_ok=True)
  for i in range(n):
    (root / 'd' / f'f{i}').write_bytes(os.urandom(4096) * 4)


def _run(fn, timeout=5.0) -> bool:
  """Runs fn in a thread; whether it returned within `timeout`."""
  t = threading.Thread(target=fn, daemon=True)
  t.start()
  t.join(timeout)
  return not t.is_alive()


@pytest.fixture
def blocked_waits(monkeypatch):
  """Makes every wait for written bytes block until the event is set."""
  if writeback._sync_file_range is None:
    pytest.skip('no sync_file_range here')
  release = threading.Event()
  waits = []
  real = writeback._range

  def sync_range(path, flags, **kw):
    if flags & writeback._WAIT_AFTER:
      waits.append(path)
      assert release.wait(30)
    return real(path, flags, **kw)

  monkeypatch.setattr(writeback, '_range', sync_range)
  return release, waits


def test_a_commit_does_not_wait_for_the_disk_while_the_thread_has_room(tmp_path, blocked_waits):
  release, waits = blocked_waits
  _files(tmp_path)
  wb = writeback.Writeback(str(tmp_path), depth=2)
  try:
    # Start 1 starts the files' writeback; start 2 waits for them (blocked).
    assert _run(lambda: wb.committed(writeback.START_EVERY_BYTES))
    _files(tmp_path, 4)
    assert _run(lambda: wb.committed(writeback.START_EVERY_BYTES))
    # The save goes on: a third start is queued, not waited for, although
    # the thread is stuck waiting for the disk.
    assert _run(lambda: wb.committed(writeback.START_EVERY_BYTES))
    # One more is past the depth: dirty pages stay bounded, so it waits.
    fourth = threading.Thread(target=lambda: wb.committed(writeback.START_EVERY_BYTES),
                              daemon=True)
    fourth.start()
    fourth.join(0.5)
    assert fourth.is_alive()
  finally:
    release.set()
  fourth.join(10)
  assert not fourth.is_alive()
  assert waits  # the thread did wait for the first start's bytes
  fsynced_before = wb.fsynced
  wb.finish()
  assert wb.fsynced > fsynced_before
  assert wb._thread is None


def test_an_error_in_the_thread_is_raised_by_the_save(tmp_path, monkeypatch):
  if writeback._sync_file_range is None:
    pytest.skip('no sync_file_range here')
  _files(tmp_path)

  def broken(path, flags, **kw):
    raise OSError(5, 'Input/output error', path)

  monkeypatch.setattr(writeback, '_range', broken)
  wb = writeback.Writeback(str(tmp_path))
  wb.committed(writeback.START_EVERY_BYTES)
  with pytest.raises(OSError, match='Input/output error'):
    wb.finish()


def test_close_stops_the_thread_and_fsyncs_nothing(tmp_path, monkeypatch):
  fsynced = []
  monkeypatch.setattr(os, 'fsync', fsynced.append)
  _files(tmp_path)
  wb = writeback.Writeback(str(tmp_path))
  wb.committed(writeback.START_EVERY_BYTES)
  wb.close()
  wb.close()
  assert wb._thread is None
  assert not fsynced
  assert not [t for t in threading.enumerate() if t.name == 'kd_ckpt-writeback']
