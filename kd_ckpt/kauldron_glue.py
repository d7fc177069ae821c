"""SafeCheckpointer: the Kauldron checkpointer that plans every save.

The only module that imports Kauldron.

In a config:

  with konfig.imports():
    import kd_ckpt
  cfg.checkpointer = kd_ckpt.SafeCheckpointer(
      save_interval_steps=500, host_ram_budget='auto')

On the command line:

  python -m kauldron.main --cfg=configs/gemma_lora.py \\
      --cfg.checkpointer='py::kd_ckpt.SafeCheckpointer(save_interval_steps=500)'

Everything a `kd.ckpts.Checkpointer` does still works (resume, max_to_keep,
should_save, wait_until_finished, continuous eval's isinstance check), and its
checkpoints are stock Kauldron checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional

from absl import logging
from etils import epath
import jax
from kauldron import kd
from kauldron.checkpoints import lazy_checkpoint_manager
import orbax.checkpoint as ocp

from kd_ckpt import budget as budget_lib
from kd_ckpt import disk
from kd_ckpt import hostmem
from kd_ckpt import plan as plan_lib
from kd_ckpt import report as report_lib
from kd_ckpt import writer


def _safe(handler):
  """Our handler in place of a stock StandardCheckpointHandler."""
  if type(handler) is ocp.StandardCheckpointHandler:  # pylint: disable=unidiomatic-typecheck
    return writer.SafePyTreeHandler()
  return handler


class _SafeLazyManager(lazy_checkpoint_manager.LazyCheckpointManager):
  """Kauldron's lazy manager with our handler for every StandardSave item."""

  def _create_manager(self, state) -> None:
    if state is not None:
      # Swap before Orbax's manager exists: one manager, our handlers.
      handlers = state.__kd_ocp_handlers__()
      if isinstance(handlers, dict):
        handlers = {k: _safe(h) for k, h in handlers.items()}
      else:
        handlers = _safe(handlers)
      object.__setattr__(self, '_item_handlers', handlers)
    super()._create_manager(None)

  def _convert(self, args, save: bool):
    """Standard(Save|Restore) args -> ours, for the items we handle.

    Orbax pairs each item's args type with its handler; the state's items
    still speak Kauldron's `StandardSave`/`StandardRestore`.
    """
    safe = self.safe_handlers()
    std, ours = ((ocp.args.StandardSave, writer.SafeSave) if save
                 else (ocp.args.StandardRestore, writer.SafeRestore))

    def one(a):
      if type(a) is std:  # pylint: disable=unidiomatic-typecheck
        return ours(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a)})
      return a

    if isinstance(args, ocp.args.Composite):
      return ocp.args.Composite(**{k: one(args[k]) if k in safe else args[k] for k in args.keys()})
    return one(args) if safe else args

  def save(self, state, *, step, force=False, metrics=None):
    mgr = self._get_manager(state)
    return mgr.save(
        step, args=self._convert(state.__kd_ocp_save_args__(), save=True),
        force=force, metrics=metrics,
    )

  def restore(self, state, *, step):
    mgr = self._get_manager(state)
    restored = mgr.restore(
        step, args=self._convert(state.__kd_ocp_restore_args__(), save=False))
    return state.__kd_ocp_restore_post__(restored)

  def safe_handlers(self) -> dict[str, writer.SafePyTreeHandler]:
    handlers = self._item_handlers
    if isinstance(handlers, writer.SafePyTreeHandler):
      return {'default': handlers}
    if not isinstance(handlers, dict):
      return {}
    return {k: h for k, h in handlers.items() if isinstance(h, writer.SafePyTreeHandler)}


@dataclasses.dataclass(frozen=True, eq=True, kw_only=True)
class SafeCheckpointer(kd.ckpts.Checkpointer):
  """A `kd.ckpts.Checkpointer` that keeps each save inside a host-RAM budget.

  Before each save it estimates the peak host RAM from the state's shardings,
  picks Orbax settings that fit (or the streaming writer when none do), logs
  one line, and afterwards releases allocator slack and the host copies JAX
  cached on the live state, so RSS does not ratchet from save to save.

  Attributes:
    host_ram_budget: extra host RAM a save may add: "auto" (half of what is
      available to this process), bytes, "8GiB"-style strings, or a fraction
      in (0, 1].  Checked when the config is built.
    strategy: "auto" (fastest that fits), "orbax", or "streaming".
    last_report: not a field; see `reports`.
  """

  host_ram_budget: Any = 'auto'
  strategy: str = 'auto'

  def __post_init__(self):
    if hasattr(super(), '__post_init__'):
      super().__post_init__()  # pytype: disable=attribute-error
    # Fail at config time, not at the first save hours later.
    budget_lib.parse(self.host_ram_budget)
    plan_lib.check_strategy(self.strategy)

  @functools.cached_property
  def _ckpt_mgr(self) -> lazy_checkpoint_manager.LazyCheckpointManager:
    base = super()._ckpt_mgr
    return _SafeLazyManager(
        directory=base.directory, options=base.options, fast=base.fast
    )

  @functools.cached_property
  def reports(self) -> list[report_lib.SaveReport]:
    """Reports of the saves made by this checkpointer, oldest first."""
    return []

  def _items_to_plan(self, state) -> dict[str, Any]:
    args = state.__kd_ocp_save_args__()
    items = {}
    if isinstance(args, ocp.args.Composite):
      for k in args.keys():
        a = args[k]
        if isinstance(a, ocp.args.StandardSave):
          items[k] = a.item
    elif isinstance(args, ocp.args.StandardSave):
      items['default'] = args.item
    return items

  def save(
      self,
      state,
      *,
      step: int,
      force: bool = False,
      metrics: Optional[Any] = None,
  ) -> bool:
    """Plans, saves, reports; see `kd.ckpts.Checkpointer.save`."""
    mgr = self._ckpt_mgr
    mgr._get_manager(state)  # pylint: disable=protected-access
    # The previous async save must finish before we measure this one.
    self._wait_for_previous()
    self._write_pending_report()
    items = self._items_to_plan(state)
    # One plan for all items together: they are saved in the same call.
    plan = plan_lib.plan_save(
        items, host_ram_budget=self.host_ram_budget, strategy=self.strategy)
    for h in mgr.safe_handlers().values():
      h.use_plan(plan)
    logging.vlog(1, 'kd_ckpt step %d plan: %s', step, plan.summary())

    hostmem.release_free_memory()
    with hostmem.PeakRss() as peak:
      start = time.monotonic()
      try:
        saved = super().save(state, step=step, force=force, metrics=metrics)
        if not (plan.orbax is not None and plan.orbax.use_async):
          # Sync and streaming plans: the budget covers the whole save.
          mgr.wait_until_finished()
      except Exception as e:
        self._raise_disk_full(e, step, plan.global_bytes)
        raise
      seconds = time.monotonic() - start
      writer.after_save(items)
    report = report_lib.SaveReport.measured(
        str(self._step_dir(step)), plan, peak, seconds)
    self.reports.append(report)
    # Written once the async commit has renamed the step directory.
    object.__setattr__(self, '_pending_report', (step, report))
    logging.info('kd_ckpt step %d saved: %s', step, report.summary())
    return saved

  def _raise_disk_full(self, e: Exception, step: int, needed_bytes: int) -> None:
    """A full disk: remove the unfinished step and say so; else do nothing.

    The manager stays usable: free space and the next save (or a retry of
    this step) goes through.
    """
    if not disk.is_disk_full(e):
      return
    d = self._step_dir(step)
    if jax.process_index() == 0:
      disk.remove_unfinished(d)
    raise disk.DiskFullError.during_save(d, needed_bytes) from e

  def _wait_for_previous(self) -> None:
    """Waits for the previous async save; its disk-full error is ours to name."""
    try:
      self._ckpt_mgr.wait_until_finished()
    except Exception as e:
      pending = self.__dict__.pop('_pending_report', None)  # frozen: bypass
      if pending is not None:
        self._raise_disk_full(e, pending[0], pending[1].bytes_written)
      raise

  def _step_dir(self, step: int) -> epath.Path:
    return epath.Path(self.workdir) / kd.ckpts.checkpointer.CHECKPOINT_FOLDER_NAME / f'ckpt_{step}'

  def _write_pending_report(self) -> None:
    pending = self.__dict__.pop('_pending_report', None)  # frozen: bypass
    if pending is None or jax.process_index() != 0:
      return
    step, report = pending
    d = self._step_dir(step)
    if d.exists():
      report.write_json(d / report_lib.REPORT_FILE_NAME)

  def wait_until_finished(self) -> None:
    self._wait_for_previous()
    super().wait_until_finished()
    self._write_pending_report()
