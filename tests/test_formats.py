"""Every on-disk format restores bit-exact, or is refused cleanly, at any budget.

The checkpoints are written here, by the installed Orbax, with the options
that Orbax releases have defaulted to or offered over time:

  ocdbt-zarr2-zstd   StandardCheckpointer's default (Orbax >= 0.5)
  ocdbt-zarr2-raw    use_compression=False
  ocdbt-zarr3-zstd   use_zarr3=True
  ocdbt-zarr3-1mib   use_zarr3=True, SaveArgs(chunk_byte_size=1 MiB): many chunks
  plain-zarr2-zstd   use_ocdbt=False: a folder per array (Orbax < 0.5's default)
  plain-zarr3-raw    use_ocdbt=False, use_zarr3=True, raw
  kd-streaming       kd_ckpt's own writer

The tree has a 32 MiB leaf stored as one chunk (far bigger than a restore
piece at the small budgets), a leaf sharded 8 ways with a prime extent, a
replicated bf16 leaf with prime extents, a 0-d leaf, a numpy leaf, an int4
leaf of one 8 MiB chunk and a float8 leaf sharded 8 ways.  Each
is restored by `kd_ckpt.restore` at budgets from below the smallest kd_ckpt
honours to far above it.  Two outcomes only: every leaf bit for bit, with
the call's peak extra RSS minus the restored arrays within the budget (a
warm process, as a resuming job is; test_budget.py measures fresh ones); or
`BudgetTooSmallError` before anything is read.  The table is printed and
written to build/format_budget_table.md.
"""

from __future__ import annotations

import math
import pathlib
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import kd_ckpt
from kd_ckpt import hostmem
from kd_ckpt import startup
from tests import states

MiB = 1 << 20
TOLERANCE = 8 * MiB
BUDGETS = (16 * MiB, 40 * MiB, 96 * MiB, 1024 * MiB)
FORMATS = ('ocdbt-zarr2-zstd', 'ocdbt-zarr2-raw', 'ocdbt-zarr3-zstd', 'ocdbt-zarr3-1mib',
           'plain-zarr2-zstd', 'plain-zarr3-raw', 'kd-streaming')
REPO = pathlib.Path(__file__).resolve().parents[1]


def _tree():
  mesh = Mesh(np.array(jax.devices()), ('x',))
  rng = np.random.default_rng(19)
  return {
      'big': jax.device_put(rng.standard_normal((4096, 2048), np.float32),
                            jax.devices()[0]),                         # 32 MiB, one chunk
      'sharded': jax.device_put(rng.standard_normal((1032, 257), np.float32),
                                NamedSharding(mesh, P('x'))),
      'bf16': jax.device_put(jnp.asarray(rng.standard_normal((509, 263)), jnp.bfloat16),
                             NamedSharding(mesh, P())),
      'count': jnp.int32(7),
      'host': np.arange(1000, dtype=np.int64),
      # Quantized weights: TensorStore stores them a byte an element, as
      # numpy holds them.  The int4 leaf is one chunk, bigger than a piece.
      'int4': jax.device_put(rng.integers(-8, 8, (2048, 4099)).astype(ml_dtypes.int4),
                             jax.devices()[1]),
      'fp8': jax.device_put(rng.standard_normal((1032, 257)).astype(ml_dtypes.float8_e4m3fn),
                            NamedSharding(mesh, P('x'))),
  }


def _write(fmt: str, directory: pathlib.Path, tree) -> None:
  if fmt == 'kd-streaming':
    kd_ckpt.save(directory, tree, strategy='streaming', host_ram_budget='96MiB')
    return
  if fmt == 'ocdbt-zarr2-zstd':
    with ocp.StandardCheckpointer() as c:
      c.save(directory, tree)
    return
  ocdbt, zarr, codec = fmt.split('-')
  save_args = None
  if codec == '1mib':
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=MiB), tree)
  handler = ocp.PyTreeCheckpointHandler(
      use_ocdbt=ocdbt == 'ocdbt', use_zarr3=zarr == 'zarr3',
      use_compression=codec in ('zstd', '1mib'))
  with ocp.Checkpointer(handler) as c:
    c.save(directory, args=ocp.args.PyTreeSave(tree, save_args=save_args))


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  startup.start_compiler()  # a process that has compiled (the cold case: test_budget.py)
  tree = _tree()
  root = tmp_path_factory.mktemp('formats')
  for fmt in FORMATS:
    _write(fmt, root / fmt, tree)
  expected = {k: (np.asarray(v).dtype, np.asarray(v).tobytes()) for k, v in tree.items()}
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, tree)
  # One restore of each format first: what the restore compiles (per shape
  # and sharding) is paid once per process, as in a training job.
  for fmt in FORMATS:
    kd_ckpt.restore(root / fmt, abstract, host_ram_budget='1GiB')
  return root, abstract, expected


@pytest.fixture(scope='module')
def table():
  rows: dict[tuple[str, int], str] = {}
  yield rows
  head = '| format | ' + ' | '.join(f'{b // MiB} MiB' for b in BUDGETS) + ' |'
  lines = [head, '|' + ' --- |' * (len(BUDGETS) + 1)]
  for fmt in FORMATS:
    lines.append(f'| {fmt} | ' + ' | '.join(rows.get((fmt, b), 'not run') for b in BUDGETS)
                 + ' |')
  text = '\n'.join(lines)
  print('\nkd_ckpt.restore in a warm process: peak extra RSS of the call, restored'
        ' arrays included (the CPU backend may place them in memory freed by an'
        ' earlier restore, so "peak - arrays" can be negative; the fresh-process'
        ' budget bounds are test_budget.py\'s):\n' + text)
  (REPO / 'build').mkdir(exist_ok=True)
  (REPO / 'build' / 'format_budget_table.md').write_text(text + '\n')


def _restored_bytes(tree) -> int:
  """What the restored arrays themselves occupy in host memory (CPU backend)."""
  total, buffers = 0, {}
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      # Once per buffer: replicas restored from one host buffer share it.
      buffers.update({s.data.unsafe_buffer_pointer(): s.data.nbytes
                      for s in leaf.addressable_shards})
    else:
      total += np.asarray(leaf).nbytes
  return total + sum(buffers.values())


@pytest.mark.parametrize('budget', BUDGETS, ids=[f'{b // MiB}MiB' for b in BUDGETS])
@pytest.mark.parametrize('fmt', FORMATS)
def test_restores_bit_exact_or_refuses_cleanly(saved, table, fmt, budget):
  root, abstract, expected = saved
  hostmem.release_free_memory()
  try:
    with hostmem.PeakRss() as peak:
      back = kd_ckpt.restore(root / fmt, abstract, host_ram_budget=budget)
  except kd_ckpt.BudgetTooSmallError as e:
    assert f'{budget}' in str(e) or f'{budget // MiB}' in str(e), str(e)
    need = re.search(r"Raise host_ram_budget to '(\d+[MG]iB)' or more", str(e))
    assert need, str(e)
    table[(fmt, budget)] = f'refused: needs {need.group(1) if need else "?"}'
    return
  assert sorted(back) == sorted(expected)
  for k, (dtype, raw) in expected.items():
    got = np.asarray(back[k])
    assert got.dtype == dtype and got.tobytes() == raw, f'{fmt} @ {budget // MiB} MiB: {k}'
  arrays = _restored_bytes(back)
  table[(fmt, budget)] = (f'bit-exact, peak +{peak.extra_bytes / MiB:.0f} MiB'
                          f' ({arrays / MiB:.0f} MiB arrays)')
  assert peak.extra_bytes - arrays <= budget + TOLERANCE, (fmt, budget, peak.extra_bytes)


def test_a_budget_that_works_works_when_larger(saved, table):
  """Monotonic: once a budget restores a format, every larger one does."""
  del saved
  for fmt in FORMATS:
    ok = [table.get((fmt, b), '').startswith('bit-exact') for b in BUDGETS]
    if not any(ok):
      continue
    first = ok.index(True)
    assert all(ok[first:]), (fmt, ok)


def _opened(directory: pathlib.Path, name: str):
  from kd_ckpt import storage  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  for driver in ('zarr', 'zarr3'):
    for kvstore in ({'driver': 'ocdbt', 'base': storage.kvstore_spec(directory), 'path': name},
                    storage.kvstore_spec(directory / name)):
      try:
        return ts.open({'driver': driver, 'kvstore': kvstore}, open=True, read=True).result()
      except ValueError:
        continue
  raise AssertionError(f'cannot open {name} in {directory}')


@pytest.mark.parametrize('fmt', FORMATS)
def test_a_leaf_priced_unopened_costs_no_more_than_its_price(saved, tmp_path, fmt):
  """Small leaves are priced from the restore args, without opening them:
  that price is at least what pricing the opened leaf gives, for Orbax's
  reader and for reading it whole (`_read_whole`), on every format,
  with casts to a narrower dtype and edge chunks (prime extents, 1 MiB chunks)."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top

  root, abstract, _ = saved
  mesh = Mesh(np.array(jax.devices()), ('x',))
  checked = 0
  for name, target in abstract.items():
    if not isinstance(target, jax.ShapeDtypeStruct):
      continue
    t = _opened(root / fmt, name)
    for dtype in {np.dtype(target.dtype), np.dtype(np.float16)}:
      for sharding in (target.sharding, NamedSharding(mesh, P())):
        if len(target.shape) and not target.shape[0] % 8:
          sharding = NamedSharding(mesh, P('x'))
        shape = tuple(target.shape)
        exact = reading._stock_charge(t, shape, dtype, sharding)
        bound = reading._stock_charge_bound(shape, dtype, sharding, True)
        assert exact <= bound, (fmt, name, dtype, sharding, exact, bound)
        exact = reading._whole_charge_of(t, shape, dtype, sharding)
        bound = reading._whole_charge_bound(shape, dtype, sharding)
        assert exact <= bound, ('whole', fmt, name, dtype, sharding, exact, bound)
        checked += 1
    assert reading._stock_charge_bound(tuple(target.shape), np.dtype(target.dtype),
                                       target.sharding, strict=False) is None
  assert checked >= 16


@pytest.mark.parametrize('fmt', ['ocdbt-zarr2-zstd', 'plain-zarr3-raw', 'kd-streaming'])
def test_small_leaves_are_read_whole_as_orbax_reads_them(tmp_path, monkeypatch, fmt):
  """Small leaves are read whole, many per TensorStore batch and one batched
  transfer, not through Orbax's per-leaf reader (~1.6 ms of Python a leaf):
  the values, dtypes and shardings are Orbax's own restore's, for a leaf on
  one device, replicated, on a 2-D mesh with prime extents, cast, and 0-d;
  numpy leaves too.  Leaves it may not read (strict=False) still go to
  Orbax's reader."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  _, mesh = states.meshes()
  rng = np.random.default_rng(23)
  tree = states.small_leaves(rng, 300)
  tree.update({
      'part': jax.device_put(rng.standard_normal((4 * 5, 3)).astype(np.float32),
                             NamedSharding(mesh, P('a'))),
      'step': jnp.int32(12345),
      'host': rng.integers(-9, 9, (17, 5)),
      'host_cast': rng.standard_normal((3, 11)),
  })
  _write(fmt, tmp_path / 'c', tree)
  target = {k: v if isinstance(v, np.ndarray) else jax.ShapeDtypeStruct(
      v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
  target['cast'] = jax.ShapeDtypeStruct((29, 31), jnp.bfloat16, sharding=tree['cast'].sharding)
  target['host_cast'] = np.zeros((3, 11), np.float32)
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
    want = c.restore(tmp_path / 'c', args=ocp.args.StandardRestore(target))
  stock = ocp.type_handlers.ArrayHandler.deserialize
  stock_leaves = []

  async def counted(self, infos, args=None):
    stock_leaves.extend(info.name for info in infos)
    return await stock(self, infos, args)

  monkeypatch.setattr(ocp.type_handlers.ArrayHandler, 'deserialize', counted)
  whole = []
  real = reading._read_whole
  monkeypatch.setattr(reading, '_read_whole', lambda leaves: whole.append(len(leaves)) or real(leaves))
  pieced = []  # leaves read piece by piece (numpy ones included)
  source = reading.Source
  monkeypatch.setattr(reading, 'Source', lambda name, *a: pieced.append(name) or source(name, *a))
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='128MiB')
  assert pieced == [] and stock_leaves == [] and sum(whole) == len(tree) - 2 and len(whole) < len(tree) / 10, whole
  for k in tree:
    assert type(back[k]) is type(want[k]) and back[k].dtype == want[k].dtype, k
    assert getattr(back[k], 'sharding', None) == getattr(want[k], 'sharding', None), k
    assert np.asarray(back[k]).tobytes() == np.asarray(want[k]).tobytes(), k
  assert back['host_cast'].dtype == np.float32 and back['host'].flags.writeable
  # strict=False: Orbax pads or truncates; its reader reads those leaves.
  loose = dict(target, cast=jax.ShapeDtypeStruct((30, 31), jnp.float32,
                                                 sharding=tree['cast'].sharding))
  whole.clear()
  back = kd_ckpt.restore(tmp_path / 'c', loose, host_ram_budget='128MiB', strict=False)
  assert sorted(stock_leaves) == sorted(k for k in tree if 'host' not in k) and not whole
  assert not np.asarray(back['cast'])[29:].any()
  np.testing.assert_array_equal(np.asarray(back['cast'])[:29], np.asarray(tree['cast']))


@pytest.mark.parametrize('shared', [False, True])
def test_a_budget_that_holds_whole_shards_reads_them_whole(tmp_path, monkeypatch, shared):
  """Stock shards bigger than a piece: filled in place at a small budget,
  read whole (nothing compiled, no zeros or update pass) at a big one; both
  bit-exact, with a cast and a replicated leaf too.

  On the CPU backend the devices keep the host shard they are given
  (`reading._shares_host_buffers`): it is the restored array, so only its
  read is charged and whole shards are read at the small budget too, each
  replica's array on the one buffer.  `shared=False` is the path of devices
  that copy it (GPUs).
  """
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', shared)

  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('a', 'b'))
  rng = np.random.default_rng(5)
  startup.start_compiler()  # as in a training process
  # Shards of 16.5 MiB: over two 8 MiB pieces at 64 MiB, so filled in place.
  tree = {'w': jax.device_put(rng.standard_normal((4 * 2053, 2 * 2053), np.float32),
                              NamedSharding(mesh, P('a', 'b'))),
          'r': jax.device_put(rng.standard_normal((2053, 2039), np.float32),
                              NamedSharding(mesh, P()))}
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', tree)
  target = jax.eval_shape(lambda: tree)
  target['r'] = jax.ShapeDtypeStruct((2053, 2039), jnp.bfloat16, sharding=tree['r'].sharding)
  calls = []
  real = reading._fill_by_shard
  monkeypatch.setattr(reading, '_fill_by_shard', lambda *a, **k: calls.append(1) or real(*a, **k))
  for budget, whole in (('64MiB', shared), ('1GiB', True)):
    calls.clear()
    back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget=budget)
    assert bool(calls) == whole, (budget, calls)
    if shared:  # read here, 'r''s 8 replicas are one buffer, at either budget
      # (at 1 GiB one TensorStore piece covers 'r': copied once into an
      # aligned buffer, not by each of the 8 devices)
      for leaf in ('w', 'r'):
        for s in back[leaf].addressable_shards:
          assert s.data.unsafe_buffer_pointer() % hostmem.DEVICE_ALIGN_BYTES == 0, (budget, leaf)
      assert len({s.data.unsafe_buffer_pointer() for s in back['r'].addressable_shards}) == 1
    assert np.asarray(back['w']).tobytes() == np.asarray(tree['w']).tobytes()
    np.testing.assert_array_equal(np.asarray(back['r']),
                                  np.asarray(tree['r']).astype(jnp.bfloat16))
    assert back['w'].sharding == tree['w'].sharding and back['r'].dtype == jnp.bfloat16


@pytest.mark.parametrize('shared', [True, False])
def test_strict_false_pads_and_truncates_big_leaves_as_orbax_does(tmp_path, monkeypatch, shared):
  """Targets bigger (zeros beyond the saved array) and smaller than a stock
  leaf whose chunks are bigger than the pieces, on 8 devices and on one, at
  a small budget: the same values as Orbax's own `strict=False` restore."""
  from kd_ckpt import chunkread, reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', shared)
  streamed = []
  real = chunkread.StoredArray.read_pieces
  monkeypatch.setattr(chunkread.StoredArray, 'read_pieces',
                      lambda *a, **k: streamed.append(1) or real(*a, **k))
  startup.start_compiler()
  mesh = Mesh(np.array(jax.devices()), ('x',))
  rng = np.random.default_rng(11)
  value = rng.integers(-99, 99, (8 * 1031, 1021)).astype(np.float32)  # ~4 MiB shards
  tree = {'w': jax.device_put(value, NamedSharding(mesh, P('x')))}
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', tree)
  for shape in ((8 * 1100, 1100), (8 * 1000, 1000), (8 * 1100, 1000)):
    for sharding in (NamedSharding(mesh, P('x')), jax.sharding.SingleDeviceSharding(jax.devices()[0])):
      target = {'w': jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)}
      with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
        want = c.restore(tmp_path / 'c', args=ocp.args.StandardRestore(target, strict=False))
      back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='40MiB', strict=False)
      assert back['w'].shape == shape and back['w'].sharding == sharding
      np.testing.assert_array_equal(np.asarray(back['w']), np.asarray(want['w']))
      common = tuple(slice(0, min(a, b)) for a, b in zip(shape, value.shape))
      np.testing.assert_array_equal(np.asarray(back['w'])[common], value[common])
  assert streamed  # the chunks were read in pieces (chunkread), not whole


@pytest.mark.parametrize('shared,rows,cols', [(True, 1031, 1021), (False, 2003, 997)],
                         ids=['shared', 'copying'])
def test_a_restore_never_waits_on_its_own_readers(tmp_path, monkeypatch, shared, rows, cols):
  """Extra reader lanes hold their zstd decoders until the leaf is read.

  A lane was added whenever its decoders fit, even if, beside them, the
  next read (and, filling in place, the device copies of a step's pieces)
  no longer did: that read then waited for bytes nothing would release,
  and the restore failed after `STALL_SECS` (300 s) instead of reading.
  Found by a sweep of stock checkpoints over budgets (8 prime-ish shards at
  40 MiB, on both placement paths).
  """
  from kd_ckpt import limiter, reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', shared)
  monkeypatch.setattr(limiter, 'STALL_SECS', 15.0)  # a wedge fails in 15 s, not 300
  startup.start_compiler()
  mesh = Mesh(np.array(jax.devices()), ('x',))
  value = np.random.default_rng(3).standard_normal((8 * rows, cols)).astype(np.float32)
  tree = {'w': jax.device_put(value, NamedSharding(mesh, P('x')))}
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', tree)
  for budget in ('36MiB', '40MiB', '44MiB'):
    back = kd_ckpt.restore(tmp_path / 'c', jax.eval_shape(lambda: tree), host_ram_budget=budget)
    assert np.asarray(back['w']).tobytes() == value.tobytes(), budget


@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'copying'])
def test_leaves_of_one_shard_are_read_side_by_side_in_parts_of_the_budget(
    tmp_path, monkeypatch, shared):
  """A stock checkpoint stores each leaf as one zstd chunk, decoded by one
  stream: read leaf after leaf, a restore used one core (4.0x Orbax's time
  on a 16-core GPU host).  From a local disk, leaves are read several at
  once, each in a part carved from the budget; the parts never add up to
  more than the read's room, and every leaf comes back bit-exact."""
  from kd_ckpt import limiter, reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', shared)
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 3)  # whatever this machine's cores
  monkeypatch.setattr(reading, 'MIN_PART_BYTES', 40 * MiB)  # 3 parts of a 160 MiB budget
  monkeypatch.setattr(limiter, 'STALL_SECS', 30.0)
  startup.start_compiler()
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  rng = np.random.default_rng(5)
  # Each leaf bigger than the read's piece (27 MiB), so none is read whole.
  shapes = [(4001, 4099), (2003, 4099), (2999, 6007), (3001, 3001), (4999, 3607)]
  values = {f'l{i}': rng.standard_normal(s).astype(np.float32 if i % 2 else np.float16)
            for i, s in enumerate(shapes)}
  tree = {k: jax.device_put(v, one) for k, v in values.items()}
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', tree)
  del tree

  # Leaves overlap however fast this machine reads.
  counting_fill, most = states.counting_calls(reading.fill_array, pause_secs=0.05)
  carved, real_carve = [], limiter.HostLimiter.carve

  def watched_carve(self, nbytes, **k):
    carved.append((nbytes, self.capacity_bytes))
    return real_carve(self, nbytes, **k)

  monkeypatch.setattr(reading, 'fill_array', counting_fill)
  monkeypatch.setattr(limiter.HostLimiter, 'carve', watched_carve)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in values.items()}
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='160MiB')
  for k, v in values.items():
    assert np.asarray(back[k]).tobytes() == v.tobytes(), k
  assert most[0] == 3, most  # three leaves at once, never more
  assert len(carved) == 3 and sum(n for n, _ in carved) <= carved[0][1], carved


@pytest.mark.parametrize('budget', ['48MiB', '64MiB'])
def test_a_small_budget_still_reads_two_leaves_side_by_side(tmp_path, monkeypatch, budget):
  """Parts of at least 32 MiB left one part under ~90 MiB budgets: the 24-leaf
  stock checkpoint of `bench/restore_stock.py` restored at 64 MiB in 1.11x
  Orbax's time, on one core.  A part needs `reading.MIN_PART_BYTES` (8 MiB):
  two leaves are decoded at once from 48 MiB, bit-exact."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 2)  # whatever this machine's cores
  startup.start_compiler()
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  rng = np.random.default_rng(7)
  values = {f'l{i}': rng.integers(-1000, 1000, (1021, 2053)).astype(np.float32)
            for i in range(4)}
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', {k: jax.device_put(v, one) for k, v in values.items()})
  counting_fill, most = states.counting_calls(reading.fill_array, pause_secs=0.05)
  monkeypatch.setattr(reading, 'fill_array', counting_fill)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in values.items()}
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget=budget)
  for k, v in values.items():
    assert np.asarray(back[k]).tobytes() == v.tobytes(), k
  assert most[0] == 2, most


def test_leaves_a_part_could_not_decode_are_read_with_the_whole_room(tmp_path, monkeypatch):
  """A zstd frame's decoder window does not shrink with the pieces: where a
  part's pieces leave too little for it but the whole budget's do not, the
  leaves are read one after another, as before parts (not refused)."""
  from kd_ckpt import chunkread, reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 2)
  startup.start_compiler()
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  rng = np.random.default_rng(11)
  values = {f'l{i}': rng.standard_normal((1999, 5003)).astype(np.float32) for i in range(3)}
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', {k: jax.device_put(v, one) for k, v in values.items()})
  # As if each frame had a 64 MiB window (a high zstd level): decodable in
  # the whole room's pieces (46 MiB at 256 MiB), not in a part's (23 MiB).
  monkeypatch.setattr(chunkread.StoredArray, '_decoder_window', lambda self: 64 << 20)
  counting_fill, most = states.counting_calls(reading.fill_array)
  monkeypatch.setattr(reading, 'fill_array', counting_fill)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in values.items()}
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='256MiB')
  for k, v in values.items():
    assert np.asarray(back[k]).tobytes() == v.tobytes(), k
  assert most[0] == 1, most


def test_a_leaf_of_one_zstd_chunk_is_decoded_into_place_and_a_sharded_one_by_tensorstore(
    tmp_path, monkeypatch):
  """From a local disk a leaf stored as one zstd chunk is decoded by chunkread
  even where TensorStore could decode it whole (`STREAM_ZSTD_FROM_BYTES`); a
  leaf of several chunks is read by TensorStore.  Both bit-exact."""
  from kd_ckpt import chunkread, reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 2)
  startup.start_compiler()
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  sharded = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x'))
  rng = np.random.default_rng(7)
  values = {'one': rng.standard_normal((2003, 5003)).astype(np.float32),  # 40 MB, one chunk
            'sharded': rng.standard_normal((8 * 1259, 5003)).astype(np.float32)}
  shardings = {'one': one, 'sharded': sharded}
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', {k: jax.device_put(v, shardings[k]) for k, v in values.items()})
  opened = []
  real_open = chunkread.StoredArray.open

  def watched_open(kv, name, *a, **k):
    opened.append(name)
    return real_open(kv, name, *a, **k)

  monkeypatch.setattr(chunkread.StoredArray, 'open', staticmethod(watched_open))
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
            for k, v in values.items()}
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='1GiB')
  for k, v in values.items():
    assert np.asarray(back[k]).tobytes() == v.tobytes(), k
  assert opened == ['one'], opened


@pytest.mark.parametrize('layout', ['one_device', 'mesh', 'mesh2d'])
def test_a_shard_filled_in_place_decodes_its_one_chunk_once(tmp_path, monkeypatch, layout):
  """On devices that copy (GPUs), a shard of a stock checkpoint (one zstd
  chunk) too big for the budget is filled in place, piece by piece, from one
  stream decoder.  Prime rows: no piece size divides them
  (`slicing.even_tile`).  The last piece is cut short, not moved back over
  its neighbour, where the decoder had passed (it then decoded the chunk
  again from its start: 1.8x the bytes).  Bit-exact, one decoder a shard."""
  from kd_ckpt import chunkread, reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', False)
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 1)
  startup.start_compiler()
  rows = 4099  # prime
  if layout == 'one_device':
    sharding, shape = jax.sharding.SingleDeviceSharding(jax.devices()[0]), (rows, 2048)
  elif layout == 'mesh':  # every shard in one SPMD program (`_update_every_shard`)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ('x',)), P('x'))
    shape = (2 * rows, 2048)
  else:  # 2 x 2 shards of prime rows and columns
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('a', 'b')),
                             P('a', 'b'))
    shape = (2 * rows, 2 * 1031)
  value = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', {'w': jax.device_put(value, sharding)})
  decoders, plans = [], []
  real_cursor, real_fill = chunkread._Cursor.__init__, reading._fill_in_place

  def counted_cursor(self, *a, **k):
    decoders.append(1)
    real_cursor(self, *a, **k)

  def watched_fill(src, shape, plan, *a, **k):
    plans.append(plan)
    return real_fill(src, shape, plan, *a, **k)

  monkeypatch.setattr(chunkread._Cursor, '__init__', counted_cursor)
  monkeypatch.setattr(reading, '_fill_in_place', watched_fill)
  target = {'w': jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)}
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='64MiB')
  assert np.asarray(back['w']).tobytes() == value.tobytes()
  assert plans and all(p.partial for p in plans), plans
  assert all(len(list(p.tiles())) > 2 for p in plans), plans  # in several pieces
  assert len(decoders) == {'one_device': 1, 'mesh': 2, 'mesh2d': 4}[layout], decoders


def _stock_mesh_leaf(tmp_path, devices: int, rows: int, cols: int = 2048, sharding=None):
  """A stock checkpoint of one f32 leaf over `devices` (one zstd chunk a shard),
  or of `devices` shards of rows in `sharding`."""
  sharding = sharding or NamedSharding(Mesh(np.array(jax.devices()[:devices]), ('x',)), P('x'))
  value = np.random.default_rng(12).standard_normal((devices * rows, cols)).astype(np.float32)
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', {'w': jax.device_put(value, sharding)})
  return value, {'w': jax.ShapeDtypeStruct(value.shape, np.float32, sharding=sharding)}


def _count_decoders(monkeypatch) -> list:
  from kd_ckpt import chunkread  # pylint: disable=g-import-not-at-top
  decoders, real = [], chunkread._Cursor.__init__

  def counted(self, array, blob, *a, **k):
    decoders.append((blob.key, blob.offset))  # the stored chunk it decodes
    real(self, array, blob, *a, **k)

  monkeypatch.setattr(chunkread._Cursor, '__init__', counted)
  return decoders


def test_one_lane_keeps_a_decoder_for_each_shard_it_reads_in_turn(tmp_path, monkeypatch):
  """8 shards filled in place piece by piece, in turn, planned on 2 lanes
  (4 decoders each) where the second lane's decoders do not fit: the first
  lane then reads all 8, and keeps 8 decoders.  It kept 4 before: each read
  restarted a decoder from its chunk's start (the `many_small` state's big
  leaf at 144 MiB: 10.4 s against 0.8 s)."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', False)
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 1)
  monkeypatch.setattr(reading, 'MAX_READ_LANES', 2)
  startup.start_compiler()
  value, target = _stock_mesh_leaf(tmp_path, 8, 2053)
  real_hold, first, lanes = reading.Source.hold_decoders, [], []

  def hold(self, *, wait=True):
    first.append(first[0] if first else self)
    if self is not first[0] and not wait:
      return False  # another lane's decoders: do not fit
    return real_hold(self, wait=wait)

  real_lanes = reading._lanes
  monkeypatch.setattr(reading.Source, 'hold_decoders', hold)
  monkeypatch.setattr(reading, '_lanes', lambda *a, **k: lanes.append(real_lanes(*a, **k)) or lanes[-1])
  decoders = _count_decoders(monkeypatch)
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='64MiB')
  assert np.asarray(back['w']).tobytes() == value.tobytes()
  (one,), = lanes
  assert one.cursors == 8, (one.cursors, one.ctx.piece_bytes, one.read_bytes, len(decoders))
  assert len(decoders) == 8, len(decoders)


def test_decoders_are_kept_where_the_limiter_has_room_beyond_the_reads_envelope(
    tmp_path, monkeypatch):
  """`cost.chunkread_piece_bytes` fits decoders within what a read of whole
  pieces sets aside; reads of small tiles leave most of it unused.  Where
  that envelope holds no more than one decoder but the limiter has room for
  one a shard beside a task, they are kept (`room_bytes`): each shard
  decoded once, bit-exact."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', False)
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 1)
  startup.start_compiler()
  value, target = _stock_mesh_leaf(tmp_path, 4, 4099)
  real_read_bytes, lanes = reading.Source._read_bytes, []
  monkeypatch.setattr(reading.Source, '_read_bytes',  # the envelope: one decoder
                      lambda self, n: real_read_bytes(self, n) if n == 1 else None)
  real_lanes = reading._lanes
  monkeypatch.setattr(reading, '_lanes', lambda *a, **k: lanes.append(real_lanes(*a, **k)) or lanes[-1])
  decoders = _count_decoders(monkeypatch)
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='64MiB')
  assert np.asarray(back['w']).tobytes() == value.tobytes()
  (one,), = lanes
  assert one.cursors == 4 and len(decoders) == 4, (one.cursors, len(decoders))


@pytest.mark.parametrize('kept,layout', [(1, 'x8'), (3, 'x8'), (1, 'b_replicated_over_a'),
                                         (2, 'b_replicated_over_a')])
def test_shards_whose_decoders_are_not_all_kept_are_filled_in_passes(
    tmp_path, monkeypatch, kept, layout):
  """Where the lanes keep fewer zstd decoders than the shards they read in
  turn, the shards are filled in passes of as many as they keep (the other
  shards keep what they hold): each stored chunk decoded once, bit-exact.
  Also where each of 2 shards is on 4 devices of a 4x2 mesh (P('b')), which
  stock Orbax stores in 4 chunks of columns a shard (one a replica): its
  tiles are read chunk after chunk, and a decoder that has read its chunk
  to the end is the one dropped (176 and 134 decoders for 8 chunks before).
  Read all in turn, the chunks whose decoders were not kept were decoded
  again from their start for every piece (the `prime` state at 48 MiB: 820
  decoders for 8 chunks, 16 s; `many_small` at 128 MiB ran over 10 min)."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', False)
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 1)
  monkeypatch.setattr(reading, 'MAX_READ_LANES', 1)
  startup.start_compiler()
  if layout == 'x8':
    value, target = _stock_mesh_leaf(tmp_path, 8, 2053)  # prime rows: a short last piece
  else:
    _, m2 = states.meshes()
    value, target = _stock_mesh_leaf(tmp_path, 4, 4099, sharding=NamedSharding(m2, P('b')))
  shards = 8 if layout == 'x8' else 4
  real_keep = reading.Source.keep_decoders
  monkeypatch.setattr(reading.Source, 'keep_decoders',  # no more than `kept` fit
                      lambda self, n, **k: real_keep(self, min(n, kept), **k))
  plans, passes = [], []
  real_fill, real_per_pass = reading._fill_in_place, reading._shards_per_pass
  monkeypatch.setattr(reading, '_fill_in_place',
                      lambda src, shape, plan, *a, **k: plans.append(plan) or real_fill(
                          src, shape, plan, *a, **k))
  monkeypatch.setattr(reading, '_shards_per_pass',
                      lambda *a: passes.append(real_per_pass(*a)) or passes[-1])
  decoders = _count_decoders(monkeypatch)
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='64MiB')
  assert np.asarray(back['w']).tobytes() == value.tobytes()
  (plan,), = [plans]
  assert plan.partial and len(list(plan.tiles())) > 2, plan  # several pieces, one short
  assert passes == [kept], passes
  # Each stored chunk decoded once (stock Orbax split each replicated shard
  # into chunks of columns: its tiles are read chunk after chunk).
  assert len(decoders) == len(set(decoders)) >= shards, decoders


def test_tiles_of_part_of_a_zstd_chunk_are_streamed_not_decoded_whole_each(
    tmp_path, monkeypatch):
  """Stock Orbax's replica-parallel save splits a replicated shard into
  chunks (here 2 shards on 4 devices each, 4 chunks a shard).  Filled in
  place in tiles smaller than a chunk, TensorStore decoded the whole chunk
  for every tile, even where the chunk fit a piece (a 256 MiB leaf on
  devices that copy: 1.9-3.2 s at 192 MiB-1 GiB, 0.64-0.73 s now): each
  chunk is now decoded once, by chunkread, bit-exact."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', False)
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 1)
  startup.start_compiler()
  _, m2 = states.meshes()
  value, target = _stock_mesh_leaf(tmp_path, 2, 3072, sharding=NamedSharding(m2, P('b')))
  plans, sources = [], []
  real_fill = reading._fill_in_place
  monkeypatch.setattr(reading, '_fill_in_place', lambda src, shape, plan, *a, **k: (
      plans.append(plan), sources.append((src.chunk, src.ctx.piece_bytes))) and real_fill(
          src, shape, plan, *a, **k))
  decoders = _count_decoders(monkeypatch)
  back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget='64MiB')
  assert np.asarray(back['w']).tobytes() == value.tobytes()
  (plan,), ((chunk, piece_bytes),) = plans, sources
  chunk_bytes = math.prod(chunk) * 4
  # A chunk TensorStore would have read (it fits a piece), in tiles of part of it.
  assert chunk_bytes <= piece_bytes and plan.piece[0] < chunk[0] < plan.shard[0], (
      chunk, piece_bytes, plan)
  assert len(decoders) == len(set(decoders)) == 2 * plan.shard[0] // chunk[0], decoders


def _file_bytes_read() -> int:
  """Bytes TensorStore's file kvstore has read in this process (reads and maps)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  return sum(v.get('value', 0) for m in ts.experimental_collect_matching_metrics('/tensorstore/')
             if m['name'] in ('/tensorstore/kvstore/file/bytes_read', '/tensorstore/file/mmap_bytes')
             for v in m['values'])


def test_tiles_of_part_of_a_raw_chunk_read_only_their_bytes(tmp_path, monkeypatch):
  """A shard filled in place in tiles smaller than its raw chunk: each tile
  reads its own byte ranges (chunkread), where TensorStore read the whole
  chunk for every tile.  This 400 MB leaf (8 shards of 2 chunks of 25 MB)
  at 160 MiB read 13x its bytes, from a bucket as from a disk."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 1)
  startup.start_compiler()
  m1, _ = states.meshes()
  tree = {'w': states.filled((97656, 1024), NamedSharding(m1, P('x')), seed=11)}
  kd_ckpt.save(tmp_path / 'c', tree, strategy='streaming', host_ram_budget='256MiB')
  target = {'w': jax.ShapeDtypeStruct(tree['w'].shape, tree['w'].dtype,
                                      sharding=tree['w'].sharding)}
  partial = []
  real_fill = reading._fill_in_place
  monkeypatch.setattr(reading, '_fill_in_place', lambda src, shape, plan, *a, **k: (
      partial.append(reading._part_of_a_chunk(plan, src.chunk)
                     and src.chunk_bytes <= src.ctx.piece_bytes)) or real_fill(
                         src, shape, plan, *a, **k))
  # The budgets around the one where the tiles are part of a chunk that
  # TensorStore would read (the start-up a process has paid moves it).
  for budget in (144, 160, 176):
    before = _file_bytes_read()
    back = kd_ckpt.restore(tmp_path / 'c', target, host_ram_budget=budget << 20)
    read = _file_bytes_read() - before
    assert np.asarray(back['w']).tobytes() == np.asarray(tree['w']).tobytes()
    del back
    print(f'{budget} MiB: {read / tree["w"].nbytes:.2f}x the leaf read')
    assert read <= tree['w'].nbytes * 1.02 + (1 << 20), (budget, read)
  assert any(partial), partial  # the case happened


def test_a_shard_filled_in_place_reads_each_of_its_chunks_once(tmp_path, monkeypatch):
  """kd_ckpt's own chunks (raw) of up to a piece are read by TensorStore,
  which decodes whole chunks: a shard filled in place on devices that copy
  is tiled in whole chunks, each read once.  Tiles of half a piece read each
  chunk whole twice (and the last, moved back, a third time)."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', False)
  monkeypatch.setattr(reading, 'MAX_LEAF_PARTS', 1)
  startup.start_compiler()
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  value = np.random.default_rng(3).standard_normal((4099, 2048)).astype(np.float32)
  # At 52 MiB the writer's chunks are bands of 456 rows (3.7 MB), between
  # half a piece and a piece of the restore at 48 MiB (4.8 MB).
  kd_ckpt.save(tmp_path / 'c', {'w': jax.device_put(value, one)}, strategy='streaming',
               host_ram_budget='52MiB')
  reads, sources = [], []
  real_read, real_fill = reading._read_host, reading._fill_in_place
  monkeypatch.setattr(reading, '_read_host', lambda *a, **k: reads.append(1) or real_read(*a, **k))

  def watched_fill(src, *a, **k):
    sources.append((src.chunk, src.chunk_bytes, src.ctx.piece_bytes, src.stored))
    return real_fill(src, *a, **k)

  monkeypatch.setattr(reading, '_fill_in_place', watched_fill)
  back = kd_ckpt.restore(tmp_path / 'c', {'w': jax.ShapeDtypeStruct(
      value.shape, value.dtype, sharding=one)}, host_ram_budget='48MiB')
  assert np.asarray(back['w']).tobytes() == value.tobytes()
  (chunk, chunk_bytes, piece_bytes, stored), = sources
  # The case: TensorStore's chunks, each more than half a piece.
  assert stored is None and piece_bytes // 2 < chunk_bytes <= piece_bytes, sources
  chunks = math.prod(-(-n // c) for n, c in zip(value.shape, chunk))
  assert len(reads) == chunks, (len(reads), chunks)


def _watch_read_pieces(monkeypatch):
  """(calls, yielded): per chunkread read, whether it was given `out`; the
  bytes of every piece it yielded (decoded outside `out`, copied after)."""
  from kd_ckpt import chunkread  # pylint: disable=g-import-not-at-top
  calls, yielded = [], []
  real = chunkread.StoredArray.read_pieces

  def watched(self, box, max_piece_bytes, *, out=None):
    calls.append(out is not None)
    for piece in real(self, box, max_piece_bytes, out=out):
      yielded.append(piece[1].nbytes)
      yield piece

  monkeypatch.setattr(chunkread.StoredArray, 'read_pieces', watched)
  return calls, yielded


def test_a_host_shard_on_devices_that_copy_is_decoded_straight_into(tmp_path, monkeypatch):
  """On devices that copy (GPUs), a shard read whole is assembled in a host
  buffer its read is charged for.  chunkread decodes its zstd chunk straight
  into that buffer, as it does into a shared one, rather than into pieces
  copied there: one copy of the shard less."""
  from kd_ckpt import limiter, reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', False)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  value = np.random.default_rng(5).standard_normal((1031, 2053)).astype(np.float32)
  with ocp.StandardCheckpointer() as c:  # one zstd chunk of 8 MiB
    c.save(tmp_path / 'c', {'w': jax.device_put(value, one)})
  capacity = 64 * MiB
  ctx = reading.ReadContext(limiter.HostLimiter(capacity), capacity, 2 * MiB)
  whole = tuple(slice(0, n) for n in value.shape)
  with reading.open_stored(tmp_path / 'c', 'w', ctx) as src:
    # The case: chunkread, in several pieces, into a host buffer of its own.
    assert src.stored is not None and not src.one_piece(whole)
    _, yielded = _watch_read_pieces(monkeypatch)
    charge = reading._read_task_charge(src, whole, whole, value.dtype, 1)  # pylint: disable=protected-access
    ctx.limiter.acquire(charge)
    host = reading._read_host(src, whole, whole, value.dtype, None)  # pylint: disable=protected-access
  assert host.tobytes() == value.tobytes()
  assert yielded == [], f'{len(yielded)} pieces copied into the host buffer'


def test_a_shard_assembled_on_the_host_is_decoded_into_its_staging_buffer(
    tmp_path, monkeypatch):
  """A shard of up to two small pieces is assembled in a host staging buffer
  (`_HostShard`, on devices that copy): chunkread decodes its zstd chunk
  straight into that buffer, not into pieces copied there, inside the
  budget.  8 shards of 4099 x 1031 (prime rows) at 96 MiB."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', False)
  startup.start_compiler()
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x'))
  value = np.random.default_rng(7).standard_normal((8 * 4099, 1031)).astype(np.float32)
  with ocp.StandardCheckpointer() as c:  # a zstd chunk per shard
    c.save(tmp_path / 'c', {'w': jax.device_put(value, sharding)})
  calls, yielded = _watch_read_pieces(monkeypatch)
  budget = 96 * MiB
  hostmem.release_free_memory()
  with hostmem.PeakRss() as peak:
    back = kd_ckpt.restore(tmp_path / 'c', {'w': jax.ShapeDtypeStruct(
        value.shape, value.dtype, sharding=sharding)}, host_ram_budget=budget)
  assert np.asarray(back['w']).tobytes() == value.tobytes()
  assert calls and all(calls), calls  # the case: every shard staged
  assert yielded == [], f'{len(yielded)} pieces copied into the staging buffers'
  assert peak.extra_bytes - value.nbytes <= budget, peak.extra_bytes


def test_a_device_that_copies_a_host_shard_it_was_to_keep_stops_sharing(
    tmp_path, monkeypatch, caplog):
  """If the CPU backend copies an aligned host shard after all (the probe was
  wrong), the restore still comes back right, says so, and later reads
  charge host shards as copies."""
  from kd_ckpt import reading  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(reading, 'SHARE_HOST_BUFFERS', True)
  startup.start_compiler()
  mesh = Mesh(np.array(jax.devices()), ('x',))
  value = np.random.default_rng(3).standard_normal((8 * 1031, 1021)).astype(np.float32)
  tree = {'w': jax.device_put(value, NamedSharding(mesh, P('x')))}
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', tree)
  assert reading._shares_host_buffers(jax.devices(), np.float32)  # asked before the patch
  real = jax.device_put

  def copying_put(x, d=None, **k):  # as a backend that copies: from a misaligned copy
    if isinstance(x, np.ndarray):
      buf = np.empty(x.size + 1, x.dtype)[1:].reshape(x.shape)
      buf[...] = x
      x = buf
    return real(x, d, **k)

  monkeypatch.setattr(reading.jax, 'device_put', copying_put)
  back = kd_ckpt.restore(tmp_path / 'c', jax.eval_shape(lambda: tree), host_ram_budget='40MiB')
  np.testing.assert_array_equal(np.asarray(back['w']), value)
  assert reading.SHARE_HOST_BUFFERS is False
  assert 'now charge host shards as copies' in caplog.text
