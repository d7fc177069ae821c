"""How the streaming writer spends a budget: slice size and pipeline depth.

A slice in flight costs its host buffer plus TensorStore's encoded copy of it
(zstd output, about ENCODE_FACTOR of the slice) until the write is durable.
On top of that a fixed floor: thread arenas, TensorStore's and OCDBT's own
buffers, the next slice's device->host copy being set up.

Example:

  layout = streaming_layout.choose(256 << 20)
  layout.slice_bytes, layout.slices_in_flight
"""

from __future__ import annotations

import dataclasses

from kd_ckpt import estimate as estimate_lib

MiB = 1 << 20
# Measured floor of the streaming save beyond its slices (arenas, OCDBT
# manifest and b-tree buffers, Python objects), 2 cores, tensorstore 0.1.86.
FLOOR_BYTES = 16 * MiB
# A slice costs its host buffer plus the encoded copy TensorStore holds until
# the chunk is durable.
COST_PER_SLICE_BYTE = 1.0 + estimate_lib.ENCODE_FACTOR
MIN_SLICE_BYTES = 1 * MiB
# Bigger slices stop paying off: 64 MiB writes already saturate a local disk
# and keep per-write overhead under 1%.
MAX_SLICE_BYTES = 64 * MiB
# Eight in flight: the device->host copy of the next slice overlaps the
# encode and write of the others, and OCDBT commits them together.
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
  """Up to MAX_SLICES_IN_FLIGHT slices, each as large as the budget allows.

  Depth beats slice size: OCDBT folds writes that are in flight together
  into one commit, and a commit costs about as much as a 10 MiB write here,
  so many moderate slices in flight write faster than two big ones.
  """
  usable = budget_bytes - FLOOR_BYTES
  for in_flight in range(MAX_SLICES_IN_FLIGHT, 1, -1):
    slice_bytes = int(usable / (in_flight * COST_PER_SLICE_BYTE)) // MiB * MiB
    if slice_bytes >= MIN_SLICE_BYTES:
      return StreamingLayout(min(MAX_SLICE_BYTES, slice_bytes), in_flight, True)
  return StreamingLayout(MIN_SLICE_BYTES, 2, feasible=False)


def predict_peak(est: estimate_lib.TreeEstimate, layout: StreamingLayout) -> int:
  """Floor plus what is in flight, never more than the data itself costs."""
  data = int(est.total_bytes(True) * COST_PER_SLICE_BYTE)
  return FLOOR_BYTES + min(layout.inflight_bytes, data)
