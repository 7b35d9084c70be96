"""Wan 2.1's DiT as pure functions of a params pytree (layout: `jaxkv.models.wan.params`), in three forms that share
every numeric:

* `forward`: the plain bidirectional Wan forward over a whole clip.
* `forward_block_causal`: the same sequence under the chunk-causal training mask of causal Wan (Self-Forcing /
  CausVid), optionally with a pinned sink and a local window, all by token position.
* `forward_chunk`: one chunk of a stream on a stacked KV cache (`jaxkv.RingCache` or `jaxkv.RollingCache` with
  ``layers=num_layers``); the chunk's keys are rotated at their absolute positions, written into the chunk's reserved
  slot, and attention reads the whole cache in physical order with masks from stored positions. With
  ``rope="cache-relative"`` keys are cached unrotated and rotated at read by their rank in the cache instead
  (`cache_relative_rope`).

Blocks run under ``lax.scan`` over the stacked layer axis. In `forward_chunk` the stacked cache rides in the scan
carry and each layer writes ``[layer, session, slot]`` with a dynamic update slice, so XLA updates it in place rather
than copying every layer's cache per forward (see DESIGN.md, "Making XLA do what the design promises"). A
`jaxkv.cache.MixedCache` (dense layers plus every k-th layer dilated) is scanned period by period with both of its
stacks in the carry (`_scan_periods`), each still updated in place.

The inference layout: with per-layer params (`jaxkv.models.wan.params.per_layer_params`), a per-layer cache
(``init_cache(..., per_layer=True)``) or per-layer cross K/V (what `cross_kv` builds from per-layer params), the
layer loop is unrolled instead (`_dit`): each layer reads its weights, its K/V and its text K/V where they lie, with
no per-layer slice of a stack (a copy per layer per forward inside the scan, which kernels that take whole buffers,
cuDNN's attention and cuBLAS's GEMMs, cannot avoid). Same results either way; the unrolled program compiles slower.

In `forward_chunk` the cuDNN attention plan (`jaxkv.attention.plan_attention`: no mask, per-session lengths or the
fallback kernel) is made once per forward from the cache's read positions, before the layer loop, and shared by
every layer; cross-attention to the text keys takes the static all-visible plan (no check, no branch).

Cross-attention keys/values depend only on the text context, so `cross_kv` computes them once for all layers; a
streaming rollout calls it once and passes the result to every `forward_chunk`.

How the model runs is one `jaxkv.run_options.RunOptions` (``run=``; the older ``backend=`` / ``precision=`` keywords
build one): each entry point resolves it and checks the params against its precision once, then passes ``run``
down whole; ``run.backend`` stops at the calls into `jaxkv.attend`.
Dtypes follow ``run.precision``, a `jaxkv.precision.Precision` (default float32 throughout): `_compute_params`
is the one place that casts weights for their matmuls (the large projections to ``compute_dtype``; the time
embedding, time projection and head to float32, as Wan runs them), `cross_kv` stores the text K/V in the policy's
``cache_dtype``, and every attention reads q, k, v in ``cache_dtype`` (the whole-sequence forwards cast to it as the
cache would hold them, so a stream and the block-causal forward attend alike). The layers themselves never choose a
dtype: every activation between the float32 residual stream and a GEMM is in `_activation_dtype` (the compute
dtype: the GEMMs emit it with float32 accumulation, bias and GELU applied in it; norms, modulation and RoPE compute
in float32 and write it), while the residual stream, the time embedding, modulation tables and head stay float32.

Conventions: latents are channels-last ``[batch, frames, height, width, channels]`` on the latent grid; timesteps
are on Wan's 0..1000 scale, one per batch row ``[batch]`` or one per (patch) frame ``[batch, frames // pt]``; text
context is ``[batch, text_tokens, text_dim]`` with ``text_tokens <= text_len`` and is zero-padded to ``text_len``
before the text embedding, as Wan does (so padding tokens are attended, as in Wan 2.1 T2V; pass exactly
``text_len`` tokens to compare against a transformer that does not pad, e.g. diffusers' WanTransformer3DModel).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention import ALL_VISIBLE_PLAN, MaskSpec, attend, plan_attention, rope_ranks
from jaxkv.attention.fp8 import fp8_attend
from jaxkv.cache import MixedCache, MixedSpec, RingSpec, policy_class
from jaxkv.cache.fp8 import Fp8Cache
from jaxkv.models.wan import layers as L
from jaxkv.models.wan.activation_sharding import HEADS, TOKEN_HEADS, TOKENS, constrain
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import is_per_layer, param_shapes
from jaxkv.models.wan.rope import apply_rope, rope_angles, rope_cos_sin, sequence_positions
from jaxkv.nn.cached import cached_attention
from jaxkv.precision import Precision
from jaxkv.run_options import RunOptions, resolve
from jaxkv.validate import is_concrete, is_int

# Where a stream's RoPE positions come from: "absolute" rotates q and k at their absolute token positions before the
# cache write (Wan 2.1 / Self-Forcing); "cache-relative" caches k unrotated and rotates q and the cached keys by
# their rank among the cache's valid positions at every read (`cache_relative_rope`).
ROPE_MODES = ("absolute", "cache-relative")


def check_rope_mode(rope) -> str:
    if not isinstance(rope, str) or rope not in ROPE_MODES:
        raise ValueError(f"rope must be one of {list(ROPE_MODES)}, got {rope!r}")
    return rope


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


def _layer_of(tree, layer: int):
    """Layer ``layer`` (a Python int) of per-layer blocks (a tuple) or of stacked blocks (a static slice)."""
    if isinstance(tree, (tuple, list)):
        return tree[layer]
    return jax.tree.map(lambda a: a[layer], tree)


# ------------------------------------------------------------------------------------------------ parameters


def init_params(config: WanConfig, key, dtype=jnp.float32):
    """Random parameters following `param_shapes(config)` exactly, created directly in ``dtype``.

    Nothing is zero: kernels ~ N(0, 1/fan_in), biases ~ N(0, 0.02^2), norm scales ~ 1 + N(0, 0.1^2), LayerNorm
    shifts ~ N(0, 0.1^2), modulation tables ~ N(0, 1/dim) (as Wan initialises them), so every parameter changes the
    output and a test that drops or permutes one fails.

    Leaf ``i`` of the flattened tree draws from ``split(key, leaves)[i]``; a stacked block leaf ``[layers, ...]``
    draws layer ``l`` from ``split(leaf_key, layers)[l]``. Each leaf is one small jitted program that writes its
    values in ``dtype`` layer by layer, so peak memory is the params plus one layer of one leaf in float32 (a
    whole-tree program held every leaf's float32 noise at once: 16.9 GB for the 1.3B preset in bfloat16).
    """
    dtype = jnp.dtype(dtype)
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(leaves, keys):
        scale, offset = _init_scale_offset(config, path, shape)
        stacked = str(path[0].key) == "blocks"
        out.append(_init_leaf(k, jnp.float32(scale), jnp.float32(offset), tuple(shape), stacked, dtype))
    return jax.tree.unflatten(treedef, out)


def _init_scale_offset(config: WanConfig, path, shape) -> tuple[float, float]:
    """Leaf ``path`` of ``shape`` is ``offset + scale * N(0, 1)`` (the distributions of `init_params`)."""
    name = str(path[-1].key)
    parent = str(path[-2].key) if len(path) > 1 else ""
    if name == "kernel":
        fan_in = math.prod(shape[:-1])
        if parent != "patch_embedding" and len(shape) >= 2:
            fan_in = shape[-2]
        return 1.0 / math.sqrt(fan_in), 0.0
    if name == "bias":
        return (0.1 if parent.startswith("norm") else 0.02), 0.0
    if name == "scale":
        return 0.1, 1.0
    if name == "modulation":
        return 1.0 / math.sqrt(config.dim), 0.0
    raise AssertionError(f"unhandled parameter {jax.tree_util.keystr(path)}")


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _init_leaf(key, scale, offset, shape: tuple[int, ...], stacked: bool, dtype):
    """One leaf ``offset + scale * N(0, 1)`` in ``dtype``; a stacked leaf is drawn layer by layer. Scale and offset
    are traced, so leaves of one shape share a program."""

    def draw(k, leaf_shape):
        return (offset + scale * jax.random.normal(k, leaf_shape, jnp.float32)).astype(dtype)

    if not stacked:
        return draw(key, shape)
    # lax.map writes each layer's slice into the stacked output: only one layer's float32 temporaries are live
    return lax.map(lambda k: draw(k, shape[1:]), jax.random.split(key, shape[0]))


# ------------------------------------------------------------------------------------------------ input checks


def _check_latents(config: WanConfig, latents, name: str = "latents"):
    if latents.ndim != 5 or latents.shape[-1] != config.in_dim:
        raise ValueError(
            f"{name} must be [batch, frames, height, width, in_dim={config.in_dim}], got {list(latents.shape)}"
        )
    _, f, h, w, _ = latents.shape
    pt, ph, pw = config.patch_size
    if f % pt or h % ph or w % pw:
        raise ValueError(f"{name} frames/height/width {f}x{h}x{w} must be divisible by the patch {config.patch_size}")
    if not jnp.issubdtype(latents.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got {latents.dtype}")
    return f // pt, h // ph, w // pw


def _frame_timesteps(timesteps, batch: int, frames: int):
    """[batch] or [batch, frames] -> float32 [batch, frames]."""
    t = jnp.asarray(timesteps)
    if t.shape == (batch,):
        t = jnp.broadcast_to(t[:, None], (batch, frames))
    elif t.shape != (batch, frames):
        raise ValueError(
            f"timesteps must be [batch]={[batch]} or per frame [batch, frames]={[batch, frames]}, got {list(t.shape)}"
        )
    return t.astype(jnp.float32)


def _check_context(
    config: WanConfig, context, batch: int | None = None, pad_context: bool = True, name: str = "context"
):
    """Checks text context [batch, text_tokens <= text_len, text_dim] (any batch when ``batch`` is None) and, when
    pad_context, zero-pads it to [batch, text_len, text_dim]."""
    context = jnp.asarray(context)
    if context.ndim != 3 or (batch is not None and context.shape[0] != batch) or context.shape[2] != config.text_dim:
        want = "batch" if batch is None else f"batch={batch}"
        raise ValueError(f"{name} must be [{want}, text_tokens, text_dim={config.text_dim}], got {list(context.shape)}")
    n = context.shape[1]
    if n > config.text_len:
        raise ValueError(f"{name} has {n} tokens, more than the model's text_len {config.text_len}")
    if n == 0 and not pad_context:
        raise ValueError(f"{name} has no tokens; pass at least one (or pad_context=True: zeros of text_len tokens)")
    if pad_context and n < config.text_len:
        context = jnp.pad(context, ((0, 0), (0, config.text_len - n), (0, 0)))
    return context


# ------------------------------------------------------------------------------------------------ precision

# Top-level weights whose matmuls stay float32 under any policy (Wan computes them under autocast(float32)).
_FLOAT32_MATMULS = ("time_embedding", "time_projection", "head")


def _cast_kernels(tree, dtype):
    """Every ``kernel`` leaf of ``tree`` in ``dtype`` (a no-op when it already is); biases, norm scales and
    modulation tables are left as they are: the layers use them in float32."""
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if getattr(path[-1], "key", None) == "kernel" and x.dtype != dtype else x, tree
    )


def _compute_params(params, run: RunOptions):
    """The non-block params with each kernel in the dtype its matmul runs in. Block params are cast one layer at
    a time inside the layer scan (`_block_params`), so a cast never materialises a copy of the whole stack."""
    compute = run.precision.compute_dtype
    return {
        name: (tree if name == "blocks" else _cast_kernels(tree, jnp.float32 if name in _FLOAT32_MATMULS else compute))
        for name, tree in params.items()
    }


def _block_params(p, run: RunOptions):
    """One layer's block params with every kernel in the compute dtype."""
    return _cast_kernels(p, run.precision.compute_dtype)


def _activation_dtype(run: RunOptions):
    """The dtype the large GEMMs emit and the norms, modulation and RoPE write: the compute dtype (float32 under
    `Precision.f32()`, bfloat16 under `Precision.bf16()`, as Self-Forcing's bf16 inference). The residual stream,
    the time embedding, the modulation tables and the head stay float32 whatever it is."""
    return jnp.dtype(run.precision.compute_dtype)


def _run_of(params, run, backend, precision, where: str) -> RunOptions:
    """The `RunOptions` of a public entry point (``run=``, or the older ``backend=`` / ``precision=``; TypeError for
    both), with the params checked against its precision: once per entry, never in the helpers it calls."""
    run = resolve(run, backend, precision, where)
    run.precision.check_params(params)
    return run


# ------------------------------------------------------------------------------------------------ attention pieces


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
    context = _check_context(config, context, None, pad_context)
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


def _block(p, x, e0, ck, cv, frames: int, self_attention, config: WanConfig, run: RunOptions, act=jnp.float32):
    """One Wan block on x float32 [batch, tokens, dim] with per-frame e0 [batch, frames, 6, dim].

    ``self_attention(p_self_attn, h) -> (y, aux)`` computes the self-attention output [batch, tokens, dim] (and any
    state it updates, e.g. the cache). ``act``: the dtype of every activation between the residual stream and a
    GEMM (`_activation_dtype`): the norms + modulation write it, the projections and the FFN emit it, and each
    branch's output is gated and added to the float32 residual in float32.
    """
    b, n, d = x.shape
    mod = p["modulation"].astype(jnp.float32)[None, None] + e0  # [batch, frames, 6, dim]
    m = [mod[:, :, i, None, :] for i in range(6)]  # each [batch, frames, 1, dim]
    shift1, scale1, gate1, shift2, scale2, gate2 = m
    flat = lambda y: y.reshape(b, n, d)

    h = flat(L.per_frame(L.layer_norm(x, config.eps), frames) * (1 + scale1) + shift1).astype(act)
    y, aux = self_attention(p["self_attn"], h)
    x = x + flat(L.per_frame(y.astype(jnp.float32), frames) * gate1)

    norm3 = L.layer_norm(x, config.eps, p["norm3"]["scale"], p["norm3"]["bias"], act)
    x = x + _cross_attention(p["cross_attn"], norm3, ck, cv, config, run, act).astype(jnp.float32)

    h = flat(L.per_frame(L.layer_norm(x, config.eps), frames) * (1 + scale2) + shift2).astype(act)
    y = L.linear(p["ffn"]["fc2"], L.gelu_tanh(L.linear(p["ffn"]["fc1"], h, act)), act)
    return x + flat(L.per_frame(y.astype(jnp.float32), frames) * gate2), aux


def _head(params, config: WanConfig, x, e, frames: int):
    """Output head: per-frame modulated LayerNorm, then the linear to pt*ph*pw*out_dim. e [batch, frames, dim]."""
    b, n, d = x.shape
    mod = params["head"]["modulation"].astype(jnp.float32)[None, None] + e[:, :, None, :]  # [b, frames, 2, dim]
    shift, scale = mod[:, :, 0:1], mod[:, :, 1:2]
    h = (L.per_frame(L.layer_norm(x, config.eps), frames) * (1 + scale) + shift).reshape(b, n, d)
    return L.linear(params["head"]["head"], h)


# ------------------------------------------------------------------------------------------------ full sequences


def _dit(
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


def _forward_sequence(
    params, config: WanConfig, latents, timesteps, context, mask: MaskSpec, pad_context: bool, run: RunOptions
):
    latents = jnp.asarray(latents)
    gf, gh, gw = _check_latents(config, latents)
    _frame_timesteps(timesteps, latents.shape[0], gf)  # checked before the text embedding runs
    cross = _cross_kv(params, config, jnp.asarray(context), pad_context, run)
    positions = sequence_positions(latents.shape[0], gf * gh * gw)
    kv_dtype = jnp.dtype(run.precision.cache_dtype)

    def self_attention(q, k, v, state, layer):
        # q, k, v in the dtype a cache would hold them in, so a stream and the whole sequence attend alike
        q, k, v = (a.astype(kv_dtype) for a in (q, k, v))
        out = attend(q, k, v, positions, positions, mask=mask, backend=run.backend, interpret=run.interpret)
        return out.astype(jnp.float32), state

    return _dit(params, config, latents, timesteps, positions, cross, self_attention, None, run)[0]


def forward(
    params,
    config: WanConfig,
    latents,
    timesteps,
    context,
    *,
    pad_context: bool = True,
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
):
    """The plain bidirectional Wan 2.1 forward (flow prediction).

    Args:
      params: the Wan parameter pytree (`jaxkv.models.wan.params`), every leaf in precision.param_dtype.
      latents: [batch, frames, height, width, in_dim] on the latent grid (height/width divisible by the patch).
      timesteps: float [batch] or per frame [batch, frames // pt], on the 0..1000 scale.
      context: [batch, text_tokens <= text_len, text_dim]; zero-padded to text_len unless pad_context=False.
      backend: the attention backend (`jaxkv.attend`'s names; default "auto").
      precision: the dtype policy, a `jaxkv.precision.Precision` or a preset name ("float32", "bfloat16"; default
        float32).
      run: a `jaxkv.run_options.RunOptions` holding both instead (TypeError if given with either).
    Returns:
      float32 [batch, frames, height, width, out_dim].
    """
    run = _run_of(params, run, backend, precision, "forward")
    return _forward_sequence(params, config, latents, timesteps, context, MaskSpec(), pad_context, run)


def block_causal_spec(config: WanConfig, latents, chunk_frames, window_frames=None, sink_frames=0) -> RingSpec:
    """The cache spec (in tokens) whose `RingSpec.mask` is the block-causal training mask of these latents.

    ``window_frames=None`` (no window: every earlier chunk is visible) is a window as long as the whole clip,
    rounded up to whole chunks."""
    gf, gh, gw = _check_latents(config, jnp.asarray(latents))
    for name, value in (("chunk_frames", chunk_frames), ("window_frames", window_frames), ("sink_frames", sink_frames)):
        if value is not None and not (is_int(value) and value >= 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if chunk_frames is None or chunk_frames <= 0:
        raise ValueError(f"chunk_frames must be a positive int, got {chunk_frames!r}")
    if window_frames is not None and window_frames < chunk_frames:
        raise ValueError(f"window_frames ({window_frames}) must hold at least one chunk ({chunk_frames} frames)")
    if window_frames is None:
        if sink_frames:
            raise ValueError("sink_frames only makes sense with a window (window_frames)")
        window_frames = -(-gf // chunk_frames) * chunk_frames
    return RingSpec.from_frames(gh * gw, chunk_frames, window_frames, sink_frames)


def forward_block_causal(
    params,
    config: WanConfig,
    latents,
    timesteps,
    context,
    *,
    chunk_frames: int,
    window_frames: int | None = None,
    sink_frames: int = 0,
    pad_context: bool = True,
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
):
    """Wan 2.1 under the block-causal (chunk-causal) mask of causal Wan training, by token position.

    Token i (frame f_i, chunk c_i = f_i // chunk_frames) sees token j iff c_j <= c_i and, when ``window_frames`` is
    set, j's chunk starts less than ``window_frames`` frames before i's chunk (the window includes i's own chunk) or
    j lies in the first ``sink_frames`` frames. The mask is `block_causal_spec(...).mask()`, the same `RingSpec.mask`
    that `forward_chunk` applies on a cache of that spec, so a stream on a sink + window cache sees exactly this.

    Args/returns as `forward`; chunk_frames, window_frames, sink_frames count latent (patch) frames.
    """
    mask = block_causal_spec(config, latents, chunk_frames, window_frames, sink_frames).mask()
    run = _run_of(params, run, backend, precision, "forward_block_causal")
    return _forward_sequence(params, config, latents, timesteps, context, mask, pad_context, run)


def forward_teacher_forcing(
    params,
    config: WanConfig,
    clean,
    noisy,
    timesteps,
    context,
    *,
    chunk_frames: int,
    window_frames: int | None = None,
    sink_frames: int = 0,
    pad_context: bool = True,
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
    remat: bool = False,
):
    """Every chunk of a clip denoised as a stream denoises it: each noisy chunk sees the *clean* chunks before it
    (teacher forcing, CausVid's training forward), in one pass over the clean and the noisy copy of the clip.

    The clean copy runs at timestep 0 under the block-causal mask (`forward_block_causal`), as a stream's commit
    pass writes each chunk's K/V; noisy chunk c then attends to the clean K/V of the chunks its mask shows (the
    sink, the window) and to its own noisy K/V, never to another noisy chunk. So chunk c's flow equals that of
    `forward_chunk` on a cache holding the clean chunks before it (a stream that committed them with
    ``context_noise = 0``): tested against that. Unlike `forward_block_causal`, where a chunk after a noisy one sees
    it noisy, every chunk here is trained in the context generation gives it. It costs about two
    `forward_block_causal` passes: twice the tokens, and the noisy chunks' attention folds the chunk axis into the
    batch (each fold reads the clean keys with its own chunk's replaced by the noisy ones).

    Args:
      clean, noisy: [batch, frames, height, width, in_dim], the clip and its noisy copy.
      timesteps: float [batch] or [batch, frames // pt]: the noisy copy's (the clean copy's are 0).
      context, chunk_frames, window_frames, sink_frames: as `forward_block_causal`.
      remat: run each block under `jax.checkpoint`: a gradient recomputes the block's activations (attention
        probabilities included) instead of storing them for every layer. The same function to float rounding (the
        recomputation may fuse differently). Scratch memory falls ~4x (`benchmarks/train_step.py`, the toy model);
        on XLA:CPU the step also gets faster (1.2-1.3x here, 1.7-2.1x for a rollout's gradient: fewer bytes
        written and read); on a GPU expect the usual trade of time for memory (not measured).
    Returns:
      float32 [batch, frames, height, width, out_dim]: the flow predicted for each noisy chunk.
    """
    clean, noisy = jnp.asarray(clean), jnp.asarray(noisy)
    if clean.shape != noisy.shape:
        raise ValueError(f"clean and noisy must have one shape, got {list(clean.shape)} and {list(noisy.shape)}")
    gf, gh, gw = _check_latents(config, clean, "clean")
    _check_latents(config, noisy, "noisy")
    b = clean.shape[0]
    t = _frame_timesteps(timesteps, b, gf)
    run = _run_of(params, run, backend, precision, "forward_teacher_forcing")
    mask = block_causal_spec(config, clean, chunk_frames, window_frames, sink_frames).mask()
    n = gf * gh * gw  # tokens of one copy
    tpc = mask.chunk  # tokens per chunk
    chunks = n // tpc
    positions = sequence_positions(b, n)
    chunk_of = jnp.arange(n) // tpc  # [n]
    own = chunk_of[None, :] == jnp.arange(chunks)[:, None]  # [chunks, n]: fold c's own tokens
    kv_dtype = jnp.dtype(run.precision.cache_dtype)

    def self_attention(q, k, v, state, layer):
        q, k, v = (a.astype(kv_dtype) for a in (q, k, v))
        out_clean = attend(
            q[:, :n], k[:, :n], v[:, :n], positions, positions, mask=mask, backend=run.backend, interpret=run.interpret
        )
        # fold c: the queries of noisy chunk c; the keys are the clean copy's with chunk c's replaced by the noisy
        fold = lambda a: a.reshape(b * chunks, tpc, *a.shape[2:])
        swap = lambda a: jnp.where(own[None, :, :, None, None], a[:, None, n:], a[:, None, :n]).reshape(
            b * chunks, n, *a.shape[2:]
        )
        q_pos = fold(positions)
        kv_pos = jnp.broadcast_to(positions[:, None], (b, chunks, n)).reshape(b * chunks, n)
        out_noisy = attend(
            fold(q[:, n:]), swap(k), swap(v), q_pos, kv_pos, mask=mask, backend=run.backend, interpret=run.interpret
        )
        out_noisy = out_noisy.reshape(b, n, *out_noisy.shape[2:])
        return jnp.concatenate([out_clean, out_noisy], axis=1).astype(jnp.float32), state

    cross = _cross_kv(params, config, jnp.asarray(context), pad_context, run)
    latents = jnp.concatenate([clean, noisy], axis=1)
    both_t = jnp.concatenate([jnp.zeros_like(t), t], axis=1)
    flow = _dit(
        params,
        config,
        latents,
        both_t,
        jnp.concatenate([positions, positions], axis=1),
        cross,
        self_attention,
        None,
        run,
        remat=remat,
    )[0]
    return flow[:, clean.shape[1] :]


# ------------------------------------------------------------------------------------------------ streaming


def init_cache(
    config: WanConfig,
    spec,
    batch: int,
    *,
    policy: str = "ring",
    dtype=jnp.float32,
    fp8: bool = False,
    per_layer: bool = False,
):
    """An empty stacked cache for all layers: k, v [layers, batch, capacity, heads, head_dim] (with ``per_layer``:
    tuples of ``layers`` buffers [batch, capacity, heads, head_dim], for the unrolled layer loop; ring and rolling
    only).

    fp8: store K/V in FP8 e4m3 with per-(chunk, head) float32 scales (`jaxkv.cache.fp8.Fp8Cache`, read and written
    in ``dtype``; a `RingSpec` with policy "ring" only; per layer too), as `jaxkv.precision.Precision.fp8_kv` asks.

    spec and policy:
      * a `RingSpec` with policy "ring" (`jaxkv.RingCache`, O(chunk) per chunk) or "rolling"
        (`jaxkv.RollingCache`, shift-by-copy): every layer keeps the same sink + window;
      * a `jaxkv.cache.DilatedSpec` with policy "dilated": every layer keeps dilated frames;
      * a `jaxkv.cache.MixedSpec`: a `jaxkv.cache.MixedCache`, every ``spec.period``-th layer dilated and the others
        dense under ``policy`` ("ring" or "rolling"); num_layers must be a multiple of the period.
    """
    if fp8:
        if policy != "ring" or type(spec) is not RingSpec:
            raise ValueError(
                f"an FP8 cache is a ring cache: pass a RingSpec with policy 'ring', got {type(spec).__name__} with "
                f"policy {policy!r}"
            )
        return Fp8Cache.init(
            spec, batch, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers, per_layer=per_layer
        )
    if per_layer and (isinstance(spec, MixedSpec) or policy == "dilated"):
        raise ValueError(f"per_layer caches are ring or rolling sink + window caches, not {policy!r} / {spec!r}")
    if per_layer:
        return policy_class(policy, spec).init(
            spec, batch, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers, per_layer=True
        )
    if isinstance(spec, MixedSpec):
        dense = policy_class(policy, spec.dense)
        return MixedCache.init(
            spec, batch, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers, dense_policy=dense
        )
    return policy_class(policy, spec).init(
        spec, batch, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers
    )


def _describe_layers(cache) -> str:
    if isinstance(cache, MixedCache):
        return f"dense k {list(cache.dense.k.shape)} + dilated k {list(cache.dilated.k.shape)}"
    if getattr(cache, "is_per_layer", False):
        return f"{len(cache.k)} per-layer k {list(cache.k[0].shape)}"
    return f"k {list(cache.k.shape)}"


def forward_chunk(
    params,
    config: WanConfig,
    cache,
    cross: CrossKV,
    latents,
    timesteps,
    *,
    rope: str = "absolute",
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
    remat: bool = False,
):
    """One chunk of a stream: the flow prediction of the cache's reserved chunk, and the cache with its K/V written.

    The caller reserves the chunk (``cache = cache.begin_chunk()``) once, then may call this any number of times for
    that chunk (each denoising step overwrites the chunk's slot; the last write wins).

    Args:
      cache: stacked `RingCache`/`RollingCache`/`DilatedCache` [layers=num_layers, batch, capacity, heads,
        head_dim], or a `MixedCache` of num_layers layers (`init_cache`), whose spec's chunk equals this chunk's
        tokens (frames/pt * height/ph * width/pw).
      cross: `cross_kv` of the text context, k and v [layers, batch, text_tokens, heads, head_dim] with batch rows
        matching the cache's sessions (any text_tokens >= 1: padded to text_len or not).
      latents: [batch, chunk_frames, height, width, in_dim].
      timesteps: float [batch] or [batch, chunk_frames // pt].
      rope: "absolute" (keys rotated at their positions before the write) or "cache-relative" (keys cached
        unrotated; q and the cached keys rotated by rank at read, `cache_relative_rope`). A cache must be used in
        one mode throughout.
      backend: the attention backend (`jaxkv.attend`'s names; default "auto").
      precision: the dtype policy (`jaxkv.precision.Precision` or a preset name; default float32): params in its
        param_dtype, the cache and the cross K/V in its cache_dtype (`init_cache(..., dtype=precision.cache_dtype)`,
        `cross_kv(..., precision=precision)`).
      run: a `jaxkv.run_options.RunOptions` holding both instead (``run=rc.run``; TypeError if given with either).
      remat: each block under `jax.checkpoint`, for a gradient through the chunk (as `forward_teacher_forcing`).
    Returns:
      (flow float32 [batch, chunk_frames, height, width, out_dim], updated cache).
    """
    check_rope_mode(rope)
    run = _run_of(params, run, backend, precision, "forward_chunk")
    latents = jnp.asarray(latents)
    gf, gh, gw = _check_latents(config, latents)
    b = latents.shape[0]
    n = gf * gh * gw
    if cache.layers != config.num_layers or cache.heads != config.num_heads or cache.head_dim != config.head_dim:
        raise ValueError(
            f"cache must be stacked as [layers={config.num_layers}, batch, capacity, "
            f"heads={config.num_heads}, head_dim={config.head_dim}], got "
            f"{_describe_layers(cache)}"
        )
    if cache.batch != b:
        raise ValueError(f"cache has {cache.batch} sessions but latents have batch {b}")
    if cache.spec.chunk != n:
        raise ValueError(
            f"cache chunk is {cache.spec.chunk} tokens but the latents chunk has {n} ({gf} frames x {gh}x{gw} patches)"
        )
    _check_cross(config, cross, b)
    _check_cache_dtypes(cache, cross, run)
    # The cache's own check sits inside the layer scan, where chunk_start is a tracer: check here, before the scan.
    if is_concrete(cache.chunk_start) and bool(jnp.all(cache.chunk_start < 0)):
        raise ValueError(
            "forward_chunk: no session has a reserved chunk (chunk_start < 0 for every session); call "
            "cache = cache.begin_chunk() before the chunk's first forward"
        )

    # One attention plan for every layer and pass: positions are shared by all layers, and every write leaves the
    # same read positions (`ChunkCache.read_positions`). A MixedCache has two sets of positions: planned per call.
    # FP8 attention (`fp8_attend`) decides its own path per call: no plan.
    plan = None
    if not isinstance(cache, MixedCache) and not run.precision.fp8_attention:
        plan = plan_attention(cache.chunk_positions(), cache.read_positions(), cache.spec.mask())

    if rope == "absolute" and not run.precision.fp8_attention:

        def self_attention(q, k, v, cache, layer):
            return cached_attention(cache, q, k, v, layer=layer, run=run, plan=plan)  # cache.spec.mask()
    elif rope == "absolute":  # FP8 attention: the same write and read, attended by `fp8_attend`

        def self_attention(q, k, v, cache, layer):
            dtype = cache.dtype
            cache = cache.write(k.astype(dtype), v.astype(dtype), layer=layer)
            kc, vc = cache.layer_kv(layer)
            out = fp8_attend(
                q.astype(dtype),
                kc,
                vc,
                cache.chunk_positions(),
                cache.positions,
                mask=cache.spec.mask(),
                backend=run.backend,
            )
            return out.astype(q.dtype), cache
    else:
        attend_fn = fp8_attend if run.precision.fp8_attention else attend

        def self_attention(q, k, v, cache, layer):
            dtype = cache.dtype
            cache = cache.write(k.astype(dtype), v.astype(dtype), layer=layer)
            kc, vc = cache.layer_kv(layer)
            return _relative_attend(
                q,
                kc,
                vc,
                cache.chunk_positions(),
                cache.positions,
                cache.spec.mask(),
                (gh, gw),
                config,
                run,
                attend_fn,
                plan=plan,
            ), cache

    return _dit(
        params,
        config,
        latents,
        timesteps,
        cache.chunk_positions(),
        cross,
        self_attention,
        cache,
        run,
        rotate=rope == "absolute",
        remat=remat,
    )


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


def _check_cross(config: WanConfig, cross: CrossKV, batch: int) -> None:
    expected = [config.num_layers, batch, "text_tokens", config.num_heads, config.head_dim]
    if cross.is_per_layer:
        shapes = {tuple(x.shape) for x in (*cross.k, *cross.v)}
        if len(cross.k) != config.num_layers or len(cross.v) != config.num_layers or len(shapes) != 1:
            raise ValueError(
                f"per-layer cross K/V must be {config.num_layers} k and v arrays of one shape [batch, text_tokens, "
                f"heads, head_dim]; got {len(cross.k)} k and {len(cross.v)} v of shapes {sorted(shapes)}"
            )
        k_shape = v_shape = (config.num_layers, *shapes.pop())
    else:
        k_shape, v_shape = tuple(cross.k.shape), tuple(cross.v.shape)
    if (
        len(k_shape) != 5
        or k_shape != v_shape
        or k_shape[2] < 1
        or (k_shape[0], k_shape[1], k_shape[3], k_shape[4])
        != (config.num_layers, batch, config.num_heads, config.head_dim)
    ):
        raise ValueError(
            f"cross K/V must both be [layers, batch, text_tokens, heads, head_dim] = {expected}, "
            f"got k {list(k_shape)}, v {list(v_shape)}"
        )


def _check_cache_dtypes(cache, cross: CrossKV, run: RunOptions) -> None:
    precision = run.precision
    if isinstance(cache, Fp8Cache) != precision.fp8_kv:
        raise ValueError(
            f"the cache is {'an FP8' if isinstance(cache, Fp8Cache) else 'a ' + jnp.dtype(cache.dtype).name} cache "
            f"but the precision's fp8_kv is {precision.fp8_kv}; build the cache with init_cache(..., "
            f"fp8=precision.fp8_kv) or pass the matching precision"
        )
    # Every layer's text K/V (one stack, or a tuple per layer; arrays or abstract ShapeDtypeStructs).
    text = [("cross K", a.dtype) for a in jax.tree.leaves(cross.k)] + [
        ("cross V", a.dtype) for a in jax.tree.leaves(cross.v)
    ]
    for name, dtype in (("cache", cache.dtype), *text):
        if jnp.dtype(dtype) != jnp.dtype(precision.cache_dtype):
            raise ValueError(
                f"the {name} is {jnp.dtype(dtype).name} but the precision's cache_dtype is "
                f"{precision.cache_dtype}; build both with it (init_cache(..., dtype="
                f"precision.cache_dtype), cross_kv(..., precision=precision)) or pass that precision"
            )


def recompute_cache(
    params,
    config: WanConfig,
    cache,
    cross: CrossKV,
    latents,
    timesteps,
    *,
    keep=None,
    rope: str = "absolute",
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
):
    """Recomputes every slot's K/V from the latents the cache's slots hold, in one forward (KV re-cache).

    The slots are run as one sequence in the cache's physical order, each token at its stored position, under the
    cache's own mask (`RingSpec.mask`: chunk-causal, the window, the sink), so every retained chunk sees exactly
    the retained chunks a stream showed it (the block-causal training mask over what is held) and nothing is
    gathered. Each layer's new K/V replace that layer's whole buffer (one update in the scan carry); positions and
    the reserved chunk are unchanged.

    Args:
      cache: stacked cache [layers, batch, capacity, heads, head_dim] whose slots all hold whole chunks.
      cross: cross K/V [layers, batch, text_tokens, heads, head_dim] of the context to recompute under.
      latents: [batch, num_slots * chunk_frames, height, width, in_dim]: slot j's chunk at frames
        [j * chunk_frames, (j + 1) * chunk_frames) (anything finite for empty slots: they stay invisible).
      timesteps: float [batch] or [batch, frames], e.g. the context-pass timestep.
      keep: optional bool [batch, capacity]: slots whose cached K/V stay as they are (and are what the others
        attend to), e.g. the sink.
      rope: the cache's RoPE mode (see `forward_chunk`).
      backend, precision, run: how the model runs (see `forward_chunk`).
    Returns:
      the cache with recomputed K/V.
    """
    check_rope_mode(rope)
    run = _run_of(params, run, backend, precision, "recompute_cache")
    if isinstance(cache, Fp8Cache):
        raise ValueError("recompute_cache does not rebuild an FP8 cache (fp8_kv); re-cache with a bf16 cache")
    if isinstance(cache, MixedCache) or not isinstance(cache.spec, RingSpec):
        raise ValueError(
            f"recompute_cache rebuilds a sink + window cache (ring or rolling, a RingSpec); a "
            f"{type(cache).__name__} (dilated layers) is re-cached by replay: jaxkv.recache.switch_prompt"
        )
    latents = jnp.asarray(latents)
    gf, gh, gw = _check_latents(config, latents)
    b = latents.shape[0]
    if cache.layers != config.num_layers or cache.heads != config.num_heads or cache.head_dim != config.head_dim:
        raise ValueError(
            f"cache must be stacked as [layers={config.num_layers}, batch, capacity, "
            f"heads={config.num_heads}, head_dim={config.head_dim}], got {_describe_layers(cache)}"
        )
    if cache.batch != b or gf * gh * gw != cache.spec.capacity:
        raise ValueError(
            f"latents must fill the cache's slots: [batch={cache.batch}, frames, h, w, in_dim] with "
            f"frames * h * w / patch = capacity {cache.spec.capacity} tokens, got {list(latents.shape)} "
            f"({gf * gh * gw} tokens)"
        )
    if keep is not None:
        keep = jnp.asarray(keep)
        if keep.shape != cache.positions.shape or keep.dtype != jnp.bool_:
            raise ValueError(f"keep must be bool {list(cache.positions.shape)}, got {keep.dtype}{list(keep.shape)}")
    _check_cross(config, cross, b)
    _check_cache_dtypes(cache, cross, run)
    positions, mask = cache.positions, cache.spec.mask()

    def self_attention(q, k, v, cache, layer):
        dtype = cache.dtype
        old_k, old_v = cache.layer_kv(layer)
        k, v = k.astype(dtype), v.astype(dtype)
        if keep is not None:
            sel = keep[:, :, None, None]
            k, v = jnp.where(sel, old_k, k), jnp.where(sel, old_v, v)
        cache = cache.replace_layer(layer, k, v)
        if rope == "absolute":
            out = attend(
                q.astype(dtype), k, v, positions, positions, mask=mask, backend=run.backend, interpret=run.interpret
            ).astype(q.dtype)
        else:
            out = _relative_attend(q, k, v, positions, positions, mask, (gh, gw), config, run)
        return out, cache

    return _dit(
        params,
        config,
        latents,
        timesteps,
        positions,
        cross,
        self_attention,
        cache,
        run,
        rotate=rope == "absolute",
    )[1]
