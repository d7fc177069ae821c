"""The policy: pick the save strategy and Orbax settings that fit the budget.

Preference, first that fits wins (Orbax's defaults are never taken blindly):

  1. Orbax async, zstd on: training continues while the save is written, as
     with stock Kauldron.  Pinned-host staging only if it fits too.
  2. Orbax async, zstd off: TensorStore then references the host copy instead
     of encoding into new buffers (the checkpoint is ~10% larger on disk).
  3. Orbax sync with `save_device_host_concurrent_bytes` and
     `save_concurrent_bytes` set, zstd off: batches of whole arrays.
  4. Streaming: leaf by leaf, big leaves in slices; holds any budget above
     `streaming.MIN_BUDGET_BYTES`.

Replica parallelism is chosen per candidate: on, when it lowers what this
host writes (replicas on other hosts share the work) and costs no extra host
copy; off otherwise.

Example:

  plan = kd_ckpt.plan_save(state, host_ram_budget="2GiB")
  print(plan)                 # table: leaves, candidates, choice
  plan.strategy, plan.predicted_peak_bytes
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, Sequence

import numpy as np

from kd_ckpt import budget as budget_lib
from kd_ckpt import estimate as estimate_lib
from kd_ckpt import hostmem
from kd_ckpt import streaming_layout

Strategy = Literal['auto', 'orbax', 'streaming']
STRATEGIES = ('auto', 'orbax', 'streaming')

# Orbax's PyTree handler raises if one write is larger than
# `save_concurrent_bytes`; never set it below this many bytes of a chunk.
_MIN_CONCURRENT_BYTES = 64 << 20


class BudgetTooSmallError(ValueError):
  """No strategy can save this tree within the host-RAM budget."""


@dataclasses.dataclass(frozen=True)
class OrbaxSettings:
  """The Orbax knobs kd_ckpt sets (None: not set, Orbax has no limit)."""

  use_async: bool = True
  use_compression: bool = True
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
    if self.save_concurrent_bytes is not None:
      parts.append(f'concurrent={hostmem.format_bytes(self.save_concurrent_bytes)}')
    if self.save_device_host_concurrent_bytes is not None:
      parts.append(
          f'd2h={hostmem.format_bytes(self.save_device_host_concurrent_bytes)}'
      )
    return ','.join(parts)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way to save, with its predicted peak extra host RAM."""

  name: str
  strategy: Literal['orbax', 'streaming']
  predicted_peak_bytes: int
  fits: bool
  orbax: OrbaxSettings | None = None
  slice_bytes: int | None = None
  slices_in_flight: int | None = None
  # The highest predicted peak over all processes of a multi-process save
  # (`fits` is for all of them too); `predicted_peak_bytes` is this one's.
  worst_peak_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class SavePlan:
  """What a save will do, decided before anything is copied.

  Attributes:
    strategy: 'orbax' or 'streaming'.
    budget_bytes: the resolved host-RAM budget for this process.
    budget_text: the budget as the user wrote it.
    predicted_peak_bytes: predicted peak extra host RAM of the chosen way.
    total_bytes: bytes this host writes.
    global_bytes: bytes of the whole tree.
    num_leaves: leaves in the tree.
    largest_leaf_bytes: the largest leaf (global).
    orbax: the chosen Orbax settings (None for streaming).
    slice_bytes: streaming slice size (None for Orbax).
    slices_in_flight: streaming pipeline depth (None for Orbax).
    candidates: every strategy considered, with its prediction.
    estimate: the per-leaf estimate the plan was made from.
    platform: JAX backend the estimate is for.
  """

  strategy: Literal['orbax', 'streaming']
  budget_bytes: int
  budget_text: str
  predicted_peak_bytes: int
  total_bytes: int
  global_bytes: int
  num_leaves: int
  largest_leaf_bytes: int
  orbax: OrbaxSettings | None
  slice_bytes: int | None
  slices_in_flight: int | None
  candidates: tuple[Candidate, ...]
  estimate: estimate_lib.TreeEstimate = dataclasses.field(repr=False)
  platform: str = 'cpu'

  @property
  def fits(self) -> bool:
    return self.predicted_peak_bytes <= self.budget_bytes

  def to_json_dict(self) -> dict[str, Any]:
    """A JSON-serialisable summary (what `python -m kd_ckpt plan --json` prints)."""
    return {
        'strategy': self.strategy,
        'budget_bytes': self.budget_bytes,
        'budget': self.budget_text,
        'predicted_peak_bytes': self.predicted_peak_bytes,
        'total_bytes': self.total_bytes,
        'global_bytes': self.global_bytes,
        'num_leaves': self.num_leaves,
        'largest_leaf_bytes': self.largest_leaf_bytes,
        'platform': self.platform,
        'orbax': dataclasses.asdict(self.orbax) if self.orbax else None,
        'slice_bytes': self.slice_bytes,
        'slices_in_flight': self.slices_in_flight,
        'candidates': [
            {
                'name': c.name,
                'strategy': c.strategy,
                'predicted_peak_bytes': c.predicted_peak_bytes,
                'fits': c.fits,
            }
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
    return (f'slices of {hostmem.format_bytes(self.slice_bytes or 0)},'
            f' {self.slices_in_flight} in flight')

  def summary(self) -> str:
    """One line, for logs."""
    how = self.settings_text()
    return (
        f'strategy={self.strategy} ({how}) predicted peak'
        f' {hostmem.format_bytes(self.predicted_peak_bytes)} of budget'
        f' {hostmem.format_bytes(self.budget_bytes)} ({self.budget_text});'
        f' writes {hostmem.format_bytes(self.total_bytes)} in'
        f' {self.num_leaves} leaves'
    )

  def __str__(self) -> str:
    fb = hostmem.format_bytes
    lines = [
        f'kd_ckpt save plan ({self.platform}, process'
        f' {self.estimate.process_index}/{self.estimate.process_count})',
        f'  this host writes  {fb(self.total_bytes)} of {fb(self.global_bytes)}'
        f' in {self.num_leaves} leaves (largest leaf {fb(self.largest_leaf_bytes)})',
        f'  budget            {fb(self.budget_bytes)} ({self.budget_text})',
        f'  choice            {self.summary()}',
        '',
    ]
    rows = [('candidate', 'predicted peak', 'x budget', 'fits')]
    for c in self.candidates:
      rows.append((
          c.name, fb(c.predicted_peak_bytes),
          f'{c.predicted_peak_bytes / max(1, self.budget_bytes):.2f}',
          'yes' if c.fits else 'no',
      ))
    lines.append(estimate_lib._table(rows))  # pylint: disable=protected-access
    lines.append('')
    lines.append(str(self.estimate))
    return '\n'.join(lines)


def all_processes(values: Sequence[int]) -> np.ndarray:
  """`values` (ints in [0, 2**62)) of every process, shape (processes, len).

  Collective in a multi-process job: every process calls it with as many
  values.  With one process nothing is exchanged.
  """
  import jax  # pylint: disable=g-import-not-at-top

  v = np.asarray(values, dtype=np.int64).reshape(-1)
  if jax.process_count() == 1:
    return v[None]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  # Two int32 halves: without jax_enable_x64 an int64 would be truncated.
  halves = np.stack([v >> 31, v & 0x7FFFFFFF]).astype(np.int32)
  out = np.asarray(multihost_utils.process_allgather(halves)).astype(np.int64)
  return (out[:, 0] << 31) | out[:, 1]


def _orbax_variants(est, budget_bytes, settings_list) -> list[tuple]:
  """(settings, this process's cost, fits here) of each settings variant."""
  out = []
  for s in settings_list:
    cost = estimate_lib.predict_orbax(
        est,
        use_replica_parallel=s.use_replica_parallel,
        enable_pinned_host_transfer=s.enable_pinned_host_transfer,
        use_compression=s.use_compression,
        save_concurrent_bytes=s.save_concurrent_bytes,
        save_device_host_concurrent_bytes=s.save_device_host_concurrent_bytes,
    )
    fits = cost.peak_bytes <= budget_bytes and restorable_within(est, s, budget_bytes)
    out.append((s, cost, fits))
  return out


def _orbax_candidate(name, variants, worst, budget_bytes) -> Candidate:
  """The cheapest of several settings variants (e.g. replica parallel on/off).

  `worst[i]` is (highest peak, most bytes written, fits everywhere) of
  variant i over all processes: they must all pick the same variant.
  """
  best = None
  for (s, cost, _), (peak, nbytes, fits) in zip(variants, worst):
    # Among variants that fit: fewest bytes written by the busiest host
    # (replica parallelism across hosts), then pinned-host staging (faster
    # D2H), then the lowest peak.
    key = (peak > budget_bytes, nbytes, not s.enable_pinned_host_transfer, peak)
    if best is None or key < best[0]:
      best = (key, s, cost, peak, fits)
  _, s, cost, peak, fits = best
  return Candidate(
      name=name, strategy='orbax', predicted_peak_bytes=cost.peak_bytes,
      fits=bool(fits), orbax=s, worst_peak_bytes=int(peak),
  )


def restorable_within(est, s: OrbaxSettings, budget_bytes: int) -> bool:
  """Whether an Orbax-written checkpoint can be restored within the budget.

  Orbax stores one zarr chunk per saved shard (or replica-parallel part),
  and reading any part of a chunk decodes all of it: the compressed and the
  decoded chunk are both in memory.  Smaller chunks (`SaveArgs.chunk_byte_size`)
  would fix that, but inside Orbax's single save transaction they cost a full
  extra copy of the state (measured 310 MiB for a 512 MiB state), so a state
  with shards this large goes to the streaming writer instead.
  """
  unit = max((l.shard_bytes // l.num_replicas
              if s.use_replica_parallel and l.replica_parallel_applies
              else l.shard_bytes for l in est.leaves), default=0)
  return unit * (1 + estimate_lib.ENCODE_FACTOR) <= budget_bytes


def candidates_for(est: estimate_lib.TreeEstimate, budget_bytes: int) -> list[Candidate]:
  """Every way to save `est`, in order of preference.

  In a multi-process save each process writes its part of the same arrays,
  so all must choose alike (compression, replica parallelism and chunk grid
  are part of the on-disk format): a candidate fits only where it fits on
  every process, and variants are ranked by the worst process.  Collective
  when `est.process_count > 1`; `budget_bytes` must be the same everywhere.
  """
  groups = []
  rp_options = (True, False)
  accelerator = est.platform in ('gpu', 'cuda', 'rocm')
  for compress, name in ((True, 'orbax async zstd'), (False, 'orbax async raw')):
    variants = []
    for rp in rp_options:
      if accelerator:
        variants.append(OrbaxSettings(use_compression=compress, use_replica_parallel=rp,
                                      enable_pinned_host_transfer=True))
      variants.append(OrbaxSettings(use_compression=compress, use_replica_parallel=rp))
    groups.append((name, _orbax_variants(est, budget_bytes, variants)))
  # Limited: leave a third of the budget to each of the two limits and the
  # largest array (the d2h batcher always lets one whole array through).
  limit = max(_MIN_CONCURRENT_BYTES, budget_bytes // 3)
  groups.append(('orbax sync limited', _orbax_variants(est, budget_bytes, [
      OrbaxSettings(use_async=False, use_compression=False, use_replica_parallel=rp,
                    save_concurrent_bytes=limit,
                    save_device_host_concurrent_bytes=limit)
      for rp in rp_options
  ])))
  layout = streaming_layout.choose(budget_bytes)
  peak = streaming_layout.predict_peak(est, layout)
  stream_fits = peak <= budget_bytes and layout.feasible
  # One row per variant, streaming last: (peak, bytes written, fits here).
  rows = [(c.peak_bytes, est.total_bytes(s.use_replica_parallel), int(f))
          for _, vs in groups for s, c, f in vs]
  rows.append((peak, 0, int(stream_fits)))
  if est.process_count > 1:
    everyone = all_processes([x for r in rows for x in r]).reshape(-1, len(rows), 3)
    rows = [(int(p), int(n), bool(f)) for p, n, f in zip(
        everyone[..., 0].max(0), everyone[..., 1].max(0), everyone[..., 2].min(0))]
  out, i = [], 0
  for name, vs in groups:
    out.append(_orbax_candidate(name, vs, rows[i:i + len(vs)], budget_bytes))
    i += len(vs)
  out.append(Candidate(
      name='streaming', strategy='streaming', predicted_peak_bytes=peak,
      fits=bool(rows[-1][2]), worst_peak_bytes=int(rows[-1][0]),
      slice_bytes=layout.slice_bytes, slices_in_flight=layout.slices_in_flight,
  ))
  return out


def check_strategy(strategy: str) -> str:
  if strategy not in STRATEGIES:
    raise ValueError(
        f'Unknown strategy={strategy!r}. It needs to be one of {list(STRATEGIES)}:'
        ' "auto" picks the fastest way that fits the budget, "orbax" forces'
        ' an Orbax save (with settings fitted to the budget where possible),'
        ' "streaming" forces the bounded slice-by-slice writer.'
    )
  return strategy


def plan_from_estimate(
    est: estimate_lib.TreeEstimate,
    *,
    budget_bytes: int,
    budget_text: str = '',
    strategy: str = 'auto',
) -> SavePlan:
  """Chooses among `candidates_for(est)`; raises BudgetTooSmallError if none fit."""
  check_strategy(strategy)
  cands = candidates_for(est, budget_bytes)
  pool = [c for c in cands if strategy == 'auto' or c.strategy == strategy]
  empty = [l.path for l in est.leaves if l.is_array and 0 in l.shape]
  if empty:
    # Orbax 0.12 refuses zero-size arrays; the streaming writer stores them
    # in Orbax's own format (zarr metadata, no chunks), which stock Orbax
    # restores.
    if strategy == 'orbax':
      raise ValueError(
          f'Leaf {empty[0]!r} has zero size, which Orbax cannot save.'
          ' Use strategy="auto" or "streaming" (kd_ckpt\'s streaming writer'
          ' stores zero-size arrays), or drop the leaf.')
    pool = [c for c in pool if c.strategy == 'streaming']
  fitting = [c for c in pool if c.fits]
  if fitting:
    choice = fitting[0]
  elif strategy == 'orbax':
    # The user insisted on Orbax: give the cheapest Orbax settings and let
    # the log and report say it will not fit.
    choice = min(pool, key=lambda c: c.worst_peak_bytes)
  else:
    stream = next(c for c in cands if c.strategy == 'streaming')
    raise BudgetTooSmallError(
        f'host_ram_budget={budget_text or budget_bytes} resolves to'
        f' {hostmem.format_bytes(budget_bytes)}, below what any strategy needs'
        f' for this tree: the streaming save needs at least'
        f' {hostmem.format_bytes(streaming_layout.MIN_BUDGET_BYTES)} and is'
        f' predicted at {hostmem.format_bytes(stream.predicted_peak_bytes)}.'
        f' Raise host_ram_budget to at least'
        f' {hostmem.format_bytes(max(stream.predicted_peak_bytes, streaming_layout.MIN_BUDGET_BYTES))}.'
    )
  return SavePlan(
      strategy=choice.strategy,
      budget_bytes=budget_bytes,
      budget_text=budget_text or str(budget_bytes),
      predicted_peak_bytes=choice.predicted_peak_bytes,
      total_bytes=est.total_bytes(choice.orbax.use_replica_parallel if choice.orbax else True),
      global_bytes=est.global_bytes,
      num_leaves=est.num_leaves,
      largest_leaf_bytes=max((l.global_bytes for l in est.leaves), default=0),
      orbax=choice.orbax,
      slice_bytes=choice.slice_bytes,
      slices_in_flight=choice.slices_in_flight,
      candidates=tuple(cands),
      estimate=est,
      platform=est.platform,
  )


def plan_save(
    tree: Any,
    *,
    host_ram_budget: budget_lib.BudgetLike = 'auto',
    strategy: str = 'auto',
    memory: hostmem.HostMemory | None = None,
    platform: str | None = None,
) -> SavePlan:
  """Plans a save of `tree` within `host_ram_budget`, copying nothing.

  Args:
    tree: a pytree of `jax.Array`s, `jax.ShapeDtypeStruct`s with shardings
      (e.g. from `jax.eval_shape`), numpy arrays and scalars.
    host_ram_budget: extra host RAM the save may add; see `kd_ckpt.budget`.
    strategy: 'auto', 'orbax' or 'streaming'.
    memory: a host-memory probe to plan against (default: probe now).
    platform: plan as if saving from this JAX backend ('gpu', 'tpu', 'cpu';
      default: the current one).  On the CPU backend device memory is host
      memory and Orbax's device->host copy is free; plan with 'gpu' from a
      CPU machine to see what a GPU host would pay.

  Returns:
    A `SavePlan`; `print(plan)` shows the table.

  In a multi-process job this is collective, like the save it plans: call it
  on every process.  The processes plan with the smallest of their budgets
  and choose the same way to save (see `candidates_for`).

  Raises:
    ValueError: bad budget or strategy, or a deleted array in the tree.
    BudgetTooSmallError: no strategy fits the budget.
  """
  check_strategy(strategy)
  spec = budget_lib.parse(host_ram_budget)
  mem = memory if memory is not None else hostmem.probe()
  budget_bytes = budget_lib.resolve(spec, mem)
  est = estimate_lib.estimate_tree(tree, platform=platform)
  if est.process_count > 1:
    # "auto" resolves per host; the streaming chunk grid follows the budget.
    budget_bytes = int(all_processes([budget_bytes]).min())
  return plan_from_estimate(
      est, budget_bytes=budget_bytes, budget_text=spec.text, strategy=strategy
  )
