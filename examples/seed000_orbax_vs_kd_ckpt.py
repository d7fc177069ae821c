r"""Seed 000 ("Saving a checkpoint requires at least 3x more RAM than the array").

The reporter's script saves a 1B-parameter f32 array (4 GB) in a flax
`TrainState` through an Orbax `CheckpointManager`, and watched RSS grow by up
to 14 GB.  This runs that script as written (`save_with_orbax`) and the same
state through `kd_ckpt.save` (`save_with_kd_ckpt`), each in a fresh
subprocess, and prints the peak extra RSS of each save side by side.

```sh
python examples/seed000_orbax_vs_kd_ckpt.py         # 2.5e8 params (1 GB), 256 MiB budget
python examples/seed000_orbax_vs_kd_ckpt.py --params=1e9 --host-ram-budget=auto
```

Peak extra RSS = peak RSS during the save minus RSS just before it, read from
the kernel's high-water mark (`kd_ckpt.PeakRss`).  On the CPU backend the
device->host copy is free (a numpy view of the array), so Orbax looks better
here than on GPU/TPU; kd_ckpt budgets as if the copy were real.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import subprocess
import sys
import tempfile


def make_state(params: float):
  """The seed's state: one (dim1, dim1) f32 array in a flax TrainState."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax.training.train_state import TrainState  # pylint: disable=g-import-not-at-top

  dim1 = int(params**0.5)
  weight = jax.random.uniform(
      jax.random.PRNGKey(123), shape=(dim1, dim1), dtype=jnp.float32
  )
  weight.block_until_ready()
  print(f'{dim1=}')
  print(f'{weight.size=}; Total GB: {4 * weight.size / 1e9}')
  return TrainState(step=0, apply_fn=None, params=weight, tx=None, opt_state=None)


def save_with_orbax(state, checkpoint_dir: str) -> None:
  """The seed's save, unchanged: async CheckpointManager, OCDBT + zarr3."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top

  p = epath.Path(checkpoint_dir)
  p.mkdir(exist_ok=True, parents=True)

  item_handlers = {
      'items': ocp.PyTreeCheckpointHandler(
          save_concurrent_gb=8, use_ocdbt=True, use_zarr3=True
      )
  }
  checkpoint_manager = ocp.CheckpointManager(
      p,
      item_names=('items',),
      item_handlers=item_handlers,
      options=ocp.CheckpointManagerOptions(
          create=True,
          save_interval_steps=10,
          enable_async_checkpointing=True,
      ),
      logger=None,
  )

  chunk_byte_size = 2 * 1024**3  # 2 GB
  save_args = jax.tree.map(
      lambda _: ocp.SaveArgs(chunk_byte_size=chunk_byte_size), state
  )

  step = 10
  checkpoint_manager.save(
      step,
      args=ocp.args.Composite(
          items=ocp.args.PyTreeSave(
              item=state,
              save_args=save_args,
              ocdbt_target_data_file_size=chunk_byte_size,
          )
      ),
  )

  checkpoint_manager.wait_until_finished()


def save_with_kd_ckpt(state, checkpoint_dir: str, host_ram_budget: str):
  """The same save through kd_ckpt: one call, blocks until durable."""
  import kd_ckpt  # pylint: disable=g-import-not-at-top

  step = 10
  return kd_ckpt.save(
      os.path.join(checkpoint_dir, str(step)),
      state,
      host_ram_budget=host_ram_budget,
  )


def _worker(args: argparse.Namespace) -> None:
  """One save in this (fresh) process; prints one JSON line."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top

  state = make_state(args.params)
  checkpoint_dir = args.checkpoint_dir
  report = None
  # Same start for both: return the heap's free memory (e.g. the PRNG's
  # temporaries) to the OS, so "before" is not inflated by slack the save
  # would reuse.
  _trim_heap()
  with kd_ckpt.PeakRss() as peak:
    if args.worker == 'orbax':
      save_with_orbax(state, checkpoint_dir)
    else:
      report = save_with_kd_ckpt(state, checkpoint_dir, args.host_ram_budget)
  result = {
      'who': args.worker,
      'state_bytes': int(state.params.nbytes),
      'peak_extra_bytes': peak.extra_bytes,
      'retained_bytes': peak.retained_bytes,
      'exact_peak': peak.exact,
  }
  if report is not None:
    result['strategy'] = f'{report.strategy} ({report.settings})'
    result['budget_bytes'] = report.budget_bytes
    # Read it back (outside the measurement) to show it is a real checkpoint.
    restored = kd_ckpt.restore(
        os.path.join(checkpoint_dir, '10'), jax.eval_shape(lambda: state)
    )
    result['restored_equal'] = bool(
        np.array_equal(np.asarray(restored.params), np.asarray(state.params))
    )
  print('RESULT ' + json.dumps(result), flush=True)


def _trim_heap() -> None:
  gc.collect()
  try:
    ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass  # not glibc


def _run_worker(who: str, args: argparse.Namespace, root: str) -> dict:
  cmd = [
      sys.executable, os.path.abspath(__file__),
      f'--worker={who}',
      f'--params={args.params}',
      f'--host-ram-budget={args.host_ram_budget}',
      f'--checkpoint-dir={os.path.join(root, who)}',
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  for line in proc.stdout.splitlines():
    if line.startswith('RESULT '):
      return json.loads(line.removeprefix('RESULT '))
  sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
  raise SystemExit(f'{who} worker failed (exit {proc.returncode})')


def _gib(num_bytes: float) -> str:
  return f'{num_bytes / 2**30:.2f} GiB'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument(
      '--params', type=float, default=2.5e8,
      help='number of f32 parameters (the seed used 1e9: 4 GB)',
  )
  parser.add_argument(
      '--host-ram-budget', default='256MiB',
      help=(
          'kd_ckpt budget: "1GiB", bytes, a fraction, or "auto" (then, with'
          ' RAM to spare, kd_ckpt picks the same fast async save as Orbax)'
      ),
  )
  parser.add_argument('--checkpoint-dir', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--worker', choices=('orbax', 'kd_ckpt'), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    _worker(args)
    return

  with tempfile.TemporaryDirectory(prefix='seed000_') as root:
    results = [_run_worker(who, args, root) for who in ('orbax', 'kd_ckpt')]

  state_bytes = results[0]['state_bytes']
  print(f'\nstate: {args.params:.3g} f32 params = {_gib(state_bytes)}')
  print(f'{"save":<10}{"peak extra RSS":>16}{"x state":>9}{"retained":>12}  how')
  for r in results:
    how = r.get('strategy', 'CheckpointManager, async, ocdbt+zarr3 (seed 000)')
    if 'budget_bytes' in r:
      how += f', budget {_gib(r["budget_bytes"])}'
    print(
        f'{r["who"]:<10}{_gib(r["peak_extra_bytes"]):>16}'
        f'{r["peak_extra_bytes"] / state_bytes:>9.2f}'
        f'{_gib(r["retained_bytes"]):>12}  {how}'
    )
  kd = results[1]
  if 'restored_equal' in kd:
    print(f'kd_ckpt checkpoint restored bit-exact: {kd["restored_equal"]}')


if __name__ == '__main__':
  main()
