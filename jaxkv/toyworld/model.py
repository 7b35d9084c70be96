"""The toy model: its configuration, its streaming settings, and the release directory it ships in.

A release is the layout of a converted Wan release (`jaxkv.models.release`) plus the latent map::

    DIR/
      dit/            the causal Wan DiT (`jaxkv.models.wan.checkpoint`), weights stored in bfloat16
      text_encoder/   the tiny umT5 encoder with its word-level tokenizer.json (`jaxkv.models.umt5.checkpoint`)
      latent_map/     latent_map.safetensors (`jaxkv.toyworld.latents.LatentMap`)
      toyworld.json   the streaming settings the model was trained for, the training command, seed and figures

`RELEASE_DIR` is the one shipped inside the package (``jaxkv generate``'s default model); `load` reads any.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxkv.models import wan
from jaxkv.models.release import PARTS
from jaxkv.models.umt5 import TextEncoder
from jaxkv.models.wan.config import WanConfig
from jaxkv.rollout import RolloutConfig
from jaxkv.schedule import Schedule
from jaxkv.toyworld import latents, text

RELEASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "release")
SETTINGS_FILE = "toyworld.json"
LATENT_MAP_DIR = "latent_map"
FORMAT = "jaxkv-toyworld"
FORMAT_VERSION = 1

# 64 tokens per latent frame: Wan's (1, 2, 2) patches of the 16x16 latent, each token covering 8x8 pixels. A token
# carries 2 * 2 * 16 = 64 latent values, fewer than the width (96): the flow target holds the input noise, which a
# token must carry through the residual stream (a first try with (1, 4, 4) patches, 256 values into 128 dims,
# could not: its samples stayed noisy and its loss stalled at 1.5).
#
# RoPE base 100, not Wan's 10,000: with 3 heads of 32 channels Wan's RoPE split gives height and width 10 channels
# each, and at base 10,000 their frequencies barely vary over the 8x8 token grid, so the first sampler step (pure
# noise in: position is all a query has) could not address "the same place a frame back" and drew a smeared copy of
# the last frame; at base 100 a model trained on the sampler's 4 levels guessed the next chunk better than holding
# the last frame still (docs/toyworld.md).
#
# This is the default shape of a training run (`train.TrainConfig.dit_*`, release 6's); the shipped release 8 (like
# release 7) is twice as wide (dim 192, ffn 512, 6 heads of the same 32 channels: its dit/config.json), and a loaded
# release always carries its own config (`ToyModel.config`).
WAN_CONFIG = WanConfig(
    dim=96,
    ffn_dim=256,
    num_heads=3,
    num_layers=4,
    patch_size=(1, 2, 2),
    text_dim=text.CONFIG.dim,
    text_len=text.CONFIG.text_len,
    freq_dim=64,
    rope_theta=100.0,
)
LATENT_SIZE = 64 // latents.PATCH  # 16: latent height and width


@dataclasses.dataclass(frozen=True)
class Settings:
    """The streaming settings of a toy model (latent frames; what it was trained with and generates with).

    Wan's 3-frame chunks; the cache holds the first chunk as the sink and the two latest chunks as the window. RoPE
    is cache-relative (keys rotated by their rank in the cache, `jaxkv.models.wan.cache_relative_rope`): the sink
    stays at rank 0 however long the stream runs, so the model never meets a distance to it that its 9-frame
    training clips did not show it (with absolute RoPE, a model trained on short clips drew garbage once the stream
    was ~20 frames past its sink)."""

    chunk_frames: int = 3
    window_frames: int = 6
    sink_frames: int = 3
    steps: tuple[int, ...] = (1000, 750, 500, 250)
    shift: float = 3.0  # the sampler's steps warp to sigma 1, 0.9, 0.75, 0.5; training draws its levels with it
    rope: str = "cache-relative"
    prompt: str = "a red circle and a blue square, slow"  # the default prompt
    # classifier-free guidance against ``negative_prompt`` (a model trained with text dropout); None: none
    guidance_scale: float | None = None
    negative_prompt: str = ""

    def schedule(self) -> Schedule:
        return Schedule(steps=tuple(self.steps), shift=self.shift)

    def rollout_config(self, **overrides) -> RolloutConfig:
        """The `RolloutConfig` of these settings on the 16x16 latent, with any field replaced by ``overrides``
        (e.g. ``sink_frames=0``, ``policy="rolling"``, ``rope="absolute"``)."""
        rc = RolloutConfig(
            latent_height=LATENT_SIZE,
            latent_width=LATENT_SIZE,
            chunk_frames=self.chunk_frames,
            window_frames=self.window_frames,
            sink_frames=self.sink_frames,
            schedule=self.schedule(),
            rope=self.rope,
            guidance_scale=self.guidance_scale,
        )
        return dataclasses.replace(rc, **overrides) if overrides else rc

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["steps"] = list(self.steps)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Settings":
        known = {f.name for f in dataclasses.fields(cls)}
        # releases written before "rope" was recorded streamed with absolute RoPE
        return cls(**{"rope": "absolute", **{k: tuple(v) if k == "steps" else v for k, v in d.items() if k in known}})


@dataclasses.dataclass(frozen=True, eq=False)
class ToyModel:
    """A loaded toy model: the DiT (config, float32 params), the text encoder, the latent map, the settings and
    the rest of ``toyworld.json`` (``info``: training command, seed, figures)."""

    config: WanConfig
    params: dict
    text_encoder: TextEncoder
    latent_map: latents.LatentMap
    settings: Settings
    info: dict

    def context(self, prompts) -> np.ndarray:
        """float32 [len(prompts), text_len, text_dim] for toy-world prompts (checked by `world.parse_prompt`)."""
        from jaxkv.toyworld.world import parse_prompt

        for p in prompts:
            parse_prompt(p)
        return self.text_encoder.encode(list(prompts))

    def negative_context(self, batch: int, rc: RolloutConfig) -> np.ndarray | None:
        """float32 [batch, text_len, text_dim]: the settings' negative prompt (what guidance steers away from) for
        each of ``batch`` rows when ``rc`` guides; None when it does not."""
        if rc.guidance_scale is None:
            return None
        return self.text_encoder.encode([self.settings.negative_prompt] * batch)


def save(
    directory: str,
    params: dict,
    text_params: dict,
    latent_map: latents.LatentMap,
    settings: Settings,
    info: dict,
    *,
    config: WanConfig = WAN_CONFIG,
    force: bool = False,
) -> None:
    """Writes a release (see the module docstring): ``params`` a DiT of shape ``config``, its weights stored in
    bfloat16."""
    from jaxkv.files import atomic_directory
    from jaxkv.models import umt5

    replace = (
        (lambda p: None if is_release(p) else f"it is not a toy-world release (no {SETTINGS_FILE})") if force else None
    )
    with atomic_directory(directory, replace=replace) as tmp:
        wan.save(os.path.join(tmp, PARTS["dit"]), config, _cast(params, jnp.bfloat16))
        umt5.save(
            os.path.join(tmp, PARTS["umt5"]),
            text.CONFIG,
            text_params,
            tokenizer_files={"tokenizer.json": text.tokenizer_json().encode()},
        )
        os.makedirs(os.path.join(tmp, LATENT_MAP_DIR))
        latent_map.save(os.path.join(tmp, LATENT_MAP_DIR))
        with open(os.path.join(tmp, SETTINGS_FILE), "w") as f:
            json.dump(
                {"format": FORMAT, "format_version": FORMAT_VERSION, "settings": settings.to_dict(), **info},
                f,
                indent=2,
                sort_keys=True,
            )


def _cast(tree, dtype):
    import jax

    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def is_release(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, SETTINGS_FILE))


def read_settings(directory: str) -> Settings:
    """The `Settings` of a release from its toyworld.json alone (no weights read), format checked as `load` checks
    it: for a caller that validates its flags before loading anything (``jaxkv generate``)."""
    path = os.path.join(directory, SETTINGS_FILE)
    with open(path) as f:
        meta = json.load(f)
    if (
        not isinstance(meta, dict)
        or meta.get("format") != FORMAT
        or meta.get("format_version") != FORMAT_VERSION
        or not isinstance(meta.get("settings"), dict)
    ):
        raise ValueError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} file with settings")
    return Settings.from_dict(meta["settings"])


def load_text_params(directory: str) -> dict:
    """A release's text-encoder weights in float32, to train or average (a `ToyModel`'s encoder keeps its own);
    ValueError if the encoder is not the toy model's (`text.CONFIG`)."""
    from jaxkv.models import umt5

    config, params, _ = umt5.load(os.path.join(directory, PARTS["umt5"]), dtype=jnp.float32)
    if config != text.CONFIG:
        raise ValueError(f"{directory}: its text encoder is not the toy model's ({config})")
    return params


def load(directory: str = RELEASE_DIR) -> ToyModel:
    """Reads a release; the DiT in float32. FileNotFoundError / ValueError name what is missing or wrong."""
    path = os.path.join(directory, SETTINGS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{directory} is not a toy-world release (no {SETTINGS_FILE}); train one with "
            f"`python -m jaxkv.toyworld train --out {directory}`"
        )
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is not a {FORMAT} v{FORMAT_VERSION} file (format {meta.get('format')!r}, "
            f"version {meta.get('format_version')!r})"
        )
    config, params = wan.load(os.path.join(directory, PARTS["dit"]), dtype=jnp.float32)
    encoder = TextEncoder.load(os.path.join(directory, PARTS["umt5"]), dtype=jnp.float32)
    latent_map = latents.LatentMap.load(os.path.join(directory, LATENT_MAP_DIR))
    info = {k: v for k, v in meta.items() if k not in ("format", "format_version", "settings")}
    return ToyModel(config, params, encoder, latent_map, Settings.from_dict(meta["settings"]), info)
