"""Cache-relative RoPE on dilated layers (`DilatedCache`) and mixed dense/dilated caches (`MixedCache`): the stream
against a cache-free reference with per-layer visibility and keys rotated by their rank among what each chunk sees;
the wrapped clock (`jaxkv.cache.clock.wrap_clock`) against the same stream unwrapped, through two wraps, with one
compilation; a session saved and resumed across a wrap; a prompt switch (replay re-cache) after a wrap."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.cache as C
from jaxkv import recache
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.cache.clock import history_chunks, wrap_period
from jaxkv.cache.dilated import stored_positions
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.dit import dit
from jaxkv.models.wan.rope import apply_rope, rope_angles, rope_cos_sin, sequence_positions
from jaxkv.run_options import RunOptions
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream
from tests.helpers.masked_reference import sample_history
from tests.test_rollout_mixed import layer_masks

XLA = RunOptions.of(backend="xla")  # the reference blocks' run options: float32, cross-attention on the XLA path

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=4, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4  # 2 tokens per frame
GRID = (H // 2, W // 2)
SCHEDULE = Schedule(steps=(1000, 500), context_noise=21.0)

CASES = {
    # every 2nd layer dilated: 2-frame chunks, dense sink 1 chunk + window 2 chunks, kept frames 0, 3, 6, ... in 2
    # buckets (a kept frame falls mid-chunk)
    "mixed": dict(chunk_frames=2, window_frames=4, sink_frames=2, dilated_every=2, dilation=3, buckets=2),
    # every layer dilated: kept frames 0, 2, 4, ... in 2 buckets
    "dilated": dict(chunk_frames=2, window_frames=2, sink_frames=0, dilated_every=1, dilation=2, buckets=2),
}


def _rc(name, **kw):
    return R.RolloutConfig(H, W, schedule=SCHEDULE, rope="cache-relative", **CASES[name], **kw)


def _params(seed=0):
    return wan.init_params(CFG, jax.random.key(seed))


def _ctx(seed=1, batch=1):
    return jax.random.normal(jax.random.key(seed), (batch, 3, CFG.text_dim))


# ------------------------------------------------------------------------------------------------ the reference


def reference_relative_rollout(params, rc, context, noise, frame_masks):
    """float32 [batch, frames, h, w, c]: a rollout without cache or ranks of any cache, recomputing the whole
    history every pass (as tests/helpers/masked_reference.py) where layer l's query frame qf sees key frame kf iff
    ``frame_masks[l, qf, kf]``, and RoPE is cache-relative by definition: in qf's row, every visible frame is
    rotated as the frame at its index among the row's visible frames (oldest 0), the query as its own frame."""
    batch = noise.shape[2]
    tpf = CFG.tokens_per_frame(H, W)
    # frame index of key frame kf in query frame qf's row: the visible frames before it
    frame_rank = np.cumsum(frame_masks, axis=2) - frame_masks  # [layers, F, F]
    own = np.stack([np.diagonal(r) for r in frame_rank])  # [layers, F]: the query frame's own index
    cross = wan.cross_kv(params, CFG, context)

    @jax.jit
    def fwd(x, t):
        n = x.shape[1] * tpf
        frames = x.shape[1]
        tok = np.arange(n)
        masks = jnp.asarray(np.repeat(np.repeat(frame_masks[:, :frames, :frames], tpf, 1), tpf, 2))
        # token "positions" fed to Wan's RoPE: frame index * tokens_per_frame + the token's place in its frame
        k_pos = jnp.asarray(frame_rank[:, tok // tpf][:, :, tok // tpf] * tpf + tok % tpf)  # [layers, n, n]
        q_pos = jnp.asarray(own[:, tok // tpf] * tpf + tok % tpf)  # [layers, n]
        angles = lambda p: rope_cos_sin(rope_angles(p, GRID, CFG.head_dim, CFG.rope_theta))

        def attention(q, k, v, state, layer):
            take = lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
            mask, kp, qp = take(masks), take(k_pos), take(q_pos)
            q_rot = apply_rope(q.astype(jnp.float32), *angles(jnp.broadcast_to(qp, (batch, n))))
            # keys rotated per query row: [batch * n rows, n keys]
            k_rows = jnp.broadcast_to(k[:, None], (batch, n, *k.shape[1:])).reshape(batch * n, *k.shape[1:])
            cos, sin = angles(jnp.broadcast_to(kp[None], (batch, n, n)).reshape(batch * n, n))
            k_rot = apply_rope(k_rows.astype(jnp.float32), cos, sin).reshape(batch, n, n, *k.shape[2:])
            logits = jnp.einsum("bqhd,bqkhd->bhqk", q_rot, k_rot) * q.shape[-1] ** -0.5
            p = jax.nn.softmax(jnp.where(mask[None, None], logits, -jnp.inf), axis=-1)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v), state

        positions = sequence_positions(batch, n)
        return dit(params, CFG, x, t, positions, cross, attention, None, XLA, rotate=False)[0]

    return sample_history(fwd, rc.schedule, noise)


@pytest.mark.slow  # a rollout and ~2 x num_chunks reference forwards per case
@pytest.mark.parametrize("name,num_chunks", [("mixed", 6), ("dilated", 6)])
def test_cache_relative_rollout_equals_the_cache_free_reference(name, num_chunks):
    rc = _rc(name)
    masks = layer_masks(rc, num_chunks)
    params, ctx = _params(), _ctx()
    noise = jax.random.normal(jax.random.key(2), rc.noise_shape(CFG, 1, num_chunks))
    out = R.jit_rollout(params, CFG, rc, ctx, num_chunks=num_chunks, noise=noise)
    want = reference_relative_rollout(params, rc, ctx, noise, masks)
    err = float(jnp.abs(out.latents - want).max() / jnp.abs(want).max())
    assert err <= 1e-4, err
    # the reference tells the two RoPE modes apart: absolute RoPE is far from it
    absolute = R.jit_rollout(params, CFG, _rc_absolute(name), ctx, num_chunks=num_chunks, noise=noise).latents
    assert float(jnp.abs(absolute - want).max() / jnp.abs(want).max()) > 100 * max(err, 1e-6)


def _rc_absolute(name):
    return R.RolloutConfig(H, W, schedule=SCHEDULE, **CASES[name])


# ------------------------------------------------------------------------------------------------ the wrapped clock


def _advanced(cache, chunks: int):
    """The cache with its clock moved on by ``chunks``: what a stream that ran that much longer holds, by the
    rules (a ring's window slots and a dilated layer's frames, visible or pending -(p) - 2, move; the sink and
    empty slots stay). ``chunks`` keeps every slot: a multiple of the window, of dilation * buckets frames and of
    the history's window."""
    if isinstance(cache, C.MixedCache):
        return cache.replace(dense=_advanced(cache.dense, chunks), dilated=_advanced(cache.dilated, chunks))
    d = chunks * cache.spec.chunk
    pos = cache.positions
    if isinstance(cache, C.DilatedCache):
        assert (chunks * cache.spec.chunk_frames) % (cache.spec.dilation * cache.spec.buckets) == 0
        moved = jnp.where(pos >= 0, pos + d, jnp.where(pos <= -2, pos - d, pos))
    else:
        assert chunks % cache.spec.window_chunks == 0
        moved = jnp.where(pos >= cache.spec.sink, pos + d, pos)
    return cache.replace(positions=moved, chunk_start=cache.chunk_start + d)


def _unit(spec) -> int:
    """The test's own reading of the chunks a clock may move by (module docstring of `jaxkv.cache.clock`)."""
    dil = spec.dilated if isinstance(spec, C.MixedSpec) else spec
    frames = dil.dilation * dil.buckets
    unit = math.lcm(frames // math.gcd(frames, dil.chunk_frames), history_chunks(spec))
    return math.lcm(unit, spec.dense.window_chunks) if isinstance(spec, C.MixedSpec) else unit


def _near_the_limit(cache) -> int:
    """Chunks (a multiple of `_unit`) that put ``cache``'s clock as close before the last chunk that fits (chunk
    max_chunks - 2 with dilated layers: a pending frame stores -(position) - 2) as they can: it wraps within
    `_unit` + 1 chunks."""
    spec, unit = cache.spec, _unit(cache.spec)
    return (spec.max_chunks - 2 - _clock(cache)) // unit * unit


def _clock(cache) -> int:
    return int(cache.next_chunk_index()[0])


def _run_to_the_wrap(params, rc, state, noise, n, want, bound):
    """Steps ``state`` from chunk ``n`` until its clock has wrapped (at most ``bound`` chunks), checking each chunk
    against ``want[chunk]``: (state, the next chunk)."""
    for _ in range(bound):
        clock = _clock(state.cache)
        got, state = R.stream_step(CFG, rc, params, state, None, None, noise[n])
        np.testing.assert_array_equal(np.asarray(got), want[n])
        n += 1
        if _clock(state.cache) < clock:
            return state, n
    raise AssertionError(f"no wrap within {bound} chunks")


@pytest.mark.parametrize("name", ["mixed", "dilated"])
def test_a_stream_wrapped_twice_equals_it_unwrapped_with_one_compilation(name):
    """The stream after 5 chunks, its clock moved near the int32 limit: its next chunks wrap (the clock jumps back
    by `wrap_period`), are moved near the limit again and wrap a second time; every chunk equals the unwrapped
    stream's, bit for bit, positions stay within int32, and all steps of both streams run one program."""
    rc = _rc(name)
    params, ctx = _params(3), _ctx(4)
    spec = rc.cache_spec(CFG)
    unit = _unit(spec)
    assert wrap_period(spec) % unit == 0 and wrap_period(spec) > spec.max_chunks // 3
    num = 5 + 2 * (unit + 1) + 2
    noise = jax.random.normal(jax.random.key(5), rc.noise_shape(CFG, 1, num))
    before = compile_count(R.stream_step)
    want = [np.asarray(c) for c in Stream(params, CFG, rc, ctx, noise=noise)]
    first = Stream(params, CFG, rc, ctx, noise=noise[:5], num_chunks=5)
    for _ in first:
        pass
    state, n = first.state, 5
    for _ in range(2):
        state = R.RolloutState(_advanced(state.cache, _near_the_limit(state.cache)), state.cross)
        state, n = _run_to_the_wrap(params, rc, state, noise, n, want, unit + 1)
        caches = (state.cache.dense, state.cache.dilated) if name == "mixed" else (state.cache,)
        for c in caches:  # every stored position (visible or pending) is one of the chunks up to the clock's
            held = stored_positions(c.positions)
            assert int(held.min()) >= -1 and int(held.max()) < int(c.chunk_start[0]) + c.spec.chunk
    got, state = R.stream_step(CFG, rc, params, state, None, None, noise[n])  # and one more
    np.testing.assert_array_equal(np.asarray(got), want[n])
    assert compile_count(R.stream_step) - before == 1


@pytest.mark.slow  # session files and a second stream
@pytest.mark.parametrize("name", ["mixed", "dilated"])
def test_a_session_saved_after_a_wrap_resumes_as_the_unwrapped_stream(name, tmp_path):
    rc = _rc(name)
    params, ctx = _params(6), _ctx(7)
    unit = _unit(rc.cache_spec(CFG))
    num = 5 + unit + 1 + 3
    noise = jax.random.normal(jax.random.key(8), rc.noise_shape(CFG, 1, num))
    want = [np.asarray(c) for c in Stream(params, CFG, rc, ctx, noise=noise)]
    first = Stream(params, CFG, rc, ctx, noise=noise[:5], num_chunks=5)
    for _ in first:
        pass
    state = R.RolloutState(_advanced(first.state.cache, _near_the_limit(first.state.cache)), first.state.cross)
    state, n = _run_to_the_wrap(params, rc, state, noise, 5, want, unit + 1)
    S.save(str(tmp_path / "s"), S.Session.create(CFG, rc, state, key=None, next_chunk=n))
    rest = Stream.from_session(params, CFG, rc, S.load(str(tmp_path / "s"), CFG, rc), noise=noise[n:])
    np.testing.assert_array_equal(np.concatenate([np.asarray(c) for c in rest], 1), np.concatenate(want[n:], 1))


@pytest.mark.slow  # the replay re-cache compiles per case
@pytest.mark.parametrize("name", ["mixed", "dilated"])
def test_a_prompt_switch_after_a_wrap_equals_the_switch_of_the_unwrapped_stream(name):
    """Both streams keep the latent history (`LatentRing`, pushed on their own clock); the wrapped one's history
    holds chunks pushed before and after its wrap. The switch right after the wrap (replay of the held chunks under
    the new prompt, `jaxkv.recache_dilated`, most of them pushed before the wrap) and the chunks after it are the
    unwrapped stream's, bit for bit."""
    rc = _rc(name)
    params, ctx, new = _params(9), _ctx(10), _ctx(11)
    unit = _unit(rc.cache_spec(CFG))
    num = 6 + unit + 1 + 4
    noise = jax.random.normal(jax.random.key(12), rc.noise_shape(CFG, 1, num))
    chunk = rc.cache_spec(CFG).chunk
    sink = recache.ring_spec(CFG, rc).sink_chunks
    ring0 = recache.LatentRing.init(recache.ring_spec(CFG, rc), rc.chunk_shape(CFG, 1))
    runs, switch_at = {}, None
    for shifted in (True, False):  # the wrapped stream first: it says where its wrap fell
        # (distinct buffers: every step donates its state, and eager zeros may share one)
        state, ring = jax.tree.map(jnp.copy, R.init_state(params, CFG, rc, ctx)), ring0
        out = []
        for n in range(num):
            if shifted and n == 6:
                d = _near_the_limit(state.cache)
                state = R.RolloutState(_advanced(state.cache, d), state.cross)
                ring = ring.replace(chunks=jnp.where(ring.chunks >= sink, ring.chunks + d, ring.chunks))
            if n == switch_at:
                recache.check_ring(CFG, rc, state, ring)
                state = jax.tree.map(jnp.copy, recache.switch_prompt(params, CFG, rc, state, ring, new))
            clock = _clock(state.cache)
            x, state = R.stream_step(CFG, rc, params, state, None, None, noise[n])
            if shifted and switch_at is None and _clock(state.cache) < clock:
                switch_at = n + 1  # right after the wrap: the history's older chunks were pushed before it
            ring = ring.push(x, state.cache.chunk_start[:1] // chunk)
            out.append(np.asarray(x))
        runs[shifted] = out
    assert switch_at is not None and switch_at < num - 1
    np.testing.assert_array_equal(np.concatenate(runs[True], 1), np.concatenate(runs[False], 1))
