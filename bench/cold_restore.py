"""Restores that are their process's first jit: an eval job, a restore script, a CLI.

    .venv/bin/python bench/cold_restore.py --out FILE.md     # ~1 min on 2 cores

Such a process has not started XLA's compiler (~54 MiB of RSS, ~0.1 s
here).  kd_ckpt starts it only where the restore compiles: shards bigger
than a piece are filled on their devices by two small programs; leaves
placed whole, or shard by shard, compile nothing.  For each state
(`tests/states.py`) this saves a stock Orbax checkpoint, then restores it
without a target in fresh processes, alternating kd_ckpt (`kd_ckpt.restore`
at BUDGET) and Orbax (`ocp.StandardCheckpointer().restore`), REPS times.
Each row: median seconds (and the range), the peak RSS beyond the restored
arrays (each device buffer counted once), and whether the restore started
the compiler (kd_ckpt's start-up, or any XLA compile).

  --states mesh2d_prime,prime,many_medium,prime_rep --mib 64 --budget 128MiB --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
MiB = 1 << 20


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--states', default='mesh2d_prime,prime,many_medium,prime_rep')
  ap.add_argument('--mib', type=int, default=64, help='state size in MiB')
  ap.add_argument('--budget', default='128MiB')
  ap.add_argument('--reps', type=int, default=3)
  ap.add_argument('--out', default=None, help='also write the table here')
  args = ap.parse_args(argv)
  from tests import states  # pylint: disable=g-import-not-at-top
  lines = [
      f'<!-- .venv/bin/python bench/cold_restore.py --states {args.states} --mib {args.mib}'
      f' --budget {args.budget} --reps {args.reps} -->',
      f'Stock Orbax checkpoints of {args.mib} MiB restored without a target, each in a fresh'
      f' process whose first jit it is (8 CPU devices); kd_ckpt at {args.budget}; median of'
      f' {args.reps} alternating reps (range).',
      '',
      '| state | restore | seconds | x Orbax | peak beyond the arrays | compiled |',
      '| --- | --- | --- | --- | --- | --- |',
  ]
  budget = args.budget
  with tempfile.TemporaryDirectory() as tmp:
    for state in args.states.split(','):
      d = os.path.join(tmp, state)
      states.run_worker('stock', d, state, str(args.mib * MiB))
      runs = {'orbax': [], 'kd': []}
      for _ in range(args.reps):
        for who in ('orbax', 'kd'):
          extra = ['orbax'] if who == 'orbax' else []
          runs[who].append(states.run_worker('cold_restore', d, '-', str(args.mib * MiB),
                                             budget, *extra))
      base = statistics.median(r['seconds'] for r in runs['orbax'])
      for who, label in (('orbax', 'Orbax StandardCheckpointer'), ('kd', 'kd_ckpt.restore')):
        secs = [r['seconds'] for r in runs[who]]
        beyond = [(r['measured_peak_extra_bytes'] - r['restored_bytes']) / MiB for r in runs[who]]
        # Orbax never calls kd_ckpt's start-up: any compile of its restore counts.
        started = sorted({'yes' if r['compiled'] or r['unpaid_compiles'] else 'no'
                          for r in runs[who]})
        lines.append(
            f'| {state} | {label} | {statistics.median(secs):.3f} ({min(secs):.3f}-{max(secs):.3f})'
            f' | {statistics.median(secs) / base:.2f}x | {min(beyond):.1f} to {max(beyond):.1f} MiB'
            f' | {"/".join(started)} |')
  text = '\n'.join(lines) + '\n'
  print(text)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
