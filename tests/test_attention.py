"""Position-addressed attention: masks, the dense reference, the blockwise XLA path, cache-relative RoPE, dispatch.

Ring layouts are built here from first principles (chunk n of a stream goes to sink slot n while the sink fills,
then to window slot (n - sink_chunks) % window_chunks), independently of `jaxkv.cache`; the last tests run the
real `RingCache`. References gather the cache into chronological order in NumPy — the attention paths never do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxkv.attention import (
    CacheRope,
    MaskSpec,
    attend,
    blockwise_attention,
    dense_attention,
    dispatch,
    pallas_attention,
    rope_ranks,
    visible,
)
from jaxkv.attention.blockwise import merge_partials
from jaxkv.attention.dispatch import BACKENDS, resolve_backend
from jaxkv.attention.rope import cache_ranks, query_ranks
from jaxkv.compilation import compile_count
from tests.helpers.attention_cases import (
    MASKS,
    brute_visible,
    make_case,
    numpy_attention,
    permuted,
    physical,
    ring_positions,
    unwrapped_positions,
)

# ------------------------------------------------------------------ layouts


# ------------------------------------------------------------------ masks and the reference


@pytest.mark.parametrize("mask", MASKS)
def test_visible_matches_definition(mask):
    rng = np.random.default_rng(0)
    qp = rng.integers(-2, 40, size=(1, 9))
    kp = rng.integers(-3, 40, size=(1, 23))
    got = np.asarray(visible(jnp.asarray(qp), jnp.asarray(kp), **mask))[0]
    np.testing.assert_array_equal(got, brute_visible(qp[0], kp[0], **mask))


@pytest.mark.parametrize("mask", MASKS[::2])
def test_dense_reference_matches_numpy(mask):
    case = make_case(1)
    args = physical(case, permuted(case["pos"], 1))
    want = numpy_attention(*args, **mask)
    np.testing.assert_allclose(dense_attention(*args, **mask), want, atol=2e-5)


def test_ring_attention_equals_chronological_history():
    """Physical order is irrelevant: the ring equals the compact chronological history it holds."""
    case = make_case(2, written=(9, 3))
    q, k, v, qp, pos = physical(case, case["pos"])
    for mask in MASKS:
        ring = dense_attention(q, k, v, qp, pos, **mask)
        for b in range(2):
            order = np.argsort(np.where(case["pos"][b] >= 0, case["pos"][b], 1 << 30))
            n = int((case["pos"][b] >= 0).sum())
            hist = order[:n]
            want = dense_attention(
                q[b : b + 1], k[b : b + 1, hist], v[b : b + 1, hist], qp[b : b + 1], pos[b : b + 1, hist], **mask
            )
            np.testing.assert_allclose(ring[b : b + 1], want, atol=1e-5, err_msg=str(mask))


def test_query_seeing_nothing_gets_zeros():
    case = make_case(3, written=(0, 2))  # session 0: empty cache
    out = dense_attention(*physical(case, case["pos"]), causal=True)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert np.abs(np.asarray(out[1])).sum() > 0
    out = blockwise_attention(*physical(case, case["pos"]), causal=True, block_k=4)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)


# ------------------------------------------------------------------ blockwise XLA path

# Sessions at different stages in one batch: partially filled, exactly full, wrapped once, wrapped many times.
LAYOUT_SESSIONS = (2, 4, 7, 11)
BLOCKINGS = [(4, (4,)), (8, None), (3, None), (5, (4, 12))]  # (block_k, segments): aligned, coarse, ragged, split


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.slow
def test_blockwise_matches_dense_over_layouts_and_masks(mask):
    case = make_case(4, batch=4, written=LAYOUT_SESSIONS)
    for block_k, segments in BLOCKINGS[:2] if mask else BLOCKINGS:
        run = jax.jit(functools.partial(blockwise_attention, block_k=block_k, segments=segments, **mask))
        for pos in (case["pos"], permuted(case["pos"], 4)):  # ring order and an arbitrary slot order
            args = physical(case, pos)
            np.testing.assert_allclose(
                run(*args), dense_attention(*args, **mask), atol=2e-6, err_msg=f"block {block_k} segments {segments}"
            )
    for block_k, segments in BLOCKINGS[2:]:  # ragged/split blockings on the sink + window masks
        if mask.get("sink"):
            args = physical(case, case["pos"])
            got = jax.jit(functools.partial(blockwise_attention, block_k=block_k, segments=segments, **mask))(*args)
            np.testing.assert_allclose(got, dense_attention(*args, **mask), atol=2e-6)


def test_blockwise_mqa_and_no_sink_ring():
    case = make_case(5, sink_chunks=0, window_chunks=4, written=(10, 5), q_heads=3, kv_heads=1)
    args = physical(case, case["pos"])
    for mask in MASKS:
        np.testing.assert_allclose(
            blockwise_attention(*args, block_k=4, **mask), dense_attention(*args, **mask), atol=2e-6
        )


def test_blockwise_bfloat16_storage_accumulates_in_float32():
    case = make_case(6, dtype=jnp.bfloat16, written=(8, 3))
    args = physical(case, case["pos"])
    want = numpy_attention(
        *(np.asarray(a, np.float32) if i < 3 else a for i, a in enumerate(args)), chunk=4, window=8, sink=4
    )
    got = blockwise_attention(*args, block_k=4, chunk=4, window=8, sink=4)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2)


@pytest.mark.parametrize("chunk, block_k", [(4, 4), (8, 512)])  # 512: the default, tiled down to the chunk size
def test_wrapped_and_unwrapped_rings_are_bit_identical(chunk, block_k):
    """Same logical content, different physical rotation: with blocks that divide the chunk, the chronological
    visit makes the results identical."""
    case = make_case(7, chunk=chunk, written=(11, 6))
    wrapped, flat = case["pos"], np.stack([unwrapped_positions(r) for r in case["pos"]])
    assert not np.array_equal(wrapped, flat)
    mask = dict(chunk=chunk, window=2 * chunk, sink=chunk)
    run = jax.jit(functools.partial(blockwise_attention, block_k=block_k, **mask))
    a, b = run(*physical(case, wrapped)), run(*physical(case, flat))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(a, dense_attention(*physical(case, wrapped), **mask), atol=2e-6)


def _scan_block_sizes(kv_len, chunk, block_k=512):
    """Key block sizes (kv_len / scan length) of the blockwise path's scans, traced abstractly."""
    q = jax.ShapeDtypeStruct((1, 8, 1, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, kv_len, 1, 8), jnp.float32)
    qp, kp = jax.ShapeDtypeStruct((1, 8), jnp.int32), jax.ShapeDtypeStruct((1, kv_len), jnp.int32)
    f = functools.partial(blockwise_attention, chunk=chunk, block_k=block_k)
    jaxpr = jax.make_jaxpr(f)(q, kv, kv, qp, kp).jaxpr
    return [kv_len // e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]


def test_blockwise_block_size_tiles_the_chunk_but_is_never_tiny():
    assert _scan_block_sizes(3 * 4680, 4680) == [468]  # Wan: divides the chunk (wrap-invariant), <= block_k
    assert _scan_block_sizes(24, 8, block_k=4) == [4]  # a small block_k is honoured
    # gcd(kv_len, chunk) = 7 would be 1,000 scan steps of 7 keys: the segment's own divisor is used instead.
    assert _scan_block_sizes(7000, 7) == [500]


def test_merge_partials_by_lse_equals_attention_over_the_union():
    case = make_case(8, written=(6, 4))
    q, k, v, qp, pos = physical(case, case["pos"])
    want, want_lse = dense_attention(q, k, v, qp, pos, causal=True, return_lse=True)
    parts = [
        dense_attention(q, k[:, s], v[:, s], qp, pos[:, s], causal=True, return_lse=True)
        for s in (slice(0, 5), slice(5, 9), slice(9, 16))
    ]
    out, lse = merge_partials(parts)
    np.testing.assert_allclose(out, want, atol=2e-6)
    np.testing.assert_allclose(
        np.where(np.isfinite(want_lse), lse, 0), np.where(np.isfinite(want_lse), want_lse, 0), atol=2e-5
    )
    _, blse = blockwise_attention(q, k, v, qp, pos, causal=True, block_k=4, return_lse=True)
    np.testing.assert_allclose(
        np.where(np.isfinite(want_lse), blse, 0), np.where(np.isfinite(want_lse), want_lse, 0), atol=2e-5
    )
    np.testing.assert_array_equal(np.isfinite(blse), np.isfinite(want_lse))


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_blockwise_gradients():
    case = make_case(9, batch=1, written=(3,), q_heads=2, kv_heads=1, head_dim=4)
    q, k, v, qp, pos = physical(case, case["pos"])
    mask = dict(chunk=4, window=8, sink=4)

    @jax.jit  # check_grads calls it many times: compiled once, not dispatched op by op
    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, qp, pos, block_k=4, rope=CacheRope(), **mask)

    def dense(q, k, v):
        return dense_attention(q, k, v, qp, pos, rope=CacheRope(), **mask)

    # Numerically for blockwise; the dense path's autodiff gradient must then equal it.
    check_grads(blockwise, (q, k, v), order=1, modes=("rev",), eps=1e-3, atol=2e-2, rtol=2e-2)
    ct = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)
    g_block = jax.vjp(blockwise, q, k, v)[1](ct)
    g_dense = jax.vjp(dense, q, k, v)[1](ct)
    for a, b, name in zip(g_block, g_dense, "qkv"):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"d{name}")
    # Forward mode too (the module docstring promises it): <ct, J t> = <J^T ct, t> for a tangent t = (ct, k, v).
    tangent = (ct, k, v)
    jt = jax.jvp(blockwise, (q, k, v), tangent)[1]
    np.testing.assert_allclose(jnp.vdot(ct, jt), sum(jnp.vdot(g, t) for g, t in zip(g_block, tangent)), rtol=1e-5)
    # empty slots get no gradient
    empty = case["pos"][0] < 0
    assert empty.any()
    np.testing.assert_array_equal(np.asarray(g_block[1])[0, empty], 0.0)


# ------------------------------------------------------------------ cache-relative RoPE


def test_cache_ranks_match_definition():
    rng = np.random.default_rng(10)
    pos = permuted(np.stack([ring_positions(3, 1, 4, n) for n in (0, 2, 9)]), 10)
    ranks = np.asarray(cache_ranks(jnp.asarray(pos, jnp.int32)))
    qp = rng.integers(0, 30, size=(3, 5))
    qranks = np.asarray(query_ranks(jnp.asarray(qp, jnp.int32), jnp.asarray(pos, jnp.int32)))
    for b in range(3):
        valid = pos[b][pos[b] >= 0]
        for j, p in enumerate(pos[b]):
            if p >= 0:
                assert ranks[b, j] == (valid < p).sum()
        for i, p in enumerate(qp[b]):
            assert qranks[b, i] == (valid < p).sum()
    both = rope_ranks(jnp.asarray(qp, jnp.int32), jnp.asarray(pos, jnp.int32))  # one sort for the two
    np.testing.assert_array_equal(both[0], qranks)
    np.testing.assert_array_equal(both[1], ranks)


def numpy_rope(x, index, theta=10000.0, style="half"):
    """Rotate x [tokens, heads, d] at integer indices [tokens], float64, written out pair by pair."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    out = np.empty_like(x)
    pairs = [(i, i + d // 2) for i in range(d // 2)] if style == "half" else [(2 * i, 2 * i + 1) for i in range(d // 2)]
    for i, (a, b) in enumerate(pairs):
        ang = index[:, None] * theta ** (-2 * i / d)
        out[..., a] = x[..., a] * np.cos(ang) - x[..., b] * np.sin(ang)
        out[..., b] = x[..., b] * np.cos(ang) + x[..., a] * np.sin(ang)
    return out


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_cache_relative_rope_equals_rotating_the_compact_history(style):
    """StreamingLLM semantics: gather the cache into order, rotate key i of the history by i and each query by the
    number of cached keys before it, then attend — what the paths compute without any gather."""
    case = make_case(11, written=(9, 3), head_dim=8)
    rope = CacheRope(style=style)
    slots = permuted(case["pos"], 11)
    q, k, v, qp, pos = physical(case, slots)
    mask = dict(chunk=4, window=8, sink=4)
    for b in range(2):
        hist = np.argsort(np.where(slots[b] >= 0, slots[b], 1 << 30))[: int((slots[b] >= 0).sum())]
        hist_pos = slots[b][hist]
        kr = numpy_rope(np.asarray(k[b])[hist], np.arange(len(hist)), style=style)
        qr = numpy_rope(np.asarray(q[b]), np.searchsorted(hist_pos, np.asarray(qp[b])), style=style)
        want = numpy_attention(qr[None], kr[None], np.asarray(v[b])[hist][None], qp[b : b + 1], hist_pos[None], **mask)
        for path in (dense_attention, functools.partial(blockwise_attention, block_k=4)):
            got = path(q, k, v, qp, pos, rope=rope, **mask)[b : b + 1]
            np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"{path} {style}")


def test_cache_relative_rope_is_invariant_to_absolute_offset():
    """Shifting every position by a whole chunk count leaves ranks — and so the output — unchanged."""
    case = make_case(12, written=(9, 6))
    q, k, v, qp, pos = physical(case, case["pos"])
    shifted = jnp.where(pos >= 0, pos + 40, -1)
    a = blockwise_attention(q, k, v, qp, pos, rope=CacheRope(), block_k=4, causal=True, window=8, sink=0)
    b = blockwise_attention(q, k, v, qp + 40, shifted, rope=CacheRope(), block_k=4, causal=True, window=8, sink=0)
    np.testing.assert_allclose(a, b, atol=1e-6)
    c = blockwise_attention(q, k, v, qp, pos, block_k=4, causal=True, window=8)
    assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-3  # the rotation does something


# ------------------------------------------------------------------ attend: dispatch and bad input


def test_attend_backends_agree(monkeypatch):
    """Each name routes to the path `resolve_backend` names, and the two distinct XLA paths agree with NumPy."""
    case = make_case(13, written=(8, 3))
    args = physical(case, case["pos"])
    q, k = args[0], args[1]
    mask = dict(chunk=4, window=8, sink=4)
    run = lambda backend: np.asarray(attend(*args, backend=backend, block_k=4, segments=(4,), **mask))
    logits = q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1]
    resolve = lambda name: resolve_backend(name, head_dim=8, dtypes=(q.dtype,) * 3, rope=None, logits=logits)
    # "auto" on a GPU without a kernel shape (head_dim 8) is "xla"; small logits make "xla" dense.
    assert (
        resolve_backend("auto", head_dim=8, dtypes=(q.dtype,) * 3, rope=None, logits=logits, platform="gpu")
        == "xla_dense"
    )
    assert {name: resolve(name) for name in ("xla", "xla_dense", "xla_blockwise")} == {
        "xla": "xla_dense",
        "xla_dense": "xla_dense",
        "xla_blockwise": "xla_blockwise",
    }
    want = numpy_attention(*args, **mask)
    paths = {name: run(name) for name in ("xla_dense", "xla_blockwise")}
    for name, got in paths.items():
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=name)
    assert np.abs(paths["xla_dense"] - paths["xla_blockwise"]).max() > 0  # two different computations
    np.testing.assert_array_equal(run("xla"), paths["xla_dense"])
    monkeypatch.setattr(dispatch, "DENSE_MAX_LOGITS", logits - 1)  # now "xla" must take the blockwise path
    assert resolve("xla") == "xla_blockwise"
    np.testing.assert_array_equal(run("xla"), paths["xla_blockwise"])


def test_resolve_backend():
    kw = dict(head_dim=128, dtypes=(jnp.bfloat16,) * 3, rope=None, logits=10)
    assert resolve_backend("auto", platform="gpu", **kw) == "cudnn"
    assert resolve_backend("auto", platform="gpu", **{**kw, "rope": CacheRope()}) == "pallas"
    assert resolve_backend("auto", platform="cpu", **kw) == "xla_cpu"
    assert resolve_backend("auto", platform="gpu", **{**kw, "head_dim": 96}) == "cudnn"  # cuDNN takes 96
    assert (
        resolve_backend("auto", platform="gpu", **{**kw, "head_dim": 96, "dtypes": (jnp.float32,) * 3}) == "xla_dense"
    )
    assert resolve_backend("xla", **{**kw, "logits": 1 << 30}) == "xla_blockwise"
    assert resolve_backend("pallas", **kw) == "pallas"
    assert set(BACKENDS) == {"auto", "xla", "xla_dense", "xla_blockwise", "xla_cpu", "pallas", "mosaic", "cudnn"}


def test_attend_is_one_compilation_across_positions():
    case = make_case(14, written=(5, 2))
    q, k, v, qp, pos = physical(case, case["pos"])
    f = jax.jit(functools.partial(attend, chunk=4, window=8, sink=4, backend="xla_blockwise", block_k=4))
    f(q, k, v, qp, pos)
    f(q, k, v, qp + 4, jnp.roll(pos, 4, axis=1))
    assert compile_count(f) == 1


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(backend="flash"), "unknown attention backend"),
        (dict(backend="cudnn"), "backend .cudnn. needs float16/bfloat16"),  # float32, head_dim 8
        (dict(chunk=0), "chunk must be"),
        (dict(window=-3), "window must be"),
        (dict(sink=-1), "sink must be"),
        (dict(causal="yes"), "causal must be"),
        (dict(scale="big"), "scale must be"),
        (dict(scale=float("nan")), "scale must be finite and > 0"),
        (dict(scale=float("inf")), "scale must be finite and > 0"),
        (dict(scale=0.0), "scale must be finite and > 0"),
        (dict(scale=-0.5), "scale must be finite and > 0"),
        (dict(sink=4), "sink needs a window"),
        (dict(causal=True, sink=4), "sink needs a window"),
        (dict(rope="rerope"), "rope must be"),
    ],
)
def test_attend_rejects_bad_options(bad, match):
    args = physical(make_case(15), make_case(15)["pos"])
    with pytest.raises(ValueError, match=match):
        attend(*args, **bad)


def test_attend_rejects_bad_shapes_and_dtypes():
    q, k, v, qp, pos = physical(make_case(16), make_case(16)["pos"])
    cases = [
        ((q, k, v, qp.astype(jnp.float32), pos), "q_positions must be an integer"),
        ((q, k, v, qp, pos.astype(jnp.float32)), "kv_positions must be an integer"),
        ((q, k, v, qp, pos[:, :-1]), "kv_positions must have shape"),
        ((q, k, v, qp[:, :-1], pos), "q_positions must have shape"),
        ((q[..., :3, :], k, v, qp, pos), "multiple of kv_heads"),
        ((q, k, v[:, :-1], qp, pos), "same shape"),
        ((q[..., :4], k, v, qp, pos), "head_dim differ"),
        ((q[:1], k, v, qp, pos), "batch sizes differ"),
        ((q[0], k, v, qp, pos), r"\[batch, tokens, heads, head_dim\]"),
        ((q, k.astype(jnp.int32), v, qp, pos), "floating point"),
    ]
    for args, match in cases:
        for backend in ("xla", "xla_blockwise", "pallas"):
            with pytest.raises(ValueError, match=match):
                jax.eval_shape(functools.partial(attend, backend=backend), *args)


PATHS = {
    "dense": dense_attention,
    "blockwise": blockwise_attention,
    "pallas": functools.partial(pallas_attention, interpret=True),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_rejects_empty_queries_or_keys(path):
    case = make_case(18, head_dim=16)  # a kernel head_dim, so only the length can be wrong
    q, k, v, qp, pos = physical(case, case["pos"])
    fn = functools.partial(PATHS[path], causal=True)
    with pytest.raises(ValueError, match=r"at least one query.*q_len 0"):
        jax.eval_shape(fn, q[:, :0], k, v, qp[:, :0], pos)
    with pytest.raises(ValueError, match=r"at least one query.*kv_len 0"):
        jax.eval_shape(fn, q, k[:, :0], v[:, :0], qp, pos[:, :0])
    jax.eval_shape(fn, q, k, v, qp, pos)  # the same call with tokens is fine
    with pytest.raises(ValueError, match="kv_len 0"):
        jax.eval_shape(
            functools.partial(attend, backend=path if path == "pallas" else f"xla_{path}"),
            q,
            k[:, :0],
            v[:, :0],
            qp,
            pos[:, :0],
        )


@pytest.mark.parametrize("path", ["dense", "blockwise"])
def test_cache_relative_rope_rejects_odd_head_dim(path):
    q, k, v, qp, pos = physical(make_case(19, head_dim=7), make_case(19, head_dim=7)["pos"])
    with pytest.raises(ValueError, match="even head_dim"):
        jax.eval_shape(functools.partial(PATHS[path], rope=CacheRope()), q, k, v, qp, pos)
    with pytest.raises(ValueError, match="even head_dim"):
        CacheRope().rotate(q, qp)


# ------------------------------------------------------------------ the real RingCache


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_attention_over_ring_cache_stream_matches_history():
    import jaxkv

    spec = jaxkv.RingSpec(chunk=4, window=12, sink=4)
    heads, d = 2, 8
    cache = jaxkv.RingCache.init(spec, batch=2, heads=heads, head_dim=d)
    rng = np.random.default_rng(17)
    hist_k, hist_v = [], []
    step = jax.jit(lambda c, k, v: c.begin_chunk().write(k, v))
    run = jax.jit(functools.partial(attend, chunk=4, window=8, sink=4, backend="xla_blockwise", block_k=4))
    ref = jax.jit(functools.partial(dense_attention, chunk=4, window=8, sink=4))
    chrono = jax.jit(lambda c: c.chronological())
    for n in range(9):
        k = jnp.asarray(rng.normal(size=(2, 4, heads, d)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(2, 4, heads, d)), jnp.float32)
        q = jnp.asarray(rng.normal(size=(2, 4, heads, d)), jnp.float32)
        hist_k.append(k)
        hist_v.append(v)
        cache = step(cache, k, v)
        qp = cache.chunk_positions()
        got = run(q, cache.k, cache.v, qp, cache.positions)
        # Independent history: every chunk so far, in order; the mask (window counted from chunk starts plus the
        # sink) selects exactly what a sink + window cache retains.
        hk, hv = jnp.concatenate(hist_k, 1), jnp.concatenate(hist_v, 1)
        hpos = jnp.broadcast_to(jnp.arange(hk.shape[1], dtype=jnp.int32), (2, hk.shape[1]))
        np.testing.assert_allclose(got, ref(q, hk, hv, qp, hpos), atol=2e-6, err_msg=f"chunk {n}")
        # And the ring in physical order equals its own chronological view.
        ck, cv, cpos = chrono(cache)
        np.testing.assert_allclose(got, ref(q, ck, cv, qp, cpos), atol=2e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("backend", ["xla_dense", "xla_blockwise", "xla_cpu", "pallas"])
def test_stale_nan_in_empty_slots_never_reaches_the_output(backend, bad):
    """A session that diverged (NaN/Inf K/V) and was reset: its stale slots are empty (positions -1) but keep their
    bytes. p is 0 there, yet 0 x NaN = NaN in p @ v unless the values of empty slots are kept out."""
    import jaxkv

    spec = jaxkv.RingSpec(chunk=2, window=4)
    heads, d = 2, 16  # a kernel head_dim
    cache = jaxkv.RingCache.init(spec, batch=1, heads=heads, head_dim=d)
    poison = jnp.full((1, 2, heads, d), bad, jnp.float32)
    for _ in range(2):
        cache = cache.begin_chunk().write(poison, poison)
    assert not np.isfinite(np.asarray(cache.k)).any()
    cache = cache.reset().begin_chunk()
    ones = jnp.ones((1, 2, heads, d), jnp.float32)
    cache = cache.write(ones, ones)
    assert not np.isfinite(np.asarray(cache.v[:, 2:])).any()  # the stale chunk is still there, only emptied
    out = attend(
        ones,
        cache.k,
        cache.v,
        cache.chunk_positions(),
        cache.positions,
        mask=spec.mask(),
        backend=backend,
        interpret=True,
        block_k=4,
    )
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)


def test_mask_spec_is_the_one_mask_vocabulary():
    """`mask=MaskSpec(...)` and the keyword sugar are the same call; a cache spec names the mask of what it holds;
    mixing the two forms, or a window that is not whole chunks, is refused."""
    case = make_case(20, written=(7, 3))
    args = physical(case, case["pos"])
    spec = MaskSpec(chunk=4, window=12, sink=4)
    import jaxkv

    assert jaxkv.RingSpec(chunk=4, window=12, sink=4).mask() == spec
    for backend in ("xla_dense", "xla_blockwise"):
        np.testing.assert_array_equal(
            attend(*args, mask=spec, backend=backend, block_k=4),
            attend(*args, chunk=4, window=12, sink=4, backend=backend, block_k=4),
        )
    np.testing.assert_array_equal(
        visible(args[3], args[4], spec), visible(args[3], args[4], chunk=4, window=12, sink=4)
    )
    with pytest.raises(ValueError, match="not both"):
        attend(*args, mask=spec, causal=True)
    with pytest.raises(ValueError, match="mask must be"):
        attend(*args, mask=dict(chunk=4))
    with pytest.raises(ValueError, match="whole number of chunks"):
        MaskSpec(chunk=4, window=6)


@pytest.mark.parametrize("mask", MASKS)
def test_block_rule_is_never_false_for_a_visible_pair(mask):
    """The block test is the pair rule over ranges: exact on single pairs, and False on a (query range, key range)
    only when no pair inside is visible (checked against the brute-force definition)."""
    from jaxkv.attention.masks import block_may_be_visible

    spec = MaskSpec(**mask)
    rng = np.random.default_rng(21)
    for _ in range(200):
        qp = np.sort(rng.integers(0, 40, size=3))
        kp = np.sort(rng.integers(-3, 40, size=3))
        valid = kp[kp >= 0]
        k_lo, k_hi = (valid.min(), valid.max()) if len(valid) else (np.iinfo(np.int32).max, -1)
        may = bool(block_may_be_visible(jnp.int32(qp[0]), jnp.int32(qp[-1]), jnp.int32(k_lo), jnp.int32(k_hi), spec))
        # every integer position in the ranges, not just the samples
        qs, ks = np.arange(qp[0], qp[-1] + 1), np.arange(k_lo, k_hi + 1) if len(valid) else np.array([-1])
        assert may or not brute_visible(qs, ks, **mask).any(), (qp, kp)
