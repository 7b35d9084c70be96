"""Wan 2.1 (causal, streaming) in Flax: pure functions of a params pytree plus an NNX module holding them."""

from jaxkv.models.wan.checkpoint import load, save
from jaxkv.models.wan.config import PRESETS, WanConfig, preset
from jaxkv.models.wan.model import (
    ROPE_MODES,
    CrossKV,
    cache_relative_rope,
    cross_kv,
    forward,
    forward_block_causal,
    forward_chunk,
    forward_teacher_forcing,
    init_cache,
    init_params,
    recompute_cache,
)
from jaxkv.models.wan.module import WanModel
from jaxkv.models.wan.params import param_shapes, validate_params

__all__ = [
    "load",
    "save",
    "PRESETS",
    "WanConfig",
    "preset",
    "CrossKV",
    "cross_kv",
    "forward",
    "forward_block_causal",
    "forward_chunk",
    "forward_teacher_forcing",
    "init_cache",
    "init_params",
    "param_shapes",
    "validate_params",
    "WanModel",
    "ROPE_MODES",
    "cache_relative_rope",
    "recompute_cache",
]
