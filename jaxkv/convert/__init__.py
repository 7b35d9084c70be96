"""Checkpoint converters: PyTorch / safetensors Wan 2.1 checkpoints -> jaxkv params.

    from jaxkv.convert import convert_checkpoint
    plan = convert_checkpoint("Wan2.1-T2V-1.3B/", "wan13b-jaxkv/", dtype="bf16")

`plan_conversion` checks a checkpoint from its headers alone; `write_checkpoint` streams a checked plan to disk;
every problem is a `ConversionError`. Converters of other model families reuse `write_tensor_directory` /
`Piece` (jaxkv/convert/stream.py: plan -> stream -> atomic write, with the destination and NaN/Inf rules) and
`open_source`. `detect_family` tells a DiT, a VAE and a umT5 source apart; `convert_release` turns a whole Wan
release into ``DST/{dit,vae,text_encoder}/`` (jaxkv/convert/release.py). Names load lazily, so `jaxkv convert --help`
does not import JAX.
"""

_API = {
    "convert_checkpoint": "jaxkv.convert.convert",
    "plan_conversion": "jaxkv.convert.convert",
    "write_checkpoint": "jaxkv.convert.convert",
    "check_output": "jaxkv.convert.convert",
    "Plan": "jaxkv.convert.convert",
    "ConversionError": "jaxkv.convert.errors",
    "open_source": "jaxkv.convert.sources",
    "write_tensor_directory": "jaxkv.convert.stream",
    "Piece": "jaxkv.convert.stream",
    "detect_family": "jaxkv.convert.release",
    "find_release": "jaxkv.convert.release",
    "plan_release": "jaxkv.convert.release",
    "write_release": "jaxkv.convert.release",
    "convert_release": "jaxkv.convert.release",
    "RELEASE_PARTS": "jaxkv.convert.release",
}

__all__ = sorted(_API)


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'jaxkv.convert' has no attribute {name!r}")
