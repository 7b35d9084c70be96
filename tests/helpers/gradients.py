"""Gradient checks shared by the rollout and streaming tests."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np


def remat_gradients_agree(make_loss, params):
    """``make_loss(remat) -> loss(params)``: with ``remat`` the gradient's program holds a ``remat2`` equation
    (without it none), and the loss and gradient equal those without it up to float rounding."""
    results = {}
    for remat in (False, True):
        grad = jax.value_and_grad(make_loss(remat))
        assert ("remat2" in str(jax.make_jaxpr(grad)(params))) == remat
        results[remat] = jax.jit(grad)(params)
    (v0, g0), (v1, g1) = results[False], results[True]
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0))
    assert scale > 0
    chex.assert_trees_all_close(g1, g0, atol=1e-5 * scale, rtol=0)
