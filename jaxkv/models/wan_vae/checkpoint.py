"""The jaxkv Wan VAE checkpoint: a directory that the VAE converter writes and `load` reads.

Layout::

    DST/
      config.json          WanVAEConfig.to_dict() plus "format": "jaxkv-wan-vae" and "format_version": 1
      params.safetensors   the params of `jaxkv.models.wan_vae.params`, flattened with '.'

Written atomically (a temporary sibling renamed onto DST when complete), like the DiT checkpoint, whose
`atomic_directory` this reuses. The distinct format marker keeps a VAE directory from being read as a DiT one and
the other way round.
"""

from __future__ import annotations

import os
from typing import Any

from jaxkv import files
from jaxkv.models.checkpoint_dir import (
    CONFIG_FILE,
    PARAMS_FILE,
    CheckpointError,
    config_text,
    load_params,
    read_marked_config,
    save_params,
)
from jaxkv.models.wan_vae.config import WanVAEConfig
from jaxkv.models.wan_vae.params import validate_params

FORMAT = "jaxkv-wan-vae"
FORMAT_VERSION = 1

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "PARAMS_FILE",
    "CheckpointError",
    "config_json",
    "read_config",
    "save",
    "load",
]


def config_json(config: WanVAEConfig) -> str:
    """The text of ``config.json``."""
    return config_text(FORMAT, FORMAT_VERSION, config.to_dict())


def read_config(path: str) -> WanVAEConfig:
    """WanVAEConfig of the checkpoint directory ``path``; CheckpointError for a missing or foreign config.json."""
    fields = read_marked_config(
        path,
        fmt=FORMAT,
        version=FORMAT_VERSION,
        kind="Wan VAE",
        hint="a PyTorch/diffusers VAE must first be converted (`jaxkv convert`)",
    )
    try:
        return WanVAEConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)} does not hold a valid WanVAEConfig: {e}") from None


def atomic_directory(path: str, *, force: bool = False, log=None):
    """`jaxkv.files.atomic_directory` for this format: with ``force`` an existing ``path`` is replaced only if it is
    a jaxkv VAE checkpoint directory."""
    return files.atomic_checkpoint_directory(path, force=force, formats=(FORMAT,), log=log)


def save(path: str, config: WanVAEConfig, params: dict[str, Any], *, force: bool = False) -> None:
    """Writes ``params`` and ``config`` to the directory ``path``, atomically; validates first (nothing is written
    on error)."""
    validate_params(params, config)
    save_params(path, params, config_json(config), fmt=FORMAT, version=FORMAT_VERSION, force=force)


def load(path: str, dtype=None) -> tuple[WanVAEConfig, dict[str, Any]]:
    """Reads a VAE checkpoint directory -> (WanVAEConfig, params as jax arrays); ``dtype`` casts every parameter
    (one tensor at a time). CheckpointError names a missing/foreign directory, a corrupt params file or params
    that do not fit the config."""
    config = read_config(path)
    return config, load_params(path, lambda tree: validate_params(tree, config), dtype)
