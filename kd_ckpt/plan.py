"""The policy: rank the ways to save, and pick the first that fits the budget.

Each strategy is a small object with its own `predict` (the numbers come from
`cost`):

  1. `OrbaxAsync`: Orbax's own async save, raw chunks.  Training continues
     while the save is written, as with stock Kauldron, but every host copy
     lives until the background commit ends, and nothing can bound that from
     outside: it is chosen only when its *worst case* fits.  Variants: replica
     parallelism on/off, pinned-host staging (GPUs) on/off; the one that
     makes the busiest host write least, then the fastest, wins.
  2. `Streaming`: leaf by leaf, big leaves in slices, every host buffer
     admitted through the host limiter: it holds any budget above
     `cost.min_budget_bytes()`, on any state, and blocks until durable.

A save that blocks until durable anyway (`kd_ckpt.save`) gains nothing from
Orbax's async commit: there `auto` streams a tree of small leaves (at most
`STREAM_LEAVES_UP_TO_BYTES` on average) or, on the CPU backend, a large one
(at least `STREAM_FROM_BYTES`), which kd_ckpt's writer saves faster than
Orbax's, even where Orbax's worst case fits.

zstd is not among the choices: TensorStore's zstd encoder fragments glibc's
thread arenas (over saves 5-50 of 512 MiB, Orbax default's RSS drifted
22.2 MiB, kd_ckpt's raw saves 1.0-1.6 MiB: bench/results/results.md,
"Soak"); raw chunks cost ~8% more disk on float weights and are faster
here.  Both writers store a leaf of zeros (>= 4 MiB) with zstd as Orbax
does, `arrays.ZSTD_ZERO_LEAVES_FROM_BYTES` (40 streaming saves with zero
leaves: RSS drift 0.7 MiB, as raw).

Example:

  plan = kd_ckpt.plan_save(state, host_ram_budget="2GiB")
  print(plan)                 # table: leaves, candidates, choice
  plan.strategy, plan.predicted_peak_bytes
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Literal, Mapping, Protocol, Sequence

import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from kd_ckpt import budget as budget_lib
from kd_ckpt import cost
from kd_ckpt import estimate as estimate_lib
from kd_ckpt import exchange
from kd_ckpt import hostmem
from kd_ckpt import startup
from kd_ckpt import text

Strategy = Literal['auto', 'orbax', 'streaming']
STRATEGIES = ('auto', 'orbax', 'streaming')

# Up to this mean leaf size a blocking save streams under `auto`: per leaf,
# kd_ckpt's writer costs less than Orbax's (auto's Orbax path adds kd_ckpt's
# bookkeeping to Orbax's own).  Streaming's time over the Orbax path's on this
# 2-core machine, hashed f32 leaves on one device, median of 5 saves
# alternating in one process (`bench/ab_save.py --state leaves --leaves N
# --leaf-bytes B --reps 5 --variants now,kd-orbax,orbax`): 1,000 x 4 KiB
# 0.91, 1,000 x 16 KiB 0.99, 500 x 64 KiB 0.86.
STREAM_LEAVES_UP_TO_BYTES = 64 * 1024

# From this many bytes (the whole tree's, so that every process of a job
# decides alike) a blocking save on the CPU backend streams under `auto`
# whatever its leaves: there the streaming writer wrote large states faster
# than Orbax's (its writes overlap their flushes, `kd_ckpt.writeback`),
# though it alone pays the host copy a GPU host pays both ways
# (`streaming.to_host`).  Streaming's time over the Orbax path's, hashed
# leaves, medians of 4-5 saves alternating in one process with `dd` before
# each (`bench/ab_save.py ... --variants now,kd-orbax`, session 25,
# 2026-12-05): 100 x 1 MiB 1.52, 300 x 256 KiB 1.17, 40 x 4 MiB 1.11, 40 x 8
# MiB 0.96, one 512 MiB leaf 0.88, 40 x 16 MiB 0.75, 40 x 32 MiB (1.34 GB)
# 0.83, the Gemma-like state at 0.5 GB 0.78 and at 2.2 GB 0.88 (0.85 without
# `dd`).  Against it, `tests/states.py`'s `zeros` state (noise beside large
# all-zero leaves, `--state zeros`): 1.24 at 0.47 GB and 1.21 at 1.88 GB,
# and 1.23 and 1.27 once zero leaves were written as one encoded chunk
# (`streaming._write_zero_chunks`): there its noise leaves' host copy is not
# paid back.  Hence 1 GiB: up to it the noise states gain little and the
# zeros state loses most.  Not on
# other backends: the one GPU run (`bench/results/gpu_check.md`, an older
# writer) saved 4 GB in 6.14 s streaming against Orbax default's 5.26 s.
STREAM_FROM_BYTES = 1024 * 1024 * 1024


class BudgetTooSmallError(ValueError):
  """No strategy can save this tree within the host-RAM budget."""


@dataclasses.dataclass(frozen=True)
class OrbaxSettings:
  """The Orbax knobs of an Orbax-strategy save."""

  use_async: bool = True
  use_compression: bool = False
  use_replica_parallel: bool = True
  enable_pinned_host_transfer: bool = False
  save_concurrent_bytes: int | None = None
  save_device_host_concurrent_bytes: int | None = None

  def short(self) -> str:
    parts = ['async' if self.use_async else 'sync',
             'zstd' if self.use_compression else 'raw',
             'replica-parallel' if self.use_replica_parallel else 'single-replica']
    if self.enable_pinned_host_transfer:
      parts.append('pinned')
    return ','.join(parts)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way to save, with its predicted peak extra host RAM.

  Attributes:
    name: what the table shows.
    strategy: 'orbax' or 'streaming'.
    predicted_peak_bytes: this process's predicted peak.
    fits: whether it fits the budget on every process.
    enforced: True when the host limiter bounds it (the prediction is then
      an upper bound by construction); False for Orbax's own save (the
      prediction is its worst case).
    orbax: the Orbax settings, for Orbax candidates.
    layout: the streaming layout, for streaming.
    worst_peak_bytes: the highest predicted peak over all processes.
    written_bytes: bytes the busiest process writes.
  """

  name: str
  strategy: Literal['orbax', 'streaming']
  predicted_peak_bytes: int
  fits: bool
  enforced: bool
  orbax: OrbaxSettings | None = None
  layout: cost.StreamingLayout | None = None
  worst_peak_bytes: int = 0
  written_bytes: int = 0


class SaveStrategy(Protocol):
  name: str

  def predict(self, est: estimate_lib.TreeEstimate, budget_bytes: int) -> Candidate:
    ...


@dataclasses.dataclass(frozen=True)
class OrbaxAsync:
  """Orbax's async save (raw chunks) with given replica/pinned settings."""

  use_replica_parallel: bool
  enable_pinned_host_transfer: bool = False
  name: str = 'orbax async raw'

  def predict(self, est, budget_bytes) -> Candidate:
    c = cost.predict_orbax_async(
        est, use_replica_parallel=self.use_replica_parallel,
        enable_pinned_host_transfer=self.enable_pinned_host_transfer,
        compiled=estimate_lib.compiled_slice_programs())
    zero_size = any(l.is_array and 0 in l.shape for l in est.leaves)
    return Candidate(
        name=self.name, strategy='orbax', predicted_peak_bytes=c.peak_bytes,
        fits=c.peak_bytes <= budget_bytes and not zero_size, enforced=False,
        orbax=OrbaxSettings(use_replica_parallel=self.use_replica_parallel,
                            enable_pinned_host_transfer=self.enable_pinned_host_transfer),
        worst_peak_bytes=c.peak_bytes,
        written_bytes=est.total_bytes(self.use_replica_parallel))


@dataclasses.dataclass(frozen=True)
class Streaming:
  """kd_ckpt's bounded writer (`streaming`)."""

  name: str = 'streaming'

  def predict(self, est, budget_bytes) -> Candidate:
    # The layout sets the chunk shape every process writes its shards in, so
    # it comes from what all processes see alike: the whole tree's bytes,
    # not this process's (process 0 also writes the numpy leaves).  From
    # this process's bytes, a 4-process save whose process 0 held 16 MiB of
    # numpy leaves wrote chunks of (387, 1000) there and (129, 2000) in the
    # others, under one metadata: a corrupt checkpoint (`tools/fuzz_budget.py
    # --processes 4` seed 5003; `kd_ckpt.verify` named the leaf).
    layout = cost.streaming_layout(budget_bytes, est.num_leaves,
                                   data_bytes=est.global_bytes)
    peak = cost.predict_streaming(est, layout)
    return Candidate(
        name=self.name, strategy='streaming', predicted_peak_bytes=peak,
        fits=layout.feasible and peak <= budget_bytes, enforced=True, layout=layout,
        worst_peak_bytes=peak, written_bytes=est.total_bytes(True))


@dataclasses.dataclass(frozen=True)
class SavePlan:
  """What a save will do, decided before anything is copied.

  Attributes:
    strategy: 'orbax' or 'streaming'.
    budget_bytes: the resolved host-RAM budget for this process.
    budget_text: the budget as the user wrote it.
    predicted_peak_bytes: predicted peak extra host RAM of the chosen way.
    enforced: whether the host limiter bounds the chosen way (streaming).
    total_bytes: bytes this host writes.
    global_bytes: bytes of the whole tree.
    num_leaves: leaves in the tree.
    largest_leaf_bytes: the largest leaf (global).
    orbax: the chosen Orbax settings (None for streaming).
    layout: the streaming layout (None for Orbax).
    candidates: every strategy considered, with its prediction.
    estimate: the per-leaf estimate the plan was made from.
    platform: JAX backend the estimate is for.
    startup_bytes: host RAM this save spent before planning on the process's
      one-time XLA compiler start-up (`kd_ckpt.startup`): part of the peak,
      so the rest of the save plans with the budget less this.
    fingerprint_programs: device programs this save's fingerprints (reuse)
      compile the way it saves, which XLA keeps
      (`reuse.fingerprint_programs_by_way`): charged
      `cost.FINGERPRINT_PROGRAM_BYTES` each, like the start-up.
    why: why this way was chosen, one line.
  """

  strategy: Literal['orbax', 'streaming']
  budget_bytes: int
  budget_text: str
  predicted_peak_bytes: int
  enforced: bool
  total_bytes: int
  global_bytes: int
  num_leaves: int
  largest_leaf_bytes: int
  orbax: OrbaxSettings | None
  layout: cost.StreamingLayout | None
  candidates: tuple[Candidate, ...]
  estimate: estimate_lib.TreeEstimate = dataclasses.field(repr=False)
  platform: str = 'cpu'
  startup_bytes: int = 0
  fingerprint_programs: int = 0
  why: str = ''

  @property
  def fits(self) -> bool:
    return self.predicted_peak_bytes <= self.budget_bytes

  @property
  def slice_bytes(self) -> int | None:
    return self.layout.slice_bytes if self.layout else None

  @property
  def reserved_bytes(self) -> int:
    """The budget spent outside the limiter: start-up and fingerprint programs."""
    return self.startup_bytes + cost.fingerprint_programs_charge(self.fingerprint_programs)

  @property
  def capacity_bytes(self) -> int:
    """What the host limiter admits (budget less the floor, start-up and programs)."""
    return cost.limiter_capacity(self.budget_bytes - self.reserved_bytes)

  def to_json_dict(self) -> dict[str, Any]:
    """A JSON-serialisable summary (what `python -m kd_ckpt plan --json` prints)."""
    return {
        'strategy': self.strategy,
        'budget_bytes': self.budget_bytes,
        'budget': self.budget_text,
        'predicted_peak_bytes': self.predicted_peak_bytes,
        'enforced': self.enforced,
        'total_bytes': self.total_bytes,
        'global_bytes': self.global_bytes,
        'num_leaves': self.num_leaves,
        'startup_bytes': self.startup_bytes,
        'fingerprint_programs': self.fingerprint_programs,
        'why': self.why,
        'largest_leaf_bytes': self.largest_leaf_bytes,
        'platform': self.platform,
        'orbax': dataclasses.asdict(self.orbax) if self.orbax else None,
        'slice_bytes': self.slice_bytes,
        'group_bytes': self.layout.group_bytes if self.layout else None,
        'candidates': [
            {'name': c.name, 'strategy': c.strategy,
             'predicted_peak_bytes': c.predicted_peak_bytes, 'fits': c.fits,
             'enforced': c.enforced}
            for c in self.candidates
        ],
        'largest_leaves': [
            {'path': l.path, 'shape': list(l.shape), 'dtype': l.dtype,
             'bytes': l.global_bytes, 'host_bytes': l.host_bytes(True)}
            for l in self.estimate.largest(8)
        ],
    }

  def to_json(self) -> str:
    return json.dumps(self.to_json_dict(), indent=2)

  def settings_text(self) -> str:
    """The chosen Orbax settings or streaming layout, short."""
    if self.orbax is not None:
      return self.orbax.short()
    assert self.layout is not None
    return (f'slices of {text.format_bytes(self.layout.slice_bytes)},'
            f' limiter {text.format_bytes(self.layout.capacity_bytes)}')

  def summary(self) -> str:
    """One line, for logs."""
    bound = 'enforced' if self.enforced else 'worst case'
    return (
        f'strategy={self.strategy} ({self.settings_text()}) peak'
        f' {text.format_bytes(self.predicted_peak_bytes)} ({bound}) of budget'
        f' {text.format_bytes(self.budget_bytes)} ({self.budget_text});'
        f' writes {text.format_bytes(self.total_bytes)} in {self.num_leaves} leaves')

  def __str__(self) -> str:
    fb = text.format_bytes
    lines = [
        f'kd_ckpt save plan ({self.platform}, process'
        f' {self.estimate.process_index}/{self.estimate.process_count})',
        f'  this host writes  {fb(self.total_bytes)} of {fb(self.global_bytes)}'
        f' in {self.num_leaves} leaves (largest leaf {fb(self.largest_leaf_bytes)})',
        f'  budget            {fb(self.budget_bytes)} ({self.budget_text})'
        + (f', of which one-time start-up (XLA, storage clients) took {fb(self.startup_bytes)}'
           if self.startup_bytes else '')
        + (f', {self.fingerprint_programs} fingerprint programs (reuse) are charged'
           f' {fb(cost.fingerprint_programs_charge(self.fingerprint_programs))}'
           if self.fingerprint_programs else ''),
        f'  choice            {self.summary()}',
    ] + ([f'  why               {self.why}'] if self.why else []) + [
        '',
    ]
    rows = [('candidate', 'predicted peak', 'x budget', 'bound', 'fits')]
    for c in self.candidates:
      rows.append((c.name + (f' ({c.orbax.short()})' if c.orbax else ''),
                   fb(c.predicted_peak_bytes),
                   f'{c.predicted_peak_bytes / max(1, self.budget_bytes):.2f}',
                   'enforced' if c.enforced else 'worst case', 'yes' if c.fits else 'no'))
    lines.append(text.table(rows))
    lines.append('')
    lines.append(str(self.estimate))
    return '\n'.join(lines)


def strategies_for(platform: str) -> list[SaveStrategy]:
  """Every way to save, in order of preference (variants of one kind together)."""
  accelerator = platform in ('gpu', 'cuda', 'rocm')
  out: list[SaveStrategy] = []
  for rp in (True, False):
    if accelerator:
      out.append(OrbaxAsync(use_replica_parallel=rp, enable_pinned_host_transfer=True))
    out.append(OrbaxAsync(use_replica_parallel=rp))
  out.append(Streaming())
  return out


def candidates_for(est: estimate_lib.TreeEstimate, budget_bytes: int,
                   reserved_by_way: Mapping[str, int] | None = None) -> list[Candidate]:
  """Each strategy's prediction; in a multi-process job, agreed by all processes.

  `reserved_by_way`: budget already spent, or to be spent outside the
  saves' limiter, by each of `WAYS` (start-up, fingerprint programs): a
  candidate is predicted with the budget less its way's, and its
  prediction includes it.  A candidate fits only where it fits on every
  process, and Orbax variants are ranked by the busiest process (collective
  when `est.process_count > 1`; `budget_bytes` and `reserved_by_way` must be
  the same everywhere).
  """
  cands = []
  for s in strategies_for(est.platform):
    r = (reserved_by_way or {}).get(_way(s), 0)
    c = s.predict(est, budget_bytes - r)
    cands.append(dataclasses.replace(  # fits: within what is left
        c, predicted_peak_bytes=c.predicted_peak_bytes + r,
        worst_peak_bytes=c.worst_peak_bytes + r))
  if est.process_count > 1:
    rows = exchange.agree(
        [x for c in cands for x in (c.predicted_peak_bytes, c.written_bytes, int(c.fits))],
        what='the save plan').reshape(-1, len(cands), 3)
    cands = [dataclasses.replace(c, worst_peak_bytes=int(rows[:, i, 0].max()),
                                 written_bytes=int(rows[:, i, 1].max()),
                                 fits=bool(rows[:, i, 2].min()))
             for i, c in enumerate(cands)]
  return cands


def _best_orbax(cands: Sequence[Candidate], budget_bytes: int) -> Candidate | None:
  """The Orbax variant that makes the busiest host write least, then pinned, then lowest peak."""
  orbax = [c for c in cands if c.strategy == 'orbax']
  if not orbax:
    return None
  return min(orbax, key=lambda c: (
      c.worst_peak_bytes > budget_bytes, c.written_bytes,
      not c.orbax.enable_pinned_host_transfer, c.worst_peak_bytes))


@functools.lru_cache(maxsize=None)
def _tensorstore_stores(dtype: str) -> bool:
  """Whether TensorStore has a data type for numeric `dtype` (not uint4,
  uint2, float6_*, float8_e4m3 in tensorstore 0.1.x; int4 and float4 it has).
  Strings and objects are Orbax's metadata, not TensorStore's."""
  if np.dtype(jnp.dtype(dtype)).kind in 'OSU':
    return True
  try:
    ts.dtype(dtype)
  except ValueError:
    return False
  return True


def check_strategy(strategy: str) -> str:
  if strategy not in STRATEGIES:
    raise ValueError(
        f'Unknown strategy={strategy!r}. It needs to be one of {list(STRATEGIES)}:'
        ' "auto" picks the fastest way that fits the budget, "orbax" forces'
        " Orbax's own async save (its worst case must fit), \"streaming\" forces"
        ' the bounded slice-by-slice writer.')
  return strategy


def _streams_faster(est: estimate_lib.TreeEstimate) -> str:
  """Why a blocking save of this tree streams faster than Orbax's writer ('' if not).

  Global bytes and leaf count are the same on every process, so every
  process of a job decides alike.
  """
  if _small_leaves(est):
    mean = text.format_bytes(est.global_bytes // est.num_leaves)
    return (f'a blocking save of {est.num_leaves} leaves of {mean} on average'
            f' (at most {text.format_bytes(STREAM_LEAVES_UP_TO_BYTES)}):'
            " kd_ckpt's writer saves small leaves faster than Orbax's")
  if est.platform == 'cpu' and est.global_bytes >= STREAM_FROM_BYTES:
    return (f'a blocking save of {text.format_bytes(est.global_bytes)} on the CPU'
            f' backend (at least {text.format_bytes(STREAM_FROM_BYTES)}): kd_ckpt\'s'
            " writer overlaps its writes with their flushes and saves a large state"
            " faster than Orbax's")
  return ''


def _small_leaves(est: estimate_lib.TreeEstimate) -> bool:
  """Whether the tree's leaves average at most STREAM_LEAVES_UP_TO_BYTES.

  Global bytes and leaf count are the same on every process, so every
  process of a job decides alike.
  """
  return (est.num_leaves > 0
          and est.global_bytes <= STREAM_LEAVES_UP_TO_BYTES * est.num_leaves)


# How a save cuts replicated leaves, which decides what its fingerprints
# compile (`reuse.fingerprint_programs_by_way`): Orbax's writer either way,
# or the streaming writer.
WAYS = ('replica_parallel', 'single_replica', 'streaming')


def way_of(c: Candidate) -> str:
  """The `WAYS` entry a candidate saves by."""
  if c.orbax is None:
    return 'streaming'
  return 'replica_parallel' if c.orbax.use_replica_parallel else 'single_replica'


def _way(s: SaveStrategy) -> str:
  if isinstance(s, OrbaxAsync):
    return 'replica_parallel' if s.use_replica_parallel else 'single_replica'
  return 'streaming'


def _programs_by_way(fingerprint_programs: int | Mapping[str, int]) -> dict[str, int]:
  if isinstance(fingerprint_programs, Mapping):
    unknown = set(fingerprint_programs) - set(WAYS)
    if unknown:
      raise ValueError(f'fingerprint_programs has unknown ways {sorted(unknown)}: the ways'
                       f' are {list(WAYS)} (`reuse.fingerprint_programs_by_way`).')
    return {w: max(0, int(fingerprint_programs.get(w, 0))) for w in WAYS}
  return dict.fromkeys(WAYS, max(0, int(fingerprint_programs)))


def plan_from_estimate(
    est: estimate_lib.TreeEstimate, *, budget_bytes: int, budget_text: str = '',
    strategy: str = 'auto', startup_bytes: int = 0,
    fingerprint_programs: int | Mapping[str, int] = 0,
    blocking: bool = True, unpaid_startup: Mapping[str, int] | None = None) -> SavePlan:
  """Chooses among `candidates_for(est)`; raises BudgetTooSmallError if none fits.

  `startup_bytes` were already spent by this save (`kd_ckpt.startup`), and
  its `fingerprint_programs` will be kept by XLA (`plan_save`; one count,
  or one for each of `WAYS`): each candidate shares what is left after its
  own, and its prediction includes both.
  `blocking`: the save returns only once durable (`plan_save`).
  `unpaid_startup`: the parts of `startup_bytes` that are estimates of
  start-ups not paid yet, {'compiler': bytes, 'storage': bytes}
  (`plan_save(pay_startup=True)`), which a refusal names.
  """
  check_strategy(strategy)
  startup_bytes = max(0, int(startup_bytes))
  programs = _programs_by_way(fingerprint_programs)
  reserved_by_way = {w: startup_bytes + cost.fingerprint_programs_charge(n)
                     for w, n in programs.items()}
  # Each way is predicted with the budget its own programs leave (a way a
  # previous save took compiles nothing new; the others may).
  cands = candidates_for(est, budget_bytes, reserved_by_way)
  stream = next(c for c in cands if c.strategy == 'streaming')
  best_orbax = _best_orbax(cands, budget_bytes)

  unpaid = {k: int(v) for k, v in (unpaid_startup or {}).items() if v}
  paid_startup_bytes = max(0, startup_bytes - sum(unpaid.values()))

  def startup_note(way: str) -> str:
    note = (
        f' This save first paid {text.format_bytes(paid_startup_bytes)} for one-time'
        ' start-up (XLA\'s compiler start-up at the first compile of the ops kd_ckpt'
        ' uses in this process, and the storage clients at its first gs:// access); a'
        ' process that has compiled a training step and touched its bucket pays'
        ' almost none of it.' if paid_startup_bytes else '')
    if unpaid:
      parts = [f'{text.format_bytes(unpaid[k])} for {what}' for k, what in (
          ('compiler', 'XLA\'s compiler start-up (this process holds no compiled program;'
           ' one that has compiled a training step pays under 1 MiB of it)'),
          ('storage', 'the storage clients (this process\'s first gs:// access)'))
               if k in unpaid]
      note += (f' The budget named includes {" and ".join(parts)}, one-time start-up'
               ' that this refusal did not pay.')
    if programs[way]:
      note += (
          f' Its fingerprints (reuse) compile {programs[way]} programs on the'
          ' devices, one per leaf shape and device set, which XLA keeps for the life of'
          f' the process ({text.format_bytes(cost.fingerprint_programs_charge(programs[way]))}'
          ' charged); later saves of the same tree compile none. Saving without'
          ' reuse (or fingerprint) spends none.')
    return note

  unstorable = [l for l in est.leaves if not _tensorstore_stores(l.dtype)]
  if unstorable:
    # TensorStore (every strategy's writer, and stock Orbax's) has no such
    # data type: the save would fail once writing, with 'Unsupported data type'.
    raise ValueError(
        f'Leaf {unstorable[0].path!r} has dtype {unstorable[0].dtype}, which TensorStore,'
        ' and so Orbax, cannot store (no zarr data type). Cast it before saving and'
        ' back after restoring: uint8 holds uint2 and uint4 values, bfloat16 holds'
        ' float6 and float8_e4m3 values exactly.')
  empty = [l.path for l in est.leaves if l.is_array and 0 in l.shape]
  if empty and strategy == 'orbax':
    # Orbax 0.12 refuses zero-size arrays; the streaming writer stores them
    # in Orbax's own format (zarr metadata, no chunks).
    raise ValueError(
        f'Leaf {empty[0]!r} has zero size, which Orbax cannot save. Use'
        ' strategy="auto" or "streaming" (kd_ckpt\'s streaming writer stores'
        ' zero-size arrays), or drop the leaf.')
  if strategy == 'orbax':
    choice = best_orbax
    if not choice.fits:
      raise BudgetTooSmallError(
          f"strategy='orbax': Orbax's own save peaks at up to"
          f' {text.format_bytes(choice.worst_peak_bytes)} for this tree (every host'
          ' copy lives until its background commit ends), more than'
          f' host_ram_budget={budget_text or budget_bytes}'
          f' ({text.format_bytes(budget_bytes)}). Use strategy="auto" or'
          f' "streaming" (bounded), or raise host_ram_budget to'
          f' {text.budget_literal(cost.suggested_budget_bytes(choice.worst_peak_bytes, startup_bytes))}'
          f' or more.{startup_note(way_of(choice))}')
    why = "strategy='orbax' asked for, and its worst case fits"
  elif strategy == 'auto' and best_orbax is not None and best_orbax.fits and not (
      blocking and stream.fits and _streams_faster(est)):
    choice = best_orbax
    why = ("Orbax's async save fits the budget in its worst case"
           + ('' if blocking else ', and training goes on while it commits'))
  elif stream.fits:
    choice = stream
    if strategy == 'streaming':
      why = "strategy='streaming' asked for"
    elif best_orbax is not None and best_orbax.fits:
      why = _streams_faster(est)
    else:
      why = 'no Orbax variant fits the budget in its worst case'
  else:
    reserved = reserved_by_way['streaming']
    need = cost.min_budget_bytes(est.num_leaves) + reserved
    raise BudgetTooSmallError(
        f'host_ram_budget={budget_text or budget_bytes} resolves to'
        f' {text.format_bytes(budget_bytes)}, below the smallest budget kd_ckpt'
        f' can honour for this tree ({text.format_bytes(need)}: a fixed floor of'
        f' {text.format_bytes(cost.FLOOR_BYTES)}, {est.num_leaves} leaves\''
        f' bookkeeping ({text.format_bytes(cost.leaves_charge(est.num_leaves))}), room'
        f' for two {text.format_bytes(cost.MIN_SLICE_BYTES)} slices'
        + (f' and the {text.format_bytes(reserved)} below' if reserved else '') + '). Raise'
        f' host_ram_budget to {text.budget_literal(cost.suggested_budget_bytes(need, startup_bytes))}'
        f' or more.{startup_note("streaming")}')
  use_rp = choice.orbax.use_replica_parallel if choice.orbax else True
  return SavePlan(
      strategy=choice.strategy, budget_bytes=budget_bytes,
      budget_text=budget_text or str(budget_bytes),
      predicted_peak_bytes=choice.predicted_peak_bytes, enforced=choice.enforced,
      total_bytes=est.total_bytes(use_rp), global_bytes=est.global_bytes,
      num_leaves=est.num_leaves,
      largest_leaf_bytes=max((l.global_bytes for l in est.leaves), default=0),
      orbax=choice.orbax, layout=choice.layout, candidates=tuple(cands),
      estimate=est, platform=est.platform, startup_bytes=startup_bytes,
      fingerprint_programs=programs[way_of(choice)], why=why)


def agreed_budget(spec: budget_lib.BudgetSpec, mem: hostmem.HostMemory | None,
                  process_count: int) -> int:
  """The budget every process plans with: the smallest (collective if > 1)."""
  mem = mem if mem is not None else hostmem.probe()
  budget_bytes = budget_lib.resolve(spec, mem)
  if process_count == 1:
    return budget_bytes
  everyone = exchange.agree([budget_bytes], what='the save budget')
  if spec.fraction is not None:
    # A fraction of the host's RAM is split between the processes that share
    # the host, which the first exchange has just counted.  Every process
    # makes this second round (even where the count did not change), so the
    # rounds stay matched.
    budget_bytes = budget_lib.resolve(spec, hostmem.probe())
    everyone = exchange.agree([budget_bytes], what='the save budget, per host')
  return int(everyone.min())


def plan_save(
    tree: Any,
    *,
    host_ram_budget: budget_lib.BudgetLike = 'auto',
    strategy: str = 'auto',
    memory: hostmem.HostMemory | None = None,
    platform: str | None = None,
    startup_bytes: int = 0,
    fingerprint_programs: int | Mapping[str, int] = 0,
    save_id=None,
    blocking: bool = True,
    pay_startup: bool = False,
) -> SavePlan:
  """Plans a save of `tree` within `host_ram_budget`, copying nothing.

  Args:
    tree: a pytree of `jax.Array`s, `jax.ShapeDtypeStruct`s with shardings
      (e.g. from `jax.eval_shape`), numpy arrays and scalars.
    host_ram_budget: the most extra host RAM the save may add: peak RSS
      during the save (async commit included) minus RSS just before it; see
      `kd_ckpt.budget`.
    strategy: 'auto', 'orbax' or 'streaming'.
    memory: a host-memory probe to plan against (default: probe now).
    platform: plan as if saving from this JAX backend ('gpu', 'tpu', 'cpu';
      default: the current one).  On the CPU backend device memory is host
      memory and Orbax's device->host copy is free; plan with 'gpu' from a
      CPU machine to see what a GPU host would pay.
    startup_bytes: host RAM the save already spent (`kd_ckpt.startup`): the
      plan shares what is left of the budget.  A preflight leaves it 0; the
      first save of a process that never ran a jit pays XLA's compiler
      start-up (~50 MiB) on top.
    fingerprint_programs: device programs the save's fingerprints will
      compile, which XLA keeps: each is charged
      `cost.FINGERPRINT_PROGRAM_BYTES`.  One count for every way to save, or
      one for each of `WAYS` (`reuse.fingerprint_programs_by_way`, which
      saves with reuse pass): each candidate is charged its own way's.
    save_id: the destination of the save this plans (saves pass it), which
      names its exchanges in a multi-process job.  None: a preflight.
    pay_startup: pay the one-time start-ups the save needs once the budget
      is known, and add them to `startup_bytes`: XLA's compiler if `tree`
      holds jax.Arrays (`startup.start_compiler`), the storage clients if
      `save_id` is a bucket path (`startup.start_storage`).  Unless the save
      is refused even with their estimates (`startup.pending_compiler_bytes`,
      `pending_storage_bytes`): those are then named in the budget and not
      paid.  Saves pass it; a preflight leaves it False.
    blocking: the save returns only once durable, as `kd_ckpt.save` does;
      then 'auto' streams trees of small leaves (and on the CPU backend
      trees of at least 1 GiB), which kd_ckpt's writer saves faster than
      Orbax's.  False (Kauldron's `SafeCheckpointer`, whose
      saves commit in the background): 'auto' prefers Orbax's async save
      wherever its worst case fits.

  Returns:
    A `SavePlan`; `print(plan)` shows the table.

  In a multi-process job this is collective, like the save it plans: call it
  on every process (`kd_ckpt.exchange`).  The processes plan with the
  smallest of their budgets and choose the same way to save.

  Raises:
    ValueError: bad budget or strategy, or a deleted array in the tree.
    BudgetTooSmallError: no strategy fits the budget.
  """
  check_strategy(strategy)
  spec = budget_lib.parse(host_ram_budget)
  est = estimate_lib.estimate_tree(tree, platform=platform)
  with exchange.save_round(save_id):
    budget_bytes = agreed_budget(spec, memory, est.process_count)
    compiles = pay_startup and startup.compiles(tree)
    touches = pay_startup and save_id is not None
    pending = {'compiler': startup.pending_compiler_bytes() if compiles else 0,
               'storage': startup.pending_storage_bytes(save_id) if touches else 0}
    if est.process_count > 1:
      # Slices (the zarr chunks every process writes into) must be the same
      # everywhere: every process plans with the largest start-up.
      programs = _programs_by_way(fingerprint_programs)
      agreed = [int(n) for n in exchange.agree(
          [startup_bytes, pending['compiler'], pending['storage']]
          + [programs[w] for w in WAYS], what='the start-up').max(axis=0)]
      startup_bytes, pending = agreed[0], {'compiler': agreed[1], 'storage': agreed[2]}
      fingerprint_programs = dict(zip(WAYS, agreed[3:]))
    plan = functools.partial(plan_from_estimate, est, budget_bytes=budget_bytes,
                             budget_text=spec.text, fingerprint_programs=fingerprint_programs,
                             strategy=strategy, blocking=blocking)
    if any(pending.values()):
      # Refused even with the start-ups' estimates: refused before paying them
      # (a fresh process's save at 16 MiB paid ~54 MiB to be refused, ~51 MiB
      # to a bucket).
      plan(startup_bytes=startup_bytes + sum(pending.values()), unpaid_startup=pending)
    if pay_startup:
      paid = ((startup.start_compiler() if compiles else 0)
              + (startup.start_storage(save_id) if touches else 0))
      if est.process_count > 1:
        paid = int(exchange.agree([paid], what='the start-up paid').max())
      startup_bytes += paid
    return plan(startup_bytes=startup_bytes)
