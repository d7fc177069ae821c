"""Bench part on object storage: the Gemma-like state saved to and restored from gs://.

A real GCS server (fake-gcs-server, tests/gcs_server.py) on 127.0.0.1; each
save, and each restore, in a fresh process that has listed its bucket
first (as a training loop, or a resumed one, has).  Rows: Orbax default (`StandardCheckpointer`, async save + wait),
kd_ckpt `auto` and `streaming` at the budget.  Peaks are VmHWM over the call
minus RSS before it; seconds are given as ratios to Orbax's in the same run,
and so is the CPU time of the worker process during the call (all its
threads, user and system): on a machine of few cores, where the GCS server
and the link proxy run beside the worker, a call that needs more CPU takes
longer whatever its requests.

`--link-latency-ms` puts a bucket's network between the workers and the
server (`slow_link.SlowLink`: each request that much later, each connection
at most `--link-mbs` MB/s): on bare loopback, reads sent one at a time cost
nothing more than reads sent together.

  .venv/bin/python bench/gcs.py --out bench/results/gcs.md   # make bench-gcs
  .venv/bin/python bench/gcs.py --link-latency-ms 20 --link-mbs 200
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
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'bench'))

MiB = 1 << 20

WORKER = r'''
import json, sys, time
sys.path.insert(0, sys.argv[4] + '/bench')
import jax
import orbax.checkpoint as ocp
import kd_ckpt
from kd_ckpt import hostmem, startup
import workloads
op, variant, path, budget = sys.argv[6], sys.argv[1], sys.argv[2], int(sys.argv[3])
startup.start_storage(path)
if op == 'save':
  state = workloads.build_gemma_gb(jax, int(sys.argv[5]))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  hostmem.release_free_memory()
  with hostmem.PeakRss() as peak:
    t, cpu = time.monotonic(), time.process_time()
    if variant == 'orbax':
      with ocp.StandardCheckpointer() as c:
        c.save(path, state)
        c.wait_until_finished()
    else:
      kd_ckpt.save(path, state, strategy=variant, host_ram_budget=budget)
    secs, cpu = time.monotonic() - t, time.process_time() - cpu
  print(json.dumps(dict(save_peak=peak.extra_bytes, save_secs=secs, save_cpu_secs=cpu,
                        nbytes=nbytes)))
  sys.exit(0)
# A fresh process, as a resumed run is: nothing of the state allocated.
abstract = workloads.abstract_gemma_gb(jax, int(sys.argv[5]))
hostmem.release_free_memory()
with hostmem.PeakRss() as rpeak:
  t, cpu = time.monotonic(), time.process_time()
  if variant == 'orbax':
    back = ocp.StandardCheckpointer().restore(path, abstract)
  else:
    back = kd_ckpt.restore(path, abstract, host_ram_budget=budget)
  jax.block_until_ready(back)
  secs, cpu = time.monotonic() - t, time.process_time() - cpu
resident = sum({s.data.unsafe_buffer_pointer(): s.data.nbytes
                for x in jax.tree.leaves(back) for s in x.addressable_shards}.values())
print(json.dumps(dict(restore_beyond=rpeak.extra_bytes - resident, restore_secs=secs,
                      restore_cpu_secs=cpu)))
'''


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--budget-mib', type=int, default=256)
  ap.add_argument('--state-bytes', type=int, default=2_200_000_000)
  ap.add_argument('--out', default=None, help='markdown file for the table')
  ap.add_argument('--link-latency-ms', type=float, default=0.0,
                  help='each request this much later (0: no link, bare loopback)')
  ap.add_argument('--link-mbs', type=float, default=200.0,
                  help="each connection's responses at most this many MB/s (with a link)")
  args = ap.parse_args()
  from tests import gcs_server  # pylint: disable=g-import-not-at-top
  import workloads  # pylint: disable=g-import-not-at-top
  thp = workloads.disable_thp()  # the workers inherit it
  budget = args.budget_mib * MiB
  with tempfile.TemporaryDirectory(prefix='kd_ckpt_gcs_bench_') as tmp:
    with gcs_server.GcsServer(os.path.join(tmp, 'data')) as srv, contextlib.ExitStack() as stack:
      srv.create_bucket('bench')
      env = {**os.environ, **srv.env(), 'PYTHONPATH': REPO, 'JAX_PLATFORMS': 'cpu',
             'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
      link = None
      if args.link_latency_ms > 0:
        import slow_link  # pylint: disable=g-import-not-at-top
        link = stack.enter_context(slow_link.SlowLink(
            srv.port, latency_secs=args.link_latency_ms / 1e3,
            rate_bytes_per_sec=args.link_mbs * 1e6))
        env = {k: v.replace(f':{srv.port}', f':{link.port}') for k, v in env.items()}
      rows = {}
      for variant in ('orbax', 'auto', 'streaming'):
        path = f'gs://bench/{variant}-{time.time_ns()}'
        rows[variant] = {}
        for op in ('save', 'restore'):
          if link:
            link.reset_counts()
          proc = subprocess.run(
              [sys.executable, '-c', WORKER, variant, path, str(budget), REPO,
               str(args.state_bytes), op], env=env, capture_output=True, text=True, timeout=1800)
          if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
          rows[variant].update(json.loads(proc.stdout.strip().splitlines()[-1]))
          if link:
            rows[variant][f'{op}_requests'] = link.requests
            rows[variant][f'{op}_busy'] = _busy(link.busy)
        print(variant, rows[variant], flush=True)
  o = rows['orbax']
  lines = [
      f'State: Gemma-like, {o["nbytes"] / 1e9:.2f} GB over 8 CPU devices; budget'
      f' {args.budget_mib} MiB; fake-gcs-server on 127.0.0.1; `bench/gcs.py'
      + (f' --link-latency-ms {args.link_latency_ms:g} --link-mbs {args.link_mbs:g}`: through'
         f' `bench/slow_link.py`, each request {args.link_latency_ms:g} ms later and each'
         f' connection at most {args.link_mbs:g} MB/s' if args.link_latency_ms > 0 else '`')
      + f'; {thp}.', '',
      '| variant | save peak | save peak / budget | save s / Orbax | save CPU s / Orbax'
      ' | restore beyond arrays | restore peak / budget | restore s / Orbax'
      ' | restore CPU s / Orbax |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  for v, r in rows.items():
    lines.append(
        f'| {"Orbax default" if v == "orbax" else "kd_ckpt " + v} |'
        f' {r["save_peak"] / MiB:.0f} MiB | {r["save_peak"] / budget:.2f} |'
        f' {r["save_secs"] / o["save_secs"]:.2f} ({r["save_secs"]:.1f} s) |'
        f' {r["save_cpu_secs"] / o["save_cpu_secs"]:.2f} ({r["save_cpu_secs"]:.1f} s) |'
        f' {r["restore_beyond"] / MiB:.0f} MiB | {r["restore_beyond"] / budget:.2f} |'
        f' {r["restore_secs"] / o["restore_secs"]:.2f} ({r["restore_secs"]:.1f} s) |'
        f' {r["restore_cpu_secs"] / o["restore_cpu_secs"]:.2f}'
        f' ({r["restore_cpu_secs"]:.1f} s) |')
  if args.link_latency_ms > 0:
    lines += ['', 'Through the link: requests each call sent, and the connections busy at'
              ' once (median, and most, over 0.1 s samples with response bytes).', '',
              '| variant | save requests | save connections busy | restore requests'
              ' | restore connections busy |', '| --- | --- | --- | --- | --- |']
    lines += [f'| {"Orbax default" if v == "orbax" else "kd_ckpt " + v} | {r["save_requests"]} |'
              f' {r["save_busy"]} | {r["restore_requests"]} | {r["restore_busy"]} |'
              for v, r in rows.items()]
  table = '\n'.join(lines)
  print(table)
  if args.out:
    with open(args.out, 'w') as f:
      f.write('# kd_ckpt on object storage (issue 18)\n\n' + table + '\n')
  return 0


def _busy(samples) -> str:
  """'median (most)' of a Counter of connections busy -> samples."""
  if not samples:
    return '-'
  values = sorted(samples.elements())
  return f'{values[len(values) // 2]} ({values[-1]})'


if __name__ == '__main__':
  sys.exit(main())
