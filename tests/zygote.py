"""A fork server for the tests' measured workers: imports once, forks each worker.

A measured operation runs in a process of its own (`states.run_worker`), so
one test's heap never flatters or spoils another's peak.  Started from
nothing, each such process spent 1.5-3 s of CPU importing numpy, jax,
TensorStore and Orbax, about a hundred times per `make test` on 2 cores.
The zygote imports those once and forks a worker per call.  Importing starts
no JAX backend and no thread (checked before the first fork), so each worker
still builds its backend, thread pools, kd_ckpt (not preloaded: it reads
KD_CKPT_* variables at import) and heap from nothing, as a fresh process
does.  One difference is undone: a fork maps none of the files' pages (the
libraries' code and data) that the zygote has resident, so a worker would
count as its own the pages of them a fresh process mapped while importing:
6-15 MiB more peak in a save.  The worker maps them again before it runs
(`_file_pages`, `_map_again`).

  z = Zygote(env)                       # python -m tests.zygote, once
  rc, out, err = z.run(['save', ...], {'KD_CKPT_SHARE_HOST_BUFFERS': '0'}, 600)

`KD_TEST_EXEC_WORKERS=1` makes `states.run_worker` start every worker from
nothing instead (to compare, or to debug).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ('numpy', 'jax', 'jax.numpy', 'tensorstore', 'orbax.checkpoint')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def forkable_env(env: dict[str, str]) -> bool:
  """Whether a worker with these extra variables can be forked: only
  variables read after the preloaded imports (kd_ckpt's and the tests' own)."""
  return all(k.startswith('KD_') for k in env)


class ZygoteError(RuntimeError):
  """The zygote could not start, or died."""


class Zygote:
  """A `python -m tests.zygote` process; `run` forks a `tests.states` worker."""

  def __init__(self, env: dict[str, str]):
    self.env = dict(env)
    self.proc = subprocess.Popen([sys.executable, '-m', 'tests.zygote'], cwd=REPO, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self._lock = threading.Lock()
    line = self.proc.stdout.readline()
    ready = json.loads(line) if line else {}
    if not ready.get('ready'):
      self.close()
      raise ZygoteError(f'the zygote did not start: {ready or self.proc.wait()}')

  def alive(self) -> bool:
    return self.proc.poll() is None

  def run(self, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Forks a worker running `python -m tests.states ARGV`: (rc, stdout, stderr).

    Raises:
      subprocess.TimeoutExpired: it ran past `timeout` (it was killed).
    """
    with self._lock, tempfile.TemporaryDirectory(prefix='kd_zygote_') as tmp:
      out, err = os.path.join(tmp, 'out'), os.path.join(tmp, 'err')
      try:
        self.proc.stdin.write(json.dumps({'argv': argv, 'env': env, 'out': out, 'err': err,
                                          'timeout': timeout}) + '\n')
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
      except (BrokenPipeError, OSError) as e:
        raise ZygoteError(f'the zygote died (exit {self.proc.poll()})') from e
      if not reply:
        raise ZygoteError(f'the zygote died (exit {self.proc.wait()})')
      reply = json.loads(reply)
      read = lambda p: open(p, errors='replace').read() if os.path.exists(p) else ''
      if reply['timed_out']:
        raise subprocess.TimeoutExpired(argv, timeout, read(out), read(err))
      return reply['rc'], read(out), read(err)

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


def _file_pages() -> list[tuple[int, int]]:
  """(address, length) of each run of pages of a file mapping resident here."""
  runs = []
  page = os.sysconf('SC_PAGE_SIZE')
  with open('/proc/self/maps') as maps, open('/proc/self/pagemap', 'rb') as pagemap:
    for line in maps:
      fields = line.split()
      if len(fields) < 6 or fields[4] == '0' or not fields[5].startswith('/'):
        continue  # anonymous memory: a fork keeps it mapped
      lo, hi = (int(x, 16) for x in fields[0].split('-'))
      pagemap.seek(lo // page * 8)
      entries = memoryview(pagemap.read((hi - lo) // page * 8)).cast('Q')
      start = None
      for i, e in enumerate(entries):
        present = e >> 63
        if present and start is None:
          start = i
        elif not present and start is not None:
          runs.append((lo + start * page, (i - start) * page))
          start = None
      if start is not None:
        runs.append((lo + start * page, (len(entries) - start) * page))
  return runs


def _map_again(runs: list[tuple[int, int]]) -> None:
  """Maps `runs` into this (forked) process again, reading nothing new."""
  import ctypes  # pylint: disable=g-import-not-at-top

  libc = ctypes.CDLL(None, use_errno=True)
  libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  madv_populate_read = 22  # Linux >= 5.14; older kernels: the worker counts a bit more
  for addr, length in runs:
    libc.madvise(addr, length, madv_populate_read)


def _child(req: dict, runs) -> int:
  """In the forked worker: its variables, output files, then tests.states as __main__."""
  import runpy  # pylint: disable=g-import-not-at-top
  import traceback  # pylint: disable=g-import-not-at-top

  _map_again(runs)
  os.environ.update(req['env'])
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.dup2(os.open(req['out'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
  os.dup2(os.open(req['err'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
  sys.argv = ['tests.states', *req['argv']]
  try:
    runpy.run_module('tests.states', run_name='__main__', alter_sys=True)
    return 0
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    return 1
  finally:
    sys.stdout.flush()
    sys.stderr.flush()


def _main() -> int:
  import importlib  # pylint: disable=g-import-not-at-top

  for name in PRELOAD:
    importlib.import_module(name)
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  # Forking is only sound while nothing runs but this thread and no backend
  # holds devices: else the workers would inherit half-made state.
  clean = threading.active_count() == 1 and not xla_bridge._backends  # pylint: disable=protected-access
  runs = _file_pages() if clean else []
  sys.stdout.write(json.dumps({'ready': clean}) + '\n')
  sys.stdout.flush()
  if not clean:
    return 1
  for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      code = 1
      try:
        code = _child(req, runs)
      finally:
        os._exit(code)  # pylint: disable=protected-access
    deadline, timed_out = time.monotonic() + float(req['timeout']), False
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      if not timed_out and time.monotonic() > deadline:
        timed_out = True
        os.kill(pid, 9)
      time.sleep(0.02)
    sys.stdout.write(json.dumps({'rc': os.waitstatus_to_exitcode(status),
                                 'timed_out': timed_out}) + '\n')
    sys.stdout.flush()
  return 0


if __name__ == '__main__':
  sys.exit(_main())
