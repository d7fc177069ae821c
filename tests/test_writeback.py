"""Writeback: the waits for the disk run in a thread of their own, bounded."""

import os
import threading
import time

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


def _commit_manifest(root, text: bytes):
  """As an OCDBT commit ends: a new manifest written beside the old one, renamed over it."""
  (root / 'manifest.ocdbt.__lock').write_bytes(text)
  os.rename(root / 'manifest.ocdbt.__lock', root / 'manifest.ocdbt')


def _open_manifests() -> dict[str, int]:
  """This process's open descriptors of manifests: {'live': n, 'deleted': n}."""
  seen = {'live': 0, 'deleted': 0}
  for fd in os.listdir('/proc/self/fd'):
    try:
      target = os.readlink(f'/proc/self/fd/{fd}')
    except OSError:
      continue
    if target.endswith('/manifest.ocdbt'):
      seen['live'] += 1
    elif target.endswith('/manifest.ocdbt (deleted)'):
      seen['deleted'] += 1
  return seen


def _until(cond, timeout=10.0) -> bool:
  deadline = time.monotonic() + timeout
  while not cond():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.005)
  return True


def test_a_replaced_manifest_is_freed_by_the_writeback_thread_not_by_the_rename(tmp_path,
                                                                                monkeypatch):
  """From the first start of writeback, every manifest renamed in is held open:
  the commit that replaces it only unlinks it (on a filesystem mounted with
  `discard` freeing it waited for the writes queued before), and the thread
  frees it once the writes started before it are done; `finish` frees all."""
  probe = writeback._ManifestHolder.start(str(tmp_path))
  if writeback._sync_file_range is None or probe is None:
    pytest.skip('no sync_file_range or inotify here')
  probe.stop()
  threads = set(threading.enumerate())
  passes, real = [], writeback.Writeback.started

  def started(self):
    real(self)
    passes.append(1)
  monkeypatch.setattr(writeback.Writeback, 'started', started)
  _files(tmp_path)
  _commit_manifest(tmp_path, b'1')
  wb = writeback.Writeback(str(tmp_path), start_every_bytes=1)
  try:
    wb.committed(1)  # the first start: the manifest there now is held
    assert _until(lambda: passes == [1] and _open_manifests()['live'] == 1), _open_manifests()
    _commit_manifest(tmp_path, b'2')
    assert _until(lambda: _open_manifests() == {'live': 1, 'deleted': 1}), _open_manifests()
    _commit_manifest(tmp_path, b'3')
    # Both replaced manifests are still open: no rename freed an inode.
    assert _until(lambda: _open_manifests() == {'live': 1, 'deleted': 2}), _open_manifests()
    wb.committed(1)  # the next start frees what was replaced before it
    assert _until(lambda: passes == [1, 1]), passes
    assert _open_manifests() == {'live': 1, 'deleted': 0}
    wb.finish()
  finally:
    wb.close()
  assert _open_manifests() == {'live': 0, 'deleted': 0}
  assert set(threading.enumerate()) <= threads  # the holder's thread stopped
  assert (tmp_path / 'manifest.ocdbt').read_bytes() == b'3'


def test_writeback_starts_after_each_commit_of_a_small_group(tmp_path, monkeypatch):
  """`start_every_bytes` below `START_EVERY_BYTES` (a small state's groups):
  each commit of that many bytes starts writeback; fewer bytes start none."""
  if writeback._sync_file_range is None:
    pytest.skip('no sync_file_range here')
  starts = []
  monkeypatch.setattr(writeback.Writeback, 'started', lambda self: starts.append(1))
  wb = writeback.Writeback(str(tmp_path), start_every_bytes=16 << 20)
  try:
    wb.committed(8 << 20)
    assert _until(lambda: True) and not starts
    wb.committed(8 << 20)
    wb.committed(16 << 20)
    assert _until(lambda: len(starts) == 2), starts
  finally:
    wb.close()


def test_the_manifests_held_open_are_bounded(tmp_path, monkeypatch):
  """Many commits between two starts of writeback (e.g. thousands of small
  leaves) hold at most `MAX_HELD_MANIFESTS` descriptors: the holder frees the
  replaced ones itself beyond that."""
  monkeypatch.setattr(writeback, 'MAX_HELD_MANIFESTS', 4)
  _commit_manifest(tmp_path, b'0')
  holder = writeback._ManifestHolder.start(str(tmp_path))
  if holder is None:
    pytest.skip('no inotify here')
  try:
    for i in range(1, 40):
      _commit_manifest(tmp_path, b'%d' % i)
      assert _until(lambda: _open_manifests()['live'] == 1), _open_manifests()
      assert sum(_open_manifests().values()) <= 5, (i, _open_manifests())
  finally:
    holder.stop()
  assert _open_manifests() == {'live': 0, 'deleted': 0}
