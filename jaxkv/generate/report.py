"""The summary of a ``jaxkv generate`` run: its head (model, settings, cache), the chunk timing (`Timing`, with the
device's own time per chunk from `DeviceClock`), the throughputs, and the human-readable lines `main` prints."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import time

import jax
import numpy as np

from jaxkv import parallel as PL
from jaxkv.generate import outputs, toy

# Latencies kept for the median (the mean runs over every chunk): bounded, so memory does not grow with the run.
LATENCY_WINDOW = 1000


def start(args, config, source: str, schedule, rc, mesh, stream, toy_dir, text_info: dict, resumed: bool) -> dict:
    """The summary's figures known before the first chunk (summary.json's head)."""
    return {
        "model": source,
        "precision": args.precision,
        "param_dtype": rc.precision.param_dtype,
        "config": config.to_dict(),
        "tokens_per_frame": rc.tokens_per_frame(config),
        "chunk_frames": rc.chunk_frames,
        "window_frames": rc.window_frames,
        "sink_frames": rc.sink_frames,
        "num_chunks": args.num_chunks,
        "policy": rc.policy,
        "cache_dtype": rc.precision.cache_dtype,
        "dilated_every": rc.dilated_every,
        "dilation": rc.dilation,
        "buckets": rc.buckets,
        "rope": rc.rope,
        "steps": list(schedule.steps),
        "timesteps": [round(float(t), 3) for t in schedule.timesteps()],
        "guidance_scale": args.guidance_scale,
        "seed": args.seed,
        "backend": jax.default_backend(),
        "mesh": None if mesh is None else PL.mesh_sizes(mesh),
        "cache_bytes": int(stream.state.cache.nbytes),
        "cache_sessions": int(stream.state.cache.batch),
        "vae": decoder_name(args, toy_dir),
        **text_info,
        "first_chunk": stream.start,
        "resumed_from": os.path.abspath(args.resume) if resumed else None,
    }


class Timing:
    """The chunk latencies of one run (host time from one chunk's fetch to the next's) and the device time of the
    chunks after the first (`DeviceClock`): the first chunk carries the compilation, the others are the steady
    rate."""

    def __init__(self):
        self.recent = collections.deque(maxlen=LATENCY_WINDOW)
        self.first_s: float | None = None
        self.loop_start: float | None = None  # when the first chunk was dispatched
        self.total_s, self.steady_n, self.denoise_s = 0.0, 0, 0.0

    def add(self, latency: float, device_s: float, now: float) -> None:
        """Records one fetched chunk: its ``latency`` (s), its ``device_s`` and the time ``now`` it was fetched."""
        if self.first_s is None:
            self.first_s, self.loop_start = latency, now - latency
        else:
            self.recent.append(latency)
            self.total_s, self.steady_n = self.total_s + latency, self.steady_n + 1
            self.denoise_s += device_s

    def figures(self) -> dict:
        """The summary's latency figures (None where there is no steady chunk)."""
        steady, recent, first_s = bool(self.steady_n), self.recent, self.first_s
        return {
            "first_chunk_s": first_s,
            "chunk_latency_ms_median": float(np.median(recent) * 1e3) if steady else None,
            "chunk_latency_ms_mean": float(self.total_s / self.steady_n * 1e3) if steady else None,
            "compile_s_estimate": float(first_s - (np.median(recent) if steady else 0.0))
            if first_s is not None
            else None,
        }

    def add_rates(self, summary: dict, chunk_frames: int, video) -> None:
        """Adds the two throughputs to ``summary``: denoise-only (latent frames per second over the chunks after the
        first, from their time on the device, `DeviceClock`) and end to end (from the first dispatch until every
        file is closed, compilation included; latent frames, and decoded video frames when an mp4 is written)."""
        steady_n, denoise_s, loop_start = self.steady_n, self.denoise_s, self.loop_start
        summary["denoise_latent_frames_per_s"] = (
            steady_n * chunk_frames / denoise_s if steady_n and denoise_s > 0 else None
        )
        latent = summary.get("latents_shape", [0, 0])[1]
        end = video.closed_at if video is not None and video.closed_at is not None else time.perf_counter()
        wall = end - loop_start if loop_start is not None else None
        summary["end_to_end_s"] = wall
        summary["end_to_end_latent_frames_per_s"] = latent / wall if wall else None
        summary["end_to_end_video_frames_per_s"] = video.video_frames / wall if wall and video is not None else None


class DeviceClock:
    """When each dispatched chunk is done on the device, seen by a thread that blocks on it while the host loop goes
    on writing the previous one. The device runs chunks in order, so a chunk's device time is its completion
    minus the later of its dispatch and the previous chunk's completion: host time spent writing, decoding or
    encoding the mp4 is never counted as denoising, and never subtracted from it."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkv-device-clock")
        self._last_done = None

    def watch(self, x):
        """Starts watching the just-dispatched array ``x``: (dispatch time, future of its completion time)."""
        return time.perf_counter(), self._pool.submit(_done_at, x)

    def device_time(self, watched) -> float:
        """Seconds the device spent on a watched chunk; call once per chunk, in dispatch order."""
        dispatched, done = watched[0], watched[1].result()
        start = dispatched if self._last_done is None else max(dispatched, self._last_done)
        self._last_done = done
        return max(done - start, 0.0)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _done_at(x) -> float:
    jax.block_until_ready(x)
    return time.perf_counter()


def decoder_name(args, toy_dir) -> str | None:
    """What decodes the mp4, for the summary (None without video)."""
    if args.no_video:
        return None
    if toy_dir:
        return f"toy-world latent map {os.path.join(toy_dir, toy.model.LATENT_MAP_DIR)}"
    return args.vae or "tiny random (embedded default)"


def print_summary(s: dict) -> None:
    """The human-readable summary on stdout."""
    mib = s["cache_bytes"] / 2**20
    lat = (
        f"{s['chunk_latency_ms_median']:.1f} ms median, {s['chunk_latency_ms_mean']:.1f} ms mean"
        if s["chunk_latency_ms_median"] is not None
        else "n/a (one chunk)"
    )
    shape = s["latents_shape"]
    print(f"model        {s['model']}")
    print(
        f"video        {shape[1]} latent frames of {shape[2]}x{shape[3]} ({s['tokens_per_frame']} tokens/frame), "
        f"batch {shape[0]}"
    )
    print(
        f"cache        {s['policy']}: sink {s['sink_frames']} + window {s['window_frames']} frames, chunks of "
        f"{s['chunk_frames']}; {mib:.2f} MiB for {s['cache_sessions']} session(s)"
    )
    if s.get("mesh"):
        m = s["mesh"]
        print(f"mesh         data={m['data']} x model={m['model']} x seq={m.get('seq', 1)} devices")
    print(
        f"sampler      steps {s['steps']} -> timesteps {s['timesteps']}"
        + (f", guidance {s['guidance_scale']}" if s["guidance_scale"] is not None else "")
    )
    if s["first_chunk_s"] is not None:
        print(
            f"compile      {s['compile_s_estimate']:.2f} s (first chunk {s['first_chunk_s']:.2f} s), "
            f"{s['compilations']} compilation(s) of the chunk step"
        )
        print(f"per chunk    {lat} after compilation ({s['backend']})")
    rates = []
    if s.get("denoise_latent_frames_per_s") is not None:
        rates.append(f"denoise only {s['denoise_latent_frames_per_s']:.2f} latent frames/s")
    if s.get("end_to_end_s"):
        rates.append(
            f"end to end {s['end_to_end_latent_frames_per_s']:.2f} latent frames/s"
            + (
                f" = {s['end_to_end_video_frames_per_s']:.2f} video frames/s"
                if s.get("end_to_end_video_frames_per_s") is not None
                else ""
            )
            + f" over {s['end_to_end_s']:.2f} s, compilation included"
        )
    if rates:
        print(f"throughput   {'; '.join(rates)}")
    if s.get("prompt") is not None:
        print(
            f"text         {s['prompt']!r} by {s['text_encoder']}"
            + (" (released before the rollout)" if s.get("text_encoder_released") else "")
        )
    print_written(s)
    if s.get("given"):
        g = s["given"]
        print(
            f"given        {g['path']} ({g['kind']}, {g['source_frames']} frame(s) of {g['source_size'][0]}x"
            f"{g['source_size'][1]}): {g['frames_used']} frames, {g['padded']} repeated in front, {g['dropped']} "
            f"oldest dropped, committed as chunks 0..{g['chunks'] - 1}; generated from chunk {s['first_chunk']}"
        )
    if s.get("resumed_from"):
        print(f"resumed      {s['resumed_from']} at stream chunk {s['first_chunk']}")
    if s.get("session"):
        print(f"session      saved to {s['session']} (continue with --resume {s['session']})")


def print_written(s: dict) -> None:
    chunks = s.get("chunks_written", 0)
    if s.get("written_by"):  # a multi-process job's other processes
        print(f"wrote        nothing from this process ({s['written_by']} wrote the {chunks} chunk(s))")
        return
    if not chunks and "manifest" not in s:
        print("wrote        nothing")
        return
    print(
        f"wrote        {chunks} chunk(s) to {s.get('latents_dir')} ({s['status']}), {s.get('preview', 'no preview')}, "
        f"{os.path.join(os.path.dirname(s['manifest']), outputs.SUMMARY)}; read them with "
        f"jaxkv.generate.load_latents({os.path.dirname(s['manifest'])!r})"
    )
    if s.get("video"):
        size = s.get("video_size") or [0, 0]
        print(
            f"video        {s['video']}: {s['video_frames']} frames of {size[0]}x{size[1]} at {s['fps']} fps "
            f"(VAE: {s['vae']})" + (f"; frames in {s['frames_dir']}" if s.get("frames_dir") else "")
        )
    if s.get("contact_sheet"):
        print(
            f"sheet        {s['contact_sheet']}: {len(s['contact_sheet_frames'])} frames of each video, evenly "
            f"spaced, the last included"
        )
