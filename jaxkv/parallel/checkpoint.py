"""Saving a stream's `jaxkv.session.Session` shard by shard, and loading it onto any mesh shape or one device.

A mesh stream's session (`MeshStream.session`) holds global arrays sharded as `state_shardings` says, its rows in
`session_order`. `save` writes it without gathering: every process writes, from ``addressable_shards``, the shards
it holds (a replicated shard once: only its ``replica_id`` 0 copy) to one safetensors file of its own. The rows are
stored in `jaxkv.rollout`'s session order (`session_order` undone), so a saved mesh session is the same logical
session as a single-device one and loads onto any mesh: `load` builds each array with
``jax.make_array_from_callback``, each device reading only the file slices of its shard (or, without a mesh, the
whole arrays: a plain single-device `Session`).

On disk, a directory (written atomically, `jaxkv.files.atomic_directory`):

  session.json               {"format": "jaxkv-sharded-session", "format_version": 1, "fingerprint", "cache_class",
                             "next_chunk", "has_key", "key_impl", "metadata": as `jaxkv.session.save`;
                             "tensors": {name: {"dtype", "shape" (global), "rows_axis" (the session axis, or null)}};
                             "pieces": [{"tensor", "file", "key", "index": [[start, stop] per axis], "sha256"}]:
                             which index range of which tensor each file entry holds; "manifest_sha256"}
  shards-PPPPP.safetensors   process P's pieces (tensor names as in `jaxkv.session`: "cache/k", "cross/v", ...;
                             a `jaxkv.cache.MixedCache`'s stacks "cache/dense/k", "cache/dilated/k", ...)

The pieces of a tensor cover it exactly once (checked on load). A single-device session directory
(`jaxkv.session.save`) also loads, onto a mesh too: its one file is one piece of every tensor.

Multi-process jobs: every process calls `save` (and `load`) with the same arguments. Each process writes the
pieces it holds to its own ``shards-PPPPP.safetensors`` inside the temporary directory process 0 opened; after a
barrier process 0 writes the manifest from every process's list of pieces (checked to cover every tensor exactly
once) and renames the directory into place, and every process returns once it has (`jaxkv.parallel.processes`:
a failure in any process raises in every process and leaves no directory that looks complete). Arrays that are not
on the mesh (the key, next_chunk, the VAE's extras) must be the same on every process and are written by process 0.
The path must be on a file system every process sees. `load` on a multi-process mesh reads, in each process, only
the pieces that overlap its devices' shards (and the small replicated tensors).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import files
from jaxkv import session as S
from jaxkv import session_format as SF
from jaxkv.cache import MixedCache
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.parallel.mesh import DATA
from jaxkv.parallel.processes import exchange, write_directory
from jaxkv.parallel.rollout import check_mesh, session_order, state_shardings
from jaxkv.parallel.rules import put_global
from jaxkv.rollout import RolloutConfig, RolloutState

FORMAT = "jaxkv-sharded-session"
FORMAT_VERSION = 1
# safetensors' dtype names -> NumPy's (the ones a session holds)
_DTYPES = {"BF16": "bfloat16", "BOOL": "bool"} | {
    f"{k}{bits}": f"{name}{bits}"
    for k, name in (("F", "float"), ("I", "int"), ("U", "uint"))
    for bits in (8, 16, 32, 64)
}


def rows_axis(name: str) -> int | None:
    """The session axis of a session tensor (None: it has none): k, v [layers, sessions, ...] of the cache (of each
    stack of a `jaxkv.cache.MixedCache`: "cache/dense/k", ...; an FP8 cache's k_scale, v_scale [layers, sessions,
    slots, heads] too) and of the cross K/V -> 1; positions
    [sessions, capacity], chunk_start [sessions] -> 0; the key, next_chunk and the VAE's extras -> None."""
    if name.startswith("cross/"):
        return 1
    if name.startswith("cache/"):
        return 1 if name.rsplit("/", 1)[1] in ("k", "v", "k_scale", "v_scale") else 0
    return None


def shard_file(process: int) -> str:
    return f"shards-{process:05d}.safetensors"


def is_sharded_session(path: str) -> bool:
    """True when ``path`` holds a manifest of this format (complete or not: `read_manifest` checks)."""
    try:
        with open(os.path.join(path, SF.MANIFEST)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _dir_problem(path: str) -> str | None:
    """Why ``path`` is not a complete sharded session directory (None: it is one)."""
    shards = (
        [e for e in os.listdir(path) if e.startswith("shards-") and e.endswith(".safetensors")]
        if (os.path.isdir(path))
        else []
    )
    problem = files.directory_problem(
        path, required=(SF.MANIFEST,), optional=shards, formats=(FORMAT,), marker_file=SF.MANIFEST
    )
    if problem is None and not shards:
        problem = f"{path} holds no shards-*.safetensors file"
    return problem


def session_dir_problem(path: str) -> str | None:
    """Why ``path`` is neither a sharded nor a single-device session directory (None: it is one of them); what
    ``--overwrite`` may replace."""
    return _dir_problem(path) if is_sharded_session(path) else SF.dir_problem(path)


def _order(session_rows: int, guided: bool, data: int) -> np.ndarray:
    batch = session_rows // (2 if guided else 1)
    return session_order(batch, data, guided)


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Contiguous runs of the logical row numbers ``rows``: [(offset in rows, first logical row, count)]."""
    out, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            out.append((start, int(rows[start]), i - start))
            start = i
    return out


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    return [[*map(int, s.indices(n)[:2])] for s, n in zip(index, shape)] + [[0, n] for n in shape[len(index) :]]


def _pieces(name: str, x, order: np.ndarray | None) -> list[tuple[list[list[int]], Any]]:
    """This process's pieces of ``x`` (a global array with rows in mesh order, or a host / one-device array):
    [(index range in the logical array, a host-readable block)], each distinct shard once."""
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    axis = rows_axis(name)
    out = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:  # another device (maybe another process) holds the copy that is written
            continue
        bounds = _bounds(shard.index, x.shape)
        data = np.asarray(shard.data)
        if axis is None or order is None:
            out.append((bounds, data))
            continue
        a, b = bounds[axis]
        for offset, first, count in _runs(order[a:b]):
            piece = [list(r) for r in bounds]
            piece[axis] = [first, first + count]
            out.append((piece, np.take(data, np.arange(offset, offset + count), axis=axis)))
    return out


def _process_local(x) -> bool:
    """True for an array of one process alone in a multi-process job (not a global array over the mesh)."""
    return jax.process_count() > 1 and x.is_fully_addressable


def _save_problem(path: str, session, force: bool) -> S.SessionError | None:
    """Why ``session`` cannot be saved to ``path`` (None: it can)."""
    if not isinstance(session, S.Session):
        return S.SessionError(f"save needs a jaxkv.session.Session, got {type(session).__name__}")
    if not session.fingerprint:
        return S.SessionError("the session has no fingerprint; build it with Session.create")
    if session.on_host:
        return S.SessionError("the session's caches are offloaded; reload() them before saving")
    if os.path.lexists(path) and not force:
        return S.SessionError(f"{path} already exists; pass force=True to replace a previous session there")
    return None


def save(
    path: str, session: S.Session, *, mesh: Mesh | None = None, force: bool = False, metadata: dict | None = None
) -> str:
    """Writes ``session`` to the directory ``path`` shard by shard (atomically); returns its absolute path.

    ``mesh``: the mesh the session's rows are ordered for (`MeshStream.session()`: `session_order` over its
    ``data`` axis), None for a session in `jaxkv.rollout`'s order (a single-device one). Nothing is gathered: each
    shard is copied to the host on its own. ``force`` replaces an existing session directory (of either format);
    ``metadata``: JSON-able, as `jaxkv.session.save`. The session stays usable."""
    from safetensors.numpy import save_file

    path = os.path.abspath(path)
    exchange(None, _save_problem(path, session, force), f"saving {path}")  # every process refuses alike, at once
    guided = session.settings["sampler"]["guidance_scale"] is not None
    order = None if mesh is None else _order(session.sessions, guided, mesh.shape[DATA])
    named, impl = SF.session_tensors(session)
    file = shard_file(jax.process_index())
    blocks, pieces, tensors, local = {}, [], {}, {}
    for name, x in named.items():
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        tensors[name] = {"dtype": np.dtype(x.dtype).name, "shape": list(x.shape), "rows_axis": rows_axis(name)}
        if _process_local(x):  # the key, next_chunk, the VAE's extras: the same on every process, process 0 writes
            local[name] = SF.digest(np.asarray(x))
            if jax.process_index() != 0:
                continue
        for n, (index, data) in enumerate(_pieces(name, x, order)):
            key = f"{name}@{n}"
            blocks[key] = np.array(data, order="C")  # (0-d stays 0-d)
            pieces.append({"tensor": name, "file": file, "key": key, "index": index, "sha256": SF.digest(data)})
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": session.settings,
        "cache_class": type(session.cache).__name__,
        "next_chunk": int(session.next_chunk),
        "has_key": session.key is not None,
        "key_impl": impl,
        "tensors": tensors,
        "metadata": SF.json_plain(metadata or {}),
    }

    def write(tmp: str) -> dict:  # every process: its own file
        save_file(blocks, os.path.join(tmp, file), metadata={"format": FORMAT})
        return {"pieces": pieces, "local": local}

    def finish(tmp: str, parts: list[dict]) -> None:  # process 0: the manifest of every process's pieces
        for i, part in enumerate(parts[1:], 1):
            differ = sorted(n for n in local if part["local"].get(n) != local[n])
            if differ:
                raise S.SessionError(
                    f"process {i} holds other values than process 0 for {', '.join(differ)} (arrays that are not "
                    f"on the mesh must be the same on every process; process 0's are saved)"
                )
        whole = json.loads(json.dumps({**manifest, "pieces": [p for part in parts for p in part["pieces"]]}))
        whole[SF.MANIFEST_DIGEST] = SF.manifest_digest(whole)
        _Reader(tmp, whole).check()  # every piece in its file, each tensor covered exactly once: else no rename
        with open(os.path.join(tmp, SF.MANIFEST), "w") as f:
            json.dump(whole, f, indent=2, sort_keys=True)
            f.write("\n")

    return write_directory(path, write=write, finish=finish, replace=session_dir_problem if force else None)


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of a sharded session directory, or of a single-device one (`jaxkv.session.read_manifest`);
    SessionError for anything else, an edited manifest or another format version."""
    if not is_sharded_session(path):
        return SF.read_manifest(path)
    problem = _dir_problem(path)
    if problem is not None:
        raise S.SessionError(f"{path} is not a complete jaxkv sharded session: {problem}")
    with open(os.path.join(path, SF.MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get(SF.MANIFEST_DIGEST) != SF.manifest_digest(manifest):
        raise S.SessionError(
            f"{os.path.join(path, SF.MANIFEST)} was changed after the session was saved (its checksum does not match "
            f"its content); an edited copy is refused"
        )
    if manifest.get("format_version") != FORMAT_VERSION:
        raise S.SessionError(
            f"{os.path.join(path, SF.MANIFEST)} has format_version {manifest.get('format_version')!r}; this jaxkv "
            f"reads version {FORMAT_VERSION}"
        )
    return manifest


class _Reader:
    """Reads index ranges of a saved session's logical tensors from its pieces. A piece is read whole, and its
    checksum verified, the first time a range touches it (so a process reads the pieces that overlap its shards,
    each once, and no others)."""

    def __init__(self, path: str, manifest: dict):
        self.path = path
        if manifest.get("format") == FORMAT:
            self.pieces: dict[str, list[dict]] = {}
            for piece in manifest["pieces"]:
                self.pieces.setdefault(piece["tensor"], []).append(piece)
        else:  # a single-device session: one piece per tensor, the whole of it
            self.pieces = {
                name: [{"file": SF.ARRAYS, "key": name, "index": [[0, n] for n in t["shape"]], "sha256": t["sha256"]}]
                for name, t in manifest["tensors"].items()
            }
        self.tensors = manifest["tensors"]
        self._handles: dict[str, Any] = {}
        self._read: dict[tuple[str, str], np.ndarray] = {}

    def _file(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(os.path.join(self.path, file), framework="numpy")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types for missing / corrupt files
                raise S.SessionError(f"{os.path.join(self.path, file)} is missing or corrupt ({e})") from None
        return self._handles[file]

    def check(self) -> None:
        """SessionError unless every tensor's pieces are in their files with their shapes and dtypes (headers only)
        and cover the tensor exactly once."""
        for name, t in self.tensors.items():
            pieces = self.pieces.get(name, [])
            for piece in pieces:
                shape = [b - a for a, b in piece["index"]]
                f = self._file(piece["file"])
                if piece["key"] not in f.keys():
                    raise S.SessionError(f"{self.path}/{piece['file']} lacks the piece {piece['key']}")
                got = f.get_slice(piece["key"])
                dtype = _DTYPES.get(got.get_dtype(), got.get_dtype())
                if list(got.get_shape()) != shape or dtype != t["dtype"]:
                    raise S.SessionError(
                        f"{self.path}/{piece['file']}: piece {piece['key']} is {dtype}{list(got.get_shape())}, the "
                        f"manifest says {t['dtype']}{shape}"
                    )
            for i, p in enumerate(pieces):  # disjoint, and as many elements as the tensor: an exact cover
                for q in pieces[i + 1 :]:
                    if all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(p["index"], q["index"])):
                        raise S.SessionError(f"{self.path}: pieces {p['key']} and {q['key']} of {name} overlap")
            covered = sum(int(np.prod([b - a for a, b in p["index"]])) for p in pieces)
            if covered != int(np.prod(t["shape"])):
                raise S.SessionError(
                    f"{self.path}: the pieces of {name} hold {covered} of its {int(np.prod(t['shape']))} elements"
                )

    def _piece(self, piece: dict) -> np.ndarray:
        at = (piece["file"], piece["key"])
        if at not in self._read:
            data = self._file(piece["file"]).get_tensor(piece["key"])
            if SF.digest(data) != piece["sha256"]:
                raise S.SessionError(
                    f"{self.path}/{piece['file']}: piece {piece['key']} does not match the checksum saved with it: "
                    f"the file was corrupted or changed after saving"
                )
            self._read[at] = data
        return self._read[at]

    def read(self, name: str, bounds: list[tuple[int, int]]) -> np.ndarray:
        """tensor ``name``[bounds] (one (start, stop) per axis)."""
        t = self.tensors[name]
        out = np.empty([b - a for a, b in bounds], np.dtype(t["dtype"]))
        for piece in self.pieces[name]:
            inter = [(max(a, pa), min(b, pb)) for (a, b), (pa, pb) in zip(bounds, piece["index"])]
            if any(a >= b for a, b in inter):
                continue
            src = tuple(slice(a - pa, b - pa) for (a, b), (pa, _) in zip(inter, piece["index"]))
            dst = tuple(slice(a - ba, b - ba) for (a, b), (ba, _) in zip(inter, bounds))
            out[dst] = self._piece(piece)[src]
        return out

    def read_rows(self, name: str, index: tuple, order: np.ndarray | None) -> np.ndarray:
        """The block at ``index`` (slices, as ``make_array_from_callback`` gives) of tensor ``name`` laid out with
        its rows in ``order`` (row i = logical row order[i]; None: the logical order)."""
        shape = self.tensors[name]["shape"]
        bounds = _bounds(index, tuple(shape))
        axis = self.tensors[name].get("rows_axis")
        if axis is None or order is None:
            return self.read(name, bounds)
        a, b = bounds[axis]
        parts = []
        for _, first, count in _runs(order[a:b]):
            run = [tuple(r) for r in bounds]
            run[axis] = (first, first + count)
            parts.append(self.read(name, run))
        return np.concatenate(parts, axis=axis)


def _shardings_by_name(state, mesh: Mesh) -> dict[str, NamedSharding]:
    """{tensor name: sharding} of a state's row tensors on ``mesh`` (`state_shardings`)."""
    shardings = state_shardings(state, mesh)
    out = SF.cache_tensors(shardings.cache)
    out["cross/k"], out["cross/v"] = shardings.cross.k, shardings.cross.v
    return out


def load(path: str, config: WanConfig, rc: RolloutConfig, *, mesh: Mesh | None = None) -> S.Session:
    """The session saved at ``path`` (sharded, or a single-device `jaxkv.session.save`) after checking it belongs
    to (config, rc) (SessionError naming every difference, before any tensor data is read).

    With ``mesh``: its arrays are global arrays in `state_shardings`, rows in `session_order`, each device's shard
    read alone (`MeshStream.from_session` continues it). Without: a plain single-device `Session` in
    `jaxkv.rollout`'s order (`jaxkv.stream.Stream.from_session`)."""
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT and mesh is None:
        return S.load(path, config, rc)
    tensors = manifest["tensors"]
    mixed = manifest["fingerprint"].get("cache", {}).get("class") == MixedCache.__name__
    rows = "cache/dense/positions" if mixed else "cache/positions"  # as `jaxkv.session.load`
    try:
        sessions = int(tensors[rows]["shape"][0])
    except (KeyError, IndexError, TypeError):
        raise S.SessionError(f"{path}/{SF.MANIFEST} lists no {rows} tensor") from None
    if mesh is not None:  # a batch the data axis does not divide, a model axis the heads do not: ValueError
        check_mesh(mesh, config, rc, sessions // (2 if rc.guidance_scale is not None else 1))
    cache = S.expected_cache(config, rc, sessions)
    S.refuse_other_settings(f"the session at {path}", manifest["fingerprint"], S.fingerprint(config, rc, cache))
    want = SF.cache_tensors(cache)
    for name, like in want.items():
        got = tensors.get(name, {})
        if got.get("shape") != list(like.shape) or got.get("dtype") != np.dtype(like.dtype).name:
            raise S.SessionError(
                f"{path}: tensor {name} is {got.get('dtype')}{got.get('shape')}, the settings need "
                f"{np.dtype(like.dtype).name}{list(like.shape)}"
            )
    cross = (config.num_layers, sessions, None, config.num_heads, config.head_dim)
    for name in ("cross/k", "cross/v"):
        s = tensors.get(name, {}).get("shape") or []
        if len(s) != 5 or any(w is not None and w != g for w, g in zip(cross, s)):
            raise S.SessionError(f"{path}: tensor {name} is {s}, the settings need {list(cross)} (None: any)")
    for name in tensors:  # a single-device file names no rows axis: these are the same
        tensors[name].setdefault("rows_axis", rows_axis(name))
    reader = _Reader(path, manifest)
    reader.check()
    if mesh is None:
        host = {name: reader.read(name, [(0, n) for n in t["shape"]]) for name, t in tensors.items()}
        arrays = {name: jnp.asarray(a) for name, a in host.items()}
    else:
        guided = rc.guidance_scale is not None
        order = _order(sessions, guided, mesh.shape[DATA])
        abstract = RolloutState(
            cache, M.CrossKV(*(jax.ShapeDtypeStruct(tensors[n]["shape"], jnp.float32) for n in ("cross/k", "cross/v")))
        )
        by_name = _shardings_by_name(abstract, mesh)
        replicated = NamedSharding(mesh, P())
        arrays = {}
        for name, t in tensors.items():
            if name in by_name:
                arrays[name] = jax.make_array_from_callback(
                    tuple(t["shape"]), by_name[name], lambda index, name=name: reader.read_rows(name, index, order)
                )
            elif name.startswith("extras/"):  # not on the mesh: the VAE decoder's caches live on one device
                arrays[name] = jnp.asarray(reader.read(name, [(0, n) for n in t["shape"]]))
            else:
                arrays[name] = put_global(reader.read(name, [(0, n) for n in t["shape"]]), replicated)
    nxt = arrays["next_chunk"]
    if nxt.shape != () or nxt.dtype != jnp.int32 or int(nxt) < 0 or int(nxt) != manifest.get("next_chunk"):
        raise S.SessionError(f"{path}: next_chunk {nxt.dtype}{list(nxt.shape)} is not the manifest's non-negative int")
    key = None
    if manifest.get("has_key"):
        key = arrays["key"]
        if manifest.get("key_impl"):
            key = jax.random.wrap_key_data(key, impl=manifest["key_impl"])
    return S.Session(
        SF.cache_from(cache, arrays),
        M.CrossKV(arrays["cross/k"], arrays["cross/v"]),
        key,
        nxt,
        SF.nest_extras({n: a for n, a in arrays.items() if n.startswith("extras/")}),
        json.dumps(manifest["fingerprint"], sort_keys=True),
    )


def to_mesh(session: S.Session, mesh: Mesh) -> S.Session:
    """A session in `jaxkv.rollout`'s order (e.g. a single-device one) laid out on ``mesh`` as `load` with a mesh
    lays it (rows in `session_order`, `state_shardings`); its arrays are read to the host once."""
    guided = session.settings["sampler"]["guidance_scale"] is not None
    order = _order(session.sessions, guided, mesh.shape[DATA])
    by_name = _shardings_by_name(session.state, mesh)

    def put(name, x):
        return put_global(np.take(np.asarray(x), order, axis=rows_axis(name)), by_name[name])

    cache = SF.cache_from(session.cache, {name: put(name, x) for name, x in SF.cache_tensors(session.cache).items()})
    return session.replace(
        cache=cache, cross=M.CrossKV(put("cross/k", session.cross.k), put("cross/v", session.cross.v))
    )
