"""Training the toy model from scratch on CPU, with optax: ``python -m jaxkv.toyworld train --out DIR``.

1. The latent map is fitted on world frames (`latents.LatentMap.fit`, a second).
2. **Teacher forcing on the stream's own layout.** A clip is what the cache holds once it is full: the sink (the
   prompt's first `Settings.sink_frames` frames, `world.canonical_scene`) and then `Settings.window_frames` frames
   from anywhere along the scene's path (or, for ``start_share`` of the clips, straight on from the sink: a stream's
   beginning). `jaxkv.models.wan.forward_teacher_forcing` denoises every chunk of it at once as a stream denoises it,
   after the clean chunks before it, each chunk at its own noise level (`noise_levels`: every level in [0, 1),
   drawn with the shift the sampler's steps are warped by, `Settings.shift`, so the sampler's steps are a setting
   and not baked into the weights; an earlier recipe trained on the 4 sampler levels alone scored lower on the quality
   survey, docs/toyworld.md). Loss: the flow ``eps - x0``
   (rectified flow, Wan's parameterisation) on every chunk but those whose answer the clip does not fix: a window
   chunk that does not follow the sink, seen after fewer than `CONTEXT_FRAMES` frames of its own path, cannot know
   which way the shapes go. The text encoder trains with the DiT. The DiT starts from `init_dit`: Wan's random init
   with every residual branch's output projection and the head zeroed (the DiT "adaLN-zero" start).
   The clip is never longer than the cache, so with cache-relative RoPE (`Settings.rope`) its positions are the
   ranks a full cache gives: training and a stream of any length see the same relative distances.
3. **Teacher forcing with a level-1 share** (``refine_steps``): stage 2's loss for a few more steps at a lower
   learning rate (``refine_lr``), with a quarter of the chunks at noise level 1 exactly (``refine_pure_noise_share``),
   where the sampler's first step decides from the context alone where the shapes go. From scratch, that share
   taught the one-step motion but loosened the shapes' outlines (their budget moved away from the low levels); after
   stage 2 has spent its steps on every level, it lifts the quality survey (docs/toyworld.md).
4. **Self-forcing through the ring, past the cache** (``sf_steps``). A clip is the sink and `context_chunks`
   window chunks (committed to an empty cache as generation commits chunks) followed by ``sf_chunks`` more chunks
   of the same scene (`batch` with ``after_sink``); `jaxkv.rollout.rollout` samples those with the model's own
   few-step sampler on the ring cache, past its capacity once ``sf_chunks`` > 1 (the ring evicts the true frames
   and the model continues from its own). The loss, differentiated through the whole rollout, is the squared error
   of the rolled-out latents to the world's true continuation (the world is deterministic once its first frames
   are seen) plus ``sf_colour_weight`` x `colour_share_error` plus ``sf_outline_weight`` x `outline_error`. The
   colour term is what makes the stage work: where the model is unsure of a shape's place the squared error rewards
   a fainter, wider shape, and without the term such rollouts faded the shapes into the empty box; the term, blind
   to place, holds each colour's pixel share to the world's. With it, 100 steps lift the quality survey and the
   check over stage 3's weights, and 300 and 600 (the default) lift the survey further and keep the shapes drawn
   through 300-frame streams; at the default width they still stop moving after ~30 frames there (release 6), and
   with a DiT twice as wide (``dit_*``, release 7 with 300 steps, release 8 with 1,000) they keep moving. The outline
   term (off in the shipped recipe, ``sf_outline_weight`` 0), also blind to place, holds each named colour's mask
   to its own shape, whole and sharp, wherever the rollout draws it (the squared error rewards a blob spread over
   the shape's possible places, and the metric needs the shape's outline to tell it); docs/toyworld-experiments.md, "The
   outline term".

Two options of stage 2, off in the shipped recipe (each measured worse there on the quality survey, docs/toyworld.md):
``text_dropout`` captions a share of the clips with the empty prompt, so the model can stream with
classifier-free guidance (`Settings.guidance_scale`); ``pure_noise_share`` trains a share of the chunks at level 1
exactly (stage 3's ``refine_pure_noise_share`` from the start).

Every random draw is a function of (seed, stage, step), so a run is reproducible and a resumed run
(`--resume`, from the snapshot written every ``snapshot_every`` steps and on Ctrl-C) continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv import rollout as R
from jaxkv.models import wan
from jaxkv.models.umt5.encoder import _encode_masked
from jaxkv.models.wan.config import WanConfig
from jaxkv.schedule import shifted
from jaxkv.toyworld import latents, text, world
from jaxkv.toyworld.model import WAN_CONFIG, Settings
from jaxkv.toyworld.model import save as save_release
from jaxkv.validate import is_real


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    batch: int = 8  # clips per teacher-forcing step
    steps: int = 1300  # teacher-forcing steps
    lr: float = 2e-3
    warmup: int = 100
    start_share: float = 0.5  # clips that run straight on from the sink (a stream's beginning)
    text_dropout: float = 0.0  # clips whose text is the empty prompt (what classifier-free guidance subtracts)
    pure_noise_share: float = 0.0  # chunks trained at sigma 1 exactly (the sampler's first step) among `noise_levels`
    refine_steps: int = 300  # stage 3: teacher-forcing steps from stage 2's weights (see the module docstring)
    refine_lr: float = 5e-4
    refine_warmup: int = 20
    refine_pure_noise_share: float = 0.25  # `pure_noise_share` of stage 3
    sf_steps: int = 600  # self-forcing steps (see the module docstring)
    sf_chunks: int = 4  # chunks a self-forcing clip rolls out after its committed frames (past the cache)
    sf_batch: int = 4
    sf_lr: float = 1e-4
    sf_colour_weight: float = 0.1  # weight of stage 4's colour-share term (`colour_share_error`)
    # weight of stage 4's outline term (`outline_error`); 0 in the shipped recipe so far (docs/toyworld-experiments.md,
    # "The outline term")
    sf_outline_weight: float = 0.0
    fit_frames: int = 2048  # frames the latent map is fitted on
    snapshot_every: int = 250
    # Recompute each DiT block's activations in the backward pass instead of storing them (`jax.checkpoint`):
    # on 2 CPU cores teacher-forcing steps 1.2-1.3x and self-forcing steps 1.7-2.1x faster (benchmarks/train_step.py),
    # but the weights differ from a run without it in float rounding from the first step: the defaults (release 6's
    # run) are without it; releases 7 and 8 were trained with it.
    remat: bool = False
    # The DiT's shape (`wan_config`): release 6's by default; the shipped release 8 (as release 7) is dim 192,
    # ffn 512, 6 heads (2.3 M parameters, 4.6 MB). A release must stay under 5 MB (its DiT is stored in bfloat16:
    # 2 bytes a parameter).
    dit_dim: int = WAN_CONFIG.dim
    dit_ffn_dim: int = WAN_CONFIG.ffn_dim
    dit_heads: int = WAN_CONFIG.num_heads
    dit_layers: int = WAN_CONFIG.num_layers

    def wan_config(self) -> WanConfig:
        """The DiT's `WanConfig`: `jaxkv.toyworld.model.WAN_CONFIG` with this config's width, heads and depth."""
        return dataclasses.replace(
            WAN_CONFIG, dim=self.dit_dim, ffn_dim=self.dit_ffn_dim, num_heads=self.dit_heads, num_layers=self.dit_layers
        )

    def __post_init__(self):
        for name in ("start_share", "text_dropout", "pure_noise_share", "refine_pure_noise_share"):
            value = getattr(self, name)
            if not is_real(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"TrainConfig.{name} is a share of clips or chunks, in [0, 1]; got {value!r}")
        for name in ("sf_colour_weight", "sf_outline_weight"):
            value = getattr(self, name)
            if not is_real(value) or not 0.0 <= value < float("inf"):
                raise ValueError(f"TrainConfig.{name} is a loss weight, finite and >= 0; got {value!r}")
        if isinstance(self.sf_chunks, bool) or not isinstance(self.sf_chunks, int) or self.sf_chunks < 1:
            raise ValueError(f"TrainConfig.sf_chunks is a number of chunks, >= 1; got {self.sf_chunks!r}")
        if not isinstance(self.remat, bool):
            raise ValueError(f"TrainConfig.remat is a bool; got {self.remat!r}")
        for name in ("dit_dim", "dit_ffn_dim", "dit_heads", "dit_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} is a size, an int >= 1; got {value!r}")
        if self.dit_dim % (2 * self.dit_heads):
            raise ValueError(
                f"TrainConfig.dit_dim ({self.dit_dim}) must split into dit_heads ({self.dit_heads}) "
                f"heads of an even width (RoPE rotates channel pairs)"
            )


# Frames of a shape's own path a chunk must see before it to know where the shape goes (two give a velocity).
CONTEXT_FRAMES = 2


def context_chunks(settings: Settings) -> int:
    """Window chunks of a clip that must precede a chunk for its answer to be fixed (`CONTEXT_FRAMES`)."""
    return -(-CONTEXT_FRAMES // settings.chunk_frames)


# ------------------------------------------------------------------------------------------------ data


def fit_latent_map(tc: TrainConfig) -> latents.LatentMap:
    rng = np.random.default_rng([tc.seed, 0])
    frames, _ = world.clips(rng, tc.fit_frames // 4, 4)
    return latents.LatentMap.fit(frames.reshape(-1, *frames.shape[2:]))


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
) -> Batch:
    """A `Batch` of clips laid out as a full cache holds them, drawn from (seed, stage, step) alone. Each clip is a
    random prompt's `world.canonical_scene`: its first ``sink_frames`` frames (the sink), then ``after_sink`` frames
    (default ``window_frames``; more for a clip that runs on past the cache) from frame ``sink_frames`` on
    (``at_start``, a ``start_share`` of the clips) or from a frame uniform in ``sink_frames + 1`` .. `MAX_START`. A
    ``text_dropout`` share of the clips is captioned with the empty prompt (drawn last, so the other draws do not
    depend on it); `Batch.objects` names the scene's objects whatever the caption."""
    rng = np.random.default_rng([seed, stage, step])
    prompts = [world.random_prompt(rng) for _ in range(size)]
    at_start = rng.random(size) < start_share
    sink = settings.sink_frames
    starts = np.where(at_start, sink, rng.integers(sink + 1, MAX_START + 1, size))
    scenes = [world.canonical_scene(p) for p in prompts]
    after_sink = settings.window_frames if after_sink is None else after_sink
    video = np.stack(
        [
            np.concatenate([world.render(scene, sink), world.render(scene, after_sink, int(t))])
            for scene, t in zip(scenes, starts)
        ]
    )
    objects = np.full((size, world.MAX_OBJECTS, 2), -1, np.int32)
    for clip, scene in zip(objects, scenes):
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


# ------------------------------------------------------------------------------------------------ losses


# Leaves that start at zero: every residual branch's output projection and the head, so the untrained DiT is the
# identity on its residual stream and predicts zero flow.
_ZERO_INIT = ("self_attn.o.", "cross_attn.o.", "ffn.fc2.", "head.head.")


def init_dit(key, config: WanConfig = WAN_CONFIG) -> dict:
    """The DiT's starting params (shaped by ``config``): `wan.init_params`, then the `_ZERO_INIT` leaves zeroed,
    biases zero and norm scales one."""

    def start(path, x):
        name = jax.tree_util.keystr(path, simple=True, separator=".") + "."
        if any(part in name for part in _ZERO_INIT) or name.endswith(".bias."):
            return jnp.zeros_like(x)
        return jnp.ones_like(x) if name.endswith(".scale.") else x

    return jax.tree_util.tree_map_with_path(start, wan.init_params(config, key))


def _context(text_params, ids, mask):
    return _encode_masked(text_params, text.CONFIG, ids, mask)


def supervised_chunks(at_start, settings: Settings):
    """bool [batch, chunks]: the chunks of a `batch` clip whose answer the clip fixes. The sink is a prompt's
    first frames (fixed by the prompt); a window chunk of a clip that does not start at the sink is fixed once
    `context_chunks` of the window precede it."""
    sink_chunks = settings.sink_frames // settings.chunk_frames
    chunks = sink_chunks + settings.window_frames // settings.chunk_frames
    index = jnp.arange(chunks)[None]
    return jnp.asarray(at_start)[:, None] | (index < sink_chunks) | (index >= sink_chunks + context_chunks(settings))


def noise_levels(key, shape, shift: float, pure_noise_share: float = 0.0):
    """float32 ``shape``: `jaxkv.schedule.shifted` (u, shift) for u uniform in [0, 1), the warp the sampler's steps
    go through; a shift > 1 puts more of them near pure noise, where the shapes' places are decided. A
    ``pure_noise_share`` of them is 1 exactly: the sampler's first step, where the shapes are decided from the
    context alone."""
    sigma = shifted(jax.random.uniform(key, shape), shift)
    if pure_noise_share:
        sigma = jnp.where(jax.random.uniform(jax.random.fold_in(key, 1), shape) < pure_noise_share, 1.0, sigma)
    return sigma


def teacher_forcing_loss(
    params,
    x0,
    ids,
    mask,
    at_start,
    key,
    settings: Settings,
    pure_noise_share: float = 0.0,
    remat: bool = False,
    config: WanConfig = WAN_CONFIG,
):
    """Flow-matching loss of clips x0 [B, F, h, w, c] (`batch`), every chunk denoised after the clean chunks before
    it (`wan.forward_teacher_forcing`, its blocks under `jax.checkpoint` with ``remat``) at its own noise level
    (`noise_levels`); the mean over the `supervised_chunks`."""
    b, f = x0.shape[:2]
    cf = settings.chunk_frames
    k_level, k_eps = jax.random.split(key)
    sigma = jnp.repeat(noise_levels(k_level, (b, f // cf), settings.shift, pure_noise_share), cf, axis=1)  # [B, F]
    eps = jax.random.normal(k_eps, x0.shape)
    xt = (1 - sigma[..., None, None, None]) * x0 + sigma[..., None, None, None] * eps
    flow = wan.forward_teacher_forcing(
        params["dit"],
        config,
        x0,
        xt,
        1000.0 * sigma,
        _context(params["text"], ids, mask),
        chunk_frames=cf,
        window_frames=settings.window_frames,
        sink_frames=settings.sink_frames,
        remat=remat,
    )
    per_frame = jnp.mean((flow - (eps - x0)) ** 2, axis=(2, 3, 4))  # [B, F]
    weight = jnp.repeat(supervised_chunks(at_start, settings), cf, axis=1).astype(jnp.float32)
    return jnp.sum(per_frame * weight) / jnp.maximum(jnp.sum(weight), 1.0)


# The world's palette (background, wall, then the shape colours of `world.COLOURS`) in [-1, 1], and the temperature
# of `colour_shares`' soft assignment of a pixel to it (by squared RGB distance; any two palette colours are >= 0.95
# apart in it, 19 temperatures, so a pixel near a colour goes almost wholly to it).
PALETTE = np.asarray([world.BACKGROUND, world.WALL, *world.COLOURS.values()], np.float32) / 127.5 - 1.0
SHAPE_COLOURS = slice(2, None)  # the shape colours' entries of PALETTE
SHARE_TEMPERATURE = 0.05


def colour_shares(latent_map: latents.LatentMap, x) -> jax.Array:
    """float32 [..., F, len(PALETTE)]: the percentage of each frame's pixels nearest each `PALETTE` colour (a softmax
    over minus the squared distance / `SHARE_TEMPERATURE`, so it has a gradient) for latents x [..., F, h, w, 16],
    decoded by ``latent_map``'s linear map (no clamp). On the world's own frames it is each colour's pixel count
    to within half a percentage point (the map blurs the edges)."""
    patches = (jnp.asarray(x, jnp.float32) * latent_map.std) @ latent_map.basis.T + latent_map.mean
    pixels = patches.reshape(*patches.shape[:-1], -1, 3)  # [..., F, h, w, 16 pixels, RGB]
    return 100.0 * jnp.mean(_palette_weights(pixels), axis=(-4, -3, -2))


def _palette_weights(pixels) -> jax.Array:
    """[..., len(PALETTE)]: the soft assignment of pixels [..., 3] (in [-1, 1]) to the `PALETTE` colours."""
    distance = jnp.sum((pixels[..., None, :] - PALETTE) ** 2, axis=-1)
    return jax.nn.softmax(-distance / SHARE_TEMPERATURE, axis=-1)


def colour_share_error(latent_map: latents.LatentMap, x, target) -> jax.Array:
    """The mean over frames and shape colours of the squared difference of `colour_shares` (percentage points
    squared) between latents x and target [..., F, h, w, 16]. Blind to where a shape is, so it does not reward what
    the squared error of a rollout rewards where the model is unsure of a shape's place: the mean of its possible
    places, a fainter, wider shape (docs/toyworld.md: self-forcing faded the shapes without it)."""
    return jnp.mean(
        (colour_shares(latent_map, x)[..., SHAPE_COLOURS] - colour_shares(latent_map, target)[..., SHAPE_COLOURS]) ** 2
    )


# `outline_error`: a shape's soft mask weighs a pixel by the sigmoid of minus its signed distance (px) to the outline
# over OUTLINE_SOFTNESS (about the pixel of blur the latent map leaves on the world's edges); a named object's centre
# is read from its colour's mask only where the mask holds OUTLINE_PRESENT px (the triangle, the smallest shape,
# covers ~114); an object lower in the prompt counts only while at most OUTLINE_CLEAR of its outline lies under a
# later-named one (its visible centroid moves as it goes under, so its outline would be put in the wrong place).
OUTLINE_SOFTNESS = 0.7
OUTLINE_PRESENT = 40.0
OUTLINE_CLEAR = 0.05
_PIXEL_CENTRES = np.mgrid[0 : world.SIZE, 0 : world.SIZE].astype(np.float32) + 0.5  # [2 (y, x), SIZE, SIZE]


def shape_outline(shape, centre) -> jax.Array:
    """float32 [..., SIZE, SIZE]: the soft mask of `world.SHAPES` [shape] (int [...], traced) centred at centre
    float [..., 2] (x, y, the world's units). Thresholded at 0.5 it is `world.shape_mask` (same outline: circle of
    `world.RADIUS`, square of half-side `world.HALF_SIDE`, triangle of circumradius `world.TRIANGLE_R` pointing up)."""
    dy = _PIXEL_CENTRES[0] - centre[..., 1, None, None]
    dx = _PIXEL_CENTRES[1] - centre[..., 0, None, None]
    r = world.TRIANGLE_R
    distance = {
        "circle": jnp.sqrt(dx * dx + dy * dy + 1e-12) - world.RADIUS,
        "square": jnp.maximum(jnp.abs(dx), jnp.abs(dy)) - world.HALF_SIDE,
        # the slanted edges' normals have length 2 in (sqrt(3) dx, -dy); the base is y = +r/2
        "triangle": jnp.maximum((np.sqrt(3.0) * jnp.abs(dx) - dy - r) / 2.0, dy - r / 2.0),
    }
    chosen = sum(
        jnp.where(jnp.asarray(shape)[..., None, None] == i, distance[name], 0.0) for i, name in enumerate(world.SHAPES)
    )
    return jax.nn.sigmoid(-chosen / OUTLINE_SOFTNESS)


def outline_error(latent_map: latents.LatentMap, x, objects) -> jax.Array:
    """How far each named object of the clips is from its own shape where the latents x [B, F, h, w, 16] draw it:
    the squared difference, summed over pixels and divided by the shape's area, between its colour's soft mask
    (`colour_shares`' assignment, decoded to the 64x64 frame) and its shape's `shape_outline` centred on that mask's
    centre of mass (with the objects named after it cut out: the world draws them on top); the mean over the
    objects and frames where it counts (see OUTLINE_PRESENT, OUTLINE_CLEAR). ``objects`` int [B, N, 2]: each
    clip's named objects in prompt order as (colour index into `world.COLOURS`, shape index into `world.SHAPES`),
    -1 rows where a clip names fewer (`batch`).

    Blind to where a shape is, like `colour_share_error`: the squared error to the world's frames rewards, where the
    model is unsure of a shape's place, a blob spread over its possible places; this term rewards the named shape,
    whole and sharp, wherever the model draws it. On the world's own frames (through the map) it is ~0.09."""
    masks = _palette_weights(latent_map.decode(x, clamp=False))[..., SHAPE_COLOURS]  # [B, F, SIZE, SIZE, colours]
    objects = jnp.asarray(objects)
    named = objects[..., 0] >= 0  # [B, N]
    drawn = jnp.einsum("bfyxc,bnc->bnfyx", masks, jax.nn.one_hot(objects[..., 0], masks.shape[-1]))
    mass = jnp.sum(drawn, axis=(-2, -1))  # [B, N, F]
    centre = (
        jnp.stack(
            [jnp.sum(drawn * _PIXEL_CENTRES[1], axis=(-2, -1)), jnp.sum(drawn * _PIXEL_CENTRES[0], axis=(-2, -1))], -1
        )
        / jnp.maximum(mass, 1e-3)[..., None]
    )
    outline = shape_outline(jnp.maximum(objects[..., 1], 0)[:, :, None], jax.lax.stop_gradient(centre))
    outline = outline * named[:, :, None, None, None]  # [B, N, F, SIZE, SIZE]
    count = objects.shape[1]
    errors, weights = [], []
    for n in range(count):
        on_top = 1.0 - jnp.prod(1.0 - outline[:, n + 1 :], axis=1) if n + 1 < count else 0.0
        area = jnp.maximum(jnp.sum(outline[:, n], axis=(-2, -1)), 1.0)  # [B, F]
        target = outline[:, n] * (1.0 - on_top)
        errors.append(jnp.sum((drawn[:, n] - target) ** 2, axis=(-2, -1)) / area)
        under = jnp.sum(outline[:, n] * on_top, axis=(-2, -1)) / area
        weights.append(
            jax.lax.stop_gradient(
                named[:, n, None] & (mass[:, n] >= OUTLINE_PRESENT) & (under <= OUTLINE_CLEAR)
            ).astype(jnp.float32)
        )
    errors, weights = jnp.stack(errors), jnp.stack(weights)
    return jnp.sum(errors * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def self_forcing_loss(
    params,
    x0,
    ids,
    mask,
    at_start,
    key,
    settings: Settings,
    latent_map: latents.LatentMap | None = None,
    colour_weight: float = 0.0,
    remat: bool = False,
    objects=None,
    outline_weight: float = 0.0,
    config: WanConfig = WAN_CONFIG,
):
    """x0 [B, F, ...] (`batch`, ``after_sink`` frames after the sink): commit the sink and the first
    `context_chunks` window chunks, roll the other (F - committed) / chunk_frames chunks out on the ring (noise of
    chunk n from ``fold_in(key, n)``, n counted from the stream's first chunk); the mean squared error of the
    rolled-out latents to the clip's, plus ``colour_weight`` x their `colour_share_error` and ``outline_weight`` x
    their `outline_error` against the clips' named ``objects`` (`Batch.objects`); either weight needs the
    ``latent_map`` that decodes the latents. ``remat``: the rollout's blocks under `jax.checkpoint`
    (`jaxkv.rollout.RolloutConfig.remat`)."""
    if (colour_weight or outline_weight) and latent_map is None:
        raise ValueError(
            "self_forcing_loss: a colour_weight or outline_weight needs the latent_map that decodes the latents"
        )
    if outline_weight and objects is None:
        raise ValueError("self_forcing_loss: an outline_weight needs the clips' named objects (Batch.objects)")
    rc = settings.rollout_config(guidance_scale=None, remat=remat)  # training rolls out the conditional model alone
    cf = settings.chunk_frames
    committed = settings.sink_frames // cf + context_chunks(settings)
    state = R.init_state(params["dit"], config, rc, _context(params["text"], ids, mask))
    state = R.commit(params["dit"], config, rc, state, x0[:, : committed * cf])
    out = R.rollout(
        params["dit"],
        config,
        rc,
        None,
        num_chunks=x0.shape[1] // cf - committed,
        key=key,
        state=state,
        first_chunk=committed,
    )
    target = x0[:, committed * cf :]
    loss = jnp.mean((out.latents - target) ** 2)
    if colour_weight:
        loss = loss + colour_weight * colour_share_error(latent_map, out.latents, target)
    if outline_weight:
        loss = loss + outline_weight * outline_error(latent_map, out.latents, objects)
    return loss


def _optimizer(lr: float, steps: int, warmup: int):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, min(warmup, max(steps - 1, 1)), max(steps, 2), end_value=lr * 0.1
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


def _step_fn(loss_fn, optimizer):
    """One optax step of ``loss_fn(params, batch: Batch, key)``, jit-compiled."""

    @jax.jit
    def step(params, opt_state, clips: Batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, clips, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# ------------------------------------------------------------------------------------------------ snapshots


def _save_snapshot(
    path: str,
    stage: int,
    step: int,
    params,
    opt_state,
    losses: list[float],
    done: list,
    seconds: tuple[float, float],
    tc: TrainConfig,
) -> None:
    """params + optimizer state + position, atomically (a Ctrl-C while writing keeps the previous snapshot).
    ``seconds``: (the run's, the stage's) training time so far, so a resumed run records the whole of it; ``tc``
    the run's config, which a resumed run must repeat."""
    from safetensors.numpy import save_file

    leaves = jax.tree.leaves((params, opt_state))
    tmp = path + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file({f"{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}, os.path.join(tmp, "state.safetensors"))
    with open(os.path.join(tmp, "position.json"), "w") as f:
        json.dump(
            {
                "stage": stage,
                "step": step,
                "losses": losses,
                "finished_stages": done,
                "seconds": round(seconds[0], 1),
                "stage_seconds": round(seconds[1], 1),
                "train_config": dataclasses.asdict(tc),
            },
            f,
        )
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def _read_position(path: str) -> dict:
    """The snapshot's stage, step, losses and finished stages (position.json)."""
    with open(os.path.join(path, "position.json")) as f:
        return json.load(f)


def _load_snapshot(path: str, template):
    from safetensors.numpy import load_file

    position = _read_position(path)
    flat = load_file(os.path.join(path, "state.safetensors"))
    leaves, treedef = jax.tree.flatten(template)
    if len(flat) != len(leaves):
        raise ValueError(f"snapshot {path} holds {len(flat)} arrays, this training run has {len(leaves)}")
    restored = [jnp.asarray(flat[f"{i:05d}"], leaf.dtype) for i, leaf in enumerate(leaves)]
    return position, jax.tree.unflatten(treedef, restored)


# ------------------------------------------------------------------------------------------------ the run


# What a resumed run may change (`resume_conflicts`). The stages (0, 1, 2: the docstring's 2, 3, 4) each TrainConfig
# field changes; fields not listed change every stage (seed, fit_frames, start_share, text_dropout: the latent map and
# the clips) but those in _RESUME_FREE, which change how a step is computed, not what (remat: float rounding only,
# like resuming on another machine; each stage's record says whether it ran with remat).
_FIELD_STAGES = {
    "batch": (0, 1),
    "steps": (0,),
    "lr": (0,),
    "warmup": (0,),
    "pure_noise_share": (0,),
    "refine_steps": (1,),
    "refine_lr": (1,),
    "refine_warmup": (1,),
    "refine_pure_noise_share": (1,),
    "sf_steps": (2,),
    "sf_chunks": (2,),
    "sf_batch": (2,),
    "sf_lr": (2,),
    "sf_colour_weight": (2,),
    "sf_outline_weight": (2,),
}
_RESUME_FREE = ("remat",)
# The value a field added after snapshots began recording their config had before it existed (else its default).
_BEFORE_FIELD = {"sf_outline_weight": 0.0}


def resume_conflicts(position: dict, tc: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(field, the snapshot's value, ``tc``'s value) of each TrainConfig field that a run resuming the snapshot
    ``position`` (its position.json) would change in a stage the snapshot has begun: a resumed run must repeat
    the steps already taken, while a stage not yet begun may run with other settings (a run stopped between
    stages continues with, say, more self-forcing steps). Empty for snapshots that record no config."""
    saved = position.get("train_config")
    if saved is None:
        return []
    begun = set(range(position["stage"] + (position["step"] > 0)))
    out = []
    for name, value in dataclasses.asdict(tc).items():
        there = saved.get(name, _BEFORE_FIELD.get(name, getattr(TrainConfig(), name)))
        if name not in _RESUME_FREE and begun & set(_FIELD_STAGES.get(name, (0, 1, 2))) and there != value:
            out.append((name, there, value))
    return out


def train(
    out: str,
    tc: TrainConfig = TrainConfig(),
    settings: Settings = Settings(),
    *,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Trains from scratch (or from the snapshot in ``out + '.partial'`` with ``resume``) and writes the release to
    ``out`` (`jaxkv.toyworld.model.save`). Returns the training record stored in its toyworld.json."""
    from tqdm import tqdm

    snapshot = os.path.abspath(out) + ".partial"
    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass force=True (--overwrite) to replace a toy-world release")
    if resume and not os.path.isdir(snapshot):
        raise FileNotFoundError(f"--resume: no snapshot at {snapshot}")
    if resume:  # a resumed run is the interrupted one continued: same config, or its steps would not be its own
        interrupted = _read_position(snapshot)
        saved = interrupted.get("train_config")  # (snapshots before this check hold none)
        changed = resume_conflicts(interrupted, tc)
        if changed:
            raise ValueError(
                f"--resume: the snapshot at {snapshot} was written by a run with other settings ("
                + ", ".join(f"{k} {there!r} there, {here!r} here" for k, there, here in changed)
                + "); resume with the flags it was started with"
            )
    started = time.perf_counter()
    latent_map = fit_latent_map(tc)
    tokenizer = text.tokenizer()
    key = jax.random.key(tc.seed)
    config = tc.wan_config()
    params = {"dit": init_dit(jax.random.fold_in(key, 0), config), "text": text.init_text_params(tc.seed)}

    def teacher_forcing(pure_noise_share):
        return lambda p, b, k: teacher_forcing_loss(
            p, b.latents, b.ids, b.mask, b.at_start, k, settings, pure_noise_share, tc.remat, config
        )

    # (name, steps, batch, frames after the sink, loss, optimizer): stages 2, 3 and 4 of the docstring
    sf_frames = (context_chunks(settings) + tc.sf_chunks) * settings.chunk_frames
    stages = [
        (
            "teacher forcing",
            tc.steps,
            tc.batch,
            settings.window_frames,
            teacher_forcing(tc.pure_noise_share),
            _optimizer(tc.lr, tc.steps, tc.warmup),
        ),
        (
            "teacher forcing, level-1 share",
            tc.refine_steps,
            tc.batch,
            settings.window_frames,
            teacher_forcing(tc.refine_pure_noise_share),
            _optimizer(tc.refine_lr, tc.refine_steps, tc.refine_warmup),
        ),
        (
            "self-forcing",
            tc.sf_steps,
            tc.sf_batch,
            sf_frames,
            lambda p, b, k: self_forcing_loss(
                p,
                b.latents,
                b.ids,
                b.mask,
                b.at_start,
                k,
                settings,
                latent_map,
                tc.sf_colour_weight,
                tc.remat,
                b.objects,
                tc.sf_outline_weight,
                config,
            ),
            _optimizer(tc.sf_lr, tc.sf_steps, 20),
        ),
    ]
    record: dict[str, Any] = {"stages": []}
    first_stage, first_step, losses = 0, 0, []
    before, stage_before = 0.0, 0.0  # seconds spent in earlier processes (a resumed run): run, stage
    opt_state = stages[0][5].init(params)
    if resume:
        first_stage = _read_position(snapshot)["stage"]
        opt_state = stages[first_stage][5].init(params)
        position, (params, opt_state) = _load_snapshot(snapshot, (params, opt_state))
        first_step, losses = position["step"], position["losses"]
        # stage records written before they carried remat: the interrupted run's setting (remat is _RESUME_FREE)
        ran_with = (saved or {}).get("remat", False)
        record["stages"] = [{**s, "remat": s.get("remat", ran_with)} for s in position["finished_stages"]]
        resumed_remat = ran_with if first_step else tc.remat  # the setting of the stage's steps before this run
        before, stage_before = position.get("seconds", 0.0), position.get("stage_seconds", 0.0)
    for stage in range(first_stage, len(stages)):
        name, steps, size, after_sink, loss_fn, optimizer = stages[stage]
        if stage != first_stage:
            opt_state, first_step, losses, stage_before = optimizer.init(params), 0, [], 0.0
        step_fn = _step_fn(loss_fn, optimizer)
        t0 = time.perf_counter()

        def seconds():
            now = time.perf_counter()
            return before + now - started, stage_before + now - t0  # noqa: B023 - called in the iteration that defines it

        bar = tqdm(
            range(first_step, steps), desc=name, disable=not progress, file=sys.stderr, initial=first_step, total=steps
        )
        done = first_step  # steps of this stage whose update is in params
        try:
            for step in bar:
                clips = batch(
                    latent_map,
                    tokenizer,
                    settings,
                    tc.seed,
                    stage + 1,
                    step,
                    size,
                    tc.start_share,
                    tc.text_dropout,
                    after_sink,
                )
                params, opt_state, loss = step_fn(
                    params, opt_state, clips, jax.random.fold_in(jax.random.fold_in(key, stage + 1), step)
                )
                done = step + 1
                losses.append(float(loss))
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
                if done % tc.snapshot_every == 0 and done < steps:
                    _save_snapshot(snapshot, stage, done, params, opt_state, losses, record["stages"], seconds(), tc)
        except KeyboardInterrupt:
            bar.close()
            _save_snapshot(snapshot, stage, done, params, opt_state, losses[:done], record["stages"], seconds(), tc)
            print(f"interrupted: snapshot at {name} step {done} in {snapshot}; continue with --resume", file=sys.stderr)
            raise
        bar.close()
        remat = tc.remat if stage != first_stage or not resume or resumed_remat == tc.remat else "mixed"
        record["stages"].append(
            {
                "name": name,
                "steps": steps,
                "seconds": round(seconds()[1], 1),
                "remat": remat,
                "loss_first_50": float(np.mean(losses[:50])) if losses else None,
                "loss_last_50": float(np.mean(losses[-50:])) if losses else None,
            }
        )
        if stage + 1 < len(stages):
            _save_snapshot(
                snapshot,
                stage + 1,
                0,
                params,
                stages[stage + 1][5].init(params),
                [],
                record["stages"],
                (seconds()[0], 0.0),
                tc,
            )
    record.update(
        seed=tc.seed,
        train_config=dataclasses.asdict(tc),
        seconds=round(before + time.perf_counter() - started, 1),
        command=command or f"python -m jaxkv.toyworld train --out {out} --seed {tc.seed}",
        jax_version=jax.__version__,
    )
    save_release(
        out, params["dit"], params["text"], latent_map, settings, {"training": record}, config=config, force=force
    )
    shutil.rmtree(snapshot, ignore_errors=True)
    return record
