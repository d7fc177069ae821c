"""Integrity: a CRC32C of every box of bytes a save writes, kept beside Orbax's files.

Orbax and TensorStore do not checksum array data, so a flipped bit on disk
restores silently.  Every kd_ckpt save records, per process, the CRC32C of
each box (a hyper-rectangle in global coordinates) of logical bytes it wrote:

  * streaming: each slice, right after its device-to-host copy;
  * Orbax strategy: each replica slice, on Orbax's own host copy, right after
    Orbax's device-to-host transfer (`transfer_arrays_to_host`);
  * numpy leaves and scalars: the whole value (already on the host).

No extra pass over the data and no extra copy: the CRC reads the host buffer
that is about to be written (CRC32C runs at ~7 GB/s here, and releases the
GIL).  The records go to `kd_ckpt_checksums.process_<i>.json` in the
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
import functools
import json
import re
import threading
from typing import Any, Sequence

from etils import epath
import google_crc32c
import jax
import numpy as np

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


def keypath_text(keypath, default: str) -> str:
  """A leaf's key path as users read it ('opt.mu'); `default` if unknown."""
  if keypath is None:
    return default
  try:
    return jax.tree_util.keystr(tuple(keypath), simple=True, separator='.')
  except Exception:  # pylint: disable=broad-exception-caught
    return default


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


def box_of(index: Sequence[Any], shape: Sequence[int]) -> Box:
  """A tuple of python slices (open ends allowed) as ((start, stop), ...)."""
  out = []
  for s, n in zip(index, shape):
    if isinstance(s, slice):
      start, stop, _ = s.indices(int(n))
    else:
      start, stop = int(s), int(s) + 1
    out.append((int(start), int(stop)))
  return tuple(out)


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

  def add(self, name: str, box: Box, data: np.ndarray, *, path: str = '',
          shape: Sequence[int] | None = None, dtype: Any = None) -> None:
    """Records the CRC32C of `data`, which holds `box` of array `name`."""
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


def read(directory: epath.PathLike) -> dict[str, LeafRecord]:
  """All processes' records in `directory`, merged by array name."""
  out: dict[str, LeafRecord] = {}
  for f in _files(directory):
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


# --- Orbax strategy: checksum Orbax's own host copies --------------------------
#
# Orbax's ArrayHandler copies each replica slice to the host in
# `replica_slices.transfer_arrays_to_host` and writes those buffers later.  We
# wrap that function once (it is looked up through the module at each call),
# and the wrapper checksums the host copies of arrays a kd_ckpt save
# registered.  Arrays nobody registered pass through untouched, so stock Orbax
# saves in the same process are unaffected.

_registry_lock = threading.Lock()
_registered: dict[int, tuple[Checksums, str, str]] = {}


def register(arrays: Sequence[Any], names: Sequence[str], paths: Sequence[str],
             sums: Checksums) -> None:
  """Marks `arrays` (the exact objects Orbax will transfer) for checksumming."""
  install_orbax_hook()
  with _registry_lock:
    for a, n, p in zip(arrays, names, paths):
      _registered[id(a)] = (sums, n, p)


def unregister(sums: Checksums) -> None:
  """Forgets every array registered for `sums` (its save is over)."""
  with _registry_lock:
    for k in [k for k, v in _registered.items() if v[0] is sums]:
      del _registered[k]


@functools.cache
def install_orbax_hook() -> None:
  from orbax.checkpoint._src.serialization import replica_slices  # pylint: disable=g-import-not-at-top

  original = replica_slices.transfer_arrays_to_host

  @functools.wraps(original)
  def transfer_and_checksum(arrays, *args, **kwargs):
    out = original(arrays, *args, **kwargs)
    with _registry_lock:
      hits = [(_registered.get(id(a)), host) for a, host in zip(arrays, out)]
    for hit, host in hits:
      if hit is None:
        continue
      sums, name, path = hit
      for rs in host.replica_slices:
        data = rs.data()
        sums.add(name, box_of(rs.index, host.global_shape), data, path=path,
                 shape=host.global_shape, dtype=host.dtype)
    return out

  replica_slices.transfer_arrays_to_host = transfer_and_checksum
