"""Command line: plan a Kauldron config's saves, inspect or verify a checkpoint.

  python -m kd_ckpt plan --cfg=configs/gemma_lora.py [--cfg.x=...]
      [--host-ram-budget=16GiB] [--strategy=auto] [--batch-spec=...] [--json]
  python -m kd_ckpt inspect DIR [--json]
  python -m kd_ckpt verify DIR [--host-ram-budget=256MiB] [--json]

`plan` builds the config's train state abstractly (`jax.eval_shape` of the
trainer's `init_state`, without the `init_transform`: nothing is allocated,
no pretrained weights are read) and prints `kd_ckpt.plan_save` of it.  The
`--cfg` flags are parsed by Kauldron's own konfig flag (as in
`python -m kauldron.main`), so `--cfg.__args__.tiny=True` or
`--cfg.checkpointer='py::kd_ckpt.SafeCheckpointer(save_interval_steps=2)'`
work the same.  The budget and strategy default to the config's
`SafeCheckpointer` fields, else to "auto".

`inspect` lists a checkpoint's leaves from Orbax's metadata (no array is
read) and, when present, what kd_ckpt recorded about the save
(`kd_ckpt_report.json`).  DIR may be a PyTree checkpoint, a Kauldron step
(`ckpt_N`, holding `default/`), a Kauldron `checkpoints/` folder or a workdir
(then the latest step).

`verify` re-reads every leaf within the budget and checks it against the
CRC32C recorded when kd_ckpt saved it (`kd_ckpt.verify`): one row per leaf,
ok or CORRUPT/unreadable, naming the bad leaves.

Exit status: 0 success; 1 no strategy fits the budget (`plan`) or a corrupt
leaf (`verify`); 2 bad arguments, config errors, no checkpoint found, or no
checksums to verify against.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import traceback
import typing
from typing import Any

from kd_ckpt import hostmem
from kd_ckpt import plan as plan_lib
from kd_ckpt import report as report_lib

# Modules Kauldron's trainer binary leaves lazy (XManager is not part of it);
# mirrored from `kauldron/main.py` so the same configs load here.
_LAZY_IMPORTED_MODULES = ('kauldron.xm', 'kauldron.kxm', 'xmanager')

# The model-derived batch: abstract dtypes of Kauldron's array annotations
# (`Int['*B L']`, `Float[...]`) made concrete, as a data pipeline would.
_ABSTRACT_DTYPES = (
    ('bool', 'bool'),
    ('integer', 'int32'),
    ('signedinteger', 'int32'),
    ('unsignedinteger', 'uint8'),
    ('floating', 'float32'),
    ('complexfloating', 'complex64'),
    ('number', 'float32'),
)

# Kauldron's `ckpt_<N>`, or a bare `<N>` (one kd_ckpt.save per step).
_STEP_DIR_RE = re.compile(r'^(?:ckpt_)?(\d+)$')


_BATCH_SOURCES = {
    'model': "the model's input annotations",
    'data': 'train_ds.element_spec, TFDS mocked',
    'flag': '--batch-spec',
}


class CliError(Exception):
  """An error reported as one message, without a traceback (exit 2)."""

  exit_code = 2


class ConfigError(CliError):
  """The config could not be loaded, resolved or shape-evaluated."""


# ---------------------------------------------------------------------------
# Argument parsing.


def _split_cfg_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Separates konfig flags (`--cfg`, `--cfg.x=...`) from kd_ckpt's own."""
  cfg_args, rest = [], []
  i = 0
  while i < len(argv):
    arg = argv[i]
    if arg == '--cfg' or arg.startswith(('--cfg=', '--cfg.')):
      cfg_args.append(arg)
      takes_value = '=' not in arg
      if takes_value and i + 1 < len(argv) and not argv[i + 1].startswith('--'):
        cfg_args.append(argv[i + 1])
        i += 1
    else:
      rest.append(arg)
    i += 1
  return cfg_args, rest


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m kd_ckpt',
      description=(
          'kd_ckpt: JAX/Orbax checkpoints that stay inside a host-RAM budget.'
      ),
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split('\n\n', 1)[1],
  )
  sub = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')

  plan = sub.add_parser(
      'plan',
      help='plan the saves of a Kauldron config (nothing allocated)',
      description=(
          'Plan the saves of a Kauldron config: --cfg=CONFIG.py plus any'
          ' --cfg.x=... overrides, parsed as by `python -m kauldron.main`.'
      ),
  )
  plan.add_argument(
      '--host-ram-budget',
      default=None,
      help=(
          'extra host RAM a save may add: "auto", bytes, "16GiB", or a'
          " fraction in (0, 1] (default: the config's SafeCheckpointer"
          ' value, else "auto")'
      ),
  )
  plan.add_argument(
      '--strategy',
      default=None,
      help=(
          '"auto", "orbax" or "streaming" (default: the config\'s'
          ' SafeCheckpointer value, else "auto")'
      ),
  )
  plan.add_argument(
      '--batch-spec',
      action='append',
      default=None,
      metavar='SPEC',
      help=(
          'the batch the state is initialised from: "model" (default: from'
          " the model's annotated inputs, e.g. Int['*B L'], named dims set to"
          ' 1; right whenever parameter shapes do not depend on input sizes),'
          ' "data" (train_ds.element_spec with TFDS mocked; may fetch assets'
          ' such as tokenizers), or KEY=DTYPE[D0,D1,...], repeatable, e.g.'
          ' --batch-spec=input=int32[16,512]'
      ),
  )
  plan.add_argument(
      '--platform',
      choices=('cpu', 'gpu', 'tpu'),
      default=None,
      help=(
          'plan for this accelerator rather than the local JAX backend (e.g.'
          ' plan a GPU job on a CPU machine: device->host copies are free'
          ' only on CPU); pair it with an explicit --host-ram-budget'
      ),
  )
  plan.add_argument(
      '--num-devices',
      type=int,
      default=None,
      help=(
          'shape-evaluate with N local devices (fake CPU devices, as the'
          ' tests do) to see shardings as on an N-accelerator host'
      ),
  )
  plan.add_argument('--json', action='store_true', help='print JSON')
  plan.add_argument(
      '--debug', action='store_true', help='show tracebacks of config errors'
  )

  inspect = sub.add_parser(
      'inspect',
      help="list a checkpoint's leaves and how kd_ckpt saved it",
      description=(
          "List a checkpoint's leaves (from Orbax metadata) and the"
          ' kd_ckpt report, if any.  DIR: a PyTree checkpoint, a Kauldron'
          ' step (ckpt_N), a checkpoints/ folder or a workdir (latest step).'
      ),
  )
  inspect.add_argument('directory', metavar='DIR')
  inspect.add_argument('--json', action='store_true', help='print JSON')

  verify = sub.add_parser(
      'verify',
      help="re-read a checkpoint and check each leaf's CRC32C",
      description=(
          'Re-read every leaf within the budget and compare it with the'
          ' CRC32C kd_ckpt recorded at save time.  DIR as for inspect.'
      ),
  )
  verify.add_argument('directory', metavar='DIR')
  verify.add_argument('--host-ram-budget', default='auto',
                      help='extra host RAM the re-read may use (default "auto")')
  verify.add_argument('--json', action='store_true', help='print JSON')
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of `python -m kd_ckpt`; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  cfg_args, rest = _split_cfg_args(argv)
  args = _parser().parse_args(rest)
  try:
    if args.command == 'plan':
      return _plan(args, cfg_args)
    if cfg_args:
      raise CliError(f'{args.command} takes no --cfg flags, got {cfg_args}.')
    if args.command == 'verify':
      return _verify(args)
    return _inspect(args)
  except CliError as e:
    print(f'kd_ckpt {args.command}: {e}', file=sys.stderr)
    return e.exit_code


# ---------------------------------------------------------------------------
# plan


def _plan(args: argparse.Namespace, cfg_args: list[str]) -> int:
  if not any(a == '--cfg' or a.startswith('--cfg=') for a in cfg_args):
    raise CliError(
        'plan needs a config: --cfg=path/to/config.py (plus optional'
        ' --cfg.x=... overrides, as for `python -m kauldron.main`).'
    )
  import jax  # pylint: disable=g-import-not-at-top

  import kd_ckpt  # pylint: disable=g-import-not-at-top

  # Bad flags fail now, not after the config's imports.
  try:
    if args.host_ram_budget is not None:
      kd_ckpt.parse_budget(args.host_ram_budget)
    if args.strategy is not None:
      plan_lib.check_strategy(args.strategy)
  except ValueError as e:
    raise CliError(str(e)) from e
  if args.num_devices is not None:
    _fake_cpu_devices(args.num_devices)

  with tempfile.TemporaryDirectory(prefix='kd_ckpt_plan_') as tmp_workdir:
    with _config_errors(args.debug, 'loading the config'):
      cfg = _load_config(cfg_args)
      if not cfg.get('workdir'):
        # The Trainer needs one; nothing is written there.
        cfg.workdir = tmp_workdir
    with _config_errors(args.debug, 'resolving the config'):
      from kauldron import kd  # pylint: disable=g-import-not-at-top

      trainer = kd.konfig.resolve(cfg)
    with _config_errors(args.debug, 'building the batch spec'):
      elem_spec, batch_source = _batch_spec(trainer, args.batch_spec)
    with _config_errors(args.debug, 'shape-evaluating the train state'):
      state = abstract_train_state(trainer, elem_spec)

  ckpt = getattr(trainer, 'checkpointer', None)
  budget = args.host_ram_budget
  if budget is None:
    budget = getattr(ckpt, 'host_ram_budget', 'auto')
  strategy = args.strategy
  if strategy is None:
    strategy = getattr(ckpt, 'strategy', 'auto')
  try:
    plan = kd_ckpt.plan_save(
        state, host_ram_budget=budget, strategy=strategy,
        platform=args.platform,
    )
  except kd_ckpt.BudgetTooSmallError as e:
    print(f'kd_ckpt plan: {e}', file=sys.stderr)
    return 1
  except ValueError as e:  # bad budget or strategy
    raise CliError(str(e)) from e

  batch = {
      k: f'{jax.numpy.dtype(v.dtype).name}{list(v.shape)}'
      for k, v in _flatten_spec(elem_spec).items()
  }
  if args.json:
    out = plan.to_json_dict()
    out['source'] = {
        'config': _config_path(cfg_args),
        'checkpointer': type(ckpt).__name__ if ckpt is not None else None,
        'batch_spec': batch,
        'batch_spec_from': batch_source,
        'num_devices': jax.device_count(),
        'backend': jax.default_backend(),
    }
    print(json.dumps(out, indent=2))
  else:
    print(f'config        {_config_path(cfg_args)}')
    print(f'checkpointer  {type(ckpt).__name__ if ckpt is not None else None}')
    print(
        'batch         '
        + ', '.join(f'{k}={v}' for k, v in batch.items())
        + f'  (from {_BATCH_SOURCES[batch_source]})'
    )
    print(
        f'devices       {jax.device_count()} ({jax.default_backend()});'
        f' planned for {plan.platform}'
    )
    print()
    print(plan)
  return 0


def _fake_cpu_devices(num_devices: int) -> None:
  """Asks XLA for `num_devices` CPU devices; only before JAX starts."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  if num_devices < 1:
    raise CliError(f'--num-devices={num_devices}: needs at least 1.')
  if xla_bridge.backends_are_initialized():
    if jax.device_count() != num_devices:
      raise CliError(
          f'--num-devices={num_devices}: JAX already runs with'
          f' {jax.device_count()} devices in this process; set XLA_FLAGS='
          f'--xla_force_host_platform_device_count={num_devices} instead.'
      )
    return
  flags = [
      f for f in os.environ.get('XLA_FLAGS', '').split()
      if not f.startswith('--xla_force_host_platform_device_count')
  ]
  flags.append(f'--xla_force_host_platform_device_count={num_devices}')
  os.environ['XLA_FLAGS'] = ' '.join(flags)
  jax.config.update('jax_platforms', 'cpu')


@contextlib.contextmanager
def _config_errors(debug: bool, what: str) -> Iterator[None]:
  """Turns any error in the user's config into a clean ConfigError."""
  try:
    yield
  except (CliError, KeyboardInterrupt):
    raise
  except BaseException as e:  # pylint: disable=broad-exception-caught
    if isinstance(e, SystemExit) and not e.code:
      raise
    if debug:
      traceback.print_exc()
    msg = str(e).strip() or repr(e)
    raise ConfigError(
        f'config error while {what}: {type(e).__name__}: {msg}\n'
        '(--debug shows the traceback)'
    ) from e


def _config_path(cfg_args: Sequence[str]) -> str | None:
  for i, a in enumerate(cfg_args):
    if a.startswith('--cfg='):
      return a.split('=', 1)[1]
    if a == '--cfg' and i + 1 < len(cfg_args):
      return cfg_args[i + 1]
  return None


def _load_config(cfg_args: Sequence[str]):
  """Parses `--cfg` flags exactly as `python -m kauldron.main` does."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  path = _config_path(cfg_args)
  if path is not None and ':' not in path and not os.path.exists(path):
    raise ConfigError(f'config file not found: {path!r}')
  flag_values = flags.FlagValues()
  holder = kd.konfig.DEFINE_config_file(
      'cfg',
      None,
      'Training configuration.',
      flag_values=flag_values,
      lock_config=False,
  )
  argv = ['kd_ckpt'] + list(cfg_args)
  # ml_collections finds the `--cfg.x` overrides in `sys.argv` unless told
  # otherwise; here they are `cfg_args` (main() may be called in-process).
  flag_values['cfg']._sys_argv = argv  # pylint: disable=protected-access
  with kd.konfig.set_lazy_imported_modules(
      lazy_import=list(_LAZY_IMPORTED_MODULES)
  ):
    flag_values(argv)
  return holder.value


def abstract_train_state(trainer: Any, elem_spec: Any) -> Any:
  """The trainer's state as `jax.ShapeDtypeStruct`s with shardings.

  `jax.eval_shape` of `trainer.init_state(skip_transforms=True)`: the
  `init_transform` (e.g. loading pretrained weights) is skipped, as in
  `Trainer.state_specs`.  Unlike `state_specs`, nothing is compiled (XLA
  would take minutes for a 4B model on CPU): shardings come from the
  config's `trainer.sharding.state`, and leaves it leaves to XLA
  (e.g. the optimizer state) are taken as replicated.

  Args:
    trainer: a resolved `kd.train.Trainer`.
    elem_spec: the batch spec the model is initialised from.

  Returns:
    The abstract `TrainState`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  init_fn = functools.partial(
      trainer.init_state, skip_transforms=True, element_spec=elem_spec
  )
  state = jax.eval_shape(init_fn)
  state = kd.sharding.with_sharding_constraint(state, trainer.sharding.state)
  replicated = kd.sharding.REPLICATED

  def _fill(x):
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
      return jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=replicated, weak_type=x.weak_type
      )
    return x

  return jax.tree.map(_fill, state)


# The batch spec.


def _batch_spec(trainer: Any, specs: Sequence[str] | None) -> tuple[Any, str]:
  """The element spec to initialise the model from, and where it came from."""
  specs = list(specs or ['model'])
  if specs == ['model']:
    return _batch_spec_from_model(trainer), 'model'
  if specs == ['data']:
    return _batch_spec_from_data(trainer), 'data'
  return _parse_batch_specs(specs), 'flag'


def _parse_batch_specs(specs: Sequence[str]) -> dict[str, Any]:
  from etils import enp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  out = {}
  for spec in specs:
    m = re.fullmatch(r'\s*([\w./]+)\s*=\s*(\w+)\s*\[([\d,\s]*)\]\s*', spec)
    if not m:
      raise CliError(
          f'bad --batch-spec {spec!r}: use "model", "data" or'
          ' KEY=DTYPE[D0,D1,...] (e.g. input=int32[16,512]), repeatable.'
      )
    key, dtype, dims = m.groups()
    try:
      dtype = np.dtype(dtype)
    except TypeError as e:
      raise CliError(f'bad dtype {dtype!r} in --batch-spec {spec!r}') from e
    shape = tuple(int(d) for d in dims.split(',') if d.strip())
    key = key.removeprefix('batch.')
    _set_nested(out, key.split('.'), enp.ArraySpec(shape=shape, dtype=dtype))
  return out


def _set_nested(tree: dict[str, Any], keys: list[str], value: Any) -> None:
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def _batch_spec_from_data(trainer: Any) -> Any:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  ds = trainer.train_ds
  batch_size = getattr(ds, 'batch_size', None) or 1
  # As `kauldron data element_spec` does: TFDS sources yield fake examples.
  with tfds.testing.mock_data(num_examples=batch_size):
    return ds.element_spec


def _batch_spec_from_model(trainer: Any) -> dict[str, Any]:
  """A batch holding only what the model reads, from its input annotations."""
  from etils import enp  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from kauldron import kontext  # pylint: disable=g-import-not-at-top

  model = trainer.model
  try:
    keypaths = kontext.get_keypaths(model)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ConfigError(
        f'cannot tell which batch keys {type(model).__name__} reads ({e});'
        ' pass --batch-spec=data or --batch-spec=KEY=DTYPE[D0,...].'
    ) from e
  batch_size = getattr(trainer.train_ds, 'batch_size', None)
  if not isinstance(batch_size, int) or batch_size <= 0:
    batch_size = jax.device_count()

  out = {}
  for arg, path in keypaths.items():
    if not isinstance(path, str) or not path.startswith('batch.'):
      continue  # optional input left unset, or read from elsewhere
    annotation = _input_annotation(model, arg)
    if annotation is None:
      raise ConfigError(
          f'{type(model).__name__} reads {path!r} (argument {arg!r}) without'
          ' an array annotation such as Int["*B L"], so its shape is'
          ' unknown: pass --batch-spec=data or'
          f' --batch-spec={path.removeprefix("batch.")}=DTYPE[D0,D1,...].'
      )
    dtype, shape = annotation
    shape = tuple(batch_size if d is None else d for d in shape)
    _set_nested(
        out,
        path.removeprefix('batch.').split('.'),
        enp.ArraySpec(shape=shape, dtype=dtype),
    )
  if not out:
    raise ConfigError(
        f'{type(model).__name__} reads nothing from the batch as far as'
        ' kontext tells: pass --batch-spec=data or'
        ' --batch-spec=KEY=DTYPE[D0,D1,...].'
    )
  return out


def _input_annotation(model: Any, arg: str):
  """(dtype, shape with None for the batch) of `model.__call__`'s `arg`.

  Wrappers such as `gm.nn.LoRA` forward `*args, **kwargs`: follow their
  `.model` down to the module that annotates the argument.
  """
  seen = set()
  while model is not None and id(model) not in seen:
    seen.add(id(model))
    try:
      hints = typing.get_type_hints(type(model).__call__)
    except Exception:  # pylint: disable=broad-exception-caught
      hints = {}
    if arg in hints:
      return _array_annotation(hints[arg])
    model = getattr(model, 'model', None)
  return None


def _array_annotation(annotation: Any):
  """Kauldron array type (`Int['*B L']`, possibly `| None`) to dtype, shape."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  candidates = typing.get_args(annotation) or (annotation,)
  for a in candidates:
    shape_spec = getattr(a, 'shape_spec', None)
    dtype = getattr(a, 'dtype', None)
    if shape_spec is None or dtype is None:
      continue
    dtype = _concrete_dtype(dtype, np)
    if dtype is None:
      continue
    shape = []
    batch_done = False
    for dim in str(shape_spec).split():
      if dim.startswith(('*', '...')):
        # The leading variadic dims are the batch: one of batch size.
        if not batch_done:
          shape.append(None)
          batch_done = True
      elif dim.isdigit():
        shape.append(int(dim))
      else:
        # A named dim (sequence length, height, ...): 1 is the smallest valid
        # size, and parameter shapes rarely depend on it.
        shape.append(1)
    return dtype, tuple(shape)
  return None


def _concrete_dtype(dtype: Any, np: Any):
  """A concrete numpy dtype for a Kauldron ktyping dtype (or None)."""
  subtypes = getattr(dtype, 'subtypes', None)
  if subtypes:  # CompoundDType (`bool_ | integer`): take the first
    dtype = subtypes[0]
  dtype = getattr(dtype, 'dtype', dtype)  # NpDType / JaxDType wrap it
  if isinstance(dtype, str):  # JaxDType: e.g. 'bfloat16'
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    dtype = getattr(jnp, dtype, None)
  if dtype is None:
    return None
  if isinstance(dtype, type) and issubclass(dtype, np.generic):
    if dtype is np.bool_:
      return np.dtype(bool)
    for abstract, concrete in _ABSTRACT_DTYPES:
      if dtype is getattr(np, abstract, None):
        return np.dtype(concrete)
  try:
    return np.dtype(dtype)
  except TypeError:
    return None


def _flatten_spec(spec: Any) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top

  flat = jax.tree_util.tree_flatten_with_path(spec)[0]
  return {
      jax.tree_util.keystr(path, simple=True, separator='.'): leaf
      for path, leaf in flat
  }


# ---------------------------------------------------------------------------
# inspect


@dataclasses.dataclass(frozen=True)
class Leaf:
  path: str
  shape: tuple[int, ...] | None
  dtype: str | None
  bytes: int | None


def find_checkpoint(directory: str | os.PathLike[str]) -> tuple[pathlib.Path, pathlib.Path | None]:
  """(PyTree checkpoint dir, Kauldron step dir or None) for `directory`.

  Accepts a PyTree checkpoint (has `_METADATA`), a Kauldron step `ckpt_N`
  (has `default/`), a `checkpoints/` folder or a workdir (latest step).

  Raises:
    CliError: nothing recognisable at `directory`.
  """
  path = pathlib.Path(directory)
  if not path.is_dir():
    raise CliError(f'no such directory: {os.fspath(directory)!r}')
  if (path / '_METADATA').is_file():
    if _is_step_dir(path.parent):
      return path, path.parent
    return path, (path if _STEP_DIR_RE.match(path.name) else None)
  if _is_step_dir(path):
    return path / 'default', path
  if (path / 'checkpoints').is_dir():
    path = path / 'checkpoints'
  # Finished steps only: Orbax renames `<name>.orbax-checkpoint-tmp*` at the end.
  steps = sorted(
      (int(m.group(1)), p)
      for p in path.iterdir()
      if (m := _STEP_DIR_RE.match(p.name))
      and (_is_step_dir(p) or (p / '_METADATA').is_file())
  )
  if steps:
    step_dir = steps[-1][1]
    if _is_step_dir(step_dir):
      return step_dir / 'default', step_dir
    return step_dir, step_dir
  raise CliError(
      f'no checkpoint in {os.fspath(directory)!r}: expected a PyTree'
      ' checkpoint (with _METADATA), a Kauldron step (ckpt_N/default/), a'
      ' checkpoints/ folder, a workdir holding ckpt_N steps, or a folder of'
      ' step-numbered checkpoints (e.g. kd_ckpt.save(f"{root}/{step}", ...)).'
  )


def _is_step_dir(path: pathlib.Path) -> bool:
  return (path / 'default' / '_METADATA').is_file()


def read_leaves(item_dir: pathlib.Path) -> list[Leaf]:
  """The leaves of a PyTree checkpoint, from Orbax's metadata only."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  try:
    metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(item_dir))
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise CliError(
        f'cannot read the Orbax metadata of {os.fspath(item_dir)!r}:'
        f' {type(e).__name__}: {e}'
    ) from e
  tree = getattr(metadata, 'tree', metadata)
  leaves = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, 'shape', None)
    dtype = getattr(leaf, 'dtype', None)
    shape = tuple(int(d) for d in shape) if shape is not None else None
    nbytes = None
    if dtype is not None:
      dtype = np.dtype(dtype)
      if shape is not None:
        nbytes = math.prod(shape) * dtype.itemsize
      dtype = dtype.name
    leaves.append(Leaf(
        path=jax.tree_util.keystr(path, simple=True, separator='.'),
        shape=shape,
        dtype=dtype,
        bytes=nbytes,
    ))
  return leaves


def read_report(item_dir: pathlib.Path, step_dir: pathlib.Path | None) -> dict[str, Any] | None:
  """kd_ckpt's report of this save: in the checkpoint or its Kauldron step."""
  for d in (item_dir, step_dir):
    if d is not None and (d / report_lib.REPORT_FILE_NAME).is_file():
      try:
        return json.loads((d / report_lib.REPORT_FILE_NAME).read_text())
      except (OSError, ValueError) as e:
        raise CliError(f'unreadable {d / report_lib.REPORT_FILE_NAME}: {e}') from e
  return None


def _disk_bytes(directory: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in directory.rglob('*') if p.is_file())


def inspect_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any]:
  """What `python -m kd_ckpt inspect DIR --json` prints, as a dict."""
  item_dir, step_dir = find_checkpoint(directory)
  leaves = read_leaves(item_dir)
  report = read_report(item_dir, step_dir)
  m = _STEP_DIR_RE.match(step_dir.name) if step_dir is not None else None
  step = int(m.group(1)) if m else None
  return {
      'directory': os.fspath(item_dir),
      'step_directory': os.fspath(step_dir) if step_dir is not None else None,
      'step': step,
      'num_leaves': len(leaves),
      'total_bytes': sum(l.bytes or 0 for l in leaves),
      'disk_bytes': _disk_bytes(item_dir),
      'leaves': [
          {
              'path': l.path,
              'shape': list(l.shape) if l.shape is not None else None,
              'dtype': l.dtype,
              'bytes': l.bytes,
          }
          for l in leaves
      ],
      'saved_by': 'kd_ckpt' if report is not None else 'orbax',
      'report': report,
  }


def _verify(args: argparse.Namespace) -> int:
  from kd_ckpt import verifying as verify_lib  # pylint: disable=g-import-not-at-top

  item_dir, _ = find_checkpoint(args.directory)
  try:
    report = verify_lib.verify(item_dir, host_ram_budget=args.host_ram_budget)
  except (verify_lib.NoChecksumsError, ValueError) as e:
    raise CliError(str(e)) from e
  print(json.dumps(report.to_json_dict(), indent=2) if args.json else report)
  return 0 if report.ok else 1


def _inspect(args: argparse.Namespace) -> int:
  info = inspect_checkpoint(args.directory)
  if args.json:
    print(json.dumps(info, indent=2))
    return 0
  print(_format_inspect(info))
  return 0


def _format_inspect(info: dict[str, Any]) -> str:
  lines = [f'checkpoint  {info["directory"]}']
  if info['step'] is not None:
    lines.append(f'step        {info["step"]}')
  lines.append(
      f'leaves      {info["num_leaves"]}, {hostmem.format_bytes(info["total_bytes"])}'
      f' ({hostmem.format_bytes(info["disk_bytes"])} on disk)'
  )
  report = info['report']
  if report is None:
    lines.append('saved by    Orbax (no kd_ckpt report)')
  else:
    lines.append(
        f'saved by    kd_ckpt, strategy {report.get("strategy")}'
        f' ({report.get("settings")})'
    )
    for key, label in (
        ('budget_bytes', 'budget'),
        ('predicted_peak_bytes', 'predicted peak extra RSS'),
        ('peak_extra_bytes', 'measured peak extra RSS'),
        ('retained_bytes', 'RSS retained after save'),
        ('bytes_written', 'bytes written'),
    ):
      if isinstance(report.get(key), (int, float)):
        lines.append(f'  {label:<26}{hostmem.format_bytes(report[key])}')
    if isinstance(report.get('seconds'), (int, float)):
      lines.append(
          f'  {"seconds":<26}{report["seconds"]:.2f}'
          + (f' ({report["gb_per_sec"]:.2f} GB/s)'
             if isinstance(report.get('gb_per_sec'), (int, float)) else '')
      )
  lines.append('')
  rows = [('path', 'shape', 'dtype', 'bytes')]
  for leaf in info['leaves']:
    rows.append((
        leaf['path'],
        'n/a' if leaf['shape'] is None else str(tuple(leaf['shape'])),
        leaf['dtype'] or 'n/a',
        'n/a' if leaf['bytes'] is None else hostmem.format_bytes(leaf['bytes']),
    ))
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  for r in rows:
    lines.append(
        f'{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}'
        f'  {r[3]:>{widths[3]}}'
    )
  return '\n'.join(lines)
