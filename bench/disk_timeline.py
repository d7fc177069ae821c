"""When the disk works during a streaming save, and what the save waits on (issue 20).

One process, one state, a few saves: every 50 ms the device's busy
milliseconds and completed bytes (/proc/diskstats of the device holding
--dir), and the times of the save's own steps: its first and last commit,
each start of writeback (`writeback.Writeback.started`), the final fsync
pass (`Writeback.finish`) and Orbax's finalize.  Printed per 250 ms:

   t s   busy ms   MB done   events
  0.50       32       0.0   S          (S: writeback started, F: fsync pass)

A save whose data is all committed long before its fsync pass returns is
bound by the disk, not by the pipeline; idle buckets before the first
commit or after the pass are the save's own fixed costs.

  .venv/bin/python bench/disk_timeline.py --state gemma_gb --budget 256MiB --reps 2
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'bench'))

import workloads  # pylint: disable=g-import-not-at-top,wrong-import-position
BUCKET_SECS = 0.25


def _disk(root: str) -> tuple[int, int]:
  """(busy ms, bytes written) of the device holding root, so far."""
  d = workloads.disk_stats(root)
  return d['busy_ms'], d['written_bytes']


def _timed(obj, name: str, label: str, events: list, t0: list) -> None:
  """Wraps obj.name to append (start, end, label) to events."""
  fn = getattr(obj, name)
  if inspect.iscoroutinefunction(fn):
    async def wrapped(*a, **k):
      t = time.perf_counter() - t0[0]
      try:
        return await fn(*a, **k)
      finally:
        events.append((t, time.perf_counter() - t0[0], label))
  else:
    def wrapped(*a, **k):
      t = time.perf_counter() - t0[0]
      try:
        return fn(*a, **k)
      finally:
        events.append((t, time.perf_counter() - t0[0], label))
  setattr(obj, name, wrapped)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  workloads.add_one_state_args(ap, reps=2)
  args = ap.parse_args(argv)
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import handler, startup, streaming, writeback  # pylint: disable=g-import-not-at-top

  startup.start_compiler()
  state = workloads.build_one_state(jax, args)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  root = workloads.make_work_dir(args.dir, 'kd_timeline_')
  events, t0 = [], [0.0]
  _timed(writeback.Writeback, 'started', 'S', events, t0)
  _timed(writeback.Writeback, 'finish', 'F', events, t0)
  _timed(streaming._Pipeline, 'flush', 'commit', events, t0)  # pylint: disable=protected-access
  _timed(handler.SafePyTreeHandler, 'finalize', 'finalize', events, t0)
  print(f'{args.state}: {nbytes / 1e9:.2f} GB, {len(jax.tree.leaves(state))} leaves,'
        f' streaming at {args.budget}')
  try:
    kd_ckpt.save(os.path.join(root, 'warm'), {'x': np.ones(4)}, strategy='streaming')
    for rep in range(args.reps):
      samples, stop = [], threading.Event()

      def sample():
        while not stop.is_set():
          samples.append((time.perf_counter() - t0[0],) + _disk(root))  # pylint: disable=cell-var-from-loop
          time.sleep(0.05)
      events.clear()
      t0[0] = time.perf_counter()
      th = threading.Thread(target=sample, daemon=True)
      th.start()
      path = os.path.join(root, f'c{rep}')
      kd_ckpt.save(path, state, strategy='streaming', host_ram_budget=args.budget)
      secs = time.perf_counter() - t0[0]
      stop.set()
      th.join()
      shutil.rmtree(path)
      n = int(secs / BUCKET_SECS) + 1
      busy, done = [0] * n, [0] * n
      for a, b in zip(samples, samples[1:]):
        i = min(int(a[0] / BUCKET_SECS), n - 1)
        busy[i] += b[1] - a[1]
        done[i] += b[2] - a[2]
      commits = [e for e in events if e[2] == 'commit']
      print(f'\nsave {rep}: {secs:.2f} s; disk busy {sum(busy) / 1000:.2f} s;'
            f' {len(commits)} commits, the first at {commits[0][0]:.2f} s,'
            f' the last at {commits[-1][0]:.2f} s' if commits else '')
      for e in events:
        if e[2] in ('F', 'finalize'):
          print(f'  {"fsync pass" if e[2] == "F" else e[2]}: {e[0]:.2f}-{e[1]:.2f} s')
      print('   t s   busy ms   MB done   events')
      for i in range(n):
        marks = ''.join(e[2] for e in events
                        if e[2] in ('S', 'F') and int(e[0] / BUCKET_SECS) == i)
        print(f'{i * BUCKET_SECS:6.2f}  {busy[i]:7d}  {done[i] / 1e6:8.1f}   {marks}')
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
