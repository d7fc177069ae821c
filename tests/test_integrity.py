"""CRC32C checksums: recorded by every kd_ckpt save, checked by `verify`."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import kd_ckpt
from kd_ckpt import integrity
from kd_ckpt import verifying
from tests import states

P, NS = states.P, states.NS


def _tree():
  m1, m2 = states.meshes()
  return {
      'big': states.filled((1024, 1024), NS(m1, P('x'))),            # 4 MiB, sharded
      'rep': states.filled((256, 256), NS(m1, P()), jnp.bfloat16, 1),  # replicated
      'grid': states.filled((64, 128), NS(m2, P('a', 'b')), jnp.int8, 2),
      'flag': jnp.ones((7,), bool),
      'step': jnp.int32(12),                                           # 0-d
      'host': np.arange(10, dtype=np.float64),
      'lr': 0.5,
  }


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', 'kd_ckpt', *args], cwd=states.REPO,
                        env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize('strategy', ['streaming', 'orbax'])
def test_every_leaf_is_checksummed_and_verifies(tmp_path, strategy):
  tree = _tree()
  d = tmp_path / 'ckpt'
  kd_ckpt.save(d, tree, host_ram_budget='64MiB', strategy=strategy)
  files = sorted(p.name for p in d.iterdir() if p.name.startswith(integrity.FILE_PREFIX))
  assert files == ['kd_ckpt_checksums.process_0.json']
  report = kd_ckpt.verify(d, host_ram_budget='64MiB')
  assert report.ok, str(report)
  assert {l.path for l in report.leaves} == set(tree)
  # Every byte of every leaf is covered, exactly once.
  nbytes = {k: np.asarray(v).nbytes for k, v in tree.items()}
  assert {l.path: l.checked_bytes for l in report.leaves} == nbytes
  assert 'big' in str(report) and 'ok' in str(report)
  # Orbax's files are untouched by ours: stock Orbax restores bit-exact.
  back = ocp.StandardCheckpointer().restore(d, tree)
  for k in tree:
    np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))


def test_checksum_matches_an_independent_crc_of_the_logical_bytes(tmp_path):
  tree = {'w': states.filled((512, 256), NS(states.meshes()[0], P('x')))}
  d = tmp_path / 'ckpt'
  kd_ckpt.save(d, tree, host_ram_budget='64MiB', strategy='streaming')
  rec = integrity.read(d)['w']
  host = np.asarray(tree['w'])
  for box, crc in rec.boxes:
    piece = host[tuple(slice(a, b) for a, b in box)]
    import google_crc32c  # pylint: disable=g-import-not-at-top
    assert crc == google_crc32c.value(piece.tobytes())


def _flip_a_byte_of_the_biggest_data_file(d: pathlib.Path) -> pathlib.Path:
  data = max((p for p in d.rglob('*') if p.is_file() and '/d/' in p.as_posix()),
             key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x5A
  data.write_bytes(bytes(raw))
  return data


@pytest.mark.parametrize('nbytes', [0, 1, 7, 8, 9, 4096, 12345, (1 << 20) + 3, 3 << 22])
@pytest.mark.parametrize('start', [0, 0xDEADBEEF])
def test_crc_of_zeros_from_the_length_matches_the_bytes(nbytes, start):
  """A leaf found all zero is checksummed from its length: the same CRC32C
  as of the bytes, extending any earlier CRC."""
  assert integrity.crc32c_zeros(nbytes, start) == integrity.crc32c(
      np.zeros(nbytes, np.uint8), start)
  with pytest.raises(ValueError, match='nbytes must be >= 0, got -1'):
    integrity.crc32c_zeros(-1)


@pytest.mark.parametrize('strategy', ['streaming', 'orbax'])
def test_flipped_byte_is_found_and_named(tmp_path, strategy):
  tree = _tree()
  d = tmp_path / 'ckpt'
  kd_ckpt.save(d, tree, host_ram_budget='64MiB', strategy=strategy)
  _flip_a_byte_of_the_biggest_data_file(d)

  report = kd_ckpt.verify(d, host_ram_budget='64MiB')
  assert not report.ok
  by_path = {l.path: l for l in report.leaves}
  # 'big' is 4 MiB of noise; the biggest data file's middle is in it.
  assert by_path['big'].status in (verifying.CORRUPT, verifying.UNREADABLE), str(report)
  assert all(l.status == verifying.OK for p, l in by_path.items() if p != 'big'), str(report)

  cli = _cli('verify', str(d), '--host-ram-budget=64MiB')
  assert cli.returncode == 1, cli.stderr[-2000:]
  assert 'big' in cli.stdout and ('CORRUPT' in cli.stdout or 'unreadable' in cli.stdout)

  with pytest.raises(kd_ckpt.CorruptCheckpointError, match='big'):
    kd_ckpt.restore(d, jax.eval_shape(lambda: tree), verify=True)


def test_verify_cli_ok_and_json(tmp_path):
  d = tmp_path / 'ckpt'
  kd_ckpt.save(d, _tree(), host_ram_budget='64MiB', strategy='streaming')
  cli = _cli('verify', str(d), '--json')
  assert cli.returncode == 0, cli.stderr[-2000:]
  out = json.loads(cli.stdout)
  assert out['ok'] and len(out['leaves']) == 7


def test_missing_process_file_is_reported_incomplete(tmp_path):
  d = tmp_path / 'ckpt'
  kd_ckpt.save(d, _tree(), host_ram_budget='64MiB', strategy='streaming')
  f = d / integrity.file_name(0)
  data = json.loads(f.read_text())
  data['leaves']['big']['boxes'] = data['leaves']['big']['boxes'][:-1]
  f.write_text(json.dumps(data))
  report = kd_ckpt.verify(d)
  assert {l.path: l.status for l in report.bad} == {'big': verifying.INCOMPLETE}


def test_stock_orbax_checkpoint_lists_every_leaf_unchecked(tmp_path):
  """verify, the CLI and restore(verify=True) agree (issue 19)."""
  d = tmp_path / 'stock'
  ckptr = ocp.StandardCheckpointer()
  tree = {'w': jnp.ones((4,)), 'b': jnp.zeros((3,))}
  ckptr.save(d, tree)
  ckptr.wait_until_finished()
  report = kd_ckpt.verify(d)
  assert report.ok and sorted(l.path for l in report.unchecked) == ['b', 'w'], str(report)
  assert 'stock Orbax' in report.unchecked[0].detail
  cli = _cli('verify', str(d))
  assert cli.returncode == 1 and 'unchecked' in cli.stderr, cli.stderr[-2000:]
  assert 'w' in cli.stdout and 'b' in cli.stdout
  assert _cli('verify', str(d), '--allow-unchecked').returncode == 0
  with pytest.raises(kd_ckpt.NoChecksumsError, match='allow_unchecked=True'):
    kd_ckpt.restore(d, verify=True)
  back = kd_ckpt.restore(d, verify=True, allow_unchecked=True)
  assert np.asarray(back['w']).tobytes() == np.asarray(tree['w']).tobytes()


def test_flipped_byte_in_a_prng_key_leaf_is_named(tmp_path):
  """Orbax strategy: the key's data is checksummed like any array (issue 10)."""
  keys = jax.random.split(jax.random.key(0), 1 << 18)  # 2 MiB of key data
  tree = {'keys': keys, 'small': jnp.ones((4,))}
  d = tmp_path / 'ckpt'
  kd_ckpt.save(d, tree, host_ram_budget='64MiB', strategy='orbax')
  assert 'keys' in integrity.read(d)
  assert kd_ckpt.verify(d).ok
  _flip_a_byte_of_the_biggest_data_file(d)
  report = kd_ckpt.verify(d, host_ram_budget='64MiB')
  assert {l.path for l in report.bad} == {'keys'}, str(report)


def test_leaf_without_checksum_is_unchecked_and_fails_the_cli(tmp_path):
  d = tmp_path / 'ckpt'
  kd_ckpt.save(d, _tree(), host_ram_budget='64MiB', strategy='streaming')
  f = d / integrity.file_name(0)
  data = json.loads(f.read_text())
  del data['leaves']['grid']
  f.write_text(json.dumps(data))
  report = kd_ckpt.verify(d)
  assert report.ok  # nothing is corrupt ...
  assert [l.path for l in report.unchecked] == ['grid']  # ... but one leaf is unvouched for
  assert 'UNCHECKED' in report.summary()
  cli = _cli('verify', str(d))
  assert cli.returncode == 1 and 'unchecked' in cli.stderr, cli.stderr[-2000:]
  assert _cli('verify', str(d), '--allow-unchecked').returncode == 0


def test_pure_python_crc32c_is_named_with_its_speed(monkeypatch):
  """google-crc32c falls back to Python silently; kd_ckpt says so (issue 19)."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(integrity.google_crc32c, 'implementation', 'python')
  seen = []
  monkeypatch.setattr(logging, 'log_first_n', lambda level, msg, n, *a: seen.append(msg))
  assert integrity.collector() is not None
  assert seen and 'pure-Python' in seen[0] and 'MB/s' in seen[0], seen
