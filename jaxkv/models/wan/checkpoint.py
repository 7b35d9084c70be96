"""The jaxkv Wan checkpoint: a directory that `jaxkv convert` writes and `jaxkv generate --checkpoint` reads.

Layout::

    DST/
      config.json          WanConfig.to_dict() plus "format": "jaxkv-wan" and "format_version": 1
      params.safetensors   the params of `jaxkv.models.wan.params`, flattened with '.' ("blocks.self_attn.q.kernel")

A directory is written atomically (`jaxkv.files.atomic_directory`): into a temporary sibling directory that is
renamed onto DST only when complete, so an interrupted write leaves either nothing or the previous checkpoint, never
half of one; ``force`` replaces only a directory that is itself a jaxkv Wan checkpoint.
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
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import validate_params

FORMAT = "jaxkv-wan"
FORMAT_VERSION = 1


def config_json(config: WanConfig) -> str:
    """The text of ``config.json``."""
    return config_text(FORMAT, FORMAT_VERSION, config.to_dict())


def read_config(path: str) -> WanConfig:
    """WanConfig of the checkpoint directory ``path``; CheckpointError for a missing or foreign config.json."""
    fields = read_marked_config(
        path,
        fmt=FORMAT,
        version=FORMAT_VERSION,
        kind="Wan",
        hint=f"create one with `jaxkv convert SRC {path}` (a PyTorch/diffusers directory must first be converted)",
    )
    try:
        return WanConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)} does not hold a valid WanConfig: {e}") from None


def replace_problem(path: str) -> str | None:
    """None if ``path`` is a jaxkv Wan checkpoint directory (config.json with the format marker +
    params.safetensors, nothing else) that ``force`` may replace; otherwise why not."""
    return files.directory_problem(path, required=(CONFIG_FILE, PARAMS_FILE), formats=(FORMAT,))


def atomic_directory(path: str, *, force: bool = False, log=None):
    """`jaxkv.files.atomic_directory` for a Wan checkpoint: with ``force`` an existing ``path`` is replaced only
    if it is a jaxkv Wan checkpoint directory (see `replace_problem`)."""
    return files.atomic_checkpoint_directory(path, force=force, formats=(FORMAT,), log=log)


def save(path: str, config: WanConfig, params: dict[str, Any], *, force: bool = False) -> None:
    """Writes ``params`` (the layout of `jaxkv.models.wan.params`, any float dtype) and ``config`` to the
    directory ``path``, atomically. Validates the params against the config first: nothing is written on error."""
    validate_params(params, config)
    save_params(path, params, config_json(config), fmt=FORMAT, version=FORMAT_VERSION, force=force)


def load(path: str, dtype=None) -> tuple[WanConfig, dict[str, Any]]:
    """Reads a checkpoint directory -> (WanConfig, params as jax arrays).

    ``dtype`` (e.g. ``jnp.float32``) casts every parameter; None keeps the stored dtype. Tensors are read and cast
    one at a time (`jaxkv.models.checkpoint_dir.load_params`), so peak host memory is the params in the requested
    dtype plus one tensor, whatever the stored dtype. Raises CheckpointError naming the problem for a
    missing/foreign directory, a truncated or corrupt params file, and params that do not match the config
    (missing / unexpected keys, shape mismatches), the last checked from the file's header before reading data.
    """
    config = read_config(path)
    return config, load_params(path, lambda tree: validate_params(tree, config), dtype)
