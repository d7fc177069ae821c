"""Shared test set-up: 8 fake CPU devices, before anything imports jax; epath on gcsfs."""

import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# etils.epath picks tf.io.gfile for gs:// when TensorFlow is importable, and
# caches that choice at the first gs:// path of the process.  The object-storage
# tests point gcsfs at a local server; tf.io.gfile cannot be pointed anywhere
# but Google's servers.  Decide before anything touches a gs:// path.
os.environ.setdefault('EPATH_USE_TF', 'false')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shutil
import tempfile

# Checkpoints written by one test module take up to ~2 GB on disk at a time.
# A disk that fills mid-run fails tests with TensorStore's RESOURCE_EXHAUSTED
# far from the cause; say so up front instead.
_MIN_FREE_DISK_BYTES = 6 << 30


def pytest_sessionstart(session):
  del session
  tmp = tempfile.gettempdir()
  free = shutil.disk_usage(tmp).free
  if free < _MIN_FREE_DISK_BYTES:
    import pytest  # pylint: disable=g-import-not-at-top

    pytest.exit(
        f'only {free / 2**30:.1f} GiB free in {tmp}; the tests need'
        f' {_MIN_FREE_DISK_BYTES / 2**30:.0f} GiB. Free space there (old'
        ' pytest-of-* directories under it are safe to delete) or point'
        ' TMPDIR elsewhere.',
        returncode=3,
    )


# The longest files first (seconds of test time on 2 cores, 560 tests in
# all): `make test` gives each of its 2 workers a file at a time
# (--dist loadfile), so a long file taken last would run alone at the end.
_LONGEST_FIRST = ('test_budget.py', 'test_object_storage.py', 'test_bench.py',  # 235-255 s
                  'test_reliability.py', 'test_crash_safety.py', 'test_streaming.py',
                  'test_kauldron_integration.py', 'test_chunkread.py')         # 75-95 s


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  # sorted() is stable: within a file, and among the other files, the order stays.
  items[:] = sorted(items, key=lambda it: rank.get(it.path.name, len(rank)))
