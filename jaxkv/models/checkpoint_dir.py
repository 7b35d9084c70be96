"""The jaxkv checkpoint directory shared by every model family: ``config.json`` + ``params.safetensors``.

``config.json`` holds the family's config fields plus ``"format"`` (e.g. "jaxkv-wan", "jaxkv-wan-vae",
"jaxkv-umt5") and ``"format_version"``; the marker keeps one family's directory from being read as another's, and
is what `jaxkv.files.atomic_checkpoint_directory` checks before ``--force`` replaces a directory.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import numpy as np

from jaxkv import files, safetensors_io
from jaxkv.models.param_tree import flatten, unflatten

CONFIG_FILE = "config.json"
PARAMS_FILE = "params.safetensors"


# The format markers of the families, with the names messages use for them.
FAMILIES = {"jaxkv-wan": "DiT", "jaxkv-wan-vae": "VAE", "jaxkv-umt5": "text-encoder"}


class CheckpointError(ValueError):
    """A jaxkv checkpoint directory is missing, incomplete, of another family or does not match its config."""


def config_text(fmt: str, version: int, fields: dict[str, Any]) -> str:
    """The text of ``config.json``: the format marker and version, then ``fields``."""
    return json.dumps({"format": fmt, "format_version": version, **fields}, indent=2, sort_keys=True) + "\n"


def read_marked_config(path: str, *, fmt: str, version: int, kind: str, hint: str) -> dict[str, Any]:
    """The entries of ``path/config.json`` other than the marker, after checking the directory exists, the file is
    JSON, and it carries ``"format": fmt`` at ``version``; CheckpointError naming the problem otherwise.

    ``kind`` names the family in messages ("Wan", "Wan VAE", "umT5"); ``hint`` says how to make one (shown when
    the directory or its marker is not ours)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path} is not a jaxkv {kind} checkpoint directory (it does not exist or is a file); {hint}"
        )
    try:
        with open(file) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a jaxkv {kind} checkpoint: {CONFIG_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not readable JSON ({e})") from None
    found = data.get("format") if isinstance(data, dict) else type(data).__name__
    if found != fmt:
        other = (
            f" (that is a jaxkv {FAMILIES[found]} checkpoint, not a {FAMILIES.get(fmt, kind)} one)"
            if isinstance(found, str) and found in FAMILIES
            else ""
        )
        raise CheckpointError(
            f'{file} is not a jaxkv {kind} config: expected "format": {fmt!r}, found {found!r}{other}; {hint}'
        )
    if data.get("format_version") != version:
        raise CheckpointError(
            f"{file} has format_version {data.get('format_version')!r}; this jaxkv reads version {version}"
        )
    return {k: v for k, v in data.items() if k not in ("format", "format_version")}


def save_params(
    path: str,
    params: dict[str, Any],
    config_json: str,
    *,
    fmt: str,
    version: int,
    force: bool = False,
    optional: tuple[str, ...] = (),
) -> None:
    """Writes ``params`` (a validated tree) and ``config_json`` to the directory ``path`` atomically; with ``force``
    an existing directory is replaced only if it is a checkpoint of ``fmt`` (holding at most ``optional`` besides
    the two files)."""
    from safetensors.numpy import save_file

    flat = {k: np.ascontiguousarray(np.asarray(v)) for k, v in flatten(params).items()}
    with files.atomic_checkpoint_directory(path, force=force, formats=(fmt,), optional=optional) as tmp:
        save_file(flat, os.path.join(tmp, PARAMS_FILE), metadata={"format": fmt, "format_version": str(version)})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(config_json)


class _Shape:
    """Stands in for an array in a ``validate`` (which reads only ``np.shape``) before any data is read."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = tuple(shape)


def load_params(
    path: str,
    validate: Callable[[dict[str, Any]], None],
    dtype=None,
    *,
    sharding_of: Callable[[str, tuple[int, ...]], Any] | None = None,
) -> dict[str, Any]:
    """The params tree of the checkpoint directory ``path`` as jax arrays.

    ``validate(tree)`` (the family's ``validate_params`` with its config) is first run on the file's header alone
    (shapes), so missing / unexpected keys and shape mismatches are reported before any data is read. Tensors are
    then read and cast to ``dtype`` (None: as stored) one at a time with plain file reads
    (`jaxkv.safetensors_io.read_array`), so peak host memory is the params in the requested dtype plus one tensor.
    CheckpointError names a missing, truncated or corrupt params file and params that do not match the config.

    ``sharding_of(key, shape) -> jax.sharding.Sharding`` (e.g. `jaxkv.parallel.rules`) loads each tensor straight
    into its shards: ``jax.make_array_from_callback`` reads only the slices of this process's devices
    (`jaxkv.safetensors_io.read_slice`), so no host or device ever holds a whole sharded tensor."""
    file = os.path.join(path, PARAMS_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a complete jaxkv checkpoint: {PARAMS_FILE} is missing")
    target = None if dtype is None else np.dtype(dtype)
    try:
        infos, _ = safetensors_io.read_header(file)
        try:
            validate(unflatten({k: _Shape(i.shape) for k, i in infos.items()}))
        except ValueError as e:
            raise CheckpointError(f"{file} does not match {os.path.join(path, CONFIG_FILE)}: {e}") from None
        flat = {}
        for key, info in infos.items():
            if sharding_of is not None:
                flat[key] = jax.make_array_from_callback(
                    info.shape,
                    sharding_of(key, info.shape),
                    lambda index, info=info: safetensors_io.read_slice(file, info, index, target),
                )
                continue
            array = safetensors_io.read_array(file, info, target)
            flat[key] = jax.device_put(array)
            del array  # the host copy goes as soon as the device holds it
    except (safetensors_io.FormatError, OSError) as e:
        raise CheckpointError(f"{file} is truncated or corrupt ({e})") from None
    return unflatten(flat)
