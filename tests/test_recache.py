"""Prompt switching with KV re-cache (`jaxkv.recache`) against a cache-free reference that rebuilds the cache from
the retained clean frames under the new prompt, then continues; its compilation count; its checks."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import generate as G
from jaxkv import recache as RC
from jaxkv import rollout as R
from jaxkv.attention.reference import dense_attention
from jaxkv.cache import Fp8Cache, RingSpec
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.dit import dit
from jaxkv.models.wan.rope import apply_rope, rope_angles, rope_cos_sin
from jaxkv.precision import Precision
from jaxkv.run_options import RunOptions
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream
from tests.helpers.fp8_steps import assert_within_one_e4m3_step, equal_byte_share

XLA = RunOptions.of(backend="xla")  # how the model runs in the hand-built references

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4  # 2 tokens per frame


def _params(seed=0):
    return wan.init_params(CFG, jax.random.key(seed))


def _ctx(seed, batch=1):
    return jax.random.normal(jax.random.key(seed), (batch, 3, CFG.text_dim))


def _rc(**kw):
    base = dict(
        chunk_frames=1, window_frames=2, sink_frames=1, schedule=Schedule(steps=(1000, 500), context_noise=20.0)
    )
    base.update(kw)
    return R.RolloutConfig(H, W, **base)


def reference_cache(params, rc, old_cache, clean, context, keep_sink):
    """The cache a switch must build, made without the ring, the slots or `recompute_cache`: the retained chunks
    (read off the old cache's positions) are laid out chronologically from the test's own record of clean chunks,
    run through one cache-free forward at their absolute positions under the block-causal mask and the new
    context, and their K/V written chunk by chunk into a fresh cache (of ``rc``'s kind: an FP8 cache quantizes
    each chunk in its own `write`, as a step does). With keep_sink the sink tokens' K/V are replaced (and attended)
    by the old cache's as it reads them (an FP8 cache dequantized), chronologically ordered. Cache-relative RoPE
    rotates by index in the chronological sequence (= rank)."""
    spec = old_cache.spec
    c = spec.chunk
    fp8 = rc.precision.fp8_kv
    old_k, old_v, old_pos = (old_cache.dequantized() if fp8 else old_cache).chronological()
    held = [int(p) // c for p in np.asarray(old_pos[0, ::c]) if p >= 0]
    batch = old_cache.batch
    latents = jnp.concatenate([clean[i] for i in held], axis=1)
    positions = jnp.broadcast_to(
        jnp.concatenate([jnp.arange(i * c, (i + 1) * c) for i in held]).astype(jnp.int32), (batch, len(held) * c)
    )
    n = positions.shape[1]
    sink = (positions < spec.sink)[:, :, None, None]
    cross = M.cross_kv(params, CFG, context)
    relative = rc.rope == "cache-relative"
    rank_rope = rope_cos_sin(
        rope_angles(jnp.broadcast_to(jnp.arange(n), (batch, n)), (H // 2, W // 2), CFG.head_dim, CFG.rope_theta)
    )

    def self_attention(q, k, v, kv, layer):
        if keep_sink:
            k = jnp.where(sink, old_k[layer][:, :n], k)
            v = jnp.where(sink, old_v[layer][:, :n], v)
        ks, vs = kv
        kv = (ks.at[layer].set(k), vs.at[layer].set(v))
        if relative:
            q, k = apply_rope(q, *rank_rope), apply_rope(k, *rank_rope)
        return dense_attention(q, k, v, positions, positions, mask=spec.mask()), kv

    zeros = jnp.zeros((CFG.num_layers, batch, n, CFG.num_heads, CFG.head_dim))
    t = jnp.full((batch,), rc.schedule.context_noise)
    forward = jax.jit(
        lambda p, x: dit(p, CFG, x, t, positions, cross, self_attention, (zeros, zeros), XLA, rotate=not relative)[1]
    )
    ks, vs = forward(params, latents)
    cache = M.init_cache(CFG, spec, batch, policy=rc.policy, fp8=fp8)
    for j, i in enumerate(held):
        cache = cache.replace(chunk_start=jnp.full((batch,), (i - 1) * c if i else -1, jnp.int32)).begin_chunk()
        for layer in range(CFG.num_layers):
            cache = cache.write(ks[layer][:, j * c : (j + 1) * c], vs[layer][:, j * c : (j + 1) * c], layer=layer)
    return R.RolloutState(cache, cross)


def _stream_then_switch(params, rc, ctx_a, ctx_b, noise, before, keep_sink):
    """A Stream on prompt A for ``before`` chunks, switched to B, continued to the end of ``noise``.
    Returns (clean chunks, the state just before the switch's copy, the state right after the switch)."""
    s = Stream(params, CFG, rc, ctx_a, noise=noise)
    chunks = [next(s) for _ in range(before)]
    snapshot = jax.tree.map(jnp.copy, s.state)  # the switch donates the state
    s.switch_prompt(ctx_b, keep_sink=keep_sink)
    switched = jax.tree.map(jnp.copy, s.state)
    chunks += list(s)
    return chunks, snapshot, switched


# Each other setting compiles the stream step and the switch again (~1 min on 2 loaded cores): slow.
@pytest.mark.parametrize(
    "policy,keep_sink,rope,before",
    [
        ("ring", True, "absolute", 5),  # wrapped window, LongLive's global sink
        ("ring", True, "absolute", 1),  # only the sink chunk is held
        pytest.param("ring", False, "absolute", 5, marks=pytest.mark.slow),  # sink recomputed too
        pytest.param("rolling", True, "absolute", 4, marks=pytest.mark.slow),
        pytest.param("ring", False, "cache-relative", 4, marks=pytest.mark.slow),
        pytest.param("ring", True, "cache-relative", 5, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_switch_equals_cache_free_reference_then_continues_alike(policy, keep_sink, rope, before):
    rc = _rc(policy=policy, rope=rope)
    params, ctx_a, ctx_b = _params(), _ctx(1, 2), _ctx(2, 2)
    after = 2
    noise = jax.random.normal(jax.random.key(3), rc.noise_shape(CFG, 2, before + after))
    chunks, old, switched = _stream_then_switch(params, rc, ctx_a, ctx_b, noise, before, keep_sink)

    ref = reference_cache(params, rc, old.cache, chunks, ctx_b, keep_sink)
    got_k, got_v, got_pos = switched.cache.chronological()
    ref_k, ref_v, ref_pos = ref.cache.chronological()
    np.testing.assert_array_equal(got_pos, ref_pos)
    valid = (np.asarray(ref_pos) >= 0)[None, :, :, None, None]
    scale = float(jnp.abs(ref_k).max())
    assert float(jnp.max(jnp.where(valid, jnp.abs(got_k - ref_k), 0))) <= 1e-5 * scale
    assert float(jnp.max(jnp.where(valid, jnp.abs(got_v - ref_v), 0))) <= 1e-5 * float(jnp.abs(ref_v).max())
    # the switch changed the K/V of the re-run chunks (the prompt matters), and kept the sink's when asked
    old_k = old.cache.chronological()[0]
    window = (np.asarray(ref_pos) >= rc.spec(CFG).sink)[None, :, :, None, None] & valid
    if window.any():
        assert float(jnp.max(jnp.where(window, jnp.abs(got_k - old_k), 0))) > 1e-3
    if keep_sink:
        sink = (np.asarray(ref_pos) >= 0) & (np.asarray(ref_pos) < rc.spec(CFG).sink)
        np.testing.assert_array_equal(np.asarray(got_k)[:, sink], np.asarray(old_k)[:, sink])

    # continuing from the reference cache with the same noise gives the switched stream's chunks
    state = ref
    for n in range(before, before + after):
        x, state = R.stream_step(CFG, rc, params, state, None, None, noise[n])  # the stream's own program
        err = float(jnp.abs(x - chunks[n]).max() / jnp.abs(x).max())
        assert err <= 1e-4, (n, err)


FP8 = Precision(fp8_kv=True)  # float32 params, reads and cross K/V: the FP8 cache's own rounding is all that differs


@pytest.mark.parametrize(
    "keep_sink,rope,before",
    [
        (True, "absolute", 5),  # wrapped window, the sink's FP8 bytes kept
        pytest.param(False, "cache-relative", 4, marks=pytest.mark.slow),  # sink re-quantized too
    ],
)
def test_an_fp8_switch_is_the_cache_free_reference_written_through_the_fp8_cache(keep_sink, rope, before):
    """An FP8 stream switched at chunk n against `reference_cache` built on an FP8 cache: the same cache-free
    forward, each re-run chunk written by `Fp8Cache.write` as a step writes it. The two forwards sum in other
    orders (float32, ~1e-6 apart), so a value lying at an e4m3 rounding boundary may land one e4m3 step apart:
    the scales agree to 1e-5, the dequantized K/V to one e4m3 step (2**-3 of the value, or the subnormal step
    scale * 2**-9 near zero), and nearly every byte is equal. Kept sink slots keep their FP8 bytes and scales bit
    for bit. The stream then continues as one continued from the reference cache. Measured here: every byte
    equal, the continuation 2e-7 relative (bound 1e-5)."""
    rc = _rc(rope=rope, precision=FP8)
    params, ctx_a, ctx_b = _params(), _ctx(1, 2), _ctx(2, 2)
    after = 2
    noise = jax.random.normal(jax.random.key(3), rc.noise_shape(CFG, 2, before + after))
    chunks, old, switched = _stream_then_switch(params, rc, ctx_a, ctx_b, noise, before, keep_sink)
    assert isinstance(switched.cache, Fp8Cache)

    ref = reference_cache(params, rc, old.cache, chunks, ctx_b, keep_sink)
    np.testing.assert_array_equal(switched.cache.positions, ref.cache.positions)
    np.testing.assert_allclose(switched.cache.k_scale, ref.cache.k_scale, rtol=1e-5)
    np.testing.assert_allclose(switched.cache.v_scale, ref.cache.v_scale, rtol=1e-5)
    for name in ("k", "v"):
        got, want = (getattr(c.cache.dequantized(), name) for c in (switched, ref))
        assert_within_one_e4m3_step(got, want, getattr(ref.cache, f"{name}_scale"), rc.spec(CFG).chunk, name)
        same = equal_byte_share(getattr(switched.cache, name), getattr(ref.cache, name))
        assert same >= 0.99, (name, same)
        # the prompt matters: the re-run window's bytes changed
        assert (np.asarray(getattr(switched.cache, name)) != np.asarray(getattr(old.cache, name))).mean() > 0.1
    sink = np.asarray(old.cache.positions[:, :: rc.spec(CFG).chunk] < rc.spec(CFG).sink) & (
        np.asarray(old.cache.positions[:, :: rc.spec(CFG).chunk]) >= 0
    )
    kept = np.asarray(switched.cache.k_scale)[:, sink] == np.asarray(old.cache.k_scale)[:, sink]
    assert kept.all() == keep_sink  # kept bit for bit, or re-quantized from the new K/V

    state = ref
    for n in range(before, before + after):
        x, state = R.stream_step(CFG, rc, params, state, None, None, noise[n])
        err = float(jnp.abs(x - chunks[n]).max() / jnp.abs(x).max())
        assert err <= 1e-5, (n, err)


def test_switching_to_the_same_prompt_before_the_window_wraps_changes_nothing():
    """Before any eviction every retained chunk saw exactly what it sees in the re-cache forward, so re-caching
    under the same prompt (sink recomputed) reproduces the K/V and the continuation of an unswitched stream."""
    rc = _rc()  # 3 slots: chunks 0..2 are held before the first eviction
    params, ctx = _params(), _ctx(1, 2)
    noise = jax.random.normal(jax.random.key(4), rc.noise_shape(CFG, 2, 5))
    plain = list(Stream(params, CFG, rc, ctx, noise=noise))
    chunks, old, switched = _stream_then_switch(params, rc, ctx, ctx, noise, 3, keep_sink=False)
    np.testing.assert_allclose(switched.cache.k, old.cache.k, atol=1e-5)
    np.testing.assert_allclose(switched.cache.v, old.cache.v, atol=1e-5)
    np.testing.assert_allclose(jnp.stack(chunks), jnp.stack(plain), atol=1e-4)


def test_switches_compile_once_and_never_recompile_the_step():
    rc = _rc()
    params = _params()
    noise = jax.random.normal(jax.random.key(5), rc.noise_shape(CFG, 2, 8))
    s = Stream(params, CFG, rc, _ctx(1, 2), noise=noise)
    next(s), next(s)
    s.switch_prompt(_ctx(12, 2))  # the first switch and step compile (or were compiled by another test)
    steps, switches = compile_count(R.stream_step), compile_count(RC.jit_switch_prompt)
    assert steps >= 1 and switches >= 1
    for n in range(2, 8):
        if n in (4, 7):
            s.switch_prompt(_ctx(10 + n, 2), keep_sink=True)
        assert bool(jnp.isfinite(next(s)).all())
    assert compile_count(R.stream_step) == steps
    assert compile_count(RC.jit_switch_prompt) == switches


@pytest.mark.slow  # compiles the guided step and switch
def test_guided_switch_recaches_both_sessions():
    rc = _rc(guidance_scale=2.0)
    params = _params()
    neg = jnp.zeros((1, 2, CFG.text_dim))
    s = Stream(params, CFG, rc, _ctx(1), negative_context=neg, key=jax.random.key(0))
    for _ in range(3):
        next(s)
    before = jax.tree.map(jnp.copy, s.state)
    s.switch_prompt(_ctx(2), neg, keep_sink=False)
    k_new, k_old = s.state.cache.k, before.cache.k
    assert float(jnp.abs(k_new[:, 0] - k_old[:, 0]).max()) > 1e-3  # the conditional row changed
    np.testing.assert_array_equal(s.state.cache.positions, before.cache.positions)
    assert bool(jnp.isfinite(next(s)).all())


def _stream(rc, chunks=2):
    noise = jax.random.normal(jax.random.key(6), rc.noise_shape(CFG, 2, 4))
    s = Stream(_params(), CFG, rc, _ctx(1, 2), noise=noise)
    for _ in range(chunks):
        next(s)
    return s


def test_a_ring_that_lacks_a_held_chunk_is_refused_before_the_state_changes():
    rc = _rc()
    s = _stream(rc)
    empty = RC.LatentRing.init(rc.spec(CFG), rc.chunk_shape(CFG, 2))  # as if never pushed
    s.restore_ring({"latents": empty.latents, "chunks": empty.chunks})
    before = s.state
    with pytest.raises(ValueError, match="lacks chunk 0"):
        s.switch_prompt(_ctx(2, 2))
    assert s.state.cache is before.cache and not s.state.cache.k.is_deleted()


def test_switch_takes_the_new_cross_kv_projected_elsewhere():
    """``cross=`` (what a mesh projects for its whole batch) stands for the projection switch_prompt makes itself:
    the same K/V give the same state; other K/V are what the re-cached frames attend to."""
    rc = _rc()
    s = _stream(rc)
    new = _ctx(2, 2)
    want = RC.switch_prompt(s.params, CFG, rc, s.state, s.ring, new)
    cross = M.cross_kv(s.params, CFG, new, run=rc.run)
    got = RC.switch_prompt(s.params, CFG, rc, s.state, s.ring, new, cross=cross)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    other = M.cross_kv(s.params, CFG, _ctx(3, 2), run=rc.run)
    got = RC.switch_prompt(s.params, CFG, rc, s.state, s.ring, new, cross=other)
    np.testing.assert_array_equal(got.cross.k, other.k)
    assert not np.allclose(got.cache.k, want.cache.k)


def test_switch_argument_errors():
    rc = _rc()
    s = _stream(rc, 1)
    params = s.params
    with pytest.raises(ValueError, match="keep_sink must be a bool"):
        RC.switch_prompt(params, CFG, rc, s.state, s.ring, _ctx(2, 2), keep_sink=1)
    with pytest.raises(ValueError, match="3 sessions but the state has 2"):
        RC.switch_prompt(params, CFG, rc, s.state, s.ring, _ctx(2, batch=3))
    short = M.CrossKV(s.state.cross.k[:, :1], s.state.cross.v[:, :1])
    with pytest.raises(ValueError, match="the given cross-attention K/V are"):
        RC.switch_prompt(params, CFG, rc, s.state, s.ring, _ctx(2, 2), cross=short)
    with pytest.raises(ValueError, match="chunk_index must be int"):
        s.ring.push(jnp.zeros(rc.chunk_shape(CFG, 2)), jnp.zeros((2,), jnp.float32))
    with pytest.raises(ValueError, match="push: latents"):
        s.ring.push(jnp.zeros((2, 2, H, W, 4)), jnp.zeros((2,), jnp.int32))


def test_latent_ring_follows_the_ring_rule_and_skips_negative_rows():
    spec = RingSpec(chunk=2, window=4, sink=2)  # 1 sink slot, 2 window slots
    ring = RC.LatentRing.init(spec, (2, 1, 1, 1, 1))
    for n in range(5):
        idx = jnp.array([n, n if n < 3 else -1], jnp.int32)
        ring = ring.push(jnp.full((2, 1, 1, 1, 1), float(n)), idx)
    # row 0: chunk 0 in the sink slot, chunks 3 and 4 in window slots 1 + (n - 1) % 2; row 1 stopped at chunk 2
    np.testing.assert_array_equal(ring.chunks, [[0, 3, 4], [0, 1, 2]])
    np.testing.assert_array_equal(ring.latents[:, :, 0, 0, 0, 0], [[0, 3, 4], [0, 1, 2]])


# ------------------------------------------------------------------------------------------------ the CLI


def _schedule(tmp_path, entries, name="schedule.json"):
    path = tmp_path / name
    path.write_text(json.dumps(entries))
    return str(path)


@pytest.mark.parametrize(
    "entries,extra,expect",
    [
        ([{"chunk": 1, "prompt": "a"}], [], "must start at chunk 0"),
        ([{"chunk": 0, "prompt": "a"}, {"chunk": 0, "prompt": "b"}], [], "strictly increase"),
        ([{"chunk": 0, "prompt": "a"}, {"chunk": 3, "prompt": "b"}], [], "chunk 3 is not generated"),
        ([{"chunk": 0, "prompt": "a", "context": "x.npy"}], [], "exactly one of"),
        ([{"chunk": 0, "text": "a"}], [], "unknown keys ['text']"),
        ([{"chunk": -1, "prompt": "a"}], [], "chunk must be an int >= 0"),
        ({"chunk": 0}, [], "non-empty JSON list"),
        ([{"chunk": 0, "context": "missing.npy"}], [], "does not exist"),
        ([{"chunk": 0, "prompt": "a"}], ["--context", "c.npy"], "not with --context"),
        ([{"chunk": 0, "prompt": "a"}], ["--guidance-scale", "2"], "needs --negative-prompt"),
        (None, ["--switch-sink", "keep"], "--switch-sink needs --prompt-schedule"),
    ],
)
def test_cli_bad_prompt_schedules_are_one_line_errors(tmp_path, capsys, entries, extra, expect):
    argv = [
        "--out",
        str(tmp_path / "out"),
        "--num-chunks",
        "3",
        "--no-progress",
        "--no-video",
        "--preset",
        "tiny",
        "--random-weights",
        *extra,
    ]  # toy-world schedules: test_generate_toy.py
    if entries is not None:
        argv += ["--prompt-schedule", _schedule(tmp_path, entries)]
    assert G.main(argv) == 2
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # three CLI runs, each compiling the tiny preset's step
def test_cli_prompt_schedule_switches_at_its_chunk_and_only_there(tmp_path):
    text_dim = wan.preset("tiny").text_dim
    rng = np.random.default_rng(0)
    np.save(tmp_path / "a.npy", rng.standard_normal((4, text_dim)).astype(np.float32))
    np.save(tmp_path / "b.npy", rng.standard_normal((6, text_dim)).astype(np.float32))
    common = [
        "--num-chunks",
        "4",
        "--no-progress",
        "--no-video",
        "--rope",
        "cache-relative",
        "--preset",
        "tiny",
        "--random-weights",
    ]

    def run(name, *extra):
        assert G.main(["--out", str(tmp_path / name), *common, *extra]) == 0
        return G.load_latents(str(tmp_path / name)), json.loads((tmp_path / name / "summary.json").read_text())

    plain, _ = run("plain", "--context", str(tmp_path / "a.npy"))
    one, _ = run("one", "--prompt-schedule", _schedule(tmp_path, [{"chunk": 0, "context": "a.npy"}], "one.json"))
    two, summary = run(
        "two",
        "--switch-sink",
        "recompute",
        "--prompt-schedule",
        _schedule(tmp_path, [{"chunk": 0, "context": "a.npy"}, {"chunk": 2, "context": "b.npy"}], "two.json"),
    )
    cf = G.DEFAULTS["chunk_frames"]
    np.testing.assert_array_equal(one, plain)  # a one-entry schedule is --context
    np.testing.assert_array_equal(two[:, : 2 * cf], plain[:, : 2 * cf])
    assert np.abs(two[:, 2 * cf :] - plain[:, 2 * cf :]).max() > 1e-3
    assert summary["switch_compilations"] == 1
    assert summary["compilations"] == 0  # the step the first runs compiled: switching recompiles nothing
    assert summary["rope"] == "cache-relative" and summary["switch_sink"] == "recompute"
    assert [e["chunk"] for e in summary["prompt_schedule"]] == [0, 2]
