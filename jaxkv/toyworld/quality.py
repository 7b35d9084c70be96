"""The quality bar a toy model must clear: a short stream of fixed prompts, scored by `jaxkv.toyworld.metric`.

`check(model)` streams `PROMPTS` for `CHUNKS` chunks (seed 0, the model's own settings) and compares the mean
overall score with `THRESHOLD`. The threshold comes from the two ends of the scale measured on the same prompts:
the world's own clips (rendered by `world`, passed through the latent map) score 1.0, and the same architecture with
random weights scores 0.0 (noise: nothing of any colour survives detection); `THRESHOLD` is their midpoint, 0.5,
so passing means the model gets at least half of its frames' objects and motions right on average. The test
(`tests/test_toyworld_quality.py`) checks both ends and the shipped model; ``jaxkv toyworld check DIR`` checks a
retrained one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxkv.toyworld import metric, sample, world
from jaxkv.toyworld.model import ToyModel

PROMPTS = ("a red circle and a blue square, slow", "a green triangle, fast", "a yellow square and a red triangle, fast",
           "a blue circle, slow")
CHUNKS = 48
SEED = 0
THRESHOLD = 0.5


class Report(NamedTuple):
    overall: float                  # mean over PROMPTS of each stream's overall score
    per_prompt: tuple[dict, ...]    # {"prompt", "adherence", "continuity", "overall"}
    passed: bool


def scores_of(videos: np.ndarray, prompts, chunk_frames: int) -> Report:
    """Report of ``videos`` uint8 [len(prompts), T, 64, 64, 3] (one per prompt)."""
    rows = []
    for video, prompt in zip(videos, prompts):
        s = metric.score(video, prompt, chunk_frames=chunk_frames, window_chunks=max(1, len(video) // chunk_frames))
        rows.append({"prompt": prompt, "adherence": s.adherence, "continuity": s.continuity, "overall": s.overall})
    overall = float(np.mean([r["overall"] for r in rows]))
    return Report(overall, tuple(rows), overall >= THRESHOLD)


def check(model: ToyModel, *, chunks: int = CHUNKS, seed: int = SEED) -> Report:
    """Streams `PROMPTS` with the model and scores them."""
    videos = sample.video(model, list(PROMPTS), num_chunks=chunks, seed=seed)
    return scores_of(videos, PROMPTS, model.settings.chunk_frames)


def world_videos(model: ToyModel, *, chunks: int = CHUNKS, seed: int = SEED) -> np.ndarray:
    """The world's own clips of `PROMPTS` through the model's latent map: uint8 [prompts, T, 64, 64, 3] (the top
    of the scale)."""
    rng = np.random.default_rng(seed)
    frames = chunks * model.settings.chunk_frames
    clips = np.stack([world.render(world.sample_scene(rng, p), frames) for p in PROMPTS])
    return np.asarray(model.latent_map.decode_uint8(model.latent_map.encode(clips)))
