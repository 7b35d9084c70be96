"""The NNX module form of Wan computes what the pure functions compute, and works under nnx transforms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxkv
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)


def _inputs():
    k1, k2 = jax.random.split(jax.random.key(1))
    return (
        jax.random.normal(k1, (1, 2, 2, 4, CFG.in_dim)),
        jnp.array([300.0]),
        jax.random.normal(k2, (1, 5, CFG.text_dim)),
    )


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_module_holds_the_params_layout_and_matches_pure_forward():
    model = wan.WanModel(CFG, rngs=nnx.Rngs(0))
    params = model.params()
    wan.validate_params(params, CFG)
    assert model.blocks.self_attn.q.kernel[...].shape == (CFG.num_layers, CFG.dim, CFG.dim)
    x, t, c = _inputs()
    # eager vs jit fuse differently: equal to float32 rounding
    np.testing.assert_allclose(
        np.asarray(model(x, t, c)), np.asarray(jax.jit(lambda p: wan.forward(p, CFG, x, t, c))(params)), atol=2e-5
    )
    again = wan.WanModel.from_params(CFG, params)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m: m(x, t, c))(again)), np.asarray(model(x, t, c)), atol=2e-5)


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_module_streaming_step_equals_block_causal():
    model = wan.WanModel(CFG, rngs=nnx.Rngs(3))
    x, _, c = _inputs()
    t = jnp.array([[100.0, 700.0]])
    cache = model.init_cache(jaxkv.RingSpec.from_frames(2, 1, 1), 1)
    cross = model.cross_kv(c)
    outs = []
    for f in range(2):
        cache = cache.begin_chunk()
        out, cache = model.step(cache, cross, x[:, f : f + 1], t[:, f : f + 1])
        outs.append(out)
    want = model.block_causal(x, t, c, chunk_frames=1, window_frames=1)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(want), atol=1e-5)


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_nnx_optimizer_step_changes_the_loss():
    model = wan.WanModel(CFG, rngs=nnx.Rngs(4))
    x, t, c = _inputs()
    opt = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    loss = lambda m: jnp.mean(m(x, t, c) ** 2)
    before = float(loss(model))
    grads = nnx.grad(loss)(model)
    opt.update(model, grads)
    assert float(loss(model)) < before


def test_module_needs_exactly_one_source_of_weights():
    with pytest.raises(ValueError, match="exactly one"):
        wan.WanModel(CFG)
    with pytest.raises(ValueError, match="missing keys"):
        wan.WanModel.from_params(CFG, {"head": {}})
