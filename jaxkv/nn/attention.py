"""A Flax NNX self-attention layer that streams over a ring cache passed in and returned.

The layer owns only its projections; the cache is state the caller threads through (as with an optax optimizer
state): `y, cache = layer(x_chunk, cache)`. Per call it

  1. projects the chunk to q, k, v ([batch, chunk, heads, head_dim]),
  2. optionally rotates q and k with a RoPE hook called at the chunk's *absolute* positions,
  3. writes k, v into the chunk slot the caller reserved (`cache.begin_chunk()`, once per chunk for all layers) and
     attends the chunk's queries to the whole cache in physical slot order, masks from positions
     (`jaxkv.nn.cached_attention`: q, k, v in the cache's dtype),
  4. projects the heads back to the model width.

`forward` runs the same layer on a whole sequence without a cache (training, or the check that streaming is
exact): with the same `MaskSpec`, chunk-by-chunk streaming over a ring big enough for the window equals it — with
no RoPE or with the absolute-position `rope` hook. With `cache_rope` it equals `forward` only until the first
eviction: ranks count only the keys the cache holds, so once a chunk is evicted the streamed keys and queries are
rotated by smaller ranks than `forward` (which ranks the whole sequence) gives them; that is the point of
cache-relative RoPE (the model never sees a distance beyond the cache), not an error.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from flax import nnx

from jaxkv.attention import CacheRope, MaskSpec, attend
from jaxkv.nn.cached import cached_attention
from jaxkv.run_options import RunOptions

RopeHook = Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]  # (x [b, t, h, d], positions int [b, t]) -> x


def rotary(theta: float = 10000.0, style: str = "half") -> RopeHook:
    """A RoPE hook at absolute positions: x [batch, tokens, heads, head_dim], positions int [batch, tokens]."""
    rope = CacheRope(theta=theta, style=style)
    return lambda x, positions: rope.rotate(x, positions).astype(x.dtype)


class CachedSelfAttention(nnx.Module):
    """Multi-head (GQA/MQA) self-attention over a jaxkv cache (`RingCache` or `RollingCache`).

    Args:
      dim: model width.
      num_heads: query heads; `num_kv_heads` (default num_heads) must divide it; the cache holds kv heads.
      head_dim: default dim // num_heads (then dim must be a multiple of num_heads).
      mask: `MaskSpec` applied both streaming and in `forward` (e.g. chunk-causal with a sink + window).
      rope: optional hook `rope(x, positions)` at absolute positions, applied to q and k before the cache write.
      cache_rope: optional `CacheRope` instead: keys cached unrotated and rotated at read by rank (StreamingLLM).
      backend: attention backend (see `jaxkv.attention.attend`; default "auto"), checked here and held as
        ``self.run`` (`jaxkv.run_options.RunOptions`; the layer's dtypes are ``dtype`` / ``param_dtype``, not its
        precision).
      run: a `jaxkv.run_options.RunOptions` instead of ``backend`` (TypeError if given with it): its backend and
        ``interpret`` (the kernel backends off their GPU, e.g. "mosaic" emulated on CPU) reach both `__call__` and
        `forward`; its precision is unused.
      use_bias, dtype, param_dtype, rngs: as for `nnx.Linear`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        mask: MaskSpec = MaskSpec(),
        rope: RopeHook | None = None,
        cache_rope: CacheRope | None = None,
        backend: str | None = None,
        run: RunOptions | None = None,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim ({dim}) is not a multiple of num_heads ({num_heads}): pass head_dim explicitly")
            head_dim = dim // num_heads
        if head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {head_dim} (dim {dim}, num_heads {num_heads})")
        if not isinstance(mask, MaskSpec):
            raise ValueError(f"mask must be a jaxkv.attention.MaskSpec, got {mask!r}")
        if rope is not None and cache_rope is not None:
            raise ValueError("pass either rope (absolute positions, keys cached rotated) or cache_rope, not both")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.mask, self.rope, self.cache_rope = mask, rope, cache_rope
        if run is not None and backend is not None:
            raise TypeError("CachedSelfAttention: pass either run= or backend=, not both (run= holds the backend)")
        if run is not None and not isinstance(run, RunOptions):
            raise TypeError(
                f"CachedSelfAttention: run must be a jaxkv.run_options.RunOptions, got {type(run).__name__}"
            )
        self.run = RunOptions.of(backend=backend) if run is None else run
        linear = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = nnx.Linear(dim, num_heads * head_dim, **linear)
        self.k = nnx.Linear(dim, num_kv_heads * head_dim, **linear)
        self.v = nnx.Linear(dim, num_kv_heads * head_dim, **linear)
        self.o = nnx.Linear(num_heads * head_dim, dim, **linear)

    def _qkv(self, x, positions):
        b, t, _ = x.shape
        q = self.q(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        return q, k, v

    def _out(self, out):
        b, t = out.shape[:2]
        return self.o(out.reshape(b, t, self.num_heads * self.head_dim))

    def __call__(self, x, cache, *, layer=None):
        """One chunk: x [batch, chunk, dim] at the positions of the chunk reserved in `cache`.

        Args:
          x: [batch, chunk, dim]; chunk must equal the cache's chunk size.
          cache: a cache with a reserved chunk (`begin_chunk()` called for this chunk), heads = num_kv_heads.
          layer: the layer index in a stacked cache (`layers=` at init), else None.
        Returns:
          (y [batch, chunk, dim], the cache with this layer's k, v written).
        """
        if x.ndim != 3 or x.shape[:2] != (cache.batch, cache.spec.chunk):
            raise ValueError(
                f"x must be [batch, chunk, dim] = [{cache.batch}, {cache.spec.chunk}, dim], got {list(x.shape)}"
            )
        if (cache.heads, cache.head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"cache holds {cache.heads} heads of {cache.head_dim}, the layer needs "
                f"{self.num_kv_heads} of {self.head_dim}"
            )
        q, k, v = self._qkv(x, cache.chunk_positions())
        out, cache = cached_attention(cache, q, k, v, layer=layer, mask=self.mask, rope=self.cache_rope, run=self.run)
        return self._out(out), cache

    def forward(self, x, positions):
        """The whole sequence at once, no cache: x [batch, tokens, dim], positions int [batch, tokens]."""
        q, k, v = self._qkv(x, positions)
        run = self.run
        out = attend(
            q,
            k,
            v,
            positions,
            positions,
            mask=self.mask,
            rope=self.cache_rope,
            backend=run.backend,
            interpret=run.interpret,
        )
        return self._out(out)
