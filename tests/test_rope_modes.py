"""RoPE modes of the Wan stream: cache-relative RoPE against a reference that re-rotates a chronological copy of the
unrotated keys at every pass; bounded positions over 10,000 chunks; the wrapped clock past 2**31."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import rollout as R
from jaxkv.attention import rope_ranks
from jaxkv.attention.reference import dense_attention
from jaxkv.cache import RingCache, RingSpec
from jaxkv.cache.spec import POSITION_LIMIT
from jaxkv.models import wan
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.dit import dit
from jaxkv.models.wan.rope import apply_rope, rope_angles, rope_cos_sin
from jaxkv.run_options import RunOptions
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream

XLA = RunOptions.of(backend="xla")  # how the model runs in the hand-built references

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4  # 2 tokens per frame
GRID = (H // 2, W // 2)


def _rc(**kw):  # the settings of tests/test_recache.py (shared compilations when run together)
    base = dict(
        chunk_frames=1, window_frames=2, sink_frames=1, schedule=Schedule(steps=(1000, 500), context_noise=20.0)
    )
    base.update(kw)
    return R.RolloutConfig(H, W, **base)


def _params():
    return wan.init_params(CFG, jax.random.key(0))


def _ctx(seed, batch=2):
    return jax.random.normal(jax.random.key(seed), (batch, 3, CFG.text_dim))


def reference_relative_stream(params, rc, context, noise):
    """Cache-relative streaming without a ring or ranks: a chronological list of each chunk's *unrotated* committed
    K/V per layer; every pass of chunk n concatenates the chunks it may see (the sink chunks and the last
    window_chunks - 1 before it, in order), appends its own, rotates all keys by their index in that list and its
    queries by theirs, and attends to all of them."""
    spec = rc.spec(CFG)
    c, s, w = spec.chunk, spec.sink_chunks, spec.window_chunks
    t, sigma, next_sigma = rc.schedule.passes()
    cross = M.cross_kv(params, CFG, context)
    batch = context.shape[0]
    hist_len = (s + w - 1) * c
    rot = lambda pos: rope_cos_sin(rope_angles(pos, GRID, CFG.head_dim, CFG.rope_theta))

    @jax.jit
    def flow_of(x, tt, hk, hv, m):
        """hk, hv [layers, batch, hist_len, heads, head_dim]: m valid tokens first, then padding."""
        idx = jnp.arange(hist_len + c)
        kv_pos = jnp.broadcast_to(jnp.where((idx < m) | (idx >= hist_len), idx, -1), (batch, hist_len + c))
        kv_rank = jnp.where(idx >= hist_len, m + idx - hist_len, idx)  # index in the list
        q_rank = jnp.broadcast_to(m + jnp.arange(c), (batch, c))
        k_rot, q_rot = rot(jnp.broadcast_to(kv_rank, (batch, hist_len + c))), rot(q_rank)

        def attn(q, k, v, rec, layer):
            keys = apply_rope(jnp.concatenate([hk[layer], k], 1), *k_rot)
            vals = jnp.concatenate([hv[layer], v], 1)
            out = dense_attention(apply_rope(q, *q_rot), keys, vals, q_rank + hist_len, kv_pos)
            return out, (rec[0].at[layer].set(k), rec[1].at[layer].set(v))

        zeros = jnp.zeros((CFG.num_layers, batch, c, CFG.num_heads, CFG.head_dim))
        return dit(params, CFG, x, jnp.full((batch,), tt), q_rank, cross, attn, (zeros, zeros), XLA, rotate=False)

    history, out = [], []
    for n in range(noise.shape[0]):
        seen = [kv for j, kv in enumerate(history) if j < s or j > n - w]
        m = len(seen) * c
        pad = jnp.zeros((CFG.num_layers, batch, hist_len - m, CFG.num_heads, CFG.head_dim))
        hk = jnp.concatenate([kv[0] for kv in seen] + [pad], axis=2)
        hv = jnp.concatenate([kv[1] for kv in seen] + [pad], axis=2)
        x = noise[n, 0]
        for i in range(len(t)):
            f, rec = flow_of(x, t[i], hk, hv, m)
            x0 = x - sigma[i] * f
            eps = noise[n, i + 1] if i + 1 < noise.shape[1] else 0.0
            x = (1 - next_sigma[i]) * x0 + next_sigma[i] * eps
        history.append(rec)  # the context pass's K/V
        out.append(x)
    return out


@pytest.mark.slow
def test_cache_relative_stream_equals_rerotating_a_chronological_copy():
    rc = _rc(rope="cache-relative")
    params, ctx = _params(), _ctx(1)
    noise = jax.random.normal(jax.random.key(2), rc.noise_shape(CFG, 2, 6))  # the window wraps twice
    got = list(Stream(params, CFG, rc, ctx, noise=noise))
    want = reference_relative_stream(params, rc, ctx, noise)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        err = float(jnp.abs(g - w).max() / jnp.abs(w).max())
        assert err <= 1e-4, (n, err)
    # the mode matters: absolute RoPE gives another stream once the frames the model sees differ (chunk 2 on)
    absolute = list(Stream(params, CFG, _rc(), ctx, noise=noise))
    assert float(jnp.abs(absolute[0] - got[0]).max()) <= 1e-5  # chunk 0: frame 0 in both modes
    assert float(jnp.abs(absolute[-1] - got[-1]).max()) > 1e-3


@pytest.mark.slow
def test_cache_relative_keys_are_cached_unrotated():
    """The cached keys of a one-chunk stream are the layer's plain k projections: rotating them at the chunk's
    absolute positions gives the absolute-mode cache (frame 0: rank = position)."""
    params, ctx = _params(), _ctx(1)
    noise = jax.random.normal(jax.random.key(3), _rc().noise_shape(CFG, 2, 2))
    rel = Stream(params, CFG, _rc(rope="cache-relative"), ctx, noise=noise)
    ab = Stream(params, CFG, _rc(), ctx, noise=noise)
    next(rel), next(ab)
    c = rel.state.cache.spec.chunk
    pos = jnp.broadcast_to(jnp.arange(c), (2, c))
    k_rel = rel.state.cache.k[:, :, :c]
    rotated = jax.vmap(lambda k: apply_rope(k, *rope_cos_sin(rope_angles(pos, GRID, CFG.head_dim))))(k_rel)
    np.testing.assert_allclose(rotated, ab.state.cache.k[:, :, :c], atol=1e-5)
    assert float(jnp.abs(k_rel - ab.state.cache.k[:, :, :c]).max()) > 1e-3  # and they were not rotated


# ------------------------------------------------------------------------------------------------ positions


def _positions_only_stream(spec: RingSpec, cache, num_chunks: int):
    """num_chunks chunks of position bookkeeping alone (wrap_clock, begin, a write of zeros) under one jit; per
    chunk the largest query and key ranks and the reserved chunk's start."""

    def body(cache, _):
        cache = R.wrap_clock(cache).begin_chunk()
        zeros = jnp.zeros((cache.batch, spec.chunk, 1, 2), cache.dtype)
        cache = cache.write(zeros, zeros)
        q_rank, k_rank = rope_ranks(cache.chunk_positions(), cache.positions)
        return cache, (q_rank.max(), k_rank.max(), cache.chunk_start[0], cache.positions.min(), cache.positions.max())

    return jax.jit(lambda c: lax_scan(body, c, num_chunks))(cache)


def lax_scan(body, cache, n):
    return jax.lax.scan(body, cache, None, length=n)


def _advanced(cache: RingCache, chunks: int) -> RingCache:
    """The cache with its clock moved on by ``chunks`` (a whole number of windows): what a stream that ran that
    much longer holds, by the ring rule."""
    spec = cache.spec
    assert chunks % spec.window_chunks == 0
    d = chunks * spec.chunk
    moved = cache.positions >= spec.sink
    return cache.replace(
        positions=jnp.where(moved, cache.positions + d, cache.positions), chunk_start=cache.chunk_start + d
    )


def test_ranks_stay_bounded_over_10000_chunks_across_the_int32_limit():
    spec = RingSpec.from_frames(2, 3, window_frames=6, sink_frames=3)  # chunk 6 tokens, 3 slots
    fresh = RingCache.init(spec, 1, 1, 2)
    _, (q0, k0, start0, lo0, hi0) = _positions_only_stream(spec, fresh, 10)
    # the ramp: chunk n's queries sit at rank n * chunk while the cache fills, then stay at the newest slot
    np.testing.assert_array_equal(np.asarray(q0)[:4], [5, 11, 17, 17])
    assert int(np.asarray(q0).max()) < spec.capacity and int(np.asarray(k0).max()) < spec.capacity

    full, _ = _positions_only_stream(spec, fresh, 3)
    near = spec.max_chunks - 5000
    start = _advanced(full, (near - 3) // spec.window_chunks * spec.window_chunks)
    _, (q, k, chunk_start, lo, hi) = _positions_only_stream(spec, start, 10_000)
    q, k, chunk_start = map(np.asarray, (q, k, chunk_start))
    assert (q == spec.capacity - 1).all() and (k == spec.capacity - 1).all()  # the same every chunk
    # the clock went past the limit once (about 5,000 chunks in) and came back by the wrap period
    assert int(np.asarray(hi).max()) < POSITION_LIMIT and int(np.asarray(lo).min()) >= 0
    jumps = np.flatnonzero(np.diff(chunk_start) != spec.chunk)
    assert len(jumps) == 1
    assert chunk_start[jumps[0] + 1] - chunk_start[jumps[0]] == spec.chunk - R.wrap_period(spec) * spec.chunk
    assert 4990 <= jumps[0] <= 5010


def test_wrap_clock_moves_only_the_due_sessions_window():
    spec = RingSpec(chunk=4, window=8, sink=4)
    last = (spec.max_chunks - 1) * spec.chunk
    positions = jnp.array(
        [
            [0, 1, 2, 3, last - 4, last - 3, last - 2, last - 1, last, last + 1, last + 2, last + 3],
            [0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1, -1],
        ],
        jnp.int32,
    )
    cache = RingCache.init(spec, 2, 1, 2).replace(positions=positions, chunk_start=jnp.array([last, 4], jnp.int32))
    out = R.wrap_clock(cache)
    shift = R.wrap_period(spec) * spec.chunk
    want = np.asarray(positions).copy()
    want[0, 4:] -= shift
    np.testing.assert_array_equal(out.positions, want)
    np.testing.assert_array_equal(out.chunk_start, [last - shift, 4])
    assert R.wrap_period(spec) % spec.window_chunks == 0
    # the wrapped chunk keeps its ring slot
    np.testing.assert_array_equal(
        out.slot_of_chunk(out.next_chunk_index()), cache.slot_of_chunk(jnp.array([spec.max_chunks, 2]))
    )


def test_cache_relative_stream_runs_past_the_int32_limit_unchanged():
    """A stream whose clock starts two chunks before the int32 limit generates exactly the chunks of the same
    stream started at its true position: only position differences reach the model."""
    rc = _rc(rope="cache-relative")
    params, ctx = _params(), _ctx(1)
    noise = jax.random.normal(jax.random.key(4), rc.noise_shape(CFG, 2, 8))
    base = Stream(params, CFG, rc, ctx, noise=noise)
    for _ in range(4):
        next(base)
    spec = rc.spec(CFG)
    d = (spec.max_chunks - 2 - 3) // spec.window_chunks * spec.window_chunks
    copy = jax.tree.map(jnp.copy, base.state)  # every step donates its state: no shared buffers
    shifted = R.RolloutState(_advanced(copy.cache, d), copy.cross)
    assert int(shifted.cache.chunk_start[0]) // spec.chunk >= spec.max_chunks - 3
    with pytest.raises(ValueError, match="int32 position limit"):
        R.check_position_room(CFG, _rc(), 4, shifted.cache)  # absolute mode refuses it
    R.check_position_room(CFG, rc, 10**12, shifted.cache)  # the wrapped clock does not
    starts = []
    for n in range(4, 8):
        want = next(base)
        got, shifted = R.stream_step(CFG, rc, params, shifted, None, None, noise[n])
        np.testing.assert_array_equal(got, want)
        assert int(shifted.cache.positions.max()) < POSITION_LIMIT and int(shifted.cache.positions.min()) >= -1
        starts.append(int(shifted.cache.chunk_start[0]))
    assert min(np.diff(starts)) < 0  # the clock wrapped in there


def test_rope_mode_is_checked():
    with pytest.raises(ValueError, match="rope must be one of"):
        _rc(rope="relative")
    with pytest.raises(ValueError, match="rope must be one of"):
        M.check_rope_mode(None)
    assert _rc().bounded and not _rc(rope="cache-relative").bounded
