"""Reuse unchanged leaves: take them by reference from the previous checkpoint.

A LoRA fine-tune saves gigabytes of frozen weights that never change.  With
reuse on, each save records a 128-bit fingerprint of the bytes every leaf
writes (`kd_ckpt_fingerprints.process_<i>.json`); the next save computes the
same fingerprint (on device for big leaves: nothing is copied to the host)
and, for a leaf whose fingerprint, shape, dtype and write boxes all match,
writes nothing: its stored chunks join the new checkpoint by reference.

The mechanism is OCDBT's own, the one Orbax's per-process merge uses.  The
previous checkpoint's OCDBT data files are hard-linked (local disk) or
copied server-side (gs://, a GCS rewrite: no byte passes through this host)
into the new checkpoint (`kd_ckpt.reuse/`, under the database being
written, `storage.copy_files`), and each
reused leaf's keys are copied into the new database with
`KvStore.experimental_copy_range_to`, which records references to the bytes
in those files instead of rewriting them.  After Orbax's finalize, links no
entry refers to are deleted (`prune`).  Hence:

  * every checkpoint is complete: stock Orbax reads it through its own root
    database, with kd_ckpt not installed;
  * deleting any checkpoint (`max_to_keep`, by hand) never changes another:
    a data file lives as long as one checkpoint links it;
  * shared bytes are stored once on disk.

Reuse falls back to a full write, saying why once in the log, where this
cannot work: no previous checkpoint, one without fingerprints (saved without
reuse), hard links or copies refused (another filesystem or bucket), or, per
leaf, a different shape, dtype or sharding.  A changed leaf is never reused.

A `jax.Array` is immutable while it lives (donation deletes it), so a leaf
saved again as the same live array object keeps the fingerprint computed at
its previous save (`_RECORDS`): frozen weights held outside the train step
(the same objects every save) cost no hashing at all.  Arrays rebuilt each
step (Kauldron returns a new state) are hashed every save.  Mutating a live
array's buffer behind JAX's back (through a DLPack export) voids this.

Example:

  report = kd_ckpt.save('/ckpt/2', state, reuse_from='/ckpt/1')
  report.bytes_reused, report.leaves_reused
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import json
import math
import posixpath
import re
import threading
from typing import Any
import weakref

from absl import logging
from etils import epath
import jax
import numpy as np
import tensorstore as ts

from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import fingerprint as fingerprint_lib
from kd_ckpt import integrity
from kd_ckpt import slicing
from kd_ckpt import storage

FILE_PREFIX = 'kd_ckpt_fingerprints'
FORMAT = 'kd_ckpt.fingerprints/1'
LINK_DIR = 'kd_ckpt.reuse'
# Each reusing save nests the previous one's links one folder deeper (OCDBT
# references are relative to the database they were copied from).  After
# this many generations a save writes everything afresh, so paths stay short
# (~15 characters a level).
MAX_GENERATIONS = 24
# Leaves whose write set is smaller than this are fingerprinted on the host
# (blake2b of the bytes): a device hash compiles once per shape, which for a
# model's many small leaves costs more than copying them.  What counts is
# what the host hash would copy (`host_fetch_bytes`), so it copies less.
DEVICE_MIN_BYTES = 1 << 20


def _host_copy_free(data) -> bool:
  # On the CPU backend `np.asarray` of a shard is a view: the host hash copies
  # only its piece.  Elsewhere `device_get` fetches the whole shard.
  return all(d.platform == 'cpu' for d in data.devices())


def host_fetch_bytes(pieces, itemsize: int) -> int:
  """Host bytes `_host_fingerprint` would copy: a replica-parallel part of a
  shard on a GPU fetches the whole shard (up to its replica count times the
  part), and the bytes the device hash should take over from it."""
  return sum(slicing.nbytes(src, itemsize) if _host_copy_free(data) else int(data.nbytes)
             for data, src, _ in pieces)


def _hashed_on_device(pieces, itemsize: int) -> bool:
  return host_fetch_bytes(pieces, itemsize) >= DEVICE_MIN_BYTES


def file_name(process_index: int) -> str:
  return f'{FILE_PREFIX}.process_{process_index}.json'


@dataclasses.dataclass(frozen=True)
class Record:
  """What one process wrote of one leaf, and its fingerprint."""

  fingerprint: str
  method: str          # 'device' (kd_ckpt.fingerprint) or 'host' (blake2b)
  dtype: str
  shape: tuple[int, ...]
  boxes: tuple[tuple[tuple[int, int], ...], ...]  # global write boxes, sorted
  nbytes: int


class Fingerprints:
  """One save's fingerprints on one process (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.records: dict[str, Record] = {}

  def __deepcopy__(self, memo) -> 'Fingerprints':
    return self

  def add(self, name: str, rec: Record) -> None:
    with self._lock:
      self.records[name] = rec

  def write(self, directory, process_index: int) -> None:
    with self._lock:
      data = {'format': FORMAT, 'leaves': {
          n: {**dataclasses.asdict(r), 'shape': list(r.shape),
              'boxes': [[list(ab) for ab in box] for box in r.boxes]}
          for n, r in self.records.items()}}
    (epath.Path(directory) / file_name(process_index)).write_text(
        json.dumps(data, separators=(',', ':')))


def read_records(directory, process_index: int) -> dict[str, Record] | None:
  f = epath.Path(directory) / file_name(process_index)
  if not f.exists():
    return None
  data = json.loads(f.read_text())
  if data.get('format') != FORMAT:
    return None
  return {n: Record(fingerprint=d['fingerprint'], method=d['method'], dtype=d['dtype'],
                    shape=tuple(d['shape']),
                    boxes=tuple(tuple(tuple(ab) for ab in box) for box in d['boxes']),
                    nbytes=int(d['nbytes']))
          for n, d in data['leaves'].items()}


@dataclasses.dataclass
class Source:
  """The previous checkpoint (item folder) a save takes unchanged leaves from."""

  directory: epath.Path
  records: dict[str, Record]
  checksums: dict[str, integrity.LeafRecord]
  label: str

  @classmethod
  def open(cls, directory, *, label: str = '') -> 'Source | None':
    """The previous checkpoint, or None (logged once, with why) if it cannot be reused."""
    directory = epath.Path(directory) if directory is not None else None
    why = None
    if directory is None or not directory.exists():
      why = 'there is no previous checkpoint'
    elif not (directory / 'manifest.ocdbt').exists():
      why = f'{directory} is not an OCDBT checkpoint'
    else:
      records = read_records(directory, jax.process_index())
      if records is None:
        why = (f'{directory} has no kd_ckpt fingerprints (saved without reuse,'
               ' or by stock Orbax); this save records them for the next one')
      elif generations(directory) >= MAX_GENERATIONS:
        why = (f'{directory} already references {MAX_GENERATIONS} generations of'
               ' reused files; this save writes everything afresh (paths stay short)')
    if why is not None:
      _log_once(f'kd_ckpt {label}: writing every leaf, no reuse: {why}.')
      return None
    checksums = integrity.read_process(directory, jax.process_index())
    return cls(directory=directory, records=records, checksums=checksums, label=label)


def generations(directory) -> int:
  """How deeply `directory`'s reused links nest (0: nothing reused)."""
  deepest = 0
  for rel, _ in storage.files(directory):
    deepest = max(deepest, rel.split('/').count(LINK_DIR))
  return deepest


_logged: set[str] = set()


def _log_once(message: str) -> None:
  """Each distinct reason once per process (a run saves many times)."""
  if message not in _logged:
    _logged.add(message)
    logging.info('%s', message)


def write_set(handler, arr: jax.Array) -> list[tuple[Any, slicing.Box, slicing.Box]]:
  """(single-device array, box in it, global box) of what this process writes of `arr`."""
  o = compat.array_handler_options(handler)
  return _write_set(arr, o.replica_id, o.use_replica_parallel,
                    o.min_slice_bytes_for_replica_parallel, o.max_replicas_for_replica_parallel)


# How a save may cut a replicated leaf, as `plan.WAYS` names them:
# (use_replica_parallel, min_slice_bytes) for Orbax's writer either way
# (`handler.SafePyTreeHandler.async_save`), then the streaming writer's.
def _ways() -> dict[str, tuple[bool, int | None]]:
  return {'replica_parallel': (True, None), 'single_replica': (False, None),
          'streaming': (jax.process_count() > 1, cost.MIN_REPLICA_PARALLEL_BYTES)}


def fingerprint_programs_by_way(tree: Any) -> dict[str, int]:
  """How many device programs fingerprinting `tree` will compile in this
  process, for each way a save may cut its replicated leaves (`plan.WAYS`).

  XLA keeps each (`cost.FINGERPRINT_PROGRAM_BYTES`) for the life of the
  process, outside any limiter: a save that fingerprints (reuse) plans each
  way with its budget less its own programs' charge
  (`plan.plan_save(fingerprint_programs=)`).  One program per shape, dtype,
  box and device set of the pieces hashed on device
  (`fingerprint.program_keys`), so a model's repeated layers share theirs,
  and a later save of the same tree compiles none for the way it took
  before.

    by_way = reuse.fingerprint_programs_by_way(state)
    by_way['streaming']  # 0 once a streaming save of `state` fingerprinted it
  """
  keys = _program_keys_by_way(tree)
  return {way: len(fingerprint_lib.new_programs(k)) for way, k in keys.items()}


def fingerprint_programs(tree: Any) -> int:
  """Device programs fingerprinting `tree` may compile, whichever way it is
  cut (the union of `fingerprint_programs_by_way`): never fewer than a save
  compiles.

    n = reuse.fingerprint_programs(state)  # 0 once saves of `state` took every way
  """
  return len(fingerprint_lib.new_programs(set().union(*_program_keys_by_way(tree).values())))


def _program_keys_by_way(tree: Any) -> dict[str, set]:
  from kd_ckpt import tree as tree_lib  # pylint: disable=g-import-not-at-top
  ways = _ways()
  keys = {way: set() for way in ways}
  for arr in jax.tree_util.tree_leaves(tree):
    if not isinstance(arr, jax.Array):
      continue
    if arr.nbytes < DEVICE_MIN_BYTES and _host_copy_free(arr):
      # A write set holds each element once at most: hashed on the host.  (On
      # a GPU its parts may each fetch a whole replica: `host_fetch_bytes`.)
      continue
    # The programs depend on the leaf's layout only: worked out once per
    # layout (0.2-0.3 s a save for 400 leaves otherwise).
    layout = (arr.shape, arr.dtype, bool(getattr(arr, 'weak_type', False)), arr.sharding,
              jax.process_count())
    if layout not in _PROGRAMS_BY_LAYOUT:
      leaf = jax.random.key_data(arr) if tree_lib.is_prng_key(arr) else arr  # as `stored_values`
      _PROGRAMS_BY_LAYOUT[layout] = {way: frozenset(_leaf_programs(leaf, *how))
                                     for way, how in ways.items()}
    for way, k in _PROGRAMS_BY_LAYOUT[layout].items():
      keys[way] |= k
  return keys


_PROGRAMS_BY_LAYOUT: dict[tuple, dict[str, frozenset]] = {}


def _leaf_programs(arr: jax.Array, replica_parallel: bool, min_slice: int | None) -> set:
  """The program keys of one leaf cut one way."""
  pieces = _write_set(arr, 0, replica_parallel, min_slice, None)
  if _hashed_on_device(pieces, np.dtype(arr.dtype).itemsize):
    return fingerprint_lib.program_keys(pieces)
  return set()


def _write_set(arr: jax.Array, replica_id, use_replica_parallel, min_slice_bytes,
               max_replicas) -> list[tuple[Any, slicing.Box, slicing.Box]]:
  rslices = compat.orbax.get_replica_slices(
      arr, replica_id, use_replica_parallel, min_slice_bytes, max_replicas)
  out = []
  for rs in rslices.replica_slices:
    data = rs.unsliced_data
    src = [slice(0, n) for n in data.shape]
    if rs.slice_args is not None:
      a = rs.slice_args
      src[a.axis] = slice(a.start_index, a.limit_index)
    # `index` is the slice's own global region (for a replica-parallel part,
    # not its shard's): offset again, a second process recorded and copied
    # its neighbour's chunks, and the reusing checkpoint lacked its own.
    out.append((data, tuple(src), slicing.from_pairs(slicing.pairs(rs.index, arr.shape))))
  return out


class _RecordCache:
  """Records of live arrays, by object: the same live jax.Array has the same bytes."""

  def __init__(self):
    self._lock = threading.Lock()
    self._by_id: dict[int, tuple[Any, Record]] = {}

  def get(self, arr: jax.Array, base: dict[str, Any]) -> Record | None:
    with self._lock:
      hit = self._by_id.get(id(arr))
    if hit is None or hit[0]() is not arr or arr.is_deleted():
      return None
    rec = hit[1]
    same = all(getattr(rec, k) == v for k, v in base.items())
    return rec if same else None

  def put(self, arr: jax.Array, rec: Record) -> None:
    key = id(arr)

    def forget(_, key=key):
      with self._lock:
        self._by_id.pop(key, None)

    with self._lock:
      self._by_id[key] = (weakref.ref(arr, forget), rec)

  def __len__(self) -> int:
    return len(self._by_id)


_RECORDS = _RecordCache()


def fingerprint_leaves(handler, arrays, infos) -> list[Record]:
  """Each leaf's record: big ones hashed on device (all dispatched at once)."""
  sets = [write_set(handler, a) for a in arrays]
  records: list[Record | None] = []
  device_jobs = []
  for arr, pieces in zip(arrays, sets):
    itemsize = np.dtype(arr.dtype).itemsize
    nbytes = sum(slicing.nbytes(src, itemsize) for _, src, _ in pieces)
    boxes = tuple(sorted(slicing.pairs(g, arr.shape) for _, _, g in pieces))
    base = dict(dtype=np.dtype(arr.dtype).name, shape=tuple(int(n) for n in arr.shape),
                boxes=boxes, nbytes=nbytes)
    known = _RECORDS.get(arr, base)
    if known is not None:
      records.append(known)
    elif _hashed_on_device(pieces, itemsize):
      device_jobs.append((len(records), pieces, base))
      records.append(None)
    else:
      records.append(Record(fingerprint=_host_fingerprint(arr.dtype, pieces),
                            method='host', **base))
  fps = fingerprint_lib.fingerprint_many([p for _, p, _ in device_jobs])
  for (i, _, base), fp in zip(device_jobs, fps):
    records[i] = Record(fingerprint=fp, method='device', **base)
  for arr, rec in zip(arrays, records):
    _RECORDS.put(arr, rec)
  return records


def _host_fingerprint(dtype, pieces) -> str:
  """blake2b-128 over the dtype and each piece's global box and bytes."""
  total = 0
  for data, src, glob in pieces:
    h = hashlib.blake2b(digest_size=16, person=b'kd_ckpt.fph/1')
    h.update(np.dtype(dtype).name.encode() + b'\0')
    h.update(repr(slicing.pairs(glob, [s.stop for s in glob])).encode())
    h.update(np.ascontiguousarray(np.asarray(jax.device_get(data))[src]).tobytes())
    total += int.from_bytes(h.digest(), 'little')
  return f'{total % 2**128:032x}'


async def split(handler, arrays, infos, ctx) -> tuple[list[int], Any]:
  """(indices to write, reuse job or None); records every leaf's fingerprint.

  The job, called with the TensorStore context the save writes with, links
  the previous checkpoint's data files and copies the reused leaves' keys.
  """
  records = fingerprint_leaves(handler, arrays, infos)
  for info, rec in zip(infos, records):
    ctx.fingerprints.add(info.name, rec)
  source = ctx.reuse
  if source is None:
    return list(range(len(arrays))), None
  reused, write, changed_layout = [], [], 0
  for i, (info, rec) in enumerate(zip(infos, records)):
    prev = source.records.get(info.name)
    same_layout = prev is not None and (prev.dtype, prev.shape, prev.boxes, prev.method) == (
        rec.dtype, rec.shape, rec.boxes, rec.method)
    if same_layout and prev.fingerprint == rec.fingerprint and info.name in source.checksums:
      reused.append(i)
    else:
      write.append(i)
      changed_layout += prev is not None and not same_layout
  if changed_layout:
    _log_once(f'kd_ckpt {source.label}: {changed_layout} leaves changed shape, dtype or'
              ' sharding since the previous checkpoint: written in full.')
  # The save checked no free space for its arrays (which would be reused was
  # not known): check it for what is written, before writing it.
  storage.check_free_space(infos[0].parent_dir, sum(records[i].nbytes for i in write))
  if not reused:
    return write, None
  names = [infos[i].name for i in reused]
  sub = handler.target_subdir()
  db_dir = epath.Path(infos[0].parent_dir)
  if sub is not None:
    db_dir = db_dir / f'ocdbt.process_{sub}'
  try:
    link_checkpoint(source.directory, db_dir / LINK_DIR)
  except OSError as e:
    how = 'copy' if storage.is_remote(db_dir) else 'hard-link'
    _log_once(f'kd_ckpt {source.label}: writing every leaf, no reuse: cannot {how}'
              f' {source.directory} into {db_dir} ({e.strerror or e}; another'
              ' filesystem or bucket?).')
    storage.check_free_space(db_dir, sum(r.nbytes for r in records))
    return list(range(len(arrays))), None
  primary_host = compat.array_handler_options(handler).primary_host
  primary = primary_host is None or jax.process_index() == primary_host

  async def job(context: ts.Context, kvstore_spec: dict[str, Any]) -> None:
    await copy_leaves(db_dir, names, [records[i] for i in reused], primary, context,
                      kvstore_spec)
    for i in reused:
      name = infos[i].name
      if ctx.checksums is not None:
        ctx.checksums.add_record(source.checksums[name])
      ctx.stats.add_reused(records[i].nbytes)

  return write, job


def link_checkpoint(src: epath.Path, dst: epath.Path) -> int:
  """Links (local) or server-side copies (gs://) `src`'s OCDBT files under `dst`.

  The manifests and data files (`d/`) of every database in `src`, the
  reused links of earlier generations included; returns their bytes.
  """

  def ocdbt_file(rel: str) -> bool:
    parts = rel.split('/')
    if parts[0].startswith('array_metadatas'):
      return False
    return parts[-1] == 'manifest.ocdbt' or 'd' in parts[:-1]

  return storage.copy_files(src, dst, ocdbt_file)


_CHUNK_KEY = re.compile(r'^(?P<name>.+)/(?P<idx>\d+(?:\.\d+)*)$')


def kvstore_of(tspec: dict[str, Any]) -> dict[str, Any]:
  """The database part of an array's write spec (its OCDBT config included)."""
  node = tspec
  while 'kvstore' not in node:  # A cast driver wraps the zarr spec.
    node = node['base']
  kv = dict(node['kvstore'])
  kv.pop('path', None)
  return kv


async def copy_leaves(db_dir, names, records, primary: bool, context,
                      kvstore_spec: dict[str, Any]) -> None:
  """Copies each leaf's keys from the linked database, by reference.

  One process's leaf: the chunks inside its write boxes, plus the zarr
  metadata on the primary host (which writes metadata in stock Orbax too).
  The target is opened with the writer's own spec (Orbax's OCDBT config).
  """
  db_dir = epath.Path(db_dir)
  dst = await ts.KvStore.open(kvstore_spec, context=context)
  # The source must be the same kind of store as the target, one folder down,
  # for TensorStore to copy references rather than bytes.
  src = await ts.KvStore.open(_moved(kvstore_spec, LINK_DIR), context=context)
  txn = ts.Transaction(atomic=False)
  target = dst.with_transaction(txn)
  copies = []
  for name, rec in zip(names, records):
    keys = await src.list(ts.KvStore.KeyRange(f'{name}/'.encode(), f'{name}0'.encode()))
    meta = json.loads((await src.read(f'{name}/.zarray'.encode())).value)
    chunk = meta['chunks']
    for key in keys:
      k = key.decode()
      if k.endswith('/.zarray'):
        if primary:
          copies.append(key)
        continue
      m = _CHUNK_KEY.match(k)
      idx = [int(i) for i in m.group('idx').split('.')] if m else []
      if m and _inside(idx, chunk, rec.boxes):
        copies.append(key)
  for key in copies:
    await compat.tensorstore.copy_range_to(
        src, target, source_range=ts.KvStore.KeyRange(key, key + b'\0'))
  await txn.commit_async()


def _moved(kvstore_spec: dict[str, Any], subdir: str) -> dict[str, Any]:
  """`kvstore_spec` for the database in `subdir` of its folder (existing config)."""
  spec = {k: v for k, v in kvstore_spec.items()
          if k not in ('config', 'assume_config', 'target_data_file_size')}
  for key in ('base', 'manifest'):
    if isinstance(spec.get(key), dict) and 'path' in spec[key]:
      spec[key] = {**spec[key], 'path': spec[key]['path'].rstrip('/') + f'/{subdir}/'}
  return spec


def _inside(idx, chunk, boxes) -> bool:
  lo = [i * c for i, c in zip(idx, chunk)]
  return any(all(a <= l < b for l, (a, b) in zip(lo, box)) for box in boxes)


def prune(directory) -> None:
  """Deletes links no entry of the finished checkpoint refers to.

  Runs after Orbax's finalize (the root database is complete).  Walks the
  root's B-tree (`tensorstore.ocdbt.dump`) for every data file its nodes and
  values live in; any file under a `kd_ckpt.reuse/` folder not among them is
  removed, so a checkpoint keeps only the bytes it uses.
  """
  directory = epath.Path(directory)
  # Links live under a database's own LINK_DIR (`split`): without one, no
  # walk of every file (0.5 ms of a 10-leaf local save, a listing per
  # folder on a bucket).
  if not any((db / LINK_DIR).exists()
             for db in (directory, *directory.glob('ocdbt.process_*'))):
    return
  linked = [(rel, p) for rel, p in storage.files(directory) if LINK_DIR in rel.split('/')]
  if not linked:
    return
  try:
    used = referenced_files(directory)
  except UnparsedReferenceError as e:
    # Fail closed: a reference we cannot read may be to any linked file.
    # Keeping them all costs disk, never data.
    logging.warning('kd_ckpt: kept every reused file of %s (%s).', directory, e)
    return
  storage.remove_files(p for rel, p in linked if rel not in used)


def referenced_files(directory) -> set[str]:
  """Data files (relative to `directory`) the root OCDBT database refers to."""
  base = ts.KvStore.open(storage.kvstore_spec(directory)).result()
  manifest = compat.tensorstore.ocdbt_dump(base, None).result()
  used = set()
  todo = []
  for v in manifest.get('versions', []):
    todo.append(v['root'].get('location'))
  for node in manifest.get('version_tree_nodes', []):
    todo.append(node.get('location') if isinstance(node, dict) else node)
  seen = set()
  while todo:
    loc = todo.pop()
    if not loc or loc in seen:
      continue
    seen.add(loc)
    used.add(_file_of(loc))
    node = compat.tensorstore.ocdbt_dump(base, loc).result()
    for e in node.get('entries', []):
      if 'indirect_value' in e:
        used.add(_file_of(e['indirect_value']))
      if 'location' in e:  # an interior node's child
        todo.append(e['location'])
      if 'node' in e:
        todo.append(e['node'].get('location') if isinstance(e['node'], dict) else e['node'])
  return {u for u in used if u}


class UnparsedReferenceError(ValueError):
  """`ocdbt.dump` gave a location this version of kd_ckpt cannot read."""


def _file_of(location: str) -> str:
  """'value:<base>:<file>:<off>:<len>' or 'btreenode:<base>:<file>:...' -> '<base><file>'.

  Raises:
    UnparsedReferenceError: any other shape (TensorStore's dump is
      experimental): `prune` then deletes nothing.
  """
  parts = location.split(':') if isinstance(location, str) else []
  if len(parts) < 3 or parts[0] not in ('value', 'btreenode', 'versionnode') or not parts[2]:
    raise UnparsedReferenceError(
        f'unrecognised OCDBT location {location!r} from tensorstore.ocdbt.dump')
  return posixpath.normpath(parts[1] + parts[2])
