"""Streaming a toy model to frames: the prompt through its text encoder, chunks from `jaxkv.rollout.Stream` on the
cache its settings (or a caller's `RolloutConfig`) name, each chunk decoded by the latent map as it arrives.

Used by the quality test, `benchmarks/policy_quality.py` and training checks; ``jaxkv generate`` runs the same
model through its own loop (files, video, signals).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import numpy as np

from jaxkv import rollout as R
from jaxkv.toyworld.model import LATENT_SIZE, ToyModel


def rollout_config(model: ToyModel, **overrides) -> R.RolloutConfig:
    """The model's `RolloutConfig` (its chunk, window, sink and schedule), with any field replaced by
    ``overrides`` (e.g. ``sink_frames=0``, ``policy="rolling"``, ``dilated_every=2, dilation=3, buckets=4``)."""
    s = model.settings
    rc = R.RolloutConfig(latent_height=LATENT_SIZE, latent_width=LATENT_SIZE, chunk_frames=s.chunk_frames,
                         window_frames=s.window_frames, sink_frames=s.sink_frames, schedule=s.schedule())
    return dataclasses.replace(rc, **overrides) if overrides else rc


def stream_frames(model: ToyModel, prompts: list[str], *, num_chunks: int, seed: int = 0,
                  rc: R.RolloutConfig | None = None) -> Iterator[np.ndarray]:
    """Yields each chunk's frames, uint8 [len(prompts), chunk_frames, 64, 64, 3], as the stream makes them."""
    rc = rc if rc is not None else rollout_config(model)
    context = model.context(prompts)
    stream = R.Stream(model.params, model.config, rc, context, num_chunks=num_chunks, key=jax.random.key(seed))
    decode = jax.jit(model.latent_map.decode_uint8)
    for chunk in stream:
        yield np.asarray(decode(chunk))


def video(model: ToyModel, prompts: list[str], *, num_chunks: int, seed: int = 0,
          rc: R.RolloutConfig | None = None) -> np.ndarray:
    """All frames of a stream: uint8 [len(prompts), num_chunks * chunk_frames, 64, 64, 3]."""
    return np.concatenate(list(stream_frames(model, prompts, num_chunks=num_chunks, seed=seed, rc=rc)), axis=1)
