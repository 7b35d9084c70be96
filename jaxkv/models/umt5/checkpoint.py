"""The jaxkv umT5 text-encoder checkpoint: a directory that `jaxkv.convert.umt5` (or `save`) writes and
`jaxkv.models.umt5.encoder.TextEncoder.load` reads.

Layout::

    DST/
      config.json          UMT5Config.to_dict() plus "format": "jaxkv-umt5", "format_version": 1, "fingerprint"
      params.safetensors   the params of `jaxkv.models.umt5.params`, flattened with '.' ("blocks.attn.q.kernel")
      tokenizer.json and/or spiece.model   the tokenizer, copied beside (see `tokenizer.find_tokenizer`)

``fingerprint`` identifies the weights (`params_fingerprint`: a hash of the params file's header and data, computed
while writing), so an embeddings cache can key on it without re-reading 11 GB. Writes are atomic
(`atomic_directory`): an interrupted write leaves nothing, or the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from typing import Any

import numpy as np

from jaxkv import files
from jaxkv.models.checkpoint_dir import (
    CONFIG_FILE,
    PARAMS_FILE,
    CheckpointError,
    config_text,
    load_params,
    read_marked_config,
)
from jaxkv.models.umt5.config import UMT5Config
from jaxkv.models.umt5.params import flatten, validate_params
from jaxkv.models.umt5.tokenizer import TOKENIZER_FILES

FORMAT = "jaxkv-umt5"
FORMAT_VERSION = 1
_CHUNK = 64 << 20


def combine_fingerprint(header_digest: bytes, data_digest: bytes) -> str:
    """The fingerprint from sha256 digests of the params file's header region (length + JSON) and data region."""
    return hashlib.sha256(FORMAT.encode() + header_digest + data_digest).hexdigest()


def params_fingerprint(file: str) -> str:
    """Fingerprint of a params.safetensors file, read in 64 MiB pieces (writers compute it on the fly)."""
    with open(file, "rb") as f:
        raw_n = f.read(8)
        if len(raw_n) < 8:
            raise CheckpointError(f"{file} is truncated: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw_n)
        header = raw_n + f.read(n)
        data = hashlib.sha256()
        while piece := f.read(_CHUNK):
            data.update(piece)
    return combine_fingerprint(hashlib.sha256(header).digest(), data.digest())


def config_json(config: UMT5Config, fingerprint: str, **extra) -> str:
    """The text of ``config.json``; ``extra`` records provenance (e.g. "source")."""
    return config_text(FORMAT, FORMAT_VERSION, {"fingerprint": fingerprint, **extra, **config.to_dict()})


def read_config(path: str) -> tuple[UMT5Config, dict[str, Any]]:
    """(UMT5Config, the other entries of config.json) of the checkpoint directory ``path``; CheckpointError for a
    missing directory, a missing or foreign config.json (a Wan DiT checkpoint included)."""
    data = read_marked_config(
        path,
        fmt=FORMAT,
        version=FORMAT_VERSION,
        kind="umT5",
        hint="a PyTorch / Hugging Face text encoder must first be converted (`jaxkv convert`)",
    )
    fields = {f: data[f] for f in UMT5Config.__dataclass_fields__ if f in data}
    meta = {k: v for k, v in data.items() if k not in fields}
    try:
        return UMT5Config.from_dict(fields), meta
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)} does not hold a valid UMT5Config: {e}") from None


def atomic_directory(path: str, *, force: bool = False, log=None):
    """`jaxkv.files.atomic_directory` for this format: with ``force`` an existing ``path`` is replaced only if it is
    a jaxkv text-encoder checkpoint directory (its tokenizer files included)."""
    return files.atomic_checkpoint_directory(path, force=force, formats=(FORMAT,), optional=TOKENIZER_FILES, log=log)


def save(
    path: str,
    config: UMT5Config,
    params: dict[str, Any],
    *,
    tokenizer_files: dict[str, str | bytes] = (),
    force: bool = False,
) -> str:
    """Writes ``params`` (any float dtype) and ``config`` to the directory ``path`` atomically, with
    ``tokenizer_files`` beside ({file name: bytes to write, or a str path to copy}). Returns the fingerprint.
    Validates the params first: nothing is written on error. (Holds the params in memory; the converter streams.)"""
    from safetensors.numpy import save_file

    validate_params(params, config)
    tokenizer_files = dict(tokenizer_files)
    flat = {k: np.ascontiguousarray(np.asarray(v)) for k, v in flatten(params).items()}
    with atomic_directory(path, force=force) as tmp:
        file = os.path.join(tmp, PARAMS_FILE)
        save_file(flat, file, metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
        fingerprint = params_fingerprint(file)
        for name, content in tokenizer_files.items():
            target = os.path.join(tmp, os.path.basename(name))
            if isinstance(content, bytes):
                with open(target, "wb") as f:
                    f.write(content)
            else:
                shutil.copyfile(content, target)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(config_json(config, fingerprint))
    return fingerprint


def load(path: str, dtype=None) -> tuple[UMT5Config, dict[str, Any], dict[str, Any]]:
    """Reads a checkpoint directory -> (UMT5Config, params as jax arrays, config.json's other entries).

    ``dtype`` casts every parameter (e.g. ``jnp.float32``), one tensor at a time; None keeps the stored dtype.
    CheckpointError names the
    problem for a missing/foreign directory, a truncated or corrupt params file, and params that do not match.
    """
    config, meta = read_config(path)
    return config, load_params(path, lambda tree: validate_params(tree, config), dtype), meta
