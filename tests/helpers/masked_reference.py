"""A cache-free Wan rollout under any per-layer frame visibility: the reference for retention policies.

Every denoising pass recomputes the whole history (past chunks at their committed clean latents and the schedule's
context-noise timestep, the current chunk at the pass's timestep) with plain dense softmax attention, where layer
l's query in frame qf sees key frame kf iff ``frame_masks[l, qf, kf]``. No cache, no jaxkv attention path: a mask
row says what a chunk sees, so a history frame's own row reproduces what it saw when it was committed. The schedule
is recomputed from its definition (steps, shift, context_noise read from the Schedule's fields).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models import wan
from jaxkv.models.wan.dit import dit
from jaxkv.models.wan.rope import sequence_positions
from jaxkv.run_options import RunOptions


def chunk_rows(visible_chunks, num_frames: int, chunk_frames: int) -> np.ndarray:
    """bool [F, F] from ``visible_chunks(n) -> iterable of key frames`` that chunk n's queries see."""
    m = np.zeros((num_frames, num_frames), bool)
    for n in range(num_frames // chunk_frames):
        rows = slice(n * chunk_frames, (n + 1) * chunk_frames)
        for kf in visible_chunks(n):
            m[rows, kf] = True
    return m


def dense_window_rows(num_frames, chunk_frames, window_frames, sink_frames=0):
    """A sink + window cache's frames, from its definition: chunk n sees chunks n - W/c + 1 .. n and the sink."""
    w = window_frames // chunk_frames

    def seen(n):
        return [f for f in range((n + 1) * chunk_frames) if f // chunk_frames > n - w or f < sink_frames]

    return chunk_rows(seen, num_frames, chunk_frames)


def sample_history(fwd, schedule, noise):
    """float32 [batch, num_chunks * chunk_frames, h, w, c]: the few-step sampler over a cache-free history, from the
    schedule's definition. ``fwd(history, timesteps)`` is the model's flow over the whole history (past chunks at
    their clean latents and ``context_noise``, the current chunk at the pass's timestep); ``noise`` [num_chunks,
    steps, batch, chunk_frames, h, w, c]."""
    lin = np.asarray(schedule.steps) / 1000.0
    sig = schedule.shift * lin / (1 + (schedule.shift - 1) * lin)
    num_chunks, steps, batch, cf = noise.shape[:4]
    done = []
    for n in range(num_chunks):
        x = noise[n, 0]
        for i in range(steps):
            hist = jnp.concatenate(done + [x], axis=1)
            ts = jnp.concatenate(
                [jnp.full((batch, n * cf), schedule.context_noise), jnp.full((batch, cf), 1000.0 * sig[i])], axis=1
            )
            v = fwd(hist, ts)[:, -cf:]
            x0 = x - sig[i] * v
            x = (1 - sig[i + 1]) * x0 + sig[i + 1] * noise[n, i + 1] if i + 1 < steps else x0
        done.append(x)
    return jnp.concatenate(done, axis=1)


def reference_rollout(params, config, rc, context, noise, frame_masks):
    """float32 [batch, num_chunks * chunk_frames, h, w, c] of a rollout without guidance whose layer l sees what
    ``frame_masks[l]`` (bool [F, F], F = num_chunks * chunk_frames) allows."""
    num_chunks, _, batch, cf = noise.shape[:4]
    frames = num_chunks * cf
    assert frame_masks.shape == (config.num_layers, frames, frames)
    tpf = config.tokens_per_frame(rc.latent_height, rc.latent_width)
    token_masks = jnp.asarray(np.repeat(np.repeat(frame_masks, tpf, axis=1), tpf, axis=2))
    cross = wan.cross_kv(params, config, context)

    @jax.jit
    def fwd(x, t):
        n = x.shape[1] * tpf
        positions = sequence_positions(batch, n)
        mask_all = token_masks[:, :n, :n]

        def attention(q, k, v, state, layer):
            mask = jax.lax.dynamic_index_in_dim(mask_all, layer, 0, keepdims=False)
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
            p = jax.nn.softmax(jnp.where(mask[None, None], logits, -jnp.inf), axis=-1)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v), state

        return dit(params, config, x, t, positions, cross, attention, None, RunOptions.of(backend="xla"))[0]

    return sample_history(fwd, rc.schedule, noise)
