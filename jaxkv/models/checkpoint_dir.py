"""The jaxkv checkpoint directory shared by every model family: ``config.json`` + ``params.safetensors``.

``config.json`` holds the family's config fields plus ``"format"`` (e.g. "jaxkv-wan", "jaxkv-wan-vae",
"jaxkv-umt5") and ``"format_version"``; the marker keeps one family's directory from being read as another's, and
is what `jaxkv.files.atomic_checkpoint_directory` checks before ``--force`` replaces a directory.
"""

from __future__ import annotations

import json
import os
from typing import Any

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
        raise CheckpointError(f"{path} is not a jaxkv {kind} checkpoint directory (it does not exist or is a file); "
                              f"{hint}")
    try:
        with open(file) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a jaxkv {kind} checkpoint: {CONFIG_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not readable JSON ({e})") from None
    found = data.get("format") if isinstance(data, dict) else type(data).__name__
    if found != fmt:
        other = (f" (that is a jaxkv {FAMILIES[found]} checkpoint, not a {FAMILIES.get(fmt, kind)} one)"
                 if isinstance(found, str) and found in FAMILIES else "")
        raise CheckpointError(f"{file} is not a jaxkv {kind} config: expected \"format\": {fmt!r}, found "
                              f"{found!r}{other}; {hint}")
    if data.get("format_version") != version:
        raise CheckpointError(f"{file} has format_version {data.get('format_version')!r}; this jaxkv reads version "
                              f"{version}")
    return {k: v for k, v in data.items() if k not in ("format", "format_version")}
