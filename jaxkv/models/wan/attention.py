"""The attention of a Wan block: the text K/V every layer's cross-attention reads (`CrossKV`, `cross_kv`, computed
once per stream), the self-attention's q, k, v (`_self_qkv`), Wan's 3-D RoPE at cache-relative positions
(`cache_relative_rope`, `_relative_attend`) and the cross-attention itself (`_cross_attention`). Where q, k and v
go (a cache, a whole sequence) is the caller's: `jaxkv.models.wan.dit.dit` takes it as a callback."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxkv.attention import ALL_VISIBLE_PLAN, MaskSpec, attend, rope_ranks
from jaxkv.models.wan import layers as L
from jaxkv.models.wan.activation_sharding import HEADS, TOKEN_HEADS, constrain
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.dtypes import _activation_dtype, _block_params, _compute_params, _run_of
from jaxkv.models.wan.inputs import check_context
from jaxkv.models.wan.params import is_per_layer
from jaxkv.models.wan.rope import apply_rope, rope_angles, rope_cos_sin
from jaxkv.precision import Precision
from jaxkv.run_options import RunOptions


class CrossKV(NamedTuple):
    """Cross-attention keys and values of every layer: k, v [layers, batch, text_tokens, heads, head_dim] in the
    precision's cache_dtype (text_tokens = text_len unless built with ``cross_kv(..., pad_context=False)``), or
    per layer: tuples of ``layers`` arrays [batch, text_tokens, heads, head_dim] (from per-layer params)."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]

    @property
    def is_per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    def layer(self, i: int):
        """(k, v) [batch, text_tokens, heads, head_dim] of layer ``i`` (a Python int)."""
        return self.k[i], self.v[i]

    def per_layer(self) -> "CrossKV":
        """Tuples of per-layer arrays (a copy of a stacked CrossKV; a per-layer one is returned as it is)."""
        if self.is_per_layer:
            return self
        return CrossKV(
            tuple(self.k[i] for i in range(self.k.shape[0])), tuple(self.v[i] for i in range(self.v.shape[0]))
        )

    def stacked(self) -> "CrossKV":
        """[layers, ...] stacks (a copy of a per-layer CrossKV)."""
        return CrossKV(jnp.stack(self.k), jnp.stack(self.v)) if self.is_per_layer else self


def _heads(x, config: WanConfig):
    """[batch, tokens, dim] -> [batch, tokens, heads, head_dim]."""
    return x.reshape(*x.shape[:-1], config.num_heads, config.head_dim)


def cross_kv(
    params,
    config: WanConfig,
    context,
    *,
    pad_context: bool = True,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
) -> CrossKV:
    """Cross-attention keys/values of all layers from the text context (a pure function: hoist it out of loops).

    Args:
      context: [batch, text_tokens, text_dim] text-encoder embeddings (zero-padded to text_len when pad_context).
      precision: the dtype policy (`jaxkv.precision.Precision` or a preset name; default float32); params must be
        in its param_dtype.
      run: a `jaxkv.run_options.RunOptions` instead of ``precision`` (its backend is unused here).
    Returns:
      CrossKV with k, v [layers, batch, text_tokens, heads, head_dim] in precision.cache_dtype (tuples of per-layer
      [batch, text_tokens, heads, head_dim] when the params are per layer): text_tokens = text_len when
      pad_context, else the context's own token count.
    """
    return _cross_kv(params, config, context, pad_context, _run_of(params, run, None, precision, "cross_kv"))


def _cross_kv(params, config: WanConfig, context, pad_context: bool, run: RunOptions) -> CrossKV:
    context = check_context(config, context, None, pad_context)
    act = _activation_dtype(run)
    ctx = L.text_embedding(_compute_params(params, run), context, act)
    cache = jnp.dtype(run.precision.cache_dtype)

    def one_layer(pk, pv, scale):
        k = L.rms_norm(L.linear(pk, ctx, act), scale, config.eps, act)
        return _heads(k, config).astype(cache), _heads(L.linear(pv, ctx, act), config).astype(cache)

    blocks = params["blocks"]
    if is_per_layer(params):
        # The text projections of all layers stacked for this one call (once per stream), so the per-layer K/V
        # are bit for bit the stacked ones; returned per layer, for the unrolled layer loop.
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *(b["cross_attn"] for b in blocks))
    else:
        blocks = blocks["cross_attn"]
    p = _block_params(blocks, run)
    k, v = jax.vmap(one_layer)(p["k"], p["v"], p["norm_k"]["scale"])
    cross = CrossKV(k, v)
    return cross.per_layer() if is_per_layer(params) else cross


def _self_qkv(p, h, rope, config: WanConfig, act=jnp.float32):
    """RMSNorm'd (over the full dim) and rotated q, k and plain v, each ``act`` [batch, tokens, heads, head_dim]
    (the projections emit ``act``; norms and RoPE compute in float32 and write ``act``).

    rope: (cos, sin) float32 [batch, tokens, head_dim // 2] from `rope_cos_sin`, computed once per forward; None
    leaves q and k unrotated (cache-relative RoPE rotates them at read)."""
    q = _heads(L.rms_norm(L.linear(p["q"], h, act), p["norm_q"]["scale"], config.eps, act), config)
    k = _heads(L.rms_norm(L.linear(p["k"], h, act), p["norm_k"]["scale"], config.eps, act), config)
    v = _heads(L.linear(p["v"], h, act), config)
    if rope is None:
        return q, k, v
    return apply_rope(q, *rope), apply_rope(k, *rope), v


def cache_relative_rope(q_positions, kv_positions, grid_hw: tuple[int, int], config: WanConfig):
    """Wan's 3-D RoPE at cache-relative positions: ((cos, sin) of the queries, (cos, sin) of the cache slots).

    Each valid slot is rotated as if it sat at its **rank** among the cache's valid positions (0 = the oldest token
    held) and each query at the number of valid positions below it (its own key's rank: distance 0 to itself), via
    `jaxkv.attention.rope_ranks` (positions only: nothing is gathered). A cache holds whole frames, so a token's
    rank is ``frame_rank * tokens_per_frame + (index within its frame)``: fed to `rope_angles` it keeps the token's
    (row, column) coordinates and replaces its frame index by the rank of its frame among the frames held, which is
    below ``capacity / tokens_per_frame`` however long the stream has run. Empty slots (-1) get rank 0; they are
    masked anyway.

    Args:
      q_positions: int32 [batch, q_tokens] absolute (or wrapped-clock) query positions, -1 for none.
      kv_positions: int32 [batch, capacity] the cache's slot positions, -1 = empty.
    Returns:
      ((cos, sin) float32 [batch, q_tokens, head_dim // 2], (cos, sin) float32 [batch, capacity, head_dim // 2]).
    """
    q_rank, k_rank = rope_ranks(q_positions, kv_positions)
    angles = lambda r: rope_angles(r, grid_hw, config.head_dim, config.rope_theta)
    return rope_cos_sin(angles(q_rank)), rope_cos_sin(angles(k_rank))


def _cross_attention(p, x, k, v, config: WanConfig, run: RunOptions, act=jnp.float32):
    """x [batch, tokens, dim] attends to the (hoisted) text keys/values [batch, text_len, heads, head_dim]; q is
    cast to their dtype (one dtype for the attention kernels, as `cached_attention` does for the cache). Returns
    ``act`` [batch, tokens, dim]."""
    b, n, _ = x.shape
    q = _heads(L.rms_norm(L.linear(p["q"], x, act), p["norm_q"]["scale"], config.eps, act), config)
    q = constrain(constrain(q, TOKEN_HEADS), HEADS)  # Ulysses: all tokens, the heads of the cross K/V held here
    zeros_q = jnp.zeros((b, n), jnp.int32)
    zeros_k = jnp.zeros((b, k.shape[1]), jnp.int32)
    # Every text key is visible to every query: cuDNN runs with no mask, no check and no branch.
    out = attend(
        q.astype(k.dtype), k, v, zeros_q, zeros_k, backend=run.backend, interpret=run.interpret, plan=ALL_VISIBLE_PLAN
    ).astype(act)
    return L.linear(p["o"], constrain(out, TOKEN_HEADS).reshape(b, n, config.dim), act)


def _relative_attend(
    q,
    kc,
    vc,
    q_positions,
    kv_positions,
    mask: MaskSpec,
    grid_hw,
    config: WanConfig,
    run: RunOptions,
    attend_fn=attend,
    plan=None,
):
    """Attention of unrotated q [batch, q_tokens, heads, head_dim] to a layer's unrotated cached keys kc and values
    vc [batch, capacity, heads, head_dim], both rotated here by cache rank (`cache_relative_rope`); q's dtype out.

    The rotation happens outside `attend` (which then takes no rope), so every backend, cuDNN included, runs
    its plain kernel: Wan's RoPE is 3-D, unlike `jaxkv.attention.CacheRope`'s 1-D rotation. ``attend_fn``: `attend`
    or `jaxkv.attention.fp8.fp8_attend` (same arguments)."""
    dtype = kc.dtype
    q_rope, k_rope = cache_relative_rope(q_positions, kv_positions, grid_hw, config)
    q_rot = apply_rope(q.astype(jnp.float32), *q_rope).astype(dtype)
    k_rot = apply_rope(kc, *k_rope)
    extra = {} if plan is None else {"plan": plan}  # (`attend` takes a plan; `fp8_attend` plans per call)
    if attend_fn is attend:  # (`fp8_attend` takes no interpret: it emulates FP8 on CPU by itself)
        extra["interpret"] = run.interpret
    out = attend_fn(q_rot, k_rot, vc, q_positions, kv_positions, mask=mask, backend=run.backend, **extra)
    return out.astype(q.dtype)
