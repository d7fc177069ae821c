"""SafeCheckpointer: the Kauldron checkpointer whose every save and restore stays in a budget.

In a config:

  with konfig.imports():
    import kd_ckpt
  cfg.checkpointer = kd_ckpt.SafeCheckpointer(
      save_interval_steps=500, host_ram_budget='auto')

On the command line:

  python -m kauldron.main --cfg=configs/gemma_lora.py \\
      --cfg.checkpointer='py::kd_ckpt.SafeCheckpointer(save_interval_steps=500)'

It plugs in through Kauldron's public extension point, the `CheckpointItem`
protocol: each save and restore hands Kauldron's `Checkpointer` a wrapper of
the state whose `__kd_ocp_handlers__` name kd_ckpt's handler for the
StandardSave items and whose `__kd_ocp_save_args__` carry the save's plan
(`SafeSave`).  Everything a `kd.ckpts.Checkpointer` does still works (resume,
max_to_keep, should_save, wait_until_finished, continuous eval's isinstance
check), and its checkpoints are stock Kauldron checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Optional

from absl import logging
from etils import epath
import jax
from kauldron import kd
import orbax.checkpoint as ocp

from kd_ckpt import budget as budget_lib
from kd_ckpt import compat
from kd_ckpt import exchange
from kd_ckpt import handler as handler_lib
from kd_ckpt import limiter as limiter_lib
from kd_ckpt import plan as plan_lib
from kd_ckpt import report as report_lib
from kd_ckpt import session as session_lib
from kd_ckpt import storage


# Kauldron's own policy for a failed save (flaky Orbax ValueErrors), applied
# by kd_ckpt to fresh saves; kd_ckpt's own errors are never retried.
SAVE_RETRIES = 3
SAVE_RETRY_SECS = 5.0
NOT_RETRIED = (plan_lib.BudgetTooSmallError, storage.UnsupportedStorageError,
               limiter_lib.RequestTooLargeError)


def _standard_items(args) -> dict[str, ocp.args.StandardSave]:
  """The StandardSave items of a state's save args (Composite or single)."""
  if isinstance(args, ocp.args.Composite):
    return {k: args[k] for k in args.keys() if type(args[k]) is ocp.args.StandardSave}  # pylint: disable=unidiomatic-typecheck
  if type(args) is ocp.args.StandardSave:  # pylint: disable=unidiomatic-typecheck
    return {'default': args}
  return {}


class _SafeItem(kd.ckpts.items.CheckpointItem):
  """A state seen through kd_ckpt: our handler and args for its StandardSave items.

  Everything else (the timer, the data iterator, custom items) goes to
  Kauldron and Orbax untouched.
  """

  def __init__(self, inner, handler: handler_lib.SafePyTreeHandler, *,
               session: session_lib.MeasuredSave | None = None,
               host_ram_budget: Any = None):
    self._inner = inner
    self._handler = handler
    self._session = session
    self._budget = host_ram_budget

  def __kd_ocp_handlers__(self):
    handlers = self._inner.__kd_ocp_handlers__()
    swap = lambda h: self._handler if type(h) is ocp.StandardCheckpointHandler else h  # pylint: disable=unidiomatic-typecheck
    if isinstance(handlers, dict):
      return {k: swap(h) for k, h in handlers.items()}
    return swap(handlers)

  def __kd_ocp_save_args__(self):
    args = self._inner.__kd_ocp_save_args__()
    convert = lambda name, a: self._session.save_args(
        name, a.item, a.save_args, a.custom_metadata)
    if isinstance(args, ocp.args.Composite):
      ours = _standard_items(args)
      return ocp.args.Composite(**{
          k: convert(k, args[k]) if k in ours else args[k] for k in args.keys()})
    return convert('default', args) if _standard_items(args) else args

  def __kd_ocp_restore_args__(self):
    args = self._inner.__kd_ocp_restore_args__()

    def convert(a):
      if type(a) is not ocp.args.StandardRestore:  # pylint: disable=unidiomatic-typecheck
        return a
      return handler_lib.SafeRestore(
          item=a.item, strict=a.strict, support_layout=a.support_layout,
          fallback_sharding=a.fallback_sharding, host_ram_budget=self._budget)

    if isinstance(args, ocp.args.Composite):
      return ocp.args.Composite(**{k: convert(args[k]) for k in args.keys()})
    return convert(args)

  def __kd_ocp_restore_post__(self, value):
    return self._inner.__kd_ocp_restore_post__(value)


@dataclasses.dataclass(frozen=True, eq=True, kw_only=True)
class SafeCheckpointer(kd.ckpts.Checkpointer):
  """A `kd.ckpts.Checkpointer` whose saves and restores stay inside a host-RAM budget.

  Each save is planned from the state's shardings (Orbax's async save when
  its worst case fits, else the bounded streaming writer), measured over its
  whole life (async commit included) and logged in one line; `reports` keeps
  the measured reports.  Restores (resume, eval) read piece by piece inside
  the same budget.

  Attributes:
    host_ram_budget: the most extra host RAM a save or restore may add:
      "auto" (half of what is available to this process, resolved at the
      first save and kept, so every save has the same layout), bytes,
      "8GiB"-style strings, or a fraction in (0, 1].  Checked when the
      config is built.
    strategy: "auto" (fastest that fits), "orbax", or "streaming".
    reuse_unchanged: leaves whose bytes did not change since the previous
      checkpoint (e.g. frozen weights under LoRA) are not copied or written
      again but referenced; every checkpoint stays complete on its own.
  """

  host_ram_budget: Any = 'auto'
  strategy: str = 'auto'
  reuse_unchanged: bool = False

  def __post_init__(self):
    if hasattr(super(), '__post_init__'):
      super().__post_init__()  # pytype: disable=attribute-error
    # Fail at config time, not at the first save hours later.
    budget_lib.parse(self.host_ram_budget)
    plan_lib.check_strategy(self.strategy)
    # A relative workdir (`--cfg.workdir=runs/x`) is taken from the working
    # directory: Orbax's manager fails a relative one at the first save
    # ('Checkpoint path should be absolute'), stock Kauldron's run with it.
    # Anything else (an unresolved config reference) is left to Kauldron.
    object.__setattr__(self, 'workdir', storage.absolute(self.workdir))

  @functools.cached_property
  def reports(self) -> list[report_lib.SaveReport]:
    """Reports of the finished saves of this checkpointer, oldest first."""
    return []

  @functools.cached_property
  def _kd(self) -> dict[str, Any]:
    # Runtime state hangs off one cached property; the dataclass stays frozen.
    return {'pending': None, 'budget': None}

  @functools.cached_property
  def _ckpt_mgr(self):
    """Kauldron's manager; on a bucket, without POSIX folder modes.

    Kauldron asks Orbax for 0o770 folders.  A bucket has no modes (access is
    IAM), tf.io.gfile ignores them there, and etils.epath's fsspec backend
    refuses them (`NotImplementedError: makedirs with custom mode=`), which
    would end a run on a gs:// workdir at its first save.
    """
    mgr = super()._ckpt_mgr
    if storage.is_remote(self.workdir) and mgr.options.file_options.path_permission_mode:
      options = dataclasses.replace(mgr.options, file_options=dataclasses.replace(
          mgr.options.file_options, path_permission_mode=None))
      mgr = dataclasses.replace(mgr, options=options)
    return mgr

  def _unretried_save(self, state, **kwargs) -> bool:
    return compat.kauldron().unretried_save(self, state, **kwargs)

  @functools.cached_property
  def _handler(self) -> handler_lib.SafePyTreeHandler:
    return handler_lib.SafePyTreeHandler(
        host_ram_budget=self.host_ram_budget, strategy=self.strategy,
        multiprocessing_options=self.multiprocessing_options)

  def _budget(self) -> Any:
    """The budget in bytes, resolved once ("auto" would drift save to save)."""
    if self._kd['budget'] is None:
      spec = budget_lib.parse(self.host_ram_budget)
      if spec.bytes is not None:
        self._kd['budget'] = spec.bytes
      else:
        # Collective, at the first save: named after this run's checkpoints.
        with exchange.save_round(f'{os.fspath(self.workdir)}#budget'):
          self._kd['budget'] = plan_lib.agreed_budget(spec, None, jax.process_count())
    return self._kd['budget']

  def _step_dir(self, step: int) -> epath.Path:
    return (epath.Path(self.workdir) / compat.kauldron().checkpoint_folder_name
            / f'ckpt_{step}')

  def save(self, state, *, step: int, force: bool = False,
           metrics: Optional[Any] = None) -> bool:
    """Plans, saves and measures one step; see `kd.ckpts.Checkpointer.save`."""
    self._finish_pending()
    if not force and not self.should_save(step):
      return False
    items = {k: a.item for k, a in _standard_items(state.__kd_ocp_save_args__()).items()}
    if not items:
      # No arrays to bound (e.g. only Kauldron's PerformanceTimer): Kauldron's
      # own save, as stock.
      return super().save(state, step=step, force=force, metrics=metrics)
    step_dir = self._step_dir(step)
    reuse_from = None
    if self.reuse_unchanged:
      earlier = [s for s in self.all_steps if s < step]
      prev = self._step_dir(max(earlier)) if earlier else None
      reuse_from = {k: (prev / k if prev is not None else None) for k in items}
    # Kauldron retries any ValueError of a save 3 times, 5 s apart, with the
    # same arguments.  kd_ckpt calls the save without that decorator and
    # retries itself: each attempt is a fresh measured save (no checksum or
    # fingerprint recorded twice, no byte counted twice), and kd_ckpt's own
    # errors, which a retry cannot fix, are raised at once.
    for attempt in range(SAVE_RETRIES + 1):
      s = session_lib.MeasuredSave(
          step_dir, items, host_ram_budget=self._budget(), strategy=self.strategy,
          reuse_from=reuse_from, label=f'step {step}', blocking=False)
      s.check_disk()
      async_commit = s.plan.strategy == 'orbax'
      try:
        with s.running(async_commit=async_commit):
          self._unretried_save(_SafeItem(state, self._handler, session=s), step=step,
                               force=force, metrics=metrics)
          if not async_commit:
            # Streaming wrote everything already; Orbax's finalize and rename
            # are part of the save the report measures.
            super().wait_until_finished()
        break
      except ValueError as e:
        if isinstance(e, NOT_RETRIED) or attempt == SAVE_RETRIES:
          raise
        logging.warning('kd_ckpt step %d: save attempt %d failed (%s: %s); retrying'
                        ' in %.0f s with a fresh save.', step, attempt + 1,
                        type(e).__name__, e, SAVE_RETRY_SECS)
        time.sleep(SAVE_RETRY_SECS)
    if async_commit:
      self._kd['pending'] = (step, s)
      logging.info('kd_ckpt step %d: async save started (%s); its report follows'
                   ' when the commit finishes.', step, s.plan.summary())
    else:
      self._complete(step, s)
    return True

  def _complete(self, step: int, s: session_lib.MeasuredSave) -> None:
    report = s.complete()
    s.write_report(self._step_dir(step))
    self.reports.append(report)

  def _finish_pending(self) -> None:
    """Waits for the previous async save; completes its report or names its error."""
    pending, self._kd['pending'] = self._kd['pending'], None
    if pending is None:
      return
    step, s = pending
    try:
      super().wait_until_finished()
    except Exception as e:
      s.fail(e)
      raise
    self._complete(step, s)

  def wait_until_finished(self) -> None:
    self._finish_pending()
    super().wait_until_finished()

  def close(self) -> None:
    self._finish_pending()
    super().close()

  def restore(self, state, *, step: int = -1, noop_if_missing: bool = False,
              donate: bool = True):
    """Kauldron's restore, reading every array inside the budget."""
    if self.latest_step is None:  # Nothing to read: Kauldron's noop or error.
      return super().restore(state, step=step, noop_if_missing=noop_if_missing,
                             donate=donate)
    if donate:
      # What Kauldron does before restoring: free the initial state's device
      # memory (its shapes and shardings stay readable).
      jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else x, state)
    item = _SafeItem(state, self._handler, host_ram_budget=self.host_ram_budget)
    return super().restore(item, step=step, noop_if_missing=noop_if_missing, donate=False)
