"""`kd_ckpt.save` and `kd_ckpt.restore` for plain Orbax users.

Example (a MaxText-style loop):

  report = kd_ckpt.save(f'/ckpt/{step}', state, host_ram_budget='4GiB')
  print(report)
  # A target from jax.eval_shape has no shardings on jax 0.12: the saved ones
  # are used, as stock Orbax does.  Pass shardings to restore elsewhere.
  state = kd_ckpt.restore(f'/ckpt/{step}', jax.eval_shape(lambda: state),
                          host_ram_budget='4GiB')

The checkpoint is a stock Orbax PyTree checkpoint:
`ocp.StandardCheckpointer().restore(path, abstract)` reads it without
kd_ckpt installed.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from kd_ckpt import budget as budget_lib
from kd_ckpt import cost
from kd_ckpt import handler as handler_lib
from kd_ckpt import hostmem
from kd_ckpt import inspecting
from kd_ckpt import plan as plan_lib
from kd_ckpt import report as report_lib
from kd_ckpt import session as session_lib
from kd_ckpt import startup
from kd_ckpt import storage
from kd_ckpt import text
from kd_ckpt import verifying


def save(
    directory: str | os.PathLike[str],
    tree: Any,
    *,
    host_ram_budget: budget_lib.BudgetLike = 'auto',
    strategy: str = 'auto',
    reuse_from: str | os.PathLike[str] | None = None,
    fingerprint: bool = False,
) -> report_lib.SaveReport:
  """Saves `tree` to `directory` within a host-RAM budget; blocks until durable.

  Args:
    directory: where to write; must not exist (an earlier checkpoint is never
      overwritten).  Orbax writes to a temporary name and renames at the end.
      A local path may be relative (to the working directory), or a gs:// URL.
    tree: a pytree of jax.Arrays (any sharding), numpy arrays and scalars.
    host_ram_budget: the most extra host RAM the save may add (peak RSS during
      the save minus RSS just before it); see `kd_ckpt.budget`.
    strategy: 'auto', 'orbax' or 'streaming'.
    reuse_from: a previous kd_ckpt checkpoint of the same tree: leaves whose
      bytes did not change are not copied or written again but referenced
      (hard links); the new checkpoint stays complete on its own.  That
      checkpoint must have been saved with `fingerprint=True` or `reuse_from`;
      otherwise (or on another filesystem) everything is written, and the log
      says why.
    fingerprint: record each leaf's fingerprint, so a later save can reuse
      this one (implied by `reuse_from`).

  Returns:
    A SaveReport with the measured peak extra RSS.

  Raises:
    FileExistsError: `directory` exists.
    ValueError: bad budget or strategy, an empty `directory` or `tree`, or
      deleted/donated arrays in `tree`.
    BudgetTooSmallError: no strategy fits the budget.
    PermissionError: nothing can be created where `directory` goes.
    DiskFullError: the filesystem has no room, before writing or during it;
      the partial files are removed either way.
  """
  # Every check happens before anything is written.
  storage.check_supported(directory)
  path = storage.as_path(directory)
  if not jax.tree.leaves(tree):
    # Orbax's words for it: 'Must provide item to save.', 'Found empty item.'
    raise ValueError(
        f'Nothing to save: the tree has no leaves ({tree!r:.80}). Pass the state'
        ' to save (a pytree of arrays and scalars).')
  if reuse_from is not None:
    reuse_from = storage.as_path(reuse_from)
  # The measurement starts first: a first touch of a bucket is this save's.
  s = session_lib.MeasuredSave(
      path, {'default': tree}, host_ram_budget=host_ram_budget, strategy=strategy,
      reuse_from={'default': reuse_from} if reuse_from is not None else None,
      fingerprint=fingerprint)
  # What a killed save of this directory left (gs://: no commit file) is no
  # checkpoint: process 0 removes it in `check_disk` below.
  if path.exists() and not storage.is_unfinished(path):
    raise FileExistsError(
        f'Checkpoint directory {os.fspath(directory)!r} already exists.'
        ' kd_ckpt never overwrites a checkpoint: pass a new directory (e.g.'
        ' one per step) or delete the old one first.')
  s.check_disk()
  path.parent.mkdir(parents=True, exist_ok=True)
  checkpointer = ocp.Checkpointer(handler_lib.SafePyTreeHandler())
  try:
    with s.running():
      checkpointer.save(path, args=s.save_args('default'))
  finally:
    checkpointer.close()
  report = s.complete()
  s.write_report(path)
  return report


def restore(
    directory: str | os.PathLike[str],
    target: Any = None,
    *,
    host_ram_budget: budget_lib.BudgetLike = 'auto',
    verify: bool = False,
    allow_unchecked: bool = False,
    strict: bool = True,
    support_layout: bool = False,
) -> Any:
  """Restores a checkpoint as stock Orbax does, within a host-RAM budget.

  What comes back is what `ocp.StandardCheckpointer().restore(directory,
  target)` returns (values, dtypes, shardings, pytree types); only the memory
  differs: every target shard is filled piece by piece, and the peak beyond
  the restored arrays stays within `host_ram_budget`.

  Args:
    directory: a checkpoint written by `kd_ckpt.save`, stock Orbax
      (`StandardCheckpointer`/`PyTreeCheckpointer`) or a Kauldron step's item
      folder (`ckpt_N/default`).
    target: a pytree of `jax.Array`s, `jax.ShapeDtypeStruct`s, numpy arrays or
      scalars with the saved structure; arrays take the target's sharding
      (the saved one when the target has none, e.g. from `jax.eval_shape`),
      scalars and numpy leaves the target's dtype.  None restores the saved
      tree (as nested dicts and lists, as Orbax does).
    host_ram_budget: extra host RAM the restore may use beyond the restored
      arrays.
    verify: first re-read every leaf and check it against the CRC32C
      recorded at save time (`kd_ckpt.verify`); costs one extra read.
    allow_unchecked: with `verify`, accept leaves that have no recorded
      checksum (all of a stock Orbax checkpoint's), as the CLI's
      `--allow-unchecked`; by default they refuse the restore.
    strict: False lets a target's shapes differ (padding or truncating), as
      Orbax's `StandardRestore(strict=False)`.
    support_layout: place arrays onto the layouts their target gives
      (`jax.ShapeDtypeStruct(..., sharding=Format(layout, sharding))`), as
      Orbax's `StandardRestore(support_layout=True)`; by default the target's
      layout is dropped and arrays take the default one, as in Orbax.  The
      relayout is a compiled program: a process that has not compiled yet
      starts the compiler inside the budget, before anything is read.

  Returns:
    The restored pytree.

  Raises:
    CorruptCheckpointError: `verify=True` and a leaf does not match.
    NoChecksumsError: `verify=True` and some leaves have no recorded checksum
      (unless `allow_unchecked`).
  """
  # A process's first touch of a bucket (its storage clients) is paid inside
  # the budget: what it took is not there for the reads.  A budget too small
  # for it beside any restore's floor is refused before paying it (a fresh
  # script's restore at 16 MiB had peaked at ~50 MiB to be refused).
  directory = storage.as_path(directory)
  _refuse_before_storage_start(directory, host_ram_budget)
  paid = startup.start_storage(directory)
  path = inspecting.checkpoint_dir(directory)
  if verify:
    check = verifying.verify(path, host_ram_budget=host_ram_budget)
    if not check.ok:
      raise verifying.CorruptCheckpointError(
          f'{os.fspath(directory)!r} is corrupt; nothing was restored.'
          f' {check.summary()}\n{check}\nRestore an earlier checkpoint, or'
          ' restore with verify=False to read it anyway.')
    if check.unchecked and not allow_unchecked:
      raise verifying.NoChecksumsError(
          f'{os.fspath(directory)!r}: {len(check.unchecked)} leaves have no recorded'
          f' checksum ({check.unchecked[0].detail}; first: {check.unchecked[0].path!r});'
          ' nothing was restored. Pass allow_unchecked=True to restore them'
          ' unverified, or verify=False.')
  h = handler_lib.SafePyTreeHandler(host_ram_budget=host_ram_budget)
  return h.restore(path, args=handler_lib.SafeRestore(
      item=target, strict=strict, support_layout=support_layout,
      host_ram_budget=host_ram_budget, storage_startup_bytes=paid))


def _refuse_before_storage_start(directory, host_ram_budget) -> None:
  """Raises BudgetTooSmallError where the storage clients' start-up
  (`startup.pending_storage_bytes`) and a one-leaf restore's floor exceed
  the budget: the refusal then pays neither."""
  pending = startup.pending_storage_bytes(directory)
  if not pending:
    return
  spec = budget_lib.parse(host_ram_budget)
  budget_bytes = budget_lib.resolve(spec, hostmem.probe())
  need = cost.min_restore_budget_bytes(1) + pending
  if budget_bytes < need:
    raise plan_lib.BudgetTooSmallError(
        f'host_ram_budget={spec.text} ({text.format_bytes(budget_bytes)}) is below the'
        f' smallest budget a restore from {os.fspath(directory)!r} can honour in this'
        f' process, {text.format_bytes(need)}: a fixed floor of'
        f' {text.format_bytes(cost.FLOOR_BYTES)}, a few pieces and'
        f' {text.format_bytes(pending)} for the storage clients\' start-up (this process\'s'
        ' first gs:// access: gcsfs, TensorStore\'s HTTP transport), which this refusal'
        ' did not pay. Raise host_ram_budget to'
        f' {text.budget_literal(cost.suggested_budget_bytes(need, pending))} or more (a'
        ' checkpoint of many leaves, or one whose pieces compile, names more then).')
