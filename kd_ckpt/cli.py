"""Command line: plan a Kauldron config's saves, inspect or verify a checkpoint.

  python -m kd_ckpt plan --cfg=configs/gemma_lora.py [--cfg.x=...]
      [--host-ram-budget=16GiB] [--strategy=auto] [--batch-spec=...] [--json]
  python -m kd_ckpt inspect DIR [--json]
  python -m kd_ckpt verify DIR [--host-ram-budget=256MiB] [--allow-unchecked] [--json]

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

`verify` re-reads every leaf the checkpoint's metadata lists within the
budget and checks it against the CRC32C recorded when kd_ckpt saved it
(`kd_ckpt.verify`): one row per leaf, ok, CORRUPT, unreadable, incomplete or
unchecked (no checksum recorded), naming the bad leaves.

This module only parses arguments and prints: the work is
`kauldron.config.plan_config`, `inspecting.inspect` and `verifying.verify`.

Exit status: 0 success; 1 no strategy fits the budget (`plan`), or a
corrupt, unreadable, incomplete leaf, or an unchecked one without
`--allow-unchecked` (`verify`); 2 bad arguments, config errors, no checkpoint
found, or no checksums to verify against.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
import os
import sys


class CliError(Exception):
  """An error reported as one message, without a traceback (exit 2)."""

  exit_code = 2


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
          " fraction of available memory: 0.25 or 25%% (default: the config's SafeCheckpointer"
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
  verify.add_argument('--allow-unchecked', action='store_true',
                      help='exit 0 even when some leaves have no recorded checksum')
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


def _plan(args: argparse.Namespace, cfg_args: list[str]) -> int:
  if not any(a == '--cfg' or a.startswith('--cfg=') for a in cfg_args):
    raise CliError(
        'plan needs a config: --cfg=path/to/config.py (plus optional'
        ' --cfg.x=... overrides, as for `python -m kauldron.main`).')
  from kd_ckpt import budget as budget_lib  # pylint: disable=g-import-not-at-top
  from kd_ckpt import plan as plan_lib  # pylint: disable=g-import-not-at-top

  # Bad flags fail now, not after the config's imports.
  try:
    if args.host_ram_budget is not None:
      budget_lib.parse(args.host_ram_budget)
    if args.strategy is not None:
      plan_lib.check_strategy(args.strategy)
  except ValueError as e:
    raise CliError(str(e)) from e
  if args.num_devices is not None:
    _fake_cpu_devices(args.num_devices)
  try:
    from kd_ckpt.kauldron import config  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise CliError(f'plan reads Kauldron configs and needs Kauldron: pip install'
                   f' "kd_ckpt[kauldron]" ({e}).') from e
  import jax  # pylint: disable=g-import-not-at-top

  try:
    result = config.plan_config(
        cfg_args, host_ram_budget=args.host_ram_budget, strategy=args.strategy,
        batch_spec=args.batch_spec, platform=args.platform, debug=args.debug)
  except config.ConfigError as e:
    raise CliError(str(e)) from e
  except plan_lib.BudgetTooSmallError as e:
    print(f'kd_ckpt plan: {e}', file=sys.stderr)
    return 1
  except ValueError as e:  # bad budget or strategy
    raise CliError(str(e)) from e
  plan = result.plan
  if args.json:
    out = plan.to_json_dict()
    out['source'] = {
        'config': result.config, 'checkpointer': result.checkpointer,
        'batch_spec': result.batch, 'batch_spec_from': result.batch_source,
        'num_devices': jax.device_count(), 'backend': jax.default_backend(),
    }
    print(json.dumps(out, indent=2))
    return 0
  print(f'config        {result.config}')
  print(f'checkpointer  {result.checkpointer}')
  print('batch         ' + ', '.join(f'{k}={v}' for k, v in result.batch.items())
        + f'  (from {result.batch_source_text})')
  print(f'devices       {jax.device_count()} ({jax.default_backend()});'
        f' planned for {plan.platform}')
  print()
  print(plan)
  return 0


def _fake_cpu_devices(num_devices: int) -> None:
  """Asks XLA for `num_devices` CPU devices; only before JAX starts."""
  import jax  # pylint: disable=g-import-not-at-top

  from kd_ckpt import compat  # pylint: disable=g-import-not-at-top

  if num_devices < 1:
    raise CliError(f'--num-devices={num_devices}: needs at least 1.')
  if compat.backends_initialized():
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



def _verify(args: argparse.Namespace) -> int:
  from kd_ckpt import inspecting  # pylint: disable=g-import-not-at-top
  from kd_ckpt import verifying  # pylint: disable=g-import-not-at-top

  try:
    item_dir, _ = inspecting.find_checkpoint(args.directory)
    report = verifying.verify(item_dir, host_ram_budget=args.host_ram_budget)
  except (FileNotFoundError, ValueError) as e:
    raise CliError(str(e)) from e
  print(json.dumps(report.to_json_dict(), indent=2) if args.json else report)
  if not report.ok:
    return 1
  if report.unchecked and not args.allow_unchecked:
    print(f'kd_ckpt verify: {len(report.unchecked)} leaf/leaves have no recorded'
          ' checksum (unchecked); pass --allow-unchecked to accept that.',
          file=sys.stderr)
    return 1
  return 0


def _inspect(args: argparse.Namespace) -> int:
  from kd_ckpt import inspecting  # pylint: disable=g-import-not-at-top

  try:
    info = inspecting.inspect(args.directory)
  except FileNotFoundError as e:
    raise CliError(str(e)) from e
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise CliError(f'cannot read {os.fspath(args.directory)!r}: {type(e).__name__}: {e}') from e
  print(json.dumps(info.to_json_dict(), indent=2) if args.json else info)
  return 0
