"""One-time process costs that a save or restore can land on: XLA's compiler, storage clients.

The first `jax.jit` of a process pulls XLA's compiler in.  Measured on this
CPU backend: +41 MiB of RSS for a one-op program, +54 MiB for one that uses
the ops kd_ckpt compiles (zeros, dynamic_update_slice, slices, casts, the
fingerprint's integer mixing), 70% of it jaxlib's code pages; later compiles
of those ops add under 1 MiB.  A training process has paid this long before
its first save.  A process whose first jit is a kd_ckpt save or restore (a
fresh restore script, an eval job, a CLI) pays it inside that call, and so
inside its budget: `start_compiler()` pays it up front, before any buffer
exists, and the call's limiter admits that much less.  A restore from a
local disk calls it only once its fill knows it compiles (shards filled on
their devices, `reading._pay_compiler`): one that places every shard whole
compiles nothing and pays nothing.

The first touch of a `gs://` path is the same kind of cost: etils.epath
imports gcsfs (aiohttp, google-auth, google-cloud-storage) and TensorStore
starts its HTTP transport: +40 MiB measured on the emulator.  A training
process that checkpoints to a bucket has paid it at its first listing of
the workdir; a restore script has not.  `start_storage()` pays it up front
in the same way.

A save or restore that its budget refuses whatever the start-up costs does
not pay it to find out: `pending_compiler_bytes()` is what it would cost
(`cost.COMPILER_STARTUP_BYTES` in a process that holds no compiled
program, else 0), `pending_storage_bytes()` likewise for a
save's bucket, and the refusal names a budget with them.

Example:

  startup_bytes = startup.start_compiler()   # 0 once the process has compiled
  startup_bytes += startup.start_storage('gs://bucket/ckpt')
  capacity = cost.limiter_capacity(budget_bytes) - startup_bytes
"""

from __future__ import annotations

import sys
import threading

import jax
import jax.extend.backend  # pylint: disable=unused-import  (`_has_compiled`)
import jax.numpy as jnp
import numpy as np

from kd_ckpt import compat
from kd_ckpt import cost
from kd_ckpt import hostmem
from kd_ckpt import text

_lock = threading.Lock()
_started = False
_compiled = False  # a backend compile seen since this module was imported

# jax reports each backend compile as this event (jax/_src/dispatch.py).
_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


def _on_event_duration(event: str, duration_secs: float, **kwargs) -> None:
  del duration_secs, kwargs
  global _compiled
  if event == _COMPILE_EVENT:
    _compiled = True


# A Kauldron run imports kd_ckpt with its config, before its first jit: its
# start-up is then known to be paid.  (A listener only sets a flag.)
jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


def _programs(x, i):
  """One small program with every kind of op kd_ckpt's saves and restores compile."""
  buf = jnp.zeros((8, 8), jnp.float32)
  buf = jax.lax.dynamic_update_slice(buf, x[1:3].astype(jnp.float32), (i, 0))
  words = jax.lax.bitcast_convert_type(buf, jnp.uint32)
  words = (words * jnp.uint32(0x9E3779B9)) ^ (words >> 15)
  return buf.astype(jnp.bfloat16), words.sum(axis=0)


def start_compiler() -> int:
  """Starts XLA's compiler if this process has not yet; returns the RSS that took.

  Call it first thing in a bounded operation, inside its measurement, and
  subtract the result from what its limiter admits.  0 after the first call
  in a process (or ~0.2 MiB when the process had compiled before: the
  program itself).
  """
  global _started
  with _lock:
    if _started:
      return 0

    def compile_once():
      with jax.transfer_guard('allow'):  # Kauldron's train loop disallows transfers.
        jax.block_until_ready(jax.jit(_programs)(np.ones((4, 8), np.float16), np.int32(1)))

    cost = _rss_cost(compile_once)
    _started = True
  return cost


def compiler_started() -> bool:
  """Whether `start_compiler` has run in this process (it then costs nothing)."""
  return _started


def pending_compiler_bytes() -> int:
  """What `start_compiler` would cost this process, without running it.

  0 once it ran, or once the process has compiled anything: since kd_ckpt
  was imported, or before it if the program is still alive on its backend
  (it then costs 0.2-12 MiB, less than any budget's floor); otherwise
  `cost.COMPILER_STARTUP_BYTES`, the start-up of a process that never
  compiled (or whose every program was freed: the estimate then only ever
  names a larger budget).  A save or restore
  refused at `budget < floor + pending_compiler_bytes()` is refused without
  paying it.

    if budget_bytes < floor_bytes + startup.pending_compiler_bytes():
      ...  # refuse, naming floor_bytes + that estimate; nothing was paid
  """
  return 0 if _started or _has_compiled() else cost.COMPILER_STARTUP_BYTES


def _has_compiled() -> bool:
  """Whether this process has compiled: since kd_ckpt's import, or before it.

  The listener sees only compiles after the import.  A training script that
  jits its step and then imports kd_ckpt (lazily, or from a callback) holds
  that step's executable on its backend: without this check its 32 MiB
  restore was refused as if it would pay the whole 56 MiB start-up.
  """
  global _compiled
  # Without started backends nothing compiled (and starting them here could
  # claim a GPU's memory for a question).
  if not _compiled and compat.backends_initialized():
    try:
      _compiled = bool(jax.extend.backend.get_backend().live_executables())
    except (AttributeError, RuntimeError):  # a jaxlib without the method; no backend
      pass
  return _compiled


def unpaid_compiler_note(nbytes: int) -> str:
  """What a refusal says of the compiler start-up it counted but did not pay."""
  return (f' That includes {text.format_bytes(nbytes)} for XLA\'s compiler start-up, which'
          ' this process has not paid (it holds no compiled program) and'
          ' this refusal did not pay either: a process that has compiled a training step'
          ' pays under 1 MiB of it.')


def _rss_cost(fn) -> int:
  """The RSS `fn()` adds, its transient peak included."""
  hwm_before = hostmem.peak_rss_bytes()
  before = hostmem.current_rss_bytes()
  fn()
  after = hostmem.current_rss_bytes()
  hwm_after = hostmem.peak_rss_bytes()
  # A transient above the final RSS shows in the high-water mark, if it moved.
  peak = hwm_after if hwm_after > hwm_before else after
  return max(0, peak - before)


_storage_started: set[str] = set()


def pending_storage_bytes(directory) -> int:
  """What `start_storage(directory)` would cost this process, without
  running it: 0 for local paths, for a scheme it has started, and once
  etils.epath has reached a bucket (gcsfs imported); else
  `cost.STORAGE_STARTUP_BYTES` (a process that reached the bucket some
  other way is counted so too: the estimate only ever names a larger
  budget)."""
  from kd_ckpt import storage  # pylint: disable=g-import-not-at-top
  scheme = storage.scheme(directory)
  if scheme is None or scheme not in storage.SUPPORTED_SCHEMES or scheme in _storage_started:
    return 0
  # A process that reached the bucket through etils.epath (Kauldron makes its
  # workdir so) has paid the bulk of it: the start then took 1.8 MiB, against
  # 42 MiB cold.  Charged as the 48 MiB estimate, a Kauldron run's first save
  # to a bucket at 48 MiB was refused.
  if 'gcsfs' in sys.modules:
    return 0
  return cost.STORAGE_STARTUP_BYTES


def start_storage(directory) -> int:
  """Starts the clients of `directory`'s storage if this process has not; returns the RSS that took.

  Local paths cost nothing.  For a bucket: etils.epath's filesystem (a
  listing of the bucket's root) and TensorStore's kvstore driver (a listing
  of an empty range).  Errors are left to the operation itself, which names
  the path.
  """
  from kd_ckpt import storage  # pylint: disable=g-import-not-at-top
  scheme = storage.scheme(directory)
  if scheme is None or scheme not in storage.SUPPORTED_SCHEMES:
    return 0
  with _lock:
    if scheme in _storage_started:
      return 0

    def warm_up():
      try:
        storage.warm_up(directory)
      except Exception:  # pylint: disable=broad-exception-caught
        pass

    cost = _rss_cost(warm_up)
    _storage_started.add(scheme)
  return cost


def compiles(tree) -> bool:
  """Whether saving or restoring `tree` can compile anything: it holds a jax.Array.

  Trees of numpy arrays and Python scalars go through Orbax's numpy and
  scalar handlers only, which compile nothing: their saves pay no start-up.
  """
  return any(isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
             for x in jax.tree_util.tree_leaves(tree))
