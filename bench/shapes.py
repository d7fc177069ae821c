"""Save and restore speed against Orbax on states the cost model never saw (issue 20).

`bench/speed.py` and `bench/ab_save.py` time the bench's own states (one
big leaf, the Gemma-like state, many equal leaves).  This times the test
suite's states instead (`tests/states.py`: prime dims, replicated leaves, a
4x2 mesh, mixed dtypes, 2,000 small leaves, zero moments, ...), one fresh
process each, alternating in that process (each rep in the reverse order
of the last), so that "never slower than
Orbax" is checked where nothing was tuned:

  save     Orbax default (`ocp.StandardCheckpointer`, waited for), kd_ckpt
           `streaming` and `auto` at the budget;
  restore  a checkpoint stock Orbax wrote and one kd_ckpt wrote, each read
           by Orbax and by `kd_ckpt.restore` at the budget (page cache warm
           for both: each checkpoint read once before, `workloads.warm_page_cache`).

Each cell is the median of `--reps` seconds; the ratios are kd_ckpt's
median over Orbax's in the same process.  A second table gives the same
medians in user CPU seconds (all threads), with each stock restore's minor
faults: on this project's VMs wall time swings with first writes into memory
the host took back (system time; bench/README.md, "Measuring"), user time
does not.  User time leaves out copies made in the kernel: TensorStore reads
with pread (system time), kd_ckpt copies out of memory-mapped files (user
time), so restore ratios in CPU overstate kd_ckpt's share.  `--raw FILE`
appends every rep's numbers.

  .venv/bin/python bench/shapes.py --mib 512 --reps 3 --out bench/results/shapes.md
  .venv/bin/python bench/shapes.py --states mixed,replicated --reps 5
  .venv/bin/python bench/shapes.py --states many_small --reps 5 --no-target
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATES = ('sharded', 'replicated', 'mesh2d', 'mixed', 'one_replicated', 'prime', 'prime_rep',
          'mesh2d_prime', 'edge_chunks', 'many_small', 'mixed_dtypes', 'zeros', 'wide_mesh2d',
          'many_medium')
RESULT = 'SHAPES_RESULT '


def _worker(name: str, total_bytes: int, budget: str, reps: int, root: str,
            no_target: bool = False) -> dict:
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  sys.path.insert(0, REPO)
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from tests import states  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(REPO, 'bench'))
  import workloads  # pylint: disable=g-import-not-at-top

  tree = jax.block_until_ready(states.make_state(name, total_bytes))
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)
  if no_target:  # restores onto the shapes, dtypes and shardings saved
    target = None
  secs: dict[str, list[float]] = {}
  user: dict[str, list[float]] = {}
  faults: dict[str, list[int]] = {}

  def timed(key, fn):
    # User CPU and minor faults beside the wall time: on this project's VMs
    # a first write into memory the host took back shows as system time
    # (bench/README.md, "Measuring"), which user time does not see.
    c0, f0 = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    secs.setdefault(key, []).append(time.perf_counter() - t0)
    user.setdefault(key, []).append(os.times().user - c0.user)
    faults.setdefault(key, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

  def orbax_save(d):
    with ocp.StandardCheckpointer() as ck:
      ck.save(d, tree)
      ck.wait_until_finished()

  for rep in range(reps):
    # Each rep reverses the last one's order: a save (or restore) right after
    # another meets its writeback and freed pages, so no variant always
    # goes first.
    flip = (lambda xs: xs) if rep % 2 == 0 else (lambda xs: xs[::-1])
    for who in flip(('orbax', 'streaming', 'auto')):
      d = os.path.join(root, f'{who}{rep}')
      if who == 'orbax':
        timed('save orbax', lambda: orbax_save(d))
      else:
        timed(f'save {who}', lambda: kd_ckpt.save(d, tree, strategy=who, host_ram_budget=budget))
    for src in ('orbax', 'streaming'):
      d = os.path.join(root, f'{src}{rep}')
      workloads.warm_page_cache(d)  # kd_ckpt's save dropped its pages, Orbax's kept them
      for by in flip(('orbax', 'kd')):
        if by == 'orbax':
          timed(f'restore {src} by orbax', lambda: ocp.StandardCheckpointer().restore(d, target))
        else:
          timed(f'restore {src} by kd', lambda: kd_ckpt.restore(d, target, host_ram_budget=budget))
    for who in ('orbax', 'streaming', 'auto'):
      shutil.rmtree(os.path.join(root, f'{who}{rep}'))
  med = {k: statistics.median(v) for k, v in secs.items()}
  return {'state': name, 'leaves': len(jax.tree.leaves(tree)),
          'bytes': sum(x.nbytes for x in jax.tree.leaves(tree)), 'median_secs': med,
          'secs': secs, 'median_user_secs': {k: statistics.median(v) for k, v in user.items()},
          'user_secs': user, 'median_minor_faults': {k: statistics.median(v)
                                                     for k, v in faults.items()}}


def _cpu_row(r: dict) -> str:
  u, f = r['median_user_secs'], r['median_minor_faults']
  # os.times() counts in 10 ms ticks: a tiny state's Orbax restore can read 0.
  ratio = lambda a, b: f'{u[a] / u[b]:.2f}' if u[b] else '-'
  mib = lambda k: f[k] * 4096 / (1 << 20)
  return (f"| {r['state']} | {u['save orbax']:.2f} "
          f"| {ratio('save streaming', 'save orbax')} | {ratio('save auto', 'save orbax')} "
          f"| {u['restore orbax by orbax']:.2f} "
          f"| {ratio('restore orbax by kd', 'restore orbax by orbax')} "
          f"| {u['restore streaming by orbax']:.2f} "
          f"| {ratio('restore streaming by kd', 'restore streaming by orbax')} "
          f"| {mib('restore orbax by orbax'):.0f} / {mib('restore orbax by kd'):.0f} |")


def _row(r: dict) -> str:
  m = r['median_secs']
  ratio = lambda a, b: m[a] / m[b]
  return (f"| {r['state']} | {r['leaves']} | {m['save orbax']:.2f} "
          f"| {ratio('save streaming', 'save orbax'):.2f} | {ratio('save auto', 'save orbax'):.2f} "
          f"| {m['restore orbax by orbax']:.2f} "
          f"| {ratio('restore orbax by kd', 'restore orbax by orbax'):.2f} "
          f"| {m['restore streaming by orbax']:.2f} "
          f"| {ratio('restore streaming by kd', 'restore streaming by orbax'):.2f} |")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--states', default=','.join(STATES))
  ap.add_argument('--mib', type=int, default=512, help='state size')
  ap.add_argument('--budget', default='256MiB')
  ap.add_argument('--reps', type=int, default=3)
  ap.add_argument('--dir', default=None, help='where to write (default: a temp dir)')
  ap.add_argument('--out', default='')
  ap.add_argument('--raw', default='', help='append each state\'s per-rep numbers (JSON lines)')
  ap.add_argument('--no-target', action='store_true',
                  help='restore without a target (each library reads the saved metadata)')
  ap.add_argument('--worker', default='')
  args = ap.parse_args()
  if args.worker:
    r = _worker(args.worker, args.mib << 20, args.budget, args.reps, args.dir, args.no_target)
    print(RESULT + json.dumps(r), flush=True)
    return 0
  sys.path.insert(0, os.path.join(REPO, 'bench'))
  import workloads  # pylint: disable=g-import-not-at-top
  thp = workloads.disable_thp()  # the workers inherit it
  rev = subprocess.run(['git', '-C', REPO, 'rev-parse', '--short', 'HEAD'],
                       capture_output=True, text=True, check=False).stdout.strip()
  no_target = ' --no-target' if args.no_target else ''
  lines = [f'<!-- .venv/bin/python bench/shapes.py --mib {args.mib} --budget {args.budget}'
           f' --reps {args.reps}{no_target} (at {rev}) -->',
           f'tests/states.py states of {args.mib} MiB, kd_ckpt at {args.budget}'
           f'{"; restores without a target" if args.no_target else ""}; medians of'
           f' {args.reps} alternating reps (each in the reverse order of the last), one process a state;'
           f' x = kd_ckpt / Orbax; {thp}.',
           '',
           '| state | leaves | Orbax save s | streaming save x | auto save x'
           ' | Orbax restores stock s | kd restores stock x | Orbax restores kd\'s s'
           ' | kd restores its own x |',
           '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  print('\n'.join(lines), flush=True)
  cpu_lines = [
      '', 'The same reps in user CPU seconds of the whole process (all threads; x ='
      ' kd_ckpt / Orbax), which the VM\'s first-touch faults (system time) do not'
      ' swing, and the minor faults of a stock-checkpoint restore in MiB of 4 KiB pages:', '',
      '| state | Orbax save user s | streaming save x | auto save x'
      ' | Orbax restores stock user s | kd restores stock x | Orbax restores kd\'s user s'
      ' | kd restores its own x | stock restore faults MiB, Orbax / kd |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  if args.dir:
    os.makedirs(args.dir, exist_ok=True)
  for name in args.states.split(','):
    root = tempfile.mkdtemp(prefix=f'kd_shapes_{name}_', dir=args.dir)
    try:
      p = subprocess.run([sys.executable, __file__, '--worker', name, '--mib', str(args.mib),
                          '--budget', args.budget, '--reps', str(args.reps), '--dir', root]
                         + (['--no-target'] if args.no_target else []),
                         capture_output=True, text=True, check=False)
    finally:
      shutil.rmtree(root, ignore_errors=True)
    found = [l for l in p.stdout.splitlines() if l.startswith(RESULT)]
    if p.returncode or not found:
      line = f'| {name} | failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]} |'
    else:
      r = json.loads(found[0][len(RESULT):])
      line = _row(r)
      cpu_lines.append(_cpu_row(r))
      if args.raw:
        with open(args.raw, 'a') as f:
          f.write(json.dumps(r) + '\n')
    lines.append(line)
    print(line, flush=True)
  lines += cpu_lines
  print('\n'.join(cpu_lines), flush=True)
  if args.out:
    with open(args.out, 'a') as f:
      f.write('\n'.join(lines) + '\n\n')
  return 0


if __name__ == '__main__':
  sys.exit(main())
