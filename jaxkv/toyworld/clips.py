"""The toy world's training clips: a clip is laid out as a full cache holds it (the sink, then window frames from
anywhere along the scene's path or straight on from the sink), drawn from (seed, stage, step) alone (`batch`), and
which of its chunks a clip fixes the answer of (`context_chunks`). Used by every stage of `jaxkv.toyworld.train`.

A clip's scene is its prompt's `world.canonical_scene` (``scenes="canonical"``, the shipped recipe: the prompt then
also says where the shapes start) or a random scene of it (``"random"``, `world.sample_scene`: the same shapes,
colours and speed at random positions and directions, so the prompt says what and how fast, never where), or
either, clip by clip (``"mixed"``: a `MIXED_RANDOM_SHARE` of the clips random, the rest canonical).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxkv.toyworld import text, world
from jaxkv.toyworld.model import Settings

SCENES = ("canonical", "random", "mixed")  # what `batch` draws a clip's scene as (the module docstring)
MIXED_RANDOM_SHARE = 0.5  # ``scenes="mixed"``: the share of clips whose scene is a random one

# Frames of a shape's own path a chunk must see before it to know where the shape goes (two give a velocity).
CONTEXT_FRAMES = 2


def context_chunks(settings: Settings) -> int:
    """Window chunks of a clip that must precede a chunk for its answer to be fixed (`CONTEXT_FRAMES`)."""
    return -(-CONTEXT_FRAMES // settings.chunk_frames)


class Batch(NamedTuple):
    """What `batch` draws (``size`` clips)."""

    latents: np.ndarray  # float32 [size, sink_frames + after_sink, 16, 16, 16]
    ids: np.ndarray  # int32 [size, text_len]: the prompts' tokens
    mask: np.ndarray  # int32 [size, text_len]
    at_start: np.ndarray  # bool [size]: the clip runs straight on from the sink
    objects: np.ndarray  # int32 [size, world.MAX_OBJECTS, 2]: (colour, shape) index of each named object in
    # prompt order (into world.COLOURS, world.SHAPES); -1 rows where a prompt names fewer


def batch(
    latent_map,
    tokenizer,
    settings: Settings,
    seed: int,
    stage: int,
    step: int,
    size: int,
    start_share: float,
    text_dropout: float = 0.0,
    after_sink: int | None = None,
    scenes: str = "canonical",
) -> Batch:
    """A `Batch` of clips laid out as a full cache holds them, drawn from (seed, stage, step) alone. Each clip is a
    random prompt's `world.canonical_scene` (``scenes="random"``: a `world.sample_scene` of the prompt drawn from the
    clip's own generator, seeded with (seed, stage, step, clip index), so every other draw is the canonical batch's;
    ``"mixed"``: that generator's first draw decides, a `MIXED_RANDOM_SHARE` of the clips random, the rest canonical):
    its first ``sink_frames`` frames (the sink), then ``after_sink`` frames (default ``window_frames``; more for a
    clip that runs on past the cache) from frame ``sink_frames`` on (``at_start``, a ``start_share`` of the clips) or
    from a frame uniform in ``sink_frames + 1`` .. `MAX_START`. A ``text_dropout`` share of the clips is captioned
    with the empty prompt (drawn last, so the other draws do not
    depend on it); `Batch.objects` names the scene's objects whatever the caption."""
    if scenes not in SCENES:
        raise ValueError(f"scenes is one of {SCENES}, got {scenes!r}")
    rng = np.random.default_rng([seed, stage, step])
    prompts = [world.random_prompt(rng) for _ in range(size)]
    at_start = rng.random(size) < start_share
    sink = settings.sink_frames
    starts = np.where(at_start, sink, rng.integers(sink + 1, MAX_START + 1, size))
    chosen = []
    for i, prompt in enumerate(prompts):
        own = np.random.default_rng([seed, stage, step, i])  # drawn from only for a clip that may be random
        mine = scenes == "random" or (scenes == "mixed" and own.random() < MIXED_RANDOM_SHARE)
        chosen.append(world.sample_scene(own, prompt) if mine else world.canonical_scene(prompt))
    after_sink = settings.window_frames if after_sink is None else after_sink
    video = np.stack(
        [
            np.concatenate([world.render(scene, sink), world.render(scene, after_sink, int(t))])
            for scene, t in zip(chosen, starts)
        ]
    )
    objects = np.full((size, world.MAX_OBJECTS, 2), -1, np.int32)
    for clip, scene in zip(objects, chosen):
        for row, thing in zip(clip, scene.things):
            row[:] = list(world.COLOURS).index(thing.colour), world.SHAPES.index(thing.shape)
    if text_dropout:
        prompts = ["" if drop else p for p, drop in zip(prompts, rng.random(size) < text_dropout)]
    ids, mask, _ = tokenizer(prompts, text.CONFIG.text_len)
    return Batch(latent_map.encode(video), ids, mask, at_start, objects)


# Training clips start anywhere in the first MAX_START frames of a scene: a lone shape's path (folds of period
# 2 x 36 px / |v| per axis, at most ~126 frames at the world's speeds: `world.trajectory`) has long covered every
# state by then; two shapes bouncing off each other (`world.paths`) are not periodic, and meet 55-111 times (slow)
# or 171-227 times (fast) in those frames of each canonical two-shape scene.
MAX_START = 4096
