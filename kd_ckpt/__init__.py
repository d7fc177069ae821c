"""kd_ckpt: JAX checkpoints that never run the host out of memory.

Public API.  Everything not exported here is internal and may change.

Example:

  plan = kd_ckpt.plan_save(state, host_ram_budget="2GiB")   # nothing copied
  report = kd_ckpt.save("/ckpt/step_100", state, host_ram_budget="2GiB")
  state = kd_ckpt.restore("/ckpt/step_100", jax.eval_shape(lambda: state))
  print(kd_ckpt.verify("/ckpt/step_100"))                   # CRC32C per leaf
  print(kd_ckpt.inspect("/ckpt/step_100"))                  # leaves, how saved
  with kd_ckpt.within_budget("2GiB"):                       # code that builds its own
    params = gm.ckpts.load_params(path, params=params)      # ocp.StandardCheckpointer
  mgr = ocp.CheckpointManager(d, handler_registry=kd_ckpt.handler_registry("2GiB"))
  mgr.save(step, args=ocp.args.StandardSave(state))         # an Orbax loop, unchanged

  # Kauldron config (needs `pip install "kd_ckpt[kauldron]"`):
  cfg.checkpointer = kd_ckpt.SafeCheckpointer(save_interval_steps=500)
  cfg.init_transform = kd_ckpt.InitWithinBudget(wrapped=gm.ckpts.LoadCheckpoint(path=...))

`host_ram_budget` is a limit: the peak RSS of a save (async commit included)
or restore, minus the RSS just before it, stays at or under it.
"""

from kd_ckpt.api import restore
from kd_ckpt.api import save
from kd_ckpt.budget import AUTO_FRACTION
from kd_ckpt.budget import parse as parse_budget
from kd_ckpt.compat import IncompatibleVersionError
from kd_ckpt.storage import DiskFullError
from kd_ckpt.storage import UnsupportedStorageError
from kd_ckpt.exchange import ExchangeTimeoutError
from kd_ckpt.handler import handler_registry
from kd_ckpt.handler import SafePyTreeHandler
from kd_ckpt.handler import SafeRestore
from kd_ckpt.handler import SafeSave
from kd_ckpt.hostmem import HostMemory
from kd_ckpt.hostmem import PeakRss
from kd_ckpt.hostmem import probe as probe_host_memory
from kd_ckpt.inspecting import CheckpointInfo
from kd_ckpt.inspecting import find_checkpoint
from kd_ckpt.inspecting import inspect
from kd_ckpt.inspecting import NoCheckpointError
from kd_ckpt.orbax_scope import within_budget
from kd_ckpt.plan import BudgetTooSmallError
from kd_ckpt.plan import OrbaxSettings
from kd_ckpt.plan import plan_save
from kd_ckpt.plan import SavePlan
from kd_ckpt.report import SaveReport
from kd_ckpt.verifying import CorruptCheckpointError
from kd_ckpt.verifying import NoChecksumsError
from kd_ckpt.verifying import verify
from kd_ckpt.verifying import VerifyReport

__all__ = [
    'AUTO_FRACTION',
    'BudgetTooSmallError',
    'CheckpointInfo',
    'CorruptCheckpointError',
    'DiskFullError',
    'ExchangeTimeoutError',
    'HostMemory',
    'IncompatibleVersionError',
    'InitWithinBudget',
    'NoCheckpointError',
    'NoChecksumsError',
    'OrbaxSettings',
    'PeakRss',
    'SafeCheckpointer',
    'SafePyTreeHandler',
    'SafeRestore',
    'SafeSave',
    'SavePlan',
    'SaveReport',
    'UnsupportedStorageError',
    'VerifyReport',
    'find_checkpoint',
    'handler_registry',
    'inspect',
    'parse_budget',
    'plan_save',
    'probe_host_memory',
    'restore',
    'save',
    'verify',
    'within_budget',
]

__version__ = '0.2.0'


def __getattr__(name: str):
  # Kauldron is optional: import it only when its glue is asked for.
  if name in ('SafeCheckpointer', 'InitWithinBudget'):
    try:
      from kd_ckpt import kauldron  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
          f'kd_ckpt.{name} needs Kauldron: pip install "kd_ckpt[kauldron]"'
          f' ({e}).') from e
    return getattr(kauldron, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
