"""One storage layer (issue 18): checkpoint paths only through etils.epath and TensorStore.

`os`, `open()`, `shutil`, `tempfile` and `pathlib` see `gs://bucket/x` as a
relative local path: a call of theirs on a checkpoint path writes a stray
local folder, or fails on a bucket.  This scans every module of the package
for them.  The exceptions are marked `# local-only:` with their reason (in
`storage.py`: free space and hard links; elsewhere: config files), and the
modules that read /proc, /sys or /dev (never a checkpoint).
"""

import ast
import os
import pathlib

import pytest

from kd_ckpt import storage

PKG = pathlib.Path(storage.__file__).parent
# Modules that touch no checkpoint path: host memory probes (/proc, cgroups)
# and the CLI's stdout redirection (/dev/null).
# writeback.py: fsync and sync_file_range on a local disk, which epath has no
# call for; it refuses a bucket path itself (test_writeback_refuses_a_bucket).
NOT_CHECKPOINT_PATHS = {'hostmem.py', '__main__.py', 'writeback.py'}
# Path-free helpers of `os` (names, strings, the environment).
ALLOWED_OS = {'fspath', 'environ', 'getcwd', 'sep', 'getpid', 'cpu_count', 'sysconf',
              'PathLike', 'devnull', 'dup2', 'O_WRONLY', 'getenv'}
FORBIDDEN_MODULES = {'shutil', 'tempfile', 'pathlib', 'glob'}


def _violations(path: pathlib.Path) -> list[str]:
  source = path.read_text()
  lines = source.splitlines()
  out = []
  for node in ast.walk(ast.parse(source)):
    what = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'open':
      what = 'open()'
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      mod, attr = node.value.id, node.attr
      if mod == 'os' and attr not in ALLOWED_OS and attr != 'path':
        what = f'os.{attr}'
      elif mod in FORBIDDEN_MODULES:
        what = f'{mod}.{attr}'
    elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
          and isinstance(node.value.value, ast.Name) and node.value.value.id == 'os'
          and node.value.attr == 'path'):
      what = f'os.path.{node.attr}'
    if what is None:
      continue
    line = lines[node.lineno - 1]
    previous = lines[node.lineno - 2] if node.lineno > 1 else ''
    if '# local-only:' in (line + previous):
      continue
    out.append(f'{path.relative_to(PKG.parent)}:{node.lineno}: {what}')
  return out


def test_no_local_file_api_on_checkpoint_paths():
  found = []
  for path in sorted(PKG.rglob('*.py')):
    if path.name not in NOT_CHECKPOINT_PATHS:
      found += _violations(path)
  assert not found, 'use etils.epath or kd_ckpt.storage instead:\n' + '\n'.join(found)


def test_the_scan_finds_what_it_forbids(tmp_path):
  bad = tmp_path / 'bad.py'
  bad.write_text('import os, shutil\nopen("x")\nos.walk("d")\nshutil.rmtree("d")\n'
                 'os.path.exists("d")\nos.fspath("ok")\n')
  found = [v.split(': ')[1] for v in _violations_at(bad)]
  assert found == ['open()', 'os.walk', 'shutil.rmtree', 'os.path.exists'], found


def _violations_at(path):
  global PKG  # pylint: disable=global-statement
  saved, PKG = PKG, path.parent.parent
  try:
    return _violations(path)
  finally:
    PKG = saved


@pytest.mark.parametrize('url,ok', [
    ('/tmp/ckpt', True), ('relative/ckpt', True), ('gs://b/ckpt', True),
    ('s3://b/ckpt', False), ('file:///tmp/ckpt', False), ('hf://x/y', False)])
def test_supported_urls(url, ok):
  if ok:
    storage.check_supported(url)
  else:
    with pytest.raises(storage.UnsupportedStorageError, match='Nothing was written'):
      storage.check_supported(url)


def test_kvstore_specs_end_in_a_slash():
  assert storage.kvstore_spec('/tmp/c') == {'driver': 'file', 'path': '/tmp/c/'}
  assert storage.kvstore_spec('gs://b/x/c') == {'driver': 'gcs', 'bucket': 'b', 'path': 'x/c/'}


def test_read_specs_for_a_bucket_lose_their_coalescing_gap():
  """Orbax's bucket spec (OCDBT over gcs) keeps merging reads, with no gap."""
  from kd_ckpt import compat  # pylint: disable=g-import-not-at-top
  spec = compat.orbax.build_kvstore_tspec('gs://b/ckpt', name='w', use_ocdbt=True)
  assert spec[storage.GAP_KEY] > 0, spec  # Orbax's own (1 MB), or this test is moot
  got = storage.without_read_gaps({'driver': 'zarr', 'kvstore': spec})
  assert got['kvstore'][storage.GAP_KEY] == 0
  assert {k: v for k, v in got['kvstore'].items() if k != storage.GAP_KEY} == {
      k: v for k, v in spec.items() if k != storage.GAP_KEY}
  local = compat.orbax.build_kvstore_tspec('/tmp/ckpt', use_ocdbt=True)
  assert storage.without_read_gaps(local) == local


def test_copy_files_hard_links_locally(tmp_path):
  src, dst = tmp_path / 'a', tmp_path / 'b'
  (src / 'd').mkdir(parents=True)
  (src / 'd' / 'f').write_bytes(b'x' * 10)
  (src / 'skip').write_bytes(b'y')
  n = storage.copy_files(src, dst, lambda rel: rel.startswith('d/'))
  assert n == 10 and (dst / 'd' / 'f').stat().st_ino == (src / 'd' / 'f').stat().st_ino
  assert not (dst / 'skip').exists()
  assert sorted(rel for rel, _ in storage.files(src)) == ['d/f', 'skip']
  assert storage.total_bytes(src) == 11


@pytest.mark.parametrize('zarr3', [False, True])
def test_checkpoints_without_ocdbt_restore_when_a_chunk_is_bigger_than_a_piece(tmp_path, zarr3):
  """Without OCDBT each array is a folder; its kvstore needs the trailing slash (issue 19)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  from kd_ckpt import startup  # pylint: disable=g-import-not-at-top
  startup.start_compiler()  # a process that has compiled (the cold case: test_budget.py)
  tree = {'big': jax.device_put(np.arange(4 << 20, dtype=np.float32).reshape(4096, 1024),
                                jax.devices()[0])}
  d = tmp_path / 'c'
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=zarr3)) as c:
    c.save(d, args=ocp.args.PyTreeSave(tree))
  back = kd_ckpt.restore(d, host_ram_budget=40 << 20)  # pieces far below the 16 MiB chunk
  assert np.asarray(back['big']).tobytes() == np.asarray(tree['big']).tobytes()


def test_writeback_refuses_a_bucket():
  from kd_ckpt import writeback  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match='local'):
    writeback.Writeback('gs://b/ckpt')


def test_only_this_targets_unfinished_saves_are_removed(tmp_path):
  """`<name>.orbax-checkpoint-tmp*` siblings of the target go; other steps'
  leftovers and finished checkpoints stay, whatever glob characters the
  name holds (`ckpt[1]` as a pattern would match `ckpt1`)."""
  target = tmp_path / 'ckpt[1]'
  mine = [tmp_path / ('ckpt[1]' + storage.TMP_MARKER + s) for s in ('', '-3')]
  others = [tmp_path / ('ckpt1' + storage.TMP_MARKER + '-3'), tmp_path / 'ckpt[1]_2',
            tmp_path / ('ckpt[1]_2' + storage.TMP_MARKER), tmp_path / 'ckpt[10]']
  for p in mine + others:
    (p / 'd').mkdir(parents=True)
  removed = storage.remove_unfinished(target)
  assert sorted(removed) == sorted(os.fspath(p) for p in mine)
  assert not any(p.exists() for p in mine) and all(p.exists() for p in others)
  assert storage.remove_unfinished(tmp_path / 'missing' / 'ckpt') == []


def test_questions_to_a_bucket_go_out_together():
  """`ask_together`: on a bucket the questions run at once; an error is raised where its answer is read."""
  import time  # pylint: disable=g-import-not-at-top
  asked = []

  def question(answer, secs=0.3):
    def ask():
      asked.append(answer)
      time.sleep(secs)
      if isinstance(answer, Exception):
        raise answer
      return answer
    return ask

  start = time.monotonic()
  one, two, bad = storage.ask_together(
      question(1), question(2), question(FileNotFoundError('gone')), remote=True)
  assert time.monotonic() - start < 0.6  # together, not 0.9 s one after the other
  assert one() == 1 and two() == 2
  with pytest.raises(FileNotFoundError, match='gone'):
    bad()
  # Locally: asked in turn, only when the answer is read.
  asked.clear()
  first, second = storage.ask_together(question('a', 0), question('b', 0), remote=False)
  assert asked == [] and first() == 'a' and asked == ['a'] and second() == 'b'
