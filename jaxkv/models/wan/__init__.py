"""Wan 2.1 (causal, streaming) in Flax."""
