"""The per-layer inference layout (`jaxkv.models.wan.params.per_layer_params`, per-layer caches and cross K/V, the
unrolled layer loop) against the stacked one (the layer scan): the same results bit for bit, one compilation, the
cache written in place, and a compiled chunk step that slices nothing out of a stack (checked in the HLO); and the
cuDNN attention plan made once per forward for every layer, with cross-attention taking no check at all."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.attention import cudnn, dispatch
from jaxkv.cache.fp8 import Fp8Cache
from jaxkv.compilation import compile_count
from jaxkv.models.wan import model as M
from jaxkv.models.wan import streaming
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import is_per_layer, per_layer_params, stacked_params
from jaxkv.precision import Precision
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream
from tests.helpers.cudnn_standin import standin
from tests.helpers.trees import as_f32

# Distinctive sizes (5 layers, 7 text tokens) so a stacked buffer is known by its shape in the compiled program.
CFG = WanConfig(dim=48, ffn_dim=80, num_heads=3, num_layers=5, in_dim=4, out_dim=4, text_dim=8, text_len=7, freq_dim=16)
H, W = 4, 6  # 6 tokens per frame


def _params(seed=0, dtype=jnp.float32):
    return M.init_params(CFG, jax.random.key(seed), dtype=dtype)


def _ctx(seed, batch=1):
    return jax.random.normal(jax.random.key(seed), (batch, CFG.text_len, CFG.text_dim))


def test_per_layer_params_round_trip_and_checks():
    params = _params()
    pl = per_layer_params(params)
    assert is_per_layer(pl) and not is_per_layer(params) and len(pl["blocks"]) == CFG.num_layers
    assert per_layer_params(pl) is pl and stacked_params(params) is params
    chex.assert_trees_all_equal(stacked_params(pl), params)
    cross = M.cross_kv(pl, CFG, _ctx(1))
    assert cross.is_per_layer and len(cross.k) == CFG.num_layers
    want = M.cross_kv(params, CFG, _ctx(1))
    np.testing.assert_array_equal(np.asarray(cross.stacked().k), np.asarray(want.k))  # bit for bit
    bad = M.CrossKV(cross.k[:-1], cross.v[:-1])
    cache = M.init_cache(CFG, jaxkv.RingSpec.from_frames(H * W // 4, 1, 2), 1, per_layer=True).begin_chunk()
    with pytest.raises(ValueError, match="per-layer cross K/V"):
        M.forward_chunk(pl, CFG, cache, bad, jnp.zeros((1, 1, H, W, 4)), jnp.zeros((1,)))
    with pytest.raises(ValueError, match="per_layer caches are ring or rolling"):
        M.init_cache(CFG, jaxkv.cache.DilatedSpec(H * W // 4, 1, 2, 3), 1, policy="dilated", per_layer=True)


@pytest.mark.parametrize("policy", ["ring", pytest.param("rolling", marks=pytest.mark.slow)])
def test_per_layer_stream_equals_the_stacked_stream_bit_for_bit_with_one_compilation(policy):
    """7 chunks on a 2-chunk window + 1 sink chunk (wrapped 2-3 times), with guidance: every chunk, and the final
    cache, are identical; each layout compiles one program for all chunks."""
    rc = R.RolloutConfig(
        H,
        W,
        chunk_frames=1,
        window_frames=2,
        sink_frames=1,
        policy=policy,
        guidance_scale=3.0,
        schedule=Schedule(steps=(1000, 500)),
    )
    params, ctx, neg, key = _params(2), _ctx(3), _ctx(4), jax.random.key(5)
    runs = {}
    for name, p in (("stacked", params), ("per_layer", per_layer_params(params))):
        before = compile_count(R.stream_step)
        stream = Stream(p, CFG, rc, ctx, negative_context=neg, num_chunks=7, key=key)
        chunks = np.concatenate([np.asarray(c) for c in stream], axis=1)
        assert compile_count(R.stream_step) - before == 1
        assert stream.state.cache.is_per_layer == (name == "per_layer")
        assert stream.state.cross.is_per_layer == (name == "per_layer")
        runs[name] = (chunks, R.stacked_state(stream.state))
    np.testing.assert_array_equal(runs["per_layer"][0], runs["stacked"][0])
    chex.assert_trees_all_equal(runs["per_layer"][1], runs["stacked"][1])


def test_a_per_layer_stream_saves_stacked_sessions_and_continues_from_them():
    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, sink_frames=1, schedule=Schedule(steps=(1000, 500)))
    pl, ctx, key = per_layer_params(_params(6)), _ctx(7), jax.random.key(8)
    whole = np.concatenate([np.asarray(c) for c in Stream(pl, CFG, rc, ctx, num_chunks=5, key=key)], axis=1)
    first = Stream(pl, CFG, rc, ctx, num_chunks=3, key=key)
    head = [np.asarray(c) for c in first]
    session = first.session()
    assert not session.cache.is_per_layer and not session.cross.is_per_layer  # sessions hold the stacked layout
    rest = Stream.from_session(pl, CFG, rc, session, num_chunks=2)
    assert rest.state.cache.is_per_layer
    got = np.concatenate(head + [np.asarray(c) for c in rest], axis=1)
    np.testing.assert_array_equal(got, whole)


@pytest.mark.parametrize(
    "precision",
    [Precision(fp8_kv=True), pytest.param(Precision.fp8(), marks=pytest.mark.slow)],
    ids=["float32-fp8-kv", "fp8"],
)
def test_a_per_layer_fp8_stream_equals_the_stacked_fp8_stream_and_continues_from_its_session(precision, tmp_path):
    """An FP8 KV cache (`Precision.fp8_kv`) held per layer under per-layer params: 6 chunks on a 2-chunk window + 1
    sink chunk (the ring wraps), with guidance, equal the stacked FP8 stream's chunks and final state (FP8 bytes and
    scales) bit for bit, one compilation each; a per-layer stream's session (stacked), saved and loaded, continues
    per layer as the uninterrupted stream. float32 read dtype, and `Precision.fp8()` (bf16 + FP8 attention, slow)."""
    rc = R.RolloutConfig(
        H,
        W,
        chunk_frames=1,
        window_frames=2,
        sink_frames=1,
        guidance_scale=3.0,
        schedule=Schedule(steps=(1000, 500)),
        precision=precision,
    )
    dtype = jnp.dtype(precision.param_dtype)
    params, ctx, neg, key = _params(11, dtype), _ctx(12), _ctx(13), jax.random.key(14)
    runs = {}
    for name, p in (("stacked", params), ("per_layer", per_layer_params(params))):
        before = compile_count(R.stream_step)
        stream = Stream(p, CFG, rc, ctx, negative_context=neg, num_chunks=6, key=key)
        chunks = np.concatenate([np.asarray(c, np.float32) for c in stream], axis=1)
        assert compile_count(R.stream_step) - before == 1
        assert isinstance(stream.state.cache, Fp8Cache)
        assert stream.state.cache.is_per_layer == stream.state.cross.is_per_layer == (name == "per_layer")
        runs[name] = (chunks, R.stacked_state(stream.state))
    np.testing.assert_array_equal(runs["per_layer"][0], runs["stacked"][0])
    chex.assert_trees_all_equal(as_f32(runs["per_layer"][1]), as_f32(runs["stacked"][1]))
    # a session of the per-layer FP8 stream after 4 chunks (stacked: FP8 bytes and scales), saved and loaded,
    # continues per layer as the uninterrupted stream
    pl = per_layer_params(params)
    first = Stream(pl, CFG, rc, ctx, negative_context=neg, num_chunks=4, key=key)
    head = [np.asarray(c, np.float32) for c in first]
    session = first.session()
    assert isinstance(session.cache, Fp8Cache) and not session.cache.is_per_layer  # sessions hold the stacked layout
    loaded = S.load(S.save(str(tmp_path / "s"), session), CFG, rc)
    chex.assert_trees_all_equal_dtypes(loaded.state, session.state)
    chex.assert_trees_all_equal(as_f32(loaded.state), as_f32(session.state))
    rest = Stream.from_session(pl, CFG, rc, loaded, num_chunks=2)
    assert rest.state.cache.is_per_layer and isinstance(rest.state.cache, Fp8Cache)
    got = np.concatenate(head + [np.asarray(c, np.float32) for c in rest], axis=1)
    np.testing.assert_array_equal(got, runs["stacked"][0])


# ------------------------------------------------------------------ what the compiled chunk step does

# (compiled HLO names values %x; the HLO text of a lowered, uncompiled program drops the %)
_DEF = re.compile(r"^\s*(?:ROOT )?%?(\S+) = \w+\[([\d,]*)\]")
_SLICE = re.compile(r"= \w+\[[\d,]*\]\S* (dynamic-slice|slice)\(%?([^,)\s]+)")


def _slices_of_stacks(text: str, cache_shape, stacked_shapes) -> tuple[int, int]:
    """(slices of the stacked cache, slices of other stacked buffers: the blocks' weights, the cross K/V) in a
    compiled HLO module: the (dynamic-)slice instructions whose operand has one of those shapes."""
    shapes = {}
    for line in text.splitlines():
        m = _DEF.match(line)
        if m:
            shapes[m.group(1)] = tuple(int(d) for d in m.group(2).split(",") if d)
    cache = other = 0
    for line in text.splitlines():
        m = _SLICE.search(line)
        if m:
            shape = shapes.get(m.group(2))
            cache += shape == cache_shape
            other += shape in stacked_shapes
    return cache, other


def _compiled_layouts(params, rc, noise, cache_shape, stacked_shapes, check_state=None):
    """({layout: (cache-stack slices, other stack slices)}, {layout: aliased buffers}) of the compiled, donating
    chunk step on stacked and on per-layer params; ``check_state(layout, state)`` looks at each initial state."""
    counts, aliases = {}, {}
    for name, p in (("stacked", params), ("per_layer", per_layer_params(params))):
        state = R.init_state(p, CFG, rc, _ctx(10))
        if check_state is not None:
            check_state(name, state)
        step = jax.jit(lambda p, s, n: R.generate_chunk(p, CFG, rc, s, n), donate_argnums=1)
        text = step.lower(p, state, noise).compile().as_text()
        counts[name] = _slices_of_stacks(text, cache_shape, stacked_shapes)
        aliases[name] = text.count("may-alias") + text.count("must-alias")
    return counts, aliases


def test_compiled_chunk_step_slices_nothing_out_of_a_stack():
    """The jitted, donated chunk step (4 passes of the layer loop) on XLA:CPU. Stacked layout (the layer scan): the
    K/V of each layer is a dynamic slice of the stacked cache feeding attention, and every layer's weights and
    text K/V are sliced out of their stacks; a kernel that takes whole buffers (cuDNN, cuBLAS) turns each slice
    into a copy per layer per pass. Per-layer layout: no slice of any stack, and the per-layer cache buffers alias
    the step's outputs (written in place)."""
    params = _params(9)
    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=3, sink_frames=1)
    noise = jnp.zeros((rc.steps, 1, 1, H, W, CFG.in_dim))
    cache_shape = (CFG.num_layers, 1, rc.spec(CFG).capacity, CFG.num_heads, CFG.head_dim)
    stacked_shapes = {tuple(x.shape) for x in jax.tree.leaves(params["blocks"])}
    stacked_shapes.add((CFG.num_layers, 1, CFG.text_len, CFG.num_heads, CFG.head_dim))  # cross K/V
    counts, aliases = _compiled_layouts(params, rc, noise, cache_shape, stacked_shapes)
    # The check sees the stacked program's slices (the program before the per-layer layout existed) ...
    assert counts["stacked"][0] >= 2 and counts["stacked"][1] >= 20, counts
    # ... and none in the per-layer program.
    assert counts["per_layer"] == (0, 0), counts
    # Donation: every per-layer K and V buffer (and the positions) alias an output.
    assert aliases["per_layer"] >= 2 * CFG.num_layers + 1, aliases


@pytest.mark.slow  # compiles two 5-layer FP8 steps
def test_compiled_per_layer_fp8_step_slices_nothing_out_of_a_stack():
    """As above with an FP8 KV cache (`Precision(fp8_kv=True)`): the stacked program slices its FP8 K/V, scales and
    weights out of their stacks; the per-layer program reads every layer's FP8 bytes and scales where they lie,
    and its per-layer K, V and scale buffers alias the step's outputs."""
    params = _params(9)
    rc = R.RolloutConfig(H, W, chunk_frames=1, window_frames=3, sink_frames=1, precision=Precision(fp8_kv=True))
    noise = jnp.zeros((rc.steps, 1, 1, H, W, CFG.in_dim))
    spec = rc.spec(CFG)
    cache_shape = (CFG.num_layers, 1, spec.capacity, CFG.num_heads, CFG.head_dim)
    stacked_shapes = {tuple(x.shape) for x in jax.tree.leaves(params["blocks"])}
    stacked_shapes.add((CFG.num_layers, 1, CFG.text_len, CFG.num_heads, CFG.head_dim))  # cross K/V
    stacked_shapes.add((CFG.num_layers, 1, spec.num_slots, CFG.num_heads))  # the FP8 scales

    def is_fp8(name, state):
        assert isinstance(state.cache, Fp8Cache) and state.cache.is_per_layer == (name == "per_layer")

    counts, aliases = _compiled_layouts(params, rc, noise, cache_shape, stacked_shapes, is_fp8)
    assert counts["stacked"][0] >= 2 and counts["stacked"][1] >= 20, counts
    assert counts["per_layer"] == (0, 0), counts
    assert aliases["per_layer"] >= 4 * CFG.num_layers + 1, aliases  # K, V, k_scale, v_scale per layer; positions


@pytest.mark.slow  # compiles two 4-layer steps
def test_per_layer_step_updates_the_cache_in_place():
    """As the stacked cache's test in test_wan_streaming: scratch stays well below the cache at a long window."""
    cfg = WanConfig(
        dim=256, ffn_dim=32, num_heads=1, num_layers=4, in_dim=4, out_dim=4, text_dim=8, text_len=4, freq_dim=16
    )
    params = per_layer_params(M.init_params(cfg, jax.random.key(0)))
    cross = M.cross_kv(params, cfg, jnp.zeros((1, 4, 8)))
    x = jnp.zeros((1, 1, 8, 8, 4))
    cache = M.init_cache(cfg, jaxkv.RingSpec.from_frames(16, 1, 64), 1, per_layer=True).begin_chunk()
    step = jax.jit(lambda c, p, x: M.forward_chunk(p, cfg, c, cross, x, jnp.zeros((1,))), donate_argnums=0)
    temp = step.lower(cache, params, x).compile().memory_analysis().temp_size_in_bytes
    assert temp < 0.5 * cache.nbytes, (temp, cache.nbytes)


# ------------------------------------------------------------------ the cuDNN path through the model


@pytest.mark.parametrize("layout", [pytest.param("stacked", marks=pytest.mark.slow), "per_layer"])
def test_cudnn_plan_is_made_once_per_forward_and_cross_attention_takes_no_check(layout, monkeypatch):
    """backend="cudnn" through `forward_chunk` on CPU, the kernel replaced by an independent stand-in: the result is
    the XLA path's; the plan is made once per forward (not per layer); the program branches on the plan once per
    layer (the self-attention's plan mode), never for cross-attention. The stacked form also holds the guarded
    writes of its traced layer index (`jaxkv.cache.rows.write_chunk_rows`), the per-layer form nothing else."""
    monkeypatch.setattr(cudnn, "cudnn_call", standin)
    monkeypatch.setattr(dispatch.pallas_gpu, "supported", lambda head_dim: False)  # fallback: XLA, not Pallas
    monkeypatch.setattr(dispatch, "_blockwise", dispatch._dense)  # ... the dense one (no branches of its own)
    made = {"model": 0, "per_call": 0}
    model_plan, call_plan = streaming.plan_attention, cudnn.plan_attention

    def counted(where, fn):
        def plan(*a):
            made[where] += 1
            return fn(*a)

        return plan

    monkeypatch.setattr(streaming, "plan_attention", counted("model", model_plan))
    monkeypatch.setattr(cudnn, "plan_attention", counted("per_call", call_plan))
    params = _params(11, jnp.bfloat16)
    params = per_layer_params(params) if layout == "per_layer" else params
    spec = jaxkv.RingSpec.from_frames(H * W // 4, 1, 2, 1)
    cross = M.cross_kv(params, CFG, _ctx(12, 2), precision="bfloat16")
    cache = M.init_cache(CFG, spec, 2, dtype=jnp.bfloat16, per_layer=layout == "per_layer")
    x = jax.random.normal(jax.random.key(13), (2, 1, H, W, CFG.in_dim))
    t = jnp.full((2,), 500.0)
    fwd = {
        backend: jax.jit(
            lambda c, b=backend: M.forward_chunk(params, CFG, c, cross, x, t, backend=b, precision="bfloat16")
        )
        for backend in ("xla", "cudnn")
    }
    for _ in range(5):  # fill (lengths), then wrap (all visible)
        cache = cache.begin_chunk()
        want, _ = fwd["xla"](cache)
        got, cache = fwd["cudnn"](cache)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-2 * float(jnp.abs(want).max()))
    made_before = dict(made)
    jaxpr = jax.make_jaxpr(
        lambda c: M.forward_chunk(params, CFG, c, cross, x, t, backend="cudnn", precision="bfloat16")
    )(cache.begin_chunk())
    assert made["model"] - made_before["model"] == 1 and made["per_call"] == 0, made
    branches = _cond_branches(jaxpr.jaxpr)
    # The plan's switch (fallback / lengths / all visible) once per layer; the scan's body holds one layer.
    assert branches.count(3) == (CFG.num_layers if layout == "per_layer" else 1), branches
    if layout == "per_layer":  # a Python int layer: no guard, no other branch at all
        assert branches == [3] * CFG.num_layers, branches
    else:  # a traced layer: the guarded writes of k, v and positions (`write_chunk_rows`), nothing else
        assert set(branches) == {2, 3} and str(jaxpr).count("platform_index[") == 3, branches


def _cond_branches(jaxpr) -> list[int]:
    """The branch count of every cond in ``jaxpr`` and the jaxprs inside it (a scan's body once)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            out.append(len(eqn.params["branches"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _cond_branches(sub)
    return out


def test_bf16_epilogues_hold_in_the_unrolled_layer_loop():
    """Under `Precision.bf16()` (GEMMs emitting bf16 with float32 accumulation, norms and modulation writing bf16,
    the residual float32) the per-layer forward equals the stacked one bit for bit: every block's GEMMs emit bf16
    in the unrolled loop too (8 per block), and the result is not the float32 forward's."""
    bf16, f32 = Precision.bf16(), Precision.f32()
    weights = _params(14)
    spec = jaxkv.RingSpec.from_frames(H * W // 4, 1, 2)
    x = jax.random.normal(jax.random.key(15), (1, 1, H, W, CFG.in_dim))
    t = jnp.full((1,), 500.0)

    def forward(params, precision, per_layer):
        params = per_layer_params(params) if per_layer else params
        dtype = jnp.dtype(precision.cache_dtype)
        cache = M.init_cache(CFG, spec, 1, dtype=dtype, per_layer=per_layer).begin_chunk()
        cross = M.cross_kv(params, CFG, _ctx(16), precision=precision)
        fwd = lambda p, c, cr: M.forward_chunk(p, CFG, c, cr, x, t, precision=precision)[0]
        return np.asarray(jax.jit(fwd)(params, cache, cross)), str(jax.make_jaxpr(fwd)(params, cache, cross))

    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights)
    stacked, _ = forward(rounded, bf16, False)
    per_layer, jaxpr = forward(rounded, bf16, True)
    np.testing.assert_array_equal(per_layer, stacked)
    assert jaxpr.count("preferred_element_type=bfloat16") >= 8 * CFG.num_layers
    assert " scan[" not in jaxpr
    full, _ = forward(weights, f32, True)
    assert np.abs(full - per_layer).max() > 1e-4 * np.abs(full).max()  # bf16 really is in effect
