"""The ASGI app of `jaxkv serve` (Starlette): the page, ``GET /health``, ``GET /api/sessions`` and one WebSocket
(``/ws``) per client, each driving at most one live stream of a shared `jaxkv.Pipeline`.

Where the work happens: the event loop only moves messages; every model call (a chunk's step and its JPEG
encoding, a prompt switch, a save, a resume) runs on one worker thread (`Hub.run`), in the order it was asked for,
so the model's streams never run concurrently and the chunks of several clients interleave fairly (each stream asks
for its next chunk only when the last one is out).

Flow control, so that a slow or vanished client never grows memory: a stream generates a chunk only while fewer
than ``ahead_chunks`` of its chunks are unacknowledged (the page acknowledges a chunk once it has shown its last
frame, so a stream runs at the page's playback rate, at most ``ahead_chunks`` ahead); each client's outgoing
messages wait in a queue of ``ahead_chunks + CONTROL_SLOTS`` entries, and the server stops reading a client's
messages while that queue is full. A client that disconnects (or a server that stops: SIGTERM) has its session
saved to ``sessions_dir`` as ``ID-autosave`` when it generated anything since its last save.

Where each part lives: the settings and the shared state with its worker thread in `jaxkv.serve.hub`, a client's
WebSocket and its live stream (the flow control) in `jaxkv.serve.live`, the routes here.

Security: the server binds 127.0.0.1 unless told otherwise (`jaxkv.serve.cli`); with a token every WebSocket,
``/api/sessions`` and ``/api/uploads`` request must carry ``?token=...``; a WebSocket or upload whose Origin is
another site is refused (a page
elsewhere cannot drive a local server); messages, prompts and sessions are bounded (`ServeConfig`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketState

from jaxkv.serve import protocol
from jaxkv.serve.hub import Hub as Hub  # re-exported, as jaxkv.serve.app.X
from jaxkv.serve.hub import ServeConfig as ServeConfig  # re-exported, as jaxkv.serve.app.X
from jaxkv.serve.live import CONTROL_SLOTS as CONTROL_SLOTS  # re-exported, as jaxkv.serve.app.X
from jaxkv.serve.live import Client

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


def _same_origin(headers) -> bool:
    """A browser names the page's origin: it must be this server (a page elsewhere may not drive it). Clients that
    send no Origin (scripts) pass."""
    origin = headers.get("origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == (headers.get("host") or "").lower()


def create_app(pipeline, config: ServeConfig) -> Starlette:
    """The Starlette app serving ``pipeline`` (a `jaxkv.Pipeline`) under ``config``; ``app.state.hub`` is its
    `Hub`."""
    hub = Hub(pipeline, config)

    async def index(request: Request):
        return FileResponse(os.path.join(STATIC, "index.html"), headers={"Cache-Control": "no-cache"})

    async def health(request: Request):
        return JSONResponse(
            {
                "status": "closing" if hub.closing else "ok",
                "protocol": protocol.VERSION,
                "sessions": len(hub.sessions),
                "max_sessions": config.max_sessions,
                "connections": hub.connections,
                "uptime_s": round(time.time() - hub.started_at, 1),
            }
        )

    async def sessions(request: Request):
        if not hub.authorized(request.query_params.get("token")):
            return JSONResponse({"error": "a valid ?token= is required"}, status_code=401)
        return JSONResponse(
            {"live": [s.status() for s in list(hub.sessions.values())], "saved": hub.saved(), **hub.describe()}
        )

    async def upload(request: Request):
        """A picture or video a stream may start from: the body's bytes, kept under a fresh name that ``start``'s
        ``image`` / ``video`` field names. Decoded (and refused if it cannot be) when a stream starts from it."""
        if not hub.authorized(request.query_params.get("token")):
            return JSONResponse({"error": "a valid ?token= is required"}, status_code=401)
        if not _same_origin(request.headers):
            return JSONResponse({"error": "cross-origin upload refused"}, status_code=403)
        if hub.closing:
            return JSONResponse({"error": "the server is shutting down"}, status_code=503)
        limit = config.max_upload_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return JSONResponse({"error": f"the upload has {declared} bytes; this server takes at most {limit}"}, 413)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                return JSONResponse({"error": f"the upload is over {limit} bytes, the most this server takes"}, 413)
        if not body:
            return JSONResponse({"error": "the upload is empty: send the file's bytes as the request body"}, 400)
        name = await asyncio.get_running_loop().run_in_executor(None, hub.add_upload, bytes(body))
        return JSONResponse({"upload": name, "bytes": len(body)})

    async def websocket(ws: WebSocket):
        if not hub.authorized(ws.query_params.get("token")):
            await ws.close(code=1008, reason="a valid ?token= is required")
            return
        if not _same_origin(ws.headers):
            await ws.close(code=1008, reason="cross-origin WebSocket refused")
            return
        if hub.connections >= config.max_connections or hub.closing:
            await ws.accept()
            await ws.send_text(
                json.dumps(
                    {
                        "type": "error",
                        "code": "too_many_connections" if not hub.closing else "shutting_down",
                        "message": f"this server takes at most {config.max_connections} connections; try again later",
                        "request": None,
                    }
                )
            )
            await ws.close(code=1013)
            return
        hub.connections += 1
        try:
            await ws.accept()
            await Client(hub, ws).run()
        finally:
            hub.connections -= 1
            if ws.application_state != WebSocketState.DISCONNECTED:
                with contextlib.suppress(Exception):
                    await ws.close()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await hub.close()

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/health", health),
            Route("/api/sessions", sessions),
            Route("/api/uploads", upload, methods=["POST"]),
            WebSocketRoute("/ws", websocket),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        lifespan=lifespan,
    )
    app.state.hub = hub
    return app
