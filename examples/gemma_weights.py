r"""Writes pretrained weights for the tiny Gemma LoRA config, as Gemma publishes them.

    python examples/gemma_weights.py /tmp/weights
    python -m kauldron.main --cfg=configs/gemma_lora.py --cfg.workdir=/tmp/lora \
        --cfg.__args__.tiny=True --cfg.__args__.pretrained=/tmp/weights

The weights of `gm.testing.DummyGemma` (the tiny config's model), drawn from
another seed than the run's, saved by stock Orbax in the layout of Gemma's
published checkpoints: one entry a module,
`'transformer/layer_0/attn/q_einsum': {'w': ...}`, the MLP's einsums as
modules of one `'w'`.  That is what `gm.ckpts.LoadCheckpoint` reads from
`gm.ckpts.CheckpointPath.*`, so the tiny run loads its weights offline the
way the real one does (through `kd_ckpt.InitWithinBudget` with
`safe_ckpt`).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


def published_layout(params: dict) -> dict:
  """Gemma's NESTED params in its published ("FLAT") checkpoint layout."""
  flat = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    *module, name = [k.key for k in path]
    if module[-1:] == ['mlp']:  # mlp/linear, mlp/gating_einsum: stored as .../w
      module, name = [*module, name], 'w'
    flat.setdefault('/'.join(['transformer', *module]), {})[name] = x
  return flat


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('path', help='where the checkpoint goes (must not exist)')
  ap.add_argument('--seed', type=int, default=7)
  args = ap.parse_args(argv)
  from gemma import gm  # pylint: disable=g-import-not-at-top
  params = gm.testing.DummyGemma().init(
      jax.random.key(args.seed), jnp.zeros((1, 4), jnp.int32))['params']
  with ocp.StandardCheckpointer() as c:
    c.save(args.path, published_layout(params))
  print(f'wrote {len(jax.tree.leaves(params))} leaves of DummyGemma weights to {args.path}')


if __name__ == '__main__':
  main()
