"""Restores from a bucket through a slow link, by kind of request (issue 20).

Each restore runs in a fresh process against fake-gcs-server on loopback,
through `slow_link.SlowLink` (each request 20 ms later, each connection at
most 200 MB/s by default).  The table gives seconds, requests, bytes down
and the requests by object, so that a restore that sends more requests than
Orbax's shows where they go.

States: `leaves` is `--leaves` f32 leaves of (64, 256) over 8 CPU devices
(64 KiB each; small leaves that Orbax's reader reads), `gemma` the bench's
Gemma-like state of `--state-bytes`, `big` one f32 leaf of `--state-bytes`
over 8 devices, `interleaved` layers of a 4 KiB bias and a 0.94 MiB kernel
on one device (`--state-bytes` in all); each saved once by kd_ckpt's
streaming writer at 256 MiB,
or with `--saved-by orbax` by stock Orbax (`StandardCheckpointer`: zstd, one
chunk a shard).  Restores: `kd` and `orbax` (`StandardCheckpointer`) without a
target (the shardings come from `_sharding`), `kd_target` and
`orbax_target` onto the saved layout.

Example:

  python bench/gcs_requests.py --state leaves --leaves 400 --restores kd_target,orbax_target
  python bench/gcs_requests.py --state big --state-bytes 400000000 --saved-by orbax
  python bench/gcs_requests.py --state interleaved --state-bytes 200000000 --budget 56MiB \\
      --restores kd_target,orbax_target
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'bench'))

WORKER = r'''
import json, sys, time, warnings
warnings.simplefilter('ignore')
repo, state, op, path, leaves, state_bytes, budget = sys.argv[1:8]
sys.path.insert(0, repo + '/bench')
import jax, jax.numpy as jnp, orbax.checkpoint as ocp, kd_ckpt
import workloads
leaves, state_bytes = int(leaves), int(state_bytes)
mesh = jax.make_mesh((8,), ('x',))
sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))
if state == 'leaves':
  build = lambda: {f'l{i:04d}': jax.device_put(jnp.full((64, 256), i, jnp.float32), sharded)
                   for i in range(leaves)}
  abstract = lambda: {f'l{i:04d}': jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=sharded)
                      for i in range(leaves)}
elif state == 'big':
  # One f32 leaf of `state_bytes` over 8 devices: shards of an eighth.
  shape = (state_bytes // 4 // 1024 // 8 * 8, 1024)
  build = lambda: {'w': jax.device_put(jax.random.normal(jax.random.key(0), shape, jnp.float32), sharded)}
  abstract = lambda: {'w': jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharded)}
elif state == 'interleaved':
  # Layers of a 4 KiB bias and a 0.94 MiB kernel on one device: a bounded
  # restore reads the biases whole in batches and fills the kernels between
  # them in the file apart.
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  layers = max(8, state_bytes // (240 * 1024 * 4 + 4096))
  shapes = {f'l{i:03d}': {'a_bias': (1024,), 'b_kernel': (240, 1024)} for i in range(layers)}
  build = lambda: jax.tree.map(lambda s: jax.device_put(jax.random.normal(
      jax.random.key(s[0]), s, jnp.float32), one), shapes, is_leaf=lambda s: isinstance(s, tuple))
  abstract = lambda: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=one),
                                  shapes, is_leaf=lambda s: isinstance(s, tuple))
else:
  build = lambda: workloads.build_gemma_gb(jax, state_bytes)
  abstract = lambda: workloads.abstract_gemma_gb(jax, state_bytes)
if op == 'save':
  kd_ckpt.save(path, build(), strategy='streaming', host_ram_budget='256MiB')
  print(json.dumps({}))
  sys.exit()
if op == 'save_orbax':
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, build())
  print(json.dumps({}))
  sys.exit()
target = abstract() if op.endswith('_target') else None
import resource
r0, t, t_epoch = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.time()
if op.startswith('kd'):
  out = kd_ckpt.restore(path, target, host_ram_budget=budget)
else:
  out = ocp.StandardCheckpointer().restore(path, target)
jax.block_until_ready(out)
secs, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({'started': t_epoch, 'secs': secs, 'leaves': len(jax.tree.leaves(out)),
                  'cpu_secs': r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime}))
'''


def _kind(line: str) -> str:
  """'GET /download/storage/v1/b/bench/o/ckpt%2Fd%2F<hash>?alt=media' -> 'GET d/* (media)'."""
  method, target = line.split(' ', 1)
  url = urllib.parse.unquote(target)
  query = url.split('?', 1)[1] if '?' in url else ''
  obj = url.split('?', 1)[0]
  obj = obj.split('/o/', 1)[1] if '/o/' in obj else obj
  obj = re.sub(r'^[^/]*/', '', obj) if '/' in obj else '.'
  obj = re.sub(r'^d/.*', 'd/*', obj)
  kind = 'list' if 'prefix=' in query else 'media' if 'alt=media' in query else 'metadata'
  return f'{method} {obj} ({kind})'


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
  ap.add_argument('--state', choices=('leaves', 'gemma', 'big', 'interleaved'), default='leaves')
  ap.add_argument('--leaves', type=int, default=400)
  ap.add_argument('--state-bytes', type=int, default=1_150_000_000)
  ap.add_argument('--restores', default='kd,orbax,kd_target,orbax_target')
  ap.add_argument('--reps', type=int, default=1)
  ap.add_argument('--saved-by', choices=('streaming', 'orbax'), default='streaming')
  ap.add_argument('--link-latency-ms', type=float, default=20.0)
  ap.add_argument('--link-mbs', type=float, default=200.0)
  ap.add_argument('--budget', default='256MiB', help="kd_ckpt's restore budget")
  args = ap.parse_args()
  from tests import gcs_server  # pylint: disable=g-import-not-at-top
  import slow_link  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix='kd_ckpt_gcs_requests_') as tmp:
    with gcs_server.GcsServer(os.path.join(tmp, 'data')) as srv, slow_link.SlowLink(
        srv.port, latency_secs=args.link_latency_ms / 1e3,
        rate_bytes_per_sec=args.link_mbs * 1e6) as link:
      srv.create_bucket('bench')
      env = {**os.environ, **srv.env(), 'PYTHONPATH': REPO, 'JAX_PLATFORMS': 'cpu',
             'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
      env = {k: v.replace(f':{srv.port}', f':{link.port}') for k, v in env.items()}
      path = 'gs://bench/ckpt'

      def server_cpu_secs():  # fake-gcs-server's user + system seconds so far
        with open(f'/proc/{srv.proc.pid}/stat') as f:
          fields = f.read().rsplit(')', 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')

      def run(op):
        link.reset_counts()
        server0, link0 = server_cpu_secs(), os.times()
        proc = subprocess.run(
            [sys.executable, '-c', WORKER, REPO, args.state, op, path, str(args.leaves),
             str(args.state_bytes), args.budget], env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
          raise RuntimeError(proc.stderr[-3000:])
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        link1 = os.times()  # the link proxy runs in this process's threads
        busy = link.busy  # samples while bytes flowed: connections carrying them
        out.update(busy_mean=sum(k * n for k, n in busy.items()) / max(1, sum(busy.values())),
                   busy_samples=sum(busy.values()))
        out.update(server_cpu=server_cpu_secs() - server0,
                   link_cpu=link1.user - link0.user + link1.system - link0.system)
        # When the first request for array data (an OCDBT data file) left,
        # from the restore call's start: what precedes it is start-up and
        # metadata, paid once per restore whatever the state's size.
        data = [t for t, l in zip(link.request_times, link.request_lines)
                if _kind(l).startswith('GET d/*')]
        out.update(first_data_secs=min(data) - out['started'] if data and 'started' in out
                   else float('nan'))
        out.update(requests=link.requests, down_mb=link.down_bytes / 1e6,
                   kinds=collections.Counter(_kind(l) for l in link.request_lines))
        return out

      run('save' if args.saved_by == 'streaming' else 'save_orbax')
      rows = [(op, run(op)) for _ in range(args.reps) for op in args.restores.split(',')]
  state = {'leaves': f'{args.leaves} f32 leaves of (64, 256) over 8 devices',
           'big': f'one f32 leaf of {args.state_bytes / 1e9:.2f} GB over 8 devices',
           'interleaved': f'layers of a 4 KiB bias and a 0.94 MiB kernel, {args.state_bytes / 1e9:.2f}'
                          ' GB on one device',
           'gemma': f'Gemma-like, {args.state_bytes / 1e9:.2f} GB over 8 devices'}[args.state]
  saved_by = 'kd_ckpt streaming' if args.saved_by == 'streaming' else 'stock Orbax'
  print(f'State: {state}, saved by {saved_by}; kd_ckpt restores at {args.budget}; link: each request'
        f' {args.link_latency_ms:g} ms later, each connection at most {args.link_mbs:g} MB/s.\n')
  print('First data: seconds from the restore call to its first request for array data'
        ' (an OCDBT data file): start-up and metadata.'
        ' CPU s: the restoring process\'s user + system seconds during the restore;'
        ' server: fake-gcs-server\'s over the whole run of that process; link: the link'
        ' proxy\'s (this process) over the same. Busy: connections carrying response bytes,'
        f' the mean over {slow_link.SAMPLE_SECS:g} s samples while bytes flowed (the samples).\n')
  print('| restore | seconds | first data s | CPU s | server CPU s | link CPU s | busy (samples) |'
        ' requests | MB down | requests by object (most first) |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  for op, r in rows:
    kinds = ', '.join(f'{n} {k}' for k, n in r['kinds'].most_common(4))
    print(f'| {op} | {r["secs"]:.2f} | {r["first_data_secs"]:.2f} | {r["cpu_secs"]:.2f} |'
          f' {r["server_cpu"]:.2f} |'
          f' {r["link_cpu"]:.2f} | {r["busy_mean"]:.1f} ({r["busy_samples"]}) | {r["requests"]} |'
          f' {r["down_mb"]:.1f} | {kinds} |')
  return 0


if __name__ == '__main__':
  sys.exit(main())
