"""Streaming a toy model to frames: the prompt through its text encoder, chunks from `jaxkv.stream.Stream` on the
cache its settings (or a caller's `RolloutConfig`) name, each chunk decoded by the latent map as it arrives.

Used by the quality test, `benchmarks/policy_quality.py` and training checks; ``jaxkv generate`` runs the same
model through its own loop (files, video, signals).
"""

from __future__ import annotations

from typing import Iterator

import jax
import numpy as np

from jaxkv import rollout as R
from jaxkv.stream import Stream
from jaxkv.toyworld.model import ToyModel


def rollout_config(model: ToyModel, **overrides) -> R.RolloutConfig:
    """The model's `RolloutConfig` (`Settings.rollout_config`: its chunk, window, sink and schedule), with any
    field replaced by ``overrides``."""
    return model.settings.rollout_config(**overrides)


def stream_frames(
    model: ToyModel, prompts: list[str], *, num_chunks: int, seed: int = 0, rc: R.RolloutConfig | None = None
) -> Iterator[np.ndarray]:
    """Yields each chunk's frames, uint8 [len(prompts), chunk_frames, 64, 64, 3], as the stream makes them."""
    rc = rc if rc is not None else rollout_config(model)
    context = model.context(prompts)
    negative = model.negative_context(len(prompts), rc)
    stream = Stream(
        model.params,
        model.config,
        rc,
        context,
        num_chunks=num_chunks,
        key=jax.random.key(seed),
        negative_context=negative,
    )
    decode = jax.jit(model.latent_map.decode_uint8)
    for chunk in stream:
        yield np.asarray(decode(chunk))


def video(
    model: ToyModel, prompts: list[str], *, num_chunks: int, seed: int = 0, rc: R.RolloutConfig | None = None
) -> np.ndarray:
    """All frames of a stream: uint8 [len(prompts), num_chunks * chunk_frames, 64, 64, 3]."""
    return np.concatenate(list(stream_frames(model, prompts, num_chunks=num_chunks, seed=seed, rc=rc)), axis=1)
