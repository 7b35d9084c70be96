"""The cuDNN path (`jaxkv.attention.cudnn`): the invariant that makes per-session lengths sufficient, proved on the
real caches; the run-time check and its fallback; backend selection. The cuDNN call itself refuses to trace on a
CPU-only jaxlib ("cuDNN is not detected"), so here a stand-in computes "attend slots [0, length)" independently and
benchmarks/gpu_check.py runs the real kernel on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import CacheRope, MaskSpec, attend, cudnn, dense_attention, visible
from jaxkv.attention.dispatch import resolve_backend
from jaxkv.models.wan.model import init_cache
from tests.helpers.attention_cases import make_case, permuted, physical

lengths_if_exact = jax.jit(cudnn.lengths_if_exact, static_argnums=2)


def by_lengths(q, k, v, lengths, scale):
    """What cuDNN computes with key_value_seq_lengths, written independently: softmax over slots [0, length) (every
    slot when lengths is None: the call with no mask)."""
    b, lq, hq, d = q.shape
    g = hq // k.shape[2]
    lengths = jnp.full((b,), k.shape[1]) if lengths is None else lengths
    keep = jnp.arange(k.shape[1])[None, :] < lengths[:, None]  # [b, k]
    kf = jnp.repeat(k.astype(jnp.float32), g, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * scale
    s = jnp.where(keep[:, None, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vf).astype(q.dtype)


@pytest.mark.parametrize("policy", ["ring", "rolling"])
@pytest.mark.parametrize("sink_frames", [0, 3])
def test_streaming_step_mask_is_a_valid_prefix_on_the_real_caches(policy, sink_frames):
    # The streaming Wan step's state at attention time (chunk reserved, then written), through fill, several
    # wraps and a reset of one session: valid slots are a prefix of physical order and the step's chunk-causal
    # mask shows each query exactly those slots. So cuDNN's lengths are exact for it.
    cfg = jaxkv.models.wan.preset("tiny")
    tpf, chunk_frames = 4, 3
    spec = jaxkv.RingSpec.from_frames(tpf, chunk_frames, 9, sink_frames)
    cache = init_cache(cfg, spec, 2, policy=policy)
    k = jnp.ones((2, spec.chunk, cfg.num_heads, cfg.head_dim))
    step = jax.jit(lambda c: c.begin_chunk().write(k, k, layer=0))
    reset = jax.jit(lambda c: c.reset(jnp.array([False, True])))
    mask = MaskSpec(chunk=spec.chunk)
    seen_full = seen_partial = False
    for n in range(12):
        if n == 7:
            cache = reset(cache)  # session 1 starts over while session 0 keeps streaming
        cache = step(cache)
        qp, kp = cache.chunk_positions(), cache.positions
        lengths, exact = lengths_if_exact(qp, kp, mask)
        assert bool(exact), (n, np.asarray(kp))
        want = visible(qp, kp, chunk=spec.chunk)  # [b, q, k] by positions
        prefix = np.arange(kp.shape[1])[None, :] < np.asarray(lengths)[:, None]
        np.testing.assert_array_equal(want, np.broadcast_to(prefix[:, None], want.shape))
        seen_full |= bool(np.any(np.asarray(lengths) == kp.shape[1]))
        seen_partial |= bool(np.any(np.asarray(lengths) < kp.shape[1]))
    assert seen_full and seen_partial


def test_lengths_are_refused_where_they_would_be_wrong():
    case = make_case(0, written=(8, 3), head_dim=16)
    _, _, _, qp, pos = physical(case, case["pos"])
    # A wrapped ring is a prefix (all full) and session 1 fills in order: exact under the streaming mask.
    assert bool(lengths_if_exact(qp, pos, MaskSpec(chunk=4))[1])
    # Not a prefix: empty slots scattered through physical order.
    assert not bool(lengths_if_exact(qp, jnp.asarray(permuted(np.asarray(pos), 3)), MaskSpec(chunk=4))[1])
    # A prefix, but not every key visible: causal inside the chunk, or a window the ring holds more than.
    assert not bool(lengths_if_exact(qp, pos, MaskSpec(causal=True))[1])
    assert not bool(lengths_if_exact(qp, pos, MaskSpec(chunk=4, window=4))[1])
    # The sink: a window that with the sink covers the whole ring is exact.
    assert bool(lengths_if_exact(qp, pos, MaskSpec(chunk=4, window=12, sink=4))[1])
    # An empty session: no length-0 call (cuDNN's output there is not jaxkv's zeros).
    empty = pos.at[1].set(-1)
    assert not bool(lengths_if_exact(qp, empty, MaskSpec(chunk=4))[1])


def _run(q, k, v, qp, pos, mask, kernel):
    fallback = lambda *a: dense_attention(*a, **mask)
    return jax.jit(lambda *a: cudnn.cudnn_attention(*a, fallback=fallback, kernel=kernel, **mask))(q, k, v, qp, pos)


@pytest.mark.parametrize("written", [(8, 3), (2, 1)])
def test_lengths_give_the_position_mask_result_and_the_fallback_covers_the_rest(written):
    case = make_case(1, written=written, head_dim=16, dtype=jnp.bfloat16)
    q, k, v, qp, pos = physical(case, case["pos"])
    mask = dict(chunk=4)
    want = np.asarray(dense_attention(q, k, v, qp, pos, **mask), np.float32)
    got = np.asarray(_run(q, k, v, qp, pos, mask, by_lengths), np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2)
    # Routing, with sentinels: the kernel runs when the lengths are exact, the fallback otherwise.
    sentinel = lambda q, k, v, lengths, scale: jnp.full(q.shape, 7.0, q.dtype)
    assert np.all(np.asarray(_run(q, k, v, qp, pos, mask, sentinel), np.float32) == 7.0)
    shuffled = jnp.asarray(permuted(np.asarray(pos), 4))
    if written == (2, 1):  # partially filled rings: shuffling breaks the prefix, so the fallback must run
        out = np.asarray(_run(q, k, v, qp, shuffled, mask, sentinel), np.float32)
        np.testing.assert_allclose(
            out, np.asarray(dense_attention(q, k, v, qp, shuffled, **mask), np.float32), atol=1e-6
        )
    causal = np.asarray(_run(q, k, v, qp, pos, dict(causal=True), sentinel), np.float32)
    np.testing.assert_allclose(
        causal, np.asarray(dense_attention(q, k, v, qp, pos, causal=True), np.float32), atol=1e-6
    )


def test_backend_selection():
    kw = dict(head_dim=128, dtypes=(jnp.bfloat16,) * 3, rope=None, logits=10)
    assert resolve_backend("auto", platform="gpu", **kw) == "cudnn"
    assert resolve_backend("auto", platform="gpu", **{**kw, "dtypes": (jnp.float16,) * 3}) == "cudnn"
    # What cuDNN cannot take goes to the ring kernel (or XLA where the kernel cannot either).
    assert resolve_backend("auto", platform="gpu", **{**kw, "dtypes": (jnp.float32,) * 3}) == "pallas"
    assert resolve_backend("auto", platform="gpu", **{**kw, "rope": CacheRope()}) == "pallas"
    assert (
        resolve_backend("auto", platform="gpu", **{**kw, "dtypes": (jnp.bfloat16, jnp.float32, jnp.float32)})
        == "xla_dense"
    )
    assert resolve_backend("auto", platform="gpu", **{**kw, "head_dim": 100}) == "xla_dense"
    assert resolve_backend("auto", platform="cpu", **kw) == "xla_cpu"
    assert resolve_backend("cudnn", **kw) == "cudnn"
    for bad in ({"dtypes": (jnp.float32,) * 3}, {"head_dim": 100}, {"head_dim": 512}, {"rope": CacheRope()}):
        with pytest.raises(ValueError, match="backend 'cudnn' needs"):
            resolve_backend("cudnn", **{**kw, **bad})


def test_cudnn_attention_rejects_unsupported_inputs_before_tracing_the_kernel():
    case = make_case(2, head_dim=12)
    q, k, v, qp, pos = physical(case, case["pos"])
    with pytest.raises(ValueError, match="float16/bfloat16"):
        cudnn.cudnn_attention(q, k, v, qp, pos, fallback=dense_attention)  # float32
    with pytest.raises(ValueError, match="head_dim"):
        cudnn.cudnn_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), qp, pos, fallback=dense_attention)


def test_cudnn_backend_lowers_for_cuda_or_reports_why():
    # On a CPU-only jaxlib the cuDNN call refuses to trace; with a CUDA jaxlib the step must lower.
    q = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    f = lambda q, k, v, qp, kp: attend(q, k, v, qp, kp, chunk=8, backend="cudnn")
    try:
        text = jax.jit(f).trace(q, q, q, p, p).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
        if "cuDNN is not detected" not in str(e):
            raise
        pytest.skip("CPU-only jaxlib: cuDNN is not detected (the kernel is run by benchmarks/gpu_check.py)")
    assert "cudnn" in text.lower() and "triton" in text  # the cuDNN call and the Pallas fallback
