"""The WebSocket protocol of `jaxkv serve`: what a client may send, checked field by field (docs/server.md lists
every message). Pure: no server, no model, so every check is testable on its own.

A client message is one JSON object (a text frame) with a ``"type"`` and that type's fields (`MESSAGES`: name ->
{field: (kind, required)}). `parse` returns it with defaults filled, or raises `ProtocolError` whose ``code`` and
message the server sends back as ``{"type": "error", "code", "message", "request"}``; the session goes on.
"""

from __future__ import annotations

import json
import re

VERSION = 1
SEED_MAX = 2**63 - 1
NUM_CHUNKS_MAX = 10**9
# A saved session's name: a directory under --sessions-dir (no separators, no leading dot).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# An uploaded file's name, as ``POST /api/uploads`` answers it.
UPLOAD = re.compile(r"u[0-9a-f]{16}")

# Field kinds: "prompt" (a string, at most the server's max_prompt_chars), "seed" (int in [0, 2**63 - 1]),
# "count" (int in [1, 10**9]), "index" (int >= 0), "name" (`NAME`), "upload" (`UPLOAD`).
MESSAGES: dict[str, dict[str, tuple[str, bool]]] = {
    # a new stream (prompt: default the model's; seed default 0; num_chunks default endless), or with "resume" a
    # saved session continued (then prompt and seed are the session's); "image" / "video": an upload
    # (POST /api/uploads) the new stream continues instead of starting from noise
    "start": {
        "prompt": ("prompt", False),
        "seed": ("seed", False),
        "num_chunks": ("count", False),
        "resume": ("name", False),
        "image": ("upload", False),
        "video": ("upload", False),
    },  # fmt: skip
    "prompt": {"prompt": ("prompt", True)},  # switch the prompt from the next chunk on (KV re-cache)
    "pause": {},  # stop generating after the current chunk
    "play": {},  # generate again
    "ack": {"chunk": ("index", True)},  # the client has shown chunk N: the stream may run ahead_chunks past it
    "save": {"name": ("name", False)},  # save the session under --sessions-dir
    "fork": {"name": ("name", False)},  # save a copy to continue elsewhere (?resume=NAME) while this one goes on
    "status": {},  # the session's state
    "stop": {},  # end the stream (no autosave)
}


class ProtocolError(ValueError):
    """A message the server refuses: ``code`` (a short stable name, docs/server.md) and the message."""

    def __init__(self, code: str, message: str, request: str | None = None):
        super().__init__(message)
        self.code, self.request = code, request

    def reply(self) -> dict:
        return {"type": "error", "code": self.code, "message": str(self), "request": self.request}


def _check(kind: str, name: str, value, where: str, max_prompt_chars: int):
    def bad(expected: str):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        return ProtocolError("bad_field", f"{where}: {name} must be {expected}, got {shown}", where)

    if kind == "prompt":
        if not isinstance(value, str):
            raise bad("a string")
        if not value.strip():
            raise bad("a non-empty string")
        if len(value) > max_prompt_chars:
            raise ProtocolError(
                "prompt_too_long",
                f"{where}: the prompt has {len(value)} characters; this server takes at most {max_prompt_chars}",
                where,
            )
        return value
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "seed":
        if not is_int or not 0 <= value <= SEED_MAX:
            raise bad(f"an integer in [0, {SEED_MAX}]")
    elif kind == "count":
        if not is_int or not 1 <= value <= NUM_CHUNKS_MAX:
            raise bad(f"an integer in [1, {NUM_CHUNKS_MAX}]")
    elif kind == "index":
        if not is_int or value < 0:
            raise bad("an integer >= 0")
    elif kind == "name":
        if not isinstance(value, str) or not NAME.fullmatch(value):
            raise bad("a session name: 1-64 letters, digits, '.', '_' or '-', not starting with '.', '_' or '-'")
    elif kind == "upload":
        if not isinstance(value, str) or not UPLOAD.fullmatch(value):
            raise bad("an upload name as POST /api/uploads answers it ('u' and 16 hex digits)")
    return value


def parse(text, *, max_bytes: int, max_prompt_chars: int) -> dict:
    """The checked message of one text frame (absent optional fields are None). ProtocolError codes:
    ``message_too_large`` (over ``max_bytes`` UTF-8 bytes), ``bad_json``, ``bad_message`` (not an object with a
    string "type"), ``unknown_type``, ``unknown_field``, ``missing_field``, ``bad_field``, ``prompt_too_long``."""
    if text is None:
        raise ProtocolError("bad_message", "binary messages are not accepted; send JSON text messages")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ProtocolError("message_too_large", f"the message has {size} bytes; this server takes at most {max_bytes}")
    try:
        message = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProtocolError("bad_json", f"the message is not JSON ({e})") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("bad_message", 'a message is a JSON object with a string "type", e.g. {"type": "status"}')
    kind = message["type"]
    if kind not in MESSAGES:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r:.40}; the types are {', '.join(MESSAGES)}")
    fields = MESSAGES[kind]
    unknown = sorted(set(message) - set(fields) - {"type"})
    if unknown:
        raise ProtocolError(
            "unknown_field",
            f"{kind}: unknown field(s) {', '.join(repr(u)[:40] for u in unknown[:5])}; it takes "
            f"{', '.join(fields) or 'no fields'}",
            kind,
        )
    out = {"type": kind}
    for name, (field_kind, required) in fields.items():
        if message.get(name) is None:
            if required:
                raise ProtocolError("missing_field", f"{kind}: the field {name!r} is required", kind)
            out[name] = None
            continue
        out[name] = _check(field_kind, name, message[name], kind, max_prompt_chars)
    if kind == "start" and out["resume"] is not None:
        extra = [f for f in ("prompt", "seed", "image", "video") if out[f] is not None]
        if extra:
            raise ProtocolError(
                "bad_field",
                f"start: a resumed session continues its own past, prompt and seed; send resume without "
                f"{', '.join(extra)}",
                kind,
            )
    if kind == "start" and out["image"] is not None and out["video"] is not None:
        raise ProtocolError("bad_field", "start: image and video both give the frames to continue; send one", kind)
    return out
