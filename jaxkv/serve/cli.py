"""``jaxkv serve``: load the model, compile its step, and serve the page and the WebSocket protocol with uvicorn.

Prints the URL once the server is ready. SIGTERM or Ctrl-C: every live session is saved to ``--sessions-dir``
(``ID-autosave``) and the process exits with status 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import time

from jaxkv.argparsing import Parser
from jaxkv.precision import PRESETS

TOKEN_ENV = "JAXKV_SERVE_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxkv serve",
        description="Serve a live, steerable video stream in the browser: a page with a prompt box where frames "
        "appear as they are generated; change the prompt mid-stream, pause, save and fork sessions. One "
        "WebSocket per client, each with its own stream of one shared model (docs/server.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a converted release or a toy-world release (default: the toy world shipped in the package)",
    )
    p.add_argument(
        "--precision",
        choices=tuple(PRESETS),
        default="float32",
        help="dtype policy of weights, activations and caches (jaxkv.precision presets; fp8: bfloat16 with an FP8 KV "
        "cache and FP8 attention, half the cache bytes of bfloat16)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs --token")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument(
        "--sessions-dir", default="jaxkv_sessions", help="where sessions are saved (save, fork, autosave) and resumed"
    )
    p.add_argument("--max-sessions", type=int, default=4, help="live streams at once, over all clients")
    p.add_argument("--max-prompt-chars", type=int, default=300, help="longest prompt accepted")
    p.add_argument(
        "--ahead-chunks",
        type=int,
        default=2,
        help="chunks a stream may generate past the last one its page has shown (the playback buffer)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"secret every client must pass (?token=...); required with a --host other than loopback (default: "
        f"${TOKEN_ENV})",
    )
    p.add_argument("--no-warm-up", action="store_true", help="do not compile before serving (the first chunk waits)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check(args, parser) -> None:
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    for flag, value in (
        ("--max-sessions", args.max_sessions),
        ("--max-prompt-chars", args.max_prompt_chars),
        ("--ahead-chunks", args.ahead_chunks),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.token is not None and len(args.token) < 8:
        parser.error("--token must have at least 8 characters")
    if not _loopback(args.host) and not args.token:
        parser.error(
            f"--host {args.host} serves other machines: pass --token SECRET (or set ${TOKEN_ENV}); clients then open "
            f"the page with ?token=SECRET"
        )
    if os.path.exists(args.sessions_dir) and not os.path.isdir(args.sessions_dir):
        parser.error(f"--sessions-dir {args.sessions_dir} exists and is not a directory")


def warm_up(pipeline) -> float:
    """Compiles the chunk step, the decode and a prompt switch on a throwaway stream; returns the seconds taken."""
    start = time.perf_counter()
    stream = pipeline.start(num_chunks=2)
    stream.step()
    stream.switch_prompt(pipeline.default_prompt)
    stream.step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        _check(args, parser)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        import uvicorn

        from jaxkv.serve.app import ServeConfig, create_app
    except ImportError as e:
        print(
            f"jaxkv serve: error: {e.name} is missing; install the server's extra: pip install 'jaxkv[serve]'",
            file=sys.stderr,
        )
        return 2
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="jaxkv serve: %(message)s", stream=sys.stderr)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"jaxkv serve: error: cannot bind {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    sock.listen(128)
    from jaxkv.pipeline import Pipeline

    print("jaxkv serve: loading the model", file=sys.stderr, flush=True)
    try:
        pipeline = Pipeline.from_pretrained(args.checkpoint, precision=args.precision)
    except ValueError as e:
        print(f"jaxkv serve: error: {e}", file=sys.stderr)
        return 2
    if not args.no_warm_up:
        print("jaxkv serve: compiling the chunk step (once; about 30 s on 2 CPU cores)", file=sys.stderr, flush=True)
        print(f"jaxkv serve: compiled in {warm_up(pipeline):.1f} s", file=sys.stderr, flush=True)
    config = ServeConfig(
        sessions_dir=os.path.abspath(args.sessions_dir),
        max_sessions=args.max_sessions,
        max_prompt_chars=args.max_prompt_chars,
        ahead_chunks=args.ahead_chunks,
        token=args.token,
    )
    app = create_app(pipeline, config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    url = f"http://{shown}:{port}/" + (f"?token={args.token}" if args.token else "")
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            ws_max_size=max(config.max_message_bytes * 4, 65536),
            timeout_graceful_shutdown=30,
            lifespan="on",
        )
    )
    # uvicorn handles SIGINT / SIGTERM while it serves (a graceful shutdown: every session is saved) and raises
    # the signal again once it is done; this handler receives that, so the process exits cleanly with status 0.
    caught: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
    }
    print(
        f"jaxkv serve: {url} (sessions in {config.sessions_dir}; Ctrl-C or SIGTERM saves the live ones and stops)",
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if caught:
        print(f"jaxkv serve: stopped by {signal.Signals(caught[0]).name}", file=sys.stderr, flush=True)
    return 0
