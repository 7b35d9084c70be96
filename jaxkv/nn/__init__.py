"""Layers on jaxkv caches: `cached_attention` (the pure write -> read -> attend step every cached layer uses),
`CachedSelfAttention` (a Flax NNX layer, cache in, cache out) and a RoPE hook at absolute positions.
`examples/streaming_encoder.py` (project root) is a small non-Wan model streaming with them."""

from jaxkv.nn.attention import CachedSelfAttention, RopeHook, rotary
from jaxkv.nn.cached import cached_attention

__all__ = ["CachedSelfAttention", "RopeHook", "cached_attention", "rotary"]
