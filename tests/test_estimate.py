"""The preflight on 8 fake CPU devices: exact byte counts, and the Orbax worst
case checked against the measured peak of an Orbax-strategy save."""

import jax
import pytest

from kd_ckpt import cost
from kd_ckpt import estimate
from tests import states

MiB = 1 << 20
P, NS = states.P, states.NS


def _abstract(shape, sharding, dtype='float32'):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_sharded_leaf():
  m1, _ = states.meshes()
  leaf = estimate.estimate_leaf('w', _abstract((1024, 256), NS(m1, P('x'))))
  assert leaf.global_bytes == 1024 * 256 * 4
  assert leaf.shard_bytes == leaf.global_bytes // 8
  assert leaf.num_replicas == 1
  assert leaf.write_bytes == leaf.global_bytes  # all 8 shards live here
  assert not leaf.replica_parallel_applies


def test_replicated_leaf_is_written_once():
  m1, _ = states.meshes()
  leaf = estimate.estimate_leaf('w', _abstract((1024, 256), NS(m1, P())))
  assert leaf.num_replicas == 8
  assert leaf.write_bytes == leaf.global_bytes  # replica 0 only
  assert leaf.write_bytes_replica_parallel == leaf.global_bytes  # 8 x 1/8
  assert leaf.replica_parallel_applies


def test_2d_mesh_partially_replicated():
  _, m2 = states.meshes()
  leaf = estimate.estimate_leaf('w', _abstract((64, 32), NS(m2, P(None, 'b')), 'bfloat16'))
  assert leaf.shard_bytes == 64 * 16 * 2
  assert leaf.num_replicas == 4
  assert leaf.write_bytes == 64 * 32 * 2


def test_replica_parallel_needs_a_divisible_axis():
  m1, _ = states.meshes()
  leaf = estimate.estimate_leaf('w', _abstract((7, 3), NS(m1, P())))
  assert not leaf.replica_parallel_applies
  assert leaf.write_bytes_replica_parallel == leaf.write_bytes == 7 * 3 * 4


def test_host_values_and_eval_shape():
  m1, _ = states.meshes()
  tree = {'a': _abstract((16, 16), NS(m1, P('x'))), 'step': 3, 'np': __import__('numpy').zeros(5)}
  est = estimate.estimate_tree(tree)
  assert est.num_leaves == 3
  assert est.total_bytes() == 16 * 16 * 4 + 8 + 40
  assert 'a' in str(est)


def test_deleted_array_is_named():
  x = jax.numpy.ones(4)
  x.delete()
  with pytest.raises(ValueError, match="Leaf 'x'.*deleted"):
    estimate.estimate_tree({'x': x})


def test_gpu_model_counts_host_copies_and_pinned():
  m1, _ = states.meshes()
  est = estimate.estimate_tree({'w': _abstract((1024, 1024), NS(m1, P('x')))}, platform='gpu')
  plain = cost.predict_orbax_async(est, use_replica_parallel=True, enable_pinned_host_transfer=False)
  pinned = cost.predict_orbax_async(est, use_replica_parallel=True, enable_pinned_host_transfer=True)
  assert plain.host_copy_bytes == 4 * MiB
  assert pinned.peak_bytes == plain.peak_bytes + 4 * MiB


def test_prng_keys_are_estimated_as_their_key_data():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  est = estimate.estimate_tree({'k': jax.random.split(jax.random.key(0), 5)})
  assert est.leaves[0].shape == (5, 2) and est.leaves[0].global_bytes == 5 * 2 * 4
  del jnp


def test_tree_estimate_equals_each_leaf_estimated_alone():
  """Leaves sharing shape, dtype and sharding are worked out once per tree:
  every leaf's estimate (its own path included) is what it is alone."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  m1, m2 = states.meshes()
  row, rep = NS(m1, P('x')), NS(m2, P(None, 'b'))
  tree = {f'layer{i}': {'w': jax.device_put(np.full((16, 6), i, np.float32), row),
                        'v': jax.device_put(np.full((16, 6), i, np.float32), rep),
                        'b': jax.numpy.full((7,), i, jax.numpy.bfloat16)}
          for i in range(3)}
  tree['odd'] = jax.device_put(np.zeros((16, 6), np.int32), row)  # same shape, other dtype
  tree['key'] = jax.random.split(jax.random.key(0), 8)
  tree['np'] = np.zeros((16, 6), np.float32)
  est = estimate.estimate_tree(tree)
  from kd_ckpt import tree as tree_lib  # pylint: disable=g-import-not-at-top
  alone = tuple(estimate.estimate_leaf(l.name, l.value) for l in tree_lib.leaves(tree))
  assert est.leaves == alone
  assert len({l.path for l in est.leaves}) == len(alone) == 3 * 3 + 3
  assert {l.num_replicas for l in est.leaves if l.path.endswith('v')} == {4}
  tree['layer1']['w'].delete()  # a deleted leaf among shared ones is still named
  with pytest.raises(ValueError, match="Leaf 'layer1.w'.*deleted"):
    estimate.estimate_tree(tree)


@pytest.mark.slow
@pytest.mark.parametrize('layout', ['sharded', 'replicated', 'mixed', 'mesh2d'])
def test_orbax_worst_case_is_never_below_the_measured_peak(tmp_path, layout):
  """The Orbax path cannot be enforced, so its prediction must be an upper bound."""
  out = states.run_worker('save', str(tmp_path / 'c'), layout, str(512 * MiB), 'orbax', '4GiB')
  predicted, measured = out['predicted_peak_bytes'], out['peak_extra_bytes']
  print(f'{layout}: worst case {predicted / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB')
  assert measured <= predicted + 8 * MiB, (predicted, measured)


def test_a_named_budget_is_whole_mib_with_room_for_a_new_processes_start_up():
  """Refusals name a budget the next process accepts: rounded up, never
  down, with headroom for a start-up measured up to 5.1 MiB apart."""
  from kd_ckpt import text  # pylint: disable=g-import-not-at-top
  MiB = 1 << 20  # pylint: disable=invalid-name
  assert cost.suggested_budget_bytes(45 * MiB) == 45 * MiB
  assert cost.suggested_budget_bytes(45 * MiB + 1) == 46 * MiB
  named = cost.suggested_budget_bytes(int(43.94 * MiB), startup_bytes=int(16.6 * MiB))
  assert named >= int((43.94 + 1.5) * MiB) and named % MiB == 0
  # 4.5-7.7 MiB apart in restores of one drawn state (fuzz seed 226).
  named = cost.suggested_budget_bytes(int(30.7 * MiB + 4.5 * MiB), startup_bytes=int(4.5 * MiB))
  assert named >= int((30.7 + 7.7) * MiB)
  # About 6 MiB in the refused process, 11.12 MiB in the retry (fuzz seed 639,
  # an `orbax` save that needed 28.91 MiB beyond its start-up).
  named = cost.suggested_budget_bytes(int((28.91 + 6) * MiB), startup_bytes=6 * MiB)
  assert named >= int((28.91 + 11.12) * MiB), named / MiB
  assert text.budget_literal(47 * MiB) == "'47MiB'"
  assert text.budget_literal(2048 * MiB) == "'2GiB'"
  assert text.budget_literal(47 * MiB + 1) == "'48MiB'"
