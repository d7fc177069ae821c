"""Budget parsing and the host-memory probe (cgroup files faked)."""

import ctypes
import os

import numpy as np
import pytest

from kd_ckpt import budget
from kd_ckpt import cost
from kd_ckpt import hostmem
from kd_ckpt import limiter as limiter_lib

GiB = 1 << 30


@pytest.mark.parametrize('text,expected', [
    ('512MiB', 512 << 20), ('8GB', 8 * 10**9), ('1.5GiB', int(1.5 * GiB)),
    ('100', 100), (' 2 gib ', 2 * GiB), (4096, 4096),
])
def test_parse_bytes(text, expected):
  assert budget.parse(text).bytes == expected


def test_parse_fraction_and_auto():
  assert budget.parse(0.25).fraction == 0.25
  assert budget.parse('auto').fraction == budget.AUTO_FRACTION
  # As a command line passes them: read as bytes, '0.25' was refused as not positive.
  assert budget.parse('0.25').fraction == 0.25 and budget.parse('.5').fraction == 0.5
  assert budget.parse('25%').fraction == 0.25 and budget.parse('100 %').fraction == 1.0
  assert budget.parse('1.0').fraction == 1.0 and budget.parse('1').bytes == 1


@pytest.mark.parametrize('bad', ['0%', '150%', '1.5', '0.0'])
def test_parse_names_a_bad_fraction_written_as_text(bad):
  with pytest.raises(ValueError, match='host_ram_budget') as e:
    budget.parse(bad)
  assert repr(bad) in str(e.value) or bad in str(e.value), e.value


@pytest.mark.parametrize('bad', [0, -5, '0MiB', '-1GB', 'lots', '12 parsecs', 1.5, 0.0, True, None, [1]])
def test_parse_rejects_with_a_fix(bad):
  with pytest.raises(ValueError) as e:
    budget.parse(bad)
  assert repr(bad) in str(e.value) and '"auto"' in str(e.value)


def test_parse_takes_numpy_integers_and_suggests_no_size_for_nan():
  import numpy as np  # pylint: disable=g-import-not-at-top
  assert budget.parse(np.int64(512 << 20)).bytes == 512 << 20
  assert budget.parse(np.uint32(4096)).text == '4096'
  with pytest.raises(ValueError, match='must be positive'):
    budget.parse(np.int64(-1))
  for bad in (float('nan'), float('inf'), -2.0):
    with pytest.raises(ValueError, match=r'must be in \(0, 1\]\. Use "auto"'):
      budget.parse(bad)
  with pytest.raises(ValueError, match='a string such as "1.5GiB"'):
    budget.parse(1.5)


def _mem(total=16 * GiB, avail=8 * GiB, procs=1):
  return hostmem.HostMemory(total_bytes=total, available_bytes=avail,
                            rss_bytes=0, local_process_count=procs)


def test_resolve_fraction_uses_per_process_share():
  assert budget.resolve('auto', _mem(avail=8 * GiB, procs=2)) == 2 * GiB
  assert budget.resolve(0.5, _mem(avail=8 * GiB)) == 4 * GiB


def test_resolve_clamps_budget_above_memory(caplog):
  assert budget.resolve('64GiB', _mem(total=16 * GiB, procs=2)) == 8 * GiB


def _fake_cgroup_v2(tmp_path, limit, current, nested=None):
  root = tmp_path / 'cg'
  root.mkdir()
  (root / 'cgroup.controllers').write_text('cpu memory\n')
  (root / 'memory.max').write_text(limit)
  (root / 'memory.current').write_text(str(current))
  proc = tmp_path / 'cgroup'
  proc.write_text('0::/\n')
  if nested:
    d = root / 'job'
    d.mkdir()
    (d / 'memory.max').write_text(nested)
    (d / 'memory.current').write_text(str(current))
    proc.write_text('0::/job\n')
  return root, proc


def test_cgroup_v2_limit(tmp_path):
  root, proc = _fake_cgroup_v2(tmp_path, str(4 * GiB), GiB)
  cg = hostmem.read_cgroup_memory(root, proc)
  assert (cg.version, cg.limit_bytes, cg.usage_bytes) == (2, 4 * GiB, GiB)
  mem = hostmem.probe(cgroup_root=root, proc_cgroup=proc, process_count=1)
  assert mem.total_bytes == 4 * GiB
  assert mem.available_bytes <= 3 * GiB


def test_cgroup_v2_nested_tightest_wins(tmp_path):
  root, proc = _fake_cgroup_v2(tmp_path, 'max', GiB, nested=str(2 * GiB))
  assert hostmem.read_cgroup_memory(root, proc).limit_bytes == 2 * GiB


def test_cgroup_v2_unlimited(tmp_path):
  root, proc = _fake_cgroup_v2(tmp_path, 'max', GiB)
  assert hostmem.read_cgroup_memory(root, proc).limit_bytes is None


def test_cgroup_v1_limit(tmp_path):
  root = tmp_path / 'cg'
  (root / 'memory').mkdir(parents=True)
  (root / 'memory' / 'memory.limit_in_bytes').write_text(str(3 * GiB))
  (root / 'memory' / 'memory.usage_in_bytes').write_text(str(GiB))
  proc = tmp_path / 'cgroup'
  proc.write_text('5:memory:/\n0::/\n')
  cg = hostmem.read_cgroup_memory(root, proc)
  assert (cg.version, cg.limit_bytes) == (1, 3 * GiB)
  # v1 reports "no limit" as a huge number.
  (root / 'memory' / 'memory.limit_in_bytes').write_text(str(2**63 - 4096))
  assert hostmem.read_cgroup_memory(root, proc).limit_bytes is None


def test_no_cgroup(tmp_path):
  assert hostmem.read_cgroup_memory(tmp_path / 'none', tmp_path / 'none') is None


def test_peak_rss_sees_an_allocation():
  import gc  # pylint: disable=g-import-not-at-top
  import mmap  # pylint: disable=g-import-not-at-top
  gc.collect()  # earlier tests' garbage, freed inside the block, would lower RSS
  hostmem.release_free_memory()
  with hostmem.PeakRss() as peak:
    # Mapped directly: a 200 MiB numpy buffer comes from glibc's heap when an
    # earlier test in this worker left that much free there (trimmed, so not
    # resident), and stays there when freed (CI: retained 200 MiB once).
    m = mmap.mmap(-1, 200 << 20)
    np.frombuffer(m, np.uint8)[:] = 1  # touched: resident
    m.close()
  assert peak.exact
  assert peak.extra_bytes >= 190 << 20
  assert peak.retained_bytes < 100 << 20


_OVERLAPPING = """
import json, threading
import numpy as np
from kd_ckpt import hostmem
hostmem.release_free_memory()
with hostmem.PeakRss() as outer:
  a = np.ones(160 << 20, dtype=np.uint8)
  del a  # freed: RSS is back down, only the high-water mark remembers
  with hostmem.PeakRss() as inner:
    b = np.ones(40 << 20, dtype=np.uint8)
    del b
  # In another thread, as a concurrent save's measurement would.
  t = threading.Thread(target=lambda: hostmem.PeakRss().__enter__().__exit__())
  t.start()
  t.join()
print(json.dumps([outer.extra_bytes, inner.extra_bytes]))
"""


def test_overlapping_measurements_do_not_hide_each_others_peaks():
  """VmHWM is one per process: a measurement that starts must not erase the
  peak an open one has seen (a report inside a user's own measurement, or
  two saves measured in two threads).

  In a fresh process: in a test worker, free heap chunks an earlier test
  left served the 40 MiB without raising RSS (once in four CI runs).
  """
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, '-c', _OVERLAPPING], cwd=repo, capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'PYTHONPATH': repo})
  assert proc.returncode == 0, proc.stderr[-3000:]
  outer, inner = json.loads(proc.stdout.strip().splitlines()[-1])
  assert outer >= 150 << 20, outer
  # The inner one measures from its own start: the earlier peak is not its.
  assert 35 << 20 <= inner < 100 << 20, inner


class _MallInfo2(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in (
      'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks',
      'uordblks', 'fordblks', 'keepcost')]


def _mmapped_chunks_for(count: int, nbytes: int) -> int:
  """How many of `count` live numpy buffers of `nbytes` glibc served with mmap."""
  libc = ctypes.CDLL('libc.so.6')
  if not hasattr(libc, 'mallinfo2'):
    pytest.skip('glibc < 2.33: no mallinfo2')
  libc.mallinfo2.restype = _MallInfo2
  before = libc.mallinfo2().hblks
  held = [np.empty(nbytes, np.uint8) for _ in range(count)]
  after = libc.mallinfo2().hblks
  del held
  return after - before


_MALLOC_TUNING = """
import json, sys
import jax, numpy as np
import kd_ckpt
from kd_ckpt import limiter as limiter_lib
from tests import test_budget_hostmem as t
# A jax.Array: the streaming writer (a limiter lease) writes it.  (A numpy
# leaf goes through Orbax's own handler, with no lease.)
kd_ckpt.save(sys.argv[1], {'w': jax.device_put(np.ones((1 << 20,), np.float32))},
             strategy='streaming', host_ram_budget='256MiB')
out = [t._mmapped_chunks_for(8, 16 << 20)]
limiter = limiter_lib.HostLimiter()
with limiter.lease(64 << 20):
  with limiter.lease(32 << 20):  # nested: still tuned when the inner ends
    pass
  out.append(t._mmapped_chunks_for(8, 16 << 20))
out.append(t._mmapped_chunks_for(8, 16 << 20))
out.append(t._mmapped_chunks_for(2, 48 << 20))
print(json.dumps(out))
"""


@pytest.mark.skipif(
    'MALLOC_MMAP_THRESHOLD_' in os.environ or 'GLIBC_TUNABLES' in os.environ,
    reason='the user\'s own malloc settings are left alone')
def test_malloc_tuning_lasts_only_while_an_operation_holds_buffers(tmp_path):
  """mallopt is process-wide: 1 MiB while kd_ckpt holds buffers, glibc's steady
  state (32 MiB) after, so the training loop's large buffers come from the heap
  again instead of an mmap + page faults each (16 MiB buffers here).

  In a fresh process: free chunks an earlier test left in the heap serve
  some of the buffers whatever the threshold.
  """
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  _mmapped_chunks_for(0, 0)  # skips where glibc has no mallinfo2
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, '-c', _MALLOC_TUNING, str(tmp_path / 'ckpt')],
                        cwd=repo, capture_output=True, text=True, timeout=300,
                        env={**os.environ, 'PYTHONPATH': repo})
  assert proc.returncode == 0, proc.stderr[-3000:]
  import json  # pylint: disable=g-import-not-at-top
  before, during, after, above = json.loads(proc.stdout.strip().splitlines()[-1])
  assert before == 0
  # (Free chunks already in the heap may still serve a few.)
  assert during >= 4, during
  assert after == 0
  # A buffer above the ceiling is still mmapped, as glibc does by default.
  assert above == 2


def test_format_bytes():
  assert hostmem.format_bytes(3 * GiB) == '3.00 GiB'
  assert hostmem.format_bytes(10) == '10 B'


_TRIM = """
import ctypes, json
from kd_ckpt import hostmem
from tests import test_budget_hostmem as t
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = t._MallInfo2

def kept(nbytes):
  # Freed at the heap's top: kept for the next allocation unless trimmed.
  libc.free(libc.malloc(nbytes))
  return libc.mallinfo2().keepcost

out = []
with hostmem.mmap_large_buffers(hostmem.READ_MMAP_THRESHOLD_BYTES):
  out.append(kept(4 << 20))
with hostmem.mmap_large_buffers():
  out.append(kept(4 << 20))
print(json.dumps(out))
"""


@pytest.mark.skipif(
    'MALLOC_MMAP_THRESHOLD_' in os.environ or 'GLIBC_TUNABLES' in os.environ,
    reason="the user's own malloc settings are left alone")
def test_reads_keep_freed_read_buffers_in_the_heap(tmp_path):
  """A read's 4 MiB byte-range reads, freed, stay in the heap for the next
  read (trim threshold 32 MiB) instead of being given back and faulted in
  again each time; a save's scope gives such a block back (2 MiB)."""
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  _mmapped_chunks_for(0, 0)  # skips where glibc has no mallinfo2
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, '-c', _TRIM], cwd=repo, capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'PYTHONPATH': repo})
  assert proc.returncode == 0, proc.stderr[-3000:]
  read_kept, save_kept = json.loads(proc.stdout.strip().splitlines()[-1])
  assert read_kept >= 4 << 20, read_kept
  assert save_kept < 4 << 20, save_kept


def test_a_reads_heap_threshold_shrinks_with_its_capacity():
  """Freed read buffers under the threshold stay in the arenas, outside the
  limiter: at small budgets the threshold is a share of the capacity (the
  zeros state restored at 96 MiB on copying devices peaked 54-121 MiB beyond
  its arrays with 8 MiB, 31-32 MiB with this; tests/test_budget.py)."""
  MiB = 1 << 20
  assert hostmem.read_mmap_threshold(remote=False) == hostmem.READ_MMAP_THRESHOLD_BYTES
  assert hostmem.read_mmap_threshold(remote=False, capacity_bytes=1 << 30) == 8 * MiB
  assert hostmem.read_mmap_threshold(remote=False, capacity_bytes=72 * MiB) == 72 * MiB // 16
  assert hostmem.read_mmap_threshold(remote=False, capacity_bytes=8 * MiB) == 1 * MiB
  # From a bucket a smaller share, at most 4 MiB: at 256 MiB the 2 MiB
  # byte ranges are reused from the heap, at 64 MiB they are not.
  assert hostmem.read_mmap_threshold(remote=True) == 1 * MiB
  assert hostmem.read_mmap_threshold(remote=True, capacity_bytes=1 << 30) == 4 * MiB
  assert hostmem.read_mmap_threshold(
      remote=True, capacity_bytes=cost.limiter_capacity(256 * MiB)) > 2 * MiB + 4096
  assert hostmem.read_mmap_threshold(
      remote=True, capacity_bytes=cost.limiter_capacity(64 * MiB)) == 1 * MiB
