"""The generation loop of ``jaxkv generate``: check everything, build the stream, hand each chunk to the output
sinks as it finishes, stop cleanly on a signal, summarise.

Order of work: arguments and their combinations (`options`), the model config (a checkpoint's config.json only),
the rollout settings, the context files, ``--out``; then the params (checked finite) and only then compilation and
generation. So a mistake costs no compile time and leaves no files.

Per chunk the device computes the latents and one fused ``isfinite(...).all()``, fetched together; chunk k+1 is
dispatched before chunk k is fetched and written, so writing (and the mp4's VAE decode, dispatched by `Mp4Sink`)
overlaps the next chunk's compute. Host memory holds one or two chunks (plus the bounded preview frames) however
many chunks run.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import math
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import continuation, recache
from jaxkv import files as jfiles
from jaxkv import parallel as PL
from jaxkv import rollout as R
from jaxkv.compilation import count_compiles
from jaxkv.files import DirectoryLost, Terminated
from jaxkv.generate import given, inputs, memory, options, outputs, prompts, resume, settings, toy
from jaxkv.generate import processes as PJ
from jaxkv.generate.options import UsageError
from jaxkv.generate.preview import PreviewSink
from jaxkv.generate.settings import Settings
from jaxkv.generate.video import Mp4Sink
from jaxkv.models.checkpoint_dir import CheckpointError
from jaxkv.parallel.processes import ProcessFailed
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream

# Token positions are int32: the last token of the last chunk must stay below 2**31. (The cache layer may export
# its own limit; use it here when it does.)
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
# Latencies kept for the median (the mean runs over every chunk): bounded, so memory does not grow with the run.
LATENCY_WINDOW = 1000


class GenerationError(RuntimeError):
    """Generation stopped on bad numbers or a failed write (a full disk, a file-size limit); the files written
    before it are finished as far as they can be (status "failed"). ``summary`` is what summary.json holds."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


class Stop:
    """Set by a stop signal (`stop_on_signals`): the loop finishes the current chunk and returns. A second signal
    restores the default action and re-raises it (kills the process at once; the files stay readable), except
    while the final ``--save-state`` is written (`saving_session`): there it raises `jaxkv.files.Terminated` (or
    KeyboardInterrupt), so the save is abandoned and its temporary directory removed, never left half written."""

    def __init__(self):
        self.signum: int | None = None
        self.saving = False
        self.aborted_save = False  # a second signal abandoned the --save-state save

    def handler(self, signum, frame) -> None:
        if self.signum is not None:
            if self.saving:
                self.aborted_save = True
                jfiles.raise_stop(signum)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        what = "finishing the session save" if self.saving else "stopping after the current chunk"
        print(
            f"\njaxkv generate: {signal.Signals(signum).name}: {what} (send it again to abort "
            f"{'the save' if self.saving else 'at once'})",
            file=sys.stderr,
            flush=True,
        )

    @contextlib.contextmanager
    def saving_session(self):
        """While the block writes the session, a second stop signal aborts it cleanly instead of killing."""
        self.saving = True
        try:
            with jfiles.keeping_lost_signals():
                yield
        finally:
            self.saving = False


@contextlib.contextmanager
def stop_on_signals():
    """Installs `Stop` for SIGINT, SIGTERM and SIGHUP while the block runs (main thread only; elsewhere the
    returned Stop is never set)."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop.handler) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@jax.jit
def _chunk_finite(x) -> jax.Array:
    return jnp.isfinite(x).all()


def _settings(args: Settings, config):
    """(Schedule, RolloutConfig) from the settings (its dtype policy and backend: ``args.run``); UsageError for any
    inconsistency with the model."""
    try:
        schedule = Schedule(steps=args.steps, shift=args.shift, context_noise=args.context_noise)
        rc = R.RolloutConfig(
            args.height,
            args.width,
            chunk_frames=args.chunk_frames,
            window_frames=args.window_frames,
            sink_frames=args.sink_frames,
            schedule=schedule,
            guidance_scale=args.guidance_scale,
            policy=args.policy,
            precision=args.run.precision,
            backend=args.run.backend,
            dilated_every=args.dilated_every,
            dilation=args.dilation,
            buckets=args.buckets,
            rope=args.rope,
        )
        rc.cache_spec(config)  # validates the frame and layer settings against the model
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        R.check_position_room(config, rc, args.num_chunks)
    except ValueError as e:
        raise UsageError(f"--num-chunks: {e}") from None
    return schedule, rc


def _check_memory(args, config, rc) -> None:
    """UsageError, with the figures, when the run obviously cannot fit in memory (`memory.check`); before anything
    is loaded or compiled."""
    devices = 1 if args.mesh is None else math.prod(args.mesh.values())
    flags = f"--height {args.height} --width {args.width} --window-frames {rc.window_frames} --batch {args.batch}"
    try:
        memory.check(
            config, rc, args.batch, f"{flags} (a {config.num_layers}-layer, dim {config.dim} model)", devices=devices
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _mesh(args, config, rc):
    """The --mesh as a `jax.sharding.Mesh` (None without it); UsageError when it does not fit the devices, the
    batch or the model. In a multi-process job (`jaxkv.generate.processes`) every process meets here, after every
    check: all go on, or all stop."""
    if args.mesh is None:
        if PJ.multi():
            raise UsageError("a multi-process JAX job runs jaxkv generate with --mesh (over every process's devices)")
        return None
    with PJ.together("checking the settings"):
        try:
            mesh = PL.make_mesh(**args.mesh)
            PL.check_mesh(mesh, config, rc, args.batch)
        except ValueError as e:
            raise UsageError(f"--mesh: {e}") from None
    return mesh


def _mesh_params(args, config, mesh):
    """The params on ``mesh``: a checkpoint read straight into its shards, or the random weights placed by the
    rule table; finite, as `inputs.load_params` checks."""
    dtype = jnp.dtype(args.run.precision.param_dtype)
    if not args.checkpoint:
        return PL.shard_params(inputs.load_params(args, config), mesh)
    try:
        loaded, params = PL.load_sharded(args.checkpoint, mesh, dtype)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if loaded != config:
        raise UsageError(f"checkpoint {args.checkpoint} changed while it was read; run again")
    bad = inputs.nonfinite_leaves(params)
    if bad:
        raise UsageError(
            f"checkpoint {args.checkpoint} holds NaN or Inf values in {', '.join(bad)}; refusing to generate from them"
        )
    return params


def run(args: Settings | argparse.Namespace, stop: Stop | None = None) -> dict:
    """Runs ``jaxkv generate`` for resolved settings (`jaxkv.generate.settings`; a Namespace parsed by
    `options.build_parser` is resolved first); returns the summary dict (as written to summary.json; ``"status"``
    is "complete", or "interrupted" when ``stop`` was set by a signal).

    Raises UsageError for bad settings or inputs (nothing written), GenerationError when the latents turn
    non-finite or a write fails (a full disk, a file-size limit: the chunks before it are written and the files
    finished as far as they can be, status "failed"), `jaxkv.files.DirectoryLost` (an OSError) when ``--out`` was
    moved or replaced under the run, OSError for other I/O failures.
    """
    stop = stop or Stop()
    if not isinstance(args, Settings):
        args = settings.from_namespace(args)  # every check that needs no model; nothing changes args after this
    resumed, toy_dir = args.session_manifest, args.toy_dir
    config, source = inputs.resolve_config(args)
    schedule, rc = _settings(args, config)
    _check_memory(args, config, rc)
    vae_config = None if toy_dir else inputs.resolve_vae(args, config)
    given_vae, given_vae_dir = given.vae_config(args, config, toy_dir, vae_config)
    given_frames = given.read(args, rc, toy_dir, given_vae)  # read and checked before anything is written
    entries = prompts.read_schedule(args.prompt_schedule, args.num_chunks) if args.prompt_schedule else None
    if toy_dir and entries:
        toy.check_schedule(entries)
    decoder = toy.frame_decoder(toy_dir) if toy_dir and not args.no_video else None  # a Wan VAE's: below
    sources = [
        p
        for p in (
            args.release,
            args.checkpoint,
            args.context,
            args.negative_context,
            args.vae,
            args.text_encoder,
            args.embeddings_cache,
            args.prompt_schedule,
            args.resume,
        )
        if p
    ]
    sources += [e.context for e in entries or () if e.context]
    sources += [p for p in (args.image, args.video) if p]
    outputs.prepare_output_dir(args.out, overwrite=args.overwrite, create=False, sources=sources)
    resume.check_save_state(args, sources)
    mesh = _mesh(args, config, rc)
    session = None
    switches = {}  # chunk of this run -> (the schedule entry, its context): where the stream switches prompts
    drawing = resume.text_of(args, resumed)  # the text the next chunk is drawn under (recorded in a saved session)
    if resumed is None and entries is not None:
        drawing = prompts.entry_text(entries[0])
    if resumed is not None:  # the session holds the cross-attention K/V: only a schedule's texts are encoded
        session = resume.load(args, config, rc, schedule=entries is not None, mesh=mesh)
        context, negative, text_info = None, None, {}
        if entries is not None:  # the schedule counts this run's chunks; its chunk-0 entry switches unless current
            scheduled, negative, text_info = prompts.schedule_contexts(args, config, entries)
            switches = {
                e.chunk: (e, jnp.asarray(c))
                for e, c in zip(entries, scheduled)
                if e.chunk > 0 or prompts.entry_text(e) != drawing
            }
    elif entries is None:
        context, negative, text_info = inputs.contexts(args, config)  # encodes --prompt (after the cheap checks)
    else:
        scheduled, negative, text_info = prompts.schedule_contexts(args, config, entries)
        context = scheduled[0]
        switches = {e.chunk: (e, jnp.asarray(c)) for e, c in zip(entries[1:], scheduled[1:])}
    params = inputs.load_params(args, config) if mesh is None else _mesh_params(args, config, mesh)
    vae_params = None if vae_config is None else inputs.load_vae(args, vae_config)
    if stop.signum is not None:
        return {"status": "interrupted", "signal": signal.Signals(stop.signum).name, "chunks_written": 0}

    # the latent history a switch re-caches from, kept for a schedule or a saved session (which then holds it)
    history = entries is not None or resume.keeps_ring(args, rc)
    if session is not None:
        try:  # a saved latent ring comes back with the session (checked before anything runs)
            if mesh is None:
                stream = Stream.from_session(params, config, rc, session, num_chunks=args.num_chunks, history=history)
            else:
                stream = PL.MeshStream.from_session(
                    params, config, rc, session, mesh=mesh, num_chunks=args.num_chunks, history=history
                )
        except ValueError as e:
            raise UsageError(f"--resume: {e}") from None
    else:
        key = jax.random.key(args.seed)
        negative = None if negative is None else jnp.asarray(negative)
        if mesh is None:
            stream = Stream(
                params,
                config,
                rc,
                jnp.asarray(context),
                num_chunks=args.num_chunks,
                key=key,
                negative_context=negative,
                history=history,
            )
        else:
            stream = PL.MeshStream(
                params,
                config,
                rc,
                jnp.asarray(context),
                mesh=mesh,
                num_chunks=args.num_chunks,
                key=key,
                negative_context=negative,
                history=history,
            )
    given_context = given_info = None
    if given_frames is not None:  # the given frames become the stream's first chunks; the schedule counts after them
        frame_encoder = given.encoder(args, toy_dir, given_vae, given_vae_dir, vae_params)
        given_context, given_info = given.commit(args, stream, given_frames, frame_encoder, rc)
    switches = {chunk + stream.start: c for chunk, c in switches.items()}  # in stream chunks (given or resumed)
    keep_sink = (args.switch_sink or "keep") == "keep"

    def advance():
        """The next chunk, switching prompts first where the schedule says so."""
        nonlocal drawing
        if stream.index in switches:
            entry, entry_context = switches[stream.index]
            stream.switch_prompt(
                entry_context, None if negative is None else jnp.asarray(negative), keep_sink=keep_sink
            )
            drawing = prompts.entry_text(entry)
        return next(stream)

    chunk_shape = rc.chunk_shape(config, args.batch)
    video, files = None, PJ.Quiet()  # a multi-process job: process 0 alone writes the outputs
    PJ.meet("loading the inputs")  # every process loaded its inputs (else none opens anything)
    with PJ.together("opening the outputs"):
        if PJ.lead():
            # Locked for the whole run: another run refuses it, even with --overwrite (`outputs.claim_output_dir`).
            lock = outputs.claim_output_dir(args.out, overwrite=args.overwrite, sources=sources)
            out = lock.path
            try:
                sinks = [
                    outputs.LatentsSink(out, args.format),
                    PreviewSink(os.path.join(out, "preview.png"), args.preview_frames, args.preview_scale),
                ]
                if vae_config is not None:
                    from jaxkv.models.wan_vae import StreamDecoder

                    decoder = StreamDecoder(
                        vae_params, vae_config, latent_height=args.height, latent_width=args.width, batch=args.batch
                    )
                if decoder is not None:
                    video = Mp4Sink(out, decoder, batch=args.batch, fps=args.fps_or_default, frames=args.frames)
                    sinks.append(video)
                files = outputs.OutputDir(out, sinks, chunk_shape=chunk_shape, latents_format=args.format, lock=lock)
            except BaseException:
                lock.release()
                raise

    summary = {
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
        "vae": _decoder_name(args, toy_dir),
        **text_info,
        "first_chunk": stream.start,
        "resumed_from": None if session is None else os.path.abspath(args.resume),
    }
    if given_info is not None:
        summary["given"] = given_info
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.num_chunks, unit="chunk", desc="generate", file=sys.stderr)
    recent = collections.deque(maxlen=LATENCY_WINDOW)
    first_s, total_s, steady_n, status, reason = None, 0.0, 0, "complete", None
    # Device time of the chunks after the first (`DeviceClock`), for the denoise-only rate.
    denoise_s, loop_start, clock = 0.0, None, DeviceClock()
    try:
        with PJ.together("starting the video decoder"):
            if video is not None:  # inside the try: a failure here still finalises the files
                summary["vae_warm_up_s"] = video.warm_up(chunk_shape)
                if session is not None:
                    resume.restore_video(video, session)
                if given_context is not None:  # the decoder carries on from the given frames (not written)
                    continuation.prime_decoder(video.decoder, given_context.latents)
        if entries is not None:
            summary["switch_sink"] = "keep" if keep_sink else "recompute"
        with count_compiles(stream.step) as compiles, count_compiles(recache.jit_switch_prompt) as switch_compiles:
            start = time.perf_counter()
            pending = advance()
            pending = (pending, _chunk_finite(pending), clock.watch(pending))
            for index in range(args.num_chunks):
                x, finite, watched = pending
                if index + 1 < args.num_chunks and stop.signum is None:
                    nxt = advance()  # dispatched now: the device computes it while this chunk is written
                    pending = (nxt, _chunk_finite(nxt), clock.watch(nxt))
                x, finite = PJ.fetch(x, finite)  # a multi-process job: in every process
                device_s = clock.device_time(watched)
                now = time.perf_counter()
                latency, start = now - start, now
                if first_s is None:
                    first_s, loop_start = latency, now - latency
                else:
                    recent.append(latency)
                    total_s, steady_n = total_s + latency, steady_n + 1
                    denoise_s += device_s
                if not finite:
                    status = "failed"
                    reason = (
                        f"chunk {index} holds NaN/Inf latents ({int((~np.isfinite(x)).sum())} values); "
                        f"stopped, chunks 0..{index - 1} are written"
                        if index
                        else f"chunk 0 holds NaN/Inf latents ({int((~np.isfinite(x)).sum())} values); stopped "
                        f"before writing any chunk"
                    )
                    break
                PJ.agree_chunk(files, index, x, stop)  # and a stop heard anywhere
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(f"{latency * 1e3:.0f} ms")
                # Stopped: with --save-state the chunk already dispatched is written too, so that the saved
                # session and the written chunks end at the same chunk.
                if stop.signum is not None and not (args.save_state and stream.index - stream.start > files.chunks):
                    break
        if stop.signum is not None and status == "complete" and files.chunks < args.num_chunks:
            status = "interrupted"
            reason = f"{signal.Signals(stop.signum).name} after {files.chunks} of {args.num_chunks} chunks"
        if args.save_state and status != "failed":
            with stop.saving_session():
                summary["session"] = resume.save(args, stream, video, files.chunks, text=drawing)
    except BaseException as e:  # KeyboardInterrupt included: finish the files, then let it propagate
        try:
            if stop.aborted_save:  # a second signal while saving the session
                name = signal.Signals(getattr(e, "signum", signal.SIGINT)).name
                status, reason = "interrupted", f"{name} twice: the session was not saved to {args.save_state}"
            elif isinstance(e, (KeyboardInterrupt, Terminated)):
                status, reason = "interrupted", outputs.describe_error(e)
            else:
                status, reason = "failed", outputs.describe_error(e)
            files.close(status, summary, reason, strict=False)
        finally:
            files.release()
        if isinstance(e, OSError) and not isinstance(e, DirectoryLost):  # a failed write: the files say so
            raise GenerationError(str(e), summary) from e
        raise
    finally:
        clock.close()
        if progress is not None:
            progress.close()
    steady = bool(steady_n)
    summary.update(
        latents_shape=[args.batch, files.chunks * rc.chunk_frames, *chunk_shape[2:]],
        first_chunk_s=first_s,
        chunk_latency_ms_median=float(np.median(recent) * 1e3) if steady else None,
        chunk_latency_ms_mean=float(total_s / steady_n * 1e3) if steady else None,
        compile_s_estimate=float(first_s - (np.median(recent) if steady else 0.0)) if first_s is not None else None,
        compilations=compiles(),
    )
    if entries is not None:
        summary["switch_compilations"] = switch_compiles()
    if stop.signum is not None:
        summary["signal"] = signal.Signals(stop.signum).name
    try:
        with PJ.together("closing the outputs"):
            summary = files.close(status, summary, reason)
            _rates(summary, rc.chunk_frames, steady_n, denoise_s, loop_start, video)
            files.write_summary(summary)  # again, with the rates
    except OSError as e:
        if isinstance(e, DirectoryLost):
            raise
        raise GenerationError(str(e), summary) from e  # closing a file failed: the files say "failed"
    finally:
        files.release()
    if status == "failed":
        raise GenerationError(reason, summary)
    return summary


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


def _decoder_name(args, toy_dir) -> str | None:
    """What decodes the mp4, for the summary (None without video)."""
    if args.no_video:
        return None
    if toy_dir:
        return f"toy-world latent map {os.path.join(toy_dir, toy.model.LATENT_MAP_DIR)}"
    return args.vae or "tiny random (embedded default)"


def _rates(summary: dict, chunk_frames: int, steady_n: int, denoise_s: float, loop_start: float | None, video) -> None:
    """Adds the two throughputs to ``summary``: denoise-only (latent frames per second over the chunks after the
    first, from their time on the device, `DeviceClock`) and end to end (from the first dispatch until every file
    is closed, compilation included; latent frames, and decoded video frames when an mp4 is written)."""
    summary["denoise_latent_frames_per_s"] = steady_n * chunk_frames / denoise_s if steady_n and denoise_s > 0 else None
    latent = summary.get("latents_shape", [0, 0])[1]
    end = video.closed_at if video is not None and video.closed_at is not None else time.perf_counter()
    wall = end - loop_start if loop_start is not None else None
    summary["end_to_end_s"] = wall
    summary["end_to_end_latent_frames_per_s"] = latent / wall if wall else None
    summary["end_to_end_video_frames_per_s"] = video.video_frames / wall if wall and video is not None else None


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


def main(argv: list[str] | None = None) -> int:
    """``jaxkv generate``: 0 when complete, 2 for bad arguments or inputs, 1 for failures (non-finite latents, I/O),
    128 + signal number when stopped by SIGINT (130), SIGTERM (143) or SIGHUP (129)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        options.build_parser().parse_args(argv)  # --help shows the defaults; argparse's errors
        flags = options.given_flags(argv)  # the flags given, by destination (each default suppressed)
    except SystemExit as e:  # --help (0) or an argparse error (2, message already printed)
        return int(e.code or 0)
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        # a file-size limit (ulimit -f) must fail the write (EFBIG, reported naming the file), not kill the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    with stop_on_signals() as stop:
        try:
            try:
                PJ.join(flags)  # --coordinator: a multi-process job, joined before anything touches a device
                PJ.defer_signals(stop)
                args = settings.resolve(flags)  # defaults < release < saved session < flags, checked; frozen
                summary = run(args, stop)
            except BaseException as e:  # a multi-process job: the others hear of it at their next meeting point
                PJ.join_after_failure(e)
                raise
        except UsageError as e:
            print(f"jaxkv generate: error: {e}", file=sys.stderr)
            return 2
        except GenerationError as e:
            print(f"jaxkv generate: error: {e}", file=sys.stderr)
            print_written(e.summary)
            return 1
        except (OSError, ProcessFailed) as e:
            print(f"jaxkv generate: error: {e}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, Terminated) as e:  # a second signal aborted the --save-state save
            signum = getattr(e, "signum", signal.SIGINT)
            name = signal.Signals(signum).name
            print(
                f"jaxkv generate: interrupted by {name} twice: the session was not saved to {args.save_state} (the "
                f"chunks written are kept)"
                if stop.aborted_save
                else f"jaxkv generate: interrupted by {name}",
                file=sys.stderr,
            )
            return 128 + signum
    if summary["status"] == "interrupted":
        print(f"jaxkv generate: interrupted by {summary['signal']}", file=sys.stderr)
        if "manifest" in summary or summary.get("written_by"):  # (another process of a job: it wrote nothing)
            print_summary(summary)
        else:
            print("wrote        nothing (stopped before the first chunk)")
        return 128 + int(signal.Signals[summary["signal"]])
    print_summary(summary)
    return 0
