"""Test states on 8 fake CPU devices, and a subprocess runner for measurements.

Each measured save runs in a fresh process (`python -m tests.states ...`), so
one test's heap never flatters or spoils another's peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

P = jax.sharding.PartitionSpec
NS = jax.sharding.NamedSharding
MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def meshes():
  devs = np.array(jax.devices())
  return (jax.sharding.Mesh(devs.reshape(8), ('x',)),
          jax.sharding.Mesh(devs.reshape(4, 2), ('a', 'b')))


def filled(shape, sharding, dtype=jnp.float32, seed=0):
  """A deterministic array made on its devices (no host copy, no temporaries)."""
  n = int(np.prod(shape))

  def f():
    # Hash-like noise: as incompressible as trained weights' mantissas, and
    # fused by XLA into one pass (no temporaries beside the output).
    i = jnp.arange(n, dtype=jnp.float32)
    u = jnp.sin(i * 12.9898 + seed * 78.233) * 43758.5453
    u = u - jnp.floor(u)  # uniform in [0, 1)
    if jnp.issubdtype(dtype, jnp.integer):
      return (u * 255 - 128).reshape(shape).astype(dtype)
    return ((u - 0.5) * 4).reshape(shape).astype(dtype)

  return jax.jit(f, out_shardings=sharding)()


def layout(name: str, total_bytes: int = 256 * MiB, n: int = 16):
  """sharded | replicated | mixed | mesh2d: n leaves of total_bytes."""
  m1, m2 = meshes()
  shs = {
      'sharded': [NS(m1, P('x'))],
      'replicated': [NS(m1, P())],
      'mesh2d': [NS(m2, P('a', 'b'))],
      'mixed': [NS(m1, P('x')), NS(m1, P()), NS(m2, P('a', 'b')), NS(m2, P(None, 'b'))],
  }[name]
  dts = [jnp.float32, jnp.bfloat16, jnp.float32, jnp.int8] if name == 'mixed' else [jnp.float32]
  tree = {}
  for i in range(n):
    dt = dts[i % len(dts)]
    rows = total_bytes // n // jnp.dtype(dt).itemsize // 1024 // 8 * 8
    tree[f'l{i:02d}'] = filled((rows, 1024), shs[i % len(shs)], dt, i)
  return tree


def one_replicated(total_bytes: int):
  m1, _ = meshes()
  return {'w': filled((total_bytes // 4 // 1024, 1024), NS(m1, P()))}


def make_state(name: str, total_bytes: int):
  if name == 'one_replicated':
    return one_replicated(total_bytes)
  return layout(name, total_bytes)


def run_worker(*args: str, timeout: int = 600) -> dict:
  """Runs `python -m tests.states ARGS` in a fresh process; returns its JSON."""
  env = dict(os.environ)
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  proc = subprocess.run(
      [sys.executable, '-m', 'tests.states', *args], cwd=REPO, env=env,
      capture_output=True, text=True, timeout=timeout,
  )
  if proc.returncode != 0:
    raise AssertionError(f'worker {args} failed:\n{proc.stderr[-4000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _worker(argv):
  """save DIR STATE TOTAL_BYTES STRATEGY BUDGET | orbax DIR STATE TOTAL_BYTES"""
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  mode, directory, state, total = argv[0], argv[1], argv[2], int(argv[3])
  tree = make_state(state, total)
  jax.block_until_ready(tree)
  if mode == 'save':
    strategy, budget = argv[4], argv[5]
    budget = int(budget) if budget.isdigit() else budget
    r = kd_ckpt.save(directory, tree, host_ram_budget=budget, strategy=strategy)
    out = r.to_json_dict()
  elif mode == 'orbax':
    # Orbax's default save of the same tree, measured the same way.
    plan = kd_ckpt.plan_save(tree, host_ram_budget=1 << 40, strategy='orbax')
    hostmem.release_free_memory()
    with hostmem.PeakRss() as peak:
      start = time.monotonic()
      ckptr = ocp.StandardCheckpointer()
      ckptr.save(directory, tree)
      ckptr.wait_until_finished()
      seconds = time.monotonic() - start
    default = [c for c in plan.candidates if c.name == 'orbax async zstd'][0]
    out = {'peak_extra_bytes': peak.extra_bytes, 'seconds': seconds,
           'predicted_default_bytes': kd_ckpt.plan.estimate_lib.predict_orbax(
               plan.estimate, use_replica_parallel=True,
               enable_pinned_host_transfer=False, use_compression=True).peak_bytes,
           'chosen_candidate_bytes': default.predicted_peak_bytes}
  elif mode == 'restore':
    budget = argv[4]
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    # On CPU every device buffer of the restored arrays is host RAM.
    restored_bytes = sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)
    del tree
    hostmem.release_free_memory()
    with hostmem.PeakRss() as peak:
      back = kd_ckpt.restore(directory, abstract, host_ram_budget=budget)
      jax.block_until_ready(back)
    out = {'peak_extra_bytes': peak.extra_bytes, 'restored_bytes': restored_bytes,
           'budget_bytes': kd_ckpt.budget.resolve(budget, hostmem.probe())}
  else:
    raise SystemExit(f'unknown mode {mode!r}')
  print(json.dumps(out))


if __name__ == '__main__':
  _worker(sys.argv[1:])
