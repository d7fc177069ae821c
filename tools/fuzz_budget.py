"""Saves and restores of drawn states, each measured in a fresh process: the budget must hold.

A budget is a limit on states nobody designed.  Each seed draws a state
(`tests.states.drawn`: 1-200 leaves, ranks 0-4, seven dtypes, one-device,
replicated, 1-D and 2-D layouts, prime and odd extents; 40% of them beside
typed PRNG keys, numpy arrays and scalars: `tests.states.mixed`), a writer
(kd_ckpt `streaming`, `auto`, `orbax`, Kauldron's `SafeCheckpointer`, or
stock Orbax), a save budget, a restore budget, the restore's target layouts
(the saved ones, or others drawn: `tests.states.redrawn`; a quarter with
`strict=False` onto other extents, truncated or zero-padded:
`tests.states.reshaped`) and its placement path (the CPU devices keep their
host shards, or copy them as GPUs do: `KD_CKPT_SHARE_HOST_BUFFERS=0`).  The
save and the restore each run in a process of their own (`tests.states`
workers), measured from outside kd_ckpt (VmHWM):

  - a kd_ckpt save peaks at most at its budget + `--tolerance-mib`, or is
    refused with `BudgetTooSmallError` before anything is written; it is then
    saved again, in a new process, at the budget the error names, which must
    be accepted and held;
  - a restore comes back bit-exact, peaking beyond the restored arrays at
    most at its budget + the tolerance, or is refused the same way.

`--processes 2` runs each save and restore in two JAX processes joined on
127.0.0.1 (4 CPU devices each; `tests.mp_worker fuzz`), each process held to
the budget and checked bit-exact on its own shards (drawn and `mixed` states,
reusing saves, restores onto custom layouts too; no Kauldron, no
`strict=False`).

  .venv/bin/python tools/fuzz_budget.py --seeds 0-99      # ~5-8 min on 2 cores
  .venv/bin/python tools/fuzz_budget.py --seeds 17 -v     # one seed again, with its state
  .venv/bin/python tools/fuzz_budget.py --seeds 1000-1099  # seeds >= 1000: int4/float8/float4 too
  .venv/bin/python tools/fuzz_budget.py --gcs --seeds 0-29 # through a GCS server on loopback
  .venv/bin/python tools/fuzz_budget.py --processes 2 --seeds 0-29

Exit status 1 if any case broke its budget, failed, or differed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
import tempfile
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MiB = 1 << 20
WRITERS = ('streaming', 'auto', 'orbax', 'stock')


def _log_uniform(rng, lo: float, hi: float) -> int:
  return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _seeds(text: str) -> list[int]:
  out = []
  for part in text.split(','):
    lo, _, hi = part.partition('-')
    out.extend(range(int(lo), int(hi or lo) + 1))
  return out


def _named_budget(error: str, budget: int) -> int | None:
  """The budget a `BudgetTooSmallError` says to use, in bytes (None if none)."""
  if 'BudgetTooSmallError' not in error:
    return None
  to = re.search(r"to '(\d+)(MiB|GiB)' or more", error)
  by = re.search(r'by (\d+) MiB or more', error)
  if to:
    return int(to.group(1)) * (MiB if to.group(2) == 'MiB' else 1 << 30)
  return budget + int(by.group(1)) * MiB if by else None


def _case(rng, seed: int) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  case = dict(
      seed=seed,
      total_bytes=_log_uniform(rng, 2 * MiB, 192 * MiB),
      writer=WRITERS[int(rng.integers(len(WRITERS)))],
      save_budget=_log_uniform(rng, 16 * MiB, 512 * MiB),
      restore_budget=_log_uniform(rng, 16 * MiB, 512 * MiB),
      copying=bool(rng.random() < 0.5),
      reshard=bool(rng.random() < 0.5),
      # Kauldron's checkpointer (SafeCheckpointer, strategy='auto', async
      # where it plans Orbax's save), restored through it too.
      kauldron=bool(rng.random() < 0.15),
      # PRNG keys, numpy arrays and scalars beside the arrays
      # (`tests.states.mixed`); a stream of its own, so that the draws above
      # stay what they were for every seed.
      mixed=bool(np.random.default_rng([seed, 2]).random() < 0.4),
      # A restore with strict=False onto other extents (`tests.states.reshaped`).
      loose=bool(np.random.default_rng([seed, 4]).random() < 0.25),
      # kd_ckpt writers: the save fingerprints, after a save of the state with
      # every other array leaf zeroed, which it reuses where unchanged
      # (`tests.states` worker `reuse`: both saves held to the budget).
      reuse=bool(np.random.default_rng([seed, 6]).random() < 0.3),
      # kd_ckpt.restore(support_layout=True) onto custom device-local layouts
      # for about half the arrays of rank >= 2 (`tests.states.custom_layouts`).
      layout=bool(np.random.default_rng([seed, 8]).random() < 0.2),
      # A third of Kauldron's restores are another run's start instead:
      # `kd.ckpts.SimpleCheckpointLoader` inside `InitWithinBudget`.
      loader=bool(np.random.default_rng([seed, 10]).random() < 1 / 3),
  )
  if case['kauldron'] and case['loader']:
    # The loader restores without restore args: onto the saved shardings,
    # whatever the target's (Orbax's PyTree handler, stock or not).
    case['reshard'] = False
  return case


def _run(states, args: list[str], env: dict | None = None) -> tuple[dict | None, str]:
  """(the worker's JSON, '') or (None, its error's last lines)."""
  # A wait on bytes nobody releases fails in 30 s (a stall), not 300 s.
  env = {'KD_TEST_STALL_SECS': '30', **(env or {})}
  try:
    return states.run_worker(*args, env=env), ''
  except AssertionError as e:
    return None, str(e)


def _state_name(case: dict) -> str:
  return f"{'mixed' if case.get('mixed') else 'drawn'}:{case['seed']}"


def _run_mp(nproc: int, op: str, path: str, state: str, total: str, strategy: str,
            budget: int, env: dict | None = None, timeout: float = 300
            ) -> tuple[dict | None, str]:
  """`_run` over `nproc` processes joined by jax.distributed on 127.0.0.1
  (`tests.mp_worker fuzz`, 8 // nproc CPU devices each).

  Returns the processes' figures merged (the most any one process peaked at,
  beyond its own restored shards for a restore), or (None, the error): a
  refusal from any process, or a process that failed or did not finish.
  """
  import json  # pylint: disable=g-import-not-at-top
  import socket  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    port = sock.getsockname()[1]
  base = {**os.environ, 'KD_TEST_STALL_SECS': '30', **(env or {}),
          'XLA_FLAGS': f'--xla_force_host_platform_device_count={8 // nproc}',
          'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': REPO + os.pathsep + os.environ.get('PYTHONPATH', '')}
  logs = tempfile.mkdtemp(prefix='kd_fuzz_mp_')
  procs = []
  for i in range(nproc):
    with open(os.path.join(logs, f'{i}.out'), 'w') as o, open(os.path.join(logs, f'{i}.err'), 'w') as e:
      procs.append(subprocess.Popen(
          [sys.executable, '-m', 'tests.mp_worker', 'fuzz', op, path, state, total, strategy,
           str(budget), str(i), str(nproc), str(port)],
          cwd=REPO, env=base, stdout=o, stderr=e))
  deadline = time.monotonic() + timeout
  # A process that fails leaves the others waiting at a barrier: stop them.
  while any(p.poll() is None for p in procs):
    if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
      break
    time.sleep(0.1)
  outs = [(open(os.path.join(logs, f'{i}.out')).read(), open(os.path.join(logs, f'{i}.err')).read())
          for i in range(nproc)]
  shutil.rmtree(logs, ignore_errors=True)
  failed = [(i, p.returncode, err) for i, (p, (_, err)) in enumerate(zip(procs, outs))
            if p.returncode]
  if failed:
    return None, '\n'.join(
        f'process {i} (killed: another failed, or past {timeout:.0f} s): {err[-600:]}' if rc < 0
        else f'process {i} (exit {rc}): {err[-1500:]}' for i, rc, err in failed)
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  errors = [r['error'] for r in results if 'error' in r]
  if errors:
    if len(errors) < nproc:
      return None, f'only {len(errors)} of {nproc} processes refused: {errors[0]}'
    return None, max(errors, key=lambda e: _named_budget(e, 0) or 0)
  beyond = [r['peak_extra_bytes'] - r.get('restored_bytes', 0) for r in results]
  return {'peak_extra_bytes': max(beyond), 'restored_bytes': 0,
          'whole_save_peak_extra_bytes': max(beyond),
          'leaves_reused': sum(r.get('report', {}).get('leaves_reused', 0) for r in results)}, ''


def _retried(call, budget: int, what: str, refused=lambda: None
             ) -> tuple[dict | None, int, list[str], str]:
  """`call(budget)`, then once more at the budget its refusal names.

  Returns (figures or None, the budget it ran at, notes, what went wrong).
  A refusal must name a larger budget, and that one must be accepted.
  `refused()`: after a refusal, what it left wrong (a note), or None.
  """
  notes = []
  for attempt in range(2):  # the budget drawn, then the one its refusal names
    out, err = call(budget)
    if out is not None:
      return out, budget, notes, ''
    named = _named_budget(err, budget)
    if named is None or named <= budget or attempt == 1:
      return None, budget, notes, (f'{what} at {budget / MiB:.1f} MiB failed'
                                   + (' (at the budget its first refusal named)' if attempt else '')
                                   + f': {err[-800:]}')
    notes.append(f'{what} refused at {budget / MiB:.1f} MiB, named {named / MiB:.1f} MiB')
    if (wrong := refused()) is not None:
      return None, budget, notes, wrong
    budget = named
  raise AssertionError('unreachable')


def run_case(states, case: dict, root: str, tolerance: int, verbose: bool,
             processes: int = 1) -> list[str]:
  """Runs one drawn case; returns what went wrong (empty: it held).

  With `processes` > 1 (`_run_mp`) each peak is the most any one process
  had, beyond its own restored shards for a restore.
  """
  state, total = _state_name(case), str(case['total_bytes'])
  path = os.path.join(root, f"s{case['seed']}")
  local = not path.startswith('gs://')
  if local:
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path + '.prev', ignore_errors=True)
  kauldron, writer = case.get('kauldron'), case['writer']
  if processes > 1:
    of = f' (most of {processes})'
    run = lambda op, budget=0, env=None: _run_mp(
        processes, op, path, state, total, writer, budget, env=env)
    stock = lambda: run('stock')
    save = lambda budget: run('reuse' if case.get('reuse') else 'save', budget)
    restore = lambda budget, env: run('restore', budget, env)
  else:
    of = ''
    stock = lambda: _run(states, ['stock', path, state, total])
    save = lambda budget: _run(states, (
        ['ckpt', path, state, total, 'auto', str(budget)] if kauldron
        else ['reuse' if case.get('reuse') else 'save', path, state, total, writer,
              str(budget)]))
    restore = lambda budget, env: _run(states, ['restore', path, state, total, str(budget)]
                                       + ([('simple' if case.get('loader') else 'ckpt')]
                                          if kauldron else []), env=env)
  if kauldron:
    writer = 'SafeCheckpointer auto'  # the save's peak: the whole async save
  problems, notes = [], []
  if writer == 'stock':
    out, err = stock()
    if out is None:
      return [f'stock Orbax save failed: {err[-600:]}']
  else:
    def left_files():  # a refusal comes before anything is written
      if not kauldron and local and os.path.exists(path) and os.listdir(path):
        return f'a refused save left files in {path}: {sorted(os.listdir(path))[:5]}'
      return None
    out, budget, more, failed = _retried(save, case['save_budget'], f'{writer} save', left_files)
    notes += more
    if out is None:
      return [failed]
    peak = out['whole_save_peak_extra_bytes' if kauldron else 'peak_extra_bytes']
    notes.append(f'save {writer} @{budget / MiB:.1f} MiB peak {peak / MiB:.1f} MiB{of}'
                 + (f", {out.get('leaves_reused', 0)} leaves reused" if case.get('reuse') else ''))
    if peak > budget + tolerance:
      problems.append(f'{writer} save peaked at {peak / MiB:.1f} MiB over its budget '
                      f'{budget / MiB:.1f} MiB')
  env = dict(states.COPYING_DEVICES) if case['copying'] else {}
  if case.get('reshard'):
    env['KD_TEST_RESHARD'] = str(case['seed'])
  if case.get('loose') and not kauldron:
    env['KD_TEST_LOOSE'] = str(case['seed'])
  if case.get('layout') and not kauldron:
    env['KD_TEST_LAYOUT'] = str(case['seed'])
  out, rbudget, more, failed = _retried(lambda b: restore(b, env), case['restore_budget'],
                                        'restore')
  notes += more
  if out is None:
    return problems + [failed] + (notes if verbose else [])
  beyond = out['peak_extra_bytes'] - out['restored_bytes']
  notes.append(f"restore {'copying' if case['copying'] else 'shared'}"
               f"{' by SimpleCheckpointLoader' if kauldron and case.get('loader') else ''}"
               f"{' resharded' if case.get('reshard') else ''}"
               f"{' strict=False' if 'KD_TEST_LOOSE' in env else ''}"
               f"{' custom layouts' if 'KD_TEST_LAYOUT' in env else ''} @{rbudget / MiB:.1f} MiB "
               f'beyond arrays {beyond / MiB:.1f} MiB{of}')
  if beyond > rbudget + tolerance:
    problems.append(f'restore peaked {beyond / MiB:.1f} MiB beyond the restored arrays, over '
                    f'its budget {rbudget / MiB:.1f} MiB')
  if local:
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path + '.prev', ignore_errors=True)
  if verbose or problems:
    print('   ', '; '.join(notes), flush=True)
  return problems


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--seeds', default='0-49', help='e.g. 0-99 or 3,17,40-45')
  ap.add_argument('--tolerance-mib', type=float, default=8.0,
                  help='allowed above a budget (the test suite uses 8 MiB)')
  ap.add_argument('--dir', default=None, help='where checkpoints go (default: a temp dir)')
  ap.add_argument('--gcs', action='store_true',
                  help='save to and restore from a GCS server on loopback (fake-gcs-server)')
  ap.add_argument('--processes', type=int, default=1, choices=(1, 2, 4, 8),
                  help='JAX processes joined on 127.0.0.1 (8 CPU devices in all); with '
                       'more than one: no Kauldron, no strict=False')
  ap.add_argument('-v', '--verbose', action='store_true', help='print each case\'s state and figures')
  args = ap.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tests import states  # pylint: disable=g-import-not-at-top

  root = args.dir or tempfile.mkdtemp(prefix='kd_fuzz_')
  server = None
  if args.gcs:
    from tests import gcs_server  # pylint: disable=g-import-not-at-top
    server = gcs_server.GcsServer(os.path.join(root, 'gcs')).start()
    server.create_bucket('fuzz')
    os.environ.update(server.env())  # the workers inherit it
  tolerance = int(args.tolerance_mib * MiB)
  failed, start = [], time.monotonic()
  seeds = _seeds(args.seeds)
  for seed in seeds:
    case = _case(np.random.default_rng(10_000_019 + seed), seed)
    if args.processes > 1:
      case.update(kauldron=False, loose=False)
    line = (f"seed {seed}: {'mixed ' if case['mixed'] else ''}{case['total_bytes'] / MiB:.1f} MiB, "
            f"{'SafeCheckpointer' if case['kauldron'] else case['writer']}"
            f"{' reusing' if case['reuse'] and not case['kauldron'] and case['writer'] != 'stock' else ''} "
            f"@{case['save_budget'] / MiB:.1f} MiB, restore "
            f"{'copying' if case['copying'] else 'shared'}{' resharded' if case['reshard'] else ''}"
            f"{' strict=False' if case['loose'] and not case['kauldron'] else ''}"
            f"{' custom layouts' if case['layout'] and not case['kauldron'] else ''}"
            f"{' by SimpleCheckpointLoader' if case['loader'] and case['kauldron'] else ''}"
            f" @{case['restore_budget'] / MiB:.1f} MiB")
    if args.verbose:
      tree = states.make_state(_state_name(case), case['total_bytes'])
      for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = getattr(getattr(x, 'sharding', None), 'spec', 'one device' if isinstance(
            x, jax.Array) else type(x).__name__)
        print(f'    {jax.tree_util.keystr(p)} {np.shape(x)} {getattr(x, "dtype", "")} {where}')
      del tree
    t = time.monotonic()
    problems = run_case(states, case, 'gs://fuzz' if server else root, tolerance, args.verbose,
                        args.processes)
    print(f"{line}: {'FAIL' if problems else 'ok'} ({time.monotonic() - t:.1f} s)", flush=True)
    for p in problems:
      print('    ' + p.replace('\n', '\n    '), flush=True)
    if problems:
      failed.append(seed)
  print(f'{len(seeds) - len(failed)}/{len(seeds)} held in {time.monotonic() - start:.0f} s'
        + (f'; failed seeds: {",".join(map(str, failed))}' if failed else ''))
  if server is not None:
    server.stop()
  if not args.dir:
    shutil.rmtree(root, ignore_errors=True)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
