"""kd_ckpt.within_budget: code that builds its own Orbax checkpointer, inside a budget.

Gemma's weights loader (`gm.ckpts.load_params`, behind `gm.ckpts.LoadCheckpoint`)
restores through an `ocp.StandardCheckpointer()` of its own, MaxText's
(`load_params_from_path`) through `ocp.PyTreeCheckpointer()`.  Inside
`kd_ckpt.within_budget`, those read through kd_ckpt: the restore's peak
beyond the restored arrays stays within the budget, where Orbax's own reader
takes several times more; after the block Orbax's handlers are back.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import kd_ckpt
from kd_ckpt import orbax_scope
from tests import states

MiB = 1 << 20
TOLERANCE = 8 * MiB
BUDGET = 64 * MiB
STATE_BYTES = 192 * MiB


@pytest.fixture(scope='module')
def stock(tmp_path_factory):
  """Stock Orbax checkpoints of states whose shapes no cost was fitted on."""
  root = tmp_path_factory.mktemp('scope')
  out = {}
  for state in ('mesh2d_prime', 'many_medium', 'prime_rep'):
    d = str(root / state)
    states.run_worker('stock', d, state, str(STATE_BYTES))
    out[state] = d
  return out


@pytest.mark.parametrize('via', ['standard', 'gemma', 'pytree'])
@pytest.mark.parametrize('state', ['mesh2d_prime', 'many_medium', 'prime_rep'])
def test_a_loaders_own_checkpointer_reads_within_the_budget(stock, state, via):
  """Fresh processes; values checked bit-exact by the worker."""
  if via == 'gemma':
    pytest.importorskip('gemma')
  got = states.run_worker('restore', stock[state], state, str(STATE_BYTES), str(BUDGET), via)
  beyond = got['peak_extra_bytes'] - got['restored_bytes']
  print(f'{state} via {via}: {beyond / MiB:.1f} MiB beyond the restored arrays'
        f' ({got["restored_bytes"] / MiB:.0f} MiB), budget {BUDGET // MiB} MiB')
  assert beyond <= BUDGET + TOLERANCE, (state, via, beyond / MiB)


def test_orbax_reader_alone_takes_more_than_the_budget(stock):
  """The comparison the test above stands on: the same restore, Orbax's reader."""
  got = states.run_worker('restore', stock['mesh2d_prime'], 'mesh2d_prime',
                          str(STATE_BYTES), str(BUDGET), 'orbax')
  beyond = got['peak_extra_bytes'] - got['restored_bytes']
  print(f'mesh2d_prime, Orbax\'s reader: {beyond / MiB:.1f} MiB beyond the restored arrays')
  assert beyond > 2 * BUDGET, got


def _tree():
  m1, m2 = states.meshes()
  return {'w': states.filled((4 * 61, 1031), jax.sharding.NamedSharding(m2, jax.sharding.PartitionSpec('a'))),
          'v': states.filled((13,), jax.sharding.NamedSharding(m1, jax.sharding.PartitionSpec()))}


def test_inside_the_block_kd_ckpt_refuses_a_budget_and_after_it_orbax_restores(tmp_path):
  tree = _tree()
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', tree)
  target = states.abstract_of(tree)
  with kd_ckpt.within_budget('1MiB'):
    with pytest.raises(kd_ckpt.BudgetTooSmallError, match="Raise host_ram_budget to '"):
      ocp.StandardCheckpointer().restore(tmp_path / 'c', target)
    assert ocp.StandardCheckpointHandler is orbax_scope.StandardHandler
  back = ocp.StandardCheckpointer().restore(tmp_path / 'c', target)  # Orbax's: no budget
  assert ocp.StandardCheckpointHandler is not orbax_scope.StandardHandler
  for k in tree:
    np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))


def test_a_pytree_loader_reads_part_of_a_checkpoint_inside_the_block(tmp_path):
  """MaxText's `load_params_from_path`: the params of a full training state,
  through Orbax's PyTreeCheckpointer with `transforms={}`; the same values
  and shardings as Orbax's own restore, and refused below the budget."""
  params = _tree()
  full = {'params': params, 'opt_state': {'mu': _tree()}, 'step': 7}
  ocp.PyTreeCheckpointer().save(tmp_path / 'c', full)
  target = states.abstract_of(params)

  def load():
    return ocp.PyTreeCheckpointer().restore(
        tmp_path / 'c', item={'params': target}, transforms={},
        restore_args={'params': ocp.checkpoint_utils.construct_restore_args(target)})['params']

  want = load()
  with kd_ckpt.within_budget('64MiB'):
    got = load()
    with pytest.raises(kd_ckpt.BudgetTooSmallError, match="Raise host_ram_budget to '"):
      with kd_ckpt.within_budget('1MiB'):
        load()
    assert ocp.PyTreeCheckpointHandler is orbax_scope.PyTreeHandler
  assert ocp.PyTreeCheckpointHandler is not orbax_scope.PyTreeHandler
  assert sorted(got) == sorted(params)
  for k in params:
    assert got[k].sharding == want[k].sharding
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def test_a_save_inside_the_block_is_a_stock_checkpoint(tmp_path):
  tree = _tree()
  with kd_ckpt.within_budget('64MiB', strategy='streaming'):
    with ocp.StandardCheckpointer() as c:
      c.save(tmp_path / 'c', tree)
  # kd_ckpt's writer records a CRC32C per slice; Orbax's does not.
  assert kd_ckpt.verify(tmp_path / 'c').ok
  with ocp.StandardCheckpointer() as c:  # stock Orbax reads it
    back = c.restore(tmp_path / 'c', states.abstract_of(tree))
  for k in tree:
    np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))


@pytest.mark.parametrize('budget, strategy, match', [
    ('lots', 'auto', 'lots'), ('8GiB', 'fastest', 'fastest'), (-3, 'auto', '-3')])
def test_bad_arguments_are_named_before_the_block_runs(budget, strategy, match):
  ran = []
  with pytest.raises(ValueError, match=match):
    with kd_ckpt.within_budget(budget, strategy=strategy):
      ran.append(1)
  assert not ran
  assert ocp.StandardCheckpointHandler is not orbax_scope.StandardHandler


def test_an_error_in_the_block_puts_orbax_back_and_blocks_nest(tmp_path):
  stock_cls = ocp.StandardCheckpointHandler
  with pytest.raises(KeyError):
    with kd_ckpt.within_budget('64MiB'):
      with kd_ckpt.within_budget('1MiB'):
        assert orbax_scope._scopes[-1][0] == '1MiB'  # pylint: disable=protected-access
      assert orbax_scope._scopes[-1][0] == '64MiB'  # pylint: disable=protected-access
      raise KeyError('in the block')
  assert ocp.StandardCheckpointHandler is stock_cls
  assert ocp.PyTreeCheckpointHandler is not orbax_scope.PyTreeHandler
  assert not orbax_scope._scopes  # pylint: disable=protected-access


def test_init_within_budget_names_a_bad_budget_when_built():
  kd_ckpt_kauldron = pytest.importorskip('kd_ckpt.kauldron')
  from kauldron import kd  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match='lots'):
    kd_ckpt_kauldron.InitWithinBudget(wrapped=kd.ckpts.NoopTransform(), host_ram_budget='lots')


def test_init_within_budget_runs_the_wrapped_loader_inside_the_block(tmp_path, caplog):
  kd_ckpt_kauldron = pytest.importorskip('kd_ckpt.kauldron')
  from kauldron import kd  # pylint: disable=g-import-not-at-top
  tree = _tree()
  with ocp.StandardCheckpointer() as c:
    c.save(tmp_path / 'c', tree)
  target = states.abstract_of(tree)

  class Load(kd.ckpts.InitTransform):
    """Loads the weights with a StandardCheckpointer of its own, as Gemma's does."""

    def transform(self, state):
      return ocp.StandardCheckpointer().restore(tmp_path / 'c', state)

  class LoadTree(kd.ckpts.InitTransform):
    """The same through a PyTreeCheckpointer, as MaxText's loader does."""

    def transform(self, state):
      return ocp.PyTreeCheckpointer().restore(
          tmp_path / 'c', item=state,
          restore_args=ocp.checkpoint_utils.construct_restore_args(state))

  caplog.set_level('INFO')
  for loader in (Load(), LoadTree()):
    back = kd_ckpt_kauldron.InitWithinBudget(wrapped=loader, host_ram_budget='64MiB').transform(
        target)
    for k in tree:
      np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))
  # Nothing loaded after the optimizer: no line for it.
  assert kd_ckpt_kauldron.InitWithinBudget(
      wrapped=Load(), host_ram_budget='64MiB').transform_after_optimizer(target) is target
  lines = [r.getMessage() for r in caplog.records if 'kd_ckpt init' in r.getMessage()]
  assert len(lines) == 2 and 'LoadTree.transform read through kd_ckpt' in lines[1], lines
  assert lines[0].startswith(
      'kd_ckpt init: Load.transform read through kd_ckpt inside host_ram_budget=64MiB:'
      ' peak extra RSS '), lines
  with pytest.raises(kd_ckpt.BudgetTooSmallError):  # the budget binds the loader's reads
    kd_ckpt_kauldron.InitWithinBudget(wrapped=Load(), host_ram_budget='1MiB').transform(target)
  assert ocp.StandardCheckpointHandler is not orbax_scope.StandardHandler


def test_kauldrons_checkpoint_loaders_read_through_kd_ckpt_inside_the_block(tmp_path):
  """Kauldron's `Checkpointer` (an Orbax CheckpointManager) looks a restore's
  handler up by its args' exact class: inside a block every one of its
  restores failed ('does not match with any registered handler'), so
  `InitWithinBudget(wrapped=kd.ckpts.SimpleCheckpointLoader(...))`, a
  fine-tune's start from another Kauldron run, could not load at all.  Now
  its reads go through kd_ckpt, within the budget, and after the block
  Orbax's args name Orbax's handlers again."""
  kd_ckpt_kauldron = pytest.importorskip('kd_ckpt.kauldron')
  import flax  # pylint: disable=g-import-not-at-top
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  @flax.struct.dataclass
  class State(kd.ckpts.items.StandardCheckpointItem):
    step: int
    params: dict
    opt_state: dict
    collections: dict

  tree = _tree()
  with kd_ckpt.SafeCheckpointer(workdir=tmp_path / 'w', save_interval_steps=1) as ckpt:
    ckpt.save(State(step=2, params=tree, opt_state={'m': jax.numpy.zeros(3)}, collections={}),
              step=2)
    ckpt.wait_until_finished()
  fresh = lambda: State(step=0, params=states.abstract_of(tree),
                        opt_state={'m': jax.numpy.ones(3)}, collections={})
  before = orbax_scope.restores_read()
  loader = kd.ckpts.SimpleCheckpointLoader(workdir=tmp_path / 'w')
  back = kd_ckpt_kauldron.InitWithinBudget(wrapped=loader, host_ram_budget='64MiB').transform(
      fresh())
  loader.close()
  assert orbax_scope.restores_read() == before + 1
  for k in tree:
    np.testing.assert_array_equal(np.asarray(back.params[k]), np.asarray(tree[k]))
  np.testing.assert_array_equal(np.asarray(back.opt_state['m']), np.ones(3))  # not loaded
  # The whole state through a Checkpointer built in the block, and the budget binds it.
  with kd_ckpt.within_budget('64MiB'):
    with kd.ckpts.Checkpointer(workdir=tmp_path / 'w', save_interval_steps=1) as ckpt:
      back = ckpt.restore(fresh(), step=2, donate=False)
  np.testing.assert_array_equal(np.asarray(back.opt_state['m']), np.zeros(3))
  assert orbax_scope.restores_read() == before + 2
  with pytest.raises(kd_ckpt.BudgetTooSmallError):
    with kd_ckpt.within_budget('1MiB'):
      with kd.ckpts.Checkpointer(workdir=tmp_path / 'w', save_interval_steps=1) as ckpt:
        ckpt.restore(fresh(), step=2, donate=False)
  for args_cls in (ocp.args.StandardSave, ocp.args.StandardRestore, ocp.args.PyTreeSave,
                   ocp.args.PyTreeRestore):
    assert ocp.args.get_registered_handler_cls(args_cls).__module__.startswith('orbax.'), args_cls


@pytest.mark.slow
def test_kauldrons_loader_of_another_run_reads_within_the_budget(tmp_path):
  """`InitWithinBudget(wrapped=kd.ckpts.SimpleCheckpointLoader(...))` in a
  fresh process, from a Kauldron run's checkpoint (compressed, Orbax's
  format): within the budget, where the loader alone is not."""
  pytest.importorskip('kd_ckpt.kauldron')
  d = str(tmp_path / 'w')
  states.run_worker('ckpt', d, 'mesh2d_prime', str(STATE_BYTES), 'orbax', str(1 << 30))
  got = {}
  for via in ('simple', 'simple_stock'):
    r = states.run_worker('restore', d, 'mesh2d_prime', str(STATE_BYTES), str(BUDGET), via)
    got[via] = r['peak_extra_bytes'] - r['restored_bytes']
  print(f"SimpleCheckpointLoader: {got['simple'] / MiB:.1f} MiB beyond the restored arrays in"
        f" InitWithinBudget ({BUDGET // MiB} MiB), {got['simple_stock'] / MiB:.1f} MiB alone")
  assert got['simple'] <= BUDGET + TOLERANCE, got
  assert got['simple_stock'] > BUDGET + TOLERANCE, got  # what the budget stands against
