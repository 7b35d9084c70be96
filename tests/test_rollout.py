"""The streaming rollout against an independent cache-free reference, its two forms against each other, its
compilation count, guidance, differentiability, and the Self-Forcing schedule."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxkv import rollout as R
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4  # 2 tokens per frame


def _params(seed=0):
    return wan.init_params(CFG, jax.random.key(seed))


def _ctx(seed=1, batch=1):
    return jax.random.normal(jax.random.key(seed), (batch, 3, CFG.text_dim))


def reference_rollout(params, rc, context, noise, negative_context=None):
    """Self-Forcing's sampler without any cache: every pass recomputes the whole history under the block-causal
    mask (past chunks at their committed clean latents and context-noise timestep, the current chunk at the pass's
    timestep) and keeps the current chunk's output. The schedule is recomputed here from its definition (steps,
    shift and context_noise read from the Schedule's fields, not from its methods)."""
    s = rc.schedule
    lin = np.asarray(s.steps) / 1000.0  # table index 1000 - d holds the unshifted sigma d/1000
    sig = s.shift * lin / (1 + (s.shift - 1) * lin)
    num_chunks, steps, batch, cf = noise.shape[:4]
    done = []  # clean chunks [batch, cf, H, W, C]
    fwd = jax.jit(
        lambda x, t, c: wan.forward_block_causal(
            params, CFG, x, t, c, chunk_frames=cf, window_frames=rc.window_frames, sink_frames=rc.sink_frames
        )
    )

    def flow_of(x, t, ctx):
        hist = jnp.concatenate(done + [x], axis=1)
        ts = jnp.concatenate([jnp.full((batch, len(done) * cf), s.context_noise), jnp.full((batch, cf), t)], 1)
        return fwd(hist, ts, ctx)[:, -cf:]

    for n in range(num_chunks):
        x = noise[n, 0]
        for i in range(steps):
            v = flow_of(x, 1000.0 * sig[i], context)
            if negative_context is not None:
                vn = flow_of(x, 1000.0 * sig[i], negative_context)
                v = vn + rc.guidance_scale * (v - vn)
            if s.sampler == "euler":  # the flow ODE, one Euler step from sigma i to sigma i + 1 (or 0)
                x = x + ((sig[i + 1] if i + 1 < steps else 0.0) - sig[i]) * v
                continue
            x0 = x - sig[i] * v
            x = (1 - sig[i + 1]) * x0 + sig[i + 1] * noise[n, i + 1] if i + 1 < steps else x0
        done.append(x)
    return jnp.concatenate(done, axis=1)


@pytest.mark.parametrize("policy,context_noise", [("ring", 0.0), ("rolling", 37.0)])
@pytest.mark.slow
def test_rollout_equals_cache_free_reference_with_sink_and_wrapping_window(policy, context_noise):
    num_chunks = 5
    rc = R.RolloutConfig(
        H,
        W,
        chunk_frames=1,
        window_frames=2,
        sink_frames=1,
        policy=policy,
        schedule=Schedule(steps=(1000, 600, 250), context_noise=context_noise),
    )
    params, ctx = _params(), _ctx(batch=2)
    noise = jax.random.normal(jax.random.key(2), rc.noise_shape(CFG, 2, num_chunks))
    got = R.jit_rollout(params, CFG, rc, ctx, num_chunks=num_chunks, noise=noise).latents
    want = reference_rollout(params, rc, ctx, noise)
    assert got.shape == (2, num_chunks, H, W, CFG.in_dim)
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert err <= 1e-4, err


@pytest.mark.slow
def test_euler_sampler_equals_the_flow_ode_reference():
    rc = R.RolloutConfig(
        H,
        W,
        chunk_frames=1,
        window_frames=2,
        sink_frames=1,
        schedule=Schedule(steps=(1000, 750, 500, 250), shift=1.0, sampler="euler"),
    )
    params, ctx = _params(), _ctx(batch=2)
    noise = jax.random.normal(jax.random.key(2), rc.noise_shape(CFG, 2, 4))
    got = R.jit_rollout(params, CFG, rc, ctx, num_chunks=4, noise=noise).latents
    want = reference_rollout(params, rc, ctx, noise)
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert err <= 1e-4, err
    # only noise[:, 0] (each chunk's start) matters to it; the fresh-noise sampler uses the rest
    other = noise.at[:, 1:].set(0.0)
    again = R.jit_rollout(params, CFG, rc, ctx, num_chunks=4, noise=other).latents
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))
    with pytest.raises(ValueError, match="Schedule.sampler must be one of"):
        Schedule(sampler="ddpm")


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_guidance_runs_the_negative_context_as_a_second_session():
    rc = R.RolloutConfig(
        H, W, chunk_frames=1, window_frames=2, guidance_scale=3.0, schedule=Schedule(steps=(1000, 500))
    )
    params, ctx, neg = _params(3), _ctx(4), _ctx(5)
    noise = jax.random.normal(jax.random.key(6), rc.noise_shape(CFG, 1, 3))
    got = R.jit_rollout(params, CFG, rc, ctx, num_chunks=3, noise=noise, negative_context=neg)
    assert got.state.cache.batch == 2
    want = reference_rollout(params, rc, ctx, noise, negative_context=neg)
    assert float(jnp.abs(got.latents - want).max() / jnp.abs(want).max()) <= 1e-4
    unguided = R.jit_rollout(
        params,
        CFG,
        R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, schedule=Schedule(steps=(1000, 500))),
        ctx,
        num_chunks=3,
        noise=noise,
    ).latents
    assert float(jnp.abs(unguided - want).max()) > 1e-3


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_stream_equals_scan_rollout_for_20_chunks_with_one_compilation():
    """20 chunks on a 2-chunk window + 1 sink chunk: the ring wraps 9 times; ring == rolling == scan."""
    params, ctx = _params(7), _ctx(8)
    key = jax.random.key(9)
    results = {}
    for policy in ("ring", "rolling"):
        rc = R.RolloutConfig(
            H, W, chunk_frames=1, window_frames=2, sink_frames=1, policy=policy, schedule=Schedule(steps=(1000, 500))
        )
        before = compile_count(R.stream_step)
        stream = Stream(params, CFG, rc, ctx, num_chunks=20, key=key)
        chunks = list(stream)
        assert len(chunks) == 20 and stream.index == 20
        assert compile_count(R.stream_step) - before == 1  # one program for all 20 chunks
        streamed = jnp.concatenate(chunks, axis=1)
        whole = R.jit_rollout(params, CFG, rc, ctx, num_chunks=20, key=key)
        np.testing.assert_allclose(np.asarray(streamed), np.asarray(whole.latents), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(stream.state.cache.positions), np.asarray(whole.state.cache.positions))
        results[policy] = streamed
        assert np.isfinite(np.asarray(streamed)).all()
    np.testing.assert_allclose(np.asarray(results["ring"]), np.asarray(results["rolling"]), atol=1e-5)
    # the cache holds the sink (chunk 0) and the last two chunks, in the ring's physical order
    pos = np.asarray(whole.state.cache.positions[0])
    assert sorted(pos.tolist()) == [0, 1, 36, 37, 38, 39]


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_rollout_can_continue_from_its_state():
    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, schedule=Schedule(steps=(1000, 500)))
    params, ctx, key = _params(10), _ctx(11), jax.random.key(12)
    full = R.jit_rollout(params, CFG, rc, ctx, num_chunks=3, key=key).latents
    first = R.jit_rollout(params, CFG, rc, ctx, num_chunks=1, key=key)
    before = compile_count(R.jit_rollout)
    second = R.jit_rollout(params, CFG, rc, ctx, num_chunks=1, key=key, state=first.state, first_chunk=1)
    third = R.jit_rollout(params, CFG, rc, ctx, num_chunks=1, key=key, state=second.state, first_chunk=2)
    # first_chunk is traced: continuing at offsets 1 and 2 runs one program, not one per offset
    assert compile_count(R.jit_rollout) - before == 1
    got = jnp.concatenate([first.latents, second.latents, third.latents], 1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=1e-5)
    for bad in (-1, 1.5, True, jnp.zeros((2,), jnp.int32)):
        with pytest.raises(ValueError, match="first_chunk"):
            R.rollout(params, CFG, rc, ctx, num_chunks=1, key=key, state=first.state, first_chunk=bad)


@pytest.mark.parametrize("policy", ["ring", pytest.param("rolling", marks=pytest.mark.slow)])
def test_committing_a_streams_own_chunks_gives_its_state(policy):
    # the cache after committing a stream's 4 chunks (past the first eviction: sink 1 + window 2) holds what the
    # stream's own commit passes wrote, so the next chunk comes out the same
    rc = R.RolloutConfig(
        H,
        W,
        chunk_frames=1,
        window_frames=2,
        sink_frames=1,
        policy=policy,
        schedule=Schedule(steps=(1000, 500), context_noise=20.0),
    )
    params, ctx, key = _params(20), _ctx(21, batch=2), jax.random.key(22)
    first = R.rollout(params, CFG, rc, ctx, num_chunks=4, key=key)
    state = R.commit(params, CFG, rc, R.init_state(params, CFG, rc, ctx), first.latents)
    chex.assert_trees_all_close(state.cache, first.state.cache, atol=1e-5, rtol=1e-7)
    nxt = [
        R.rollout(params, CFG, rc, None, num_chunks=1, key=key, state=s, first_chunk=4).latents
        for s in (first.state, state)
    ]
    np.testing.assert_allclose(np.asarray(nxt[1]), np.asarray(nxt[0]), atol=1e-5)
    for bad in (first.latents[:, :0], first.latents[..., :2], first.latents[:1]):
        with pytest.raises(ValueError, match="commit" if bad.shape[0] == 2 else "sessions"):
            R.commit(params, CFG, rc, R.init_state(params, CFG, rc, ctx), bad)


def test_committing_a_guided_streams_own_chunks_gives_its_state():
    # a guided stream commits each chunk to both sessions of its row (the conditional and the negative one); commit
    # under guidance must write the same caches, so the stream continues the same from either state
    rc = R.RolloutConfig(
        H,
        W,
        chunk_frames=1,
        window_frames=2,
        sink_frames=1,
        guidance_scale=2.5,
        schedule=Schedule(steps=(1000, 500), context_noise=20.0),
    )
    params, ctx, neg, key = _params(23), _ctx(24, batch=2), _ctx(25, batch=2), jax.random.key(26)
    first = R.rollout(params, CFG, rc, ctx, num_chunks=4, key=key, negative_context=neg)
    state = R.commit(params, CFG, rc, R.init_state(params, CFG, rc, ctx, neg), first.latents)
    assert state.cache.batch == 4
    chex.assert_trees_all_close(state.cache, first.state.cache, atol=1e-5, rtol=1e-7)
    nxt = [
        R.rollout(params, CFG, rc, None, num_chunks=1, key=key, state=s, first_chunk=4).latents
        for s in (first.state, state)
    ]
    np.testing.assert_allclose(np.asarray(nxt[1]), np.asarray(nxt[0]), atol=1e-5)
    unguided = dataclasses.replace(rc, guidance_scale=None)
    with pytest.raises(ValueError, match="4 sessions, the latents 2 rows"):
        R.commit(params, CFG, unguided, R.init_state(params, CFG, rc, ctx, neg), first.latents)
    with pytest.raises(ValueError, match="guidance doubles them"):
        R.commit(params, CFG, rc, R.init_state(params, CFG, unguided, ctx), first.latents)


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_rollout_is_differentiable_and_an_optax_step_lowers_the_loss():
    tiny = wan.preset("tiny")
    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, schedule=Schedule(steps=(1000, 500)))
    params = wan.init_params(tiny, jax.random.key(13))
    ctx = jax.random.normal(jax.random.key(14), (1, 3, tiny.text_dim))
    noise = jax.random.normal(jax.random.key(15), rc.noise_shape(tiny, 1, 2))
    target = jax.random.normal(jax.random.key(16), (1, 2, H, W, tiny.in_dim))

    def loss(p):
        return jnp.mean((R.rollout(p, tiny, rc, ctx, num_chunks=2, noise=noise).latents - target) ** 2)

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    value, grads = value_and_grad(params)
    # the gradient reaches the keys/values through the cache writes: compare directional derivatives with central
    # finite differences along random directions, one over all parameters and one over the self-attention key/value
    # projections only (float32, so a loose tolerance; gradients lost in the cache writes would make the second ~0)
    f = lambda p: value_and_grad(p)[0]  # reuses the one compiled program
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(17), len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for only_kv in (False, True):
        direction = [
            jax.random.normal(k, x.shape) * (not only_kv or ("self_attn" in path and ("'k'" in path or "'v'" in path)))
            for k, x, path in zip(keys, leaves, paths)
        ]
        norm = jnp.sqrt(sum(jnp.sum(d**2) for d in direction))
        direction = jax.tree.unflatten(treedef, [d / norm for d in direction])
        eps = 3e-2
        fd = (
            f(jax.tree.map(lambda p, d: p + eps * d, params, direction))  # noqa: B023 - called in the iteration that defines it
            - f(jax.tree.map(lambda p, d: p - eps * d, params, direction))  # noqa: B023 - called in the iteration that defines it
        ) / (2 * eps)
        ad = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction), strict=True))
        assert abs(float(fd)) > 1e-4
        assert abs(float(fd) - float(ad)) <= 0.05 * abs(float(fd)), (only_kv, fd, ad)
    opt = optax.adam(1e-3)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    assert float(f(optax.apply_updates(params, updates))) < float(value)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"rope": "cache-relative"},
        pytest.param({"dilated_every": 2, "dilation": 2, "buckets": 2, "sink_frames": 0}, marks=pytest.mark.slow),
    ],
)
def test_remat_gives_the_gradient_of_the_rollout_without_it(extra):
    """`RolloutConfig(remat=True)` recomputes each block in the backward pass (a ``remat2`` equation in the gradient's
    program, none without it) and gives the same loss and gradient (float rounding), on the plain, the
    cache-relative and the mixed dense/dilated layer scans; and it is not part of a session's fingerprint (it
    changes nothing a stream holds)."""
    from jaxkv import session
    from tests.helpers.gradients import remat_gradients_agree

    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, schedule=Schedule(steps=(1000, 500)), **extra)
    params, ctx = _params(21), _ctx(22)
    noise = jax.random.normal(jax.random.key(23), rc.noise_shape(CFG, 1, 3))
    target = jax.random.normal(jax.random.key(24), (1, 3, H, W, CFG.in_dim))

    def make_loss(remat):
        cfg = dataclasses.replace(rc, remat=remat)
        return lambda p: jnp.mean((R.rollout(p, CFG, cfg, ctx, num_chunks=3, noise=noise).latents - target) ** 2)

    remat_gradients_agree(make_loss, params)
    cache = R.init_state(params, CFG, rc, ctx).cache
    remat_rc = dataclasses.replace(rc, remat=True)
    assert session.fingerprint(CFG, rc, cache) == session.fingerprint(CFG, remat_rc, cache)
    with pytest.raises(ValueError, match="RolloutConfig.remat must be a bool"):
        dataclasses.replace(rc, remat="yes")


def test_self_forcing_schedule_values():
    s = Schedule()
    # warped through the shift-5 table: sigma(d) = 5u / (1 + 4u) with u = d/1000
    np.testing.assert_allclose(s.timesteps(), [1000.0, 937.5, 2500.0 / 3.0, 625.0], rtol=1e-12)
    np.testing.assert_allclose(Schedule(warp=False).timesteps(), [1000, 750, 500, 250])
    t, sigma, nxt = s.passes()
    assert t[-1] == 0.0 and sigma[-1] == 0.0 and nxt[-2] == 0.0
    for bad in (
        {"steps": ()},
        {"steps": (500, 750)},
        {"steps": (1001,)},
        {"shift": 0.0},
        {"shift": float("inf")},
        {"shift": float("nan")},
        {"shift": True},
        {"shift": "5"},
        {"context_noise": -1},
        {"context_noise": float("nan")},
        {"context_noise": float("inf")},
        {"num_train_timesteps": 1000.0},
        {"num_train_timesteps": 0},
        {"warp": 1},
    ):
        with pytest.raises(ValueError):
            Schedule(**bad)


def test_bad_rollout_arguments_raise_clear_errors():
    params, ctx = _params(), _ctx()
    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2)
    with pytest.raises(ValueError, match="multiples"):
        R.RolloutConfig(H, W, chunk_frames=2, window_frames=3)
    with pytest.raises(ValueError, match="policy"):
        R.RolloutConfig(H, W, policy="lru")
    with pytest.raises(ValueError, match="exactly one"):
        R.rollout(params, CFG, rc, ctx, num_chunks=2)
    with pytest.raises(ValueError, match="noise must be"):
        R.rollout(params, CFG, rc, ctx, num_chunks=2, noise=jnp.zeros((2, 4, 1, 1, H, W, 3)))
    with pytest.raises(ValueError, match="negative_context"):
        R.rollout(
            params,
            CFG,
            R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, guidance_scale=2.0),
            ctx,
            num_chunks=1,
            key=jax.random.key(0),
        )
    with pytest.raises(ValueError, match="divisible"):
        R.rollout(
            params,
            CFG,
            R.RolloutConfig(3, W, chunk_frames=1, window_frames=2),
            ctx,
            num_chunks=1,
            key=jax.random.key(0),
        )


def test_stream_rejects_more_chunks_than_the_noise_holds():
    params, ctx = _params(), _ctx()
    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, schedule=Schedule(steps=(1000, 500)))
    noise = jnp.zeros(rc.noise_shape(CFG, 1, 2))
    with pytest.raises(ValueError, match="num_chunks=3 but the noise holds only 2"):
        Stream(params, CFG, rc, ctx, num_chunks=3, noise=noise)
    assert Stream(params, CFG, rc, ctx, noise=noise).num_chunks == 2
    assert Stream(params, CFG, rc, ctx, num_chunks=1, noise=noise).num_chunks == 1


@pytest.mark.slow
def test_rollout_rejects_a_temporal_patch_and_bad_guidance_or_context():
    cfg = WanConfig(
        dim=32,
        ffn_dim=48,
        num_heads=2,
        num_layers=1,
        in_dim=4,
        out_dim=4,
        text_dim=8,
        text_len=5,
        freq_dim=16,
        patch_size=(2, 2, 2),
    )
    rc = R.RolloutConfig(H, W, chunk_frames=2, window_frames=4)
    with pytest.raises(ValueError, match="temporal patch of 1"):
        R.init_state(wan.init_params(cfg, jax.random.key(0)), cfg, rc, _ctx())
    for g in (float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="guidance_scale"):
            R.RolloutConfig(H, W, guidance_scale=g)
    params = _params()
    guided = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, guidance_scale=2.0)
    too_long = jnp.zeros((1, CFG.text_len + 1, CFG.text_dim))
    with pytest.raises(ValueError, match="negative_context has 6 tokens"):
        R.init_state(params, CFG, guided, _ctx(), too_long)
    with pytest.raises(ValueError, match=r"negative_context must be \[batch=1"):
        R.init_state(params, CFG, guided, _ctx(), jnp.zeros((2, 3, CFG.text_dim)))
    with pytest.raises(ValueError, match="context has 6 tokens"):
        R.init_state(params, CFG, rc, too_long)


def test_rollout_and_stream_refuse_to_pass_the_int32_position_limit():
    params, ctx = _params(), _ctx()
    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2)
    limit = rc.spec(CFG).max_chunks
    assert limit == 2**31 // 2  # 2 tokens per frame, 1-frame chunks
    with pytest.raises(ValueError, match="int32 position limit"):
        R.rollout(params, CFG, rc, ctx, num_chunks=limit + 1, key=jax.random.key(0))
    with pytest.raises(ValueError, match="int32 position limit"):
        Stream(params, CFG, rc, ctx, num_chunks=limit + 1, key=jax.random.key(0))
    # Continuing a state: the chunks it already holds count.
    state = R.init_state(params, CFG, rc, ctx)
    chunk = rc.spec(CFG).chunk
    late = state._replace(cache=state.cache.replace(chunk_start=jnp.array([(limit - 2) * chunk], jnp.int32)))
    with pytest.raises(ValueError, match="generate at most 1 more"):
        R.rollout(params, CFG, rc, ctx, num_chunks=2, key=jax.random.key(0), state=late)
    # An endless stream stops with an error at the limit instead of wrapping.
    stream = Stream(params, CFG, rc, ctx, key=jax.random.key(0))
    stream.carry = stream.carry.replace(next_chunk=np.int32(limit))
    with pytest.raises(OverflowError, match="int32 position limit"):
        next(stream)
