"""Orbax's own checkpointers, inside a host-RAM budget, for code kd_ckpt does not own.

Some code builds its Orbax checkpointer itself: Gemma's pretrained-weights
loader (`gm.ckpts.LoadCheckpoint`, `gm.ckpts.load_params`) restores through
`ocp.StandardCheckpointer()`, MaxText's `load_params_from_path` through
`ocp.PyTreeCheckpointer()`, each with Orbax's reader: the Gemma-like 2.2 GB
bench state took 1.4-1.7 GiB of host RAM beyond the restored arrays
(`bench/results/gb_256mib.md`).  On a host with little more RAM than its
accelerators, a run can die loading its weights before its first checkpoint.

`within_budget(host_ram_budget)` swaps two of Orbax's names for the duration
of a block:

  * `StandardCheckpointHandler` (`ocp.StandardCheckpointer()` builds one):
    kd_ckpt's `SafePyTreeHandler`.  Its restores read within the budget and
    its saves write within it, in the same format.
  * `PyTreeCheckpointHandler` (`ocp.PyTreeCheckpointer()`, Orbax's Standard
    handler and `CheckpointManager`s build them): `PyTreeHandler`, whose
    restores go to a `SafePyTreeHandler` with the caller's restore args and
    transforms.  Its saves, and handlers built with a type handler registry of
    their own, stay Orbax's.

Handlers built before the block keep Orbax's reader.

It changes process-wide names for the block's duration, as a process's
set-up does (load the weights, then train): other threads that build those
handlers meanwhile get kd_ckpt's too.  Blocks in several threads take turns.

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
# The innermost block's (budget, strategy): what the handlers are built with.
_scopes: list[tuple[budget_lib.BudgetLike, str]] = []
# Restores read through kd_ckpt's handlers here so far (`restores_read`),
# under a lock of its own: a block's thread holds `_lock` while it waits.
_reads = 0
_reads_lock = threading.Lock()


def _count_read() -> None:
  global _reads
  with _reads_lock:
    _reads += 1


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
    budget, strategy = _scopes[-1] if _scopes else ('auto', 'auto')
    super().__init__(host_ram_budget=budget, strategy=strategy,
                     multiprocessing_options=multiprocessing_options,
                     pytree_metadata_options=pytree_metadata_options, use_ocdbt=use_ocdbt)

  def restore(self, directory, item=None, args=None):
    _count_read()
    return super().restore(directory, item=item, args=args)


class PyTreeHandler(handler_lib.ORBAX_PYTREE_HANDLER):
  """Orbax's `PyTreeCheckpointHandler` whose restores read through kd_ckpt.

  Built inside a `within_budget` block where Orbax's is asked for (e.g.
  `ocp.PyTreeCheckpointer()`, `ocp.Checkpointer(ocp.PyTreeCheckpointHandler())`:
  MaxText's `load_params_from_path`).  A restore goes to a `SafePyTreeHandler`
  with the block's budget, arguments as given (`restore_args`, `transforms`,
  `partial_restore`).  Saves stay Orbax's, and so does a handler built with
  a type handler registry or implementation of its own (kd_ckpt's handlers
  build theirs so).
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._kd_budget, _ = _scopes[-1] if _scopes else ('auto', 'auto')
    self._kd_reads = not args and not {'type_handler_registry', 'handler_impl'} & set(kwargs)
    self._kd_kwargs = {k: kwargs[k] for k in ('multiprocessing_options', 'use_ocdbt',
                                               'pytree_metadata_options') if k in kwargs}

  def restore(self, directory, args=None):
    if not self._kd_reads or args is None:
      return super().restore(directory, args=args)
    _count_read()
    safe = handler_lib.SafePyTreeHandler(host_ram_budget=self._kd_budget, **self._kd_kwargs)
    return safe.restore(directory, args=args)


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


@ocp.args.register_with_handler(PyTreeHandler, for_save=True)
@dataclasses.dataclass
class _PyTreeSave(ocp.args.PyTreeSave):
  pass


@ocp.args.register_with_handler(PyTreeHandler, for_restore=True)
@dataclasses.dataclass
class _PyTreeRestore(ocp.args.PyTreeRestore):
  pass


# Orbax's CheckpointManager (Kauldron's `Checkpointer`, and the loaders built
# on it: `kd.ckpts.SimpleCheckpointLoader`) registers a handler it is given
# under the args classes registered for that handler's class, then looks a
# restore's args up by their exact class: `StandardRestore`, `PyTreeRestore`.
# Registered only under `_Restore` and the like, kd_ckpt's handlers made every
# such restore in a block fail ('does not match with any registered
# handler').  Inside a block Orbax's own args name kd_ckpt's handlers
# (Orbax's public registration), and name Orbax's again after it.
_ORBAX_ARGS = ((ocp.args.StandardSave, True, StandardHandler),
               (ocp.args.StandardRestore, False, StandardHandler),
               (ocp.args.PyTreeSave, True, PyTreeHandler),
               (ocp.args.PyTreeRestore, False, PyTreeHandler))


def _register_args(handlers: dict) -> dict:
  """Registers each of Orbax's args classes with `handlers[cls]`; returns
  the handler classes they were registered with before."""
  before = {}
  for args_cls, for_save, _ in _ORBAX_ARGS:
    before[args_cls] = ocp.args.get_registered_handler_cls(args_cls)
    ocp.args.register_with_handler(handlers[args_cls], for_save=for_save,
                                   for_restore=not for_save)(args_cls)
  return before


def restores_read() -> int:
  """How many restores read through these handlers so far in this process."""
  return _reads


def _install(host_ram_budget: budget_lib.BudgetLike, strategy: str):
  """Makes Orbax build `StandardHandler` and `PyTreeHandler`; returns what puts Orbax's back."""
  _scopes.append((host_ram_budget, strategy))
  previous = compat.replace_standard_checkpoint_handler(StandardHandler)
  previous_tree = compat.replace_pytree_checkpoint_handler(PyTreeHandler)
  previous_public = ocp.StandardCheckpointHandler, ocp.PyTreeCheckpointHandler
  ocp.StandardCheckpointHandler, ocp.PyTreeCheckpointHandler = StandardHandler, PyTreeHandler
  previous_args = _register_args({a: h for a, _, h in _ORBAX_ARGS})

  def uninstall():
    _register_args(previous_args)
    ocp.StandardCheckpointHandler, ocp.PyTreeCheckpointHandler = previous_public
    compat.replace_pytree_checkpoint_handler(previous_tree)
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
  """Orbax's Standard and PyTree checkpoint handlers built in the block read through kd_ckpt.

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
