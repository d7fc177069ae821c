"""How the streaming writer spends a budget: slice size and pipeline depth.

A slice in flight costs its host buffer until its OCDBT commit is durable,
plus what TensorStore adds while committing.  On top of that a fixed floor:
thread arenas, TensorStore's and OCDBT's own buffers, the next slice's
device->host copy being set up.

Example:

  layout = streaming_layout.choose(256 << 20)
  layout.slice_bytes, layout.slices_in_flight
"""

from __future__ import annotations

import dataclasses

from kd_ckpt import estimate as estimate_lib

MiB = 1 << 20
# Floor of the streaming save beyond its slices (thread arenas, metadata
# writes, OCDBT manifest and node cache, Python objects).  Raw chunks, 2
# cores, tensorstore 0.1.86: a 512 MiB save at a 64 MiB budget (8 MiB
# staged) peaked at 16 MiB, so ~8 MiB; kept at 3x that for other hosts.
FLOOR_BYTES = 24 * MiB
# A staged slice is the host buffer TensorStore references (raw chunks are
# not re-encoded), plus OCDBT's data-file buffer while its group commits:
# measured 86 MiB peak for 76 MiB staged (256 MiB budget), i.e. ~1.1; 1.5
# leaves room for hosts whose allocator or disk behave worse.
COST_PER_SLICE_BYTE = 1.5
MIN_SLICE_BYTES = 1 * MiB
# Bigger slices stop paying off: 64 MiB writes already saturate a local disk
# and keep per-write overhead under 1%.
MAX_SLICE_BYTES = 64 * MiB
# Each OCDBT commit costs ~0.1 s here whatever its size, and writes in flight
# together share a commit: keep several in flight, but not so many that each
# slice gets tiny.
TARGET_SLICES_IN_FLIGHT = 4
MAX_SLICES_IN_FLIGHT = 8
MIN_BUDGET_BYTES = FLOOR_BYTES + int(2 * MIN_SLICE_BYTES * COST_PER_SLICE_BYTE) + MiB


@dataclasses.dataclass(frozen=True)
class StreamingLayout:
  slice_bytes: int
  slices_in_flight: int
  feasible: bool

  @property
  def inflight_bytes(self) -> int:
    return int(self.slices_in_flight * self.slice_bytes * COST_PER_SLICE_BYTE)


def choose(budget_bytes: int) -> StreamingLayout:
  """Slices of usable / (TARGET_SLICES_IN_FLIGHT x cost), then as many in flight as fit."""
  usable = budget_bytes - FLOOR_BYTES
  per_slice = usable / (TARGET_SLICES_IN_FLIGHT * COST_PER_SLICE_BYTE)
  slice_bytes = min(MAX_SLICE_BYTES, int(per_slice) // MiB * MiB)
  if slice_bytes < MIN_SLICE_BYTES:
    slice_bytes = MIN_SLICE_BYTES
  in_flight = min(MAX_SLICES_IN_FLIGHT, int(usable / (slice_bytes * COST_PER_SLICE_BYTE)))
  if in_flight < 2:
    return StreamingLayout(MIN_SLICE_BYTES, 2, feasible=False)
  return StreamingLayout(slice_bytes, in_flight, feasible=True)


def predict_peak(est: estimate_lib.TreeEstimate, layout: StreamingLayout) -> int:
  """Floor plus what is in flight, never more than the data itself costs.

  The writer stages slices in OCDBT transactions of half the in-flight
  bytes (one filling, one committing), whatever the slices' size, so small
  shards fill the envelope as big ones do.
  """
  inflight = int(layout.slices_in_flight * layout.slice_bytes * COST_PER_SLICE_BYTE)
  data = int(est.total_bytes(True) * COST_PER_SLICE_BYTE)
  return FLOOR_BYTES + min(inflight, data)
