"""Integrity: a CRC32C of every box of bytes a save writes, kept beside Orbax's files.

Orbax and TensorStore do not checksum array data, so a flipped bit on disk
restores silently.  Every kd_ckpt save records, per process, the CRC32C of
each box (a hyper-rectangle in global coordinates) of logical bytes it wrote:

  * streaming: each slice, right after its device-to-host copy;
  * Orbax strategy: each replica slice, on the host copy Orbax then writes,
    right after the device-to-host transfer (`orbax_writer`);
  * numpy leaves and scalars: the whole value (already on the host);
  * slices known to be all zero (`crc32c_zeros`): computed from the length,
    without the bytes;
  * leaves reused from the previous checkpoint (`reuse`): that checkpoint's
    records, since the bytes are the very same.

No extra pass over the data and no extra copy: the CRC reads the host buffer
that is about to be written (CRC32C ran at ~13 GB/s here; google-crc32c
holds the GIL while it runs: 256 MiB took 20 ms in one thread and 40 ms for
two in two threads, 2026-12-07).  The records go to `kd_ckpt_checksums.process_<i>.json` in the
checkpoint folder, inside Orbax's temporary directory, so they are renamed
into place with the checkpoint.  Orbax's own files are unchanged, and stock
Orbax ignores ours.  `kd_ckpt.verify` re-reads every box and compares.

Example:

  sums = Checksums()
  sums.add('params.w', ((0, 128), (0, 64)), host_slice, path="['params']['w']")
  sums.write(directory, process_index=0)
  records = read(directory)        # {name: LeafRecord}
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Any, Sequence

from etils import epath
import numpy as np

try:
  import google_crc32c  # pylint: disable=g-import-not-at-top
except ImportError:  # a bare image without it: saves carry no checksums
  google_crc32c = None

FILE_PREFIX = 'kd_ckpt_checksums'
FORMAT = 'kd_ckpt.checksums/1'
_FILE_RE = re.compile(re.escape(FILE_PREFIX) + r'\.process_(\d+)\.json$')

Box = tuple[tuple[int, int], ...]


def file_name(process_index: int) -> str:
  return f'{FILE_PREFIX}.process_{process_index}.json'


def _files(directory: epath.PathLike) -> list[epath.Path]:
  d = epath.Path(directory)
  if not d.is_dir():
    return []
  return sorted(p for p in d.iterdir() if _FILE_RE.match(p.name))


def available() -> bool:
  """Whether CRC32C can be computed here (`google-crc32c` installed)."""
  return google_crc32c is not None


def _warn_if_slow() -> None:
  """Says once, with the speed, when google-crc32c runs its pure-Python fallback.

  google-crc32c installs without its C extension where no wheel matches
  (and falls back silently): every saved byte is then checksummed in Python.
  """
  if getattr(google_crc32c, 'implementation', 'c') == 'c':
    return
  import time  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  probe = np.zeros(1 << 16, np.uint8)
  start = time.perf_counter()
  google_crc32c.extend(0, probe)
  secs = max(time.perf_counter() - start, 1e-9)
  logging.log_first_n(
      logging.WARNING, 'kd_ckpt: google-crc32c is running its pure-Python fallback'
      f' ({probe.nbytes / secs / 1e6:.1f} MB/s here, against ~7 GB/s for its C'
      ' extension): checksums will dominate save time. Reinstall google-crc32c'
      ' with a wheel for this platform (pip install --force-reinstall'
      ' google-crc32c), or install a C compiler so it builds.', 1)


def collector() -> 'Checksums | None':
  """A new save's collector, or None (logged once) where CRC32C is unavailable."""
  if available():
    _warn_if_slow()
    return Checksums()
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.log_first_n(
      logging.WARNING, 'kd_ckpt: google-crc32c is not installed, so saves record no'
      ' checksums (verify will report their leaves unchecked): pip install'
      ' google-crc32c.', 1)
  return None


def crc32c(data: np.ndarray, crc: int = 0) -> int:
  """CRC32C of `data`'s bytes in C order, extending `crc`.

  Zero-copy for C-contiguous arrays (a read-only view is what the C
  extension accepts); others are copied once.
  """
  a = np.ascontiguousarray(data)
  if a.size == 0:
    return crc
  view = a.reshape(-1).view(np.uint8)
  view.flags.writeable = False
  return google_crc32c.extend(crc, view)


# The CRC register after one zero bit is a linear map (over GF(2)) of the
# register before it.  `_ZERO_BYTES_OPS[k]` applies 2**k zero bytes (32
# columns: the image of each register bit), so n zero bytes cost one
# matrix-vector product per set bit of n, as in zlib's crc32_combine.
_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial
_ZERO_BYTES_OPS: list[list[int]] = []
_ops_lock = threading.Lock()


def _gf2_apply(op: list[int], vec: int) -> int:
  out, i = 0, 0
  while vec:
    if vec & 1:
      out ^= op[i]
    vec >>= 1
    i += 1
  return out


def _zero_bytes_op(k: int) -> list[int]:
  """The register's map over 2**k zero bytes."""
  with _ops_lock:
    if not _ZERO_BYTES_OPS:
      op = [_CRC32C_POLY] + [1 << i for i in range(31)]  # one zero bit
      for _ in range(3):  # 8 bits
        op = [_gf2_apply(op, c) for c in op]
      _ZERO_BYTES_OPS.append(op)
    while len(_ZERO_BYTES_OPS) <= k:
      op = _ZERO_BYTES_OPS[-1]
      _ZERO_BYTES_OPS.append([_gf2_apply(op, c) for c in op])
    return _ZERO_BYTES_OPS[k]


def crc32c_zeros(nbytes: int, crc: int = 0) -> int:
  """CRC32C of `nbytes` zero bytes, extending `crc`, without the bytes.

  Equal to `crc32c(np.zeros(nbytes, np.uint8), crc)` in O(log nbytes): a
  leaf found all zero where it lives (an optimizer's moments before the
  first step) is checksummed without copying it to the host.

    crc32c_zeros(1 << 30)   # microseconds, not a 1 GiB pass
  """
  if nbytes < 0:
    raise ValueError(f'nbytes must be >= 0, got {nbytes}.')
  state = crc ^ 0xFFFFFFFF  # google_crc32c pre- and post-inverts the register
  k = 0
  while nbytes:
    if nbytes & 1:
      state = _gf2_apply(_zero_bytes_op(k), state)
    nbytes >>= 1
    k += 1
  return state ^ 0xFFFFFFFF


@dataclasses.dataclass
class LeafRecord:
  """What one or more processes recorded for one stored array."""

  name: str
  path: str
  shape: tuple[int, ...]
  dtype: str
  boxes: list[tuple[Box, int]] = dataclasses.field(default_factory=list)


class Checksums:
  """Thread-safe collector for one save on one process."""

  def __init__(self):
    self._lock = threading.Lock()
    self.leaves: dict[str, LeafRecord] = {}

  def __deepcopy__(self, memo) -> 'Checksums':
    return self  # One collector per save, shared by its handlers.

  def add(self, name: str, box: Box, data: np.ndarray, *, path: str = '',
          shape: Sequence[int] | None = None, dtype: Any = None,
          crc: int | None = None) -> None:
    """Records the CRC32C of `data`, which holds `box` of array `name`.

    `crc`: the data's CRC32C where the caller knows it without reading the
    bytes (all zero: `crc32c_zeros`).
    """
    if crc is None:
      crc = crc32c(data)
    with self._lock:
      rec = self.leaves.get(name)
      if rec is None:
        rec = self.leaves[name] = LeafRecord(
            name=name, path=path or name,
            shape=tuple(int(d) for d in (shape if shape is not None else data.shape)),
            dtype=np.dtype(dtype if dtype is not None else data.dtype).name,
        )
      rec.boxes.append((tuple(box), crc))

  def add_whole(self, name: str, value: Any, *, path: str = '') -> None:
    """A host value saved whole (numpy array or scalar)."""
    arr = np.asarray(value)
    self.add(name, tuple((0, int(n)) for n in arr.shape), arr, path=path)

  def add_record(self, rec: 'LeafRecord') -> None:
    """Carries over another save's records of a leaf whose bytes are the same."""
    with self._lock:
      mine = self.leaves.setdefault(rec.name, LeafRecord(
          name=rec.name, path=rec.path, shape=rec.shape, dtype=rec.dtype))
      mine.boxes.extend(rec.boxes)

  def to_json_dict(self) -> dict[str, Any]:
    with self._lock:
      return {
          'format': FORMAT,
          'algorithm': 'crc32c',
          'leaves': {
              r.name: {
                  'path': r.path, 'shape': list(r.shape), 'dtype': r.dtype,
                  'boxes': [[[list(ab) for ab in box], crc] for box, crc in r.boxes],
              }
              for r in self.leaves.values()
          },
      }

  def write(self, directory: epath.PathLike, process_index: int) -> epath.Path:
    path = epath.Path(directory) / file_name(process_index)
    path.write_text(json.dumps(self.to_json_dict(), separators=(',', ':')))
    return path


def has_checksums(directory: epath.PathLike) -> bool:
  return bool(_files(directory))


def read_process(directory: epath.PathLike, process_index: int) -> dict[str, LeafRecord]:
  """One process's records in `directory` ({} if it has none)."""
  return read(directory, only=file_name(process_index))


def read(directory: epath.PathLike, only: str | None = None) -> dict[str, LeafRecord]:
  """All processes' records in `directory`, merged by array name."""
  out: dict[str, LeafRecord] = {}
  for f in _files(directory):
    if only is not None and f.name != only:
      continue
    data = json.loads(f.read_text())
    if data.get('format') != FORMAT:
      raise ValueError(f'{f}: unknown checksum format {data.get("format")!r}; expected {FORMAT!r}.')
    for name, d in data['leaves'].items():
      rec = out.get(name)
      if rec is None:
        rec = out[name] = LeafRecord(name=name, path=d['path'], shape=tuple(d['shape']),
                                     dtype=d['dtype'])
      rec.boxes.extend((tuple(tuple(ab) for ab in box), int(crc)) for box, crc in d['boxes'])
  return out
