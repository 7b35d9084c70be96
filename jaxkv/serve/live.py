"""One client's WebSocket (`Client`) and the live stream it drives (`LiveSession`): the message loop, the answers
to each request, and the flow control that keeps a slow or vanished client from growing memory.

A stream generates a chunk only while fewer than ``ahead_chunks`` of its chunks are unacknowledged (the page
acknowledges a chunk once it has shown its last frame, so a stream runs at the page's playback rate, at most
``ahead_chunks`` ahead); each client's outgoing messages wait in a queue of ``ahead_chunks + CONTROL_SLOTS`` entries,
and the server stops reading a client's messages while that queue is full. A client that disconnects (or a server
that stops) has its session saved as ``ID-autosave`` when it generated anything since its last save.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time

from starlette.websockets import WebSocket

from jaxkv.continuation import ContinuationError
from jaxkv.serve import protocol
from jaxkv.serve.hub import Hub, encode_jpeg
from jaxkv.serve.protocol import ProtocolError

CONTROL_SLOTS = 16  # outgoing non-chunk messages a client may have waiting
log = logging.getLogger("jaxkv.serve")


class LiveSession:
    """One live stream: generates chunks on the hub's worker while its client's acknowledgements allow, and queues
    each chunk (a JSON header, then one JPEG binary message per frame) on the client's outbox."""

    def __init__(self, hub: Hub, client: "Client", stream, session_id: str, resumed: str | None):
        self.hub, self.client, self.stream, self.id, self.resumed = hub, client, stream, session_id, resumed
        self.paused = False
        self.closing = False
        self.sent = self.acked = stream.chunk_index  # chunk indices: next to queue / next to be acknowledged
        self.generated_since_save = 0
        self.frames_sent = 0
        self.step_s: float | None = None  # latest chunk's step + encode time
        self.started_at = time.perf_counter()
        self.wake = asyncio.Event()
        self._step_future: asyncio.Future | None = None
        self.ended: str | None = None
        self.task = asyncio.create_task(self._produce(), name=f"jaxkv-serve-{session_id}")

    @property
    def waiting(self) -> bool:
        """True while the stream waits for its client (ahead_chunks unacknowledged)."""
        return self.sent - self.acked >= self.hub.config.ahead_chunks

    def status(self) -> dict:
        s = self.stream
        elapsed = time.perf_counter() - self.started_at
        return {
            "session": self.id,
            "chunk": s.chunk_index,
            "prompt": s.prompt,
            "seed": s.seed,
            "switches": [list(x) for x in s.switches],
            "paused": self.paused,
            "waiting_for_client": self.waiting,
            "unacknowledged": self.sent - self.acked,
            "queued": self.client.outbox.qsize(),
            "frames_sent": self.frames_sent,
            "sent_fps": self.frames_sent / elapsed if elapsed > 0 else None,
            "step_ms": None if self.step_s is None else round(self.step_s * 1e3, 1),
            "remaining": s.remaining,
            "resumed_from": self.resumed,
            "ended": self.ended,
        }

    def _step(self):
        """On the worker: the next chunk, encoded. (index, prompt, [jpeg bytes], seconds)."""
        start = time.perf_counter()
        index, prompt = self.stream.chunk_index, self.stream.prompt
        frames = self.stream.step()
        jpegs = [encode_jpeg(f, self.hub.config.jpeg_quality) for f in frames]
        return index, prompt, jpegs, time.perf_counter() - start

    async def _produce(self) -> None:
        try:
            while not self.closing:
                while (self.paused or self.waiting) and not self.closing:
                    self.wake.clear()
                    await self.wake.wait()
                if self.closing:
                    return
                if self.stream.remaining == 0:
                    self.ended = "num_chunks"
                    await self.client.put({"type": "ended", "reason": "num_chunks", "chunk": self.stream.chunk_index})
                    return
                self._step_future = asyncio.ensure_future(self.hub.run(self._step))
                try:
                    index, prompt, jpegs, seconds = await self._step_future
                finally:
                    self._step_future = None
                self.generated_since_save += 1
                self.step_s = seconds
                if self.closing:
                    return
                header = {
                    "type": "chunk",
                    "chunk": index,
                    "frames": len(jpegs),
                    "prompt": prompt,
                    "step_ms": round(seconds * 1e3, 1),
                    "remaining": self.stream.remaining,
                }
                self.sent = index + 1
                self.frames_sent += len(jpegs)
                await self.client.put(("chunk", header, jpegs))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed chunk ends this stream, not the server
            log.exception("session %s: generation failed", self.id)
            self.ended = "failed"
            await self.client.put(
                {"type": "error", "code": "generation_failed", "message": f"{type(e).__name__}: {e}", "request": None}
            )

    def ack(self, chunk: int) -> None:
        if chunk >= self.sent:
            raise ProtocolError(
                "bad_field", f"ack: chunk {chunk} was not sent (the last sent is {self.sent - 1})", "ack"
            )
        self.acked = max(self.acked, chunk + 1)
        self.wake.set()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.wake.set()

    async def save(self, name: str, *, overwrite: bool = False) -> tuple[str, int]:
        """Saves the stream under ``sessions_dir/name`` on the worker, between two chunks: (path, the index of the
        chunk the saved session continues with)."""
        os.makedirs(self.hub.config.sessions_dir, exist_ok=True)

        def save():
            return self.stream.save(self.hub.path_of(name), overwrite=overwrite), self.stream.chunk_index

        path, chunk = await self.hub.run(save)
        self.generated_since_save = 0
        return path, chunk

    async def end(self, *, autosave: bool) -> str | None:
        """Stops the stream (waiting for a chunk being generated), saves it as ``ID-autosave`` when asked and it
        generated anything since its last save, and removes it from the hub. Returns the autosave's path."""
        if self.closing:
            return None
        self.closing = True
        self.wake.set()
        if self._step_future is not None:
            await asyncio.wait([self._step_future])
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        path = None
        if autosave and self.generated_since_save and self.ended != "failed":
            try:
                path, _ = await self.save(f"{self.id}-autosave", overwrite=True)
                log.info("session %s saved to %s", self.id, path)
            except Exception:  # a failed autosave is logged; the shutdown goes on
                log.exception("session %s: autosave failed", self.id)
        self.hub.sessions.pop(self.id, None)
        return path


class Client:
    """One WebSocket: reads messages, answers them, and sends the queued messages in order."""

    def __init__(self, hub: Hub, ws: WebSocket):
        self.hub, self.ws = hub, ws
        self.outbox: asyncio.Queue = asyncio.Queue(maxsize=hub.config.ahead_chunks + CONTROL_SLOTS)
        self.live: LiveSession | None = None

    async def put(self, item) -> None:
        await self.outbox.put(item)

    async def _send_loop(self) -> None:
        while True:
            item = await self.outbox.get()
            if isinstance(item, tuple):
                _, header, jpegs = item
                await self.ws.send_text(json.dumps(header))
                for jpeg in jpegs:
                    await self.ws.send_bytes(jpeg)
            else:
                await self.ws.send_text(json.dumps(item))

    async def run(self) -> None:
        sender = asyncio.create_task(self._send_loop())
        try:
            await self.put(
                {
                    "type": "hello",
                    "protocol": protocol.VERSION,
                    **self.hub.describe(),
                    "limits": {
                        "max_sessions": self.hub.config.max_sessions,
                        "max_prompt_chars": self.hub.config.max_prompt_chars,
                        "max_message_bytes": self.hub.config.max_message_bytes,
                        "ahead_chunks": self.hub.config.ahead_chunks,
                    },
                    "saved": self.hub.saved(),
                }
            )
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                request = None
                try:
                    parsed = protocol.parse(
                        message.get("text"),
                        max_bytes=self.hub.config.max_message_bytes,
                        max_prompt_chars=self.hub.config.max_prompt_chars,
                    )
                    request = parsed["type"]
                    reply = await self.handle(parsed)
                except ProtocolError as e:
                    reply = e.reply()
                except Exception as e:  # one failed request must not end the connection
                    log.exception("request %s failed", request)
                    reply = {"type": "error", "code": "internal", "message": f"{type(e).__name__}: {e}"}
                    reply["request"] = request
                if reply is not None:
                    await self.put(reply)
        finally:
            if self.live is not None:
                await self.live.end(autosave=True)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    def _need_live(self, kind: str) -> LiveSession:
        if self.live is None or self.live.closing:
            raise ProtocolError("no_session", f"{kind}: no stream is running; send start first", kind)
        return self.live

    async def handle(self, m: dict) -> dict | None:
        kind = m["type"]
        if kind == "start":
            return await self._start(m)
        if kind == "status":
            if self.live is None:
                return {"type": "status", "session": None, "live": len(self.hub.sessions)}
            return {"type": "status", **self.live.status()}
        live = self._need_live(kind)
        if kind == "ack":
            live.ack(m["chunk"])
            return None
        if kind in ("pause", "play"):
            live.set_paused(kind == "pause")
            return {"type": "paused" if kind == "pause" else "playing", "chunk": live.stream.chunk_index}
        if kind == "prompt":
            try:
                applied = await self.hub.run(live.stream.switch_prompt, m["prompt"])
            except ValueError as e:
                raise ProtocolError("bad_prompt", str(e), kind) from None
            log.info("session %s: prompt switched at chunk %d", live.id, applied)
            return {"type": "switched", "prompt": m["prompt"], "chunk": applied}
        if kind in ("save", "fork"):
            default = f"{live.id}-{'fork-' if kind == 'fork' else ''}{live.stream.chunk_index:06d}"
            name = m["name"] or default
            if os.path.lexists(self.hub.path_of(name)):
                raise ProtocolError("exists", f"{kind}: a session named {name!r} exists already; choose another", kind)
            path, chunk = await live.save(name)
            reply = {"type": "saved" if kind == "save" else "forked", "name": name, "path": path, "chunk": chunk}
            if kind == "fork":
                reply["url"] = f"/?resume={name}"
            return reply
        if kind == "stop":
            self.live = None
            await live.end(autosave=False)
            return {"type": "stopped", "chunk": live.stream.chunk_index}
        raise AssertionError(kind)  # protocol.parse admits only the types above

    async def _start(self, m: dict) -> dict:
        hub = self.hub
        if self.live is not None and not self.live.closing and self.live.ended is None:
            raise ProtocolError("already_started", "start: a stream is running; send stop first", "start")
        if hub.closing:
            raise ProtocolError("shutting_down", "start: the server is shutting down", "start")
        if len(hub.sessions) + hub.reserved >= hub.config.max_sessions:
            raise ProtocolError(
                "too_many_sessions",
                f"start: this server runs at most {hub.config.max_sessions} streams at once and all are taken; "
                f"try again later",
                "start",
            )
        if self.live is not None:  # a stream that ended (num_chunks, failure): replaced
            await self.live.end(autosave=True)
            self.live = None
        hub.reserved += 1
        try:
            if m["resume"] is not None:
                path = hub.path_of(m["resume"])
                if not os.path.isdir(path):
                    raise ProtocolError("not_found", f"start: no saved session named {m['resume']!r}", "start")
                try:
                    stream = await hub.run(lambda: hub.pipeline.resume(path, num_chunks=m["num_chunks"]))
                except ValueError as e:  # SessionError included
                    raise ProtocolError("resume_failed", f"start: {e}", "start") from None
            else:
                given = {}
                for kind in ("image", "video"):
                    if m[kind] is not None:
                        if m[kind] not in hub.uploads:
                            raise ProtocolError(
                                "not_found", f"start: no upload named {m[kind]!r} (POST /api/uploads first)", "start"
                            )
                        given[kind] = hub.uploads[m[kind]]
                try:
                    stream = await hub.run(
                        lambda: hub.pipeline.start(
                            m["prompt"], seed=m["seed"] or 0, num_chunks=m["num_chunks"], **given
                        )
                    )
                except ContinuationError as e:
                    shown = str(e).replace(hub.uploads_dir + os.sep, "")  # the upload's name, not the server's path
                    raise ProtocolError("bad_frames", f"start: {shown}", "start") from None
                except ValueError as e:
                    raise ProtocolError("bad_prompt", f"start: {e}", "start") from None
            session_id = "s" + secrets.token_hex(4)
            live = LiveSession(hub, self, stream, session_id, m["resume"])
            hub.sessions[session_id] = live
            self.live = live
        finally:
            hub.reserved -= 1
        log.info("session %s started (%s)", session_id, f"resumed {m['resume']}" if m["resume"] else "new")
        given = None if stream.given is None else {k: v for k, v in stream.given.items() if k != "path"}
        return {
            "type": "started",
            "given": given,
            "frames_per_chunk": stream.frames_per_chunk,
            "fps": stream.fps,
            "frame_shape": list(stream.frame_shape),
            **live.status(),
        }
