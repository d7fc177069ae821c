"""Pytrees the way Orbax sees them: which nodes are leaves, and their names.

kd_ckpt's save, restore, verify and inspect all go through this module, so
they agree with Orbax and with each other.  Orbax names a leaf by its key path
joined with dots (`opt_state.0.mu.w`), the name its array has in the OCDBT
database, and it stores no data for empty nodes (`None`, `{}`, `()`,
`optax.EmptyState()`, `optax.MaskedNode()`): `_METADATA` records them, and
they come back as they were.  `leaves` drops them exactly where
`jax.tree_util.tree_flatten_with_path` does, so names and values line up.

Example:

  for leaf in tree.leaves({'a': jnp.ones(3), 'b': None, 'c': [1.0]}):
    print(leaf.name, leaf.value)          # a [1. 1. 1.] / c.0 1.0
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One leaf Orbax stores.

  Attributes:
    name: Orbax's parameter name (its key in the checkpoint), also the name
      kd_ckpt shows users.
    keypath: the JAX key path.
    value: the leaf.
  """

  name: str
  keypath: tuple[Any, ...]
  value: Any


def name_of(keypath) -> str:
  """Orbax's parameter name of a key path: `('opt', 0, 'mu')` -> 'opt.0.mu'."""
  return '.'.join(ocp.tree.str_keypath(tuple(keypath))) if keypath else ''


def leaves(tree: Any) -> list[Leaf]:
  """The leaves Orbax stores, in flattening order (empty nodes excluded)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [Leaf(name_of(kp), tuple(kp), v) for kp, v in flat]


def names(tree: Any) -> list[str]:
  return [l.name for l in leaves(tree)]


def is_prng_key(x: Any) -> bool:
  """A typed PRNG key array (`jax.random.key`), stored as its key data."""
  dtype = getattr(x, 'dtype', None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
