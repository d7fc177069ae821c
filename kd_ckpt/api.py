"""`kd_ckpt.save` and `kd_ckpt.restore` for plain Orbax users.

Example (a MaxText-style loop):

  report = kd_ckpt.save(f'/ckpt/{step}', state, host_ram_budget='4GiB')
  print(report)
  abstract = jax.eval_shape(lambda: state)   # keeps the shardings
  state = kd_ckpt.restore(f'/ckpt/{step}', abstract, host_ram_budget='4GiB')

The checkpoint is a stock Orbax PyTree checkpoint:
`ocp.StandardCheckpointer().restore(path, abstract)` reads it without
kd_ckpt installed.
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp

from kd_ckpt import budget as budget_lib
from kd_ckpt import disk
from kd_ckpt import hostmem
from kd_ckpt import plan as plan_lib
from kd_ckpt import report as report_lib
from kd_ckpt import restoring
from kd_ckpt import verifying as verify_lib
from kd_ckpt import writer


def save(
    directory: str | os.PathLike[str],
    tree: Any,
    *,
    host_ram_budget: budget_lib.BudgetLike = 'auto',
    strategy: str = 'auto',
) -> report_lib.SaveReport:
  """Saves `tree` to `directory` within a host-RAM budget; blocks until durable.

  Args:
    directory: where to write; must not exist (an earlier checkpoint is never
      overwritten).  Orbax writes to a temporary name and renames at the end.
    tree: a pytree of jax.Arrays (any sharding), numpy arrays and scalars.
    host_ram_budget: extra host RAM the save may add; see `kd_ckpt.budget`.
    strategy: 'auto', 'orbax' or 'streaming'.

  Returns:
    A SaveReport with the measured peak extra RSS.

  Raises:
    FileExistsError: `directory` exists.
    ValueError: bad budget or strategy, or deleted/donated arrays in `tree`.
    BudgetTooSmallError: no strategy fits the budget.
    PermissionError: nothing can be created where `directory` goes.
    DiskFullError: the filesystem has no room, before writing (uncompressed
      saves) or during it; the partial files are removed either way.
  """
  path = epath.Path(directory)
  # Every check happens before anything is written.
  if path.exists():
    raise FileExistsError(
        f'Checkpoint directory {os.fspath(directory)!r} already exists.'
        ' kd_ckpt never overwrites a checkpoint: pass a new directory (e.g.'
        ' one per step) or delete the old one first.'
    )
  plan = plan_lib.plan_save(tree, host_ram_budget=host_ram_budget, strategy=strategy)
  logging.vlog(1, 'kd_ckpt save %s plan: %s', os.fspath(directory), plan.summary())
  disk.check_writable(path)
  needed_bytes = plan.estimate.global_bytes
  if plan.orbax is not None and not plan.orbax.use_compression:
    disk.check_free_space(path, needed_bytes)  # zstd output size is unknowable
  path.parent.mkdir(parents=True, exist_ok=True)
  if jax.process_index() == 0:
    # A save of this same directory that was killed: never a checkpoint.
    for stale in disk.remove_unfinished(path):
      logging.warning('kd_ckpt: removed %s, left by an unfinished save.', stale)

  handler = writer.SafePyTreeHandler()
  handler.use_plan(plan)
  checkpointer = ocp.Checkpointer(handler)
  # Start from a trimmed heap, so the peak counts what this save adds rather
  # than hiding in slack left by earlier work.
  hostmem.release_free_memory()
  with hostmem.PeakRss() as peak:
    start = time.monotonic()
    try:
      with jax.transfer_guard('allow'):
        checkpointer.save(path, args=writer.SafeSave(tree))
    except Exception as e:
      checkpointer.close()
      if jax.process_index() == 0:
        disk.remove_unfinished(path)
      if disk.is_disk_full(e):
        raise disk.DiskFullError.during_save(path, needed_bytes) from e
      raise
    checkpointer.close()
    seconds = time.monotonic() - start
    writer.after_save(tree)
  report = report_lib.SaveReport.measured(
      os.fspath(directory), plan, peak, seconds)
  if jax.process_index() == 0:
    report.write_json(path / report_lib.REPORT_FILE_NAME)
  logging.info('kd_ckpt saved %s: %s', os.fspath(directory), report.summary())
  return report


def restore(
    directory: str | os.PathLike[str],
    target: Any = None,
    *,
    host_ram_budget: budget_lib.BudgetLike = 'auto',
    verify: bool = False,
) -> Any:
  """Restores a checkpoint, reading leaf by leaf within a host-RAM budget.

  Args:
    directory: a checkpoint written by `kd_ckpt.save`, stock Orbax
      (`StandardCheckpointer`/`PyTreeCheckpointer`) or a Kauldron step's item
      folder (`ckpt_N/default`).
    target: a pytree of `jax.Array`s or `jax.ShapeDtypeStruct`s with
      shardings: the arrays are placed in those shardings, which may differ
      from the ones saved.  None restores with the saved shardings.
    host_ram_budget: extra host RAM the restore may add on top of the restored
      arrays themselves.
    verify: first re-read every leaf and check it against the CRC32C
      recorded at save time (`kd_ckpt.verify`); costs one extra read.

  Returns:
    The restored pytree.

  Raises:
    CorruptCheckpointError: `verify=True` and a leaf does not match.
    NoChecksumsError: `verify=True` on a checkpoint without kd_ckpt checksums.
  """
  path = epath.Path(directory)
  if not path.exists():
    raise FileNotFoundError(
        f'No checkpoint at {os.fspath(directory)!r}. Check the path (for a'
        ' Kauldron step, point at its item folder, e.g. ckpt_100/default).'
    )
  spec = budget_lib.parse(host_ram_budget)
  budget_bytes = budget_lib.resolve(spec, hostmem.probe())
  restoring.check_is_checkpoint(path)
  if verify:
    check = verify_lib.verify(path, host_ram_budget=budget_bytes)
    if not check.ok:
      raise verify_lib.CorruptCheckpointError(
          f'{os.fspath(directory)!r} is corrupt; nothing was restored.'
          f' {check.summary()}\n{check}\nRestore an earlier checkpoint, or'
          ' restore with verify=False to read it anyway.')
  out = restoring.restore_tree(path, target, budget_bytes=budget_bytes)
  hostmem.release_free_memory()
  return out
