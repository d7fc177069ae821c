"""A process that saves checkpoints and dies by SIGKILL at a chosen point.

Used by tests/test_crash_safety.py.  The kill points are armed here, by
wrapping Orbax/kd_ckpt functions in this (test) process only; kd_ckpt has no
test hooks.

  python -m tests.crash_worker save API STRATEGY POINT DIR
      API: 'ckpt' -- kd_ckpt.SafeCheckpointer into the Kauldron layout
           (DIR/checkpoints/ckpt_N/default); 'api' -- kd_ckpt.save(DIR/N).
      Saves steps 0 and 1, then dies at POINT while saving step 2.
  python -m tests.crash_worker train STEP POINT KAULDRON_MAIN_ARGS...
      Runs `python -m kauldron.main KAULDRON_MAIN_ARGS` in this process and
      dies at POINT of SafeCheckpointer's save of step STEP.

Kill points (each prints "CRASH_WORKER KILL <point>" to stderr, then SIGKILLs
its own process):

  d2h      the save's first device-to-host copy: kd_ckpt.streaming.to_host
           (streaming), Orbax's replica_slices.transfer_arrays_to_host (orbax).
  write    data half written: streaming, before the middle slice of the
           8 MiB leaf (the first ones staged or committed to the OCDBT database);
           orbax, once the first array's TensorStore write has returned, the
           others still in flight.
  merge    the handler's finalize: before Orbax merges the per-process OCDBT
           databases.
  rename   everything written, items renamed, commit_success.txt written:
           just before the atomic rename of `<step>.orbax-checkpoint-tmp` to
           `<step>` (the commit).
  renamed  just after that rename (the checkpoint is complete).
  reuse    a reusing save (reuse_unchanged / reuse_from), after the previous
           step's data files are hard-linked into the new one, before any
           reference is copied.

Exit status: -9 (SIGKILL) when the kill point was reached; otherwise 3
(`save`) or kauldron.main's own (`train`).
"""

from __future__ import annotations

import functools
import os
import runpy
import signal
import sys
from typing import Any

import flax
import jax
import jax.numpy as jnp
from kauldron.checkpoints import checkpoint_items
import numpy as np

from tests import states

# kd_ckpt's budget per strategy: streaming at 32 MiB cuts the 8 MiB leaf into
# 1 MiB slices (see _mid_slice); orbax under 'auto' is Orbax's async save.
BUDGETS = {'orbax': 'auto', 'streaming': '32MiB'}
# A reusing save also pays for the programs its fingerprints compile (8 here,
# `reuse.fingerprint_programs`: 12 MiB charged), which 32 MiB cannot hold.
REUSE_BUDGETS = {**BUDGETS, 'streaming': '48MiB'}
BIG_SHAPE = (2048, 1024)  # f32, 8 MiB, on one device
KILLED_STEP = 2  # `save` mode: steps 0 and 1 complete, dies saving step 2
KILL_MARK = 'CRASH_WORKER KILL'


def make_tree(step: int) -> dict[str, Any]:
  """The deterministic tree saved at `step` (different values per step).

  An 8 MiB leaf on one device (several streaming slices), four 1 MiB leaves
  in mixed shardings and dtypes, a numpy array and a scalar (Orbax's own
  handlers, merged from the per-process OCDBT database at finalize).  Made
  on the host from a seeded generator: no compilation, same bytes in every
  process.
  """
  rng = np.random.default_rng(1000 + step)
  m1, m2 = states.meshes()
  ns, p = states.NS, states.P

  def arr(shape, dtype, sharding):
    if np.dtype(dtype).kind == 'i':
      x = rng.integers(-128, 128, size=shape).astype(dtype)
    else:
      x = rng.standard_normal(size=shape, dtype=np.float32).astype(dtype)
    return jax.device_put(x, sharding)

  return {
      'big': arr(BIG_SHAPE, np.float32, jax.sharding.SingleDeviceSharding(jax.devices()[0])),
      'mixed': {
          'sharded': arr((256, 1024), np.float32, ns(m1, p('x'))),
          'replicated': arr((512, 1024), jnp.bfloat16, ns(m1, p())),
          'mesh2d': arr((256, 1024), np.float32, ns(m2, p('a', 'b'))),
          'int8': arr((1024, 1024), np.int8, ns(m2, p(None, 'b'))),
      },
      'host': np.arange(1000, dtype=np.int32) * (step + 1),
      'step': jnp.asarray(step, jnp.int32),
      # The same at every step: what a reusing save takes by reference.
      'frozen': jax.device_put(
          np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024), ns(m1, p('x'))),
  }


@flax.struct.dataclass
class State(checkpoint_items.StandardCheckpointItem):
  """A Kauldron checkpoint item holding one tree (saved as item `default`)."""

  tree: Any


def checkpointer(workdir, strategy: str, reuse: bool = False):
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  # A training process has compiled its step before it saves or restores;
  # a cold process is test_budget.py's first-jit test.
  startup.start_compiler()
  return kd_ckpt.SafeCheckpointer(
      workdir=os.fspath(workdir), save_interval_steps=1,
      host_ram_budget=(REUSE_BUDGETS if reuse else BUDGETS)[strategy], strategy=strategy,
      reuse_unchanged=reuse)


# --- Kill points -----------------------------------------------------------

_armed = False  # the hooks do nothing until the save to kill starts


def _die(point: str) -> None:
  sys.stderr.write(f'{KILL_MARK} {point}\n')
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _mid_slice() -> int:
  """The slice of the big leaf to die before: past the first, before the last."""
  from kd_ckpt import budget  # pylint: disable=g-import-not-at-top
  from kd_ckpt import cost  # pylint: disable=g-import-not-at-top
  from kd_ckpt import hostmem  # pylint: disable=g-import-not-at-top
  from kd_ckpt import slicing  # pylint: disable=g-import-not-at-top

  nbytes = budget.resolve(BUDGETS['streaming'], hostmem.probe())
  slice_bytes = cost.streaming_layout(nbytes, num_leaves=2).slice_bytes
  chunk = slicing.chunk_shape(BIG_SHAPE, 4, slice_bytes, global_shape=BIG_SHAPE)
  n = len(list(slicing.boxes(BIG_SHAPE, chunk, 4, slice_bytes)))
  if n < 3:
    raise SystemExit(f'the big leaf makes {n} slices at {BUDGETS["streaming"]}: no middle')
  return n // 2 + 1


def _install(point: str, strategy: str) -> None:
  """Wraps the function where `point` is, for `strategy`'s code path."""
  from kd_ckpt import streaming  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.path import async_path  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.path import atomicity  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.serialization import ocdbt_utils  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.serialization import replica_slices  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.serialization import serialization  # pylint: disable=g-import-not-at-top

  def wrap(module, name, make):
    orig = getattr(module, name)
    setattr(module, name, functools.wraps(orig)(make(orig)))

  def die_first(orig):
    def first_call(*a, **k):
      if _armed:
        _die(point)
      return orig(*a, **k)
    return first_call

  if point == 'd2h' and strategy == 'streaming':
    wrap(streaming, 'to_host', die_first)
  elif point == 'd2h':
    wrap(replica_slices, 'transfer_arrays_to_host', die_first)
  elif point == 'write' and strategy == 'streaming':
    big_slices = [0]
    kill_at = _mid_slice()

    def make(orig):
      def to_host(data, box, **kwargs):
        if _armed and tuple(data.shape) == BIG_SHAPE:
          big_slices[0] += 1
          if big_slices[0] == kill_at:
            _die(point)
        return orig(data, box, **kwargs)
      return to_host
    wrap(streaming, 'to_host', make)
  elif point == 'write':
    def make(orig):
      async def write(*a, **k):
        out = await orig(*a, **k)
        if _armed:
          _die(point)
        return out
      return write
    wrap(serialization, 'async_serialize_from_host', make)
  elif point == 'merge':
    def make(orig):
      async def merge(*a, **k):
        if _armed:
          _die(point)
        return await orig(*a, **k)
      return merge
    wrap(ocdbt_utils, 'merge_ocdbt_per_process_files', make)
  elif point == 'reuse':
    from kd_ckpt import reuse  # pylint: disable=g-import-not-at-top

    def make(orig):
      async def copy(*a, **k):  # the previous step's files linked, nothing copied
        if _armed:
          _die(point)
        return await orig(*a, **k)
      return copy
    wrap(reuse, 'copy_leaves', make)
  elif point in ('rename', 'renamed'):
    def make(orig):
      async def rename(src, dst, *a, **k):
        # The step's own rename (the commit), not an item's inside it.
        name, parent = os.path.basename(src), os.path.dirname(src)
        is_commit = (_armed and atomicity.TMP_DIR_SUFFIX in name
                     and atomicity.TMP_DIR_SUFFIX not in parent)
        if is_commit and point == 'rename':
          _die(point)
        out = await orig(src, dst, *a, **k)
        if is_commit:
          _die(point)
        return out
      return rename
    wrap(async_path, 'rename', make)
  else:
    raise SystemExit(f'unknown kill point {point!r}')


# --- Modes -------------------------------------------------------------------


def _save(api: str, strategy: str, point: str, directory: str) -> None:
  global _armed
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  # A training process has compiled its step before it saves or restores;
  # a cold process is test_budget.py's first-jit test.
  startup.start_compiler()

  _install(point, strategy)
  reuse = point == 'reuse'
  if api == 'ckpt':
    ckpt = checkpointer(directory, strategy, reuse=reuse)

    def save(step, tree):
      ckpt.save(State(tree=tree), step=step)
      ckpt.wait_until_finished()
  elif api == 'api':
    def save(step, tree):
      prev = os.path.join(directory, str(step - 1)) if reuse and step else None
      kd_ckpt.save(os.path.join(directory, str(step)), tree,
                   host_ram_budget=(REUSE_BUDGETS if reuse else BUDGETS)[strategy],
                   strategy=strategy, fingerprint=reuse, reuse_from=prev)
  else:
    raise SystemExit(f'unknown api {api!r}')
  for step in range(KILLED_STEP + 1):
    tree = make_tree(step)
    jax.block_until_ready(tree)
    _armed = step == KILLED_STEP
    if _armed:
      print('ARMED', flush=True)
    save(step, tree)
  sys.exit(3)  # not killed: the kill point was never reached


def _train(step: int, point: str, argv: list[str]) -> None:
  """kauldron.main in this process, killed at `point` of the save of `step`."""
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  # A training process has compiled its step before it saves or restores;
  # a cold process is test_budget.py's first-jit test.
  startup.start_compiler()

  strategy = next((a.split('=', 1)[1] for a in argv
                   if a.startswith('--cfg.__args__.strategy=')), 'orbax')
  _install(point, 'streaming' if strategy == 'streaming' else 'orbax')
  kill_step = step
  cls = kd_ckpt.SafeCheckpointer
  orig_save = cls.save

  def save(self, state, *, step: int, **kwargs):  # pylint: disable=redefined-outer-name
    global _armed
    _armed = step == kill_step
    if _armed:
      print(f'ARMED step {step}', flush=True)
    return orig_save(self, state, step=step, **kwargs)

  cls.save = save
  sys.argv = ['kauldron.main', *argv]
  # What `python -m kauldron.main` runs; absl's app.run exits 0 at the end.
  runpy.run_module('kauldron.main', run_name='__main__', alter_sys=True)
  sys.exit(3)


def main(argv: list[str]) -> None:
  if argv[0] == 'save':
    _save(*argv[1:5])
  elif argv[0] == 'train':
    _train(int(argv[1]), argv[2], argv[3:])
  else:
    raise SystemExit(f'usage: {__doc__}')


if __name__ == '__main__':
  main(sys.argv[1:])
