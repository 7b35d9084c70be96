"""Checks of the Wan model's inputs, each naming the problem before anything runs: latents on the patch grid,
timesteps per row or per frame, text context (zero-padded to text_len as Wan pads it), and the RoPE mode of a
stream."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.models.wan.config import WanConfig

# Where a stream's RoPE positions come from: "absolute" rotates q and k at their absolute token positions before the
# cache write (Wan 2.1 / Self-Forcing); "cache-relative" caches k unrotated and rotates q and the cached keys by
# their rank among the cache's valid positions at every read (`cache_relative_rope`).
ROPE_MODES = ("absolute", "cache-relative")


def check_rope_mode(rope) -> str:
    if not isinstance(rope, str) or rope not in ROPE_MODES:
        raise ValueError(f"rope must be one of {list(ROPE_MODES)}, got {rope!r}")
    return rope


def _check_latents(config: WanConfig, latents, name: str = "latents"):
    if latents.ndim != 5 or latents.shape[-1] != config.in_dim:
        raise ValueError(
            f"{name} must be [batch, frames, height, width, in_dim={config.in_dim}], got {list(latents.shape)}"
        )
    _, f, h, w, _ = latents.shape
    pt, ph, pw = config.patch_size
    if f % pt or h % ph or w % pw:
        raise ValueError(f"{name} frames/height/width {f}x{h}x{w} must be divisible by the patch {config.patch_size}")
    if not jnp.issubdtype(latents.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got {latents.dtype}")
    return f // pt, h // ph, w // pw


def _frame_timesteps(timesteps, batch: int, frames: int):
    """[batch] or [batch, frames] -> float32 [batch, frames]."""
    t = jnp.asarray(timesteps)
    if t.shape == (batch,):
        t = jnp.broadcast_to(t[:, None], (batch, frames))
    elif t.shape != (batch, frames):
        raise ValueError(
            f"timesteps must be [batch]={[batch]} or per frame [batch, frames]={[batch, frames]}, got {list(t.shape)}"
        )
    return t.astype(jnp.float32)


def check_context(
    config: WanConfig, context, batch: int | None = None, pad_context: bool = True, name: str = "context"
):
    """Checks text context [batch, text_tokens <= text_len, text_dim] (any batch when ``batch`` is None) and, when
    pad_context, zero-pads it to [batch, text_len, text_dim]."""
    context = jnp.asarray(context)
    if context.ndim != 3 or (batch is not None and context.shape[0] != batch) or context.shape[2] != config.text_dim:
        want = "batch" if batch is None else f"batch={batch}"
        raise ValueError(f"{name} must be [{want}, text_tokens, text_dim={config.text_dim}], got {list(context.shape)}")
    n = context.shape[1]
    if n > config.text_len:
        raise ValueError(f"{name} has {n} tokens, more than the model's text_len {config.text_len}")
    if n == 0 and not pad_context:
        raise ValueError(f"{name} has no tokens; pass at least one (or pad_context=True: zeros of text_len tokens)")
    if pad_context and n < config.text_len:
        context = jnp.pad(context, ((0, 0), (0, config.text_len - n), (0, 0)))
    return context
