"""Flax NNX layers on jaxkv caches: `CachedSelfAttention` (cache in, cache out) and a RoPE hook at absolute
positions. `jaxkv.nn.example.StreamingEncoder` is a small non-Wan model streaming with them."""

from jaxkv.nn.attention import CachedSelfAttention, RopeHook, rotary

__all__ = ["CachedSelfAttention", "RopeHook", "rotary"]
