r"""A plain-Orbax training loop switched from `CheckpointManager` to kd_ckpt.

Before (the usual Orbax loop):

```python
mgr = ocp.CheckpointManager(
    ckpt_dir,
    options=ocp.CheckpointManagerOptions(save_interval_steps=50, max_to_keep=3),
)
if mgr.latest_step() is not None:
  state = mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(abstract))
for step in range(start, num_steps):
  state = train_step(state, batch)
  mgr.save(step, args=ocp.args.StandardSave(state))
mgr.wait_until_finished()
```

After (this file): `kd_ckpt.save(f'{ckpt_dir}/{step}', state)` and
`kd_ckpt.restore(...)`, with the interval and `max_to_keep` done by hand
(`should_save`, `cleanup`).  Each save is planned against the host-RAM
budget, blocks until durable and returns a `SaveReport` with the measured
peak.  Each step folder is a stock Orbax PyTree checkpoint:
`ocp.StandardCheckpointer().restore(path, abstract)` reads it too.

```sh
python examples/orbax_manager_loop.py --ckpt-dir=/tmp/loop --steps=200
python examples/orbax_manager_loop.py --ckpt-dir=/tmp/loop --steps=300   # resumes
XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python examples/orbax_manager_loop.py --ckpt-dir=/tmp/loop8 --host-ram-budget=64MiB
```
"""

from __future__ import annotations

import argparse
import os
import re
import shutil

import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kd_ckpt

_STEP_DIR = re.compile(r'^\d+$')  # Orbax writes `<step>.orbax-checkpoint-tmp*` first.


class Mlp(nn.Module):
  hidden: int = 1024

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(1)(x)


def create_state(mesh: jax.sharding.Mesh) -> train_state.TrainState:
  model = Mlp()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 64)))['params']
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)
  )
  # FSDP-style: shard every array's first axis over the devices when it
  # divides, replicate the rest (scalars, biases of odd sizes).
  def shard(x):
    x = jnp.asarray(x)  # TrainState.step starts as a Python int
    axis = 'data' if x.ndim and x.shape[0] % mesh.size == 0 else None
    spec = jax.sharding.PartitionSpec(axis) if x.ndim else jax.sharding.PartitionSpec()
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

  return jax.tree.map(shard, state)


@jax.jit
def train_step(state, x, y):
  def loss_fn(params):
    pred = state.apply_fn({'params': params}, x)
    return jnp.mean((pred - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def saved_steps(ckpt_dir: str) -> list[int]:
  """Finished checkpoints, oldest first (Orbax renames a step dir when done)."""
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(int(n) for n in os.listdir(ckpt_dir) if _STEP_DIR.match(n))


def should_save(step: int, interval: int, last_step: int) -> bool:
  return step % interval == 0 or step == last_step


def cleanup(ckpt_dir: str, max_to_keep: int) -> None:
  """`CheckpointManagerOptions(max_to_keep=...)`: drop the oldest steps."""
  for step in saved_steps(ckpt_dir)[:-max_to_keep]:
    shutil.rmtree(os.path.join(ckpt_dir, str(step)))


def main() -> None:
  parser = argparse.ArgumentParser(description='Orbax-style loop on kd_ckpt.')
  parser.add_argument('--ckpt-dir', default='/tmp/kd_ckpt_loop')
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--save-interval-steps', type=int, default=50)
  parser.add_argument('--max-to-keep', type=int, default=3)
  parser.add_argument('--host-ram-budget', default='auto')
  args = parser.parse_args()

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  state = create_state(mesh)

  # Resume: the abstract state carries the shardings to restore into.
  steps = saved_steps(args.ckpt_dir)
  if steps:
    abstract = jax.eval_shape(lambda: state)
    state = kd_ckpt.restore(
        os.path.join(args.ckpt_dir, str(steps[-1])), abstract,
        host_ram_budget=args.host_ram_budget,
    )
    print(f'restored step {int(state.step)} from {args.ckpt_dir}/{steps[-1]}')
  start = int(state.step)

  rng = np.random.default_rng(0)
  w = rng.normal(size=(64, 1)).astype(np.float32)
  loss = float('nan')
  for step in range(start + 1, args.steps + 1):
    x = rng.normal(size=(32, 64)).astype(np.float32)
    state, loss = train_step(state, x, x @ w)
    if should_save(step, args.save_interval_steps, args.steps):
      report = kd_ckpt.save(
          os.path.join(args.ckpt_dir, str(step)), state,
          host_ram_budget=args.host_ram_budget,
      )
      cleanup(args.ckpt_dir, args.max_to_keep)
      print(f'step {step}: loss {float(loss):.4f}; saved: {report.summary()}')
  print(f'done at step {int(state.step)}; kept steps {saved_steps(args.ckpt_dir)}')


if __name__ == '__main__':
  main()
