"""`Session`: everything a stream needs to continue, as one pytree; saved to disk, resumed, forked, offloaded.

A session is the state of a `jaxkv.stream.Stream` (or of the scan `rollout`) between two chunks; a stream carries
exactly one (``stream.carry``, its latent history as ``extras["latent_ring"]``), replaced after each chunk:

  cache:       the stacked self-attention cache of every layer, any policy (`RingCache`, `RollingCache`,
               `jaxkv.cache.dilated.DilatedCache`): k, v [layers, sessions, capacity, heads, head_dim] in the cache
               dtype; positions int32 [sessions, capacity] (the chunk clock: the absolute position of every slot,
               -1 when empty); chunk_start int32 [sessions] (the last reserved chunk's first position). A
               `jaxkv.cache.MixedCache` (dense layers plus every k-th layer dilated) is two such stacks.
               ``sessions`` = batch, or 2 * batch with guidance (conditional rows first).
  cross:       the hoisted cross-attention K/V (`jaxkv.models.wan.CrossKV`): k, v float32
               [layers, sessions, text_tokens, heads, head_dim]. The text context itself is not needed to continue.
  key:         the noise key (a typed PRNG key [], or a raw uint32 key), or None for a stream fed explicit noise.
               Chunk n's noise is ``jax.random.normal(fold_in(key, n), ...)`` (`jaxkv.rollout.chunk_noise`).
  next_chunk:  int32 []: the index of the next chunk (its noise index, and the chunks generated so far).
  extras:      {name: nested dict of arrays}: optional parts that continue with the stream, e.g.
               ``extras["vae_decoder"]`` (`VAE_DECODER`: the VAE decoder's streaming feature caches, see
               `vae_extra`); part of the pytree, saved and offloaded with the rest.
  fingerprint: (static) JSON text of the settings the state is only valid under: the model config, the sampler
               (every `RolloutConfig` field) and the cache (class, spec, dtype, layers, heads, head_dim).

On disk (`save` / `load`) a session is a directory of two files, written atomically; `jaxkv.session_format` holds
the format (file names, tensor naming, checksums, the manifest) and says why it is safetensors + JSON.

`load` refuses a snapshot whose model config, cache class / spec / dtype, policy or sampler settings differ from
the ones asked for, naming every differing field; a resumed stream then produces chunks bit-identical to an
uninterrupted one (same compiled step, same noise index, same state bits).

`Session.fork` copies every buffer, so two continuations of one history can diverge: a stream donates its state
to each step (the buffers are reused in place), and a fork's buffers are its own.

`offload` / `reload` move the caches (cache, cross, extras) to host memory and back: to the device's
``pinned_host`` memory kind where the backend has one, else to NumPy arrays; bit-identical both ways. An offload
that fails raises `OffloadError` and leaves the device copy as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv import files
from jaxkv.cache import CACHE_CLASSES, ChunkCache, Fp8Cache, MixedCache, RingCache, RollingCache
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.rollout import RolloutConfig, RolloutState, check_position_room, empty_cache, jit_rollout
from jaxkv.session_format import _CACHE_FIELDS as _CACHE_FIELDS  # re-exported: read as jaxkv.session._CACHE_FIELDS
from jaxkv.session_format import (
    ARRAYS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_DIGEST,
    SessionError,
    _empty_like,
    _flat_extras,
    _stacks,
    cache_from,
    cache_tensors,
    digest,
    dir_problem,
    json_plain,
    manifest_digest,
    nest_extras,
    read_manifest,
    session_tensors,
)
from jaxkv.session_format import _is_typed_key as _is_typed_key  # re-exported: read as jaxkv.session._is_typed_key
from jaxkv.session_format import read_metadata as read_metadata  # re-exported: read as jaxkv.session.read_metadata
from jaxkv.validate import check_int, is_concrete

VAE_DECODER = "vae_decoder"  # the extras entry of the VAE decoder's feature caches (`vae_extra`)


class OffloadError(RuntimeError):
    """Moving a session's caches between device and host failed; the source copy is untouched."""


# ------------------------------------------------------------------------------------------------ fingerprint


def cache_settings(cache) -> dict[str, Any]:
    """The static description of a stacked cache (concrete or abstract): class, spec, dtype and geometry; for a
    `MixedCache` also its dense stack's class ("dense_class": ring or rolling) and ``layers`` counts all layers."""
    if type(cache).__name__ not in CACHE_CLASSES or not isinstance(cache, tuple(CACHE_CLASSES.values())):
        raise SessionError(f"a session holds one of {sorted(CACHE_CLASSES)}, got {type(cache).__name__}")
    for part in _stacks(cache).values():
        if getattr(part, "is_per_layer", False) or part.k.ndim != 5:
            raise SessionError(
                f"a session holds a stacked cache k [layers, sessions, capacity, heads, head_dim], got k "
                f"{list(part.k.shape) if hasattr(part.k, 'shape') else 'per layer'}"
            )
    k = cache.dense.k if isinstance(cache, MixedCache) else cache.k
    out = {
        "class": type(cache).__name__,
        "spec_class": type(cache.spec).__name__,
        "spec": json_plain(dataclasses.asdict(cache.spec)),
        "dtype": jnp.dtype(k.dtype).name,
        "layers": int(cache.layers),
        "heads": int(k.shape[-2]),
        "head_dim": int(k.shape[-1]),
    }
    if isinstance(cache, MixedCache):
        out["dense_class"] = type(cache.dense).__name__
    return out


def fingerprint(config: WanConfig, rc: RolloutConfig, cache) -> dict[str, Any]:
    """{"model": WanConfig fields, "sampler": every RolloutConfig field but ``remat``, "cache": `cache_settings`}.
    (``remat`` only changes how a gradient is computed, not what a stream holds or draws, so sessions saved before
    it existed, or under the other value, continue.)"""
    sampler = dataclasses.asdict(rc)
    sampler.pop("remat")
    return {"model": json_plain(config.to_dict()), "sampler": json_plain(sampler), "cache": cache_settings(cache)}


def expected_cache(config: WanConfig, rc: RolloutConfig, sessions: int):
    """The abstract cache a stream with these settings holds (what `jaxkv.rollout.init_state` builds)."""
    return jax.eval_shape(lambda: empty_cache(config, rc, sessions))


def differences(saved: Any, now: Any, prefix: str = "") -> list[str]:
    """Every leaf where two fingerprints differ, as "path: saved X, now Y" lines."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for k in sorted(set(saved) | set(now)):
            name = f"{prefix}.{k}" if prefix else str(k)
            if k not in saved:
                out.append(f"{name}: absent in the snapshot, now {now[k]!r}")
            elif k not in now:
                out.append(f"{name}: saved {saved[k]!r}, absent now")
            else:
                out.extend(differences(saved[k], now[k], name))
        return out
    return [] if saved == now else [f"{prefix}: saved {saved!r}, now {now!r}"]


_WHAT = {"model": "model config", "sampler": "sampler settings (RolloutConfig)", "cache": "cache"}


def refuse_other_settings(where: str, saved: dict, now: dict) -> None:
    """SessionError naming every field in which the fingerprints ``saved`` and ``now`` (`fingerprint`) differ, and
    what it belongs to (model config, sampler settings, cache); nothing when they are equal. ``where`` names the
    session in the message."""
    diff = differences(saved, now)
    if diff:
        parts = sorted({_WHAT.get(d.split(".", 1)[0].split(":", 1)[0], d.split(".", 1)[0]) for d in diff})
        raise SessionError(f"{where} was made under a different {' and '.join(parts)}: " + "; ".join(diff))


# ------------------------------------------------------------------------------------------------ the pytree


@struct.dataclass
class Session:
    """One stream's resumable state (fields: see the module docstring). A pytree: jit, tree_map and device_put
    apply to its arrays; ``fingerprint`` is static."""

    cache: ChunkCache
    cross: M.CrossKV
    key: Any
    next_chunk: jax.Array
    extras: dict = struct.field(default_factory=dict)
    fingerprint: str = struct.field(pytree_node=False, default="")

    @classmethod
    def create(
        cls, config: WanConfig, rc: RolloutConfig, state: RolloutState, *, key, next_chunk, extras: dict | None = None
    ) -> "Session":
        """A session of ``state`` (`jaxkv.rollout.RolloutState`) before chunk ``next_chunk`` (int >= 0 or int32 [])
        of a stream whose noise comes from ``key`` (None: explicit noise). The arrays are used as they are (not
        copied): `fork` for an independent copy."""
        if not isinstance(state, RolloutState):
            raise SessionError(f"state must be a jaxkv.rollout.RolloutState, got {type(state).__name__}")
        nxt = jnp.asarray(next_chunk)
        if nxt.shape != () or not jnp.issubdtype(nxt.dtype, jnp.integer):
            raise SessionError(f"next_chunk must be an int or an int scalar, got {nxt.dtype}{list(nxt.shape)}")
        if is_concrete(nxt) and int(nxt) < 0:
            raise SessionError(f"next_chunk must be >= 0, got {int(nxt)}")
        extras = dict(extras or {})
        _flat_extras(extras)  # checks the names
        text = json.dumps(fingerprint(config, rc, state.cache), sort_keys=True)
        return cls(state.cache, state.cross, key, nxt.astype(jnp.int32), extras, text)

    @property
    def settings(self) -> dict[str, Any]:
        """The fingerprint as a dict."""
        return json.loads(self.fingerprint)

    @property
    def state(self) -> RolloutState:
        """The `jaxkv.rollout.RolloutState` (cache, cross) that `generate_chunk` / `rollout(state=...)` continue."""
        return RolloutState(self.cache, self.cross)

    @property
    def sessions(self) -> int:
        """Cache rows: batch, or 2 * batch with guidance."""
        return int(self.cache.batch)

    def check(self, config: WanConfig, rc: RolloutConfig, *, cache_like=None, where: str = "the session") -> None:
        """SessionError naming every difference between this session's settings and (config, rc, cache): the
        cache is ``cache_like`` (a cache or an abstract one), else the one ``rc`` builds for a ring / rolling
        session, else the session's own (a custom cache such as a DilatedCache)."""
        if cache_like is None:
            # A policy cache is what rc builds; any other (e.g. a DilatedCache) is checked against its own class,
            # spec and dtype as recorded.
            # (rc builds the cache when it has dilated layers, or for a ring / rolling cache)
            builds = rc.dilated_every or type(self.cache) in (RingCache, RollingCache, Fp8Cache)
            cache_like = expected_cache(config, rc, self.sessions) if builds else self.cache
        refuse_other_settings(where, self.settings, fingerprint(config, rc, cache_like))

    def fork(self) -> "Session":
        """An independent copy: every array in a new buffer (a stream that donates one fork's buffers leaves the
        others valid)."""
        return jax.tree.map(lambda x: jnp.array(x, copy=True), self)

    @property
    def on_host(self) -> bool:
        """True when the caches were moved off the device by `offload`."""
        return _offloaded(jax.tree.leaves((self.cache, self.cross, self.extras)))


# ------------------------------------------------------------------------------------------------ VAE extra


def vae_extra(state) -> dict:
    """`jaxkv.models.wan_vae.decoder.DecoderState` -> the ``extras[VAE_DECODER]`` entry {"caches": {...},
    "first": bool []}."""
    return {"caches": dict(state.caches), "first": state.first}


def vae_state(extra: dict):
    """The ``extras[VAE_DECODER]`` entry -> a `DecoderState` for `decode_chunk`."""
    from jaxkv.models.wan_vae.decoder import DecoderState

    return DecoderState(dict(extra["caches"]), extra["first"])


# ------------------------------------------------------------------------------------------------ save / load


def save(path: str, session: Session, *, force: bool = False, metadata: dict | None = None) -> str:
    """Writes ``session`` to the directory ``path`` (atomically: complete or absent); returns its absolute path.

    ``metadata``: JSON-able dict stored in the manifest (`read_metadata`), e.g. the settings of the command that
    made it. An existing ``path`` is refused unless ``force``, and then replaced only if it is a session directory.
    The session stays usable (its arrays are read, not donated)."""
    from safetensors.numpy import save_file

    if not isinstance(session, Session):
        raise SessionError(f"save needs a jaxkv.session.Session, got {type(session).__name__}")
    if not session.fingerprint:
        raise SessionError("the session has no fingerprint; build it with Session.create")
    if session.on_host:
        raise SessionError("the session's caches are offloaded; reload() them before saving")
    named, impl = session_tensors(session)
    meta = json_plain(metadata or {})
    host = {name: np.array(jax.device_get(x), order="C") for name, x in named.items()}  # (0-d stays 0-d)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": session.settings,
        "cache_class": type(session.cache).__name__,
        "next_chunk": int(host["next_chunk"]),
        "has_key": session.key is not None,
        "key_impl": impl,
        "tensors": {n: {"dtype": a.dtype.name, "shape": list(a.shape), "sha256": digest(a)} for n, a in host.items()},
        "metadata": meta,
    }
    manifest = json.loads(json.dumps(manifest))  # as it will read back (tuples become lists)
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    path = os.path.abspath(path)
    if os.path.lexists(path) and not force:
        raise SessionError(f"{path} already exists; pass force=True to replace a previous session there")
    with files.atomic_directory(path, replace=dir_problem if force else None) as tmp:
        save_file(host, os.path.join(tmp, ARRAYS), metadata={"format": FORMAT})
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.write("\n")
    return path


def load(path: str, config: WanConfig, rc: RolloutConfig, *, cache_like=None) -> Session:
    """The session saved at ``path``, on the default device, after checking it belongs to (config, rc).

    Args:
      config, rc: the settings the session will continue under. The snapshot's fingerprint must equal theirs
        (model config, every RolloutConfig field, the cache class / spec / dtype), else SessionError naming every
        differing field, before any tensor data is read.
      cache_like: for a cache ``rc`` does not build (e.g. a `DilatedCache`): a cache of the expected class and
        spec (concrete or `jax.eval_shape`'d); its session count is not compared.
    Raises SessionError for a directory that is not a complete session, mismatched settings, or tensors whose
    names, dtypes or shapes do not match the manifest and the settings.
    """
    from safetensors import safe_open

    manifest = read_manifest(path)
    saved = manifest["fingerprint"]
    tensors = manifest["tensors"]
    rows = "cache/dense/positions" if saved.get("cache", {}).get("class") == MixedCache.__name__ else "cache/positions"
    try:
        sessions = int(tensors[rows]["shape"][0])
    except (KeyError, IndexError, TypeError):
        raise SessionError(f"{path}/{MANIFEST} lists no {rows} tensor") from None
    cache = cache_like if cache_like is not None else expected_cache(config, rc, sessions)
    refuse_other_settings(f"the session at {path}", saved, fingerprint(config, rc, cache))
    expect = cache_tensors(_empty_like(cache, sessions, config))
    arrays: dict[str, np.ndarray] = {}
    file = os.path.join(path, ARRAYS)
    try:
        with safe_open(file, framework="numpy") as f:
            stored = set(f.keys())
            if stored != set(tensors):
                raise SessionError(
                    f"{file} holds tensors {sorted(stored ^ set(tensors))} that the manifest does "
                    f"not list (or lacks ones it does)"
                )
            for name in sorted(stored):
                arrays[name] = f.get_tensor(name)
    except SessionError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for truncated / corrupt files
        raise SessionError(f"{file} is truncated or corrupt ({type(e).__name__}: {e})") from None
    for name, a in arrays.items():
        listed = tensors[name]
        if "sha256" in listed and digest(a) != listed["sha256"]:
            raise SessionError(
                f"{file}: tensor {name} does not match the checksum saved with it: the file was corrupted or "
                f"changed after saving"
            )
        if a.dtype.name != listed["dtype"] or list(a.shape) != listed["shape"]:
            raise SessionError(
                f"{file}: tensor {name} is {a.dtype.name}{list(a.shape)}, the manifest says "
                f"{listed['dtype']}{listed['shape']}"
            )
        if name in expect and (tuple(a.shape) != tuple(expect[name].shape) or a.dtype != expect[name].dtype):
            raise SessionError(
                f"{file}: tensor {name} is {a.dtype.name}{list(a.shape)}, the settings need "
                f"{jnp.dtype(expect[name].dtype).name}{list(expect[name].shape)}"
            )
    cross_shape = (config.num_layers, sessions, None, config.num_heads, config.head_dim)
    for name in ("cross/k", "cross/v"):
        s = arrays[name].shape
        if len(s) != 5 or any(w is not None and w != g for w, g in zip(cross_shape, s)) or s[2] < 1:
            raise SessionError(
                f"{file}: tensor {name} is {list(s)}, the settings need [layers={config.num_layers}, "
                f"sessions={sessions}, text_tokens, heads={config.num_heads}, "
                f"head_dim={config.head_dim}]"
            )
    nxt = arrays["next_chunk"]
    if nxt.shape != () or nxt.dtype != np.int32 or int(nxt) < 0:
        raise SessionError(f"{file}: next_chunk must be a non-negative int32 scalar, got {nxt.dtype}{list(nxt.shape)}")
    if manifest.get("next_chunk") != int(nxt):
        raise SessionError(
            f"{path}/{MANIFEST} says next_chunk {manifest.get('next_chunk')!r} but the saved state is before chunk "
            f"{int(nxt)}; the snapshot is inconsistent"
        )
    dev = {n: jnp.asarray(a) for n, a in arrays.items()}
    missing = sorted(set(expect) - set(dev))
    if missing:
        raise SessionError(f"{file} lacks the cache tensors {missing} that the settings need")
    cache_obj = cache_from(cache, dev)
    reserved = int(jnp.max(cache_obj.next_chunk_index()))
    # (on cache-relative RoPE's wrapped clock the cache's positions no longer count the stream's chunks)
    if rc.bounded and reserved != int(nxt):
        raise SessionError(
            f"{file}: next_chunk is {int(nxt)} but the cache has reserved {reserved} chunks; the "
            f"snapshot is inconsistent"
        )
    key = None
    if manifest.get("has_key"):
        key = dev["key"]
        if manifest.get("key_impl"):
            key = jax.random.wrap_key_data(key, impl=manifest["key_impl"])
    extras = nest_extras({n: a for n, a in dev.items() if n.startswith("extras/")})
    return Session(
        cache_obj,
        M.CrossKV(dev["cross/k"], dev["cross/v"]),
        key,
        dev["next_chunk"],
        extras,
        json.dumps(saved, sort_keys=True),
    )


# ------------------------------------------------------------------------------------------------ continuing


def advance(params, config: WanConfig, rc: RolloutConfig, session: Session, num_chunks: int):
    """``num_chunks`` more chunks of ``session`` with the scan rollout (`jaxkv.rollout.jit_rollout`, one program
    for any offset); returns (latents float32 [batch, num_chunks * chunk_frames, h, w, in_dim], the new session).
    Draws the noise from the session's key as a `Stream` does. The scan and the stream step are two compiled
    programs that may round differently (tested equal to 1e-6 on XLA:CPU), so the bit-identical guarantee of a
    resume is for continuing in the same form (`Stream.from_session` after a `Stream`, `advance` after
    `advance`, tested)."""
    num_chunks = check_int("num_chunks", num_chunks, minimum=1)
    session.check(config, rc)
    if session.key is None:
        raise SessionError(
            "the session has no noise key (it came from explicit noise); use "
            "jaxkv.rollout.rollout(..., noise=..., state=session.state)"
        )
    if session.on_host:
        raise SessionError("the session's caches are offloaded; reload() them first")
    check_position_room(config, rc, num_chunks, session.cache)
    out = jit_rollout(
        params,
        config,
        rc,
        None,
        num_chunks=num_chunks,
        key=session.key,
        state=session.state,
        first_chunk=session.next_chunk,
    )
    new = session.replace(cache=out.state.cache, cross=out.state.cross, next_chunk=session.next_chunk + num_chunks)
    return out.latents, new


# ------------------------------------------------------------------------------------------------ host offload


def host_memory_kind(device=None) -> str | None:
    """ "pinned_host" when ``device`` (default: the first) has that memory kind, else None (offload to NumPy)."""
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - backends without memory kinds
        return None
    return "pinned_host" if "pinned_host" in kinds else None


def _offloaded(leaves) -> bool:
    return bool(leaves) and all(
        isinstance(x, np.ndarray)
        or getattr(getattr(x, "sharding", None), "memory_kind", None) in ("pinned_host", "unpinned_host")
        for x in leaves
    )


def _to_host(x, kind: str | None):
    """One array to host memory, finished (not an in-flight transfer)."""
    if kind is None:
        return np.array(jax.device_get(x), copy=True)
    device = next(iter(x.devices()))
    y = jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
    return jax.block_until_ready(y)


def _to_device(x, device):
    y = jax.device_put(x, jax.sharding.SingleDeviceSharding(device))
    return jax.block_until_ready(y)


def _move(session: Session, move, what: str, delete: bool) -> Session:
    parts = (session.cache, session.cross, session.extras)
    leaves, treedef = jax.tree.flatten(parts)
    moved = []
    try:
        for i, x in enumerate(leaves):
            y = move(x)
            if tuple(y.shape) != tuple(x.shape) or np.dtype(y.dtype) != np.dtype(x.dtype):
                raise OffloadError(
                    f"leaf {i} came back as {y.dtype}{list(y.shape)} instead of {x.dtype}{list(x.shape)}"
                )
            moved.append(y)
    except Exception as e:  # any failure: keep the source, say so
        raise OffloadError(
            f"{what} failed at array {len(moved)} of {len(leaves)} ({type(e).__name__}: {e}); the "
            f"session's arrays are where they were, untouched"
        ) from e
    if delete:  # only now, with every copy complete: free the source buffers
        for x in leaves:
            if isinstance(x, jax.Array):
                x.delete()
    cache, cross, extras = jax.tree.unflatten(treedef, moved)
    return session.replace(cache=cache, cross=cross, extras=extras)


def offload(session: Session, *, memory_kind: str | None | object = "auto", delete: bool = True) -> Session:
    """The session with its caches (cache, cross, extras) in host memory: the device's ``memory_kind``
    ("auto": `host_memory_kind`, "pinned_host" where the backend has it) or, with None, NumPy arrays.

    Every array is copied and the copies completed before anything is released; then, with ``delete``, the
    device buffers are freed (the passed session becomes unusable, as after a donation). Any failure raises
    OffloadError and leaves the passed session intact. The key and next_chunk stay where they are."""
    if not isinstance(session, Session):
        raise SessionError(f"offload needs a jaxkv.session.Session, got {type(session).__name__}")
    if session.on_host:
        raise SessionError("the session is already offloaded")
    kind = host_memory_kind() if memory_kind == "auto" else memory_kind
    if kind not in (None, "pinned_host", "unpinned_host"):
        raise SessionError(
            f"memory_kind must be 'auto', 'pinned_host', 'unpinned_host' or None (NumPy), got {memory_kind!r}"
        )
    return _move(session, lambda x: _to_host(x, kind), "offload", delete)


def reload(session: Session, device=None) -> Session:
    """The offloaded session's caches back on ``device`` (default: the first), bit-identical; the host copies are
    released. OffloadError (host copy kept) on failure."""
    if not session.on_host:
        raise SessionError("the session is not offloaded (its caches are on the device)")
    device = device or jax.devices()[0]
    return _move(session, lambda x: _to_device(x, device), "reload", delete=True)
