"""How well a toy model continues a clip of the world from its pixels (`jaxkv.continuation`), against starting
from noise with the same prompt.

`measure` renders ``clips`` clips of the world of ``given + ahead`` frames, random prompts in one of three kinds of
scene (``scenes``):

- ``"offset"``: the scene a stream of the prompt is meant to show (`world.canonical_scene`, the scenes the shipped
  model was trained on) from a random frame before `OFFSET_BEFORE`: where the shapes are is in the given frames,
  not in the prompt;
- ``"random"``: random scenes of the prompts (`world.sample_scene`: random positions and directions, which the
  model never saw in training), from frame 0;
- ``"canonical"``: the canonical scene from frame 0, where a stream from noise is meant to show these very frames
  (the hardest baseline to beat).
 Four videos of the ``ahead`` frames after the first ``given`` are then compared with the
world's own, shape by shape: the detected centre of each named shape's colour (`metric.detect`) against the
world's centre of it (`world.paths`), in pixels, a shape not detected counting as infinitely far:

- ``continued``: the model's stream after the first ``given`` frames were committed as its first chunks
  (`jaxkv.continuation.context_from_frames` with the latent map, `jaxkv.continuation.start_stream`);
- ``noise``: the model's stream of the same prompt from noise, same seed (so the same noise for the same chunks),
  its frames ``given .. given + ahead - 1``: what a stream knows of the scene from the prompt alone;
- ``still``: the last given frame held (no motion at all);
- ``world``: the world's own frames through the latent map (the floor: what detection reads of a perfect model).

The summary of each is the median error over (clip, shape, frame) and the share of those within
`quality.TRACK_RADIUS` px (`hits`); ``by_frame`` the median per frame ahead.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxkv.toyworld import metric, quality, world
from jaxkv.toyworld.model import ToyModel
from jaxkv.validate import check_int

GIVEN = 9  # frames given: one full cache of the shipped model (sink 3 + window 6)
AHEAD = 12  # frames compared after them (4 chunks)
CLIPS = 16
SEED = 0
SCENES = ("random", "offset", "canonical")
OFFSET_BEFORE = 2000  # "offset" clips start at a random frame before this one (as `quality.next_chunk`'s)
METHODS = ("continued", "noise", "still", "world")


class Reading(NamedTuple):
    scenes: str
    given: int
    ahead: int
    clips: int
    errors: dict  # method -> float64 [named shapes over the clips, ahead]: px from the world's centre (inf: unseen)

    def summary(self) -> dict:
        """{method: {"median_px", "hits", "by_frame_px"}} (JSON-able; inf written as None)."""

        def px(x):
            return None if not np.isfinite(x) else round(float(x), 3)

        return {
            m: {
                "median_px": px(np.median(e)),
                "hits": round(float(np.mean(e <= quality.TRACK_RADIUS)), 4),
                "by_frame_px": [px(v) for v in np.median(e, axis=0)],
            }
            for m, e in self.errors.items()
        }


def shape_errors(videos: np.ndarray, scenes, starts) -> np.ndarray:
    """float64 [sum of the scenes' shapes, T]: for ``videos`` uint8 [len(scenes), T, 64, 64, 3] showing frames
    starts[i] .. starts[i] + T - 1 of each scene, each shape's distance (px) from its detected centre to the
    world's (inf where its colour is not detected)."""
    rows = []
    for frames, scene, start in zip(videos, scenes, starts):
        detections = metric.detect(frames)
        for thing, path in zip(scene.things, np.moveaxis(world.paths(scene, len(frames), int(start)), 1, 0)):
            centre = detections.centroid[:, metric.COLOUR_NAMES.index(thing.colour)]  # NaN where absent
            rows.append(np.nan_to_num(np.linalg.norm(centre - path, axis=-1), nan=np.inf))
    return np.stack(rows)


def measure(
    model: ToyModel,
    *,
    clips: int = CLIPS,
    given: int = GIVEN,
    ahead: int = AHEAD,
    seed: int = SEED,
    scenes: str = "random",
) -> Reading:
    """The reading of the module docstring; ``given`` and ``ahead`` whole chunks of the model's."""
    import jax

    from jaxkv import continuation as C
    from jaxkv.stream import Stream

    clips = check_int("clips", clips, minimum=1)
    cf = model.settings.chunk_frames
    given = check_int("given", given, minimum=cf)
    ahead = check_int("ahead", ahead, minimum=cf)
    if ahead % cf or given % cf:
        raise ValueError(f"given ({given}) and ahead ({ahead}) must be whole {cf}-frame chunks")
    if scenes not in SCENES:
        raise ValueError(f"scenes must be one of {SCENES}, got {scenes!r}")
    rng = np.random.default_rng([seed, clips])
    prompts = [world.random_prompt(rng) for _ in range(clips)]
    chosen = [world.sample_scene(rng, p) if scenes == "random" else world.canonical_scene(p) for p in prompts]
    starts = rng.integers(0, OFFSET_BEFORE, clips) if scenes == "offset" else np.zeros(clips, int)
    # [clips, given + ahead, 64, 64, 3]: frames start .. start + given + ahead - 1 of each scene
    truth = np.stack([world.render(s, given + ahead, int(t)) for s, t in zip(chosen, starts)])

    rc = model.settings.rollout_config()
    text = model.context(prompts)
    negative = model.negative_context(clips, rc)
    key = jax.random.key(seed)
    decode = jax.jit(model.latent_map.decode_uint8)

    context = C.context_from_frames(truth[:, :given], C.ToyEncoder(model.latent_map), rc)
    stream = C.start_stream(
        model.params,
        model.config,
        rc,
        text,
        context.latents,
        num_chunks=ahead // cf,
        key=key,
        negative_context=negative,
    )
    continued = np.concatenate([np.asarray(decode(x)) for x in stream], axis=1)
    # the same prompt from noise, same key: its chunks after the first given // cf draw the continuation's noise
    noise_stream = Stream(
        model.params, model.config, rc, text, num_chunks=(given + ahead) // cf, key=key, negative_context=negative
    )
    noise = np.concatenate([np.asarray(decode(x)) for x in noise_stream], axis=1)[:, given:]
    still = np.repeat(truth[:, given - 1 : given], ahead, axis=1)
    floor = np.asarray(decode(model.latent_map.encode(truth[:, given:])))
    errors = {
        name: shape_errors(video, chosen, starts + given)
        for name, video in (("continued", continued), ("noise", noise), ("still", still), ("world", floor))
    }
    return Reading(scenes, given, ahead, clips, errors)
