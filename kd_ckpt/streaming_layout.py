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
# Two in flight is enough to overlap the device->host copy of slice k+1 with
# the encode/write of slice k; more helps only with more cores than CI has.
MAX_SLICES_IN_FLIGHT = 4
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
  """The largest slices (up to MAX_SLICE_BYTES), two or more in flight."""
  usable = budget_bytes - FLOOR_BYTES
  in_flight = 2
  slice_bytes = int(usable / (in_flight * COST_PER_SLICE_BYTE))
  slice_bytes = min(MAX_SLICE_BYTES, slice_bytes // MiB * MiB)
  if slice_bytes < MIN_SLICE_BYTES:
    return StreamingLayout(MIN_SLICE_BYTES, 2, feasible=False)
  if slice_bytes == MAX_SLICE_BYTES:
    in_flight = max(2, min(
        MAX_SLICES_IN_FLIGHT, int(usable / (slice_bytes * COST_PER_SLICE_BYTE))
    ))
  return StreamingLayout(slice_bytes, in_flight, feasible=True)


def predict_peak(est: estimate_lib.TreeEstimate, layout: StreamingLayout) -> int:
  """Floor plus what is in flight, never more than the data itself costs."""
  data = int(est.total_bytes(True) * COST_PER_SLICE_BYTE)
  return FLOOR_BYTES + min(layout.inflight_bytes, data)
