"""cuDNN flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) where a position mask reduces to
per-session valid key counts.

cuDNN takes no per-key positions: besides causal/local masks by *index* (wrong on a ring), its only mask is
``key_value_seq_lengths`` — session b attends slots [0, length_b). That equals the position mask exactly when

1. the valid slots (position >= 0) of every session form a prefix of physical slot order, and
2. every valid key is visible to every query of its session.

Both hold in a streaming Wan step (`jaxkv.models.wan.forward_chunk`): a ring or rolling cache fills its slots in
order and never holds a key later than the chunk being denoised, RoPE is applied before the write, and the mask is
chunk-causal only — so attention reads every cached key (tests/test_cudnn.py proves the invariant on the real
caches through fill, wrap and reset). They are *checked* at run time too: `cudnn_attention` computes
`lengths_if_exact` and runs the fallback (the Pallas ring kernel, or XLA) under ``lax.cond`` whenever they fail, so
the result never depends on the caller having got the invariant right.

What is decided where (the positions are the same for every layer and every denoising pass of a chunk):

* `plan_attention` reduces the mask of one set of positions once, to a `Plan`: ALL_VISIBLE (every slot valid and
  visible to every query: a full ring; cuDNN runs with no mask at all), LENGTHS (a valid prefix, all visible:
  ``key_value_seq_lengths``) or FALLBACK. A model computes it once per chunk forward, outside its layer loop, and
  hands it to every call (`jaxkv.attend(..., plan=)`); each call then only branches on it. A plan whose mode is a
  Python int (`ALL_VISIBLE_PLAN`, for cross-attention to text keys that are always all visible) is static: no
  branch, no check.
* With every key visible, the keys may be split in equal parts run as extra batch rows of one call and merged by
  float32 log-sum-exp (`jaxkv.attention.split`), where the table `SPLIT_KV` says that wins for (keys, queries).
  That needs cuDNN's float32 softmax statistics, which ``jax.nn.dot_product_attention(return_residual=True)``
  rounds to the output dtype: `cudnn_call` takes them from jax's residual-returning cuDNN entry point
  (`lse_entry_point`), and splits only where it exists.

cuDNN needs float16/bfloat16 q, k, v of one dtype and head_dim a multiple of 8 up to 256 (`static_ok`); on a CPU-only
jaxlib the call refuses to trace ("cuDNN is not detected"), so this path is selected only on GPU.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention.checks import check_inputs, check_scale
from jaxkv.attention.masks import MaskSpec, as_mask, block_all_visible
from jaxkv.attention.split import check_parts, split_attention
from jaxkv.attention.xla_cpu import _INT_MAX

DTYPES = (jnp.float16, jnp.bfloat16)

# Plan modes, in the order of `cudnn_attention`'s branches.
FALLBACK, LENGTHS, ALL_VISIBLE = 0, 1, 2

# Split-KV table: (keys, queries) -> parts, for the calls where every key is visible (ALL_VISIBLE). A shape not
# listed runs as one call. Keyed on the call's shape only (heads, head_dim and batch as the entry was measured at).
# Entries come from measurements on a GPU (benchmarks/gpu_check.py's ``attention_plans`` prints the rows to add):
#   (32760, 4680): Wan 2.1 1.3B at 480x832, sink 3 + window 18 frames, 12 x 128 heads, batch 1, bf16, H200:
#   the cuDNN kernel alone ran 553 TFLOP/s with no mask and 614 with the keys in two halves merged by float32 LSE
#   (two calls, measured 2026-12-04); this module's one-call form of the split is not yet measured there.
# Update it in place (``SPLIT_KV[(keys, queries)] = parts``) before tracing to try another entry.
SPLIT_KV: dict[tuple[int, int], int] = {(32760, 4680): 2}


def split_parts(kv_len: int, q_len: int) -> int:
    """How many key parts an all-visible cuDNN call over kv_len keys and q_len queries runs as (`SPLIT_KV`; 1 for
    a shape not in the table, or when the residual entry point is missing)."""
    parts = SPLIT_KV.get((int(kv_len), int(q_len)), 1)
    if parts > 1 and lse_entry_point() is None:
        return 1
    return check_parts(kv_len, parts)


class Plan(NamedTuple):
    """How the position mask over one set of positions reduces for cuDNN (`plan_attention`).

    mode: int32 [] (decided at run time) or a Python int (known at trace time): FALLBACK, LENGTHS or ALL_VISIBLE.
    lengths: int32 [batch] valid keys per session (the LENGTHS call's ``key_value_seq_lengths``); None with a
      static ALL_VISIBLE mode.
    """

    mode: jax.Array | int
    lengths: jax.Array | None


# Every key visible to every query, known before tracing (cross-attention to text keys, no mask).
ALL_VISIBLE_PLAN = Plan(ALL_VISIBLE, None)


def static_ok(head_dim: int, dtypes, rope) -> bool:
    """What cuDNN's fused attention accepts, known at trace time: one half dtype, head_dim % 8 == 0 and <= 256, and
    no cache-relative RoPE (keys would need rotating at read)."""
    dtypes = {jnp.dtype(d) for d in dtypes}
    return (
        rope is None
        and len(dtypes) == 1
        and dtypes.pop() in {jnp.dtype(d) for d in DTYPES}
        and head_dim % 8 == 0
        and 8 <= head_dim <= 256
    )


def lengths_if_exact(q_positions, kv_positions, spec: MaskSpec):
    """(lengths int32 [batch], exact bool []): valid keys per session, and whether attending slots [0, length) of
    every session is exactly the position mask (conditions 1 and 2 above, and at least one key per session: cuDNN's
    result for an empty session is not the zeros jaxkv promises).

    q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty).
    """
    valid = kv_positions >= 0
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
    prefix = jnp.all(valid == (jnp.arange(kv_positions.shape[1])[None, :] < lengths[:, None]))
    q_lo, q_hi = jnp.min(q_positions, axis=1), jnp.max(q_positions, axis=1)
    # The window clause needs only the oldest key outside the sink (sink keys are never hidden by the window).
    k_lo = jnp.min(jnp.where(valid & (kv_positions >= spec.sink), kv_positions, _INT_MAX), axis=1)
    k_hi = jnp.max(jnp.where(valid, kv_positions, -1), axis=1)
    # k_min = 0: empty slots are excluded by the lengths, so only the valid keys must all be visible.
    every = jnp.all(block_all_visible(q_lo, q_hi, jnp.zeros_like(k_lo), k_lo, k_hi, spec))
    return lengths, prefix & every & jnp.all(lengths > 0)


def plan_attention(q_positions, kv_positions, mask: MaskSpec) -> Plan:
    """The `Plan` of the position mask ``mask`` over these positions, decided at run time (a few reductions over
    the positions: compute it once for every call that shares them).

    q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty).
    """
    q_positions, kv_positions = q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32)
    lengths, exact = lengths_if_exact(q_positions, kv_positions, mask)
    full = exact & jnp.all(lengths == kv_positions.shape[1])
    mode = jnp.where(full, ALL_VISIBLE, jnp.where(exact, LENGTHS, FALLBACK)).astype(jnp.int32)
    return Plan(mode, lengths)


def lse_entry_point():
    """jax's cuDNN attention entry point that returns the float32 softmax statistics (``return_residual``), or
    None where this jax has none (then no call is split). Internal to jax: checked by name and signature."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:  # pragma: no cover - depends on the jax build
        return None
    fn = getattr(fa, "dot_product_attention", None)
    if fn is None or not hasattr(fa, "MaskType"):
        return None
    names = inspect.signature(fn).parameters
    if not {"return_residual", "kv_seqlen", "q_seqlen", "mask_type", "qkv_layout", "scale"} <= set(names):
        return None
    return fn


def cudnn_call(q, k, v, lengths, scale: float, return_lse: bool = False):
    """The fused kernel: out [batch, q_len, q_heads, head_dim], attending slots [0, lengths[b]) of each session,
    or every slot when ``lengths`` is None (no mask).

    With ``return_lse``: (out, lse float32 [batch, q_len, q_heads]), the natural-log log-sum-exp of the scaled
    logits, from `lse_entry_point` (the public API rounds it to the output dtype).
    """
    if not return_lse:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=lengths, implementation="cudnn")
    fn = lse_entry_point()
    if fn is None:
        raise NotImplementedError("this jax has no residual-returning cuDNN attention entry point")
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    kw = dict(mask_type=MaskType.NO_MASK)
    if lengths is not None:
        q_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
        kw = dict(mask_type=MaskType.PADDING, q_seqlen=q_lengths, kv_seqlen=lengths)
    out, stats = fn(q, k, v, scale=scale, qkv_layout="BTNH", return_residual=True, **kw)
    return out, jnp.transpose(stats, (0, 2, 1)).astype(jnp.float32)  # [B, N, T] -> [B, T, N]


def cudnn_attention(
    q,
    k,
    v,
    q_positions,
    kv_positions,
    *,
    fallback: Callable,
    mask: MaskSpec | None = None,
    causal=False,
    chunk=None,
    window=None,
    sink=0,
    scale=None,
    plan: Plan | None = None,
    parts: int | None = None,
    kernel: Callable | None = None,
):
    """Position-masked attention on cuDNN when the mask reduces to no mask or a valid-prefix mask, else ``fallback``.

    Args:
      q: [batch, q_len, q_heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim] (float16/bfloat16).
      q_positions: int [batch, q_len]; kv_positions: int [batch, kv_len] (negative = empty).
      fallback: ``fallback(q, k, v, q_positions, kv_positions) -> out`` computing the same mask any other way (the
        Pallas ring kernel on GPU); run under ``lax.switch`` when the plan says cuDNN would be wrong.
      mask: the position mask, a `MaskSpec` (or its fields as the keywords causal, chunk, window, sink).
      plan: `plan_attention` of exactly these positions and mask, made once for many calls (default: made here). A
        plan of other positions gives wrong results; a static ALL_VISIBLE plan skips every check.
      parts: split-KV parts for the all-visible call (default `split_parts` of the shape; 1 = one call).
      kernel: the cuDNN call, ``kernel(q, k, v, lengths or None, scale, return_lse=False)``; default this module's
        `cudnn_call`, looked up at trace time (so tests and dry runs on CPU can stand in for it, here or module-wide;
        ``return_lse`` is asked for only when splitting).
    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype.
    """
    _, _, _, _, _, d = check_inputs(q, k, v, q_positions, kv_positions)
    spec = as_mask(mask, causal=causal, chunk=chunk, window=window, sink=sink)
    scale = check_scale(scale, d)
    if not static_ok(d, (q.dtype, k.dtype, v.dtype), None):
        raise ValueError(
            f"cuDNN attention needs float16/bfloat16 q, k, v of one dtype and head_dim % 8 == 0, "
            f"<= 256; got {q.dtype}/{k.dtype}/{v.dtype}, head_dim {d}"
        )
    q_positions, kv_positions = q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32)
    kernel = cudnn_call if kernel is None else kernel
    parts = split_parts(k.shape[1], q.shape[1]) if parts is None else check_parts(k.shape[1], parts)
    if plan is None:
        plan = plan_attention(q_positions, kv_positions, spec)
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a jaxkv.attention.cudnn.Plan, got {type(plan).__name__}")

    def all_visible():
        if parts == 1:
            return kernel(q, k, v, None, scale).astype(q.dtype)
        one = lambda q_, k_, v_: kernel(q_, k_, v_, None, scale, return_lse=True)
        return split_attention(one, q, k, v, parts)[0]

    if isinstance(plan.mode, int):  # known at trace time
        if plan.mode != ALL_VISIBLE:
            raise ValueError(f"a static plan must be ALL_VISIBLE ({ALL_VISIBLE}), got mode {plan.mode}")
        return all_visible()
    if plan.lengths is None or plan.lengths.shape != (q.shape[0],):
        raise ValueError(f"a run-time plan needs lengths int32 [{q.shape[0]}], got {plan.lengths!r}")
    return lax.switch(
        plan.mode,
        (
            lambda: fallback(q, k, v, q_positions, kv_positions).astype(q.dtype),
            lambda: kernel(q, k, v, plan.lengths, scale).astype(q.dtype),
            all_visible,
        ),
    )
