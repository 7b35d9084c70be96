"""A small non-Wan streaming model built on `CachedSelfAttention`: a chunk-causal transformer over feature frames.

Think of a stream of sensor or audio feature vectors arriving a chunk at a time: each chunk attends to itself
(bidirectionally), to a pinned sink (the first chunk) and to a rolling window of recent chunks. The same weights
run on the whole sequence at once (training) with the chunk-causal window mask, and the streaming path reproduces
that forward exactly::

    import jax, jax.numpy as jnp
    from flax import nnx
    import jaxkv
    from examples.streaming_encoder import StreamingEncoder   # from the project root

    spec = jaxkv.RingSpec(chunk=4, window=12, sink=4)           # tokens: a 1-chunk sink + 3 chunks of window
    model = StreamingEncoder(features=6, dim=32, num_heads=4, num_layers=2, spec=spec, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 40, 6))       # 10 chunks of 4 frames

    full = model(x)                                             # [2, 40, 6], whole sequence at once
    step = model.stream_step()                                  # jitted (cache, chunk) -> (cache, y)
    cache = model.init_cache(batch=2)
    ys = []
    for n in range(10):
        cache, y = step(cache, x[:, 4 * n:4 * (n + 1)])
        ys.append(y)
    assert jnp.allclose(jnp.concatenate(ys, 1), full, atol=1e-5)

The cache never grows: after the fourth chunk each step overwrites the oldest window slot in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.cache import RingCache, RingSpec
from jaxkv.nn.attention import CachedSelfAttention, rotary


class _Block(nnx.Module):
    def __init__(self, dim, num_heads, num_kv_heads, mask, *, rngs):
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = CachedSelfAttention(
            dim, num_heads, num_kv_heads=num_kv_heads, mask=mask, rope=rotary(), backend="auto", rngs=rngs
        )
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def _mlp(self, x):
        return self.down(jax.nn.gelu(self.up(self.norm2(x))))

    def __call__(self, x, cache, layer):
        y, cache = self.attn(self.norm1(x), cache, layer=layer)
        x = x + y
        return x + self._mlp(x), cache

    def forward(self, x, positions):
        x = x + self.attn.forward(self.norm1(x), positions)
        return x + self._mlp(x)


class StreamingEncoder(nnx.Module):
    """features -> dim, `num_layers` pre-norm blocks of chunk-causal attention (sink + window) and an MLP -> features.

    The attention mask is the cache spec's own (`RingSpec.mask()`: chunk-causal, a window of `spec.window` tokens
    counted from chunk starts, `spec.sink` pinned tokens), so the cache holds exactly what the mask can see.
    """

    def __init__(
        self,
        features: int,
        dim: int,
        num_heads: int,
        num_layers: int,
        spec: RingSpec,
        *,
        num_kv_heads: int | None = None,
        rngs: nnx.Rngs,
    ):
        self.spec = spec
        self.mask = spec.mask()
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = dim // num_heads
        self.embed = nnx.Linear(features, dim, rngs=rngs)
        self.blocks = nnx.List(
            [_Block(dim, num_heads, self.num_kv_heads, self.mask, rngs=rngs) for _ in range(num_layers)]
        )
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, features, rngs=rngs)

    def init_cache(self, batch: int, dtype=jnp.float32) -> RingCache:
        """An empty ring stacking every layer: k, v [layers, batch, sink + window, kv_heads, head_dim]."""
        return RingCache.init(self.spec, batch, self.num_kv_heads, self.head_dim, dtype=dtype, layers=len(self.blocks))

    def step(self, cache: RingCache, x):
        """One chunk x [batch, chunk, features] -> (cache, y [batch, chunk, features])."""
        cache = cache.begin_chunk()
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h, cache = block(h, cache, i)
        return cache, self.head(self.norm(h))

    def __call__(self, x, positions=None):
        """Whole sequence x [batch, tokens, features] (positions default 0..tokens-1) -> [batch, tokens, features]."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        h = self.embed(x)
        for block in self.blocks:
            h = block.forward(h, positions)
        return self.head(self.norm(h))

    def stream_step(self):
        """A jitted pure function (cache, x_chunk) -> (cache, y) closing over this model's weights; the cache is
        donated so each chunk is written in place."""
        graphdef, state = nnx.split(self)

        def run(state, cache, x):
            return nnx.merge(graphdef, state).step(cache, x)

        run = jax.jit(run, donate_argnums=(1,))
        return lambda cache, x: run(state, cache, x)
