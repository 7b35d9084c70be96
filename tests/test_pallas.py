"""The Pallas GPU kernel: interpret mode on CPU against the dense reference, visit lists, and CUDA lowering.

Interpret mode is slow (about a second per call), so the shapes are tiny and each call covers several sessions at
once (partially filled, wrapped, permuted slot orders in one batch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import BlockSizes, CacheRope, MaskSpec, attend, dense_attention, pallas_attention, visible
from jaxkv.attention.tiles import visit_lists
from tests.helpers.attention_cases import make_case, permuted, physical

SMALL = BlockSizes(block_q=16, block_k=16)


def _case(seed, *, chunk=20, head_dim=16, dtype=jnp.float32, q_heads=2, kv_heads=1, permute=False):
    """Sessions: partly filled, full, wrapped; ring of a 1-chunk sink and 3-chunk window; chunk not a multiple of
    the block sizes (like Wan's 4,680-token chunks)."""
    case = make_case(
        seed,
        batch=3,
        chunk=chunk,
        sink_chunks=1,
        window_chunks=3,
        written=(2, 4, 9),
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    pos = permuted(case["pos"], seed) if permute else case["pos"]
    return physical(case, pos)


@pytest.mark.parametrize(
    "mask, permute",
    [
        (dict(), True),
        (dict(causal=True), False),
        (dict(chunk=20, window=40, sink=20), False),
        (dict(causal=True, window=30, sink=20), True),
    ],
)
def test_kernel_matches_reference_interpret(mask, permute):
    args = _case(1, permute=permute)
    got = pallas_attention(*args, block_sizes=SMALL, interpret=True, **mask)
    np.testing.assert_allclose(got, dense_attention(*args, **mask), atol=2e-6)


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.slow
def test_kernel_cache_relative_rope_interpret(style):
    args = _case(2, permute=True, q_heads=1, kv_heads=1, head_dim=32)  # the smallest head_dim the kernel takes
    rope = CacheRope(style=style)
    got = pallas_attention(*args, rope=rope, block_sizes=SMALL, interpret=True, chunk=20, window=40, sink=20)
    np.testing.assert_allclose(got, dense_attention(*args, rope=rope, chunk=20, window=40, sink=20), atol=5e-6)


@pytest.mark.slow
def test_kernel_bfloat16_and_head_dim_64_interpret():
    args = _case(3, head_dim=64, dtype=jnp.bfloat16, chunk=12)
    got = pallas_attention(*args, block_sizes=SMALL, interpret=True, chunk=12, window=24, sink=12)
    assert got.dtype == jnp.bfloat16
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    want = dense_attention(*f32, chunk=12, window=24, sink=12)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2)


def test_kernel_wrapped_and_unwrapped_bit_identical_and_empty_rows_zero_interpret():
    case = make_case(
        4, batch=2, chunk=16, sink_chunks=1, window_chunks=2, written=(7, 0), q_heads=1, kv_heads=1, head_dim=16
    )
    flat = np.stack([np.concatenate([np.sort(r[r >= 0]), -np.ones((r < 0).sum(), int)]) for r in case["pos"]])
    run = functools.partial(pallas_attention, block_sizes=SMALL, interpret=True, causal=True, window=32, sink=16)
    a, b = run(*physical(case, case["pos"])), run(*physical(case, flat))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a[1]), 0.0)  # session 1 has an empty cache
    np.testing.assert_allclose(
        a, dense_attention(*physical(case, case["pos"]), causal=True, window=32, sink=16), atol=2e-6
    )


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_attend_pallas_backend_gradient_comes_from_blockwise_interpret():
    args = _case(5)
    q, k, v, qp, pos = args
    mask = dict(chunk=20, window=40, sink=20)
    f = lambda q, k, v: jnp.sum(
        jnp.sin(attend(q, k, v, qp, pos, backend="pallas", interpret=True, block_sizes=SMALL, block_k=20, **mask))
    )
    g = lambda q, k, v: jnp.sum(jnp.sin(dense_attention(q, k, v, qp, pos, **mask)))
    for a, b in zip(jax.grad(f, argnums=(0, 1, 2))(q, k, v), jax.grad(g, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(TypeError, match="forward-mode"):  # reverse mode only, as `attend` documents
        jax.jit(lambda q: jax.jvp(lambda q: f(q, k, v), (q,), (q,))).lower(q)


# ------------------------------------------------------------------ visit lists (plain XLA, fast)


@pytest.mark.parametrize(
    "mask",
    [dict(), dict(causal=True), dict(chunk=8, window=16, sink=8), dict(causal=True, window=12, sink=0), dict(chunk=8)],
)
def test_visit_lists_cover_every_visible_block_in_chronological_order(mask):
    case = make_case(6, batch=4, chunk=8, sink_chunks=1, window_chunks=4, written=(1, 3, 6, 13))
    _, _, _, qp, pos = physical(case, case["pos"])
    # Queries of several chunks at once (like a training forward), so tiles straddle chunk boundaries.
    qp = jnp.concatenate([qp - 8, qp], axis=1)
    bq, bk = 4, 4
    visits = np.asarray(visit_lists(qp, pos, MaskSpec(**mask), bq, bk))
    m = np.asarray(visible(qp, pos, **mask))
    p = np.asarray(pos)
    for b in range(4):
        for i in range(visits.shape[1]):
            count, listed = visits[b, i, 0], visits[b, i, 1 : 1 + visits[b, i, 0]]
            needed = {j for j in range(pos.shape[1] // bk) if m[b, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()}
            assert needed <= set(listed.tolist()), (b, i)
            assert all((p[b, j * bk : (j + 1) * bk] >= 0).any() for j in listed)  # never an empty block
            firsts = [p[b, j * bk : (j + 1) * bk][p[b, j * bk : (j + 1) * bk] >= 0].min() for j in listed]
            assert firsts == sorted(firsts)
            assert count == len(set(listed.tolist()))
    held = (p[3].reshape(-1, bk) >= 0).any(axis=1).sum()
    if mask.get("window"):  # the window really prunes: wrapped sessions visit fewer blocks than they hold
        assert visits[3, -1, 0] < held
    if mask.get("causal") or mask.get("chunk"):  # so do causal and chunk masks: the first tile (the earlier chunk
        assert visits[3, 0, 0] < held  # of queries) skips the blocks of the chunk after it


# ------------------------------------------------------------------ lowering for CUDA on a CPU-only machine


@pytest.mark.parametrize(
    "head_dim, dtype, rope, sizes",
    [
        (64, jnp.bfloat16, None, None),
        (128, jnp.bfloat16, None, None),
        (128, jnp.float32, None, BlockSizes(128, 128, 8, 2)),
        (64, jnp.float32, CacheRope(), None),
        (128, jnp.bfloat16, CacheRope(style="interleaved"), BlockSizes(64, 64)),
    ],
)
def test_kernel_lowers_for_cuda(head_dim, dtype, rope, sizes):
    """Wan shapes (scaled down in tokens only): a 4,680-token chunk is not a multiple of any block size."""
    chunk, cap = 4680, 4680 * 3
    q = jax.ShapeDtypeStruct((1, chunk, 12, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, cap, 12, head_dim), dtype)
    qp = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    kp = jax.ShapeDtypeStruct((1, cap), jnp.int32)
    f = functools.partial(
        attend, backend="pallas", chunk=chunk, window=2 * chunk, sink=chunk, rope=rope, block_sizes=sizes
    )
    text = jax.jit(f).trace(q, kv, kv, qp, kp).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert "jaxkv_ring_attention" in text


def test_kernel_rejects_unsupported_head_dim_and_blocks():
    args = _case(7)
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=48)
    q, k, v, qp, pos = args
    with pytest.raises(ValueError, match="head_dim a power of two"):
        pallas_attention(q[..., :12], k[..., :12], v[..., :12], qp, pos, interpret=True)
    with pytest.raises(ValueError, match="head_dim >= 32"):
        pallas_attention(q, k, v, qp, pos, rope=CacheRope())  # head_dim 16: rotary halves too small for a dot
