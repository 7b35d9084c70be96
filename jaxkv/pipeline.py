"""`Pipeline`: a loaded model that streams decoded video frames chunk by chunk, for Python users and `jaxkv serve`.

    pipe = Pipeline.from_pretrained()                 # the toy world shipped in the package (`jaxkv generate`'s)
    stream = pipe.start("a red circle and a blue square, slow", seed=0)
    frames = stream.step()                            # uint8 [frames, H, W, 3]: the next chunk, decoded
    stream.switch_prompt("a green triangle, fast")    # from the next chunk on (KV re-cache)
    stream.save("session_dir")                        # ... later: Pipeline.resume("session_dir")

Nothing is reimplemented here: the model, its settings and its decoder are resolved by the same functions
``jaxkv generate`` uses (`jaxkv.generate.toy`, `jaxkv.generate.inputs`), so a pipeline stream of a prompt and seed
draws exactly the chunks ``jaxkv generate --prompt P --seed S`` writes; a stream drives a `jaxkv.stream.Stream`
(whose prompt switches re-cache the retained frames as ``--prompt-schedule`` does); the frames come from the
release's decoder (the toy world's latent map, or a converted release's Wan VAE, whose feature caches continue from
chunk to chunk); `save` / `Pipeline.resume` are `jaxkv.session` sessions.

A saved pipeline session holds, beside the stream state, the clean latents of the chunks the cache retains (the
`jaxkv.recache.LatentRing`, extras entry ``latent_ring``) so that a resumed stream can switch prompts at once, the
VAE decoder's caches for a Wan release, and in its metadata (``metadata["pipeline"]``) the model, precision,
settings, seed and prompt history. A resumed stream continues bit for bit: its frames are those the uninterrupted
stream would have drawn. A session saved by ``jaxkv generate --save-state`` resumes too (its prompt and seed are
read from its settings, its latent ring restored). A session without a latent ring (saved by an older jaxkv) can
switch prompts only once the cache's retained chunks were all generated after the resume.

Streams are batch 1 and not thread-safe: step one stream from one thread at a time (`jaxkv serve` runs every
stream's work on one worker thread).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import decoding, recache
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.stream import Stream
from jaxkv.validate import check_int, shorten, utf8_problem

RING = recache.RING_EXTRA  # the session extras entry of the latent ring
METADATA = "pipeline"  # the session metadata entry
# from_pretrained's keyword settings: ``jaxkv generate`` flags (their destinations) that shape the stream.
SETTINGS = (
    "height",
    "width",
    "chunk_frames",
    "window_frames",
    "sink_frames",
    "policy",
    "steps",
    "shift",
    "context_noise",
    "rope",
    "guidance_scale",
    "negative_prompt",
    "text_encoder",
    "vae",
    "fps",
)


class PipelineError(RuntimeError):
    """A stream produced non-finite latents (NaN / Inf) for a chunk."""


class _ClassOrInstanceMethod:
    """A method that receives the class when called on the class and the instance when called on one (so
    ``Pipeline.resume(path)`` loads the session's model, and ``pipe.resume(path)`` reuses ``pipe``)."""

    def __init__(self, func):
        self.func = func
        functools.update_wrapper(self, func)

    def __get__(self, obj, cls):
        return functools.partial(self.func, cls if obj is None else obj)


@jax.jit
def _finite(latents) -> jax.Array:
    """bool []: every latent is finite."""
    return jnp.isfinite(latents).all()


class Pipeline:
    """A model, its settings, its text encoder and its frame decoder, loaded once; `start` makes streams.

    Build with `from_pretrained`. Attributes: ``config`` (`jaxkv.models.wan.WanConfig`), ``rc``
    (`jaxkv.rollout.RolloutConfig`), ``params``, ``fps``, ``default_prompt``, ``frame_shape`` (H, W, 3), ``model``
    (the release directory, None for the embedded toy world), ``toy`` (a toy-world release: prompts must parse as
    toy-world prompts).
    """

    def __init__(
        self,
        *,
        params,
        config,
        rc: R.RolloutConfig,
        text_encoder,
        decoder,
        vae: tuple[Any, Any] | None,
        fps: int,
        default_prompt: str,
        negative_prompt: str | None,
        model: str | None,
        toy: bool,
        precision: str,
        settings: dict,
        frame_shape: tuple[int, int, int],
        source: str,
    ):
        self.params, self.config, self.rc = params, config, rc
        self.text_encoder = text_encoder
        self._decoder = decoder  # the toy world's stateless FrameDecoder, shared by every stream (None for a VAE)
        self._vae = vae  # (params, config) of a Wan VAE: one StreamDecoder per stream
        self.fps, self.default_prompt, self.negative_prompt = fps, default_prompt, negative_prompt
        self.model, self.toy, self.precision, self.settings = model, toy, precision, settings
        self.frame_shape, self.source = frame_shape, source

    # ---------------------------------------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(
        cls, path: str | None = None, *, precision: str = "float32", backend: str = "auto", **settings
    ) -> "Pipeline":
        """Loads a model as ``jaxkv generate --checkpoint PATH --precision PRECISION`` would.

        Args:
          path: None for the toy world shipped in the package (``jaxkv generate``'s default); a toy-world release
            directory; or a converted release (`jaxkv convert`: ``dit/``, ``vae/``, ``text_encoder/``).
          precision: "float32", "bfloat16" or "fp8" (`jaxkv.precision` presets).
          backend: the attention backend (`jaxkv.attend`'s names; "auto" picks per platform).
          settings: ``jaxkv generate`` flags by destination (`SETTINGS`: height, width, chunk_frames,
            window_frames, sink_frames, policy, steps, shift, context_noise, rope, guidance_scale,
            negative_prompt, text_encoder, vae, fps); a toy-world release fills those not given from its own.
        Raises ValueError naming the problem (nothing is loaded before the settings check out).
        """
        from jaxkv.generate import inputs, options, toy
        from jaxkv.generate.options import UsageError
        from jaxkv.generate.settings import resolve, rollout_settings
        from jaxkv.toyworld import model as toy_model

        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(f"from_pretrained got unknown settings {unknown}; it takes {list(SETTINGS)}")
        if not isinstance(backend, str):
            raise ValueError(f"backend must be a string, got {backend!r}")
        checkpoint = None if path is None else os.fspath(path)
        if precision not in options.PRECISIONS:
            raise ValueError(f"precision must be one of {list(options.PRECISIONS)}, got {precision!r}")
        if checkpoint is not None and not os.path.isdir(checkpoint):
            raise ValueError(f"Pipeline.from_pretrained: {checkpoint} is not a directory")
        given = {k: v for k, v in settings.items() if v is not None}
        for dest in ("text_encoder", "vae"):  # recorded in saved sessions: absolute, to resume from anywhere
            if dest in given:
                given[dest] = os.path.abspath(os.fspath(given[dest]))
        flags = {"precision": precision, **given, **({} if checkpoint is None else {"checkpoint": checkpoint})}
        if checkpoint is not None and not toy_model.is_release(checkpoint):
            flags["prompt"] = ""  # a Wan release: the pipeline encodes prompts, so it needs the text encoder
        if flags.get("guidance_scale") is not None:
            flags.setdefault("negative_prompt", "")
        try:
            args = resolve(flags, backend=backend)  # the settings as jaxkv generate resolves them: frozen
            toy_dir = args.toy_dir
            config, source = inputs.resolve_config(args)
            _, rc = rollout_settings(args, config)
            vae_config = None if toy_dir else inputs.resolve_vae(args, config)
            params = inputs.load_params(args, config)
            encoder = inputs.text_encoder(args, config)
            decoder = toy.frame_decoder(toy_dir) if toy_dir else None
            vae = None if vae_config is None else (inputs.load_vae(args, vae_config), vae_config)
        except UsageError as e:
            raise ValueError(f"Pipeline.from_pretrained({path!r}): {e}") from None
        h, w = rc.latent_height, rc.latent_width
        scale = 4 if toy_dir else 8  # the latent map's 4x4 patches; the Wan VAE's 8x spatial compression
        release = args.release or args.checkpoint
        shipped = path is None or os.path.abspath(release) == os.path.abspath(toy_model.RELEASE_DIR)
        return cls(
            params=params,
            config=config,
            rc=rc,
            text_encoder=encoder,
            decoder=decoder,
            vae=vae,
            fps=args.fps_or_default,
            default_prompt=args.prompt,
            negative_prompt=args.negative_prompt if args.guidance_scale is not None else None,
            model=None if shipped else os.path.abspath(release),
            toy=toy_dir is not None,
            precision=precision,
            settings={k: list(v) if k == "steps" else v for k, v in given.items()},
            frame_shape=(scale * h, scale * w, 3),
            source=source,
        )

    # ---------------------------------------------------------------------------------------------- text

    def check_prompt(self, prompt, what: str = "prompt") -> str:
        """``prompt`` if this model takes it; ValueError naming the problem otherwise (a toy-world model takes only
        toy-world prompts, and names its vocabulary)."""
        if not isinstance(prompt, str):
            raise ValueError(f"{what} must be a string, got {type(prompt).__name__}")
        problem = utf8_problem(prompt)
        if problem:
            raise ValueError(f"{what} {shorten(prompt.encode('utf-8', 'replace').decode())}: {problem}")
        if self.toy and not (what == "negative_prompt" and prompt == ""):
            from jaxkv.generate import toy
            from jaxkv.generate.options import UsageError

            try:
                toy.check_prompt(prompt, what)
            except UsageError as e:
                raise ValueError(str(e)) from None
        return prompt

    def encode(self, prompts: list[str]) -> np.ndarray:
        """float32 [len(prompts), text_len, text_dim]: the text contexts (one encoder call)."""
        return np.asarray(self.text_encoder.encode(list(prompts)), np.float32)

    # ---------------------------------------------------------------------------------------------- streams

    def _new_decoder(self):
        if self._vae is None:
            return self._decoder
        from jaxkv.models.wan_vae import StreamDecoder

        return StreamDecoder(
            self._vae[0], self._vae[1], latent_height=self.rc.latent_height, latent_width=self.rc.latent_width
        )

    def start(
        self,
        prompt: str | None = None,
        *,
        seed: int = 0,
        negative_prompt: str | None = None,
        num_chunks: int | None = None,
        image=None,
        video=None,
    ) -> "PipelineStream":
        """A new stream of ``prompt`` (default: the model's default prompt) drawn from ``seed``; ``num_chunks``
        None streams forever. ``negative_prompt`` only with guidance (default: the model's). Nothing is computed
        until `PipelineStream.step` but the text contexts and the stream's empty state.

        ``image`` / ``video`` (one of them; ``jaxkv generate --image`` / ``--video``): the stream continues these
        frames instead of starting from noise. Either a file path (anything PyAV decodes) or uint8 RGB frames
        (``image`` [H, W, 3], ``video`` [T, H, W, 3]) of any size: they are mapped to the stream's frame size, cut
        or padded to whole chunks, encoded and committed as the stream's first chunks (`jaxkv.continuation`), so
        ``chunk_index`` starts after them and the first `step` returns the frames that follow. ValueError
        (`jaxkv.continuation.ContinuationError`) naming the problem, before any model work, for frames that
        cannot be read or mapped."""
        if image is not None and video is not None:
            raise ValueError("start: image and video both give the frames to continue; pass one")
        given = self._given_frames(image, video)  # read and checked before the prompt is encoded
        prompt = self.check_prompt(self.default_prompt if prompt is None else prompt)
        seed = check_int("seed", seed, minimum=0)
        if num_chunks is not None:
            num_chunks = check_int("num_chunks", num_chunks, minimum=1)
        guided = self.rc.guidance_scale is not None
        if negative_prompt is not None and not guided:
            raise ValueError("negative_prompt needs a model run with guidance (from_pretrained(guidance_scale=...))")
        negative = (self.negative_prompt if negative_prompt is None else negative_prompt) if guided else None
        if negative is not None:
            self.check_prompt(negative, "negative_prompt")
        encoded = self.encode([prompt] + ([negative] if guided else []))
        try:
            stream = Stream(
                self.params,
                self.config,
                self.rc,
                jnp.asarray(encoded[:1]),
                num_chunks=num_chunks,
                key=jax.random.key(seed),
                negative_context=jnp.asarray(encoded[1:2]) if guided else None,
            )
        except ValueError as e:
            raise ValueError(f"start: {e}") from None
        decoder = self._new_decoder()
        info = None
        if given is not None:
            info = self._commit_given(stream, decoder, *given)
        out = PipelineStream(self, stream, decoder, prompt, negative, seed)
        out.given = info
        return out

    def frame_encoder(self):
        """The encoder that turns frames into this model's latents (`jaxkv.continuation`): the toy world's latent
        map, or the Wan VAE's encoder (ContinuationError for a VAE loaded without one)."""
        from jaxkv import continuation as C

        if self._vae is None:
            return C.ToyEncoder(self._decoder.latent_map)
        return C.WanEncoder(*self._vae)

    def _given_frames(self, image, video):
        """(kind, uint8 frames [T, H, W, 3] at the stream's frame size, source (path or None), source size) for
        ``start``'s image / video, or None. ContinuationError naming the problem."""
        from jaxkv import continuation as C

        if image is None and video is None:
            return None
        kind, given = ("image", image) if image is not None else ("video", video)
        height, width = self.frame_shape[:2]
        if isinstance(given, (str, os.PathLike)):
            path = os.fspath(given)
            read = C.read_frames(path, height, width, image=kind == "image")
            return kind, read.frames, os.path.abspath(path), read.source_size
        frames = np.asarray(given)
        if kind == "image" and frames.ndim != 3:
            raise C.ContinuationError(f"image must be one uint8 RGB frame [H, W, 3], got {list(frames.shape)}")
        if kind == "video" and frames.ndim != 4:
            raise C.ContinuationError(f"video must be uint8 RGB frames [T, H, W, 3], got {list(frames.shape)}")
        size = tuple(int(x) for x in frames.shape[-3:-1])
        return kind, C.fit_frames(frames, height, width), None, size

    def _commit_given(self, stream, decoder, kind, frames, path, source_size) -> dict:
        """Encodes the given frames, commits them as the stream's first chunks and runs the decoder over them (a
        Wan VAE's caches then continue them); returns what the stream records of them."""
        from jaxkv import continuation as C

        context = C.context_from_frames(frames, self.frame_encoder(), self.rc)
        stream.commit(context.latents)
        C.prime_decoder(decoder, context.latents)
        return {
            "kind": kind,
            "path": path,
            "source_size": list(source_size),
            "source_frames": int(frames.shape[0]),
            "frames_used": int(context.frames.shape[1]),
            "padded": context.padded,
            "dropped": context.dropped,
            "chunks": context.chunks,
        }

    def stream(
        self,
        prompt: str | None = None,
        num_chunks: int | None = None,
        *,
        seed: int = 0,
        negative_prompt: str | None = None,
        image=None,
        video=None,
    ) -> Iterator[np.ndarray]:
        """Yields each chunk's decoded frames uint8 [frames, H, W, 3] (``num_chunks`` chunks; None: forever);
        ``image`` / ``video`` as in `start`."""
        s = self.start(
            prompt, seed=seed, negative_prompt=negative_prompt, num_chunks=num_chunks, image=image, video=video
        )
        yield from s

    @_ClassOrInstanceMethod
    def resume(self_or_cls, path: str, *, num_chunks: int | None = None, **load) -> "PipelineStream":
        """Continues a saved session (`PipelineStream.save`, or ``jaxkv generate --save-state``).

        Called on the class (``Pipeline.resume(path)``) it first loads the model the session names (``load``:
        `from_pretrained` keywords overriding the recorded ones); called on a pipeline it continues on that
        pipeline, whose settings must be the session's (`jaxkv.session.SessionError` naming every difference).
        ``num_chunks`` counts the chunks of the continuation (None: forever)."""
        path = os.fspath(path)
        try:
            meta = S.read_metadata(path)
        except S.SessionError as e:
            raise ValueError(f"resume: {e}") from None
        recorded = _recorded(meta, path)
        if isinstance(self_or_cls, Pipeline):
            if load:
                raise TypeError("pipe.resume takes no loading keywords; Pipeline.resume(path, ...) does")
            pipe = self_or_cls
        else:
            kwargs = {
                "precision": recorded["precision"],
                "backend": recorded["backend"],
                **recorded["settings"],
                **load,
            }
            pipe = self_or_cls.from_pretrained(recorded["model"], **kwargs)
        session = S.load(path, pipe.config, pipe.rc)
        vae_extra = session.extras.get(S.VAE_DECODER)
        if num_chunks is not None:
            num_chunks = check_int("num_chunks", num_chunks, minimum=1)
        decoder = pipe._new_decoder()  # (a Wan VAE's state: the session's, which the stream carries)
        if pipe._vae is not None and vae_extra is None:
            raise ValueError(
                f"resume: {path} holds no VAE decoder state (saved without video), so the frames cannot continue"
            )
        try:  # the session's latent ring, if it saved one, comes back with it (checked first)
            stream = Stream.from_session(pipe.params, pipe.config, pipe.rc, session, num_chunks=num_chunks)
        except S.SessionError:
            raise
        except ValueError as e:
            raise ValueError(f"resume: {path}: {e}") from None
        try:  # the decoder continues the session's VAE caches (checked to fit)
            s = PipelineStream(pipe, stream, decoder, recorded["prompt"], recorded["negative_prompt"], recorded["seed"])
        except ValueError as e:
            raise ValueError(f"resume: {path}: {e}") from None
        s.switches = [tuple(x) for x in recorded["switches"]] or [(int(session.next_chunk), recorded["prompt"])]
        s.given = recorded.get("given")
        return s


def _recorded(meta: dict, path: str) -> dict:
    """What a session's metadata says about its pipeline: model, precision, backend, settings, prompt, negative
    prompt, seed, switches. A session of ``jaxkv generate --save-state`` is read from its recorded flags."""
    if isinstance(meta.get(METADATA), dict):
        return meta[METADATA]
    flags = meta.get("generate")
    if isinstance(flags, dict) and flags.get("checkpoint") and flags.get("prompt") is not None:
        from jaxkv.toyworld import model as toy_model

        checkpoint = flags["checkpoint"]
        shipped = os.path.abspath(checkpoint) == os.path.abspath(toy_model.RELEASE_DIR)
        settings = {k: flags[k] for k in SETTINGS if flags.get(k) is not None and k not in ("vae", "text_encoder")}
        return {
            "model": None if shipped else checkpoint,
            "precision": flags.get("precision", "float32"),
            "backend": "auto",
            "settings": settings,
            "prompt": flags["prompt"],
            "negative_prompt": flags.get("negative_prompt"),
            "seed": flags.get("seed", 0),
            "switches": [],
        }
    raise ValueError(
        f"resume: {path} is a jaxkv session but records no pipeline (nor a jaxkv generate run with --prompt); "
        f"continue it with jaxkv.stream.Stream.from_session"
    )


class PipelineStream:
    """One stream of a `Pipeline`: `step` for the next chunk's frames, `switch_prompt`, `save`, `fork`.

    Properties: ``chunk_index`` (the index of the next chunk, counted from the stream's start), ``prompt`` (the
    prompt the next chunk is drawn under), ``switches`` (list of (chunk index, prompt): where each prompt took
    effect), ``seed``, ``fps``, ``frame_shape`` (H, W, 3), ``given`` (a stream started from an image or video: how
    its frames were used, the committed chunks included; else None). Iterating yields `step` until ``num_chunks``
    are done.
    """

    def __init__(self, pipeline: Pipeline, stream: Stream, decoder, prompt, negative, seed):
        self.pipeline, self._stream, self._decoder = pipeline, stream, decoder
        # a Wan VAE's feature caches are carried by the stream: a new stream takes its decoder's fresh (or primed)
        # state, a resumed or forked one's decoder continues the carried state
        decoding.adopt(stream, decoder)
        self.prompt, self.negative_prompt, self.seed = prompt, negative, seed
        self.switches: list[tuple[int, str]] = [(stream.index, prompt)]
        self.given: dict | None = None  # what `Pipeline.start` committed from an image / video (None: from noise)

    @property
    def chunk_index(self) -> int:
        return self._stream.index

    @property
    def fps(self) -> int:
        return self.pipeline.fps

    @property
    def frame_shape(self) -> tuple[int, int, int]:
        return self.pipeline.frame_shape

    @property
    def remaining(self) -> int | None:
        """Chunks left before the stream's ``num_chunks`` are done (None: endless)."""
        s = self._stream
        return None if s.num_chunks is None else s.num_chunks - (s.index - s.start)

    def step(self) -> np.ndarray:
        """Generates and decodes the next chunk: uint8 [frames, H, W, 3] (the toy world: one frame per latent frame;
        a Wan VAE: 4 per latent frame, 3 fewer on a stream's first chunk). StopIteration once ``num_chunks`` are done;
        `PipelineError` for a chunk of non-finite latents."""
        index = self._stream.index
        x = next(self._stream)
        frames, finite = jax.device_get((self._decode(x), _finite(x)))  # the decode `jaxkv generate`'s mp4 runs
        if not finite:
            raise PipelineError(f"chunk {index} holds NaN/Inf latents")
        return np.asarray(frames[0])

    @property
    def frames_per_chunk(self) -> int:
        """Frames the next `step` returns: one per latent frame for the toy world; a Wan VAE's 4 per latent frame,
        3 fewer on a stream's first chunk."""
        t = self.pipeline.rc.chunk_frames
        return 4 * t - (3 if self._decoder.first else 0) if self._vae_stateful else t

    @property
    def _vae_stateful(self) -> bool:
        return self.pipeline._vae is not None

    def _decode(self, x):
        """The decoder's frames of the chunk ``x``, from the decoder state the stream carries (`jaxkv.decoding`), so
        a save or fork of the stream takes the decoder with it."""
        return decoding.decode(self._stream, self._decoder, x)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        return self.step()

    def switch_prompt(self, prompt: str, *, keep_sink: bool = True) -> int:
        """Draws the chunks from the next one on under ``prompt``, re-caching the frames the cache retains
        (`jaxkv.recache`, as ``jaxkv generate --prompt-schedule`` does); returns the chunk index it applies from.
        ValueError (the stream untouched) for a prompt the model does not take."""
        prompt = self.pipeline.check_prompt(prompt)
        if not isinstance(keep_sink, bool):
            raise ValueError(f"keep_sink must be a bool, got {keep_sink!r}")
        guided = self.pipeline.rc.guidance_scale is not None
        encoded = self.pipeline.encode([prompt] + ([self.negative_prompt] if guided else []))
        self._stream.switch_prompt(
            jnp.asarray(encoded[:1]), jnp.asarray(encoded[1:2]) if guided else None, keep_sink=keep_sink
        )
        self.prompt = prompt
        index = self._stream.index
        if self.switches and self.switches[-1][0] == index:
            self.switches[-1] = (index, prompt)
        else:
            self.switches.append((index, prompt))
        return index

    def metadata(self) -> dict:
        """What `save` records in ``metadata["pipeline"]``."""
        p = self.pipeline
        return {
            "model": p.model,
            "precision": p.precision,
            "backend": p.rc.backend,
            "settings": p.settings,
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "seed": self.seed,
            "switches": [list(x) for x in self.switches],
            "fps": p.fps,
            "given": self.given,
        }

    def save(self, path: str, *, overwrite: bool = False) -> str:
        """Saves the stream before its next chunk to the directory ``path`` (atomically; an existing session there
        only with ``overwrite``); returns its absolute path. The stream goes on unchanged."""
        session = self._stream.session(copy=False)  # the latent ring and a VAE's state included
        return S.save(os.fspath(path), session, force=overwrite, metadata={METADATA: self.metadata()})

    def fork(self) -> "PipelineStream":
        """An independent copy of this stream at its current chunk (its own buffers): stepping either one leaves
        the other as it was; both draw the same chunks until one switches prompts."""
        if self.remaining == 0:
            raise ValueError("fork: the stream has generated all its num_chunks; there is nothing left to fork")
        twin = self._stream.fork()  # its copy of the carried state holds a VAE decoder's
        decoder = self.pipeline._new_decoder() if self._vae_stateful else self._decoder
        out = PipelineStream(self.pipeline, twin, decoder, self.prompt, self.negative_prompt, self.seed)
        out.switches = list(self.switches)
        out.given = self.given
        return out


__all__ = ["Pipeline", "PipelineError", "PipelineStream"]
