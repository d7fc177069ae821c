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

Every exchange is named by the save it belongs to (its destination, which
every process knows alike) and by what it agrees on, not by a count of calls:
a process that makes an extra exchange (a `plan_save` preflight on one
process only) cannot shift the rounds of the saves after it.  Within one
save id the rounds are numbered, so a retried save of the same directory
does not read its failed attempt's values.

Example:

  with exchange.save_round(path):   # every process, for the same save
    everyone = exchange.agree([budget_bytes], what='the save budget')  # (P, 1)
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import socket
import threading
import zlib
from typing import Iterator, Sequence

import jax
import numpy as np

from kd_ckpt import compat
from kd_ckpt import hostmem

# Long enough for a slow process to finish its previous step; short enough
# that a process that will never come (a crashed host, a save called on one
# process only) is named within minutes rather than hanging the job.
TIMEOUT_SECS = 300

_lock = threading.Lock()
# Per save id: how many rounds this process has begun (a retry is a new round).
_rounds: collections.Counter = collections.Counter()
# Preflights name no destination: they are numbered among themselves only.
_preflights = itertools.count()
# This process's keys, oldest first, to delete once everyone has read them.
_written: list[str] = []
_local = threading.local()


@contextlib.contextmanager
def save_round(save_id=None) -> Iterator[str]:
  """Names the exchanges made inside it after the save `save_id`.

  `save_id` is the save's destination (a path or URL; the same string on
  every process).  None is a preflight (`plan_save` with no save): those
  are matched with the other processes' preflights, in order.
  """
  if save_id is None:
    base = f'preflight-{next(_preflights)}'
  else:
    text = os.fspath(save_id)
    with _lock:
      _rounds[text] += 1
      n = _rounds[text]
    base = f'{zlib.crc32(text.encode()) & 0xFFFFFFFF:08x}-{n}'
  outer = getattr(_local, 'round', None)
  _local.round = base
  try:
    yield base
  finally:
    _local.round = outer


class ExchangeTimeoutError(TimeoutError):
  """Another process did not reach the same exchange in time."""


def _host_id() -> int:
  # A stable hash (Python's hash() is salted per process).
  return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def agree(values: Sequence[int], *, what: str,
          timeout_secs: float | None = None) -> np.ndarray:
  """Every process's `values`, shape (process_count, len(values)).

  Collective: every process calls it inside `save_round` of the same save,
  with the same `what` and as many values.  With one process nothing is
  exchanged.

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
  if getattr(_local, 'round', None) is None:
    raise RuntimeError(
        'kd_ckpt: exchange.agree outside exchange.save_round(); every process must'
        ' name the save it agrees on.')
  me, n = jax.process_index(), jax.process_count()
  timeout_secs = TIMEOUT_SECS if timeout_secs is None else timeout_secs
  seq = f'{_local.round}/{zlib.crc32(what.encode()) & 0xFFFFFFFF:08x}'
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
          f'kd_ckpt: process {p} did not reach exchange {seq} ({what}) within'
          f' {timeout_secs:.0f} s (this is process {me} of {n}). Every process must'
          ' call kd_ckpt.save / plan_save / SafeCheckpointer.save for the same'
          f' step (and a preflight plan_save on all of them or none).'
          f' ({type(e).__name__}: {e})') from e
  with _lock:
    _written.append(f'{prefix}/{me}')
    # Everyone has written this exchange, so everyone has read all but the
    # last of this process's earlier ones (they come in the same order).
    stale = _written[:-2]
    del _written[:-2]
  for key in stale:
    try:
      client.key_value_delete(key)
    except Exception:  # pylint: disable=broad-exception-caught
      pass
  hosts = [r[0] for r in rows]
  hostmem.note_local_process_count(hosts.count(_host_id()))
  if any(len(r) != len(rows[0]) for r in rows):
    raise RuntimeError(
        f'kd_ckpt: processes sent different numbers of values for {what}:'
        f' {[len(r) - 1 for r in rows]}. They must save the same tree.')
  return np.asarray([r[1:] for r in rows], dtype=np.int64)
