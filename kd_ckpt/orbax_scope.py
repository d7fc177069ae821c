"""Orbax's own checkpointers, inside a host-RAM budget, for code kd_ckpt does not own.

Some code builds its Orbax checkpointer itself: Gemma's pretrained-weights
loader (`gm.ckpts.LoadCheckpoint`, `gm.ckpts.load_params`) restores through
`ocp.StandardCheckpointer()`, which reads a stock checkpoint with Orbax's
reader: the Gemma-like 2.2 GB bench state took 1.4-1.7 GiB of host RAM
beyond the restored arrays (`bench/results/gb_256mib.md`).  On a host with
little more RAM than its accelerators, a run can die loading its weights
before its first checkpoint.

`within_budget(host_ram_budget)` makes Orbax build kd_ckpt's
`SafePyTreeHandler` wherever it would build its `StandardCheckpointHandler`
(`ocp.StandardCheckpointer()`, `ocp.StandardCheckpointHandler()`), for the
duration of the block.  Restores there read within the budget and saves
write within it, in the same format: nothing else changes.  Handlers built
before the block, and `CheckpointManager`s (which look handlers up by their
arguments' type), are not affected.

It changes process-wide names for the block's duration, as a process's
set-up does (load the weights, then train): other threads that build a
StandardCheckpointHandler meanwhile get kd_ckpt's too.  Blocks in several
threads take turns.

Example:

  with kd_ckpt.within_budget('8GiB'):
    params = gm.ckpts.load_params(path, params=params)   # read within 8 GiB

  # Kauldron: kd_ckpt.kauldron.InitWithinBudget(wrapped=..., host_ram_budget=...)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

import orbax.checkpoint as ocp

from kd_ckpt import budget as budget_lib
from kd_ckpt import compat
from kd_ckpt import handler as handler_lib
from kd_ckpt import plan as plan_lib

_lock = threading.RLock()
# The innermost block's (budget, strategy): what `StandardHandler` is built with.
_scopes: list[tuple[budget_lib.BudgetLike, str]] = []
_built = 0  # StandardHandlers built so far in this process (`handlers_built`)


class StandardHandler(handler_lib.SafePyTreeHandler):
  """`SafePyTreeHandler` built from `StandardCheckpointHandler`'s arguments.

  Its budget and strategy are the innermost `within_budget` block's (or
  `kd_ckpt.testing.install_orbax_peer`'s); Orbax's byte limits
  (`save_concurrent_gb`, `restore_concurrent_gb`) are left to the budget.
  """

  def __init__(self, *, save_concurrent_gb=None, restore_concurrent_gb=None,
               multiprocessing_options: ocp.options.MultiprocessingOptions = (
                   ocp.options.MultiprocessingOptions()),
               pytree_metadata_options=None, use_ocdbt: bool = True):
    del save_concurrent_gb, restore_concurrent_gb  # kd_ckpt bounds memory itself
    global _built
    _built += 1
    budget, strategy = _scopes[-1] if _scopes else ('auto', 'auto')
    super().__init__(host_ram_budget=budget, strategy=strategy,
                     multiprocessing_options=multiprocessing_options,
                     pytree_metadata_options=pytree_metadata_options, use_ocdbt=use_ocdbt)


# Orbax's Checkpointer wraps a handler that has no registered arguments in
# its legacy adapter (which then refuses `StandardRestore`): these register
# the handler, without taking `StandardSave`/`StandardRestore` from Orbax's own.
@ocp.args.register_with_handler(StandardHandler, for_save=True)
@dataclasses.dataclass
class _Save(ocp.args.StandardSave):
  pass


@ocp.args.register_with_handler(StandardHandler, for_restore=True)
@dataclasses.dataclass
class _Restore(ocp.args.StandardRestore):
  pass


def handlers_built() -> int:
  """How many handlers Orbax built as kd_ckpt's so far in this process."""
  return _built


def _install(host_ram_budget: budget_lib.BudgetLike, strategy: str):
  """Makes Orbax build `StandardHandler`; returns what puts Orbax's back."""
  _scopes.append((host_ram_budget, strategy))
  previous = compat.replace_standard_checkpoint_handler(StandardHandler)
  previous_public, ocp.StandardCheckpointHandler = ocp.StandardCheckpointHandler, StandardHandler

  def uninstall():
    ocp.StandardCheckpointHandler = previous_public
    compat.replace_standard_checkpoint_handler(previous)
    _scopes.pop()
  return uninstall


def install_for_process(host_ram_budget: budget_lib.BudgetLike, strategy: str) -> None:
  """`within_budget` for the rest of the process (a process made for it: tests)."""
  with _lock:
    _install(host_ram_budget, strategy)


@contextlib.contextmanager
def within_budget(host_ram_budget: budget_lib.BudgetLike = 'auto', *,
                  strategy: str = 'auto') -> Iterator[None]:
  """Orbax's StandardCheckpointer and StandardCheckpointHandler, kd_ckpt's inside the block.

  Args:
    host_ram_budget: what a save or restore in the block may add to the
      process's RSS ("8GiB", bytes, "auto", or a fraction of the available
      RAM in (0, 1]); see `kd_ckpt.parse_budget`.
    strategy: how saves in the block write ("auto", "orbax", "streaming").

  Both are checked before the block runs.  See the module docstring for what
  it changes and for how long.
  """
  budget_lib.parse(host_ram_budget)  # A bad value is named before the block runs.
  plan_lib.check_strategy(strategy)
  with _lock:
    uninstall = _install(host_ram_budget, strategy)
    try:
      yield
    finally:
      uninstall()
