"""The Mosaic GPU ring kernel (jaxkv/attention/mosaic_gpu.py) and its specification, the pure-JAX emulation
(jaxkv/attention/mosaic_emulation.py), and the tile plan both use (jaxkv/attention/tiles.py).

On CPU: the tile plan against brute-force masks; the emulation against the dense reference on every mask and
layout the other backends' CPU tests cover (random rings, wraps, sink, window, chunk-causal, inactive sessions, NaN
in empty slots, rows that see nothing, GQA, head dims 64 / 128, bf16 / fp16, a stacked cache at a layer index;
hypothesis over random slot layouts and masks); the kernel traced and lowered for CUDA. On a GPU (marker ``gpu``):
the compiled kernel against the emulation and the dense reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.attention import MaskSpec, dense_attention, visible
from jaxkv.attention.mosaic_emulation import MosaicBlockSizes, emulate_mosaic
from jaxkv.attention.mosaic_gpu import mosaic_attention
from jaxkv.attention.tiles import FULL, PARTIAL, PARTIAL_EMPTY, SKIP, tile_plan, visit_lists
from tests.helpers.attention_cases import make_case, permuted, physical, unwrapped_positions

C = 100  # tokens per chunk: not a multiple of the 64-token blocks, like Wan's 4,680
MASKS = [
    dict(),
    dict(causal=True),
    dict(chunk=C),
    dict(chunk=C, window=2 * C),
    dict(chunk=C, window=2 * C, sink=C),
    dict(causal=True, window=150, sink=C),
    dict(causal=True, chunk=C, window=3 * C, sink=2 * C),
]
SMALL = MosaicBlockSizes(block_q=64, block_k=64, stages=2)


def _case(
    seed,
    *,
    written=(2, 4, 9, 0),
    q_chunks=1,
    head_dim=16,
    q_heads=4,
    kv_heads=2,
    dtype=jnp.float32,
    permute=False,
    nan_empty=False,
):
    """Sessions of a ring (1-chunk sink + 3-chunk window, 400 slots: ragged against 64-slot blocks): partly filled,
    full, wrapped, never written (an inactive session); queries for the last ``q_chunks`` chunks (so query tiles
    straddle chunks); empty slots hold noise, or NaN."""
    case = make_case(
        seed,
        batch=len(written),
        chunk=C,
        sink_chunks=1,
        window_chunks=3,
        written=written,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=jnp.float32,
    )
    pos = permuted(case["pos"], seed) if permute else case["pos"]
    q, k, v, qp, kp = physical(case, pos)
    if q_chunks > 1:
        rng = np.random.default_rng(seed + 1)
        q = jnp.asarray(rng.normal(size=(q.shape[0], q_chunks * C, q_heads, head_dim)), jnp.float32)
        qp = jnp.concatenate([qp - (q_chunks - 1 - i) * C for i in range(q_chunks)], axis=1)
    if nan_empty:
        empty = (kp < 0)[:, :, None, None]
        k, v = jnp.where(empty, jnp.nan, k), jnp.where(empty, jnp.nan, v)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), qp, kp


def _check(args, mask, atol=2e-6, bs=SMALL):
    out, lse = emulate_mosaic(*args, block_sizes=bs, **mask)
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    want, want_lse = dense_attention(*f32, return_lse=True, **mask)
    assert out.dtype == args[0].dtype and lse.dtype == jnp.float32
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=atol)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=max(atol, 2e-6) * 10)
    return out, lse


# ------------------------------------------------------------------ the tile plan


@pytest.mark.parametrize("mask", MASKS)
def test_tile_plan_classifies_every_pair_of_tiles(mask):
    q, k, v, qp, kp = _case(0, q_chunks=3, permute=True)
    bq, bk = 128, 64
    plan = tile_plan(qp, kp, MaskSpec(**mask), bq, bk)
    seen = np.asarray(visible(qp, kp, **mask))
    p = np.asarray(plan.kv_positions)
    lq, lk = qp.shape[1], kp.shape[1]
    for b in range(qp.shape[0]):
        for i in range(plan.order.shape[1]):
            n = int(plan.count[b, i])
            listed = [int(x) for x in plan.order[b, i, :n]]
            kinds = [int(x) for x in plan.kind[b, i]]
            assert kinds[n:] == [SKIP] * (len(kinds) - n)
            for j in range(plan.order.shape[2]):
                tile = seen[b, i * bq : min((i + 1) * bq, lq), j * bk : min((j + 1) * bk, lk)]
                if j not in listed:
                    assert not tile.any(), (b, i, j)  # skipped: nothing visible
                    continue
                kind = kinds[listed.index(j)]
                block = p[b, j * bk : (j + 1) * bk]
                assert (block >= 0).any()  # never an empty block
                if kind == FULL:
                    assert tile.all() and tile.shape[1] == bk, (b, i, j)  # unmasked loop: truly every pair
                else:
                    in_bounds = block[: max(0, min(bk, lk - j * bk))]
                    assert kind == (PARTIAL_EMPTY if (in_bounds < 0).any() else PARTIAL), (b, i, j)
            firsts = [p[b, j * bk : (j + 1) * bk][p[b, j * bk : (j + 1) * bk] >= 0].min() for j in listed]
            assert firsts == sorted(firsts)  # chronological
    # The Triton kernel's visit lists are the same plan (one shared computation).
    tri = np.asarray(visit_lists(qp, kp, MaskSpec(**mask), bq, bk))
    np.testing.assert_array_equal(tri[..., 0], plan.count)
    np.testing.assert_array_equal(tri[..., 1:], plan.order)


def test_tile_plan_full_ring_is_all_full_and_the_ragged_block_masked():
    """A full ring under its own window: the unmasked loop covers all but the block that runs past the 400 slots
    and (the block test being conservative) the one holding both sink keys and window keys."""
    q, k, v, qp, kp = _case(1, written=(4, 9))
    plan = tile_plan(qp, kp, MaskSpec(chunk=C, window=3 * C, sink=C), 128, 64)
    kinds = np.asarray(plan.kind)
    for b in range(2):
        n = int(plan.count[b, 0])
        assert n == 7  # 400 slots in 64-slot blocks
        partial = sorted(int(j) for j, kind in zip(plan.order[b, 0, :n], kinds[b, 0, :n]) if kind != FULL)
        assert partial == [1, 6] and (kinds[b, 0, :n] != PARTIAL_EMPTY).all()


# ------------------------------------------------------------------ the emulation against the dense reference


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("permute", [False, True])
def test_emulation_matches_dense_on_every_mask_and_layout(mask, permute):
    _check(_case(2, q_chunks=2, permute=permute), mask)


@pytest.mark.parametrize("mask", [dict(), dict(chunk=C, window=2 * C, sink=C), dict(causal=True)])
def test_nan_in_empty_slots_has_no_influence(mask):
    args = _case(3, permute=True, nan_empty=True)
    clean = _case(3, permute=True)
    out, _ = _check(args, mask)
    np.testing.assert_array_equal(out, emulate_mosaic(*clean, block_sizes=SMALL, **mask)[0])


def test_rows_that_see_nothing_are_exact_zeros_with_lse_minus_inf():
    q, k, v, qp, kp = _case(4, written=(3, 0))
    qp = qp.at[0, :40].set(0)  # session 0: 40 queries at position 0 under a causal mask only see key 0 ...
    kp = kp.at[0].set(jnp.where(kp[0] == 0, -1, kp[0]))  # ... which is emptied: they see nothing
    out, lse = _check((q, k, v, qp, kp), dict(causal=True))
    np.testing.assert_array_equal(out[0, :40], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)  # an inactive session (empty cache)
    assert np.isneginf(lse[0, :40]).all() and np.isneginf(lse[1]).all() and np.isfinite(lse[0, 40:]).all()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_emulation_half_precision_gqa_head_dims(head_dim, dtype):
    args = _case(5, head_dim=head_dim, dtype=dtype, q_heads=6, kv_heads=2, permute=True, nan_empty=True)
    _check(args, dict(chunk=C, window=2 * C, sink=C), atol=2e-2)


def test_wrapped_and_unwrapped_rings_bit_identical_when_blocks_divide_the_chunk():
    """Positions alone fix the visit order: with 128-token chunks in 64-slot blocks, a wrapped ring and the same
    content laid out in order give the same bits."""
    case = make_case(
        6, batch=2, chunk=128, sink_chunks=1, window_chunks=2, written=(7, 2), q_heads=2, kv_heads=1, head_dim=16
    )
    flat = np.stack([unwrapped_positions(r) for r in case["pos"]])
    mask = dict(chunk=128, window=256, sink=128)
    a = emulate_mosaic(*physical(case, case["pos"]), block_sizes=SMALL, **mask)
    b = emulate_mosaic(*physical(case, flat), block_sizes=SMALL, **mask)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    _check(physical(case, case["pos"]), mask)


def test_stacked_cache_at_a_layer_index_equals_the_layer():
    q, k, v, qp, kp = _case(7)
    ks, vs = jnp.stack([k * 2.0, k, -k]), jnp.stack([v, v, v * 3.0])
    want = emulate_mosaic(q, k, v, qp, kp, block_sizes=SMALL, chunk=C)
    got = emulate_mosaic(q, ks, vs, qp, kp, layer=1, block_sizes=SMALL, chunk=C)
    traced = jax.jit(lambda i: emulate_mosaic(q, ks, vs, qp, kp, layer=i, block_sizes=SMALL, chunk=C))(jnp.int32(1))
    for x in (got, traced):
        np.testing.assert_array_equal(x[0], want[0])
        np.testing.assert_array_equal(x[1], want[1])


@pytest.mark.slow  # 20 compilations
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    fill=st.floats(0.0, 1.0),
    mask=st.sampled_from(MASKS),
    lq=st.integers(1, 200),
    lk=st.integers(1, 300),
    bs=st.sampled_from([SMALL, MosaicBlockSizes(64, 128, 3)]),
)
def test_emulation_matches_dense_on_random_slot_layouts(seed, fill, mask, lq, lk, bs):
    """Any slot order, any fraction of empty slots (NaN in them), any lengths (ragged against every block)."""
    rng = np.random.default_rng(seed)
    kp = np.where(rng.random((2, lk)) < fill, rng.permutation(4 * lk)[:lk][None] % 400, -1)
    qp = rng.integers(0, 400, size=(2, lq))
    q, k, v = (rng.normal(size=(2, n, h, 16)) for n, h in ((lq, 2), (lk, 1), (lk, 1)))
    k, v = (np.where((kp < 0)[..., None, None], np.nan, x) for x in (k, v))
    args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v)) + (
        jnp.asarray(qp, jnp.int32),
        jnp.asarray(kp, jnp.int32),
    )
    _check(args, mask, bs=bs)


def test_bad_inputs_are_named():
    q, k, v, qp, kp = _case(8)
    with pytest.raises(ValueError, match="needs layer="):
        emulate_mosaic(q, k[None], v[None], qp, kp)
    with pytest.raises(ValueError, match="needs layer="):
        emulate_mosaic(q, k, v, qp, kp, layer=0)
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        emulate_mosaic(q, k[None], v[None], qp, kp, layer=3)
    with pytest.raises(ValueError, match="bfloat16/float16 and head_dim"):
        mosaic_attention(q, k, v, qp, kp)  # float32, head_dim 16
    with pytest.raises(ValueError, match="share a dtype"):
        emulate_mosaic(q, k.astype(jnp.bfloat16), v, qp, kp)
    with pytest.raises(ValueError, match="multiple of 64"):
        MosaicBlockSizes(block_q=32)
    with pytest.raises(ValueError, match="stages"):
        MosaicBlockSizes(stages=1)
    q, k, v, qp, kp = _case(8, head_dim=64, dtype=jnp.bfloat16)  # 100 queries, 400 slots: kernel dtype and dim
    with pytest.raises(ValueError, match=r"below 8 or multiples of 8; got q_len 100 \("):
        mosaic_attention(q, k, v, qp, kp)
    with pytest.raises(ValueError, match="got q_len 100, kv_len 396"):
        mosaic_attention(q, k[:, 4:], v[:, 4:], qp, kp[:, 4:])


# ------------------------------------------------------------------ the kernel: traced and lowered for CUDA here


@pytest.mark.parametrize(
    "head_dim, dtype, mask, stacked, groups, sizes",
    [
        (128, jnp.bfloat16, dict(chunk=4680, window=28080, sink=4680), True, 1, None),
        (128, jnp.bfloat16, dict(chunk=4680), False, 1, MosaicBlockSizes(128, 64, 3)),
        (64, jnp.float16, dict(causal=True, window=9360, sink=4680), True, 2, None),
        (128, jnp.float16, dict(), False, 3, MosaicBlockSizes(64, 64, 2)),
    ],
)
def test_kernel_lowers_for_cuda(head_dim, dtype, mask, stacked, groups, sizes):
    """Wan shapes: 4,680 queries and 32,760 slots, multiples of no block size; a stacked cache at a traced layer."""
    q = jax.ShapeDtypeStruct((1, 4680, 12, head_dim), dtype)
    kv_shape = (1, 32760, 12 // groups, head_dim)
    kv = jax.ShapeDtypeStruct((30, *kv_shape) if stacked else kv_shape, dtype)
    qp, kp = jax.ShapeDtypeStruct((1, 4680), jnp.int32), jax.ShapeDtypeStruct((1, 32760), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)

    def f(q, k, v, qp, kp, layer):
        return mosaic_attention(q, k, v, qp, kp, layer=layer if stacked else None, block_sizes=sizes, **mask)

    text = jax.jit(f).trace(q, kv, kv, qp, kp, layer).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_kernel_refuses_blocks_over_the_shared_memory_budget_when_lowered():
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    qp, kp = jax.ShapeDtypeStruct((1, 256), jnp.int32), jax.ShapeDtypeStruct((1, 512), jnp.int32)
    f = functools.partial(mosaic_attention, block_sizes=MosaicBlockSizes(64, 128, 2))
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        jax.jit(f).trace(q, kv, kv, qp, kp).lower(lowering_platforms=("cuda",))


# ------------------------------------------------------------------ the kernel compiled on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [MASKS[0], MASKS[4], MASKS[5], MASKS[6]])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiled_kernel_matches_emulation_and_dense(mask, head_dim):
    args = _case(
        9, q_chunks=3, head_dim=head_dim, dtype=jnp.bfloat16, q_heads=6, kv_heads=2, permute=True, nan_empty=True
    )
    out, lse = jax.jit(functools.partial(mosaic_attention, **mask))(*args)
    e_out, e_lse = emulate_mosaic(*args, **mask)
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    want = dense_attention(*f32, **mask)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(e_out, np.float32), atol=1e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(e_lse))
    finite = np.isfinite(e_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(e_lse)[finite], atol=1e-2)


@pytest.mark.gpu
def test_compiled_kernel_stacked_cache_at_wan_shapes():
    """A 1-frame chunk (1,560 tokens) on a wrapped ring with a sink, 12 x 128 heads, bf16, layer 2 of 3."""
    from tests.helpers.attention_cases import ring_positions

    chunk = 1560
    pos = ring_positions(chunk, 1, 5, 17)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, chunk, 12, 128), jnp.bfloat16)
    k = jax.random.normal(kk, (3, 1, len(pos), 12, 128), jnp.bfloat16)
    v = jax.random.normal(kv, (3, 1, len(pos), 12, 128), jnp.bfloat16)
    qp = jnp.arange(16 * chunk, 17 * chunk, dtype=jnp.int32)[None]
    kp = jnp.asarray(pos, jnp.int32)[None]
    mask = dict(chunk=chunk, window=5 * chunk, sink=chunk)
    out, _ = jax.jit(lambda *a: mosaic_attention(*a, layer=2, **mask))(q, k, v, qp, kp)
    want = dense_attention(q.astype(jnp.float32), k[2].astype(jnp.float32), v[2].astype(jnp.float32), qp, kp, **mask)
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))) < 3e-2


# ------------------------------------------------------------------ dispatch


def test_attend_mosaic_backend_runs_the_emulation_on_cpu_with_the_blockwise_gradient():
    from jaxkv.attention import attend

    q, k, v, qp, kp = _case(10, permute=True, nan_empty=True)
    mask = dict(chunk=C, window=2 * C, sink=C)
    run = lambda q, k, v: attend(q, k, v, qp, kp, backend="mosaic", interpret=True, block_sizes=SMALL, **mask)
    np.testing.assert_array_equal(run(q, k, v), emulate_mosaic(q, k, v, qp, kp, block_sizes=SMALL, **mask)[0])
    finite = [jnp.where((kp < 0)[:, :, None, None], 0.0, x) for x in (k, v)]  # the reference's gradient needs
    f = lambda q, k, v: jnp.sum(jnp.sin(run(q, k, v)))  # finite empty slots (the NaN test is above)
    g = lambda q, k, v: jnp.sum(jnp.sin(dense_attention(q, k, v, qp, kp, **mask)))
    for a, b in zip(jax.grad(f, argnums=(0, 1, 2))(q, *finite), jax.grad(g, argnums=(0, 1, 2))(q, *finite)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_auto_picks_mosaic_only_where_the_hopper_table_says_so(monkeypatch):
    from jaxkv.attention import mosaic_gpu
    from jaxkv.attention.dispatch import resolve_backend

    bf16 = (jnp.bfloat16,) * 3
    pick = functools.partial(resolve_backend, "auto", head_dim=128, rope=None, logits=1 << 30, platform="gpu")
    assert mosaic_gpu.MOSAIC_OVER_CUDNN == set() and mosaic_gpu.MOSAIC_OVER_TRITON == set()  # nothing measured yet
    assert pick(dtypes=bf16, shape=(32760, 4680), hopper=True) == "cudnn"  # as before the kernel existed
    monkeypatch.setattr(mosaic_gpu, "MOSAIC_OVER_CUDNN", {(32760, 4680, 128)})
    assert pick(dtypes=bf16, shape=(32760, 4680), hopper=True) == "mosaic"
    assert pick(dtypes=bf16, shape=(32760, 4680), hopper=False) == "cudnn"  # the table is Hopper's
    assert pick(dtypes=bf16, shape=(9360, 4680), hopper=True) == "cudnn"  # another shape: not measured
    assert pick(dtypes=(jnp.float32,) * 3, shape=(32760, 4680), hopper=True) == "pallas"  # not the kernel's dtype
    assert resolve_backend("mosaic", head_dim=64, dtypes=bf16, rope=None, logits=1) == "mosaic"


def test_attend_mosaic_backend_names_what_the_kernel_does_not_take():
    from jaxkv.attention import CacheRope, attend

    q, k, v, qp, kp = _case(11)
    with pytest.raises(ValueError, match="bfloat16/float16 and head_dim"):
        attend(q, k, v, qp, kp, backend="mosaic")  # float32, head_dim 16: only the emulation takes them
    with pytest.raises(ValueError, match="no cache-relative rope"):
        attend(q, k, v, qp, kp, backend="mosaic", interpret=True, rope=CacheRope())
