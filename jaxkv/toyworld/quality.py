"""The quality bar a toy model must clear: a short stream of fixed prompts, scored by `jaxkv.toyworld.metric`.

`check(model)` streams `PROMPTS` for `FRAMES` frames (seed 0, the model's own settings) and compares the mean
overall score with `THRESHOLD`. The threshold comes from the two ends of the scale measured on the same prompts:
the world's own clips (rendered by `world`, passed through the latent map) score 1.0, and the same architecture with
random weights scores 0.0 (noise: nothing of any colour survives detection); `THRESHOLD` is their midpoint, 0.5,
so passing means the model gets at least half of its frames' objects and motions right on average. The test
(`tests/test_toyworld_quality.py`) checks both ends and the shipped model; ``jaxkv toyworld check DIR`` checks a
retrained one.

`tracking` is a second, stricter reading that the metric cannot give: a stream of a prompt is meant to show that
prompt's `world.canonical_scene`, so each named object's detected centre can be compared with where the world puts
it (`world.paths`). The metric only judges what is plausible from the prompt, and it forgives an object missing
under another one for a while (it reads later-named shapes as on top): a model that merges two shapes into one blob
once they meet can score well on it while tracking shows the loss. It is reported beside the bar, not part of it.

`next_chunk` reads the one step a stream repeats: given the world's own frames as context (a full cache of them),
how far from the world's are the shapes of the chunk the model samples next, against the same frames held still.
A model that has not learnt motion draws its chunks no better than the still frame. `denoising_errors` reads the
same chunks one level down: the error of the model's x0 prediction at each of its sampler's noise levels, so it
shows which step falls short (at level 1 the input holds nothing of the chunk: that step decides the motion).

`default_stream` reads the stream a user sees first (``jaxkv generate``'s default prompt, 600 frames): each named
shape drawn in nearly every frame, travelling and roaming like the world's, and faster when the prompt says "fast".

`survey` streams 16 prompts x 2 seeds: a steadier reading than the bar's 4 streams when comparing recipes.
`long_streams` streams the bar's prompts for 300 frames and scores every 30: the bar's 48 frames hide what happens
after them (a model whose shapes stop moving, or fade into the empty box, can look fine there).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jaxkv.toyworld import metric, sample, world
from jaxkv.toyworld.model import ToyModel
from jaxkv.validate import check_int

PROMPTS = (
    "a red circle and a blue square, slow",
    "a green triangle, fast",
    "a yellow square and a red triangle, fast",
    "a blue circle, slow",
)
FRAMES = 48  # per prompt (16 chunks of the shipped model)
SEED = 0
THRESHOLD = 0.5
TRACK_RADIUS = 3.0  # px from the true centre for `tracking` (5 x the metric's CENTROID_ERROR: a slow shape's 3 frames)


NEXT_CLIPS = 48  # clips of `next_chunk`
NEXT_START = 2000  # `next_chunk`'s chunks start anywhere before this frame of their scene


class Report(NamedTuple):
    overall: float  # mean over PROMPTS of each stream's overall score
    per_prompt: tuple[dict, ...]  # {"prompt", "adherence", "continuity", "overall", "tracking"}
    passed: bool
    tracking: float  # mean over PROMPTS of `tracking` (not part of the bar)


def tracking(video: np.ndarray, prompt: str) -> float:
    """The fraction of (frame, named object) pairs of ``video`` uint8 [T, 64, 64, 3] in which the object's colour
    is detected within `TRACK_RADIUS` px of the object's centre in the prompt's `world.canonical_scene` (the
    world's shapes bounce off each other and never hide one another: its own clips score 1 up to detection)."""
    detections = metric.detect(video)
    scene = world.canonical_scene(prompt)
    hits = []
    for thing, path in zip(scene.things, np.moveaxis(world.paths(scene, len(video)), 1, 0)):
        centre = detections.centroid[:, metric.COLOUR_NAMES.index(thing.colour)]  # NaN where absent
        error = np.linalg.norm(centre - path, axis=-1)
        hits.append(np.nan_to_num(error, nan=np.inf) <= TRACK_RADIUS)
    return float(np.mean(hits))


def scores_of(videos: np.ndarray, prompts, chunk_frames: int) -> Report:
    """Report of ``videos`` uint8 [len(prompts), T, 64, 64, 3] (one per prompt)."""
    rows = []
    for video, prompt in zip(videos, prompts):
        s = metric.score(video, prompt, chunk_frames=chunk_frames, window_chunks=max(1, len(video) // chunk_frames))
        rows.append(
            {
                "prompt": prompt,
                "adherence": s.adherence,
                "continuity": s.continuity,
                "overall": s.overall,
                "tracking": tracking(video, prompt),
            }
        )
    overall = float(np.mean([r["overall"] for r in rows]))
    return Report(overall, tuple(rows), overall >= THRESHOLD, float(np.mean([r["tracking"] for r in rows])))


def check(model: ToyModel, *, frames: int = FRAMES, seed: int = SEED) -> Report:
    """Streams `PROMPTS` with the model for ``frames`` frames (whole chunks) and scores them."""
    return _streamed(model, PROMPTS, frames, seed)


def _streamed(model: ToyModel, prompts, frames: int, seed: int) -> Report:
    """`scores_of` the model's streams of ``prompts`` for ``frames`` frames (whole chunks) with ``seed``."""
    chunk_frames = model.settings.chunk_frames
    if frames % chunk_frames:
        raise ValueError(f"frames ({frames}) must be a whole number of the model's {chunk_frames}-frame chunks")
    videos = sample.video(model, list(prompts), num_chunks=frames // chunk_frames, seed=seed)
    return scores_of(videos, prompts, chunk_frames)


SURVEY_PROMPTS = 16  # `survey`: the check's prompts and 12 more
SURVEY_SEEDS = 2


class Survey(NamedTuple):
    overall: float  # mean overall score over every (prompt, seed) stream
    tracking: float  # mean tracking over the same streams
    by_seed: tuple[float, ...]  # mean overall of each seed's streams (their spread is the reading's noise)
    prompts: tuple[str, ...]


def survey_prompts(count: int = SURVEY_PROMPTS) -> tuple[str, ...]:
    """`PROMPTS`, then distinct random prompts (`world.random_prompt`, a fixed draw) up to ``count``."""
    c, s = len(world.COLOURS), len(world.SHAPES)
    distinct = len(world.SPEEDS) * sum(math.perm(c, n) * s**n for n in range(1, world.MAX_OBJECTS + 1))
    count = check_int("count", count, minimum=len(PROMPTS), maximum=distinct)
    rng = np.random.default_rng([SEED, count])
    prompts = list(PROMPTS)
    while len(prompts) < count:
        prompt = world.random_prompt(rng)
        if prompt not in prompts:
            prompts.append(prompt)
    return tuple(prompts)


def survey(
    model: ToyModel, *, prompts: int = SURVEY_PROMPTS, seeds: int = SURVEY_SEEDS, frames: int = FRAMES
) -> Survey:
    """A steadier reading than `check` for comparing models (not the bar): ``prompts`` prompts (`survey_prompts`)
    streamed with each of ``seeds`` seeds (`SEED`, `SEED` + 1, ...) for ``frames`` frames, scored as `check` scores
    its streams. The check's 4 streams move by a few hundredths between models that differ only by noise; the
    spread of `Survey.by_seed` shows how much. With ``prompts=4, seeds=1`` it is `check`'s streams exactly."""
    seeds = check_int("seeds", seeds, minimum=1)
    chosen = survey_prompts(check_int("prompts", prompts, minimum=len(PROMPTS)))
    reports = [_streamed(model, chosen, frames, SEED + i) for i in range(seeds)]
    return Survey(
        float(np.mean([r.overall for r in reports])),
        float(np.mean([r.tracking for r in reports])),
        tuple(r.overall for r in reports),
        chosen,
    )


LONG_FRAMES = 300  # `long_streams`: frames per prompt (100 chunks of the shipped model) ...
LONG_WINDOW = 30  # ... scored per window of this many frames


class LongStreams(NamedTuple):
    """`long_streams`' reading, per window of `LONG_WINDOW` frames (means over the prompts)."""

    window_frames: int
    overall: np.ndarray  # float64 [windows]: the metric's overall score of each window (`metric.Scores`)
    continuity: np.ndarray  # float64 [windows]: its continuity part
    seen: np.ndarray  # float64 [windows]: the share of (frame, named shape) pairs whose colour is detected
    # float64 [windows]: the share of named shapes whose detected centre spans `metric.STOP_SPAN` px per
    # `metric.STOP_FRAMES` frames of the window (6 px over 30): the metric's travel check, read per window
    moving: np.ndarray


def _check_windows(frames: int, window_frames: int, chunk_frames: int) -> int:
    """``window_frames``, checked: whole chunks, dividing ``frames``."""
    window_frames = check_int("window_frames", window_frames, minimum=2)
    if window_frames % chunk_frames or frames % window_frames:
        raise ValueError(
            f"windows of {window_frames} frames must be whole {chunk_frames}-frame chunks and divide "
            f"the {frames} frames"
        )
    return window_frames


def long_scores(videos: np.ndarray, prompts, chunk_frames: int, window_frames: int = LONG_WINDOW) -> LongStreams:
    """`LongStreams` of ``videos`` uint8 [len(prompts), T, 64, 64, 3], T a multiple of ``window_frames``, itself a
    multiple of ``chunk_frames``."""
    window_frames = _check_windows(videos.shape[1], window_frames, chunk_frames)
    travel = metric.STOP_SPAN * window_frames / metric.STOP_FRAMES  # px a moving shape spans in a window
    overall, continuity, seen, moving = [], [], [], []
    for video, prompt in zip(videos, prompts):
        s = metric.score(video, prompt, chunk_frames=chunk_frames, window_chunks=window_frames // chunk_frames)
        overall.append(s.window_overall)
        continuity.append(s.window_continuity)
        named = [metric.COLOUR_NAMES.index(t.colour) for t in world.canonical_scene(prompt).things]
        found = metric.detect(video)
        seen.append(found.present[:, named].mean(axis=1).reshape(-1, window_frames).mean(axis=1))
        centres = found.centroid[:, named].reshape(-1, window_frames, len(named), 2)  # [windows, frames, N, 2]
        here = ~np.isnan(centres)
        span = np.where(here, centres, -np.inf).max(axis=1) - np.where(here, centres, np.inf).min(axis=1)
        moving.append((span.max(axis=-1) >= travel).mean(axis=1))  # -inf: never seen
    return LongStreams(window_frames, *(np.mean(x, axis=0) for x in (overall, continuity, seen, moving)))


def long_streams(
    model: ToyModel, *, frames: int = LONG_FRAMES, window_frames: int = LONG_WINDOW, seed: int = SEED
) -> LongStreams:
    """Streams `PROMPTS` for ``frames`` frames (seed ``seed``, the model's settings) and scores each window of
    ``window_frames`` frames (`long_scores`): whether the shapes stay drawn, and keep moving, past the bar's
    `FRAMES`."""
    chunk_frames = model.settings.chunk_frames
    frames = check_int("frames", frames, minimum=2)
    window_frames = _check_windows(frames, window_frames, chunk_frames)  # before streaming anything
    videos = sample.video(model, list(PROMPTS), num_chunks=frames // chunk_frames, seed=seed)
    return long_scores(videos, PROMPTS, chunk_frames, window_frames)


def world_videos(
    model: ToyModel, *, frames: int = FRAMES, seed: int = SEED, canonical: bool = False, prompts=PROMPTS
) -> np.ndarray:
    """The world's own clips of ``prompts`` through the model's latent map: uint8 [prompts, frames, 64, 64, 3] (the
    top of the scale): random scenes of the prompts (`world.sample_scene`), or with ``canonical`` the scenes a
    stream is meant to show (`world.canonical_scene`, the top of `tracking`'s scale)."""
    rng = np.random.default_rng(seed)
    clips = np.stack(
        [world.render(world.canonical_scene(p) if canonical else world.sample_scene(rng, p), frames) for p in prompts]
    )
    return np.asarray(model.latent_map.decode_uint8(model.latent_map.encode(clips)))


TRAVEL_FRAMES = 300  # `travel`: frames per prompt (100 chunks of the shipped model)
TRAVEL_RATIO = 0.6  # the least share of the world's travel, and of its roam, each named shape must reach


class Travel(NamedTuple):
    """`travel`'s reading: how far each named shape gets per `metric.TRAVEL_FRAMES` frames (median over the stream,
    `metric.travel`) and how far across the box it gets over the whole stream (`metric.roam`), in the model's stream
    and in the world's canonical scene of the same prompt through the model's latent map, one row per (prompt,
    named shape). Both readings are needed: a shape looping near its start at the world's speed can travel like
    the world per window and roam a fraction of the box."""

    rows: tuple[dict, ...]  # {"prompt", "shape", "model_px", "world_px", "ratio", "model_roam_px", "world_roam_px",
    #                          "roam_ratio"}
    ratio: float  # the least travel ratio over the rows (NaN counts as 0: a shape never seen does not travel)
    roam_ratio: float  # the least roam ratio over the rows (NaN counts as 0)
    passed: bool  # every row's ratio and roam_ratio >= TRAVEL_RATIO


def travel_scores(videos: np.ndarray, truth: np.ndarray, prompts) -> Travel:
    """`Travel` of ``videos`` against ``truth``, both uint8 [len(prompts), T, 64, 64, 3] (one per prompt)."""
    rows = []
    for video, clip, prompt in zip(videos, truth, prompts):
        mine, theirs = metric.detect(video), metric.detect(clip)
        readings = zip(
            world.parse_prompt(prompt)[0],
            metric.travel(mine, prompt),
            metric.travel(theirs, prompt),
            metric.roam(mine, prompt),
            metric.roam(theirs, prompt),
        )
        for (colour, shape), m, w, m_roam, w_roam in readings:
            rows.append({
                "prompt": prompt, "shape": f"{colour} {shape}", "model_px": m, "world_px": w,
                "ratio": float(np.nan_to_num(m / w, nan=0.0)), "model_roam_px": m_roam, "world_roam_px": w_roam,
                "roam_ratio": float(np.nan_to_num(m_roam / w_roam, nan=0.0)),
            })  # fmt: skip
    least, least_roam = min(r["ratio"] for r in rows), min(r["roam_ratio"] for r in rows)
    return Travel(tuple(rows), least, least_roam, min(least, least_roam) >= TRAVEL_RATIO)


def _travel_chunks(model: ToyModel, frames: int) -> int:
    """The chunks of a ``frames``-frame stream read for travel; ValueError where they are too few to read or
    not whole chunks of the model."""
    chunk_frames = model.settings.chunk_frames
    frames = check_int("frames", frames, minimum=metric.TRAVEL_FRAMES)
    if frames % chunk_frames:
        raise ValueError(f"frames ({frames}) must be a whole number of the model's {chunk_frames}-frame chunks")
    return frames // chunk_frames


def travel(model: ToyModel, *, frames: int = TRAVEL_FRAMES, seed: int = SEED) -> Travel:
    """Streams `PROMPTS` for ``frames`` frames and compares each named shape's travel and roam with the world's
    own clip of the prompt (`world_videos` with ``canonical``): a viewer's reading of motion, stricter than the
    metric's travel check (which only asks that a shape has not stopped: shapes circling on the spot pass it)."""
    videos = sample.video(model, list(PROMPTS), num_chunks=_travel_chunks(model, frames), seed=seed)
    return travel_scores(videos, world_videos(model, frames=frames, seed=seed, canonical=True), PROMPTS)


DEFAULT_FRAMES = 600  # `default_stream`: as many frames as `jaxkv generate` streams by default
SEEN_SHARE = 0.99  # the least share of its frames each named shape of the default stream must be drawn in
PACE_RATIO = 1.5  # the least travel of the default prompt said "fast" over said "slow" (the world's: ~1.6)


class DefaultStream(NamedTuple):
    """`default_stream`'s reading of the stream a user sees first (issue 44's targets)."""

    travel: Travel  # the default prompt's stream against the world's canonical clip of it (one row per named shape)
    seen: tuple[float, ...]  # per named shape: the share of frames it is drawn in
    pace: tuple[float, ...]  # per named shape: its travel with the prompt said "fast" over said "slow"
    passed: bool  # travel.passed, every seen >= SEEN_SHARE and every pace >= PACE_RATIO


def _said_fast(prompt: str) -> str:
    """The prompt said ", fast" instead of ", slow"; ValueError where it does not end with ", slow"."""
    if not prompt.endswith(", slow"):
        raise ValueError(f"the default stream's prompt must end with ', slow' to be compared with ', fast': {prompt!r}")
    return prompt.removesuffix(", slow") + ", fast"


def default_stream_scores(slow: np.ndarray, fast: np.ndarray, truth: np.ndarray, prompt: str) -> DefaultStream:
    """`DefaultStream` of the streams of ``prompt`` (ending ", slow") and of it said ", fast", against ``truth``,
    the world's canonical clip of ``prompt``; each uint8 [T, 64, 64, 3]."""
    fast_prompt = _said_fast(prompt)
    report = travel_scores(slow[None], truth[None], [prompt])
    found = metric.detect(slow)
    colours = [colour for colour, _ in world.parse_prompt(prompt)[0]]
    seen = tuple(float(found.present[:, metric.COLOUR_NAMES.index(c)].mean()) for c in colours)
    with np.errstate(divide="ignore", invalid="ignore"):  # a slow shape that never moves: inf (or NaN: 0)
        ratios = metric.travel(metric.detect(fast), fast_prompt) / metric.travel(found, prompt)
    pace = tuple(float(np.nan_to_num(r, nan=0.0)) for r in ratios)
    passed = report.passed and min(seen) >= SEEN_SHARE and min(pace) >= PACE_RATIO
    return DefaultStream(report, seen, pace, passed)


def default_stream(model: ToyModel, *, frames: int = DEFAULT_FRAMES, seed: int = SEED) -> DefaultStream:
    """Streams the model's default prompt (`Settings.prompt`) alone for ``frames`` frames, as ``jaxkv generate``
    streams it with no arguments, and the same prompt said "fast", and reads `default_stream_scores`. Each prompt
    streams alone, as the command streams it: a batch would draw other noise."""
    chunks = _travel_chunks(model, frames)
    prompt = model.settings.prompt
    fast = _said_fast(prompt)
    slow_video, fast_video = (sample.video(model, [p], num_chunks=chunks, seed=seed)[0] for p in (prompt, fast))
    truth = world_videos(model, frames=frames, seed=seed, canonical=True, prompts=[prompt])[0]
    return default_stream_scores(slow_video, fast_video, truth, prompt)


class NextChunk(NamedTuple):
    """`next_chunk`'s reading: per frame of the generated chunk, the median over (clip, named shape) of the distance
    (px) from the shape's detected centre to the world's (inf where it is not detected)."""

    model: np.ndarray  # float64 [chunk_frames]: the model's chunk
    still: np.ndarray  # float64 [chunk_frames]: the last frame before the chunk held still (no motion at all)
    world: np.ndarray  # float64 [chunk_frames]: the world's own chunk through the latent map (the floor)


class WorldChunks(NamedTuple):
    """The clips `next_chunk` and `denoising_errors` read (`_world_chunks`)."""

    prompts: list  # str [clips]
    starts: np.ndarray  # int [clips]: the frame each clip's chunk starts at
    context: np.ndarray  # uint8 [clips, sink + window - chunk frames, 64, 64, 3]: the sink and the window before t
    truth: np.ndarray  # uint8 [clips, chunk_frames, 64, 64, 3]: frames t .. t + chunk_frames - 1
    scenes: list  # world.Scene [clips]: the scene each clip shows


def _world_chunks(model: ToyModel, clips: int, seed: int, scenes: str = "canonical") -> WorldChunks:
    """``clips`` random prompts' scenes (each prompt's canonical scene, or with ``scenes="random"`` a random scene
    of it, `world.sample_scene`: the prompt then says what and how fast but not where), each at a random frame
    t < `NEXT_START`."""
    if scenes not in ("canonical", "random"):
        raise ValueError(f"scenes is 'canonical' or 'random', got {scenes!r}")
    st = model.settings
    cf, sink, before = st.chunk_frames, st.sink_frames, st.window_frames - st.chunk_frames
    if sink % cf or before % cf:
        raise ValueError(
            f"the world's chunks are committed whole: the sink ({sink}) and the window before a chunk "
            f"({before}) must be multiples of the chunk ({cf} frames)"
        )
    rng = np.random.default_rng([seed, clips])
    prompts = [world.random_prompt(rng) for _ in range(clips)]
    starts = rng.integers(sink + before, NEXT_START, clips)
    if scenes == "canonical":
        drawn = [world.canonical_scene(p) for p in prompts]
    else:  # drawn after the prompts and starts, so both are the canonical clips' own
        drawn = [world.sample_scene(rng, p) for p in prompts]
    context = np.stack(
        [
            np.concatenate([world.render(sc, sink), world.render(sc, before, int(t) - before)])
            if before
            else world.render(sc, sink)
            for sc, t in zip(drawn, starts)
        ]
    )
    truth = np.stack([world.render(sc, cf, int(t)) for sc, t in zip(drawn, starts)])
    return WorldChunks(prompts, starts, context, truth, drawn)


def next_chunk(model: ToyModel, *, clips: int = NEXT_CLIPS, seed: int = SEED, scenes: str = "canonical") -> NextChunk:
    """How well the model continues the world's own frames by one chunk, the step every chunk of a stream takes.

    ``clips`` random prompts' canonical scenes (or random scenes of them, ``scenes="random"``: a model that
    continues those as well as the canonical ones reads the motion from the frames, not from a memory of the
    prompt's one scene); for each, the cache is given what a full cache holds when a stream
    makes the chunk starting at a random frame t (`NEXT_START`): the sink (the scene's first frames) and the
    window's frames before t, all committed from the world's true frames (`jaxkv.rollout.commit`); the model then
    samples the chunk t .. t + chunk_frames - 1 with its sampler. Motion is what this reads: a model that draws
    the shapes where they were scores `still`, one that moves them as the world does scores near `world`."""
    import jax

    from jaxkv import rollout as R

    st = model.settings
    prompts, starts, context, truth, drawn = _world_chunks(model, clips, seed, scenes)
    rc = st.rollout_config()
    negative = model.negative_context(clips, rc)
    state = R.init_state(model.params, model.config, rc, model.context(prompts), negative)
    state = R.jit_commit(model.params, model.config, rc, state, model.latent_map.encode(context))
    out = R.jit_rollout(
        model.params,
        model.config,
        rc,
        None,
        num_chunks=1,
        key=jax.random.key(seed),
        state=state,
        first_chunk=context.shape[1] // st.chunk_frames,
    )
    generated = np.asarray(model.latent_map.decode_uint8(out.latents))
    still = np.repeat(context[:, -1:], st.chunk_frames, axis=1)
    through_map = np.asarray(model.latent_map.decode_uint8(model.latent_map.encode(truth)))
    return NextChunk(
        *(np.median(chunk_errors(v, prompts, starts, drawn), axis=0) for v in (generated, still, through_map))
    )


class DenoisingErrors(NamedTuple):
    """`denoising_errors`' reading: mean squared error in latent units (mean over clips, positions, channels)."""

    sigmas: np.ndarray  # float64 [levels]: the sampler's noise levels, first step first
    model: np.ndarray  # float64 [levels, chunk_frames]: of the model's x0 prediction at each level, per frame
    still: np.ndarray  # float64 [chunk_frames]: of the last frame before the chunk held still


def denoising_errors(model: ToyModel, *, clips: int = NEXT_CLIPS, seed: int = SEED) -> DenoisingErrors:
    """Where in its sampler a model falls short. `next_chunk`'s clips (the world's true frames: sink, the window's
    frames before the chunk, the chunk) with the chunk noised to each of the sampler's levels (``(1 - sigma) x +
    sigma eps``, one eps draw from ``seed``) and denoised once after the true frames
    (`jaxkv.models.wan.forward_teacher_forcing`, as training does); the error of the predicted x0 (``x - sigma *
    flow``) per frame of the chunk. At level 1 the input holds nothing of the chunk, so that row is the model's
    own guess of where the shapes go, the guess the later steps refine: a row no better than `still` is a model
    that has not learnt the motion."""
    import jax
    import jax.numpy as jnp

    from jaxkv.models import wan

    st = model.settings
    schedule = st.schedule()
    prompts, _, context, truth, _ = _world_chunks(model, clips, seed)
    x0 = model.latent_map.encode(np.concatenate([context, truth], axis=1))  # [clips, F, 16, 16, 16]
    eps = np.random.default_rng([seed, clips, 1]).standard_normal(x0.shape).astype(np.float32)
    text = model.context(prompts)
    cf = st.chunk_frames

    @jax.jit
    def predict(params, x0, eps, text, sigma, timestep):
        xt = (1 - sigma) * x0 + sigma * eps
        flow = wan.forward_teacher_forcing(
            params,
            model.config,
            x0,
            xt,
            jnp.full(x0.shape[:2], timestep),
            text,
            chunk_frames=cf,
            window_frames=st.window_frames,
            sink_frames=st.sink_frames,
        )
        return (xt - sigma * flow)[:, -cf:]

    sigmas = np.asarray(schedule.sigmas(), np.float64)
    errors = np.stack(
        [
            np.mean(
                (
                    np.asarray(predict(model.params, x0, eps, text, np.float32(s), np.float32(t)), np.float64)
                    - x0[:, -cf:]
                )
                ** 2,
                axis=(0, 2, 3, 4),
            )
            for s, t in zip(sigmas, schedule.timesteps())
        ]
    )
    still = np.mean((x0[:, -cf - 1 : -cf] - x0[:, -cf:]) ** 2, axis=(0, 2, 3, 4))
    return DenoisingErrors(sigmas, errors.astype(np.float64), still.astype(np.float64))


def chunk_errors(chunks: np.ndarray, prompts, starts, scenes=None) -> np.ndarray:
    """float64 [sum of the prompts' shapes, F]: for ``chunks`` uint8 [len(prompts), F, 64, 64, 3] showing frames
    starts[i] .. starts[i] + F - 1 of each prompt's canonical scene (or of ``scenes[i]``, a `world.Scene`), each
    named shape's distance (px) from its detected centre to the world's (inf where not detected)."""
    errors = []
    scenes = [world.canonical_scene(p) for p in prompts] if scenes is None else scenes
    for frames, scene, start in zip(chunks, scenes, starts):
        detections = metric.detect(frames)
        for thing, path in zip(scene.things, np.moveaxis(world.paths(scene, len(frames), int(start)), 1, 0)):
            centre = detections.centroid[:, metric.COLOUR_NAMES.index(thing.colour)]
            error = np.linalg.norm(centre - path, axis=-1)
            errors.append(np.nan_to_num(error, nan=np.inf))
    return np.stack(errors)
