"""The Wan 2.1 causal 3-D VAE in JAX: pure functions over a params pytree, channels last, with a streaming decoder
whose feature caches are an immutable state (`decode_chunk`)."""

from jaxkv.models.wan_vae.checkpoint import load, save
from jaxkv.models.wan_vae.config import LATENTS_MEAN, LATENTS_STD, PRESETS, WanVAEConfig, preset
from jaxkv.models.wan_vae.decoder import DecoderState, cache_bytes, decode, decode_chunk, init_decoder_state
from jaxkv.models.wan_vae.encoder import encode
from jaxkv.models.wan_vae.latents import denormalize, normalize
from jaxkv.models.wan_vae.params import init_params, num_params, param_shapes, validate_params
from jaxkv.models.wan_vae.stream import StreamDecoder

__all__ = [
    "load",
    "save",
    "LATENTS_MEAN",
    "LATENTS_STD",
    "PRESETS",
    "WanVAEConfig",
    "preset",
    "DecoderState",
    "cache_bytes",
    "decode",
    "decode_chunk",
    "init_decoder_state",
    "encode",
    "denormalize",
    "normalize",
    "init_params",
    "num_params",
    "param_shapes",
    "validate_params",
    "StreamDecoder",
]
