"""The jaxkv Wan checkpoint: a directory that `jaxkv convert` writes and `jaxkv generate --checkpoint` reads.

Layout::

    DST/
      config.json          WanConfig.to_dict() plus "format": "jaxkv-wan" and "format_version": 1
      params.safetensors   the params of `jaxkv.models.wan.params`, flattened with '.' ("blocks.self_attn.q.kernel")

A directory is written atomically: into a temporary sibling directory that is renamed onto DST only when complete,
so an interrupted write leaves either nothing or the previous checkpoint, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import flatten, unflatten, validate_params

FORMAT = "jaxkv-wan"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
PARAMS_FILE = "params.safetensors"


class CheckpointError(ValueError):
    """A jaxkv checkpoint directory is missing, incomplete or does not match its config."""


def config_json(config: WanConfig) -> str:
    """The text of ``config.json``."""
    return json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, **config.to_dict()}, indent=2,
                      sort_keys=True) + "\n"


def read_config(path: str) -> WanConfig:
    """WanConfig of the checkpoint directory ``path``; CheckpointError for a missing or foreign config.json."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a jaxkv checkpoint directory (it does not exist or is a file); "
                              f"create one with `jaxkv convert SRC {path}`")
    try:
        with open(file) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a jaxkv checkpoint: {CONFIG_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not readable JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{file} is not a jaxkv Wan config: expected \"format\": {FORMAT!r}, found {found!r} "
                              f"(a PyTorch/diffusers directory must first be converted with `jaxkv convert`)")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{file} has format_version {version!r}; this jaxkv reads version {FORMAT_VERSION}")
    fields = {k: v for k, v in data.items() if k not in ("format", "format_version")}
    try:
        return WanConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file} does not hold a valid WanConfig: {e}") from None


@contextlib.contextmanager
def atomic_directory(path: str, *, force: bool = False) -> Iterator[str]:
    """Yields a fresh temporary directory beside ``path``; on normal exit it becomes ``path``, on any exception
    (KeyboardInterrupt included) it is deleted. An existing ``path`` is an error unless ``force``, and is replaced
    only after the new directory is complete."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"{path} already exists; pass force=True (--force) to replace it")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        yield tmp
        _fsync_dir(tmp)
        if os.path.lexists(path):
            # Move the old one aside first: rename cannot replace a non-empty directory.
            old = os.path.join(parent, f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            os.rename(tmp, path)
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old)
            else:
                os.remove(old)
        else:
            os.rename(tmp, path)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(path: str, config: WanConfig, params: dict[str, Any], *, force: bool = False) -> None:
    """Writes ``params`` (the layout of `jaxkv.models.wan.params`, any float dtype) and ``config`` to the
    directory ``path``, atomically. Validates the params against the config first: nothing is written on error."""
    from safetensors.numpy import save_file

    validate_params(params, config)
    flat = {k: np.ascontiguousarray(np.asarray(v)) for k, v in flatten(params).items()}
    with atomic_directory(path, force=force) as tmp:
        save_file(flat, os.path.join(tmp, PARAMS_FILE), metadata={"format": FORMAT,
                                                                  "format_version": str(FORMAT_VERSION)})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(config_json(config))


def load(path: str, dtype=None) -> tuple[WanConfig, dict[str, Any]]:
    """Reads a checkpoint directory -> (WanConfig, params as jax arrays).

    ``dtype`` (e.g. ``jnp.float32``) casts every parameter; None keeps the stored dtype. Raises CheckpointError
    naming the problem for a missing/foreign directory, a truncated or corrupt params file, and params that do not
    match the config (missing / unexpected keys, shape mismatches).
    """
    from safetensors import SafetensorError, safe_open

    config = read_config(path)
    file = os.path.join(path, PARAMS_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a complete jaxkv checkpoint: {PARAMS_FILE} is missing")
    flat = {}
    try:
        with safe_open(file, framework="numpy") as f:
            for key in f.keys():
                array = f.get_tensor(key)
                flat[key] = jnp.asarray(array, dtype=dtype)
                del array
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is truncated or corrupt ({e})") from None
    params = unflatten(flat)
    try:
        validate_params(params, config)
    except ValueError as e:
        raise CheckpointError(f"{file} does not match {os.path.join(path, CONFIG_FILE)}: {e}") from None
    return config, params
