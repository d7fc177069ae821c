"""Every prediction kd_ckpt makes, and the measured constants behind it.

Two kinds of numbers live here:

* What the limiter charges (`limiter`): the bytes a host buffer costs while
  it lives, including what TensorStore allocates for it.  These bound the
  streaming save and every restore; they are enforced, not predicted.
* What the plan predicts, to rank strategies and to decide whether a path
  that cannot be enforced (Orbax's own async save) fits: its worst case.

Every constant says where it was measured (2 cores, 24 GiB, CPU backend,
tensorstore 0.1.86); `make calibrate` (bench/calibrate.py) re-measures the
fixed ones: the floor, the per-leaf charge and the placement programs.

Example:

  cap = cost.limiter_capacity(256 << 20)        # bytes buffers may hold
  piece = cost.restore_piece_bytes(cap)
  layout = cost.streaming_layout(256 << 20, num_leaves=1738)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Collection

from kd_ckpt import estimate as estimate_lib

KiB, MiB = 1 << 10, 1 << 20

# --- The fixed floor ----------------------------------------------------------
# What a bounded save or restore costs beyond its buffers, whatever the state:
# TensorStore's thread pools and their glibc arenas, the OCDBT manifest and
# node cache, Python objects.  The limiter's capacity is the budget less this.
# `make calibrate` measures 3.9-4.7 MiB beyond the admitted buffers for one
# tiny leaf; kept at 24 MiB because bigger slices grow TensorStore's arenas
# and hosts with more threads have more of them (tests/test_budget.py
# measures every path against the whole budget).
FLOOR_BYTES = 24 * MiB

# --- Streaming save -------------------------------------------------------------
# A staged slice costs its host buffer, which TensorStore references rather
# than copies when each chunk is one contiguous run of the slice (raw chunks),
# plus OCDBT's data-file buffer while its group commits.  Measured: 1.0-1.1
# per staged byte; charged 1.5.
STAGED_FACTOR = 1.5
# When a chunk is not contiguous in the slice (e.g. column chunks, forced by
# prime shard extents), TensorStore copies the slice into per-chunk buffers:
# one more copy.  Measured 1.5x over the 1.5 charge on a 4x2 mesh of prime
# extents (tests/test_budget.py, mesh2d_prime); charged 2.5.
STAGED_COPY_FACTOR = 2.5
# Per chunk staged in a transaction: TensorStore's write state and the OCDBT
# B-tree entry.  Measured ~3 KiB (2,000 leaves of 16 KiB in 8 chunks each:
# 25 KiB/leaf beyond the data); charged 4 KiB.  Negligible for MiB chunks.
PER_CHUNK_BYTES = 4 * KiB
# Per leaf, for the whole save: Orbax's ParamInfo and metadata, the zarr spec,
# TensorStore's open array, JAX's per-shard objects.  Measured 12.4-14.9
# KiB/leaf for single-device leaves (1,000-10,000 tiny leaves), 16-20 KiB for
# leaves replicated on 8 devices (2,000 leaves, tests/test_budget.py
# many_small); `make calibrate` on 2026-12-02: 21 KiB/leaf saving 2,000
# single-device leaves of 1 KiB ((46.09 - 4.68 MiB) / 2,000), 4 KiB/leaf
# restoring them.  Charged 24 KiB.
PER_LEAF_BYTES = 24 * KiB
# Leaves opened together (their metadata commits share one OCDBT commit).
OPEN_BATCH_LEAVES = 256
MIN_SLICE_BYTES = 1 * MiB
# Replica parallelism splits a replicated shard among its replicas; on one
# host that only multiplies chunks, across hosts it shares the writing.
# Shards smaller than this are written whole by one replica.
MIN_REPLICA_PARALLEL_BYTES = 1 * MiB
# Bigger read pieces stop paying off: 64 MiB reads already saturate a local
# disk and keep per-read overhead under 1%.
MAX_SLICE_BYTES = 64 * MiB
# A save's slices, at most: each slice in flight is a host buffer the save
# faults in afresh, and bigger ones made saves slower, not faster.  The 4 GB
# leaf, streaming, 3 alternating reps in one process (/tmp script): at 1 GiB
# with 64 MiB slices 10.2-11.8 s (31k more page faults a save than at 256
# MiB), with 32 MiB slices 5.2-7.1 s; at 256 MiB, 37 MiB slices 7.4-10.8 s,
# 32 MiB slices 4.9-6.6 s; at 4 GiB, 5.8-7.2 s.
MAX_SAVE_SLICE_BYTES = 32 * MiB
# Smaller slices for small states (about sqrt(state MiB) MiB, so that a 128
# MiB leaf reuses most of its buffers) saved that leaf in 0.25 s against
# 0.28 s, but slices are the chunk grid, and at 22 MiB a 512 MiB leaf of
# prime extents on a 2-D mesh got 1-column chunks (32191 x 1, against one
# 64 MiB chunk a shard): 0.86 s against 0.47 s (`mesh2d_prime`; 0.88 against
# 0.49 `wide_mesh2d`).  Tried and reverted (43b2547, fifteenth session).
# 16 MiB slices at every budget, tried again (thirty-sixth session,
# bench/results/ab_save_128mib_budgets.md): the 128 MiB leaf 0.16 s against
# 0.22 s, but the 4 GB leaf 3.38 s against 2.21 s (a last chunk cut short by a
# column, which TensorStore fills whole: 2.9 GB of fresh pages a save).
# What stayed (thirty-seventh session): a state smaller than the room gets
# slices of an eighth of it (`STATE_SLICES`), and a shard whose chunks would
# then be tiny keeps the budget's (`StreamingLayout.budget_slice_bytes`).
# What a streaming save keeps in flight, at most, beside its leaves'
# bookkeeping: the room a 256 MiB budget gives.  More room only let the
# pipeline fault in more fresh buffers before reusing any (the 4 GB leaf, 3
# alternating reps: 9.2-9.7 s at 1 GiB against 3.9-8.6 s at 256 MiB, with
# 32 MiB slices at both).  A bigger budget is headroom, not buffers.
MAX_STREAMING_ROOM_BYTES = 224 * MiB


def streaming_capacity(capacity_bytes: int, leaves_bytes: int) -> int:
  """The capacity a streaming save leases: its leaves and `MAX_STREAMING_ROOM_BYTES`."""
  return min(int(capacity_bytes), int(leaves_bytes) + MAX_STREAMING_ROOM_BYTES)
# Each OCDBT commit costs ~0.1 s here whatever its size: aim for groups of
# several slices, one filling while one commits.  Tried and reverted
# (39f6c5a, d3b16b9, thirty-fourth session): groups of 32 MiB (one slice),
# with one or two commits in flight, for every save or for saves under 1
# GiB.  Alternating in one process, 256 MiB budget: the Gemma-like state
# was 2-6% slower (13 of 34 pairs faster), 128-512 MiB leaves faster in
# some runs (512 MiB: 592 against 441 ms, 11 of 12 pairs) and not in
# others (4 of 8; 128 MiB 6 of 10), and `bench/speed.py` then had the 128
# MiB row at 0.26 s against 0.19-0.20 s.
TARGET_SLICES_PER_GROUP = 2
# Slices of at most 1/8 of the state: the two groups of two slices in flight
# then hold at most half of it, and the rest reuses their buffers.  A state
# no bigger than the pipeline's room otherwise has every slice in a fresh
# buffer, whose pages the copy faults in: a 128 MiB leaf (8 shards) saved in
# 0.22 s at 256 MiB against 0.15 s at 128 MiB (208 against 57 MiB of pages
# faulted a save, bench/results/ab_save_128mib_budgets.md).  With this, a
# budget above the state's needs gives the same layout as one that just
# meets them; at 256 MiB a 128 MiB leaf saved in 0.20 s against 0.32 s with
# the budget's slices, a 200 MiB leaf 0.31 s against 0.51 s (alternating,
# bench/results/ab_save_state_slices.md).
STATE_SLICES = 4 * TARGET_SLICES_PER_GROUP
# The streaming pipeline also watches the process RSS: before admitting a
# slice it drains its own commits while RSS + the slice's charge would pass
# the RSS before the save + the budget - this headroom (left for the commit
# in flight's transients).  It catches what the charges do not model:
# measured 238 MiB at a 160 MiB budget without it for a 4x2 mesh whose
# shards are prime on both axes (1-row chunks, two shards' keys interleaved
# in one OCDBT B-tree), and 1.3x the budget on gs:// (upload buffers).
RSS_HEADROOM_BYTES = 12 * MiB
# Orbax's 100 MB B-tree node cache is for reads; a streaming save reads
# nothing back (measured +60 MiB over a 1 GB save with the default).
WRITE_NODE_CACHE_BYTES = 8 * 10**6

# --- Restore --------------------------------------------------------------------
READ_NODE_CACHE_BYTES = 8 * 10**6
# A stored chunk bigger than a piece is read by `chunkread`: two pieces plus
# its state (`StoredArray.state_bytes`), which for zstd chunks includes the
# decoder's window, 512 KiB-2 MiB for Orbax's levels: pieces leave this much.
CHUNKREAD_STATE_BYTES = 3 * MiB
# The least the pieces of a restore need: a read and a placement of 64 KiB
# pieces (`restore_piece_bytes`), plus chunkread's state.
MIN_PIECES_BYTES = 5 * 64 * KiB + CHUNKREAD_STATE_BYTES
# Each program a restore compiles to fill a big shard on its device (a zeros
# buffer, an update), which XLA keeps for the life of the process.  Measured
# (`make calibrate`) 390 KiB each on one device, 491 KiB SPMD over 8 devices;
# charged 1 MiB.
PROGRAM_BYTES = 1 * MiB
# A relayout onto a target's custom device-local layout (`support_layout`)
# compiles one program per shard shape, dtype and layout: 2.3-2.5 MiB kept
# each, and up to 12.9 MiB beyond its results while one compiles (20 shapes
# x 8 CPU devices, shards of 20 KiB-4 MiB, host memory trimmed between:
# `python bench/relayout_restore.py --programs`).  A restore holds both
# (compiles one at a time).
RELAYOUT_PROGRAM_BYTES = 3 * MiB
# Each program the streaming writer keeps on a shard's device
# (`streaming._DevicePrograms`): one cutting part of a shard (packed dtypes
# on the CPU backend, every dtype elsewhere; one per shard shape, part shape
# and device), or looking for a set bit in a leaf that may be all zero
# (accelerators only; one per leaf shape, dtype and sharding).
# Measured on CPU devices, the first compile's start-up aside: 0.38 MiB a
# cut (120 int4 shapes, one device), 0.68-0.70 MiB a zero check (one
# program a leaf over 8 devices, 61 leaves); unmeasured on accelerators.
# Charged as `PROGRAM_BYTES`.
DEVICE_PROGRAM_BYTES = PROGRAM_BYTES
RELAYOUT_COMPILE_BYTES = 13 * MiB
# XLA's compiler start-up in a process that has compiled nothing yet
# (`kd_ckpt.startup`): 52.6-54.5 MiB for `start_compiler` in three fresh
# processes on this CPU backend, 50.6 MiB in a fresh restore; 8.7 MiB after
# one trivial jit.  Never charged in place of the measured figure: it names
# the budget of a save or restore refused before the start-up is paid
# (`startup.pending_compiler_bytes`), which a 16 MiB restore had paid
# first, peaking at 58 MiB only to be refused.  Unmeasured on GPU backends.
COMPILER_STARTUP_BYTES = 56 * MiB
# A process's first touch of a bucket (`kd_ckpt.startup.start_storage`:
# gcsfs, TensorStore's HTTP transport): 43.3 MiB measured against the GCS
# emulator.  Likewise only names the budget of a save refused before it.
STORAGE_STARTUP_BYTES = 48 * MiB
# Each program a fingerprinting save (reuse) compiles to hash leaves on their
# devices (one per shape, dtype, box and device set:
# `reuse.fingerprint_programs`), which XLA keeps for the life of the process.
# Measured 0.85-1.08 MiB each: 40 shapes of each of seven dtypes, ranks 1-4,
# on one device, and of leaves sharded over 8 devices (rows, a 2x4 mesh,
# replicated, complex 3-D); `make calibrate` re-measures four of them;
# charged 1.5 MiB.
FINGERPRINT_PROGRAM_BYTES = 3 * MiB // 2

# --- Orbax's own save (cannot be enforced: chosen only if its worst case fits)
# TensorStore and OCDBT contexts, thread stacks and arenas, metadata: 4-16 MiB
# measured for states of 0.1-13 MiB; with reuse, the fingerprints' first
# compile adds a few MiB (16.8 MiB measured for a 24 MiB state).
ORBAX_FLOOR_BYTES = 24 * MiB
# Per leaf: Orbax's bookkeeping plus the write futures of one transaction.
# Measured 21 KiB/leaf (4,000 and 10,000 tiny leaves); charged 32 KiB.
ORBAX_PER_LEAF_BYTES = 32 * KiB
# Raw chunks: TensorStore references the host copy (0.01 GiB measured for a
# 1 GiB array).
ORBAX_RAW_ENCODE_FACTOR = 0.02
# Replica-parallel slices are cut by `lax.slice_in_dim`, compiled at the first
# save of each shape: +12 MiB measured on one process (32 MiB replicated state,
# first save against later ones), +15 MiB on each of two (tests/
# test_multiprocess.py); kept at 24 MiB.
ORBAX_SLICE_COMPILE_BYTES = 24 * MiB
# ... and one program per shard shape, dtype, slice and device
# (`estimate.slice_program_key`), each kept by XLA: 30 replicated leaves of
# as many shapes over 8 CPU devices in two processes (120 programs a
# process) peaked at 171.4 MiB on a first save and 105.7 MiB on the next,
# 0.55 MiB a program; with 60 leaves (240 programs) a save predicted at
# 350.4 MiB peaked at 388.7 MiB (`tests/test_multiprocess.py`).  Charged
# for each program this process has not compiled yet
# (`estimate.compiled_slice_programs`) beyond the first
# `ORBAX_SLICE_PROGRAMS_IN_COMPILE`, which the 24 MiB above was measured with.
ORBAX_SLICE_PROGRAM_BYTES = PROGRAM_BYTES
ORBAX_SLICE_PROGRAMS_IN_COMPILE = 8
# A host copy of a packed dtype (int4, `estimate.packed_on_device`) on the
# CPU backend: a packed copy and an unpacked buffer on the device, then the
# host's.  `np.asarray(jnp.array(x, copy=True))` of a 64 MiB int4 array
# peaked at 160 MiB (a /tmp script, twice).
PACKED_CPU_COPY_FACTOR = 2.5


def packed_copy_extra_bytes(nbytes: int, *, cpu: bool) -> int:
  """What a host copy of `nbytes` (unpacked) of a packed dtype holds beyond
  the copy itself: on CPU the packed and unpacked device buffers (1.5x);
  on an accelerator a packed host landing (0.5x, not measured: charged so
  that the bound holds if the transfer lands packed)."""
  extra = PACKED_CPU_COPY_FACTOR - 1 if cpu else 0.5
  return int(math.ceil(nbytes * extra))


def limiter_capacity(budget_bytes: int) -> int:
  """What the limiter admits under `budget_bytes` (the budget less the floor)."""
  return int(budget_bytes) - FLOOR_BYTES


def min_budget_bytes(num_leaves: int = 0) -> int:
  """The smallest budget a bounded save (of `num_leaves` leaves) can honour.

  `streaming_layout` needs room for two slices of MIN_SLICE_BYTES at the
  worst staging cost, and for two groups of TARGET_SLICES_PER_GROUP such
  slices: the larger of the two.
  """
  slices = max(2 * staged_charge(MIN_SLICE_BYTES, contiguous=False),
               int(2 * STAGED_FACTOR * TARGET_SLICES_PER_GROUP * MIN_SLICE_BYTES))
  return FLOOR_BYTES + slices + leaves_charge(num_leaves)


# --- what the limiter charges ---------------------------------------------------

def staged_charge(nbytes: int, *, chunks: int = 1, contiguous: bool = True,
                  aligned_bytes: int | None = None) -> int:
  """What one staged slice costs until its transaction has committed.

  `aligned_bytes`: the bytes of the whole stored chunks the slice touches
  (`slicing.aligned_nbytes`).  A slice that fills only part of a chunk (an
  edge chunk, cut by the array's end, is stored whole) is copied by
  TensorStore into a buffer of the whole chunk, as a non-contiguous one is:
  charged as the slice plus a copy of every chunk it touches, with the copy
  factor's margin.  A 1260 x 31622 f32 leaf in chunks of 315 x 29959
  peaked at 293 MiB under a 256 MiB budget when its edge chunks were
  charged as their slices (2 MiB each, 36 MiB held).
  """
  aligned = nbytes if aligned_bytes is None else max(nbytes, aligned_bytes)
  if contiguous and aligned == nbytes:
    return int(math.ceil(nbytes * STAGED_FACTOR)) + chunks * PER_CHUNK_BYTES
  return int(math.ceil(nbytes + aligned * (STAGED_COPY_FACTOR - 1))) + chunks * PER_CHUNK_BYTES


def leaves_charge(num_leaves: int) -> int:
  """The per-leaf bookkeeping of a save, held from its start to its end."""
  return int(num_leaves) * PER_LEAF_BYTES


def read_charge(piece_bytes: int, chunk_bytes: int) -> int:
  """A TensorStore read of whole stored chunks of `chunk_bytes` (<= a piece):
  the output piece, plus one chunk's compressed and decoded bytes in flight."""
  return int(piece_bytes + 2 * min(chunk_bytes, piece_bytes))


def ranged_read_charge(flight_bytes: int, range_bytes: int) -> int:
  """Byte ranges read straight into a host buffer (`chunkread.start_read_into`),
  beyond that buffer: the reads in flight as TensorStore's responses and as
  the bytes each hands over, and one range being landed."""
  return int(2 * flight_bytes + range_bytes)


def whole_read_charge(read_bytes: int, chunks_bytes: int, placed_bytes: int) -> int:
  """A small leaf read whole and placed in one batched transfer
  (`reading._read_whole`): the stored array and its cast (`read_bytes`),
  every stored chunk compressed and decoded at once, and a device (or
  staging) copy of each distinct shard."""
  return int(read_bytes + 2 * chunks_bytes + placed_bytes)


def place_charge(piece_bytes: int) -> int:
  """Placing a piece on a device: a cast copy and the device (or staging) copy."""
  return int(2 * piece_bytes)


def stock_read_charge(shard_bytes: int, chunks_bytes: int) -> int:
  """Orbax's own read of one target shard (`ArrayHandler.deserialize`).

  The shard (in the target dtype), every stored chunk it touches compressed
  and decoded at once (TensorStore may decode them all concurrently), and
  the device copy (host RAM on the CPU backend).
  """
  return int(2 * shard_bytes + 2 * chunks_bytes)


def programs_charge(num_programs: int, num_relayouts: int = 0) -> int:
  """Placement programs a restore compiles, held from their compile to its
  end; of them `num_relayouts` relayouts, and the room one needs compiling."""
  relayouts = int(num_relayouts)
  return ((int(num_programs) - relayouts) * PROGRAM_BYTES + relayouts * RELAYOUT_PROGRAM_BYTES
          + (RELAYOUT_COMPILE_BYTES if relayouts else 0))


def fingerprint_programs_charge(num_programs: int) -> int:
  """Fingerprint programs a save compiles (`reuse.fingerprint_programs`), kept by XLA."""
  return int(num_programs) * FINGERPRINT_PROGRAM_BYTES


def startup_spread_bytes(startup_bytes: int) -> int:
  """How far apart the next process may measure a start-up this one measured
  at `startup_bytes` (the `startup` module's one-time costs); 0 for none.

  Measured in fresh processes of one state (`tools/fuzz_budget.py`):
  13.7-14.3 MiB, 16.6-16.7 MiB and 53.2-53.5 MiB, but 6.8-8.8 MiB and
  4.5-7.7 MiB (12 processes) for the restores of drawn states whose
  processes had compiled a trivial program (seeds 90 and 226): the spread
  does not grow with the start-up.  Seed 639's `orbax` save: about 6 MiB in
  the process refused (inferred from the budget it named), 11.12 MiB in
  the one that retried at that budget, which it then exceeded by 0.03 MiB:
  the headroom was a quarter of the start-up, at most 4 MiB, plus 3 MiB
  (4.5 MiB there).  Half of it, at most 4 MiB, plus 3 MiB covers all of
  these.
  """
  return min(startup_bytes // 2, 4 * MiB) + 3 * MiB if startup_bytes else 0


def suggested_budget_bytes(need_bytes: int, startup_bytes: int = 0) -> int:
  """The budget a refusal tells the user to use: `need_bytes` with headroom, in whole MiB.

  `need_bytes` includes `startup_bytes`, the one-time start-up this process
  paid (`startup`), which the next process measures differently
  (`startup_spread_bytes`): a budget named to the hundredth of a MiB was
  refused again 0.01-1.5 MiB short when retried (`tools/fuzz_budget.py`).

  Example:

    cost.suggested_budget_bytes(45.17 * MiB, startup_bytes=13.7 * MiB)  # 53 MiB
  """
  return -(-int(need_bytes + startup_spread_bytes(startup_bytes)) // MiB) * MiB


def min_restore_budget_bytes(num_leaves: int = 0) -> int:
  """The smallest budget a restore of `num_leaves` leaves can honour."""
  return FLOOR_BYTES + leaves_charge(num_leaves) + MIN_PIECES_BYTES


def chunkread_piece_bytes(piece_bytes: int, state_bytes, itemsize: int = 1) -> int | None:
  """The largest read piece <= `piece_bytes` that chunkread can use within
  what `restore_piece_bytes` set aside for it: two pieces plus
  CHUNKREAD_STATE_BYTES.  `state_bytes(piece)` is the array's own state
  (`chunkread.StoredArray.state_bytes`: it grows with the piece, and a zstd
  decoder window can exceed CHUNKREAD_STATE_BYTES alone).  None: none fits.
  """
  envelope = 2 * piece_bytes + CHUNKREAD_STATE_BYTES
  piece = int(piece_bytes)
  while piece >= max(1, itemsize):
    if 2 * piece + state_bytes(piece) <= envelope:
      return piece
    piece = piece * 7 // 8 if piece > 8 * KiB else piece - max(1, itemsize)
  return None


def restore_piece_bytes(capacity_bytes: int) -> int:
  """The largest piece whose reads and placement fit the capacity together.

  TensorStore read: piece + 2 chunks (<= piece each) + placement (2 pieces).
  chunkread: 2 pieces + its state + placement (2 pieces).
  """
  by_ts = capacity_bytes // 5
  by_chunkread = (capacity_bytes - CHUNKREAD_STATE_BYTES) // 4
  piece = min(by_ts, by_chunkread, MAX_SLICE_BYTES)
  return int(max(64 * KiB, piece // KiB * KiB))


# --- streaming layout -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StreamingLayout:
  """How the streaming writer spends a budget.

  Attributes:
    capacity_bytes: what the limiter admits (budget less the floor).
    slice_bytes: the largest slice (and zarr chunk) written.
    group_bytes: staged bytes per OCDBT transaction; one group fills while
      the previous one commits.
  """

  capacity_bytes: int
  slice_bytes: int
  group_bytes: int

  leaves_bytes: int = 0
  # The slice the budget allows, where the state made `slice_bytes` smaller
  # (`slicing.chunk_shape`'s `up_to_bytes`: a shard that would otherwise
  # fall to tiny chunks).  0: `slice_bytes`.
  budget_slice_bytes: int = 0

  @property
  def feasible(self) -> bool:
    """Room for two slices at the worst staging cost, after the leaves' share."""
    return (self.slice_bytes >= MIN_SLICE_BYTES and
            2 * staged_charge(self.slice_bytes, contiguous=False)
            <= self.capacity_bytes - self.leaves_bytes)


def streaming_layout(budget_bytes: int, num_leaves: int = 0,
                     data_bytes: int | None = None) -> StreamingLayout:
  """Slices sized so two groups of `TARGET_SLICES_PER_GROUP` fit the capacity;
  groups of no more than that many slices.

  The leaves' bookkeeping (`leaves_charge`) comes off the capacity first.
  `data_bytes` (what the save writes): slices of at most
  1/`STATE_SLICES` of it, so that the buffers the pipeline holds at once
  are at most half the state (`STATE_SLICES`).  The capacity is the
  budget's either way.

    cost.streaming_layout(256 << 20, 1, data_bytes=128 << 20).slice_bytes
    # 16 MiB: the same layout as any budget from 128 MiB up
  """
  cap = limiter_capacity(budget_bytes)
  leaves = leaves_charge(num_leaves)
  group = (cap - leaves) / (2 * STAGED_FACTOR)
  slice_bytes = int(min(MAX_SAVE_SLICE_BYTES, (cap - leaves) / (2 * STAGED_COPY_FACTOR),
                        group / TARGET_SLICES_PER_GROUP)) // MiB * MiB
  if slice_bytes < MIN_SLICE_BYTES:
    slice_bytes = int(group / TARGET_SLICES_PER_GROUP) // KiB * KiB
  # Once slices are at their largest, bigger groups only make bigger
  # commits for the disk to absorb at once: at 1 GiB, groups of 333 MiB
  # saved the Gemma-like state in 5.11 s (median of 8) against 4.53 s at
  # 256 MiB, and 4.65 s with groups of 128 MiB (/tmp A/B, alternating).
  budget_slice = slice_bytes
  if data_bytes is not None:
    small = max(MIN_SLICE_BYTES, int(data_bytes) // STATE_SLICES // MiB * MiB)
    if small < slice_bytes:
      slice_bytes = small
  group = min(group, TARGET_SLICES_PER_GROUP * max(slice_bytes, MIN_SLICE_BYTES))
  return StreamingLayout(capacity_bytes=max(0, cap), slice_bytes=max(0, slice_bytes),
                         group_bytes=max(0, int(group)), leaves_bytes=leaves,
                         budget_slice_bytes=max(0, budget_slice))


def predict_streaming(est: estimate_lib.TreeEstimate, layout: StreamingLayout) -> int:
  """Floor plus what is admitted at once; never more than the data needs."""
  data = staged_charge(est.total_bytes(True), contiguous=False)
  return FLOOR_BYTES + min(layout.capacity_bytes, data + leaves_charge(est.num_leaves))


# --- Orbax's async save ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OrbaxCost:
  """The worst case of one Orbax async save, by component (bytes)."""

  host_copy_bytes: int
  pinned_staging_bytes: int
  encode_bytes: int
  floor_bytes: int = ORBAX_FLOOR_BYTES

  @property
  def peak_bytes(self) -> int:
    return (self.host_copy_bytes + self.pinned_staging_bytes + self.encode_bytes
            + self.floor_bytes)


def predict_orbax_async(
    est: estimate_lib.TreeEstimate, *, use_replica_parallel: bool,
    enable_pinned_host_transfer: bool, compiled: Collection[tuple] = ()) -> OrbaxCost:
  """Worst case of Orbax's async raw save: every host copy lives until the commit.

  Orbax copies every array to the host before `save()` returns and keeps the
  copies until the background commit ends.  On the CPU backend the copy is
  zero-copy except for replica-parallel slices (`lax.slice_in_dim` makes new
  buffers) and packed dtypes (`estimate.packed_on_device`: numpy unpacks
  them); numpy leaves are deep-copied.  Raw chunks: TensorStore writes
  from those copies.  Replica-parallel slices compile programs XLA keeps
  (`estimate.LeafEstimate.slice_programs`), those in `compiled` aside.
  """
  on_cpu = est.platform == 'cpu'
  copies = 0
  chunk_copies = 0
  sliced = use_replica_parallel and any(l.replica_parallel_applies for l in est.leaves)
  programs = ({k for l in est.leaves for k in l.slice_programs} - set(compiled)
              if use_replica_parallel else set())
  for leaf in est.leaves:
    w = leaf.host_bytes(use_replica_parallel)
    if not leaf.is_array:
      copies += w  # NumpyHandler deep-copies host values for async saves.
    elif leaf.packed:
      # Unpacked into a real copy even on CPU (`packed_copy_extra_bytes`).
      copies += w + packed_copy_extra_bytes(w, cpu=on_cpu)
    elif not on_cpu or (use_replica_parallel and leaf.replica_parallel_applies):
      copies += w
    if leaf.unit_dim_chunks:
      # TensorStore copies such chunks again, whatever the platform (a 512
      # MiB (131072, 1, 1024) leaf under `auto` at 256 MiB on CPU peaked at
      # 512 MiB when this was predicted as zero-copy).
      chunk_copies += w
  pinned = copies if enable_pinned_host_transfer and not on_cpu else 0
  encode = chunk_copies + int(est.total_bytes(use_replica_parallel) * ORBAX_RAW_ENCODE_FACTOR)
  floor = (ORBAX_FLOOR_BYTES + (ORBAX_SLICE_COMPILE_BYTES if sliced else 0)
           + max(0, len(programs) - ORBAX_SLICE_PROGRAMS_IN_COMPILE) * ORBAX_SLICE_PROGRAM_BYTES
           + est.num_leaves * ORBAX_PER_LEAF_BYTES)
  return OrbaxCost(host_copy_bytes=copies, pinned_staging_bytes=pinned, encode_bytes=encode,
                   floor_bytes=floor)
