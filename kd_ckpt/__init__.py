"""kd_ckpt: JAX checkpoints that stay inside a host-RAM budget.

Public API.  Everything not exported here is internal and may change.

Example:

  plan = kd_ckpt.plan_save(state, host_ram_budget="2GiB")   # nothing copied
  report = kd_ckpt.save("/ckpt/step_100", state, host_ram_budget="2GiB")
  state = kd_ckpt.restore("/ckpt/step_100", jax.eval_shape(lambda: state))
  print(kd_ckpt.verify("/ckpt/step_100"))                   # CRC32C per leaf

  # Kauldron config:
  cfg.checkpointer = kd_ckpt.SafeCheckpointer(save_interval_steps=500)
"""

from kd_ckpt.api import restore
from kd_ckpt.api import save
from kd_ckpt.budget import AUTO_FRACTION
from kd_ckpt.budget import parse as parse_budget
from kd_ckpt.disk import DiskFullError
from kd_ckpt.hostmem import HostMemory
from kd_ckpt.hostmem import PeakRss
from kd_ckpt.hostmem import probe as probe_host_memory
from kd_ckpt.kauldron_glue import SafeCheckpointer
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
    'CorruptCheckpointError',
    'DiskFullError',
    'HostMemory',
    'NoChecksumsError',
    'OrbaxSettings',
    'PeakRss',
    'SafeCheckpointer',
    'SavePlan',
    'SaveReport',
    'parse_budget',
    'plan_save',
    'probe_host_memory',
    'restore',
    'save',
    'verify',
    'VerifyReport',
]

__version__ = '0.1.0'
