"""Pytree helpers for comparing whole trees with chex (structure and every leaf, named by its path on failure)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def as_f32(tree):
    """``tree`` with every leaf a float32 numpy array: FP8 and bfloat16 leaves compared by the values they hold
    (numpy's equality does not take float8 dtypes)."""
    return jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32)), tree)
