"""Reuse of unchanged leaves (issue 13): nothing changed is written twice,
every checkpoint stays complete and independent, a changed leaf is never reused."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
from kauldron import kd
import numpy as np
import orbax.checkpoint as ocp
import pytest

import kd_ckpt
from kd_ckpt import reuse
from kd_ckpt import verifying
from tests import states

P, NS = states.P, states.NS
MiB = states.MiB
TOLERANCE = 8 * MiB  # as tests/test_budget.py
REPO = pathlib.Path(__file__).resolve().parents[1]


def _frozen():
  m1, m2 = states.meshes()
  return {'embed': states.filled((2048, 1024), NS(m1, P('x'))),            # 8 MiB sharded
          'proj': states.filled((1024, 1024), NS(m1, P()), jnp.bfloat16, 1),  # replicated
          'grid': states.filled((512, 256), NS(m2, P('a', 'b')), seed=2),
          'bias': jnp.arange(10, dtype=jnp.float32)}


def _trainable(step):
  m1, _ = states.meshes()
  return {'lora': states.filled((256, 64), NS(m1, P('x')), seed=100 + step),
          'mu': states.filled((256, 64), NS(m1, P('x')), seed=200 + step),
          'count': jnp.int32(step)}


def _tree(frozen, step):
  return {'frozen': frozen, 'opt': _trainable(step)}


def _assert_same(a, b):
  """Same structure, same leaf count, every leaf bit for bit (a missing leaf fails)."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, (ta, tb)
  assert len(la) == len(lb) > 0
  for x, y in zip(la, lb, strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _stock_restore_without_kd_ckpt(directory, like):
  """Restores in a fresh process where `import kd_ckpt` fails."""
  block = pathlib.Path(directory).parent / 'block_kd'
  block.mkdir(exist_ok=True)
  (block / 'sitecustomize.py').write_text(
      'import importlib.abc, sys\n'
      'class _B(importlib.abc.MetaPathFinder):\n'
      '  def find_spec(self, name, path=None, target=None):\n'
      "    if name.split('.')[0] == 'kd_ckpt':\n"
      "      raise ModuleNotFoundError('kd_ckpt blocked', name=name)\n"
      'sys.meta_path.insert(0, _B())\n')
  out = pathlib.Path(directory).parent / 'restored.npz'
  script = (
      'import sys, numpy as np, orbax.checkpoint as ocp, jax\n'
      'try:\n  import kd_ckpt\n  raise SystemExit("kd_ckpt importable")\n'
      'except ModuleNotFoundError:\n  pass\n'
      'back = ocp.StandardCheckpointer().restore(sys.argv[1])\n'
      'flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in'
      ' jax.tree_util.tree_flatten_with_path(back)[0]}\n'
      'np.savez(sys.argv[2], **{k: np.frombuffer(v.tobytes(), np.uint8) for k, v in flat.items()})\n')
  env = dict(os.environ, PYTHONPATH=str(block), JAX_PLATFORMS='cpu',
             XLA_FLAGS='--xla_force_host_platform_device_count=8')
  proc = subprocess.run([sys.executable, '-c', script, str(directory), str(out)],
                        capture_output=True, text=True, env=env, timeout=300, cwd='/')
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = dict(np.load(out))
  want = {jax.tree_util.keystr(p): np.frombuffer(np.asarray(x).tobytes(), np.uint8) for p, x in
          jax.tree_util.tree_flatten_with_path(like)[0]}
  assert got.keys() == want.keys()
  for k in want:
    assert got[k].tobytes() == want[k].tobytes(), k


@pytest.mark.parametrize('strategy', ['streaming', 'orbax'])
def test_unchanged_leaves_are_reused_and_every_checkpoint_stays_complete(tmp_path, strategy):
  frozen = _frozen()
  frozen_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(frozen))
  reports = []
  for step in range(4):
    prev = tmp_path / str(step - 1) if step else None
    reports.append(kd_ckpt.save(tmp_path / str(step), _tree(frozen, step),
                                host_ram_budget='64MiB', strategy=strategy,
                                fingerprint=True, reuse_from=prev))
  assert reports[0].bytes_reused == 0
  for r in reports[1:]:
    assert r.leaves_reused == 4 and r.bytes_reused == frozen_bytes, str(r)
    assert r.bytes_written == 2 * 256 * 64 * 4 + 4, str(r)  # only what changed
  # Delete every earlier checkpoint: the last one is complete on its own.
  for step in range(3):
    shutil.rmtree(tmp_path / str(step))
  last = _tree(frozen, 3)
  _assert_same(kd_ckpt.restore(tmp_path / '3', jax.eval_shape(lambda: last)), last)
  _stock_restore_without_kd_ckpt(tmp_path / '3', last)
  check = kd_ckpt.verify(tmp_path / '3')
  assert check.ok and not check.unchecked, str(check)
  # Only the files the checkpoint uses were kept (`reuse.prune`).
  assert reuse.referenced_files(tmp_path / '3') >= {
      os.path.relpath(os.path.join(r, f), tmp_path / '3')
      for r, _, fs in os.walk(tmp_path / '3') for f in fs
      if reuse.LINK_DIR in r and f != 'manifest.ocdbt'}


def test_a_single_changed_element_is_never_reused(tmp_path):
  m1, _ = states.meshes()
  big = states.filled((4096, 1024), NS(m1, P('x')))  # 16 MiB, fingerprinted on device
  kd_ckpt.save(tmp_path / '0', {'w': big}, host_ram_budget='64MiB', fingerprint=True)
  changed = big.at[2047, 511].add(1e-3)  # one element, mid-array, in one shard
  assert int((np.asarray(changed) != np.asarray(big)).sum()) == 1
  r = kd_ckpt.save(tmp_path / '1', {'w': changed}, host_ram_budget='64MiB',
                   reuse_from=tmp_path / '0')
  assert r.leaves_reused == 0 and r.bytes_reused == 0, str(r)
  back = kd_ckpt.restore(tmp_path / '1', {'w': jax.ShapeDtypeStruct(big.shape, big.dtype)})
  np.testing.assert_array_equal(np.asarray(back['w']), np.asarray(changed))
  # ... while the unchanged array is.
  r = kd_ckpt.save(tmp_path / '2', {'w': changed}, host_ram_budget='64MiB',
                   reuse_from=tmp_path / '1')
  assert r.leaves_reused == 1 and r.bytes_written == 0, str(r)


def test_a_live_array_saved_again_is_not_hashed_again(tmp_path, monkeypatch):
  """Same object: its recorded fingerprint; an equal copy: hashed, reused; a change: written."""
  from kd_ckpt import fingerprint as fingerprint_lib  # pylint: disable=g-import-not-at-top
  m1, _ = states.meshes()
  big = states.filled((4096, 1024), NS(m1, P('x')), seed=7)
  hashed = []
  real = fingerprint_lib.fingerprint_many

  def counting(jobs):
    hashed.append(len(jobs))
    return real(jobs)

  monkeypatch.setattr(fingerprint_lib, 'fingerprint_many', counting)
  kd_ckpt.save(tmp_path / '0', {'w': big}, host_ram_budget='64MiB', fingerprint=True)
  assert sum(hashed) == 1
  r = kd_ckpt.save(tmp_path / '1', {'w': big}, host_ram_budget='64MiB', reuse_from=tmp_path / '0')
  assert r.leaves_reused == 1 and sum(hashed) == 1, str(r)  # not hashed again
  copy = big + 0  # a new object with the same bytes
  r = kd_ckpt.save(tmp_path / '2', {'w': copy}, host_ram_budget='64MiB', reuse_from=tmp_path / '1')
  assert r.leaves_reused == 1 and sum(hashed) == 2, str(r)
  changed = copy.at[4095, 1023].add(1.0)
  r = kd_ckpt.save(tmp_path / '3', {'w': changed}, host_ram_budget='64MiB',
                   reuse_from=tmp_path / '2')
  assert r.leaves_reused == 0 and sum(hashed) == 3, str(r)
  back = kd_ckpt.restore(tmp_path / '3', {'w': jax.ShapeDtypeStruct(big.shape, big.dtype)})
  np.testing.assert_array_equal(np.asarray(back['w']), np.asarray(changed))
  del big
  assert len(reuse._RECORDS) <= 2  # records go with their arrays  # pylint: disable=protected-access


def test_changed_sharding_or_dtype_is_written(tmp_path):
  m1, m2 = states.meshes()
  w = states.filled((1024, 1024), NS(m1, P('x')))
  kd_ckpt.save(tmp_path / '0', {'w': w, 'b': w.astype(jnp.bfloat16)}, fingerprint=True)
  resharded = jax.device_put(w, NS(m2, P('a', 'b')))
  r = kd_ckpt.save(tmp_path / '1', {'w': resharded, 'b': w.astype(jnp.float32)},
                   reuse_from=tmp_path / '0')
  assert r.leaves_reused == 0, str(r)
  back = kd_ckpt.restore(tmp_path / '1')
  np.testing.assert_array_equal(np.asarray(back['w']), np.asarray(w))


def test_falls_back_where_hard_links_fail(tmp_path, caplog):
  """Previous checkpoint on another filesystem (a tmpfs): full write, and why."""
  fs = tmp_path / 'fs'
  fs.mkdir()
  r = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=64m', 'tmpfs', str(fs)],
                     capture_output=True, text=True)
  if r.returncode:
    pytest.skip(f'cannot mount a tmpfs here: {r.stderr.strip()}')
  try:
    tree = _tree(_frozen(), 0)
    kd_ckpt.save(fs / 'prev', tree, host_ram_budget='64MiB', fingerprint=True)
    caplog.set_level('INFO')
    r = kd_ckpt.save(tmp_path / 'next', tree, host_ram_budget='64MiB', reuse_from=fs / 'prev')
    # Nothing reused: every byte of the tree written again.
    expected = sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
    assert r.leaves_reused == 0 and r.bytes_written == expected > 0, (r.bytes_written, expected)
    assert 'cannot hard-link' in caplog.text
    _assert_same(kd_ckpt.restore(tmp_path / 'next', jax.eval_shape(lambda: tree)), tree)
  finally:
    subprocess.run(['umount', '-l', str(fs)], check=False)


def test_no_fingerprints_in_the_previous_checkpoint_falls_back(tmp_path, caplog):
  tree = _tree(_frozen(), 0)
  kd_ckpt.save(tmp_path / '0', tree)  # no fingerprints
  caplog.set_level('INFO')
  r = kd_ckpt.save(tmp_path / '1', tree, reuse_from=tmp_path / '0')
  assert r.leaves_reused == 0 and 'no kd_ckpt fingerprints' in caplog.text
  r = kd_ckpt.save(tmp_path / '2', tree, reuse_from=tmp_path / '1')  # 1 recorded them
  assert r.leaves_reused == 7


def test_deleting_a_checkpoint_never_changes_another(tmp_path):
  frozen = _frozen()
  for step in range(3):
    kd_ckpt.save(tmp_path / str(step), _tree(frozen, step), fingerprint=True,
                 reuse_from=tmp_path / str(step - 1) if step else None)
  def snapshot(d):
    return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), 'rb').read()
            for r, _, fs in os.walk(d) for f in fs}
  before = {s: snapshot(tmp_path / str(s)) for s in (0, 2)}
  shutil.rmtree(tmp_path / '1')
  assert {s: snapshot(tmp_path / str(s)) for s in (0, 2)} == before
  for s in (0, 2):
    assert kd_ckpt.verify(tmp_path / str(s)).ok
    want = _tree(frozen, s)
    _assert_same(kd_ckpt.restore(tmp_path / str(s), jax.eval_shape(lambda w=want: w)), want)


@pytest.mark.parametrize('strategy', ['streaming', 'orbax'])
def test_a_zero_leaf_stored_zstd_is_reused(tmp_path, strategy):
  """A frozen leaf of zeros is stored zstd (`arrays.ZSTD_ZERO_LEAVES_FROM_BYTES`)
  by either writer; the next save links it, and stock Orbax restores both."""
  frozen = {'zero': jnp.zeros((1 << 20, 2), jnp.float32), 'embed': _frozen()['embed']}
  trees = [_tree(frozen, step) for step in range(2)]
  for step, tree in enumerate(trees):
    r = kd_ckpt.save(tmp_path / str(step), tree, host_ram_budget='1GiB', strategy=strategy,
                     fingerprint=True, reuse_from=tmp_path / '0' if step else None)
    assert r.strategy == strategy and r.leaves_reused == (2 if step else 0)
  for step, tree in enumerate(trees):
    d = tmp_path / str(step)
    # zero (8 MiB) takes a few KB; the rest is raw: embed 8 MiB, opt 128 KiB.
    assert states.stored_bytes(d) < frozen['embed'].nbytes + MiB, states.stored_bytes(d)
    assert kd_ckpt.verify(d).ok
    abstract = jax.eval_shape(lambda t=tree: t)
    _assert_same(kd_ckpt.restore(d, abstract, host_ram_budget='64MiB'), tree)
    _assert_same(ocp.StandardCheckpointer().restore(d, abstract), tree)


def test_reused_leaves_are_covered_by_verify(tmp_path):
  frozen = _frozen()
  kd_ckpt.save(tmp_path / '0', _tree(frozen, 0), fingerprint=True)
  kd_ckpt.save(tmp_path / '1', _tree(frozen, 1), reuse_from=tmp_path / '0')
  report = kd_ckpt.verify(tmp_path / '1')
  checked = {l.path: l.checked_bytes for l in report.leaves}
  assert checked['frozen.embed'] == 2048 * 1024 * 4 and report.ok
  # The bytes are shared: corrupting them shows in both checkpoints.  The
  # byte flipped is found by content (embed's first row, raw chunks): which
  # data file holds which leaf, and where, depends on TensorStore's timing.
  head = np.asarray(frozen['embed'])[0, :16].tobytes()
  found = [(p, raw.find(head)) for p in (tmp_path / '0').rglob('*')
           if '/d/' in p.as_posix() and (raw := p.read_bytes()).find(head) >= 0]
  assert len(found) == 1, found
  data, at = found[0]
  raw = bytearray(data.read_bytes())
  raw[at + 8] ^= 0xFF
  data.write_bytes(bytes(raw))
  bad = [{l.path for l in kd_ckpt.verify(tmp_path / d).bad} for d in ('0', '1')]
  assert bad == [{'frozen.embed'}, {'frozen.embed'}], bad


@flax.struct.dataclass
class _State(kd.ckpts.items.StandardCheckpointItem):
  params: dict


@pytest.mark.slow
def test_safe_checkpointer_reuse_with_max_to_keep(tmp_path):
  frozen = _frozen()
  ckpt = kd_ckpt.SafeCheckpointer(workdir=str(tmp_path), save_interval_steps=1,
                                  max_to_keep=2, host_ram_budget='64MiB',
                                  reuse_unchanged=True)
  for step in range(5):
    assert ckpt.save(_State(params=_tree(frozen, step)), step=step)
    ckpt.wait_until_finished()
  assert list(ckpt.all_steps) == [3, 4]
  assert [r.leaves_reused for r in ckpt.reports] == [0, 4, 4, 4, 4]
  last = _State(params=_tree(frozen, 4))
  _assert_same(ckpt.restore(last, step=4, donate=False).params, last.params)
  # Stock Kauldron restores it too.
  stock = kd.ckpts.Checkpointer(workdir=str(tmp_path), save_interval_steps=1)
  _assert_same(stock.restore(_State(params=jax.eval_shape(lambda: last.params)), step=4).params,
               last.params)
  info = kd_ckpt.inspect(tmp_path / 'checkpoints' / 'ckpt_4')
  assert info.report.leaves_reused == 4 and info.report.bytes_reused > 0
  assert 'bytes reused' in str(info)


def test_verify_reports_unchecked_when_checksums_cannot_be_taken(tmp_path, monkeypatch):
  from kd_ckpt import integrity  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(integrity, 'google_crc32c', None)
  kd_ckpt.save(tmp_path / 'c', {'w': jnp.ones((8,))})
  monkeypatch.undo()
  report = kd_ckpt.verify(tmp_path / 'c')
  assert [l.path for l in report.unchecked] == ['w'], str(report)
  with pytest.raises(verifying.NoChecksumsError):
    kd_ckpt.restore(tmp_path / 'c', verify=True)


def test_pruning_fails_closed_on_a_reference_it_cannot_read(tmp_path, monkeypatch):
  """An unparsed `ocdbt.dump` location deletes nothing (issue 19): disk, never data."""
  from kd_ckpt import reuse as reuse_lib  # pylint: disable=g-import-not-at-top
  from kd_ckpt import storage  # pylint: disable=g-import-not-at-top
  for bad in ('', 'value', 'blob:x:y:0:1', None):
    with pytest.raises(reuse_lib.UnparsedReferenceError):
      reuse_lib._file_of(bad)  # pylint: disable=protected-access
  assert reuse_lib._file_of('value:a/:d/f:0:4') == 'a/d/f'  # pylint: disable=protected-access
  t = {'a': jnp.arange(1 << 18, dtype=jnp.float32), 'b': jnp.ones((1 << 16,))}
  kd_ckpt.save(tmp_path / '1', t, fingerprint=True)
  real = reuse_lib.referenced_files

  def unreadable(directory):
    real(directory)
    raise reuse_lib.UnparsedReferenceError('unrecognised OCDBT location')

  monkeypatch.setattr(reuse_lib, 'referenced_files', unreadable)
  kd_ckpt.save(tmp_path / '2', dict(t, b=t['b'] + 1), reuse_from=tmp_path / '1')
  linked = [rel for rel, _ in storage.files(tmp_path / '2') if reuse_lib.LINK_DIR in rel]
  monkeypatch.undo()
  kept_all = [rel for rel, _ in storage.files(tmp_path / '1')
              if rel.split('/')[-1] == 'manifest.ocdbt' or '/d/' in f'/{rel}']
  assert len(linked) == len(kept_all) > 1, (linked, kept_all)
  back = ocp.StandardCheckpointer().restore(tmp_path / '2')
  assert np.asarray(back['a']).tobytes() == np.asarray(t['a']).tobytes()


def test_free_space_is_checked_for_what_a_reusing_save_writes(tmp_path, monkeypatch):
  """A LoRA-like save that rewrites a few hundred KiB must not ask for the
  frozen MiBs free; one whose changes do not fit is refused before writing."""
  from kd_ckpt import storage  # pylint: disable=g-import-not-at-top
  frozen = _frozen()
  kd_ckpt.save(tmp_path / '0', _tree(frozen, 0), host_ram_budget='64MiB', fingerprint=True)
  total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(_tree(frozen, 1)))
  # Less free than the tree, more than its trainable part (~128 KiB).
  free = {'bytes': 1 * MiB}
  monkeypatch.setattr(storage, 'free_bytes', lambda _: free['bytes'])
  assert total > 8 * free['bytes']
  r = kd_ckpt.save(tmp_path / '1', _tree(frozen, 1), host_ram_budget='64MiB',
                   reuse_from=tmp_path / '0')
  assert r.bytes_reused > 0 and r.bytes_written < free['bytes'], str(r)
  _assert_same(kd_ckpt.restore(tmp_path / '1'), _tree(frozen, 1))
  # Without a previous checkpoint every byte is written: refused up front.
  with pytest.raises(storage.DiskFullError, match='Nothing was written'):
    kd_ckpt.save(tmp_path / 'fresh', _tree(frozen, 1), host_ram_budget='64MiB',
                 reuse_from=tmp_path / 'missing')
  # Changes that do not fit: refused before their bytes are written.
  free['bytes'] = 64 << 10
  with pytest.raises(storage.DiskFullError, match='Not enough disk space'):
    kd_ckpt.save(tmp_path / '2', _tree(frozen, 2), host_ram_budget='64MiB',
                 reuse_from=tmp_path / '1')
  assert not (tmp_path / '2').exists()
  _assert_same(kd_ckpt.restore(tmp_path / '1'), _tree(frozen, 1))


# --- the fingerprints' device programs are charged to the budget --------------

def test_fingerprint_program_keys_are_the_programs_jit_compiles():
  """`fingerprint.program_keys` counts exactly what a save's fingerprints
  compile: one program per shape, dtype, box and device set (a sharded leaf:
  one over its 8 devices); once hashed, none is new."""
  from kd_ckpt import fingerprint  # pylint: disable=g-import-not-at-top
  m1, _ = states.meshes()
  leaves = [states.filled((8 * 131, 1031), NS(m1, P('x')), seed=5),          # 8 shards
            states.filled((8 * 131, 1031), NS(m1, P('x')), seed=6),          # the same again
            states.filled((8 * 80, 1031), NS(m1, P()), jnp.bfloat16, 7)]     # replicated, 1.3 MB
  sets = [reuse._write_set(x, 0, True, None, None) for x in leaves]
  keys = set().union(*(fingerprint.program_keys(s) for s in sets))
  new = fingerprint.new_programs(keys)
  compiled = lambda: fingerprint._lane_sums._cache_size() + fingerprint._spmd_program._cache_size()
  before = compiled()
  fingerprint.fingerprint_many(sets)
  assert compiled() - before == len(new)
  # One program per shape: the replicated leaf is cut replica-parallel, a
  # part on each device (none new if an earlier test hashed these).
  assert len(new) == 2 or not new, new
  assert not fingerprint.new_programs(keys)
  assert reuse.fingerprint_programs({'a': leaves[0]}) == 0
  # The replicated leaf, cut whole on one device (Orbax's single-replica
  # writer), is one more program, counted until a save compiles it.
  assert reuse.fingerprint_programs({'b': leaves[2]}) == 1


_PROGRAMS_WORKER = """
import json, os, sys, jax, jax.numpy as jnp, kd_ckpt
from kd_ckpt import hostmem, reuse
root, budget = sys.argv[1], int(sys.argv[2])
# 90 leaves of 1.0-1.1 MiB, each of its own shape: 90 fingerprint programs.
tree = {f'l{i}': jnp.full((256 + i, 1031), i, jnp.float32) for i in range(90)}
jax.block_until_ready(tree)
out = {'programs': reuse.fingerprint_programs(tree), 'runs': []}
for name, reuse_from, b in (('a', None, budget), ('b', 'a', 64 << 20)):
  with hostmem.PeakRss() as peak:
    try:
      r = kd_ckpt.save(os.path.join(root, name), tree, host_ram_budget=b, fingerprint=True,
                       reuse_from=reuse_from and os.path.join(root, reuse_from))
      run = {'reused': r.leaves_reused}
    except kd_ckpt.BudgetTooSmallError as e:
      run = {'error': str(e)}
  run.update(budget=b, peak=peak.extra_bytes, exists=os.path.exists(os.path.join(root, name)))
  out['runs'].append(run)
  if 'error' in run:
    break
print(json.dumps(out))
"""


def _programs_worker(root, budget):
  import json  # pylint: disable=g-import-not-at-top
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  proc = subprocess.run([sys.executable, '-c', _PROGRAMS_WORKER, str(root), str(budget)],
                        capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_fingerprinting_save_charges_the_programs_xla_keeps(tmp_path):
  """Each leaf shape hashed on device compiles a program XLA keeps (~0.9 MiB).

  Uncharged, 200 shapes peaked at 155 MiB on a 64 MiB budget.  Now a fresh
  process at 64 MiB is refused before anything is written, naming a budget
  that then holds; and a second save of the same tree in that process
  compiles nothing new, so it fits 64 MiB again (its unchanged leaves reused).
  """
  from kd_ckpt import cost  # pylint: disable=g-import-not-at-top
  first = _programs_worker(tmp_path / 'r64', 64 * MiB)
  assert first['programs'] == 90
  [refused] = first['runs']
  assert 'error' in refused and not refused['exists'], refused
  assert '90 programs' in refused['error'] and 'without reuse' in refused['error']
  assert refused['peak'] <= 64 * MiB + TOLERANCE
  named = int(re.search(r"to '(\d+)MiB' or more", refused['error']).group(1)) * MiB
  assert named >= 90 * cost.FINGERPRINT_PROGRAM_BYTES
  second = _programs_worker(tmp_path / 'named', named)
  a, b = second['runs']
  assert 'error' not in a and a['exists'] and a['peak'] <= named + TOLERANCE, a
  assert 'error' not in b and b['exists'] and b['peak'] <= 64 * MiB + TOLERANCE, b
  assert a['reused'] == 0 and b['reused'] == 90, second
  back = kd_ckpt.restore(tmp_path / 'named' / 'b', host_ram_budget='256MiB')
  for i in (0, 45, 89):
    leaf = np.asarray(back[f'l{i}'])
    assert leaf.shape == (256 + i, 1031) and (leaf == i).all()


def test_replica_parallel_parts_are_recorded_where_they_are():
  """A replica-parallel part's global box is Orbax's `ReplicaSlice.index` as it
  is: the parts tile the array, and each box holds the bytes its source box
  does.  (Offset twice, a second process recorded its neighbour's chunks and
  its reusing checkpoint lacked its own: tests/test_multiprocess.py.)"""
  from kd_ckpt import compat, streaming  # pylint: disable=g-import-not-at-top
  m1, _ = states.meshes()
  x = states.filled((8 * 16, 5), NS(m1, P()), seed=9)  # replicated over 8 devices
  host = np.asarray(x)
  pieces = reuse._write_set(x, 0, True, None, None)
  assert sorted(g[0].start for _, _, g in pieces) == list(range(0, 128, 16))
  for data, src, glob in pieces:
    assert (np.asarray(data)[src] == host[glob]).all()
  rslices = compat.orbax.get_replica_slices(x, 0, True, None, None).replica_slices
  assert sorted(streaming._region(r, x.shape)[0].start for r in rslices) == list(range(0, 128, 16))


def test_a_host_hash_never_fetches_a_megabyte(monkeypatch):
  """Where `device_get` copies (a GPU), the host hash of a replica-parallel
  part fetches its whole shard: a replicated 256 KiB leaf over 8 devices was
  2 MiB fetched for 256 KiB hashed, uncharged.  Such a leaf is hashed on
  device instead, and its program is counted.  (The CPU backend's view is
  made to copy here; on it, each part alone is copied and hashed on the host.)"""
  m1, _ = states.meshes()
  rep = states.filled((8 * 64, 128), NS(m1, P()), seed=3)   # 256 KiB, 8 replicas
  tiny = states.filled((8, 16), NS(m1, P()), seed=4)
  handler = ocp.type_handlers.ArrayHandler(replica_id=0, use_replica_parallel=True)
  assert len(reuse.write_set(handler, rep)) == 8
  fetched, hashed = [], []
  host_fingerprint, many = reuse._host_fingerprint, reuse.fingerprint_lib.fingerprint_many

  def spy_host(dtype, pieces):
    fetched.append(reuse.host_fetch_bytes(pieces, np.dtype(dtype).itemsize))
    return host_fingerprint(dtype, pieces)

  def spy_many(leaves):
    hashed.extend(leaves)
    return many(leaves)

  monkeypatch.setattr(reuse, '_host_fingerprint', spy_host)
  monkeypatch.setattr(reuse.fingerprint_lib, 'fingerprint_many', spy_many)
  on_cpu = reuse.fingerprint_leaves(handler, [rep, tiny], None)
  assert [r.method for r in on_cpu] == ['host', 'host'] and fetched == [256 * 1024, 512] and not hashed
  assert reuse.fingerprint_programs({'rep': rep, 'tiny': tiny}) == 0

  monkeypatch.setattr(reuse, '_host_copy_free', lambda data: False)
  fetched.clear()
  assert reuse.fingerprint_programs({'rep': rep, 'tiny': tiny}) >= 1  # counted before it compiles
  fresh = [states.filled((8 * 64, 128), NS(m1, P()), seed=3),   # not the cached arrays
           states.filled((8, 16), NS(m1, P()), seed=4)]
  copying = reuse.fingerprint_leaves(handler, fresh, None)
  assert [r.method for r in copying] == ['device', 'host']
  assert fetched == [8 * 512], fetched                 # the tiny leaf's 8 replicas
  assert [len(pieces) for pieces in hashed] == [8]     # the big one's 8 parts, on device
  # Another method is another fingerprint (a previous checkpoint's leaf is
  # written again once); the same method, the same one.
  assert copying[0].fingerprint != on_cpu[0].fingerprint
  assert copying[1].fingerprint == on_cpu[1].fingerprint


def test_a_later_save_is_charged_only_the_programs_its_way_compiles(tmp_path):
  """A replicated leaf's fingerprint programs depend on how the save cuts it
  (Orbax's writer replica-parallel or not, the streaming writer).  The plan
  charges each candidate its own way's programs: once a save took one way,
  a later save that way is charged none.  (Charged the union, it was
  charged the ways it never took, 1.5 MiB a replicated leaf shape, at every
  save: here 18 MiB, and a budget it fits was refused.)"""
  from kd_ckpt import cost  # pylint: disable=g-import-not-at-top
  m1, _ = states.meshes()
  # 12 replicated leaves of 1.3-1.7 MiB, of shapes no other test hashes.
  tree = {f'r{i:02d}': states.filled((8 * (41 + i), 1031), NS(m1, P()), seed=i)
          for i in range(12)}
  before = reuse.fingerprint_programs_by_way(tree)
  assert before == {'replica_parallel': 12, 'single_replica': 12, 'streaming': 12}, before
  kd_ckpt.save(tmp_path / 'a', tree, fingerprint=True, strategy='streaming',
               host_ram_budget='256MiB')
  after = reuse.fingerprint_programs_by_way(tree)
  assert after == {'replica_parallel': 12, 'single_replica': 0, 'streaming': 0}, after
  assert reuse.fingerprint_programs(tree) == 12  # the union still counts the way not taken

  budget = cost.min_budget_bytes(len(tree)) + 4 * MiB
  with pytest.raises(kd_ckpt.BudgetTooSmallError, match='12 programs'):
    kd_ckpt.plan_save(tree, host_ram_budget=budget, fingerprint_programs=12)  # the union
  plan = kd_ckpt.plan_save(tree, host_ram_budget=budget, fingerprint_programs=after)
  # Orbax's single-replica writer cuts these leaves as the streaming one did.
  assert plan.fingerprint_programs == 0 and plan.reserved_bytes == 0, plan
  assert plan.strategy == 'streaming' or not plan.orbax.use_replica_parallel, plan
  r = kd_ckpt.save(tmp_path / 'b', tree, reuse_from=tmp_path / 'a', host_ram_budget=budget)
  assert r.leaves_reused == 12
  assert r.peak_extra_bytes <= budget + TOLERANCE, r
  _assert_same(kd_ckpt.restore(tmp_path / 'b'), tree)
