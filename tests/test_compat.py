"""The compat wall: every internal checked loudly, and Kauldron optional (issue 12)."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

from kd_ckpt import compat

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / 'kd_ckpt'


def test_every_internal_is_found_in_the_installed_versions():
  versions = compat.check_all()
  lo, hi = compat.SUPPORTED_ORBAX
  installed = compat.version_tuple(versions['orbax-checkpoint'])
  assert compat.version_tuple(lo) <= installed < compat.version_tuple(hi), versions


def test_pyproject_declares_the_supported_orbax_range():
  text = (pathlib.Path(__file__).resolve().parents[1] / 'pyproject.toml').read_text()
  lo, hi = compat.SUPPORTED_ORBAX
  assert f'"orbax-checkpoint>={lo},<{hi}"' in text


def test_a_missing_internal_fails_loudly_naming_version_and_symbol():
  with pytest.raises(compat.IncompatibleVersionError) as e:
    compat._need('orbax-checkpoint', 'orbax.checkpoint._src.serialization.replica_slices',  # pylint: disable=protected-access
                 'no_such_function')
  msg = str(e.value)
  assert 'no_such_function' in msg and compat.version('orbax-checkpoint') in msg
  assert 'pip install "orbax-checkpoint==' in msg
  with pytest.raises(compat.IncompatibleVersionError, match=r"no parameter\(s\) \['nope'\]"):
    compat._need('orbax-checkpoint', 'orbax.checkpoint._src.serialization.replica_slices',  # pylint: disable=protected-access
                 'transfer_arrays_to_host', ('arrays', 'nope'))


def test_patches_of_orbax_functions_reach_kd_ckpt(monkeypatch):
  """compat calls Orbax's functions as they are at call time."""
  from orbax.checkpoint._src.serialization import replica_slices  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(replica_slices, 'get_replica_slices',
                      lambda *a, **k: calls.append(a) or 'patched')
  assert compat.orbax.get_replica_slices(1, 0, True) == 'patched' and calls


def _imports(path: pathlib.Path) -> set[str]:
  tree = ast.parse(path.read_text())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      out.add(node.module)
  return out


def test_only_compat_imports_internals():
  """One module touches `_src` / private packages; Kauldron only under kd_ckpt/kauldron."""
  for path in PKG.rglob('*.py'):
    rel = path.relative_to(REPO).as_posix()
    for mod in _imports(path):
      if '._src' in mod or mod.startswith('jax._src'):
        assert rel == 'kd_ckpt/compat.py', (rel, mod)
      if mod.split('.')[0] == 'kauldron':
        assert rel.startswith('kd_ckpt/kauldron/'), (rel, mod)
    text = path.read_text()
    if rel != 'kd_ckpt/compat.py':
      assert '_src.' not in text.replace('# pylint', ''), rel


def test_import_and_save_without_kauldron(tmp_path):
  """A plain Orbax user's machine: no Kauldron, no gemma."""
  block = tmp_path / 'block'
  block.mkdir()
  (block / 'sitecustomize.py').write_text(
      'import importlib.abc, sys\n'
      'class _Block(importlib.abc.MetaPathFinder):\n'
      '  def find_spec(self, name, path=None, target=None):\n'
      "    if name.split('.')[0] in ('kauldron', 'gemma'):\n"
      "      raise ModuleNotFoundError(f'No module named {name!r} (blocked)', name=name)\n"
      'sys.meta_path.insert(0, _Block())\n')
  script = (
      'import sys, jax.numpy as jnp, kd_ckpt\n'
      "assert 'kauldron' not in sys.modules\n"
      "r = kd_ckpt.save(sys.argv[1], {'w': jnp.ones((64, 64))}, host_ram_budget='64MiB')\n"
      "back = kd_ckpt.restore(sys.argv[1])\n"
      "assert float(back['w'].sum()) == 64 * 64\n"
      "assert 'kauldron' not in sys.modules\n"
      'try:\n'
      '  kd_ckpt.SafeCheckpointer\n'
      'except ImportError as e:\n'
      "  assert 'kd_ckpt[kauldron]' in str(e), e\n"
      "  print('OK without kauldron')\n")
  env = dict(os.environ, PYTHONPATH=f'{block}{os.pathsep}{REPO}', JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-c', script, str(tmp_path / 'c')],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0 and 'OK without kauldron' in proc.stdout, proc.stderr[-3000:]


def test_array_handler_options_read_every_option_of_the_installed_orbax():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from kd_ckpt import compat as compat_lib  # pylint: disable=g-import-not-at-top
  h = ocp.type_handlers.ArrayHandler(primary_host=0, replica_id=0, use_replica_parallel=False)
  o = compat_lib.array_handler_options(h)
  assert o.primary_host == 0 and o.replica_id == 0 and o.use_replica_parallel is False
  assert set(vars(o)) == set(compat_lib._ARRAY_HANDLER_ATTRS)  # pylint: disable=protected-access
  with pytest.raises(compat_lib.IncompatibleVersionError, match='_replica_id'):
    compat_lib.array_handler_options(object())
  # A NumpyHandler keeps only some of them: those read one at a time.
  n = ocp.type_handlers.NumpyHandler()
  assert compat_lib.handler_option(n, 'metadata_key') == n._metadata_key  # pylint: disable=protected-access
  with pytest.raises(compat_lib.IncompatibleVersionError, match='NumpyHandler._replica_id'):
    compat_lib.handler_option(n, 'replica_id')


def test_private_names_of_orbax_and_jax_are_used_in_compat_only():
  """Attribute access, not only imports (issue 19): `x._name` on anything but self/cls."""
  import ast  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import kd_ckpt  # pylint: disable=g-import-not-at-top
  pkg = pathlib.Path(kd_ckpt.__file__).parent
  # kd_ckpt's own private names (module helpers, its own classes' state).
  own = {'_options', '_kd', '_ckpt_mgr', '_handler', '_bounds', '_read', '_strip_protocol',
         '_started', '_ARRAY_HANDLER_ATTRS'}
  found = []
  for path in sorted(pkg.rglob('*.py')):
    if path.name == 'compat.py':
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr.startswith('_')
          and not node.attr.startswith('__') and node.attr not in own):
        base = node.value
        if isinstance(base, ast.Name) and base.id in ('self', 'cls'):
          continue
        if isinstance(base, ast.Name) and base.id.endswith('_lib'):
          continue  # kd_ckpt's own modules
        if isinstance(base, ast.Call) and getattr(base.func, 'id', '') == 'super':
          continue
        found.append(f'{path.relative_to(pkg)}:{node.lineno}: .{node.attr}')
  assert not found, found


def test_byte_limit_reads_orbax_byte_limiters():
  """Orbax's default byte limiters (96 GB) are read, so reads can skip them."""
  from orbax.checkpoint._src.serialization import limits  # pylint: disable=g-import-not-at-top
  assert compat.byte_limit(None) is None
  assert compat.byte_limit(limits.get_byte_limiter(None)) is None
  assert compat.byte_limit(limits.get_byte_limiter(96 * 10**9)) == 96 * 10**9
  assert compat.byte_limit(limits.get_byte_limiter(12345)) == 12345
  assert compat.byte_limit(object()) == 1  # unknown: always honoured
