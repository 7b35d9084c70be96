"""Wan's umT5 text encoder in JAX: config presets, params layout, pure `encode`, Wan's tokenization and context
post-processing (`encode_prompts`), checkpoints, and `TextEncoder` (load / tiny, encode, release, embeddings cache).
"""

from jaxkv.models.umt5.checkpoint import load, save
from jaxkv.models.umt5.config import PRESETS, UMT5Config, preset
from jaxkv.models.umt5.encoder import EmbeddingsCache, PromptTruncated, TextEncoder, encode_prompts
from jaxkv.models.umt5.model import encode, encode_jit, relative_buckets
from jaxkv.models.umt5.params import init_params, param_shapes, validate_params
from jaxkv.models.umt5.tokenizer import Tokenizer, TokenizerNotFound, clean_text, tiny_tokenizer

__all__ = [
    "load",
    "save",
    "PRESETS",
    "UMT5Config",
    "preset",
    "EmbeddingsCache",
    "PromptTruncated",
    "TextEncoder",
    "encode_prompts",
    "encode",
    "encode_jit",
    "relative_buckets",
    "init_params",
    "param_shapes",
    "validate_params",
    "Tokenizer",
    "TokenizerNotFound",
    "clean_text",
    "tiny_tokenizer",
]
