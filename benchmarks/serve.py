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

With ``--clients N`` (N > 1) it is a soak instead: N clients stream at once for ``--seconds`` (no switches), and
the process's resident memory (server, model and clients together) is sampled every ``--sample-every`` seconds;
it reports each client's frames/s, whether every chunk arrived whole and in order, and the memory over time (its
growth from the end of the first minute to the end).

    python benchmarks/serve.py --clients 4 --seconds 600 --json soak.json
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
    p.add_argument("--clients", type=int, default=1, help="clients at once (> 1: the memory soak)")
    p.add_argument("--sample-every", type=float, default=10.0, help="soak: seconds between memory samples")
    args = p.parse_args(argv)
    if args.clients < 1:
        p.error("--clients must be >= 1")

    import uvicorn
    from websockets.sync.client import connect

    from jaxkv.pipeline import Pipeline
    from jaxkv.serve import cli
    from jaxkv.serve.app import ServeConfig, create_app

    load_before = os.getloadavg()
    pipe = Pipeline.from_pretrained()
    compile_s = cli.warm_up(pipe)
    sessions = tempfile.mkdtemp(prefix="jaxkv-serve-bench-")
    config = ServeConfig(sessions_dir=sessions, ahead_chunks=args.ahead_chunks, max_sessions=max(4, args.clients))
    app = create_app(pipe, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    url = f"ws://127.0.0.1:{sock.getsockname()[1]}/ws"
    if args.clients > 1:
        result = soak(url, args, connect)
        result.update(compile_s=compile_s, cpus=os.cpu_count(), load_average_before=[round(x, 2) for x in load_before])
        result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        server.should_exit = True
        thread.join(30)
        return report(result, args.json)
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


def rss_mib() -> float:
    """This process's resident memory (MiB), from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def soak(url: str, args, connect) -> dict:
    """``args.clients`` clients streaming for ``args.seconds``; memory sampled meanwhile."""
    stop = threading.Event()
    per_client: dict[int, dict] = {}

    def client(i: int) -> None:
        frames, expected, problems = 0, None, []
        with connect(url, max_size=2**22) as ws:
            json.loads(ws.recv())
            ws.send(json.dumps({"type": "start", "seed": i}))
            t0 = time.perf_counter()
            while not stop.is_set():
                m = ws.recv(timeout=120)
                if isinstance(m, bytes):
                    problems.append("a binary message outside a chunk")
                    continue
                m = json.loads(m)
                if m["type"] == "error":
                    problems.append(m["code"])
                if m["type"] != "chunk":
                    continue
                got = [ws.recv(timeout=120) for _ in range(m["frames"])]
                if not all(isinstance(g, bytes) and g[:2] == b"\xff\xd8" for g in got):
                    problems.append(f"chunk {m['chunk']}: a frame is not a JPEG")
                if expected is not None and m["chunk"] != expected:
                    problems.append(f"chunk {m['chunk']} after {expected - 1}")
                expected = m["chunk"] + 1
                frames += m["frames"]
                ws.send(json.dumps({"type": "ack", "chunk": m["chunk"]}))
            elapsed = time.perf_counter() - t0
            ws.send(json.dumps({"type": "stop"}))
        per_client[i] = {"frames_per_s": round(frames / elapsed, 2), "chunks": expected, "problems": problems[:5]}

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    samples = [(0.0, rss_mib())]
    while time.perf_counter() - start < args.seconds:
        time.sleep(min(args.sample_every, max(args.seconds - (time.perf_counter() - start), 0.01)))
        samples.append((round(time.perf_counter() - start, 1), round(rss_mib(), 1)))
    stop.set()
    for t in threads:
        t.join(180)
    after_minute = next((m for t, m in samples if t >= 60), samples[-1][1])
    return {
        "clients": args.clients,
        "seconds": args.seconds,
        "per_client": per_client,
        "frames_per_s_all": round(sum(c["frames_per_s"] for c in per_client.values()), 2),
        "rss_mib": samples,
        "rss_growth_after_first_minute_mib": round(samples[-1][1] - after_minute, 1),
        "ahead_chunks": args.ahead_chunks,
        "machine": platform.processor() or platform.machine(),
    }


def report(result: dict, path: str | None) -> int:
    for i, c in sorted(result["per_client"].items()):
        print(
            f"client {i}: {c['frames_per_s']:.1f} frames/s, {c['chunks']} chunks, problems: {c['problems'] or 'none'}"
        )
    rss = result["rss_mib"]
    print(
        f"{result['clients']} clients, {result['seconds']:.0f} s: {result['frames_per_s_all']:.1f} frames/s in all; "
        f"resident memory {rss[0][1]:.0f} MiB at the start, {rss[-1][1]:.0f} MiB at the end, "
        f"{result['rss_growth_after_first_minute_mib']:+.1f} MiB after the first minute"
    )
    print(
        f"machine: {result['cpus']} CPUs, load average {result['load_average_before']} before, "
        f"{result['load_average_after']} after"
    )
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(not c["problems"] for c in result["per_client"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
