"""Checkpoint converters: PyTorch / safetensors Wan 2.1 checkpoints -> jaxkv params.

    from converters import convert_checkpoint
    plan = convert_checkpoint("Wan2.1-T2V-1.3B/", "wan13b-jaxkv/", dtype="bf16")

`plan_conversion` checks a checkpoint from its headers alone; `write_checkpoint` streams a checked plan to disk;
every problem is a `ConversionError`. Converters of other model families reuse `write_tensor_directory` /
`Piece` (converters/stream.py: plan -> stream -> atomic write, with the destination and NaN/Inf rules) and
`open_source`. `detect_family` tells a DiT, a VAE and a umT5 source apart; `convert_release` turns a whole Wan
release into ``DST/{dit,vae,text_encoder}/`` (converters/release.py). Names load lazily, so `jaxkv convert --help` does not import JAX.
"""

_API = {"convert_checkpoint": "converters.convert", "plan_conversion": "converters.convert",
        "write_checkpoint": "converters.convert", "check_output": "converters.convert", "Plan": "converters.convert",
        "ConversionError": "converters.errors", "open_source": "converters.sources",
        "write_tensor_directory": "converters.stream", "Piece": "converters.stream",
        "detect_family": "converters.release", "find_release": "converters.release",
        "plan_release": "converters.release", "write_release": "converters.release",
        "convert_release": "converters.release", "RELEASE_PARTS": "converters.release"}

__all__ = sorted(_API)


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'converters' has no attribute {name!r}")
