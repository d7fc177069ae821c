"""Every training state stock Orbax round-trips, kd_ckpt round-trips too (issue 10).

For each state, strategy and kind of target, `kd_ckpt.restore` must return
exactly what `ocp.StandardCheckpointer().restore` returns for the same
checkpoint and target: pytree types (static fields included), leaf types,
dtypes, shapes, shardings and bytes.  Stock Orbax restores every kd_ckpt
checkpoint too, and `verify` checks every leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import flax
from flax import nnx
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import kd_ckpt

P = jax.sharding.PartitionSpec
NS = jax.sharding.NamedSharding


def _mesh1():
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ('x',))


def _mesh2():
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('a', 'b'))


@flax.struct.dataclass
class _StaticState:
  params: dict
  step: jax.Array
  name: str = flax.struct.field(pytree_node=False, default='run')


class _Mlp(nnx.Module):

  def __init__(self, rngs):
    self.dense = nnx.Linear(16, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)


def _arange(shape, dtype=jnp.float32, sharding=None):
  x = (jnp.arange(int(np.prod(shape)), dtype=jnp.float32) * 0.37 - 5).reshape(shape).astype(dtype)
  return jax.device_put(x, sharding) if sharding is not None else x


def _states():
  m1, m2 = _mesh1(), _mesh2()
  sharded = _arange((64, 16), sharding=NS(m1, P('x')))
  out = {}
  out['train_state'] = train_state.TrainState(
      step=0, apply_fn=None, params=_arange((64, 64)), tx=None, opt_state=None)
  params = {'w': sharded, 'b': _arange((16,))}
  tx = optax.adam(1e-3)
  out['train_state_create_adam'] = train_state.TrainState.create(
      apply_fn=lambda x: x, params=params, tx=tx)
  out['struct_static_field'] = _StaticState(params={'w': _arange((8, 8))}, step=jnp.int32(3))
  out['nnx_state'] = nnx.state(_Mlp(nnx.Rngs(0)))
  masked = optax.masked(optax.adam(1e-3), {'w': True, 'b': False})
  chain = optax.chain(optax.clip_by_global_norm(1.0), masked, optax.scale(0.1))
  out['optax_chain_masked'] = {'params': params, 'opt': chain.init(params)}
  out['none_leaf'] = {'a': _arange((3,)), 'b': None}
  out['empty_subtrees'] = {'a': {}, 'b': [], 'c': (), 'd': [_arange((2, 3)), {'e': None}],
                           'f': (_arange((4,)), [])}
  out['typed_prng_key'] = {'k': jax.random.key(0), 'ks': jax.random.split(jax.random.key(1), 4)}
  out['raw_uint32_key'] = {'k': jax.random.PRNGKey(0)}
  out['numpy_leaves'] = {'f64': np.array([1 / 3, 2 / 3]), 'i64': np.arange(5, dtype=np.int64),
                         'u8': np.arange(7, dtype=np.uint8)}
  out['python_scalars'] = {'i': 3, 'big': 3 * 2**40 + 5, 'f': 1 / 3, 'bool': True,
                           'np_f32': np.float32(2.5), 'np_i64': np.int64(-7)}
  out['dtypes'] = {
      'bf16': _arange((5, 7), jnp.bfloat16), 'f16': _arange((5,), jnp.float16),
      'i8': _arange((9,), jnp.int8), 'u8': _arange((9,), jnp.uint8),
      'bool': jnp.arange(10) % 3 == 0, 'i32': _arange((4,), jnp.int32),
  }
  if hasattr(jnp, 'int4'):
    out['dtypes']['int4'] = jnp.arange(16, dtype=jnp.int32).astype(jnp.int4)
  out['zero_d_and_zero_size'] = {'s': jnp.float32(7.0), 'z': jnp.zeros((0, 4)),
                                 'zb': jnp.zeros((3, 0), jnp.bfloat16)}
  out['mesh2d_and_replicated'] = {
      'm2': _arange((16, 12), sharding=NS(m2, P('a', 'b'))),
      'rep': _arange((32, 8), sharding=NS(m1, P())),
      'col': _arange((12, 16), sharding=NS(m2, P(None, 'b'))),
      'prime': _arange((1009, 3), sharding=NS(m1, P())),
  }
  out['nested_lists_tuples'] = [(_arange((3,)), [_arange((2,)), 4]), {'z': (1.5,)}]
  return out


STATES = list(_states())


def _leaf_kind(x):
  if isinstance(x, jax.Array):
    return 'jax.Array'
  return type(x).__name__


def _bytes(x):
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x).tobytes()


def assert_same(got, want, where=''):
  """Same pytree (types, static fields), leaf types, dtypes, shardings, bytes."""
  assert jax.tree.structure(got) == jax.tree.structure(want), (
      f'{where}: structure {jax.tree.structure(got)} != {jax.tree.structure(want)}')
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    name = f'{where}{jax.tree_util.keystr(path)}'
    assert _leaf_kind(g) == _leaf_kind(w), f'{name}: {type(g)} != {type(w)}'
    if hasattr(w, 'dtype'):
      assert g.dtype == w.dtype, f'{name}: dtype {g.dtype} != {w.dtype}'
      assert np.shape(g) == np.shape(w), f'{name}: shape {np.shape(g)} != {np.shape(w)}'
    if isinstance(w, jax.Array):
      assert g.sharding.is_equivalent_to(w.sharding, w.ndim), (
          f'{name}: sharding {g.sharding} != {w.sharding}')
    assert _bytes(g) == _bytes(w), f'{name}: values differ'


def _assert_saved_values(restored, original, where):
  """Leaf by leaf (Orbax's names), the saved bytes and dtypes are the original's."""
  got = {n: v for n, v in ((ocp.tree.str_keypath(p), v) for p, v in
                           jax.tree_util.tree_flatten_with_path(restored)[0])}
  for path, w in jax.tree_util.tree_flatten_with_path(original)[0]:
    g = got[ocp.tree.str_keypath(path)]
    keys = lambda x: (jax.random.key_data(x) if isinstance(x, jax.Array) and
                      jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    g, w = keys(g), keys(w)
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), (
        f'{where}{jax.tree_util.keystr(path)}: {g!r} != {w!r}')


def _abstract(tree):
  try:
    return jax.eval_shape(lambda: tree)
  except OverflowError:  # a Python int beyond int32: JAX cannot trace it
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x,
        tree)


def _stock_restore(d, target):
  return ocp.StandardCheckpointer().restore(d, target)


@functools.cache
def _saved(tmp_root, state_name, strategy):
  state = _states()[state_name]
  d = f'{tmp_root}/{state_name}_{strategy}'
  kd_ckpt.save(d, state, host_ram_budget='64MiB', strategy=strategy)
  return d


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  return str(tmp_path_factory.mktemp('structures'))


def _strategies(name):
  if name == 'zero_d_and_zero_size':
    return ['streaming', 'auto']  # Orbax cannot save zero-size arrays.
  return ['streaming', 'orbax', 'auto']


CASES = [(n, s) for n in STATES for s in _strategies(n)]


@pytest.mark.parametrize('name,strategy', CASES)
def test_round_trip_matches_stock_orbax(root, name, strategy):
  state = _states()[name]
  d = _saved(root, name, strategy)
  # Stock Orbax restores what kd_ckpt saved, with the original values.
  _assert_saved_values(_stock_restore(d, None), state, name)
  for kind, target in (('abstract', _abstract(state)), ('concrete', state), ('none', None)):
    try:
      want = _stock_restore(d, target)
    except ValueError as e:  # Stock refuses (e.g. a numpy scalar in a target):
      with pytest.raises(ValueError):  # so must kd_ckpt.
        kd_ckpt.restore(d, target, host_ram_budget='64MiB')
      print(f'{kind} {name}: stock Orbax refuses: {e}')
      continue
    got = kd_ckpt.restore(d, target, host_ram_budget='64MiB')
    assert_same(got, want, f'{kind} {name}')
  check = kd_ckpt.verify(d, host_ram_budget='64MiB')
  assert check.ok and not check.unchecked, str(check)


def test_abstract_target_keeps_saved_sharding(root):
  """jax.eval_shape drops shardings on jax 0.12: the saved ones are used, as Orbax does."""
  state = _states()['mesh2d_and_replicated']
  d = _saved(root, 'mesh2d_and_replicated', 'streaming')
  abstract = _abstract(state)
  assert all(getattr(x, 'sharding', None) is None for x in jax.tree.leaves(abstract))
  got = kd_ckpt.restore(d, abstract)
  for k in state:
    assert got[k].sharding.is_equivalent_to(state[k].sharding, state[k].ndim), k


def test_restore_into_other_sharding(root):
  state = _states()['mesh2d_and_replicated']
  d = _saved(root, 'mesh2d_and_replicated', 'orbax')
  m2 = _mesh2()
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NS(m2, P('b', None)))
            for k, v in state.items() if v.shape[0] % 2 == 0}
  target['prime'] = jax.ShapeDtypeStruct((1009, 3), jnp.float32, sharding=NS(m2, P(None, None)))
  got = kd_ckpt.restore(d, target, host_ram_budget='64MiB')
  assert_same(got, _stock_restore(d, target), 'resharded')


def test_python_scalars_take_the_target_dtype(root):
  """TrainState.create's step is a Python int; a target of f32 casts like Orbax."""
  state = _states()['python_scalars']
  d = _saved(root, 'python_scalars', 'streaming')
  target = {k: jax.ShapeDtypeStruct((), jnp.float32) for k in state}
  assert_same(kd_ckpt.restore(d, target), _stock_restore(d, target), 'cast')


def test_no_target_keeps_wide_values(root):
  d = _saved(root, 'python_scalars', 'streaming')
  got = kd_ckpt.restore(d)
  assert got['big'] == 3 * 2**40 + 5
  d = _saved(root, 'numpy_leaves', 'orbax')
  got = kd_ckpt.restore(d)
  assert got['f64'].dtype == np.float64 and got['f64'][0] == 1 / 3


def test_none_in_the_target_skips_a_saved_leaf_as_orbax_does(root):
  """Orbax's test_none_node_in_restore_args: a None target node comes back None."""
  tree = {'a': jnp.arange(4.0), 'b': {'c': jnp.ones(3), 'e': jnp.zeros(2)}}
  d = os.path.join(root, 'none_node')
  kd_ckpt.save(d, tree, host_ram_budget='64MiB')
  target = {'a': None, 'b': jax.eval_shape(lambda: tree['b'])}
  back = kd_ckpt.restore(d, target)
  assert back['a'] is None
  np.testing.assert_array_equal(np.asarray(back['b']['c']), np.ones(3))
  stock = ocp.StandardCheckpointer().restore(d, target)
  assert jax.tree.structure(stock) == jax.tree.structure(back)
  # A target leaf the checkpoint never had is still named.
  with pytest.raises(ValueError, match="'z'"):
    kd_ckpt.restore(d, {**target, 'z': jax.ShapeDtypeStruct((2,), jnp.float32)})


@pytest.mark.parametrize('strategy', ['streaming', 'orbax'])
def test_the_sharding_file_is_the_one_stock_orbax_writes(root, strategy):
  """kd_ckpt writes `_sharding` as one JSON document (Orbax opens it once per
  leaf); the file must hold what Orbax's holds, so that a restore without
  a target, by Orbax or Kauldron, finds the saved shardings."""
  state = _states()['mesh2d_and_replicated']
  stock = f'{root}/sharding_file_stock'
  if not os.path.exists(stock):
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(stock, state)
  d = _saved(root, 'mesh2d_and_replicated', strategy)
  with open(f'{stock}/_sharding', 'rb') as f:
    want = f.read()
  with open(f'{d}/_sharding', 'rb') as f:
    assert f.read() == want
  got = ocp.StandardCheckpointer().restore(d)
  for k, v in state.items():
    assert got[k].sharding.is_equivalent_to(v.sharding, v.ndim), k


def test_the_sharding_file_keeps_entries_written_before(tmp_path):
  """Two calls for one item (Orbax's handler may split its leaves) add up."""
  import asyncio  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from kd_ckpt import arrays  # pylint: disable=g-import-not-at-top
  m1 = _mesh1()
  infos = [ocp.type_handlers.ParamInfo(name=n, parent_dir=epath.Path(tmp_path),
                                       is_ocdbt_checkpoint=True)
           for n in ('a', 'b.c', 'd/e')]
  shardings = [NS(m1, P('x')), NS(m1, P()), jax.sharding.SingleDeviceSharding(jax.devices()[1])]
  asyncio.run(arrays.write_sharding_file(shardings[:1], infos[:1], primary_host=0))
  asyncio.run(arrays.write_sharding_file(shardings[1:], infos[1:], primary_host=0))
  from kd_ckpt import compat  # pylint: disable=g-import-not-at-top
  args = [ocp.ArrayRestoreArgs()] * 3
  got = asyncio.run(compat.orbax.deserialize_shardings(infos, args, True))  # Orbax's reader
  for g, want in zip(got, shardings):
    assert g == want


def test_a_restore_without_target_reads_the_sharding_file_once(root, monkeypatch):
  """Orbax's `ArrayHandler.metadata` reads the whole `_sharding` file once per
  leaf; kd_ckpt's reads it once, and finds what Orbax's finds."""
  from kd_ckpt import arrays  # pylint: disable=g-import-not-at-top
  state = _states()['mesh2d_and_replicated']
  stock = f'{root}/sharding_file_stock_metadata'
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(stock, state)
  reads = []
  real = arrays._read_document

  async def counted(t):
    reads.append(t)
    return await real(t)

  monkeypatch.setattr(arrays, '_read_document', counted)
  got = kd_ckpt.restore(stock, host_ram_budget='64MiB')
  assert len(reads) == 1
  want = _stock_restore(stock, None)
  assert_same(got, want, 'no target')
  for k, v in state.items():
    assert got[k].sharding.is_equivalent_to(v.sharding, v.ndim), k
