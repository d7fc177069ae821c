"""Kauldron configs without training: load one as `kauldron.main` does, and plan its saves.

`python -m kd_ckpt plan --cfg=...` uses this to build a config's train state
abstractly (`jax.eval_shape` of the trainer's `init_state`, without the
`init_transform`: nothing is allocated, no pretrained weights are read) and
plan its saves.

Example:

  result = config.plan_config(['--cfg=configs/gemma_lora.py'],
                              host_ram_budget='16GiB')
  print(result.plan)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import dataclasses
import functools
import os
import re
import tempfile
import traceback
import typing
from typing import Any

from kd_ckpt import compat
from kd_ckpt import plan as plan_lib


class ConfigError(Exception):
  """The config could not be loaded, resolved or shape-evaluated."""


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

_BATCH_SOURCES = {
    'model': "the model's input annotations",
    'data': 'train_ds.element_spec, TFDS mocked',
    'flag': '--batch-spec',
}




@contextlib.contextmanager
def config_errors(what: str, *, debug: bool = False) -> Iterator[None]:
  """Turns any error in the user's config into one ConfigError naming the stage."""
  try:
    yield
  except (ConfigError, KeyboardInterrupt):
    raise
  except BaseException as e:  # pylint: disable=broad-exception-caught
    if isinstance(e, SystemExit) and not e.code:
      raise
    if debug:
      traceback.print_exc()
    msg = str(e).strip() or repr(e)
    raise ConfigError(
        f'config error while {what}: {type(e).__name__}: {msg}\n'
        '(--debug shows the traceback)') from e


def config_path(cfg_args: Sequence[str]) -> str | None:
  for i, a in enumerate(cfg_args):
    if a.startswith('--cfg='):
      return a.split('=', 1)[1]
    if a == '--cfg' and i + 1 < len(cfg_args):
      return cfg_args[i + 1]
  return None


def load_config(cfg_args: Sequence[str]):
  """Parses `--cfg` flags exactly as `python -m kauldron.main` does."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from kauldron import kd  # pylint: disable=g-import-not-at-top

  path = config_path(cfg_args)
  # local-only: a config file path (a Python file to import), never a checkpoint.
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
  compat.set_flag_argv(flag_values['cfg'], argv)
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
      raise ConfigError(
          f'bad --batch-spec {spec!r}: use "model", "data" or'
          ' KEY=DTYPE[D0,D1,...] (e.g. input=int32[16,512]), repeatable.'
      )
    key, dtype, dims = m.groups()
    try:
      dtype = np.dtype(dtype)
    except TypeError as e:
      raise ConfigError(f'bad dtype {dtype!r} in --batch-spec {spec!r}') from e
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


def flatten_spec(spec: Any) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top

  flat = jax.tree_util.tree_flatten_with_path(spec)[0]
  return {
      jax.tree_util.keystr(path, simple=True, separator='.'): leaf
      for path, leaf in flat
  }


@dataclasses.dataclass(frozen=True)
class ConfigPlan:
  """`plan_config`'s result: the plan and where its inputs came from."""

  plan: plan_lib.SavePlan
  config: str | None
  checkpointer: str | None
  batch: dict[str, str]
  batch_source: str

  @property
  def batch_source_text(self) -> str:
    return _BATCH_SOURCES[self.batch_source]


def plan_config(
    cfg_args: Sequence[str], *, host_ram_budget: Any = None, strategy: str | None = None,
    batch_spec: Sequence[str] | None = None, platform: str | None = None,
    debug: bool = False) -> ConfigPlan:
  """Plans the saves of a Kauldron config (nothing allocated).

  Args:
    cfg_args: `--cfg=...` and `--cfg.x=...` flags, as for `kauldron.main`.
    host_ram_budget: default: the config's SafeCheckpointer value, else "auto".
    strategy: default: the config's SafeCheckpointer value, else "auto".
    batch_spec: "model", "data" or KEY=DTYPE[D0,...] entries.
    platform: plan as if on this backend ('cpu', 'gpu', 'tpu').
    debug: print tracebacks of config errors.

  Raises:
    ConfigError: the config could not be loaded, resolved or evaluated.
    BudgetTooSmallError: no strategy fits the budget.
  """
  import jax  # pylint: disable=g-import-not-at-top

  # local-only: a scratch workdir the Trainer needs to exist; nothing is written to it.
  with tempfile.TemporaryDirectory(prefix='kd_ckpt_plan_') as tmp_workdir:
    with config_errors('loading the config', debug=debug):
      cfg = load_config(cfg_args)
      if not cfg.get('workdir'):
        cfg.workdir = tmp_workdir  # The Trainer needs one; nothing is written.
    with config_errors('resolving the config', debug=debug):
      from kauldron import kd  # pylint: disable=g-import-not-at-top

      trainer = kd.konfig.resolve(cfg)
    with config_errors('building the batch spec', debug=debug):
      elem_spec, batch_source = _batch_spec(trainer, batch_spec)
    with config_errors('shape-evaluating the train state', debug=debug):
      state = abstract_train_state(trainer, elem_spec)
  ckpt = getattr(trainer, 'checkpointer', None)
  if host_ram_budget is None:
    host_ram_budget = getattr(ckpt, 'host_ram_budget', 'auto')
  if strategy is None:
    strategy = getattr(ckpt, 'strategy', 'auto')
  plan = plan_lib.plan_save(state, host_ram_budget=host_ram_budget, strategy=strategy,
                            platform=platform, blocking=False)
  batch = {k: f'{jax.numpy.dtype(v.dtype).name}{list(v.shape)}'
           for k, v in flatten_spec(elem_spec).items()}
  return ConfigPlan(plan=plan, config=config_path(cfg_args),
                    checkpointer=type(ckpt).__name__ if ckpt is not None else None,
                    batch=batch, batch_source=batch_source)
