"""The generation loop of ``jaxkv generate``: check everything, build the stream, hand each chunk to the output
sinks as it finishes, stop cleanly on a signal (`jaxkv.generate.stopping`), summarise (`jaxkv.generate.report`).

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
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import parallel as PL
from jaxkv import recache
from jaxkv.compilation import count_compiles
from jaxkv.files import DirectoryLost, Terminated
from jaxkv.generate import given, inputs, options, outputs, prompts, report, resume, settings, toy
from jaxkv.generate import processes as PJ
from jaxkv.generate.options import UsageError
from jaxkv.generate.preview import PreviewSink
from jaxkv.generate.report import DeviceClock, print_summary, print_written
from jaxkv.generate.settings import Settings
from jaxkv.generate.stopping import STOP_SIGNALS, Stop, stop_on_signals
from jaxkv.generate.video import Mp4Sink
from jaxkv.parallel.processes import ProcessFailed
from jaxkv.stream import Stream

__all__ = [
    "STOP_SIGNALS",
    "DeviceClock",
    "GenerationError",
    "Stop",
    "main",
    "print_summary",
    "print_written",
    "run",
    "stop_on_signals",
]

# the settings' old name here (`jaxkv.generate.settings.rollout_settings`)
_settings = settings.rollout_settings


class GenerationError(RuntimeError):
    """Generation stopped on bad numbers or a failed write (a full disk, a file-size limit); the files written
    before it are finished as far as they can be (status "failed"). ``summary`` is what summary.json holds."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


@jax.jit
def _chunk_finite(x) -> jax.Array:
    return jnp.isfinite(x).all()


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


def _stream(args, params, config, rc, session, context, negative, *, history: bool, mesh) -> Stream:
    """The stream the run draws from: ``session``'s continuation (``--resume``; UsageError when it does not fit) or
    a new stream of ``context`` / ``negative`` drawn from ``--seed``; a `jaxkv.parallel.MeshStream` on ``mesh``."""
    cls, on_mesh = (Stream, {}) if mesh is None else (PL.MeshStream, {"mesh": mesh})
    if session is not None:
        try:  # a saved latent ring comes back with the session (checked before anything runs)
            return cls.from_session(params, config, rc, session, **on_mesh, num_chunks=args.num_chunks, history=history)
        except ValueError as e:
            raise UsageError(f"--resume: {e}") from None
    return cls(
        params,
        config,
        rc,
        jnp.asarray(context),
        **on_mesh,
        num_chunks=args.num_chunks,
        key=jax.random.key(args.seed),
        negative_context=None if negative is None else jnp.asarray(negative),
        history=history,
    )


def _open_outputs(args, sources, chunk_shape, stream, decoder, vae_config, vae_params):
    """(the output directory's `outputs.OutputDir`, its `Mp4Sink` or None): the latents, the preview and the
    mp4 (decoded by ``decoder``, the toy model's, or a Wan VAE's built here from ``vae_config``), the directory
    locked for the whole run (another run refuses it, even with --overwrite: `outputs.claim_output_dir`). In a
    multi-process job only process 0 writes: the others get a `processes.Quiet` and no video."""
    if not PJ.lead():
        return PJ.Quiet(), None
    lock = outputs.claim_output_dir(args.out, overwrite=args.overwrite, sources=sources)
    try:
        sinks = [
            outputs.LatentsSink(lock.path, args.format),
            PreviewSink(os.path.join(lock.path, "preview.png"), args.preview_frames, args.preview_scale),
        ]
        if vae_config is not None:
            from jaxkv.models.wan_vae import StreamDecoder

            decoder = StreamDecoder(
                vae_params, vae_config, latent_height=args.height, latent_width=args.width, batch=args.batch
            )
        video = None
        if decoder is not None:
            video = Mp4Sink(
                lock.path, decoder, batch=args.batch, fps=args.fps_or_default, frames=args.frames, stream=stream
            )
            sinks.append(video)
        files = outputs.OutputDir(lock.path, sinks, chunk_shape=chunk_shape, latents_format=args.format, lock=lock)
        return files, video
    except BaseException:
        lock.release()
        raise


def _non_finite(index: int, x: np.ndarray) -> str:
    """Why a run stopped at chunk ``index``, whose latents ``x`` are not all finite."""
    count = int((~np.isfinite(x)).sum())
    if index:
        return f"chunk {index} holds NaN/Inf latents ({count} values); stopped, chunks 0..{index - 1} are written"
    return f"chunk 0 holds NaN/Inf latents ({count} values); stopped before writing any chunk"


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
    schedule, rc = settings.rollout_settings(args, config)
    settings.check_memory(args, config, rc)
    vae_config = None if toy_dir else inputs.resolve_vae(args, config)
    given_vae, given_vae_dir = given.vae_config(args, config, toy_dir, vae_config)
    given_frames = given.read(args, rc, toy_dir, given_vae)  # read and checked before anything is written
    entries = prompts.read_schedule(args.prompt_schedule, args.num_chunks) if args.prompt_schedule else None
    if toy_dir and entries:
        toy.check_schedule(entries)
    decoder = toy.frame_decoder(toy_dir) if toy_dir and not args.no_video else None  # a Wan VAE's: below
    sources = inputs.source_paths(args, entries)
    outputs.prepare_output_dir(args.out, overwrite=args.overwrite, create=False, sources=sources)
    resume.check_save_state(args, sources)
    mesh = _mesh(args, config, rc)
    # a resumed session holds the cross-attention K/V: only a schedule's texts are encoded
    session = None if resumed is None else resume.load(args, config, rc, schedule=entries is not None, mesh=mesh)
    texts = prompts.starting_texts(args, config, entries, resume.text_of(args, resumed), resumed=resumed is not None)
    context, negative, text_info, switches, drawing = texts
    params = inputs.load_params(args, config) if mesh is None else inputs.load_mesh_params(args, config, mesh)
    vae_params = None if vae_config is None else inputs.load_vae(args, vae_config)
    if stop.signum is not None:
        return {"status": "interrupted", "signal": signal.Signals(stop.signum).name, "chunks_written": 0}

    # the latent history a switch re-caches from, kept for a schedule or a saved session (which then holds it)
    history = entries is not None or resume.keeps_ring(args, rc)
    stream = _stream(args, params, config, rc, session, context, negative, history=history, mesh=mesh)
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
    PJ.meet("loading the inputs")  # every process loaded its inputs (else none opens anything)
    with PJ.together("opening the outputs"):
        # a multi-process job: process 0 alone writes the outputs
        files, video = _open_outputs(args, sources, chunk_shape, stream, decoder, vae_config, vae_params)
    summary = report.start(args, config, source, schedule, rc, mesh, stream, toy_dir, text_info, session is not None)
    if given_info is not None:
        summary["given"] = given_info
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.num_chunks, unit="chunk", desc="generate", file=sys.stderr)
    status, reason, timing, clock = "complete", None, report.Timing(), DeviceClock()
    try:
        with PJ.together("starting the video decoder"):
            if video is not None:  # inside the try: a failure here still finalises the files
                summary["vae_warm_up_s"] = video.warm_up(chunk_shape)
                # the decoder's state lives in the stream's carry (a resumed session's VAE caches, or fresh), so
                # the saved session holds it (in a multi-process job process 0's: `resume.save`)
                resume.continue_video(stream, video.decoder, resumed=session is not None)
                if given_context is not None:  # the decoder carries on from the given frames (not written)
                    video.decode(given_context.latents)
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
                timing.add(latency, device_s, now)
                if not finite:
                    status, reason = "failed", _non_finite(index, x)
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
                summary["session"] = resume.save(args, stream, files.chunks, text=drawing)
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
    summary.update(
        latents_shape=[args.batch, files.chunks * rc.chunk_frames, *chunk_shape[2:]],
        **timing.figures(),
        compilations=compiles(),
    )
    if entries is not None:
        summary["switch_compilations"] = switch_compiles()
    if stop.signum is not None:
        summary["signal"] = signal.Signals(stop.signum).name
    try:
        with PJ.together("closing the outputs"):
            summary = files.close(status, summary, reason)
            timing.add_rates(summary, rc.chunk_frames, video)
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
