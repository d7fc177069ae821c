"""One process of the multi-process tests (tests/test_multiprocess.py).

  python -m tests.mp_worker save    WORKDIR STRATEGY BUDGET PROCESS_ID NUM_PROCESSES PORT
  python -m tests.mp_worker restore WORKDIR...
  python -m tests.mp_worker fuzz OP PATH STATE ...   (tools/fuzz_budget.py --processes N)

`save`: one of NUM_PROCESSES JAX processes (4 fake CPU devices each) joined by
`jax.distributed.initialize` on 127.0.0.1:PORT.  Every process builds the
same global state on a mesh over all global devices, saves it with
`kd_ckpt.SafeCheckpointer` at step 1, restores it (through the checkpointer
and through `kd_ckpt.restore`) and checks its own shards bit-exact.

`restore`: a single process (8 fake CPU devices) restores those checkpoints
onto a different mesh, through `kd_ckpt.restore`, stock Orbax and the
checkpointer, and checks every leaf bit-exact against the deterministic state.

Each prints one JSON line last.  The values are a hash of the global element
index, so any process can compute any slice without communicating.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

MiB = 1 << 20
CKPT_STEP = 1
# name: (shape, dtype, sharding kind, seed).  'x8': split over all 8 global
# devices; 'rep': replicated on all 8 (4 replicas on each process);
# 'b_rep_a': split 4 ways over mesh axis 'b', replicated over 'a' -- the two
# replicas of each shard live on different processes.
LEAVES = {
    'replicated': ((4096, 2048), 'float32', 'rep', 1),      # 32 MiB
    'sharded': ((8192, 2048), 'float32', 'x8', 2),          # 64 MiB
    'bf16': ((4096, 2048), 'bfloat16', 'b_rep_a', 3),       # 16 MiB
    'scalar': ((), 'float32', 'rep', 4),
    'count': ((), 'int32', 'rep', 5),
}


def _dtype(name: str):
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  return np.dtype(ml_dtypes.bfloat16) if name == 'bfloat16' else np.dtype(name)


def values(shape, dtype_name: str, seed: int, index=None) -> np.ndarray:
  """The slice `index` of leaf (shape, dtype, seed): a hash of the flat index."""
  index = index if index is not None else tuple(slice(None) for _ in shape)
  ranges = [np.arange(n, dtype=np.uint32)[s] for s, n in zip(index, shape)]
  x = np.full([len(r) for r in ranges], np.uint32(seed * 0x9E3779B9 % 2**32))
  stride = 1
  for axis in reversed(range(len(shape))):  # + flat index; uint32 wraps
    x += ranges[axis].reshape([-1] + [1] * (len(shape) - 1 - axis)) * np.uint32(stride)
    stride *= shape[axis]
  x *= np.uint32(2654435761)
  x ^= x >> np.uint32(15)
  x *= np.uint32(0x85EBCA6B)
  x ^= x >> np.uint32(13)
  bits = x
  dtype = _dtype(dtype_name)
  if dtype == np.float32:  # finite, sign and 23 random mantissa bits
    return ((bits & 0x807FFFFF) | 0x3F800000).view(np.float32)
  if dtype.itemsize == 2:  # bfloat16, likewise
    return (((bits >> 16) & 0x807F) | 0x3F80).astype(np.uint16).view(dtype)
  return bits.view(np.int32).astype(dtype)


def _shardings(devices, kind: str):
  import jax  # pylint: disable=g-import-not-at-top
  P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding  # pylint: disable=invalid-name
  devs = np.array(devices)
  m1 = jax.sharding.Mesh(devs.reshape(len(devs)), ('x',))
  m2 = jax.sharding.Mesh(devs.reshape(2, len(devs) // 2), ('a', 'b'))
  return {'rep': NS(m1, P()), 'x8': NS(m1, P('x')), 'b_rep_a': NS(m2, P('b'))}[kind]


def build_state():
  """The global state, built shard by shard on this process's devices."""
  import jax  # pylint: disable=g-import-not-at-top
  tree = {}
  for name, (shape, dt, kind, seed) in LEAVES.items():
    sharding = _shardings(jax.devices(), kind)
    tree[name] = jax.make_array_from_callback(
        shape, sharding, lambda idx, s=shape, d=dt, sd=seed: values(s, d, sd, idx))
  return jax.block_until_ready(tree)


def check_shards(tree, label: str) -> None:
  """Every addressable shard of every leaf equals the deterministic values."""
  for name, (shape, dt, _, seed) in LEAVES.items():
    leaf = tree[name]
    assert leaf.shape == shape and np.dtype(leaf.dtype) == _dtype(dt), (label, name)
    for shard in leaf.addressable_shards:
      got = np.asarray(shard.data)
      want = values(shape, dt, seed, shard.index)
      if got.tobytes() != want.tobytes():
        raise AssertionError(f'{label}: leaf {name!r} shard {shard.index} differs')


def _kvstore(path: str):
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  return ts.KvStore.open({
      'driver': 'ocdbt', 'base': {'driver': 'file', 'path': os.path.join(path, '')},
  }).result()


def per_process_writes(item_dir: str) -> dict:
  """{process db: {leaf: {'chunks': [keys], 'raw_bytes', 'stored_bytes'}}}.

  Each process writes its part of every array into its own OCDBT database,
  `ocdbt.process_<i>`; Orbax's finalize merges their manifests into the root
  database and leaves the per-process databases (and their data) in place.
  So what each process wrote is what its database holds.  `raw_bytes` is the
  uncompressed size of its chunks, from the grid in the root's `.zarray`.
  """
  root = _kvstore(item_dir)
  grids = {}
  for key in root.list().result():
    leaf, _, rest = key.decode().partition('/')
    if rest == '.zarray':
      meta = json.loads(root.read(key).result().value)
      grids[leaf] = (meta['shape'], meta['chunks'], np.dtype(meta['dtype']).itemsize)
  out = {}
  for sub in sorted(os.listdir(item_dir)):
    if not sub.startswith('ocdbt.process_'):
      continue
    kv = _kvstore(os.path.join(item_dir, sub))
    per_leaf = {}
    for key in kv.list().result():
      leaf, _, rest = key.decode().partition('/')
      if rest.startswith('.'):  # .zarray / .zattrs: metadata, not data
        continue
      shape, chunks, itemsize = grids[leaf]
      pos = [int(i) for i in rest.split('.')] if shape else []
      raw = itemsize * int(np.prod(
          [min(c, n - i * c) for i, c, n in zip(pos, chunks, shape)]))
      d = per_leaf.setdefault(leaf, {'chunks': [], 'raw_bytes': 0, 'stored_bytes': 0})
      d['chunks'].append(rest)
      d['raw_bytes'] += raw
      d['stored_bytes'] += len(kv.read(key).result().value)
    out[sub] = per_leaf
  return out


def _state_class():
  from kauldron import kd  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top

  @flax.struct.dataclass
  class State(kd.ckpts.items.StandardCheckpointItem):
    params: dict

  return State


def _join(pid: int, nproc: int, port) -> None:
  """Joins this process to the others on 127.0.0.1:PORT (`jax.distributed`)."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.initialize(
      coordinator_address=f'127.0.0.1:{port}', num_processes=nproc, process_id=pid,
      initialization_timeout=120)


def _save(argv) -> dict:
  workdir, strategy, budget, pid, nproc, port = argv
  pid, nproc = int(pid), int(nproc)
  import jax  # pylint: disable=g-import-not-at-top
  _join(pid, nproc, port)
  assert jax.process_index() == pid and jax.process_count() == nproc
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  # A training process has compiled its step before it saves or restores;
  # a cold process is test_budget.py's first-jit test.
  startup.start_compiler()
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top

  State = _state_class()  # pylint: disable=invalid-name
  t0 = time.monotonic()
  state = State(params=build_state())
  out = {'process_index': pid, 'local_devices': len(jax.local_devices()),
         'global_devices': jax.device_count(), 'build_secs': time.monotonic() - t0}
  # A training job has run cross-process computations long before its first
  # save; the first one sets up the CPU collectives (~27 MiB, once).
  multihost_utils.sync_global_devices('kd_ckpt_mp_test_warm_up')

  ckpt = kd_ckpt.SafeCheckpointer(
      workdir=workdir, save_interval_steps=1,
      host_ram_budget=int(budget) if budget.isdigit() else budget,
      strategy=strategy)
  hostmem.release_free_memory()
  # The report's peak ends when save() returns, while an async Orbax save
  # goes on writing in the background: this outer measure lasts until the
  # step is committed on every process.  (The report's PeakRss resets VmHWM
  # when its save starts, so the planning before that counts here only by
  # what it leaves resident.)
  with hostmem.PeakRss() as whole:
    t0 = time.monotonic()
    saved = ckpt.save(state, step=CKPT_STEP)
    ckpt.wait_until_finished()
    out['save_secs'] = time.monotonic() - t0
  assert saved is not False
  out['report'] = ckpt.reports[-1].to_json_dict()
  out['whole_save_peak_extra_bytes'] = whole.extra_bytes
  out['whole_save_exact'] = whole.exact
  out['local_process_count'] = hostmem.local_process_count()
  out['available_bytes'] = hostmem.probe().available_bytes

  multihost_utils.sync_global_devices('kd_ckpt_mp_test_saved')
  step_dir = os.path.join(workdir, 'checkpoints', f'ckpt_{CKPT_STEP}')
  if pid == 0:
    out['per_process_writes'] = per_process_writes(os.path.join(step_dir, 'default'))
    out['step_dir_files'] = sorted(os.listdir(step_dir))

  # Restore on every process, into the saved shardings: Kauldron's path
  # (Orbax's CheckpointManager) and kd_ckpt's budgeted reader.
  abstract = State(params=jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params))
  back = ckpt.restore(abstract, step=CKPT_STEP)
  check_shards(back.params, 'SafeCheckpointer.restore')
  del back
  back = kd_ckpt.restore(os.path.join(step_dir, 'default'), abstract,
                         host_ram_budget=int(budget) if budget.isdigit() else budget)
  check_shards(back.params, 'kd_ckpt.restore')
  del back
  ckpt.close()
  multihost_utils.sync_global_devices('kd_ckpt_mp_test_restored')
  return out


def _restore(workdirs) -> dict:
  """One process, 8 devices, another mesh: three readers, every leaf checked."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  # A training process has compiled its step before it saves or restores;
  # a cold process is test_budget.py's first-jit test.
  startup.start_compiler()
  P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding  # pylint: disable=invalid-name
  assert jax.process_count() == 1 and jax.device_count() == 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('u', 'v'))
  new = {  # Every leaf laid out differently from the save.
      'replicated': NS(mesh, P('v', 'u')),
      'sharded': NS(mesh, P(None, ('u', 'v'))),
      'bf16': NS(mesh, P()),
      'scalar': NS(mesh, P()),
      'count': jax.sharding.SingleDeviceSharding(jax.devices()[3]),
  }
  # The saved item is a `State(params=...)`: same names as {'params': ...}.
  params = {k: jax.ShapeDtypeStruct(shape, _dtype(dt), sharding=new[k])
            for k, (shape, dt, _, _) in LEAVES.items()}
  expected = {k: values(shape, dt, seed).tobytes()
              for k, (shape, dt, _, seed) in LEAVES.items()}
  State = _state_class()  # pylint: disable=invalid-name
  done = []
  for workdir in workdirs:
    item = os.path.join(workdir, 'checkpoints', f'ckpt_{CKPT_STEP}', 'default')
    readers = {
        'kd_ckpt.restore': lambda: kd_ckpt.restore(
            item, {'params': params}, host_ram_budget=64 * MiB)['params'],
        'ocp.StandardCheckpointer': lambda: ocp.StandardCheckpointer().restore(
            item, {'params': params})['params'],
        'SafeCheckpointer.restore': lambda: kd_ckpt.SafeCheckpointer(
            workdir=workdir, save_interval_steps=1).restore(
                State(params=params), step=CKPT_STEP).params,
    }
    for label, read in readers.items():
      back = read()
      for k, (shape, dt, _, _) in LEAVES.items():
        assert back[k].sharding.is_equivalent_to(new[k], len(shape)), (label, k, back[k].sharding)
        got = np.asarray(back[k])
        if got.dtype != _dtype(dt) or got.tobytes() != expected[k]:
          raise AssertionError(f'{workdir}: {label}: leaf {k!r} differs')
      del back
      done.append(f'{workdir}: {label}')
    # One process verifies what two processes wrote: every leaf's CRC32C
    # records (both processes') found and matching.
    result = kd_ckpt.verify(item)
    names = sorted(r.path for r in result.leaves)
    assert names == sorted(f'params.{k}' for k in LEAVES), names
    assert result.ok and all(r.status == 'ok' for r in result.leaves), str(result)
    assert result.checked_bytes == sum(len(b) for b in expected.values()), str(result)
    done.append(f'{workdir}: kd_ckpt.verify')
  return {'checked': done}


def _save_api(argv) -> dict:
  """`kd_ckpt.save` of the global state from every process, then restores on each.

  PATH may be a gs:// URL (tests/test_object_storage.py); both processes
  write one checkpoint, each its own OCDBT database, merged by process 0.
  """
  path, strategy, budget, pid, nproc, port = argv
  pid, nproc = int(pid), int(nproc)
  import jax  # pylint: disable=g-import-not-at-top
  _join(pid, nproc, port)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  startup.start_compiler()
  startup.start_storage(path)
  state = build_state()
  multihost_utils.sync_global_devices('kd_ckpt_mp_api_warm_up')
  report = kd_ckpt.save(path, state, strategy=strategy,
                        host_ram_budget=int(budget) if budget.isdigit() else budget)
  multihost_utils.sync_global_devices('kd_ckpt_mp_api_saved')
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  check_shards(kd_ckpt.restore(path, abstract, host_ram_budget=report.budget_bytes),
               'kd_ckpt.restore')
  with ocp.StandardCheckpointer() as c:
    check_shards(c.restore(path, abstract), 'stock Orbax restore')
  multihost_utils.sync_global_devices('kd_ckpt_mp_api_restored')
  return {'process_index': pid, 'report': report.to_json_dict()}


def _save_shapes(argv) -> dict:
  """`kd_ckpt.save` (auto) of LEAVES replicated leaves of as many shapes, measured.

  PATH may be a gs:// URL (tests/test_object_storage.py).

  Data-parallel training replicates every parameter on every process; with
  replica parallelism each process cuts its replicas' slices of each shape
  with a program of its own (`estimate.slice_program_key`).  The peak is
  taken from outside kd_ckpt (VmHWM around the call), then each process
  restores and checks its shards.
  """
  path, budget, pid, nproc, port, num_leaves = argv
  pid, nproc = int(pid), int(nproc)
  import jax  # pylint: disable=g-import-not-at-top
  _join(pid, nproc, port)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  startup.start_compiler()
  startup.start_storage(path)  # a gs:// PATH: the storage client's start-up, paid before
  sharding = _shardings(jax.devices(), 'rep')
  shapes = {f'r{i}': (8 * (40 + i), 64 + 8 * i) for i in range(int(num_leaves))}
  state = jax.block_until_ready({
      k: jax.make_array_from_callback(s, sharding, lambda idx, s=s, i=i: values(s, 'float32', i, idx))
      for i, (k, s) in enumerate(shapes.items())})
  multihost_utils.sync_global_devices('kd_ckpt_mp_shapes_warm_up')
  import gc  # pylint: disable=g-import-not-at-top
  gc.collect()
  hostmem.release_free_memory()
  before = hostmem.current_rss_bytes()
  hostmem.reset_peak_rss()
  report = kd_ckpt.save(path, state, strategy='auto', host_ram_budget=int(budget))
  peak = hostmem.peak_rss_bytes() - before
  multihost_utils.sync_global_devices('kd_ckpt_mp_shapes_saved')
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  back = kd_ckpt.restore(path, abstract, host_ram_budget=int(budget))
  for i, (k, s) in enumerate(shapes.items()):
    for shard in back[k].addressable_shards:
      if np.asarray(shard.data).tobytes() != values(s, 'float32', i, shard.index).tobytes():
        raise AssertionError(f'leaf {k!r} shard {shard.index} differs')
  multihost_utils.sync_global_devices('kd_ckpt_mp_shapes_restored')
  return {'process_index': pid, 'peak_extra_bytes': peak, 'report': report.to_json_dict()}


def _save_reuse(argv) -> dict:
  """Two `kd_ckpt.save`s, the second of the global state, reusing the first.

  The first saves the state with its fully replicated leaves zeroed (zero
  chunks, each process its replica-parallel part), the second the state
  itself: each process fingerprints its own shards (one device program per
  leaf shape over its 4 devices, `fingerprint._spmd_lane_sums`), reuses the
  unchanged leaves (the sharded one, and the one whose replicas the
  processes split) and writes the others.  Both checkpoints restore
  bit-exact on both processes.
  """
  path, strategy, budget, pid, nproc, port = argv
  pid, nproc = int(pid), int(nproc)
  import jax  # pylint: disable=g-import-not-at-top
  _join(pid, nproc, port)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem, reuse, startup  # pylint: disable=g-import-not-at-top
  startup.start_compiler()
  state = build_state()
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  # Zeroed: the leaves replicated everywhere.  Kept: 'sharded' and 'bf16',
  # whose replicas the two processes split (each writes half of a shard):
  # reusing 'bf16' is what lost the second process's chunks before.
  zeroed = [n for n, (_, _, kind, _) in LEAVES.items() if kind == 'rep']
  prev = {**state, **{n: jax.jit(jax.numpy.zeros_like, out_shardings=state[n].sharding)(state[n])
                      for n in zeroed}}
  programs = reuse.fingerprint_programs(state)
  out = {'process_index': pid, 'programs': programs, 'saves': []}
  for name, item, reuse_from in (('a', prev, None), ('b', state, 'a')):
    multihost_utils.sync_global_devices(f'kd_ckpt_mp_reuse_{name}')
    with hostmem.PeakRss() as peak:
      report = kd_ckpt.save(os.path.join(path, name), item, strategy=strategy,
                            host_ram_budget=int(budget), fingerprint=True,
                            reuse_from=reuse_from and os.path.join(path, reuse_from))
    out['saves'].append({'peak_extra_bytes': peak.extra_bytes,
                         'leaves_reused': report.leaves_reused})
    multihost_utils.sync_global_devices(f'kd_ckpt_mp_reuse_{name}_saved')
    back = kd_ckpt.restore(os.path.join(path, name), abstract, host_ram_budget=int(budget))
    if item is prev:
      for n in zeroed:
        assert all(not np.asarray(s.data).any() for s in back[n].addressable_shards), n
      back = {**back, **{n: state[n] for n in zeroed}}
    check_shards(back, f'restore of {name}')
  out['programs_after'] = reuse.fingerprint_programs(state)
  multihost_utils.sync_global_devices('kd_ckpt_mp_reuse_done')
  return out


def _preflight_one(argv) -> dict:
  """A `plan_save` preflight on process 1 only, then saves on both.

  The preflight waits for process 0, which never comes: it must time out
  with a clear error, and must not shift the exchanges of the saves after it.
  """
  path, pid, nproc, port = argv
  pid, nproc = int(pid), int(nproc)
  import jax  # pylint: disable=g-import-not-at-top
  _join(pid, nproc, port)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import exchange  # pylint: disable=g-import-not-at-top
  state = build_state()
  out = {'process_index': pid}
  if pid == 1:
    exchange.TIMEOUT_SECS = 5  # how long the preflight waits for process 0
    try:
      kd_ckpt.plan_save(state, host_ram_budget=96 * MiB)
    except exchange.ExchangeTimeoutError as e:
      out['preflight_error'] = str(e)
    else:
      raise AssertionError('a preflight on one process only did not time out')
  multihost_utils.sync_global_devices('kd_ckpt_mp_preflight_done')
  exchange.TIMEOUT_SECS = 60
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  for i, budget in enumerate([96 * MiB, 'auto']):
    target = f'{path}/{i}'
    report = kd_ckpt.save(target, state, host_ram_budget=budget)
    multihost_utils.sync_global_devices(f'kd_ckpt_mp_preflight_saved_{i}')
    check_shards(kd_ckpt.restore(target, abstract, host_ram_budget=96 * MiB),
                 'kd_ckpt.restore')
    out[f'budget_{i}'] = report.budget_bytes
  multihost_utils.sync_global_devices('kd_ckpt_mp_preflight_restored')
  return out


def _fuzz(argv) -> dict:
  """One process of a drawn case of `tools/fuzz_budget.py --processes N`.

    fuzz OP PATH STATE TOTAL_BYTES STRATEGY BUDGET PROCESS_ID NUM_PROCESSES PORT

  OP `save`: `kd_ckpt.save(strategy=STRATEGY)` of `tests.states.drawn`'s
  state (`mixed`'s for STATE `mixed:SEED`) over all processes' devices, measured in this process (VmHWM);
  `reuse`: as `tests.states`' worker `reuse` (PATH.prev, the state with every
  other array leaf zeroed, saved with fingerprints; then PATH reusing it),
  the larger of the two saves' peaks;
  `stock`: Orbax's default save, unmeasured; `restore`: `kd_ckpt.restore`
  onto the saved layouts (or others: KD_TEST_RESHARD=SEED; onto custom
  device-local layouts: KD_TEST_LAYOUT=SEED), its peak beyond
  this process's restored shards, every shard checked bit-exact against the
  drawn values.  A `BudgetTooSmallError` is returned as `error`.
  """
  op, path, state, total, strategy, budget, pid, nproc, port = argv
  pid, nproc, total = int(pid), int(nproc), int(total)
  import hashlib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  _join(pid, nproc, port)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top
  from kd_ckpt import limiter  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  from tests import states  # pylint: disable=g-import-not-at-top
  if os.environ.get('KD_TEST_STALL_SECS'):
    limiter.STALL_SECS = float(os.environ['KD_TEST_STALL_SECS'])
  seed = int(state.split(':', 1)[1])
  as_budget = lambda b: int(b) if b.isdigit() else b
  startup.start_storage(path)
  # Cross-process computations have run long before a save (the CPU
  # collectives' set-up, ~27 MiB once, is not the save's).
  multihost_utils.sync_global_devices('kd_fuzz_warm_up')
  out = {'process_index': pid}
  is_mixed = state.startswith('mixed:')
  if op == 'reuse':
    from etils import epath  # pylint: disable=g-import-not-at-top
    tree = states.mixed(seed, total) if is_mixed else states.drawn(seed, total)
    prev = states.every_other_leaf_zeroed(tree)
    if pid == 0 and epath.Path(path + '.prev').exists():  # left by a refused attempt
      epath.Path(path + '.prev').rmtree()
    multihost_utils.sync_global_devices('kd_fuzz_prev_cleared')
    peaks = []
    for target, item, reuse_from in ((path + '.prev', prev, None), (path, tree, path + '.prev')):
      states._settle()  # pylint: disable=protected-access
      with hostmem.PeakRss() as peak:
        try:
          r = kd_ckpt.save(target, item, strategy=strategy, host_ram_budget=as_budget(budget),
                           fingerprint=True, reuse_from=reuse_from)
        except kd_ckpt.BudgetTooSmallError as e:
          out['error'] = f'BudgetTooSmallError: {e}'
      peaks.append(peak.extra_bytes)
      if 'error' in out:
        break
      out['report'] = r.to_json_dict()
    out['peak_extra_bytes'] = max(peaks)
    out['peaks'] = peaks
    multihost_utils.sync_global_devices('kd_fuzz_saved')
    return out
  if op in ('save', 'stock'):
    tree = states.mixed(seed, total) if is_mixed else states.drawn(seed, total)
    jax.block_until_ready(tree)
    states._settle()  # pylint: disable=protected-access
    with hostmem.PeakRss() as peak:
      try:
        if op == 'stock':
          with ocp.StandardCheckpointer() as c:
            c.save(path, tree)
            c.wait_until_finished()
        else:
          out['report'] = kd_ckpt.save(path, tree, strategy=strategy,
                                       host_ram_budget=as_budget(budget)).to_json_dict()
      except kd_ckpt.BudgetTooSmallError as e:
        out['error'] = f'BudgetTooSmallError: {e}'
    out['peak_extra_bytes'] = peak.extra_bytes
    multihost_utils.sync_global_devices('kd_fuzz_saved')
    return out
  assert op == 'restore', op
  if os.environ.get('KD_TEST_WARM') == '1':
    startup.start_compiler()
  want, abstract, layouts = {}, {}, {}
  if os.environ.get('KD_TEST_RESHARD'):  # every leaf's shape, then the layouts
    shapes = {name: host.shape for name, host, _ in states.drawn_on_host(seed, total)}
    layouts = states.redrawn_shardings(shapes, int(os.environ['KD_TEST_RESHARD']))
  for name, host, sharding in states.drawn_on_host(seed, total):
    sharding = layouts.get(name, sharding)
    abstract[name] = jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)
    for device, index in sharding.addressable_devices_indices_map(host.shape).items():
      want[f'{name}@{device.id}'] = hashlib.sha256(
          np.ascontiguousarray(host[index]).reshape(-1).view(np.uint8)).hexdigest()
    del host
  formats = {}
  if os.environ.get('KD_TEST_LAYOUT'):  # onto custom layouts (support_layout)
    abstract, formats = states.custom_layouts(abstract, int(os.environ['KD_TEST_LAYOUT']))
  if is_mixed:
    # Keys, numpy arrays and scalars beside the drawn arrays: restored as
    # saved, checked by their (addressable) shards' digests.
    extra = states.mixed_extra(seed, total)
    abstract = {'arrays': abstract, 'extra': states.abstract_of(extra)}
    want_extra = states._digests({'extra': extra})  # pylint: disable=protected-access
    del extra
  states._settle()  # pylint: disable=protected-access
  with hostmem.PeakRss() as peak:
    try:
      back = kd_ckpt.restore(path, abstract, host_ram_budget=as_budget(budget),
                             support_layout=bool(formats))
      jax.block_until_ready(back)
    except kd_ckpt.BudgetTooSmallError as e:
      out['error'] = f'BudgetTooSmallError: {e}'
      back = None
  out['peak_extra_bytes'] = peak.extra_bytes
  if back is not None:
    out['restored_bytes'] = states.resident_bytes(back)
    arrays = back['arrays'] if is_mixed else back
    for name, x in arrays.items():
      want_layout = formats.get(jax.tree_util.keystr((jax.tree_util.DictKey(name),)))
      if want_layout is not None and x.format.layout.major_to_minor != want_layout:
        raise SystemExit(f'{name} came back in layout {x.format.layout.major_to_minor},'
                         f' not {want_layout}')
    got = {f'{name}@{sh.device.id}': hashlib.sha256(
        np.ascontiguousarray(np.asarray(sh.data)).reshape(-1).view(np.uint8)).hexdigest()
           for name, x in arrays.items() for sh in x.addressable_shards}
    if is_mixed:
      got_extra = states._digests({'extra': back['extra']})  # pylint: disable=protected-access
      bad = sorted(k for k in want_extra if got_extra.get(k) != want_extra[k])
      if bad or set(got_extra) != set(want_extra):
        raise SystemExit(f'restored keys, host arrays or scalars differ: {bad[:5]}'
                         f' {sorted(set(got_extra) ^ set(want_extra))[:5]}')
    if got != want:
      bad = sorted(k for k in want if got.get(k) != want[k])
      raise SystemExit(f'restored values differ from the saved ones: {bad[:5]}')
  multihost_utils.sync_global_devices('kd_fuzz_restored')
  return out


if __name__ == '__main__':
  mode, rest = sys.argv[1], sys.argv[2:]
  try:
    result = {'save': _save, 'restore': _restore, 'save_api': _save_api,
              'save_reuse': _save_reuse, 'save_shapes': _save_shapes,
              'preflight_one': _preflight_one, 'fuzz': _fuzz}[mode](rest)
  except BaseException as e:  # pylint: disable=broad-exception-caught
    if isinstance(e, SystemExit) and e.code in (None, 0):
      raise
    # Exit now: a normal exit runs jax.distributed's shutdown, which waits
    # for the other processes, and they wait at a barrier for this one, so
    # the harness saw a timeout, not this error.
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access
  print(json.dumps(result))
