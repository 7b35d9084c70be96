"""FP8 (e4m3) attention: cuDNN's FP8 flash attention where the GPU has it, an emulation of its rounding elsewhere.

`fp8_attend` takes q, k, v in a float dtype (e.g. bfloat16 K/V read from an `jaxkv.cache.fp8.Fp8Cache`) and
quantizes each to FP8 with one per-tensor scale (`jaxkv.fp8`: amax / 448), which is what cuDNN's FP8 kernel takes
(scalar descale factors). The kernel multiplies FP8 q by FP8 k with float32 accumulation, runs the softmax in float32,
stores the probabilities P in FP8 (scale 448: P <= 1) for the P @ V product and writes the output in FP8 (scale
amax(v) / 448: every output row is a convex combination of values, so |o| <= amax(v)); `fp8_attention_emulated`
applies exactly those five roundings (q, k, v, P, o) around float32 math, densely, with the position mask.

Paths:
* GPU with cuDNN FP8 attention (`cudnn_fp8_supported`: a CUDA device of compute capability >= 8.9, jax's fused
  attention module with its FP8 entry point, head_dim a multiple of 16 up to 256), backend "auto" or "cudnn": the
  cuDNN FP8 kernel when every cached key is visible to every query (a full ring in the steady state: cuDNN's FP8
  entry takes no mask and no lengths), checked at run time with `jaxkv.attention.cudnn.lengths_if_exact`; otherwise
  (the ring still filling) the plain `attend` on the same q, k, v, under ``lax.cond``.
* CPU: `fp8_attention_emulated` (dense: [batch, heads, q_len, kv_len] float32 logits; meant for the quality
  measurements at small sizes, not for speed).
* Any other case (a GPU without FP8 attention, another backend asked for): a ValueError at trace time, never a
  silent fallback to another precision.

The emulation rounds where the kernel does, but is not bit-exact with it: a flash kernel exponentiates each key
block against the running row maximum when it quantizes P (the emulation uses the final maximum), and it sums the
row's probabilities before quantizing them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv import fp8
from jaxkv.attention.checks import check_inputs, check_scale
from jaxkv.attention.dispatch import attend
from jaxkv.attention.masks import MaskSpec, as_mask, visible

P_SCALE = fp8.E4M3_MAX  # P in [0, 1] is stored as fp8(P * 448)
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later: FP8 tensor cores


def fp8_attention_emulated(q, k, v, q_positions, kv_positions, *, mask: MaskSpec | None = None, scale=None):
    """Attention with cuDNN FP8's roundings (see the module docstring) around float32 math, position-masked.

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim] (any float dtypes;
        q_heads % kv_heads == 0).
      q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty slot, never visible).
      mask: the position mask (`MaskSpec`), default none beyond the empty slots.
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype; a query that sees no key gets zeros.
    """
    b, lq, hq, _, hk, d = check_inputs(q, k, v, q_positions, kv_positions)
    groups = hq // hk
    scale = check_scale(scale, d)
    valid = (kv_positions >= 0)[:, :, None, None]
    # empty slots may hold anything (NaN included): they must not set a scale nor reach p @ v
    k = jnp.where(valid, k.astype(jnp.float32), 0.0)
    v = jnp.where(valid, v.astype(jnp.float32), 0.0)
    sq, sk, sv = fp8.scale_of(q), fp8.scale_of(k), fp8.scale_of(v)
    q8, k8, v8 = fp8.quantize(q, sq), fp8.quantize(k, sk), fp8.quantize(v, sv)
    qf = q8.astype(jnp.float32).reshape(b, lq, hk, groups, d)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k8.astype(jnp.float32)) * (sq * sk * scale)
    seen = visible(q_positions, kv_positions, as_mask(mask))[:, None, None]
    logits = jnp.where(seen, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    p8 = fp8.quantize(p, 1.0 / P_SCALE)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p8.astype(jnp.float32), v8.astype(jnp.float32)) * (sv / P_SCALE)
    out = fp8.dequantize(fp8.quantize(out, sv), sv)  # the FP8 output, |o| <= amax(v)
    return out.reshape(b, lq, hq, d).astype(q.dtype)


def cudnn_fp8_supported(head_dim: int) -> bool:
    """Whether cuDNN FP8 attention can run here (static): a CUDA GPU of compute capability >= 8.9, jax's fused
    attention module with its FP8 entry point, and head_dim % 16 == 0, <= 256."""
    if not (head_dim % 16 == 0 and head_dim <= 256):
        return False
    try:
        device = jax.devices()[0]
        if device.platform != "gpu":
            return False
        major, minor = (int(x) for x in str(getattr(device, "compute_capability", "0.0")).split(".")[:2])
        from jax._src.cudnn import fused_attention_stablehlo as fa

        return (major, minor) >= MIN_CAPABILITY and hasattr(fa, "fp8_params_keys")
    except Exception:  # noqa: BLE001 - any failure of the probe means FP8 attention is not available
        return False


def cudnn_fp8_call(q, k, v, scale: float):
    """cuDNN's FP8 flash attention on q [batch, q_len, heads, head_dim], k, v [batch, kv_len, heads, head_dim] (any
    float dtype, quantized here per tensor), no mask; the output dequantized to q's dtype. GPU only."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    sq, sk, sv = fp8.scale_of(q), fp8.scale_of(k), fp8.scale_of(v)
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    as4 = lambda x: jnp.reshape(jnp.asarray(x, jnp.float32), (1, 1, 1, 1))
    params = dict.fromkeys(fa.fp8_params_keys, one)
    params.update(
        descale_q=as4(sq),
        descale_k=as4(sk),
        descale_v=as4(sv),
        descale_s=as4(1.0 / P_SCALE),
        scale_s=as4(P_SCALE),
        scale_o=as4(1.0 / sv),
        descale_o=as4(sv),
    )
    out8, _, _ = fa.dot_product_attention(
        fp8.quantize(q, sq),
        fp8.quantize(k, sk),
        fp8.quantize(v, sv),
        fp8_params=params,
        scale=scale,
        use_fp8=True,
        qkv_layout="BTNH",
    )
    return fp8.dequantize(out8, sv, q.dtype)


def fp8_attend(q, k, v, q_positions, kv_positions, *, mask: MaskSpec | None = None, backend: str = "auto"):
    """Position-masked attention with FP8 q, k, v, P and output: cuDNN FP8 on a capable GPU when every key is
    visible, `attend` (``backend``) there otherwise, `fp8_attention_emulated` on any other platform.

    Args/returns as `jaxkv.attention.attend` (q, k, v of one float dtype; the output in q's dtype).
    """
    from jaxkv.attention.cudnn import lengths_if_exact

    _, _, _, _, _, d = check_inputs(q, k, v, q_positions, kv_positions)
    spec = as_mask(mask)
    if jax.default_backend() == "cpu":
        return fp8_attention_emulated(q, k, v, q_positions, kv_positions, mask=spec)
    if backend not in ("auto", "cudnn") or not cudnn_fp8_supported(d):
        raise ValueError(
            f"FP8 attention needs cuDNN's FP8 kernel (a GPU of compute capability >= 8.9, head_dim % 16 == 0) and "
            f"backend 'auto' or 'cudnn'; got backend {backend!r}, head_dim {d} on {jax.devices()[0].device_kind}. "
            f"Use a precision without fp8_attention (the FP8 cache alone still halves the cache)"
        )
    q_positions, kv_positions = q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32)
    lengths, exact = lengths_if_exact(q_positions, kv_positions, spec)
    full = exact & jnp.all(lengths == kv_positions.shape[1])
    return lax.cond(
        full,
        lambda: cudnn_fp8_call(q, k, v, check_scale(None, d)),
        lambda: attend(q, k, v, q_positions, kv_positions, mask=spec, backend=backend).astype(q.dtype),
    )
