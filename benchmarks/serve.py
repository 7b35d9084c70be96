"""`jaxkv serve` as one client sees it: frames per second delivered over the WebSocket, and how many chunks a
prompt switch takes to reach the video.

Runs the server in this process (uvicorn on a free localhost port, the shipped toy world, compiled first) and one
protocol client that acknowledges each chunk as soon as it has all its frames (so the stream runs as fast as the
model, the JPEG encoding and the socket allow; the page itself paces it to its playback rate). Reports

  * frames/s delivered over ``--seconds`` (after the first chunk), and the median chunk step (generation + JPEG);
  * per prompt switch (one every ``--switch-every`` chunks): the chunks between the last chunk the client had
    received when it asked and the first chunk drawn under the new prompt (1 = the very next chunk), and the
    wall-clock time from asking to receiving that chunk's header;
  * the machine: CPU count and the load average before and after (other processes share the cores).

    python benchmarks/serve.py [--seconds 20] [--switch-every 8] [--ahead-chunks 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import threading
import time

import numpy as np

PROMPTS = ("a green triangle, fast", "a red circle and a blue square, slow")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--switch-every", type=int, default=8)
    p.add_argument("--ahead-chunks", type=int, default=2)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)

    import uvicorn
    from websockets.sync.client import connect

    from jaxkv.pipeline import Pipeline
    from jaxkv.serve import cli
    from jaxkv.serve.app import ServeConfig, create_app

    load_before = os.getloadavg()
    pipe = Pipeline.from_pretrained()
    compile_s = cli.warm_up(pipe)
    sessions = tempfile.mkdtemp(prefix="jaxkv-serve-bench-")
    app = create_app(pipe, ServeConfig(sessions_dir=sessions, ahead_chunks=args.ahead_chunks))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    url = f"ws://127.0.0.1:{sock.getsockname()[1]}/ws"
    frames, steps, switches = 0, [], []
    pending = None  # (asked at, last chunk received when asked, prompt)
    with connect(url, max_size=2**22) as ws:
        json.loads(ws.recv())
        ws.send(json.dumps({"type": "start", "seed": 0}))
        t0 = None
        last = -1
        while True:
            m = ws.recv(timeout=120)
            if isinstance(m, bytes):
                continue
            m = json.loads(m)
            if m["type"] != "chunk":
                continue
            for _ in range(m["frames"]):
                ws.recv(timeout=120)
            ws.send(json.dumps({"type": "ack", "chunk": m["chunk"]}))
            last = m["chunk"]
            if t0 is None:  # the clock starts after the first chunk
                t0 = time.perf_counter()
                continue
            frames += m["frames"]
            steps.append(m["step_ms"])
            if pending is not None and m["prompt"] == pending[2]:
                switches.append(
                    {"chunks": m["chunk"] - pending[1], "ms": round((time.perf_counter() - pending[0]) * 1e3, 1)}
                )
                pending = None
            if pending is None and m["chunk"] % args.switch_every == 0:
                prompt = PROMPTS[len(switches) % 2]
                pending = (time.perf_counter(), last, prompt)
                ws.send(json.dumps({"type": "prompt", "prompt": prompt}))
            if time.perf_counter() - t0 >= args.seconds:
                break
        elapsed = time.perf_counter() - t0
    server.should_exit = True
    thread.join(30)

    result = {
        "frames_per_s": frames / elapsed,
        "chunks_per_s": len(steps) / elapsed,
        "step_ms_median": float(np.median(steps)),
        "switch_chunks": [s["chunks"] for s in switches],
        "switch_ms": [s["ms"] for s in switches],
        "compile_s": compile_s,
        "seconds": elapsed,
        "ahead_chunks": args.ahead_chunks,
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "machine": platform.processor() or platform.machine(),
    }
    print(
        f"one client: {result['frames_per_s']:.1f} frames/s ({result['chunks_per_s']:.1f} chunks/s) over "
        f"{elapsed:.1f} s; median step {result['step_ms_median']:.0f} ms (generate + JPEG)"
    )
    print(
        f"prompt switch: {result['switch_chunks']} chunks after the last one received (1 = the next), "
        f"{result['switch_ms']} ms to the first chunk of the new prompt"
    )
    print(
        f"machine: {result['cpus']} CPUs, load average {result['load_average_before']} before, "
        f"{result['load_average_after']} after"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
