"""The NNX self-attention layer on a cache: streaming chunk by chunk equals the full-sequence chunk-causal forward."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from examples import streaming_encoder as example
from examples.streaming_encoder import StreamingEncoder
from jaxkv.attention import CacheRope, MaskSpec
from jaxkv.nn import CachedSelfAttention, cached_attention, rotary
from jaxkv.run_options import RunOptions


def _stream(model, x, cache):
    step = model.stream_step()
    c = model.spec.chunk
    ys = []
    for n in range(x.shape[1] // c):
        cache, y = step(cache, x[:, n * c : (n + 1) * c])
        ys.append(y)
    return jnp.concatenate(ys, axis=1), cache


@pytest.mark.parametrize("sink_chunks, num_kv_heads", [(1, 2), (0, 4)])
@pytest.mark.slow
def test_streaming_encoder_equals_full_forward(sink_chunks, num_kv_heads):
    spec = jaxkv.RingSpec(chunk=3, window=6, sink=3 * sink_chunks)
    model = StreamingEncoder(
        features=5, dim=16, num_heads=4, num_layers=2, spec=spec, num_kv_heads=num_kv_heads, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(1), (2, 24, 5))  # 8 chunks: the window wraps three times
    streamed, cache = _stream(model, x, model.init_cache(batch=2))
    np.testing.assert_allclose(streamed, model(x), atol=2e-5)
    assert cache.k.shape == (2, 2, spec.capacity, num_kv_heads, 4)  # never grew
    # The window matters: a model with a longer window differs.
    wide = StreamingEncoder(
        features=5,
        dim=16,
        num_heads=4,
        num_layers=2,
        rngs=nnx.Rngs(0),
        num_kv_heads=num_kv_heads,
        spec=jaxkv.RingSpec(chunk=3, window=24, sink=3 * sink_chunks),
    )
    assert np.abs(np.asarray(wide(x) - model(x))).max() > 1e-3


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_module_docstring_example_runs():
    code = "\n".join(line[4:] for line in re.search(r"::\n\n(.*?)\n\n[A-Z]", example.__doc__, re.S)[1].splitlines())
    exec(compile(code, "examples/streaming_encoder.py docstring", "exec"), {})


def _layer(mask, **kw):
    return CachedSelfAttention(12, num_heads=2, num_kv_heads=1, mask=mask, rngs=nnx.Rngs(3), **kw)


@pytest.mark.parametrize("policy", [jaxkv.RingCache, jaxkv.RollingCache])
@pytest.mark.parametrize("rope", ["absolute", "cache_relative"])
@pytest.mark.slow
def test_layer_streams_over_unstacked_cache(policy, rope):
    """One layer, one cache without a layer axis. With cache-relative RoPE, ranks equal absolute positions while
    nothing is evicted, so the streamed result still equals the full forward; both policies behave the same."""
    spec = jaxkv.RingSpec(chunk=2, window=8, sink=0)
    mask = MaskSpec(chunk=2)
    kw = dict(rope=rotary(style="interleaved")) if rope == "absolute" else dict(cache_rope=CacheRope())
    layer = _layer(mask, **kw)
    x = jax.random.normal(jax.random.key(4), (1, 8, 12))
    cache = policy.init(spec, batch=1, heads=1, head_dim=6)
    step = jax.jit(lambda cache, xc: layer(xc, cache.begin_chunk())[::-1])
    ys = []
    for n in range(4):
        cache, y = step(cache, x[:, 2 * n : 2 * n + 2])
        ys.append(y)
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    np.testing.assert_allclose(jnp.concatenate(ys, 1), layer.forward(x, positions), atol=2e-5)


def test_layer_rejects_bad_configuration_and_inputs():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        CachedSelfAttention(12, num_heads=3, num_kv_heads=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"dim \(10\) is not a multiple of num_heads \(4\): pass head_dim"):
        CachedSelfAttention(10, num_heads=4, rngs=nnx.Rngs(0))  # would silently round head_dim down to 2
    assert CachedSelfAttention(10, num_heads=4, head_dim=3, rngs=nnx.Rngs(0)).head_dim == 3
    with pytest.raises(ValueError, match="not both"):
        _layer(MaskSpec(), rope=rotary(), cache_rope=CacheRope())
    with pytest.raises(ValueError, match="MaskSpec"):
        _layer(dict(chunk=2))
    layer = _layer(MaskSpec(chunk=2))
    cache = jaxkv.RingCache.init(jaxkv.RingSpec(chunk=2, window=4), batch=1, heads=1, head_dim=6).begin_chunk()
    with pytest.raises(ValueError, match=r"x must be \[batch, chunk, dim\]"):
        layer(jnp.zeros((1, 3, 12)), cache)
    wrong = jaxkv.RingCache.init(jaxkv.RingSpec(chunk=2, window=4), batch=1, heads=2, head_dim=6).begin_chunk()
    with pytest.raises(ValueError, match="cache holds 2 heads"):
        layer(jnp.zeros((1, 2, 12)), wrong)


def test_cached_attention_is_write_read_cast_attend():
    """The one cached-attention step: k, v written in the cache dtype into the reserved slot of the given layer, q
    cast to the cache dtype, attention over that layer with the spec's mask; the output comes back in q's dtype.
    The NNX layer runs exactly this step (its output equals the step's, projected)."""
    spec = jaxkv.RingSpec(chunk=2, window=4, sink=2)
    cache = jaxkv.RingCache.init(spec, batch=1, heads=1, head_dim=6, dtype=jnp.bfloat16, layers=2)
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 2, h, 6)), jnp.float32) for h in (2, 1, 1))
    for _ in range(3):  # a sink chunk, then the window fills
        cache = cache.begin_chunk()
        out, cache = cached_attention(cache, q, k, v, layer=1)
    assert out.dtype == jnp.float32
    kc, vc = cache.layer_kv(1)
    np.testing.assert_array_equal(np.asarray(kc[:, 4:6], np.float32), np.asarray(k.astype(jnp.bfloat16), np.float32))
    assert not np.asarray(cache.layer_kv(0)[0], np.float32).any()  # the other layer is untouched
    want = jaxkv.attend(q.astype(jnp.bfloat16), kc, vc, cache.chunk_positions(), cache.positions, mask=spec.mask())
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want.astype(jnp.float32)))
    # A float32 query would give a different (more precise) answer: the cast is really there.
    f32 = jaxkv.attend(
        q, kc.astype(jnp.float32), vc.astype(jnp.float32), cache.chunk_positions(), cache.positions, mask=spec.mask()
    )
    assert np.abs(np.asarray(f32) - np.asarray(out)).max() > 0

    layer = _layer(spec.mask())
    x = jnp.asarray(rng.normal(size=(1, 2, 12)), jnp.float32)
    fresh = jaxkv.RingCache.init(spec, batch=1, heads=1, head_dim=6, dtype=jnp.bfloat16).begin_chunk()
    y, written = layer(x, fresh)
    b, t = x.shape[:2]
    qx = layer.q(x).reshape(b, t, 2, 6)
    kx, vx = layer.k(x).reshape(b, t, 1, 6), layer.v(x).reshape(b, t, 1, 6)
    out, by_hand = cached_attention(fresh, qx, kx, vx, mask=spec.mask())
    np.testing.assert_array_equal(np.asarray(written.k), np.asarray(by_hand.k))
    np.testing.assert_allclose(np.asarray(y), np.asarray(layer.o(out.reshape(b, t, 12))), atol=1e-6)


def test_layer_runs_the_mosaic_emulation_through_run_options_cached_and_not():
    """``run=RunOptions(backend="mosaic", interpret=True)`` reaches `attend` from both branches: the whole-sequence
    `forward` (no cache) and the cached `__call__`; each equals backend "xla" within the Wan model's mosaic-vs-xla
    tolerance (tests/test_attention_layer.py). Without ``interpret`` the Mosaic GPU kernel cannot run on CPU."""
    mask = MaskSpec(chunk=8)
    x = jax.random.normal(jax.random.key(7), (2, 16, 12))
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    spec = jaxkv.RingSpec(chunk=8, window=16, sink=0)
    outs = {}
    for name, run in (("xla", RunOptions.of(backend="xla")), ("mosaic", RunOptions(backend="mosaic", interpret=True))):
        layer = _layer(mask, run=run)
        assert layer.run == run
        cache = jaxkv.RingCache.init(spec, batch=2, heads=1, head_dim=6)
        streamed = []
        for n in range(2):
            y, cache = layer(x[:, 8 * n : 8 * n + 8], cache.begin_chunk())
            streamed.append(y)
        outs[name] = (layer.forward(x, positions), jnp.concatenate(streamed, axis=1))
    for got, want in zip(outs["mosaic"], outs["xla"], strict=True):
        assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) <= 1e-5
    np.testing.assert_allclose(outs["xla"][1], outs["xla"][0], atol=2e-5)  # streaming equals the whole sequence
    with pytest.raises(TypeError, match="either run= or backend="):
        _layer(mask, run=RunOptions(), backend="xla")
    with pytest.raises(TypeError, match="run must be a jaxkv.run_options.RunOptions, got str"):
        _layer(mask, run="mosaic")
