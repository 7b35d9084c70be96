"""``jaxkv generate``'s output directory, written as chunks arrive, and `load_latents` to read it back.

Layout of ``--out``::

    manifest.json              what this run wrote so far (rewritten atomically after every chunk, see below)
    latents/chunk_000000.npy   float32 [batch, chunk_frames, latent_height, latent_width, channels], one per chunk
    latents/...                (``--format safetensors``: chunk_000000.safetensors holding one tensor "latents")
    preview.png                first and last frames through a fixed latent-to-RGB projection (`preview`)
    video.mp4                  the decoded video, grown chunk by chunk (`video`; video_B.mp4 per video, batch > 1)
    contact_sheet.png          with video: decoded frames spread evenly over the stream, bounded (`contact_sheet`)
    frames/                    with ``--frames``: frame_B_NNNNNN.png per frame or chunk_NNNNNN.npy per chunk
    summary.json               settings, timings and how the run ended
    .jaxkv-lock                while the run writes: flock-ed by it, holding its pid (`claim_output_dir`)

``manifest.json`` holds ``"format": "jaxkv-generate"``, ``"format_version"``, ``"status"`` (``running``,
``complete``, ``interrupted`` or ``failed``, with a ``"reason"`` unless complete), ``"chunks"`` (how many chunk
files are complete: chunk files are written under a temporary name and renamed, and the manifest is updated only
after the rename), ``"chunk_shape"``, ``"dtype"``, ``"latents_format"`` and ``"entries"`` (every name this run
created in the directory). A run killed outright (SIGKILL, power loss) leaves ``"status": "running"`` with every
chunk it counts readable.

Each output kind is a *sink* with ``names`` (the directory entries it writes), ``write_chunk(index, latents)`` and
``close() -> dict`` (what it adds to the summary), and optionally ``discard()`` (stop without writing more, when
the directory was lost); `OutputDir` feeds every sink each chunk in order, so another output (e.g. an mp4 of
decoded frames) is one more sink, not a change to the generation loop. Every file is written under a temporary
name and renamed (`jaxkv.files.write_file`); a failed write (a full disk) names the file, and the run is finished
as "failed" with every other sink still closed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import uuid
from typing import Iterator, Protocol

import numpy as np

from jaxkv import files
from jaxkv.generate.options import UsageError

FORMAT = "jaxkv-generate"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUMMARY = "summary.json"
LATENTS_DIR = "latents"
FRAMES_DIR = "frames"  # decoded frames (``--frames``), written by `jaxkv.generate.video.Mp4Sink`


class Sink(Protocol):
    names: tuple[str, ...]

    def write_chunk(self, index: int, latents: np.ndarray) -> None: ...

    def close(self) -> dict: ...


# ------------------------------------------------------------------------------------------------ directory safety


def _read_manifest(path: str) -> dict | None:
    """The manifest of a jaxkv generate output directory, or None if ``path`` holds none (or a foreign one)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def _is_previous_output(path: str) -> bool:
    """True when every entry of directory ``path`` is one a previous `OutputDir` recorded in its manifest (and,
    inside ``latents/`` and ``frames/``, only chunk and frame files): the only kind ``--overwrite`` may replace."""
    manifest = _read_manifest(path)
    if manifest is None:
        return False
    own = set(manifest.get("entries", [])) | {MANIFEST}
    own |= {f"{name}.tmp" for name in own}  # a file being replaced when the run was killed
    own.add(files.LOCK)  # left by a writer that was killed (no process holds it: `prepare_output_dir` checks)
    if not set(os.listdir(path)) <= own:
        return False
    for sub, prefixes in ((LATENTS_DIR, ("chunk_",)), (FRAMES_DIR, ("chunk_", "frame_"))):
        inner = os.path.join(path, sub)
        if os.path.lexists(inner):
            if os.path.islink(inner) or not os.path.isdir(inner):
                return False
            if any(not n.startswith(prefixes) for n in os.listdir(inner)):
                return False
    return True


def prepare_output_dir(path: str, *, overwrite: bool, create: bool, sources=()) -> str:
    """Decides whether ``--out`` may be written (the rules are `jaxkv.files.check_destination`'s, as for
    ``jaxkv convert``); returns the absolute path.

    Accepted: a path that does not exist (its parents are created), or an empty directory. A previous jaxkv
    generate output (see `_is_previous_output`) is accepted only with ``overwrite``, and then replaced whole: the old
    directory is renamed aside and deleted before anything new is written, so old and new files never mix.
    Refused with a UsageError: a directory that a running process is writing (it holds its `jaxkv.files.LOCK`;
    with or without ``overwrite``), a file, a directory of anything else (even with ``overwrite``), the current
    directory or one containing it, a directory equal to / inside / containing one of ``sources`` (the input
    files), a place that is not writable. With ``create=False`` only checks; ``create=True`` also makes the
    directory (a run takes it with `claim_output_dir` instead, which keeps it locked).
    """
    if not create:
        return _check_output_dir(path, overwrite=overwrite, sources=sources)[0]
    lock = claim_output_dir(path, overwrite=overwrite, sources=sources)
    lock.release()
    return lock.path


def _check_output_dir(path: str, *, overwrite: bool, sources) -> tuple[str, bool]:
    """The checks of `prepare_output_dir`; returns (absolute path, whether it is an existing non-empty directory)."""
    path = os.path.abspath(path)
    if os.path.islink(path):
        raise UsageError(
            f"--out {path} is a symbolic link (to {os.path.realpath(path)}); outputs are written only into a "
            f"directory named by its own path: pass the target itself, or another --out"
        )
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"--out {path} exists and is not a directory; choose another --out")
    if os.path.isdir(path):
        writer = files.live_writer(path)
        if writer is not None:
            raise UsageError(
                f"--out {path} is being written by {writer}; wait for it to finish or choose another --out "
                f"(--overwrite never replaces a live output); nothing was touched"
            )
    exists = os.path.isdir(path) and bool(os.listdir(path))
    try:
        # A foreign directory is refused for what it is, with or without --overwrite; only our own previous
        # output asks for --overwrite.
        force = overwrite or not exists or not _is_previous_output(path)
        files.check_destination(
            path,
            sources=sources,
            force=force,
            flag="--overwrite",
            replaceable=lambda p: None if _is_previous_output(p) else "it is not a jaxkv generate output",
        )
    except files.DestinationError as e:
        raise UsageError(f"--out: {e}; nothing was touched") from None
    parent = path if os.path.isdir(path) else os.path.dirname(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"cannot create --out {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write --out {path}: {parent} is not writable")
    return path, exists


def _lock(path: str) -> files.DirectoryLock:
    try:
        return files.DirectoryLock.acquire(path)
    except files.LockedError as e:
        raise UsageError(f"--out {e}; wait for it to finish or choose another --out") from None


def claim_output_dir(path: str, *, overwrite: bool, sources=()) -> files.DirectoryLock:
    """Checks ``--out`` as `prepare_output_dir` does, makes it (replacing a previous output with ``overwrite``) and
    returns the `jaxkv.files.DirectoryLock` that marks it live for as long as the run writes it (``.path`` is the
    absolute path). A previous output is itself locked before it is moved aside, so one being written by another
    run is never replaced (UsageError naming the writer)."""
    path, exists = _check_output_dir(path, overwrite=overwrite, sources=sources)
    if exists:  # a previous output, overwrite checked above
        with _lock(path) as old:
            if not _is_previous_output(path):
                raise UsageError(f"--out {path} changed while it was checked; nothing was touched")
            aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, aside)
            old.path = aside  # its lock file moved with it
            shutil.rmtree(aside)
    os.makedirs(path, exist_ok=True)
    return _lock(path)


# ------------------------------------------------------------------------------------------------ writing


def _write_json(path: str, data: dict) -> None:
    """Writes ``data`` to ``path`` atomically (temporary file + rename): a reader sees the old or the new file; a
    failed write leaves no temporary (`jaxkv.files.write_file`)."""
    files.write_file(path, json.dumps(data, indent=2) + "\n")


def array_bytes(array: np.ndarray, fmt: str) -> bytes:
    """The file content of ``array`` as an ``.npy`` or a ``.safetensors`` (one tensor "latents") file."""
    if fmt == "npy":
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()
    from safetensors.numpy import save

    return save({"latents": array})


class LatentsSink:
    """Output sink for ``latents/chunk_NNNNNN.{npy,safetensors}``: one file per chunk, written as it arrives."""

    def __init__(self, out: str, fmt: str):
        if fmt not in ("npy", "safetensors"):
            raise ValueError(f"latents format must be 'npy' or 'safetensors', got {fmt!r}")
        self.dir, self.format = os.path.join(out, LATENTS_DIR), fmt
        os.makedirs(self.dir, exist_ok=True)

    names = (LATENTS_DIR,)

    def write_chunk(self, index: int, latents: np.ndarray) -> None:
        # serialised first, then written with Python's own file I/O: a full disk or a file-size limit is an
        # OSError with its errno (numpy's writer reports a short write without one)
        data = array_bytes(np.ascontiguousarray(latents), self.format)
        files.write_file(os.path.join(self.dir, chunk_name(index, self.format)), data)

    def close(self) -> dict:
        return {"latents_dir": self.dir}


def chunk_name(index: int, fmt: str) -> str:
    return f"chunk_{index:06d}.{fmt}"


class OutputDir:
    """The output directory of one run: the manifest, the sinks, and the summary.

    ``write_chunk`` hands chunk ``index`` (float32 [batch, chunk_frames, h, w, channels], in order from 0) to every
    sink, then records it in the manifest; ``close(status, summary)`` closes the sinks and writes the final
    manifest and ``summary.json``. With the run's ``lock`` (`claim_output_dir`), every chunk and the close first
    check that ``path`` is still the directory the run made (`jaxkv.files.DirectoryLost` otherwise: nothing is
    written into whatever now stands at ``path``).
    """

    def __init__(
        self,
        path: str,
        sinks: list[Sink],
        *,
        chunk_shape: tuple[int, ...],
        latents_format: str,
        lock: files.DirectoryLock | None = None,
    ):
        self.path, self.sinks, self.lock = path, list(sinks), lock
        self.chunks = 0
        entries = sorted({n for s in self.sinks for n in s.names} | {SUMMARY})
        self.manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "status": "running",
            "chunks": 0,
            "chunk_shape": list(chunk_shape),
            "dtype": "float32",
            "latents_format": latents_format,
            "entries": entries,
        }
        _write_json(os.path.join(path, MANIFEST), self.manifest)

    def write_chunk(self, index: int, latents: np.ndarray) -> None:
        if index != self.chunks:
            raise ValueError(f"chunks must arrive in order: expected chunk {self.chunks}, got {index}")
        if list(latents.shape) != self.manifest["chunk_shape"] or latents.dtype != np.float32:
            raise ValueError(
                f"chunk {index} is {latents.dtype}{list(latents.shape)}, expected float32{self.manifest['chunk_shape']}"
            )
        self.check()
        for sink in self.sinks:
            sink.write_chunk(index, latents)
        self.check()  # the manifest is what counts the chunk: never write it into a replacement
        self.chunks += 1
        self.manifest["chunks"] = self.chunks
        _write_json(os.path.join(self.path, MANIFEST), self.manifest)

    def check(self) -> None:
        """`jaxkv.files.DirectoryLost` when the run's directory was moved, deleted or replaced (with a lock)."""
        if self.lock is not None:
            self.lock.check()

    def release(self) -> None:
        """Ends the run's hold on the directory (removes its lock file): call once nothing more is written."""
        if self.lock is not None:
            self.lock.release()

    def write_summary(self, summary: dict) -> None:
        """Rewrites ``summary.json`` (e.g. with figures known only after `close`)."""
        self.check()
        _write_json(os.path.join(self.path, SUMMARY), summary)

    def close(self, status: str, summary: dict, reason: str | None = None, *, strict: bool = True) -> dict:
        """Closes every sink, writes the summary (with what the sinks report) and the final manifest; returns the
        summary (``summary`` itself, updated).

        Every sink is closed and both files are written even when one of them fails (a full disk, a file-size
        limit): a failing sink turns the status into "failed" with its error as the reason (unless it already was
        "failed"), temporaries left in the directory are removed, and the first error is raised, with ``strict``;
        without it (the caller is already handling an error) the errors are only recorded in the files. When the
        directory was lost (`check`), the sinks are discarded instead (nothing is written into whatever now stands
        at ``path``) and `jaxkv.files.DirectoryLost` is raised with ``strict``."""
        summary.update(status=status, chunks_written=self.chunks, manifest=os.path.join(self.path, MANIFEST))
        if reason:
            summary["reason"] = reason
        if self.lock is not None and self.lock.problem() is not None:
            for sink in self.sinks:
                discard = getattr(sink, "discard", None)
                if discard is not None:
                    discard()
            if strict:
                self.lock.check()
            return summary
        errors: list[BaseException] = []
        for sink in self.sinks:
            try:
                summary.update(sink.close())
            except Exception as e:  # noqa: BLE001 - every sink is closed; the first error is raised below
                errors.append(e)
        if errors and status != "failed":
            status, reason = "failed", describe_error(errors[0])
            summary.update(status=status, reason=reason)
        for name, data in ((SUMMARY, summary), (MANIFEST, self.manifest)):
            if name == MANIFEST:
                data["status"] = status
                if reason:
                    data["reason"] = reason
            try:
                _write_json(os.path.join(self.path, name), data)
            except OSError as e:
                errors.append(e)
        self._remove_temporaries()
        if errors and strict:
            raise errors[0]
        return summary

    def _remove_temporaries(self) -> None:
        """Removes the ``*.tmp`` files a failed write may have left in the directory, ``latents/`` and
        ``frames/``."""
        for folder in (self.path, os.path.join(self.path, LATENTS_DIR), os.path.join(self.path, FRAMES_DIR)):
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                tmp = os.path.join(folder, name)
                if name.endswith(".tmp") and os.path.isfile(tmp) and not os.path.islink(tmp):
                    with contextlib.suppress(OSError):
                        os.remove(tmp)


def describe_error(error: BaseException) -> str:
    """An error as the manifest's and summary's ``"reason"``: a write error's own message (it names the file),
    else the exception's type and message."""
    return str(error) if isinstance(error, files.WriteError) else f"{type(error).__name__}: {error}"


# ------------------------------------------------------------------------------------------------ reading


def latent_chunks(out_dir: str) -> Iterator[np.ndarray]:
    """Yields the chunks the manifest of ``out_dir`` counts, in order: each float32 [batch, chunk_frames, h, w, c].
    Raises ValueError naming the problem for a directory that is not a jaxkv generate output or a missing or
    mis-shaped chunk file."""
    manifest = _read_manifest(out_dir)
    if manifest is None:
        raise ValueError(f'{out_dir} is not a jaxkv generate output ({MANIFEST} with "format": {FORMAT!r} missing)')
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{out_dir}/{MANIFEST} has format_version {manifest.get('format_version')!r}; this jaxkv "
            f"reads version {FORMAT_VERSION}"
        )
    fmt, shape = manifest["latents_format"], list(manifest["chunk_shape"])
    for i in range(manifest["chunks"]):
        path = os.path.join(out_dir, LATENTS_DIR, chunk_name(i, fmt))
        if not os.path.isfile(path):
            raise ValueError(f"{path} is missing: the manifest counts {manifest['chunks']} chunks")
        if fmt == "npy":
            chunk = np.load(path, allow_pickle=False)
        else:
            from safetensors.numpy import load_file

            chunk = load_file(path)["latents"]
        if list(chunk.shape) != shape:
            raise ValueError(f"{path} is {list(chunk.shape)}, the manifest says {shape}")
        yield chunk


def load_latents(out_dir: str) -> np.ndarray:
    """Every chunk of a ``jaxkv generate`` output directory, reassembled: float32 [batch, frames, h, w, channels]
    with frames = chunks * chunk_frames (also for an interrupted or still running one: the chunks written so far)."""
    manifest = _read_manifest(out_dir)
    chunks = list(latent_chunks(out_dir))
    if not chunks:
        b, f, h, w, c = manifest["chunk_shape"]
        return np.zeros((b, 0, h, w, c), np.float32)
    return np.concatenate(chunks, axis=1)
