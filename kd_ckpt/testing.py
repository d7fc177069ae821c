"""Test support: plug kd_ckpt into code that builds stock Orbax handlers.

`install_orbax_peer(strategy)` makes every Orbax PyTree save and restore in
this process go through kd_ckpt: its `jax.Array` and `np.ndarray` type
handlers replace Orbax's in the global registry, and
`StandardCheckpointHandler` and `PyTreeCheckpointHandler` resolve to
kd_ckpt's (`orbax_scope`, as inside `kd_ckpt.within_budget`, for the rest of
the process).  It is how
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
from kd_ckpt import orbax_scope
from kd_ckpt import orbax_writer
from kd_ckpt import plan as plan_lib
from kd_ckpt import streaming

# The budget the peer handlers plan with: big enough for Orbax's test trees
# to take every strategy's normal path.
PEER_BUDGET = '256MiB'


def install_orbax_peer(strategy: str) -> None:
  """Routes Orbax's PyTree and Standard handlers through kd_ckpt (`strategy`).

  `auto` is a choice made for a whole save, which the handlers built from
  `StandardCheckpointHandler` make (each save planned at `PEER_BUDGET`); a
  type handler sees a batch of leaves, not a save, so the one registered for
  `jax.Array` under `auto` is the streaming writer's, what `auto` falls back
  to when Orbax's writer does not fit.
  """
  if strategy not in ('streaming', 'orbax', 'auto'):
    raise ValueError(f'strategy={strategy!r}: use "streaming", "orbax" or "auto".')
  ctx = arrays_lib.SaveContext.for_budget(plan_lib.budget_lib.parse(PEER_BUDGET).bytes)
  cls = orbax_writer.OrbaxArrayHandler if strategy == 'orbax' else streaming.StreamingArrayHandler
  ocp.type_handlers.register_type_handler(jax.Array, cls(save=ctx), override=True)
  ocp.type_handlers.register_type_handler(
      np.ndarray, arrays_lib.KdNumpyHandler(), override=True)
  orbax_scope.install_for_process(PEER_BUDGET, strategy)
