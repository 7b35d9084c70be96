"""The Wan forwards over a whole clip: `forward` (bidirectional), `forward_block_causal` (the chunk-causal training
mask, `block_causal_spec`) and `forward_teacher_forcing` (each noisy chunk on the clean chunks before it)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.attention import MaskSpec, attend
from jaxkv.cache import RingSpec
from jaxkv.models.wan.attention import _cross_kv
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.dit import dit
from jaxkv.models.wan.dtypes import _run_of
from jaxkv.models.wan.inputs import _check_latents, _frame_timesteps
from jaxkv.models.wan.rope import sequence_positions
from jaxkv.precision import Precision
from jaxkv.run_options import RunOptions
from jaxkv.validate import is_int


def _forward_sequence(
    params, config: WanConfig, latents, timesteps, context, mask: MaskSpec, pad_context: bool, run: RunOptions
):
    latents = jnp.asarray(latents)
    gf, gh, gw = _check_latents(config, latents)
    _frame_timesteps(timesteps, latents.shape[0], gf)  # checked before the text embedding runs
    cross = _cross_kv(params, config, jnp.asarray(context), pad_context, run)
    positions = sequence_positions(latents.shape[0], gf * gh * gw)
    kv_dtype = jnp.dtype(run.precision.cache_dtype)

    def self_attention(q, k, v, state, layer):
        # q, k, v in the dtype a cache would hold them in, so a stream and the whole sequence attend alike
        q, k, v = (a.astype(kv_dtype) for a in (q, k, v))
        out = attend(q, k, v, positions, positions, mask=mask, backend=run.backend, interpret=run.interpret)
        return out.astype(jnp.float32), state

    return dit(params, config, latents, timesteps, positions, cross, self_attention, None, run)[0]


def forward(
    params,
    config: WanConfig,
    latents,
    timesteps,
    context,
    *,
    pad_context: bool = True,
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
):
    """The plain bidirectional Wan 2.1 forward (flow prediction).

    Args:
      params: the Wan parameter pytree (`jaxkv.models.wan.params`), every leaf in precision.param_dtype.
      latents: [batch, frames, height, width, in_dim] on the latent grid (height/width divisible by the patch).
      timesteps: float [batch] or per frame [batch, frames // pt], on the 0..1000 scale.
      context: [batch, text_tokens <= text_len, text_dim]; zero-padded to text_len unless pad_context=False.
      backend: the attention backend (`jaxkv.attend`'s names; default "auto").
      precision: the dtype policy, a `jaxkv.precision.Precision` or a preset name ("float32", "bfloat16"; default
        float32).
      run: a `jaxkv.run_options.RunOptions` holding both instead (TypeError if given with either).
    Returns:
      float32 [batch, frames, height, width, out_dim].
    """
    run = _run_of(params, run, backend, precision, "forward")
    return _forward_sequence(params, config, latents, timesteps, context, MaskSpec(), pad_context, run)


def block_causal_spec(config: WanConfig, latents, chunk_frames, window_frames=None, sink_frames=0) -> RingSpec:
    """The cache spec (in tokens) whose `RingSpec.mask` is the block-causal training mask of these latents.

    ``window_frames=None`` (no window: every earlier chunk is visible) is a window as long as the whole clip,
    rounded up to whole chunks."""
    gf, gh, gw = _check_latents(config, jnp.asarray(latents))
    for name, value in (("chunk_frames", chunk_frames), ("window_frames", window_frames), ("sink_frames", sink_frames)):
        if value is not None and not (is_int(value) and value >= 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if chunk_frames is None or chunk_frames <= 0:
        raise ValueError(f"chunk_frames must be a positive int, got {chunk_frames!r}")
    if window_frames is not None and window_frames < chunk_frames:
        raise ValueError(f"window_frames ({window_frames}) must hold at least one chunk ({chunk_frames} frames)")
    if window_frames is None:
        if sink_frames:
            raise ValueError("sink_frames only makes sense with a window (window_frames)")
        window_frames = -(-gf // chunk_frames) * chunk_frames
    return RingSpec.from_frames(gh * gw, chunk_frames, window_frames, sink_frames)


def forward_block_causal(
    params,
    config: WanConfig,
    latents,
    timesteps,
    context,
    *,
    chunk_frames: int,
    window_frames: int | None = None,
    sink_frames: int = 0,
    pad_context: bool = True,
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
):
    """Wan 2.1 under the block-causal (chunk-causal) mask of causal Wan training, by token position.

    Token i (frame f_i, chunk c_i = f_i // chunk_frames) sees token j iff c_j <= c_i and, when ``window_frames`` is
    set, j's chunk starts less than ``window_frames`` frames before i's chunk (the window includes i's own chunk) or
    j lies in the first ``sink_frames`` frames. The mask is `block_causal_spec(...).mask()`, the same `RingSpec.mask`
    that `forward_chunk` applies on a cache of that spec, so a stream on a sink + window cache sees exactly this.

    Args/returns as `forward`; chunk_frames, window_frames, sink_frames count latent (patch) frames.
    """
    mask = block_causal_spec(config, latents, chunk_frames, window_frames, sink_frames).mask()
    run = _run_of(params, run, backend, precision, "forward_block_causal")
    return _forward_sequence(params, config, latents, timesteps, context, mask, pad_context, run)


def forward_teacher_forcing(
    params,
    config: WanConfig,
    clean,
    noisy,
    timesteps,
    context,
    *,
    chunk_frames: int,
    window_frames: int | None = None,
    sink_frames: int = 0,
    pad_context: bool = True,
    backend: str | None = None,
    precision: Precision | str | None = None,
    run: RunOptions | None = None,
    remat: bool = False,
):
    """Every chunk of a clip denoised as a stream denoises it: each noisy chunk sees the *clean* chunks before it
    (teacher forcing, CausVid's training forward), in one pass over the clean and the noisy copy of the clip.

    The clean copy runs at timestep 0 under the block-causal mask (`forward_block_causal`), as a stream's commit
    pass writes each chunk's K/V; noisy chunk c then attends to the clean K/V of the chunks its mask shows (the
    sink, the window) and to its own noisy K/V, never to another noisy chunk. So chunk c's flow equals that of
    `forward_chunk` on a cache holding the clean chunks before it (a stream that committed them with
    ``context_noise = 0``): tested against that. Unlike `forward_block_causal`, where a chunk after a noisy one sees
    it noisy, every chunk here is trained in the context generation gives it. It costs about two
    `forward_block_causal` passes: twice the tokens, and the noisy chunks' attention folds the chunk axis into the
    batch (each fold reads the clean keys with its own chunk's replaced by the noisy ones).

    Args:
      clean, noisy: [batch, frames, height, width, in_dim], the clip and its noisy copy.
      timesteps: float [batch] or [batch, frames // pt]: the noisy copy's (the clean copy's are 0).
      context, chunk_frames, window_frames, sink_frames: as `forward_block_causal`.
      remat: run each block under `jax.checkpoint`: a gradient recomputes the block's activations (attention
        probabilities included) instead of storing them for every layer. The same function to float rounding (the
        recomputation may fuse differently). Scratch memory falls ~4x (`benchmarks/train_step.py`, the toy model);
        on XLA:CPU the step also gets faster (1.2-1.3x here, 1.7-2.1x for a rollout's gradient: fewer bytes
        written and read); on a GPU expect the usual trade of time for memory (not measured).
    Returns:
      float32 [batch, frames, height, width, out_dim]: the flow predicted for each noisy chunk.
    """
    clean, noisy = jnp.asarray(clean), jnp.asarray(noisy)
    if clean.shape != noisy.shape:
        raise ValueError(f"clean and noisy must have one shape, got {list(clean.shape)} and {list(noisy.shape)}")
    gf, gh, gw = _check_latents(config, clean, "clean")
    _check_latents(config, noisy, "noisy")
    b = clean.shape[0]
    t = _frame_timesteps(timesteps, b, gf)
    run = _run_of(params, run, backend, precision, "forward_teacher_forcing")
    mask = block_causal_spec(config, clean, chunk_frames, window_frames, sink_frames).mask()
    n = gf * gh * gw  # tokens of one copy
    tpc = mask.chunk  # tokens per chunk
    chunks = n // tpc
    positions = sequence_positions(b, n)
    chunk_of = jnp.arange(n) // tpc  # [n]
    own = chunk_of[None, :] == jnp.arange(chunks)[:, None]  # [chunks, n]: fold c's own tokens
    kv_dtype = jnp.dtype(run.precision.cache_dtype)

    def self_attention(q, k, v, state, layer):
        q, k, v = (a.astype(kv_dtype) for a in (q, k, v))
        out_clean = attend(
            q[:, :n], k[:, :n], v[:, :n], positions, positions, mask=mask, backend=run.backend, interpret=run.interpret
        )
        # fold c: the queries of noisy chunk c; the keys are the clean copy's with chunk c's replaced by the noisy
        fold = lambda a: a.reshape(b * chunks, tpc, *a.shape[2:])
        swap = lambda a: jnp.where(own[None, :, :, None, None], a[:, None, n:], a[:, None, :n]).reshape(
            b * chunks, n, *a.shape[2:]
        )
        q_pos = fold(positions)
        kv_pos = jnp.broadcast_to(positions[:, None], (b, chunks, n)).reshape(b * chunks, n)
        out_noisy = attend(
            fold(q[:, n:]), swap(k), swap(v), q_pos, kv_pos, mask=mask, backend=run.backend, interpret=run.interpret
        )
        out_noisy = out_noisy.reshape(b, n, *out_noisy.shape[2:])
        return jnp.concatenate([out_clean, out_noisy], axis=1).astype(jnp.float32), state

    cross = _cross_kv(params, config, jnp.asarray(context), pad_context, run)
    latents = jnp.concatenate([clean, noisy], axis=1)
    both_t = jnp.concatenate([jnp.zeros_like(t), t], axis=1)
    flow = dit(
        params,
        config,
        latents,
        both_t,
        jnp.concatenate([positions, positions], axis=1),
        cross,
        self_attention,
        None,
        run,
        remat=remat,
    )[0]
    return flow[:, clean.shape[1] :]
