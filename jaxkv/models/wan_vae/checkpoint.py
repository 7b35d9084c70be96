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

import jax.numpy as jnp
import numpy as np

from jaxkv import files
from jaxkv.models.checkpoint_dir import (CONFIG_FILE, PARAMS_FILE, CheckpointError, config_text,
                                         read_marked_config)
from jaxkv.models.wan_vae.config import WanVAEConfig
from jaxkv.models.wan_vae.params import flatten, unflatten, validate_params

FORMAT = "jaxkv-wan-vae"
FORMAT_VERSION = 1

__all__ = ["FORMAT", "FORMAT_VERSION", "CheckpointError", "config_json", "read_config", "save", "load"]


def config_json(config: WanVAEConfig) -> str:
    """The text of ``config.json``."""
    return config_text(FORMAT, FORMAT_VERSION, config.to_dict())


def read_config(path: str) -> WanVAEConfig:
    """WanVAEConfig of the checkpoint directory ``path``; CheckpointError for a missing or foreign config.json."""
    fields = read_marked_config(path, fmt=FORMAT, version=FORMAT_VERSION, kind="Wan VAE",
                                hint="a PyTorch/diffusers VAE must first be converted (`jaxkv convert`)")
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
    from safetensors.numpy import save_file

    validate_params(params, config)
    flat = {k: np.ascontiguousarray(np.asarray(v)) for k, v in flatten(params).items()}
    with atomic_directory(path, force=force) as tmp:
        save_file(flat, os.path.join(tmp, PARAMS_FILE), metadata={"format": FORMAT,
                                                                  "format_version": str(FORMAT_VERSION)})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(config_json(config))


def load(path: str, dtype=None) -> tuple[WanVAEConfig, dict[str, Any]]:
    """Reads a VAE checkpoint directory -> (WanVAEConfig, params as jax arrays); ``dtype`` casts every parameter.
    CheckpointError names a missing/foreign directory, a corrupt params file or params that do not fit the config."""
    from safetensors import SafetensorError, safe_open

    config = read_config(path)
    file = os.path.join(path, PARAMS_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a complete jaxkv VAE checkpoint: {PARAMS_FILE} is missing")
    flat = {}
    try:
        with safe_open(file, framework="numpy") as f:
            for key in f.keys():
                flat[key] = jnp.asarray(f.get_tensor(key), dtype=dtype)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is truncated or corrupt ({e})") from None
    params = unflatten(flat)
    try:
        validate_params(params, config)
    except ValueError as e:
        raise CheckpointError(f"{file} does not match {os.path.join(path, CONFIG_FILE)}: {e}") from None
    return config, params
