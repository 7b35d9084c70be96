"""Wan's umT5 text encoder in JAX: config presets, params layout, pure `encode`."""

from jaxkv.models.umt5.config import PRESETS, UMT5Config, preset
from jaxkv.models.umt5.model import encode, encode_jit, relative_buckets
from jaxkv.models.umt5.params import init_params, param_shapes, validate_params

__all__ = ["PRESETS", "UMT5Config", "preset", "encode", "encode_jit", "relative_buckets", "init_params",
           "param_shapes", "validate_params"]
