"""The DiT body every Wan forward runs (`dit`): patch embedding, time embedding, the blocks in a layer loop, the
head. The loop is a ``lax.scan`` over stacked blocks, unrolled when params, cache or cross K/V are held per layer,
or period by period over a `jaxkv.cache.MixedCache`'s two stacks (`_scan_periods`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.cache import MixedCache
from jaxkv.models.wan import layers as L
from jaxkv.models.wan.activation_sharding import HEADS, TOKEN_HEADS, TOKENS, constrain
from jaxkv.models.wan.attention import CrossKV, _self_qkv
from jaxkv.models.wan.block import _block, _head
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.dtypes import _activation_dtype, _block_params, _compute_params
from jaxkv.models.wan.inputs import _check_latents, _frame_timesteps
from jaxkv.models.wan.params import is_per_layer
from jaxkv.models.wan.rope import rope_angles, rope_cos_sin
from jaxkv.run_options import RunOptions


def _layer_of(tree, layer: int):
    """Layer ``layer`` (a Python int) of per-layer blocks (a tuple) or of stacked blocks (a static slice)."""
    if isinstance(tree, (tuple, list)):
        return tree[layer]
    return jax.tree.map(lambda a: a[layer], tree)


def dit(
    params,
    config: WanConfig,
    latents,
    timesteps,
    positions,
    cross: CrossKV,
    self_attention,
    state,
    run: RunOptions,
    rotate: bool = True,
    remat: bool = False,
):
    """The DiT on latents whose tokens sit at ``positions`` int32 [batch, tokens]: patch embedding, the blocks under
    ``lax.scan`` over layers, the head. ``self_attention(q, k, v, state, layer) -> (out, state)`` attends q, k and v
    [batch, tokens, heads, head_dim] in the activation dtype (`_activation_dtype`), rotated at ``positions``
    (unrotated when ``rotate`` is False: the callback rotates them, as cache-relative RoPE does); ``state`` (e.g. the
    stacked cache) rides in the scan carry.
    ``remat``: each block under `jax.checkpoint` (see `forward_teacher_forcing`).

    The layer loop is a ``lax.scan`` over stacked blocks, or unrolled (layer a Python int) when the params, the
    state (a per-layer cache) or the cross K/V are held per layer: then nothing is sliced out of a stack.
    Returns (flow float32 [batch, frames, height, width, out_dim], state)."""
    gf, gh, gw = _check_latents(config, latents)
    b, n = positions.shape
    t = _frame_timesteps(timesteps, b, gf)
    rope = rope_cos_sin(rope_angles(positions, (gh, gw), config.head_dim, config.rope_theta)) if rotate else None
    top = _compute_params(params, run)
    act = _activation_dtype(run)
    x = constrain(L.patchify(top, config, latents, act).astype(jnp.float32), TOKENS)  # the residual stream: float32
    e, e0 = L.time_embedding(top, config, t)

    def run_block(x, state, p, ck, cv, layer, attend_layer):
        p = _block_params(p, run)

        def attention(pa, h):
            # Ulysses (`activation_sharding`): q, k, v projected per token, then all-to-all tokens -> heads for the
            # cache and the ring; the output back heads -> tokens
            q, k, v = (constrain(constrain(t, TOKEN_HEADS), HEADS) for t in _self_qkv(pa, h, rope, config, act))
            out, new_state = attend_layer(q, k, v, state, layer)
            out = constrain(out.astype(act), TOKEN_HEADS)
            return L.linear(pa["o"], out.reshape(b, n, config.dim), act), new_state

        x, state = _block(p, x, e0, ck, cv, gf, attention, config, run, act)
        return constrain(x, TOKENS), state

    unrolled = is_per_layer(params) or cross.is_per_layer or getattr(state, "is_per_layer", False)
    if remat:
        run_block = jax.checkpoint(run_block, static_argnums=(5, 6) if unrolled else (6,))
    if isinstance(state, MixedCache):
        if unrolled:
            raise ValueError(
                "a MixedCache runs the layer scan: pass stacked params and cross K/V "
                "(jaxkv.models.wan.params.stacked_params, CrossKV.stacked)"
            )
        x, state = _scan_periods(run_block, x, state, params["blocks"], cross, self_attention)
    elif unrolled:
        for layer in range(config.num_layers):
            p = _layer_of(params["blocks"], layer)
            ck, cv = cross.layer(layer)
            x, state = run_block(x, state, p, ck, cv, layer, self_attention)
    else:

        def body(carry, xs):
            x, state = carry
            p, ck, cv, layer = xs
            return run_block(x, state, p, ck, cv, layer, self_attention), None

        layers = jnp.arange(config.num_layers, dtype=jnp.int32)
        (x, state), _ = lax.scan(body, (x, state), (params["blocks"], cross.k, cross.v, layers))
    return L.unpatchify(config, _head(top, config, x, e, gf), (gf, gh, gw)), state


def _scan_periods(run_block, x, cache: MixedCache, blocks, cross: CrossKV, self_attention):
    """The layers of a `MixedCache` model in the order and layout the cache sets (`MixedCache.scan_layers`: period
    by period, both stacks in the carries); the layer's params and cross K/V are read by a dynamic index of the
    model layer (no stacked copy of the params per period)."""
    take = lambda tree, layer: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), tree)

    def one(x, stack, layer, index):
        return run_block(
            x, stack, take(blocks, layer), take(cross.k, layer), take(cross.v, layer), index, self_attention
        )

    return cache.scan_layers(one, x)
