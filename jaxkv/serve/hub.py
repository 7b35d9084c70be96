"""The server's shared state (`Hub`) and settings (`ServeConfig`): the pipeline, the one worker thread every model
call runs on (`Hub.run`, FIFO, so the model's streams never run concurrently), the live sessions, the uploads and
the saved sessions' directory.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hmac
import io
import os
import secrets
import shutil
import tempfile
import time

from jaxkv.serve import protocol


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The server's settings.

    sessions_dir: where sessions are saved (save, fork, autosave) and resumed from.
    max_sessions: live streams at once, over all clients.
    max_connections: open WebSockets at once (default 4 * max_sessions).
    max_prompt_chars: longest prompt accepted.
    max_message_bytes: largest client message accepted.
    ahead_chunks: chunks a stream may generate past the last one its client acknowledged (>= 1).
    jpeg_quality: quality of the JPEG frames (1..95).
    token: required on every WebSocket and API request when set.
    max_upload_bytes: largest picture or video accepted by ``POST /api/uploads`` (a stream's start frames).
    max_uploads: uploads kept at once (the oldest is dropped past it; default 2 * max_sessions).
    """

    sessions_dir: str
    max_sessions: int = 4
    max_connections: int | None = None
    max_prompt_chars: int = 300
    max_message_bytes: int = 4096
    ahead_chunks: int = 2
    jpeg_quality: int = 90
    token: str | None = None
    max_upload_bytes: int = 32 * 2**20
    max_uploads: int | None = None

    def __post_init__(self):
        if self.max_connections is None:
            object.__setattr__(self, "max_connections", 4 * self.max_sessions)
        if self.max_uploads is None:
            object.__setattr__(self, "max_uploads", 2 * self.max_sessions)
        for name, low in (
            ("max_sessions", 1),
            ("max_prompt_chars", 1),
            ("max_message_bytes", 64),
            ("ahead_chunks", 1),
            ("max_upload_bytes", 1),
            ("max_uploads", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ServeConfig.{name} must be an int >= {low}, got {value!r}")
        if not 1 <= self.jpeg_quality <= 95:
            raise ValueError(f"ServeConfig.jpeg_quality must be in [1, 95], got {self.jpeg_quality!r}")
        if self.token is not None and not self.token:
            raise ValueError("ServeConfig.token must be a non-empty string or None")


def encode_jpeg(frame, quality: int) -> bytes:
    """uint8 [H, W, 3] -> JPEG bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame, "RGB").save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


class Hub:
    """The server's state: the pipeline, the worker thread that runs it, the live sessions and the clients."""

    def __init__(self, pipeline, config: ServeConfig):
        self.pipeline, self.config = pipeline, config
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkv-serve-model")
        self.sessions: dict = {}  # session id -> its `jaxkv.serve.live.LiveSession`
        self.reserved = 0  # starts under way (counted against max_sessions before their stream exists)
        self.connections = 0
        self.started_at = time.time()
        self.closing = False
        # Uploaded start frames (POST /api/uploads): name -> file, in a directory of the server's own that
        # `close` removes; at most config.max_uploads, the oldest dropped first.
        self.uploads_dir = tempfile.mkdtemp(prefix="jaxkv-serve-uploads-")
        self.uploads: collections.OrderedDict[str, str] = collections.OrderedDict()

    def add_upload(self, data: bytes) -> str:
        """Keeps an uploaded file; returns its name (`protocol.UPLOAD`)."""
        name = "u" + secrets.token_hex(8)
        path = os.path.join(self.uploads_dir, name)
        with open(path, "wb") as f:
            f.write(data)
        self.uploads[name] = path
        while len(self.uploads) > self.config.max_uploads:
            _, old = self.uploads.popitem(last=False)
            with contextlib.suppress(OSError):
                os.remove(old)
        return name

    async def run(self, fn, *args):
        """``fn(*args)`` on the model's worker thread (FIFO with every other model call)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def authorized(self, token: str | None) -> bool:
        if self.config.token is None:
            return True
        return token is not None and hmac.compare_digest(token.encode(), self.config.token.encode())

    def path_of(self, name: str) -> str:
        return os.path.join(self.config.sessions_dir, name)

    def saved(self, limit: int = 100) -> list[str]:
        """Names of the saved sessions (newest first, at most ``limit``)."""
        d = self.config.sessions_dir
        if not os.path.isdir(d):
            return []
        names = [
            n
            for n in os.listdir(d)
            if protocol.NAME.fullmatch(n) and os.path.isfile(os.path.join(d, n, "session.json"))
        ]
        names.sort(key=lambda n: os.path.getmtime(os.path.join(d, n)), reverse=True)
        return names[:limit]

    def describe(self) -> dict:
        p = self.pipeline
        return {
            "model": "toy world (shipped)" if p.toy and p.model is None else (p.model or "model"),
            "default_prompt": p.default_prompt,
            "fps": p.fps,
            "frame_shape": list(p.frame_shape),
            "chunk_frames": p.rc.chunk_frames,
            "vocabulary": _vocabulary() if p.toy else None,
        }

    async def close(self) -> None:
        """Ends every live session with an autosave (server shutdown), then stops the worker."""
        self.closing = True
        for live in list(self.sessions.values()):
            await live.end(autosave=True)
        await asyncio.get_running_loop().run_in_executor(None, self.executor.shutdown, True)
        shutil.rmtree(self.uploads_dir, ignore_errors=True)


def _vocabulary() -> list[str]:
    from jaxkv.toyworld import world

    return list(world.VOCABULARY)
