"""The toy world's training objectives (`jaxkv.toyworld.train` runs them in stages; its docstring says why each is
there): the DiT's starting params (`init_dit`), the teacher-forcing flow loss at every noise level
(`teacher_forcing_loss`, `noise_levels`), and the self-forcing loss through the ring (`self_forcing_loss`) with its
pixel-space terms: each colour's pixel share (`colour_share_error`) and each named shape's outline
(`outline_error`), both blind to where a shape is, and each named shape's distance from its place in the world
(`position_error`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import rollout as R
from jaxkv.models import wan
from jaxkv.models.umt5.encoder import _encode_masked
from jaxkv.models.wan.config import WanConfig
from jaxkv.schedule import shifted
from jaxkv.toyworld import latents, text, world
from jaxkv.toyworld.clips import context_chunks
from jaxkv.toyworld.model import WAN_CONFIG, Settings

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


def _named_masks(latent_map: latents.LatentMap, x, objects) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each named object's colour mask in latents x [B, F, h, w, 16] decoded to the frame (`colour_shares`' soft
    assignment): (mask [B, N, F, SIZE, SIZE], its mass in px [B, N, F], its centre of mass [B, N, F, 2] as (x, y)
    in the world's units) for ``objects`` int [B, N, 2] (`outline_error`)."""
    masks = _palette_weights(latent_map.decode(x, clamp=False))[..., SHAPE_COLOURS]  # [B, F, SIZE, SIZE, colours]
    drawn = jnp.einsum("bfyxc,bnc->bnfyx", masks, jax.nn.one_hot(objects[..., 0], masks.shape[-1]))
    mass = jnp.sum(drawn, axis=(-2, -1))
    centre = (
        jnp.stack(
            [jnp.sum(drawn * _PIXEL_CENTRES[1], axis=(-2, -1)), jnp.sum(drawn * _PIXEL_CENTRES[0], axis=(-2, -1))], -1
        )
        / jnp.maximum(mass, 1e-3)[..., None]
    )
    return drawn, mass, centre


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
    objects = jnp.asarray(objects)
    named = objects[..., 0] >= 0  # [B, N]
    drawn, mass, centre = _named_masks(latent_map, x, objects)
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


def position_error(latent_map: latents.LatentMap, x, target, objects) -> jax.Array:
    """How far each named object is drawn from where the world puts it, in px: the pseudo-Huber distance
    ``sqrt(d^2 + 1) - 1`` between the centre of mass of its colour's mask (`_named_masks`) in latents x and in
    target [B, F, h, w, 16], the mean over the objects and frames where both masks hold `OUTLINE_PRESENT` px (a
    shape not drawn has no centre; the colour-share term is what keeps it drawn). ``objects`` as `outline_error`.

    Unlike the squared error of the latents, it does not reward a faint copy of the shape at each of its possible
    places (their mean centre is the target only if the places are balanced around it): a shape drawn behind where
    the world puts it costs its lag in px, however sharp or faint. Linear past ~1 px, so a shape that went the
    wrong way at a bounce does not outweigh the rest. World frames through the latent map against themselves: 0."""
    objects = jnp.asarray(objects)
    _, mass, centre = _named_masks(latent_map, x, objects)
    _, target_mass, target_centre = jax.lax.stop_gradient(_named_masks(latent_map, target, objects))
    counts = (objects[..., 0] >= 0)[:, :, None] & (target_mass >= OUTLINE_PRESENT)
    counts = jax.lax.stop_gradient(counts & (mass >= OUTLINE_PRESENT)).astype(jnp.float32)
    distance = jnp.sqrt(jnp.sum((centre - target_centre) ** 2, axis=-1) + 1.0) - 1.0  # [B, N, F]
    return jnp.sum(distance * counts) / jnp.maximum(jnp.sum(counts), 1.0)


# [shape, shape]: the distance between two shapes' centres below which their reaches overlap (`world.contact` less
# its gap): the world bounces shapes apart a gap before this, so its frames never come closer
_TOUCH = np.array([[world.REACH[a] + world.REACH[b] for b in world.SHAPES] for a in world.SHAPES], np.float32)


def apart_error(latent_map: latents.LatentMap, x, objects) -> jax.Array:
    """How far the clips' named objects are drawn into each other, in px: for each pair of named objects of a clip,
    ``max(0, touch - d)`` where d is the distance between the centres of their colour masks (`_named_masks`) in
    latents x [B, F, h, w, 16] and touch the sum of their shapes' reaches (`world.REACH`); the mean over the pairs
    and frames where both masks hold `OUTLINE_PRESENT` px. ``objects`` as `outline_error`; 0 for clips naming one.

    The world bounces two shapes apart before their reaches meet (`world.paths`), so no shape hides another; a
    model rolling out its own paths can draw them over each other, after which it tends to draw only one. Blind to
    where the pair should be: it costs only the overlap. World frames through the latent map: ~0."""
    objects = jnp.asarray(objects)
    _, mass, centre = _named_masks(latent_map, x, objects)  # [B, N, F], [B, N, F, 2]
    present = jax.lax.stop_gradient((objects[..., 0] >= 0)[:, :, None] & (mass >= OUTLINE_PRESENT))
    n = objects.shape[1]
    first, second = np.triu_indices(n, k=1)
    if not len(first):
        return jnp.zeros((), jnp.float32)
    shape = jnp.maximum(objects[..., 1], 0)  # [B, N]; rows of -1 are not present
    touch = jnp.asarray(_TOUCH)[shape[:, first], shape[:, second]]  # [B, pairs]
    d = jnp.sqrt(jnp.sum((centre[:, first] - centre[:, second]) ** 2, axis=-1) + 1e-6)  # [B, pairs, F]
    counts = (present[:, first] & present[:, second]).astype(jnp.float32)
    overlap = jnp.maximum(touch[..., None] - d, 0.0)
    return jnp.sum(overlap * counts) / jnp.maximum(jnp.sum(counts), 1.0)


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
    position_weight: float = 0.0,
    apart_weight: float = 0.0,
):
    """x0 [B, F, ...] (`batch`, ``after_sink`` frames after the sink): commit the sink and the first
    `context_chunks` window chunks, roll the other (F - committed) / chunk_frames chunks out on the ring (noise of
    chunk n from ``fold_in(key, n)``, n counted from the stream's first chunk); the mean squared error of the
    rolled-out latents to the clip's, plus ``colour_weight`` x their `colour_share_error`, ``outline_weight`` x
    their `outline_error`, ``position_weight`` x their `position_error` and ``apart_weight`` x their
    `apart_error` against the clips' named ``objects`` (`Batch.objects`); each weight needs the ``latent_map`` that
    decodes the latents. ``remat``: the rollout's
    blocks under `jax.checkpoint` (`jaxkv.rollout.RolloutConfig.remat`)."""
    if (colour_weight or outline_weight or position_weight or apart_weight) and latent_map is None:
        raise ValueError(
            "self_forcing_loss: a colour_weight, outline_weight, position_weight or apart_weight needs the "
            "latent_map that decodes the latents"
        )
    if (outline_weight or position_weight or apart_weight) and objects is None:
        raise ValueError(
            "self_forcing_loss: an outline_weight, position_weight or apart_weight needs the clips' named objects "
            "(Batch.objects)"
        )
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
    if position_weight:
        loss = loss + position_weight * position_error(latent_map, out.latents, target, objects)
    if apart_weight:
        loss = loss + apart_weight * apart_error(latent_map, out.latents, objects)
    return loss
