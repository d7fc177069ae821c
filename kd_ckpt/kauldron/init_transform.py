"""InitWithinBudget: a Kauldron `init_transform` whose Orbax restores stay in a budget.

A LoRA run loads its pretrained weights before it trains, through the loader
the config names (`gm.ckpts.LoadCheckpoint`), which reads the checkpoint with
a `StandardCheckpointer` of its own.  Wrapped here, that loader's reads go
through kd_ckpt's reader, inside `host_ram_budget`
(`kd_ckpt.within_budget`: Orbax's Standard and PyTree handlers); what it
loads, and how, is unchanged.

In a config:

  with konfig.imports():
    from gemma import gm
    import kd_ckpt
  cfg.init_transform = kd_ckpt.InitWithinBudget(
      wrapped=gm.ckpts.SkipLoRA(
          wrapped=gm.ckpts.LoadCheckpoint(path=gm.ckpts.CheckpointPath.GEMMA3_4B_IT)),
      host_ram_budget='8GiB',
  )
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from absl import logging
from kauldron import kd

from kd_ckpt import budget as budget_lib
from kd_ckpt import hostmem
from kd_ckpt import orbax_scope
from kd_ckpt import text

_StateT = TypeVar('_StateT')


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitWithinBudget(kd.ckpts.InitTransform):
  """Runs `wrapped`'s transforms with Orbax's checkpointers reading inside a budget.

  Attributes:
    wrapped: the init transform to run (e.g. `gm.ckpts.LoadCheckpoint`, or
      `gm.ckpts.SkipLoRA` around it).
    host_ram_budget: what its restores may add to the process's RSS ("auto",
      "8GiB", bytes, or a fraction of the available RAM in (0, 1]).
  """

  wrapped: kd.ckpts.InitTransform
  host_ram_budget: budget_lib.BudgetLike = 'auto'

  def __post_init__(self):
    # Named when the config is built, not once the model is initialized.
    budget_lib.parse(self.host_ram_budget)

  def transform(self, state: _StateT) -> _StateT:
    return self._run(self.wrapped.transform, state)

  def transform_after_optimizer(self, state: _StateT) -> _StateT:
    return self._run(self.wrapped.transform_after_optimizer, state)

  def _run(self, fn, state: _StateT) -> _StateT:
    reads = orbax_scope.restores_read()
    with hostmem.PeakRss() as peak, orbax_scope.within_budget(self.host_ram_budget):
      state = fn(state)
    if orbax_scope.restores_read() == reads:
      return state  # Nothing was read through Orbax (e.g. no optimizer state to load).
    # The loaded arrays count in the peak (host RAM on the CPU backend), the
    # budget is what the reads may add beside them.
    logging.info('kd_ckpt init: %s.%s read through kd_ckpt inside host_ram_budget=%s:'
                 ' peak extra RSS %s, the loaded arrays included',
                 type(self.wrapped).__name__, fn.__name__, self.host_ram_budget,
                 text.format_bytes(peak.extra_bytes))
    return state
