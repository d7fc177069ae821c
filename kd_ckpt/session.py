"""One measured save: the sequence `kd_ckpt.save` and `SafeCheckpointer` both run.

  wait for the state  ->  trim, reset the peak  ->  XLA start-up (first
  save of a process)  ->  plan  ->  disk checks  ->  Orbax save with
  `SafeSave` args  ->  (async: background commit)  ->  after-save release
  ->  `SaveReport`

Nothing of it is written twice: `api.save` drives a `MeasuredSave` around a
synchronous `ocp.Checkpointer`, `SafeCheckpointer` around Kauldron's
`CheckpointManager` save.  The report covers the whole save: for an async
save the peak and the seconds are read when the background commit of every
item is durable (the handler calls `on_commit`), not when `save()` returns.

Example:

  s = MeasuredSave(path, {'default': tree}, host_ram_budget='1GiB')
  with s.running():
    ocp.Checkpointer(SafePyTreeHandler()).save(path, args=s.save_args('default'))
  report = s.complete()
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterator

from absl import logging
from etils import epath
import jax

from kd_ckpt import arrays as arrays_lib
from kd_ckpt import budget as budget_lib
from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import handler as handler_lib
from kd_ckpt import hostmem
from kd_ckpt import integrity
from kd_ckpt import plan as plan_lib
from kd_ckpt import report as report_lib
from kd_ckpt import reuse as reuse_lib
from kd_ckpt import storage


class HandlerDidNotRunError(RuntimeError):
  """Orbax saved an item with another handler than kd_ckpt's: nothing was bounded."""


class MeasuredSave:
  """One save of one or more items (Kauldron saves several per step).

  Attributes:
    directory: the checkpoint (kd_ckpt.save) or step (Kauldron) directory.
    plan: one plan for all items: they share one budget and one limiter.
    report: the SaveReport, once `complete()` ran.
  """

  def __init__(self, directory, items: dict[str, Any], *,
               host_ram_budget: budget_lib.BudgetLike = 'auto',
               strategy: str = 'auto',
               item_dirs: dict[str, Any] | None = None,
               reuse_from: dict[str, Any] | None = None,
               fingerprint: bool = False,
               label: str = '',
               blocking: bool = True):
    # Refused before anything is measured, planned or written.
    storage.check_supported(directory)
    self.directory = storage.as_path(directory)
    self.items = dict(items)
    self.item_dirs = {k: epath.Path(v) for k, v in (item_dirs or {}).items()}
    self.label = label or os.fspath(directory)
    tree = self.items if len(self.items) > 1 else next(iter(self.items.values()))
    # The measurement covers the whole save, from here.  The state must exist
    # first: on the CPU backend a just-dispatched step allocates its outputs
    # (host memory there) when it runs, which is not this save's doing.
    _wait_for_values(tree)
    # From a trimmed heap, so the peak counts what this save adds rather than
    # hiding in slack left by earlier work.
    hostmem.release_free_memory()
    self._peak = hostmem.PeakRss().__enter__()
    self._start = time.monotonic()
    # Reuse (or `fingerprint`): every leaf's fingerprint is recorded, so the
    # next save can reuse what this one wrote.
    fingerprint = fingerprint or reuse_from is not None
    # A process that never compiled pays XLA's start-up here (in
    # `plan_save`, once the budget is known, unless the save is refused even
    # with its estimate), before any buffer exists, and the plan shares what
    # is left of the budget.
    # Likewise a process's first touch of a bucket (its storage clients),
    # and the fingerprints' device programs, which XLA keeps: 200 leaf
    # shapes compiled 155 MiB on a 64 MiB budget before they were charged.
    self.plan = plan_lib.plan_save(
        tree, host_ram_budget=host_ram_budget, strategy=strategy,
        pay_startup=True,
        fingerprint_programs=reuse_lib.fingerprint_programs_by_way(tree) if fingerprint else 0,
        save_id=self.directory, blocking=blocking)
    self.stats = arrays_lib.SaveStats()
    self._contexts = {}
    self._reusing = False
    for name in self.items:
      source = None
      if reuse_from is not None:
        source = reuse_lib.Source.open(reuse_from.get(name), label=self.label)
        self._reusing = self._reusing or source is not None
      self._contexts[name] = handler_lib.context_for(
          self.plan, checksums=integrity.collector(), stats=self.stats, reuse=source,
          fingerprints=reuse_lib.Fingerprints() if fingerprint else None,
          progress_total_bytes=self.plan.total_bytes,
          rss_ceiling_bytes=(self._peak.before_bytes + self.plan.budget_bytes
                             - cost.RSS_HEADROOM_BYTES))
    self._lock = threading.Lock()
    self._pending = set(self.items)
    self._end = None
    self._frozen = False
    self.report: report_lib.SaveReport | None = None
    self.async_commit = False

  # --- before -----------------------------------------------------------------

  def check_disk(self) -> None:
    """Before anything is written: a writable place, room for raw chunks, no leftovers."""
    storage.check_writable(self.directory)
    # Chunks are raw (uncompressed): the bytes to write are known exactly.
    # (A bucket has no free space to check.)  When reusing, which leaves
    # changed is known only once they are fingerprinted: the writer checks
    # then, for what it will write (`reuse.split`), and a LoRA save that
    # writes MBs does not ask for the frozen GBs here.
    storage.check_free_space(
        self.directory, self._host_leaf_bytes() if self._reusing else self.plan.total_bytes)
    if jax.process_index() == 0:
      # A save of this same directory that was killed: never a checkpoint.
      for stale in storage.remove_unfinished(self.directory):
        logging.warning('kd_ckpt: removed %s, left by an unfinished save.', stale)

  def save_args(self, name: str, item: Any = None, save_args: Any = None,
                custom_metadata: Any = None) -> handler_lib.SafeSave:
    """The `SafeSave` args of item `name`: its tree plus this save's inputs."""
    return handler_lib.SafeSave(
        item=self.items[name] if item is None else item, save_args=save_args,
        custom_metadata=custom_metadata, plan=self.plan, context=self._contexts[name],
        on_commit=lambda: self._committed(name))

  # --- during -----------------------------------------------------------------

  @contextlib.contextmanager
  def running(self, *, async_commit: bool = False) -> Iterator['MeasuredSave']:
    """Around the Orbax save call; maps a full disk and cleans up on failure."""
    self.async_commit = async_commit
    try:
      with jax.transfer_guard('allow'):
        yield self
    except BaseException as e:
      self.fail(e)
      raise

  def _committed(self, name: str) -> None:
    # Called from Orbax's commit thread once an item's writes are durable.
    with self._lock:
      self._pending.discard(name)
      done = not self._pending
    if done:
      self._end = time.monotonic()
      if self.async_commit:
        # The report is frozen here, not at the next save, wait or close:
        # training goes on in between and its memory is not this save's.
        self._peak.__exit__(None, None, None)
        self._frozen = True
      else:
        self._peak.sample()

  def fail(self, e: BaseException) -> None:
    """Removes the unfinished save; a full disk becomes `DiskFullError`.

    Only in a single-process job: with several, the others may still be
    writing into the same directory when this one fails, and a removal under
    them would let their writes re-create parts of it.  The leftover is never
    taken as a checkpoint (Orbax's temporary name; no commit file on a
    bucket), and the next save of this directory removes it before writing.
    """
    if jax.process_count() > 1:
      logging.warning(
          'kd_ckpt: the save of %s failed on process %d; its unfinished directory'
          ' is left for the next save of it to remove (other processes may still'
          ' be writing there).', self.label, jax.process_index())
    elif not storage.answers(self.directory):
      # A bucket that is down: each request of the removal would be retried
      # for half a minute before failing anyway.
      logging.warning(
          'kd_ckpt: the save of %s failed and its storage does not answer; the'
          ' unfinished save is left for the next save of this directory to'
          ' remove (it is never taken as a checkpoint).', self.label)
    else:
      try:
        storage.remove_unfinished(self.directory)
      except Exception as cleanup:  # pylint: disable=broad-exception-caught
        # Storage may be what failed (a bucket unreachable): the save's own
        # error is what the caller needs; the leftover is removed before
        # this directory is saved again, and is never taken as a checkpoint.
        logging.warning('kd_ckpt: could not remove the unfinished save %s: %s',
                        self.label, cleanup)
    if storage.is_disk_full(e) and not getattr(e, 'checked_before_writing', False):
      raise storage.DiskFullError.during_save(self.directory, self.plan.total_bytes) from e
    note = (f'kd_ckpt: the save of {self.label} failed; it is not a checkpoint, and'
            ' earlier checkpoints are untouched.')
    if (isinstance(e, Exception) and os.fspath(self.directory) not in str(e)
        and note not in getattr(e, '__notes__', ())):
      # Errors from below (gcsfs losing a bucket: 'Cannot connect to host
      # ...', a failed device-to-host copy) do not say which save they ended;
      # the traceback then does.
      e.add_note(note)

  # --- after ------------------------------------------------------------------

  def complete(self) -> report_lib.SaveReport:
    """Ends the measurement (the save and its commit are done) and reports."""
    if self.report is not None:
      return self.report
    if not self.stats.handler_ran and self.plan.total_bytes and any(
        l.is_array for l in self.plan.estimate.leaves):
      raise HandlerDidNotRunError(
          f'kd_ckpt: {self.label} was saved, but not by kd_ckpt\'s handler: Orbax'
          ' used another handler for its items (e.g. a CheckpointManager built'
          ' with stock item_handlers before kd_ckpt saw it), so nothing of this'
          ' save was bounded. Create the manager with'
          ' kd_ckpt.handler.SafePyTreeHandler (SafeCheckpointer does).')
    if not self._frozen:
      self._peak.__exit__(None, None, None)
    end = self._end if self._end is not None else time.monotonic()
    for tree in self.items.values():
      after_save(tree)
    stats = self.stats
    self.report = report_lib.SaveReport(
        directory=os.fspath(self.directory), strategy=self.plan.strategy,
        settings=self.plan.settings_text(), budget_bytes=self.plan.budget_bytes,
        predicted_peak_bytes=self.plan.predicted_peak_bytes,
        peak_extra_bytes=self._peak.extra_bytes, retained_bytes=self._peak.retained_bytes,
        bytes_written=stats.bytes_written + self._host_leaf_bytes(),
        bytes_reused=stats.bytes_reused, leaves_reused=stats.leaves_reused,
        seconds=max(0.0, end - self._start), async_commit=self.async_commit,
        exact_peak=self._peak.exact, startup_bytes=self.plan.startup_bytes)
    logging.info('kd_ckpt %s saved: %s', self.label, self.report.summary())
    return self.report

  def _host_leaf_bytes(self) -> int:
    """numpy and scalar leaves: Orbax's own handler writes them whole."""
    return sum(l.host_bytes(True) for l in self.plan.estimate.leaves if not l.is_array)

  def write_report(self, directory=None) -> None:
    """The report beside the checkpoint (process 0), for `kd_ckpt inspect`."""
    d = epath.Path(directory or self.directory)
    if self.report is not None and jax.process_index() == 0 and d.exists():
      self.report.write_json(d / report_lib.REPORT_FILE_NAME)


def after_save(tree: Any) -> None:
  """What every save ends with, so RSS does not ratchet from save to save.

  Drops the host copies JAX cached on the live arrays (Orbax's
  `np.asarray(shard.data)` stores one on every shard, which would otherwise
  live as long as the training state; jaxlib 0.12 refuses, then the copy
  goes with the array), then returns freed heap to the OS.
  """
  refused = False
  for leaf in jax.tree_util.tree_leaves(tree):
    if refused or not isinstance(leaf, jax.Array):
      continue
    for arr in [leaf, *compat.single_device_arrays(leaf)]:
      if compat.has_host_cache(arr) and not compat.drop_host_cache(arr):
        refused = True
        logging.log_first_n(
            logging.WARNING, 'kd_ckpt: cannot drop the host copy JAX cached on a'
            ' live array; it is freed with the array (the next train step).', 1)
        break
  hostmem.release_free_memory()


def _wait_for_values(tree: Any) -> None:
  """Blocks until every live array of `tree` is computed (deleted ones: the save names them)."""
  for leaf in jax.tree_util.tree_leaves(tree):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.block_until_ready()


def _drop(arr) -> bool:
  from kd_ckpt import compat  # pylint: disable=g-import-not-at-top
  return compat.drop_host_cache(arr)

