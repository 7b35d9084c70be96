"""The layout of a converted Wan release: one directory holding a jaxkv checkpoint per model part.

    DST/
      dit/            the causal Wan DiT (`jaxkv.models.wan.checkpoint`)
      vae/            the Wan VAE (`jaxkv.models.wan_vae.checkpoint`)
      text_encoder/   the umT5 encoder with its tokenizer (`jaxkv.models.umt5.checkpoint`)

`jaxkv convert` writes it from a Wan release (jaxkv/convert/release.py); `jaxkv generate --checkpoint DST` reads it.
Both take the part names from `PARTS`, so they cannot drift apart.
"""

from __future__ import annotations

import os

from jaxkv.models.checkpoint_dir import CONFIG_FILE

PARTS = {"dit": "dit", "vae": "vae", "umt5": "text_encoder"}  # model family -> subdirectory


def release_parts(path: str) -> dict[str, str] | None:
    """{family: subdirectory path} of the parts present when ``path`` is a converted release directory (a directory
    with no config.json of its own that holds ``dit/``), else None. A part may be missing (e.g. a text encoder
    removed to save space); the caller decides whether it needs it. Reads directory entries only."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, CONFIG_FILE)):
        return None
    found = {family: os.path.join(path, sub) for family, sub in PARTS.items() if os.path.isdir(os.path.join(path, sub))}
    return found if "dit" in found else None
