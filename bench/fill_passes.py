"""Stock shards filled in place at small budgets: decoders kept, passes, seconds.

On devices that copy their host shards (GPUs; here the CPU backend with
`KD_CKPT_SHARE_HOST_BUFFERS=0`), a restore below a shard's size fills equal
shards on their devices piece by piece, every shard of a pass in turn, each
stock zstd chunk through a kept decoder (`reading._fill_in_place`).  This
writes a `tests/states.py` state with stock Orbax once, then restores it at
each budget in a fresh process, as that process's first jit (its compiler
start-up is paid inside the budget, as a resumed run's is), without a
target (`--warm`: after the process has compiled).  Each row: the readers
and the decoders they keep, the shards a pass, each filled leaf's pieces
and seconds, the decoders created over the restore (the stored chunks, when
none restarts), the restore's seconds.

  .venv/bin/python bench/fill_passes.py --state many_small --mib 256 \\
      --budgets 129,131,133,136,139,144
  .venv/bin/python bench/fill_passes.py --state fsdp_dp --budgets 128,256,1024 --warm --gcs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _worker(directory: str, budget_mib: int, warm: bool) -> dict:
  sys.path.insert(0, REPO)
  import jax  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import chunkread, hostmem, reading, startup  # pylint: disable=g-import-not-at-top

  if warm:
    startup.start_compiler()  # as in a training process: its compiler has started

  out = {'budget_mib': budget_mib, 'decoders': 0, 'fills': []}
  real_cursor = chunkread._Cursor.__init__  # pylint: disable=protected-access

  def cursor(self, *a, **k):
    out['decoders'] += 1
    real_cursor(self, *a, **k)

  # (Absent before passes, 2026-12-05: the bench then counts decoders only.)
  real_per_pass = getattr(reading, '_shards_per_pass', None)

  def per_pass(lanes, num_shards):
    n = real_per_pass(lanes, num_shards)
    out['fills'].append({'readers': len(lanes), 'kept': [lane.cursors for lane in lanes],
                         'shards': num_shards, 'per_pass': n})
    return n

  real_fill = reading._fill_in_place  # pylint: disable=protected-access

  def fill(src, shape, plan, *a, **k):
    t0 = time.perf_counter()
    try:
      return real_fill(src, shape, plan, *a, **k)
    finally:
      if real_per_pass is None:
        out['fills'].append({})
      if out['fills'] and 'secs' not in out['fills'][-1]:
        out['fills'][-1].update(leaf=src.name, piece=list(plan.piece),
                                pieces=len(list(plan.tiles())),
                                secs=time.perf_counter() - t0)

  chunkread._Cursor.__init__ = cursor  # pylint: disable=protected-access
  if real_per_pass is not None:
    reading._shards_per_pass = per_pass  # pylint: disable=protected-access
  reading._fill_in_place = fill  # pylint: disable=protected-access
  hostmem.release_free_memory()
  t0 = time.perf_counter()
  try:
    jax.block_until_ready(kd_ckpt.restore(directory, host_ram_budget=budget_mib * MiB))
  except kd_ckpt.BudgetTooSmallError as e:
    out['refused'] = str(e)
  out['secs'] = time.perf_counter() - t0
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--state', default='many_small', help='a tests/states.py state')
  ap.add_argument('--mib', type=int, default=256, help='its size')
  ap.add_argument('--budgets', default='129,131,133,136,139,144', help='MiB, comma-separated')
  ap.add_argument('--dir', default=None)
  ap.add_argument('--gcs', action='store_true',
                  help='the checkpoint in a bucket on a local fake-gcs-server')
  ap.add_argument('--warm', action='store_true',
                  help='each restore after its process has compiled (not its first jit)')
  ap.add_argument('--worker', nargs=3, metavar=('DIR', 'BUDGET_MIB', 'WARM'), help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    print(json.dumps(_worker(args.worker[0], int(args.worker[1]), args.worker[2] == '1')))
    return 0
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', KD_CKPT_SHARE_HOST_BUFFERS='0',
             PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  with tempfile.TemporaryDirectory(dir=args.dir) as tmp, contextlib.ExitStack() as stack:
    d = os.path.join(tmp, 'stock')
    if args.gcs:
      sys.path.insert(0, REPO)
      from tests import gcs_server  # pylint: disable=g-import-not-at-top
      srv = gcs_server.GcsServer(os.path.join(tmp, 'gcs')).start()
      stack.callback(srv.stop)
      srv.create_bucket('kd-fill-passes')
      env.update(srv.env())
      d = 'gs://kd-fill-passes/stock'
    subprocess.run([sys.executable, '-m', 'tests.states', 'stock', d, args.state,
                    str(args.mib * MiB)], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    print(f'{args.state} ({args.mib} MiB) saved by stock Orbax{" to a GCS emulator" if args.gcs else ""},'
          ' restored by kd_ckpt on 8 devices that copy, each budget in a fresh process'
          f' ({"compiled before" if args.warm else "its first jit"})\n')
    print('| budget | readers x decoders kept | shards a pass | leaf: pieces, fill s'
          ' | decoders created | restore s |')
    print('| --- | --- | --- | --- | --- | --- |')
    for b in args.budgets.split(','):
      p = subprocess.run([sys.executable, os.path.abspath(__file__), '--worker', d, b,
                          '1' if args.warm else '0'],
                         cwd=REPO, env=env, capture_output=True, text=True)
      if p.returncode:
        print(f'| {b} MiB | failed: {p.stderr.strip().splitlines()[-1][:200]} |||||')
        continue
      r = json.loads(p.stdout.strip().splitlines()[-1])
      if 'refused' in r:
        print(f'| {b} MiB | refused: {r["refused"][:160]} |||||')
        continue
      if not r['fills']:
        print(f'| {b} MiB | no shard filled in place |||| {r["secs"]:.2f} |')
        continue
      fills = r['fills']
      col = lambda f: '; '.join(f(x) for x in fills)
      print(f'| {b} MiB | {col(lambda x: "x".join(map(str, [x.get("readers", "-"), min(x.get("kept", [0]))])))}'
            f' | {col(lambda x: f"{x.get("per_pass", "-")} of {x.get("shards", "-")}")}'
            f' | {col(lambda x: f"{x.get("leaf", "-")}: {x.get("pieces", 0)}, {x.get("secs", 0):.2f}")}'
            f' | {r["decoders"]} | {r["secs"]:.2f} |', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
