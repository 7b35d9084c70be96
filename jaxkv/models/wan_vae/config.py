"""Wan 2.1 VAE configuration, presets and the published latent statistics.

A `WanVAEConfig` is static (frozen, hashable, never traced): it fixes every parameter shape, the number of feature
caches of the streaming decoder and the temporal/spatial compression. ``wan2.1-vae`` is the released Wan 2.1 VAE
(``Wan2.1_VAE.pth``, diffusers ``AutoencoderKLWan`` with its default config); ``tiny`` is a small random VAE for
tests and the embedded default of ``jaxkv generate``, with the same 16 latent channels as the tiny DiT.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from jaxkv.validate import check_int

# Per-channel statistics of the Wan 2.1 latent space, published with the model: the DiT sees
# (z - mean) / std (`latents.normalize`).
LATENTS_MEAN = (
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
)
LATENTS_STD = (
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
)


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """Static shape of a Wan 2.1 causal 3-D VAE.

    Attributes:
      base_dim: channels of the first encoder / last decoder stage (96 in Wan 2.1).
      z_dim: latent channels (16); the encoder emits 2 * z_dim (mean and log-variance).
      dim_mult: channel multiplier of each stage; ``len(dim_mult) - 1`` spatial 2x resamplings.
      num_res_blocks: residual blocks per encoder stage (the decoder has one more per stage).
      temporal_downsample: per resampling, whether it also halves time (encoder order; the decoder reverses it).
      image_channels: channels of the video (3, RGB in [-1, 1]).
      latents_mean, latents_std: the z_dim per-channel statistics used by `normalize` / `denormalize`.
    """

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    image_channels: int = 3
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD

    def __post_init__(self):
        for name in ("base_dim", "z_dim", "num_res_blocks", "image_channels"):
            object.__setattr__(self, name, check_int(f"WanVAEConfig.{name}", getattr(self, name), minimum=1))
        mult = self.dim_mult
        if not isinstance(mult, (tuple, list)) or len(mult) < 1:
            raise ValueError(f"WanVAEConfig.dim_mult must be a non-empty sequence of positive ints, got {mult!r}")
        object.__setattr__(self, "dim_mult", tuple(check_int("WanVAEConfig.dim_mult[i]", m, minimum=1) for m in mult))
        down = self.temporal_downsample
        if (
            not isinstance(down, (tuple, list))
            or len(down) != len(self.dim_mult) - 1
            or any(not isinstance(d, bool) for d in down)
        ):
            raise ValueError(
                f"WanVAEConfig.temporal_downsample must be {len(self.dim_mult) - 1} bools (one per "
                f"resampling, len(dim_mult) - 1), got {down!r}"
            )
        object.__setattr__(self, "temporal_downsample", tuple(down))
        for name in ("latents_mean", "latents_std"):
            values = getattr(self, name)
            if (
                not isinstance(values, (tuple, list))
                or len(values) != self.z_dim
                or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in values)
            ):
                raise ValueError(
                    f"WanVAEConfig.{name} must be {self.z_dim} finite floats (one per latent channel), got {values!r}"
                )
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if any(s <= 0 for s in self.latents_std):
            raise ValueError(f"WanVAEConfig.latents_std must be > 0, got {self.latents_std}")
        for i, m in enumerate(self.decoder_dims[1:-1]):
            if (self.base_dim * m) % 2:
                raise ValueError(
                    f"decoder stage {i + 1} has {self.base_dim * m} channels; upsampling halves them, so "
                    f"they must be even"
                )

    # --- derived sizes -------------------------------------------------------------------------------------------

    @property
    def temporal_upsample(self) -> tuple[bool, ...]:
        """Per decoder upsampling, whether it doubles time (the encoder's flags reversed)."""
        return self.temporal_downsample[::-1]

    @property
    def temporal_factor(self) -> int:
        """Video frames per latent frame after the first (4 for Wan 2.1): T latent frames <-> 1 + f(T - 1) frames."""
        return 2 ** sum(self.temporal_downsample)

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent pixel along height and width (8 for Wan 2.1)."""
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def first_chunk_padding(self) -> int:
        """Leading frames of a stream's first `decode_chunk` output that are not video (``temporal_factor - 1``)."""
        return self.temporal_factor - 1

    @property
    def encoder_dims(self) -> tuple[int, ...]:
        return tuple(self.base_dim * m for m in (1, *self.dim_mult))

    @property
    def decoder_dims(self) -> tuple[int, ...]:
        return tuple(self.base_dim * m for m in (self.dim_mult[-1], *self.dim_mult[::-1]))

    def video_frames(self, latent_frames: int) -> int:
        """Frames decoded from ``latent_frames`` latent frames: ``1 + temporal_factor * (latent_frames - 1)``."""
        t = check_int("latent_frames", latent_frames, minimum=1)
        return 1 + self.temporal_factor * (t - 1)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key, value in d.items():
            if isinstance(value, tuple):
                d[key] = list(value)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WanVAEConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown WanVAEConfig fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


PRESETS: dict[str, WanVAEConfig] = {
    "wan2.1-vae": WanVAEConfig(),
    # Every structural feature of the real one (3 resamplings, 2 temporal, channel changes, shortcuts, the mid
    # attention) at 8 base channels and one residual block per stage: decodes a 4x4 latent in milliseconds.
    "tiny": WanVAEConfig(base_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1),
}


def preset(name: str) -> WanVAEConfig:
    """Returns the named preset; raises ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown Wan VAE preset {name!r}; known presets: {sorted(PRESETS)}") from None
