"""The three ways to run the same Wan weights agree: streaming chunk by chunk on a ring (or rolling) cache equals the
block-causal full-sequence forward with the matching sink/window, and the first chunk equals the bidirectional
forward on that chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from tests.helpers.gradients import remat_gradients_agree

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4  # latent grid -> 1 x 2 patches = 2 tokens per frame
TPF = 2


def _setup(seed, batch, frames):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    params = wan.init_params(CFG, k1)
    latents = jax.random.normal(k2, (batch, frames, H, W, CFG.in_dim))
    t = jax.random.uniform(k3, (batch, frames), maxval=1000.0)
    ctx = jax.random.normal(k4, (batch, 3, CFG.text_dim))
    return params, latents, t, ctx


def _stream(params, latents, t, ctx, chunk_frames, window_frames, sink_frames, policy, repeats=1):
    batch, frames = latents.shape[:2]
    spec = jaxkv.RingSpec.from_frames(TPF, chunk_frames, window_frames, sink_frames)
    cache = wan.init_cache(CFG, spec, batch, policy=policy)
    cross = wan.cross_kv(params, CFG, ctx)
    step = jax.jit(lambda p, c, x, tt: wan.forward_chunk(p, CFG, c, cross, x, tt))
    outs = []
    for start in range(0, frames, chunk_frames):
        cache = cache.begin_chunk()
        sl = slice(start, start + chunk_frames)
        for r in range(repeats):
            # earlier writes of this chunk (e.g. other denoising steps) must be overwritten, not accumulated
            junk = latents[:, sl] * (r + 2.0) if r < repeats - 1 else latents[:, sl]
            out, cache = step(params, cache, junk, t[:, sl])
        outs.append(out)
    return jnp.concatenate(outs, axis=1), step


@pytest.mark.parametrize("policy", ["ring", "rolling"])
@pytest.mark.parametrize("window_frames,sink_frames", [(4, 2), (2, 0), (20, 0)])
@pytest.mark.slow
def test_streaming_equals_block_causal_full_sequence(policy, window_frames, sink_frames):
    params, latents, t, ctx = _setup(0, batch=2, frames=12)
    got, step = _stream(params, latents, t, ctx, 2, window_frames, sink_frames, policy, repeats=2)
    want = wan.forward_block_causal(
        params,
        CFG,
        latents,
        t,
        ctx,
        chunk_frames=2,
        window_frames=None if window_frames >= 12 else window_frames,
        sink_frames=sink_frames if window_frames < 12 else 0,
    )
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert err <= 1e-4, err
    assert compile_count(step) == 1  # positions and slots are traced: one program for every chunk


@pytest.mark.parametrize(
    "chunk_frames,window_frames,sink_frames",
    [(1, 3, 1), pytest.param(2, 4, 2, marks=pytest.mark.slow), pytest.param(2, None, 0, marks=pytest.mark.slow)],
)
def test_teacher_forcing_equals_a_stream_that_committed_the_clean_chunks(chunk_frames, window_frames, sink_frames):
    """Noisy chunk c of `forward_teacher_forcing` is what a stream predicts for it after committing the clean chunks
    before it at timestep 0 (with evictions: 10 frames through a 3- or 4-frame window)."""
    params, clean, t, ctx = _setup(5, batch=2, frames=10)
    noisy = jax.random.normal(jax.random.key(6), clean.shape)
    got = wan.forward_teacher_forcing(
        params,
        CFG,
        clean,
        noisy,
        t,
        ctx,
        chunk_frames=chunk_frames,
        window_frames=window_frames,
        sink_frames=sink_frames,
    )
    spec = jaxkv.RingSpec.from_frames(TPF, chunk_frames, window_frames or 10, sink_frames)
    cache = wan.init_cache(CFG, spec, 2)
    cross = wan.cross_kv(params, CFG, ctx)
    step = jax.jit(lambda c, x, tt: wan.forward_chunk(params, CFG, c, cross, x, tt))
    want = []
    for start in range(0, 10, chunk_frames):
        sl = slice(start, start + chunk_frames)
        cache = cache.begin_chunk()
        flow, cache = step(cache, noisy[:, sl], t[:, sl])
        want.append(flow)
        _, cache = step(cache, clean[:, sl], jnp.zeros_like(t[:, sl]))  # the commit pass overwrites the slot
    want = jnp.concatenate(want, axis=1)
    assert got.shape == want.shape == clean.shape
    assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) <= 1e-5
    # the noisy chunks never see each other: changing noisy chunk 0 leaves every later chunk's flow unchanged
    moved = wan.forward_teacher_forcing(
        params,
        CFG,
        clean,
        noisy.at[:, :chunk_frames].add(1.0),
        t,
        ctx,
        chunk_frames=chunk_frames,
        window_frames=window_frames,
        sink_frames=sink_frames,
    )
    np.testing.assert_allclose(np.asarray(moved[:, chunk_frames:]), np.asarray(got[:, chunk_frames:]), atol=1e-6)
    assert float(jnp.abs(moved[:, :chunk_frames] - got[:, :chunk_frames]).max()) > 1e-3


def test_teacher_forcing_rejects_mismatched_copies():
    params, clean, t, ctx = _setup(7, batch=1, frames=4)
    with pytest.raises(ValueError, match="one shape"):
        wan.forward_teacher_forcing(params, CFG, clean, clean[:, :2], t, ctx, chunk_frames=1)
    with pytest.raises(ValueError, match="timesteps"):
        wan.forward_teacher_forcing(params, CFG, clean, clean, t[:, :3], ctx, chunk_frames=1)


@pytest.mark.slow
def test_first_chunk_equals_bidirectional_forward():
    params, latents, t, ctx = _setup(1, batch=1, frames=6)
    got, _ = _stream(params, latents, t, ctx, 3, 6, 0, "ring")
    want = wan.forward(params, CFG, latents[:, :3], t[:, :3], ctx)
    assert float(jnp.abs(got[:, :3] - want).max() / jnp.abs(want).max()) <= 1e-5
    # later chunks see the past: they differ from an independent bidirectional pass
    other = wan.forward(params, CFG, latents[:, 3:], t[:, 3:], ctx)
    assert float(jnp.abs(got[:, 3:] - other).max()) > 1e-3


@pytest.mark.slow
def test_window_is_respected_by_streaming():
    """With a window of one chunk and no sink, a chunk's output does not depend on chunks two back."""
    params, latents, t, ctx = _setup(2, batch=1, frames=6)
    base, _ = _stream(params, latents, t, ctx, 1, 2, 0, "ring")
    changed = latents.at[:, 0].add(1.0)
    other, _ = _stream(params, changed, t, ctx, 1, 2, 0, "ring")
    assert float(jnp.abs(other[:, 1] - base[:, 1]).max()) > 1e-4  # frame 1 sees frame 0
    # frame 3 sees frames 2-3; their layer-1 K/V saw frame 1 at layer 0, whose layer-0 K/V depend on frame 1's own
    # latents only: with 2 layers, frame 0 is outside frame 3's receptive field
    np.testing.assert_allclose(np.asarray(other[:, 3:]), np.asarray(base[:, 3:]), atol=1e-6)


def test_forward_chunk_rejects_mismatched_cache():
    params, latents, t, ctx = _setup(3, batch=1, frames=2)
    cross = wan.cross_kv(params, CFG, ctx)
    spec = jaxkv.RingSpec.from_frames(TPF, 1, 2)
    cache = wan.init_cache(CFG, spec, 1).begin_chunk()
    with pytest.raises(ValueError, match="chunk"):
        wan.forward_chunk(params, CFG, cache, cross, latents, t)
    bad = jaxkv.RingCache.init(spec, 1, CFG.num_heads, CFG.head_dim, layers=CFG.num_layers + 1).begin_chunk()
    with pytest.raises(ValueError, match="stacked"):
        wan.forward_chunk(params, CFG, bad, cross, latents[:, :1], t[:, :1])
    with pytest.raises(ValueError, match="policy"):
        wan.init_cache(CFG, spec, 1, policy="lru")


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_streaming_step_updates_the_stacked_cache_in_place():
    """Compiled, donated step: XLA's scratch stays well below the cache size at a long window (a per-layer copy of
    the stacked cache in the scan carry would need at least the whole cache). Wide heads make the cache dominate
    the attention scratch."""
    cfg = WanConfig(
        dim=256, ffn_dim=32, num_heads=1, num_layers=4, in_dim=4, out_dim=4, text_dim=8, text_len=4, freq_dim=16
    )
    params = wan.init_params(cfg, jax.random.key(0))
    cross = wan.cross_kv(params, cfg, jnp.zeros((1, 4, 8)))
    x = jnp.zeros((1, 1, 8, 8, 4))  # 16 tokens per frame
    spec = jaxkv.RingSpec.from_frames(16, 1, 64)
    cache = wan.init_cache(cfg, spec, 1).begin_chunk()
    step = jax.jit(lambda c, p, x: wan.forward_chunk(p, cfg, c, cross, x, jnp.zeros((1,))), donate_argnums=0)
    temp = step.lower(cache, params, x).compile().memory_analysis().temp_size_in_bytes
    assert temp < 0.5 * cache.nbytes, (temp, cache.nbytes)


def test_forward_chunk_without_begin_chunk_is_a_clear_error():
    params, latents, t, ctx = _setup(3, batch=1, frames=1)
    cross = wan.cross_kv(params, CFG, ctx)
    cache = wan.init_cache(CFG, jaxkv.RingSpec.from_frames(TPF, 1, 2), 1)
    with pytest.raises(ValueError, match="begin_chunk"):
        wan.forward_chunk(params, CFG, cache, cross, latents, t)


@pytest.mark.slow
def test_forward_chunk_takes_unpadded_cross_kv():
    """cross_kv(pad_context=False) keeps the context's own token count; the first chunk then equals the unpadded
    bidirectional forward."""
    params, latents, t, ctx = _setup(4, batch=1, frames=1)
    cross = wan.cross_kv(params, CFG, ctx, pad_context=False)
    assert cross.k.shape[2] == ctx.shape[1] < CFG.text_len
    cache = wan.init_cache(CFG, jaxkv.RingSpec.from_frames(TPF, 1, 2), 1).begin_chunk()
    got, _ = wan.forward_chunk(params, CFG, cache, cross, latents, t)
    want = wan.forward(params, CFG, latents, t, ctx, pad_context=False)
    assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) <= 1e-5
    with pytest.raises(ValueError, match="cross K/V"):
        wan.forward_chunk(params, CFG, cache, wan.CrossKV(cross.k, cross.v[:, :, :2]), latents, t)


def test_streaming_step_with_a_bf16_cache_lowers_for_cuda_with_the_pallas_kernel():
    """The GPU configuration: bf16 cache, backend "pallas". Queries are cast to the cache dtype so the kernel (one
    dtype for q, k, v) is used; checked by lowering for CUDA on this CPU-only machine, with abstract params."""
    from jaxkv.models.wan.params import param_shapes

    cfg = wan.preset("tiny")
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )
    spec = jaxkv.RingSpec.from_frames(16, 3, 9, 3)
    cache = jax.eval_shape(lambda: wan.init_cache(cfg, spec, 2, dtype=jnp.bfloat16).begin_chunk())
    cross = jax.eval_shape(
        lambda p, c: wan.cross_kv(p, cfg, c, precision="bfloat16"),
        params,
        jax.ShapeDtypeStruct((2, cfg.text_len, cfg.text_dim), jnp.bfloat16),
    )
    x = jax.ShapeDtypeStruct((2, 3, 8, 8, cfg.in_dim), jnp.float32)
    t = jax.ShapeDtypeStruct((2,), jnp.float32)
    texts = {}
    for backend in ("pallas", "xla"):
        step = jax.jit(
            lambda p, c, cr, x, t: wan.forward_chunk(p, cfg, c, cr, x, t, backend=backend, precision="bfloat16"),  # noqa: B023 - called in the iteration that defines it
            donate_argnums=1,
        )
        texts[backend] = step.trace(params, cache, cross, x, t).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in texts["pallas"]
    assert "triton" not in texts["xla"]


def test_teacher_forcing_with_remat_gives_the_same_gradient():
    """``remat=True`` puts each block under `jax.checkpoint` and changes nothing but float rounding."""
    params, latents, t, ctx = _setup(5, batch=2, frames=6)
    noisy = latents + jax.random.normal(jax.random.key(6), latents.shape)
    remat_gradients_agree(
        lambda remat: (
            lambda p: jnp.mean(
                wan.forward_teacher_forcing(
                    p, CFG, latents, noisy, t, ctx, chunk_frames=2, window_frames=4, sink_frames=2, remat=remat
                )
                ** 2
            )
        ),
        params,
    )
