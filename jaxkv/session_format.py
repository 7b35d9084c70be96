"""The on-disk format of a `jaxkv.session.Session`: file names, tensor naming, checksums and the manifest.

`jaxkv.session.save` / `load` write and read it (and `jaxkv.parallel.checkpoint` reuses its naming and checksums
for sharded sessions); this module knows nothing of the `Session` class itself, only the fields it reads.
`SessionError` lives here because the format's checks raise it; `jaxkv.session` re-exports it.

On disk (`save` / `load`) a session is a directory of two files, written atomically (`jaxkv.files.atomic_directory`:
built in a hidden temporary sibling and renamed into place when complete, so a killed save never leaves a
directory that loads):

  session.json        {"format": "jaxkv-session", "format_version": 1, "fingerprint": {...}, "cache_class",
                      "next_chunk", "key_impl" (null: raw or no key), "has_key", "tensors": {name: {dtype,
                      shape, sha256}}, "metadata": {...} (the caller's, e.g. the generate command's settings),
                      "manifest_sha256": the checksum of all the rest}: `load` refuses a tensor whose bytes, or a
                      manifest whose entries, changed after saving
  arrays.safetensors  one tensor per leaf: "cache/k", "cache/v", "cache/positions", "cache/chunk_start"
                      (a MixedCache: "cache/dense/k", ..., "cache/dilated/k", ...; an FP8 cache (`Fp8Cache`):
                      its FP8 k and v as their uint8 bytes, which every safetensors reader opens, and
                      "cache/k_scale", "cache/v_scale"),
                      "cross/k", "cross/v", "key" (the key's uint32 data), "next_chunk", "extras/NAME/SUB/..."

Why safetensors + a JSON manifest rather than orbax-checkpoint: the project already reads and writes safetensors
(checkpoints, latents) and has one atomic-directory writer for every output, so a session adds no dependency and no
second notion of "complete"; the files are plain (any safetensors reader opens them, the manifest is readable
text) and `load` checks the settings from the manifest before reading a byte of tensor data. What orbax would add
(asynchronous and multi-host writes of sharded arrays) a single-process stream does not need: here every array is
fetched to the host whole. A mesh session is saved shard by shard, from every process of a multi-host job, by
`jaxkv.parallel.checkpoint` (the same tensor names and checksums, one file per process and a manifest of pieces).

The helpers both formats share (public, for `jaxkv.session` and `jaxkv.parallel.checkpoint`):
`session_tensors` (a session's arrays by file name), `cache_tensors` / `cache_from` (a cache <-> its arrays by file
name), `nest_extras`, `digest` (an array's sha256), `manifest_digest`, `json_plain` (settings in JSON-normal form)
and `dir_problem` (why a path is not a complete session directory).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import files
from jaxkv.cache import ChunkCache, MixedCache
from jaxkv.cache.fp8 import Fp8Cache
from jaxkv.models.wan.config import WanConfig

FORMAT = "jaxkv-session"
FORMAT_VERSION = 1
MANIFEST = "session.json"
ARRAYS = "arrays.safetensors"
MANIFEST_DIGEST = "manifest_sha256"  # the manifest's own checksum, over every other entry
_CACHE_FIELDS = ("k", "v", "positions", "chunk_start")


class SessionError(ValueError):
    """A session (or a session directory) does not match the settings it is used with, or is not a complete
    jaxkv session."""


def _stacks(cache) -> dict[str, ChunkCache]:
    """The stacked `ChunkCache`s a session's cache is made of, by file-name prefix: {"cache": cache}, or for a
    `MixedCache` {"cache/dense": its dense stack, "cache/dilated": its dilated stack}, or for an `Fp8Cache`
    {"cache": its FP8 ring} (its scales: `cache_tensors`)."""
    if isinstance(cache, MixedCache):
        return {"cache/dense": cache.dense, "cache/dilated": cache.dilated}
    if isinstance(cache, Fp8Cache):
        return {"cache": cache.inner}
    return {"cache": cache}


def _flat_extras(extras: dict, prefix: str = "extras") -> dict[str, Any]:
    """{"extras/a/b": leaf} of nested dicts (keys: non-empty strings without '/')."""
    out = {}
    for name, value in extras.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise SessionError(f"extras keys must be non-empty strings without '/', got {name!r} under {prefix}")
        if isinstance(value, dict):
            out.update(_flat_extras(value, f"{prefix}/{name}"))
        elif value is None:
            continue
        else:
            out[f"{prefix}/{name}"] = value
    return out


def nest_extras(flat: dict[str, Any]) -> dict:
    """The nested extras dict of `session_tensors`' flat "extras/a/b" names (the inverse of its flattening)."""
    root: dict = {}
    for name, value in flat.items():
        parts = name.split("/")[1:]
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return root


def json_plain(value):
    """JSON-normal form (tuples -> lists, dataclasses -> dicts), so saved and fresh settings compare equal."""
    return json.loads(
        json.dumps(value, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o))
    )


def _is_typed_key(key) -> bool:
    return key is not None and jnp.issubdtype(
        jnp.asarray(key).dtype if not hasattr(key, "dtype") else key.dtype, jax.dtypes.prng_key
    )


def session_tensors(session) -> tuple[dict[str, Any], str | None]:
    """A `jaxkv.session.Session`'s leaves by file name (device arrays), and the key's impl name (None for a raw
    key)."""
    out = cache_tensors(session.cache)
    out["cross/k"], out["cross/v"] = session.cross.k, session.cross.v
    impl = None
    if session.key is not None:
        if _is_typed_key(session.key):
            impl = str(jax.random.key_impl(session.key))
            out["key"] = jax.random.key_data(session.key)
        else:
            out["key"] = session.key
    out["next_chunk"] = session.next_chunk
    out.update(_flat_extras(session.extras))
    return out, impl


_FP8_SCALES = ("k_scale", "v_scale")


def _fp8_bytes(x, to):
    """An FP8 array (or abstract one) as its uint8 bytes (``to`` uint8), or back (``to`` float8): the same bits. A
    sharding (`cache_tensors` of a cache's shardings) is the bytes' sharding as it is: the shapes are the same."""
    if isinstance(x, jax.sharding.Sharding):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, to, sharding=x.sharding)
    return jax.lax.bitcast_convert_type(jnp.asarray(x), to)


def cache_tensors(cache) -> dict[str, Any]:
    """The cache's arrays by file name: "cache/k", ... or, for a `MixedCache`, "cache/dense/k", "cache/dilated/k",
    ... (each stack's k, v, positions and chunk_start); for an `Fp8Cache` also its scales, and k, v as uint8."""
    out = {f"{prefix}/{f}": getattr(part, f) for prefix, part in _stacks(cache).items() for f in _CACHE_FIELDS}
    if isinstance(cache, Fp8Cache):
        out.update({f"cache/{f}": _fp8_bytes(out[f"cache/{f}"], jnp.uint8) for f in ("k", "v")})
        out.update({f"cache/{f}": getattr(cache, f) for f in _FP8_SCALES})
    return out


def cache_from(like, arrays: dict[str, Any]):
    """A cache of ``like``'s class and spec (a `MixedCache`: and its dense class) from `cache_tensors` names."""
    if isinstance(like, Fp8Cache):
        fp8 = {f"cache/{f}": _fp8_bytes(arrays[f"cache/{f}"], like.k.dtype) for f in ("k", "v")}
        inner = cache_from(like.inner, {**arrays, **fp8})
        return Fp8Cache(inner, *(arrays[f"cache/{f}"] for f in _FP8_SCALES), like.read_dtype)
    parts = {
        prefix: type(part)(**{f: arrays[f"{prefix}/{f}"] for f in _CACHE_FIELDS}, spec=part.spec)
        for prefix, part in _stacks(like).items()
    }
    if isinstance(like, MixedCache):
        return MixedCache(dense=parts["cache/dense"], dilated=parts["cache/dilated"], spec=like.spec)
    return parts["cache"]


def _empty_like(like, sessions: int, config: WanConfig):
    """The abstract empty cache of ``like``'s class, spec and dtype for ``sessions`` sessions of this model."""
    dtype = like.dtype if isinstance(like, Fp8Cache) else jnp.dtype(next(iter(_stacks(like).values())).k.dtype)
    extra = {"dense_policy": type(like.dense)} if isinstance(like, MixedCache) else {}
    return jax.eval_shape(
        lambda: type(like).init(
            like.spec, sessions, config.num_heads, config.head_dim, dtype=dtype, layers=config.num_layers, **extra
        )
    )


def dir_problem(path: str) -> str | None:
    """Why ``path`` is not a complete single-device session directory (None: it is one); what `save` may replace."""
    return files.directory_problem(path, required=(MANIFEST, ARRAYS), formats=(FORMAT,), marker_file=MANIFEST)


def digest(a: np.ndarray) -> str:
    """sha256 of an array's bytes (C order)."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's entries other than its own checksum (`MANIFEST_DIGEST`), in a canonical JSON form."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the session directory ``path`` (checked: format marker, version, both files present)."""
    problem = dir_problem(path)
    if problem is not None:
        raise SessionError(f"{path} is not a complete jaxkv session: {problem}")
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if MANIFEST_DIGEST in manifest and manifest[MANIFEST_DIGEST] != manifest_digest(manifest):
        raise SessionError(
            f"{os.path.join(path, MANIFEST)} was changed after the session was saved (its checksum does not match "
            f"its content): next_chunk, the seed and the settings are read from it, so an edited copy is refused"
        )
    if manifest.get("format_version") != FORMAT_VERSION:
        raise SessionError(
            f"{os.path.join(path, MANIFEST)} has format_version {manifest.get('format_version')!r}; "
            f"this jaxkv reads version {FORMAT_VERSION}"
        )
    return manifest


def read_metadata(path: str) -> dict[str, Any]:
    """The ``metadata`` a session was saved with."""
    return read_manifest(path).get("metadata", {})
