"""The one collective kd_ckpt makes: processes agree on a save's plan.

In a multi-process job every process writes its part of the same arrays, so
they must choose alike: the budget (it sets the chunk grid), compression,
replica parallelism.  `agree` sends each process's numbers to all the others
through JAX's distributed key-value store and returns everyone's, with a
timeout and an error that says which process did not come.  It is called by
`plan_save` (hence by every save) and nowhere else: restore, verify and the
memory probe never talk to other processes, so a single process can verify or
restore a multi-process checkpoint.

Each exchange also carries the host name, so a save learns how many processes
share its host (`hostmem.local_process_count`) without any extra round trip.

Example:

  everyone = exchange.agree([budget_bytes], what='the save budget')  # (P, 1)
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import zlib
from typing import Sequence

import jax
import numpy as np

from kd_ckpt import compat
from kd_ckpt import hostmem

# Long enough for a slow process to finish its previous step; short enough
# that a process that will never come (a crashed host, a save called on one
# process only) is named within minutes rather than hanging the job.
TIMEOUT_SECS = 300

_counter = itertools.count()
_lock = threading.Lock()


class ExchangeTimeoutError(TimeoutError):
  """Another process did not reach the same exchange in time."""


def _host_id() -> int:
  # A stable hash (Python's hash() is salted per process).
  return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def agree(values: Sequence[int], *, what: str, timeout_secs: float = TIMEOUT_SECS) -> np.ndarray:
  """Every process's `values`, shape (process_count, len(values)).

  Collective: every process calls it, in the same order, with as many
  values.  With one process nothing is exchanged.

  Raises:
    ExchangeTimeoutError: a process did not call it within `timeout_secs`.
  """
  mine = [int(v) for v in values]
  if jax.process_count() == 1:
    return np.asarray([mine], dtype=np.int64)
  client = compat.distributed_client()
  if client is None:
    raise RuntimeError(
        'kd_ckpt: jax.process_count() > 1 but jax.distributed is not initialized;'
        ' call jax.distributed.initialize() before saving.')
  with _lock:
    seq = next(_counter)
  me, n = jax.process_index(), jax.process_count()
  prefix = f'kd_ckpt/exchange/{seq}'
  client.key_value_set(f'{prefix}/{me}', json.dumps([_host_id(), *mine]))
  rows = []
  for p in range(n):
    if p == me:
      rows.append([_host_id(), *mine])
      continue
    try:
      rows.append(json.loads(client.blocking_key_value_get(
          f'{prefix}/{p}', int(timeout_secs * 1000))))
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise ExchangeTimeoutError(
          f'kd_ckpt: process {p} did not reach exchange #{seq} ({what}) within'
          f' {timeout_secs:.0f} s (this is process {me} of {n}). Every process must'
          ' call kd_ckpt.save / plan_save / SafeCheckpointer.save for the same'
          f' step, in the same order. ({type(e).__name__}: {e})') from e
  if seq >= 2:
    # Everyone has passed exchange seq-1, so nobody still reads seq-2.
    try:
      client.key_value_delete(f'kd_ckpt/exchange/{seq - 2}/{me}')
    except Exception:  # pylint: disable=broad-exception-caught
      pass
  hosts = [r[0] for r in rows]
  hostmem.note_local_process_count(hosts.count(_host_id()))
  if any(len(r) != len(rows[0]) for r in rows):
    raise RuntimeError(
        f'kd_ckpt: processes sent different numbers of values for {what}:'
        f' {[len(r) - 1 for r in rows]}. They must save the same tree.')
  return np.asarray([r[1:] for r in rows], dtype=np.int64)
