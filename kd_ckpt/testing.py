"""Test support: plug kd_ckpt into code that builds stock Orbax handlers.

`install_orbax_peer(strategy)` makes every Orbax PyTree save and restore in
this process go through kd_ckpt: its `jax.Array` and `np.ndarray` type
handlers replace Orbax's in the global registry, and
`StandardCheckpointHandler` resolves to `SafePyTreeHandler`.  It is how
`make test-orbax-peer` runs Orbax's own handler test suites against kd_ckpt
(`tools/orbax_peer.py`); it changes process-wide state, so call it only in a
process made for that.

Example:

  kd_ckpt.testing.install_orbax_peer('streaming')
  ocp.StandardCheckpointer().save(path, tree)     # written by kd_ckpt's streaming writer
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp

from kd_ckpt import arrays as arrays_lib
from kd_ckpt import compat
from kd_ckpt import handler as handler_lib
from kd_ckpt import orbax_writer
from kd_ckpt import plan as plan_lib
from kd_ckpt import streaming

# The budget the peer handlers plan with: big enough for Orbax's test trees
# to take every strategy's normal path.
PEER_BUDGET = '256MiB'


def install_orbax_peer(strategy: str) -> None:
  """Routes Orbax's PyTree and Standard handlers through kd_ckpt (`strategy`)."""
  if strategy not in ('streaming', 'orbax'):
    raise ValueError(f'strategy={strategy!r}: use "streaming" or "orbax".')
  ctx = arrays_lib.SaveContext.for_budget(plan_lib.budget_lib.parse(PEER_BUDGET).bytes)
  cls = streaming.StreamingArrayHandler if strategy == 'streaming' else orbax_writer.OrbaxArrayHandler
  ocp.type_handlers.register_type_handler(jax.Array, cls(save=ctx), override=True)
  ocp.type_handlers.register_type_handler(
      np.ndarray, arrays_lib.KdNumpyHandler(), override=True)

  class PeerStandardHandler(handler_lib.SafePyTreeHandler):
    """`SafePyTreeHandler` taking StandardCheckpointHandler's arguments."""

    def __init__(self, *, save_concurrent_gb=None, restore_concurrent_gb=None,
                 multiprocessing_options=ocp.options.MultiprocessingOptions(),
                 pytree_metadata_options=None, use_ocdbt=True):
      del save_concurrent_gb, restore_concurrent_gb  # kd_ckpt bounds memory itself
      super().__init__(host_ram_budget=PEER_BUDGET, strategy=strategy,
                       multiprocessing_options=multiprocessing_options,
                       pytree_metadata_options=pytree_metadata_options,
                       use_ocdbt=use_ocdbt)

  compat.replace_standard_checkpoint_handler(PeerStandardHandler)
  ocp.StandardCheckpointHandler = PeerStandardHandler
