"""Wan 2.1 transformer configuration and presets.

A `WanConfig` is static (hashable, never traced): it fixes every parameter shape. The presets follow the released
Wan 2.1 text-to-video models; ``tiny`` is a small model for tests and the embedded default of ``jaxkv generate``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from jaxkv.validate import MAX_LAYERS, MAX_TEXT_LEN, MAX_WIDTH, check_int, is_int, is_real


@dataclasses.dataclass(frozen=True)
class WanConfig:
    """Static shape of a Wan 2.1 DiT.

    Attributes:
      dim: model width D.
      ffn_dim: hidden width of the feed-forward block.
      num_heads: attention heads; ``dim % num_heads == 0``.
      num_layers: transformer blocks.
      in_dim: latent channels in (16 for the Wan VAE).
      out_dim: latent channels out.
      patch_size: (frames, height, width) of one patch; tokens per latent frame = (H/ph) * (W/pw).
      text_dim: width of the text-encoder embeddings (umT5-XXL: 4096).
      text_len: number of text tokens the model was trained with.
      freq_dim: width of the sinusoidal timestep embedding.
      eps: epsilon of the RMS/LayerNorms.
      rope_theta: RoPE base.
    """

    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    in_dim: int = 16
    out_dim: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self):
        patch = self.patch_size
        if not isinstance(patch, (tuple, list)) or len(patch) != 3 or not all(is_int(p) and p > 0 for p in patch):
            raise ValueError(f"WanConfig.patch_size must be three positive ints (frames, height, width), got {patch!r}")
        object.__setattr__(self, "patch_size", tuple(int(p) for p in patch))
        # sizes no model has (`jaxkv.validate`): refused here, so at conversion and at load, not at allocation
        limits = {"num_layers": MAX_LAYERS, "text_len": MAX_TEXT_LEN}  # the others: MAX_WIDTH
        if max(self.patch_size) > MAX_WIDTH:
            raise ValueError(f"WanConfig.patch_size must be at most {MAX_WIDTH} per axis, got {self.patch_size}")
        for name in (
            "dim",
            "ffn_dim",
            "num_heads",
            "num_layers",
            "in_dim",
            "out_dim",
            "text_dim",
            "text_len",
            "freq_dim",
        ):
            value = check_int(f"WanConfig.{name}", getattr(self, name), minimum=1)
            limit = limits.get(name, MAX_WIDTH)
            if value > limit:
                raise ValueError(f"WanConfig.{name} must be at most {limit} (no model is larger), got {value}")
            object.__setattr__(self, name, value)
        for name in ("eps", "rope_theta"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"WanConfig.{name} must be a finite float > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.dim % self.num_heads:
            raise ValueError(f"WanConfig.dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.freq_dim % 2:
            raise ValueError(f"WanConfig.freq_dim ({self.freq_dim}) must be even")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw

    def tokens_per_frame(self, latent_height: int, latent_width: int) -> int:
        """Tokens of one latent frame of size [latent_height, latent_width] (e.g. 60x104 -> 1560)."""
        _, ph, pw = self.patch_size
        if latent_height % ph or latent_width % pw:
            raise ValueError(f"latent size {latent_height}x{latent_width} is not divisible by the patch {ph}x{pw}")
        return (latent_height // ph) * (latent_width // pw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WanConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown WanConfig fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


PRESETS: dict[str, WanConfig] = {
    "wan2.1-t2v-1.3b": WanConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
    "wan2.1-t2v-14b": WanConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
    # Small enough to run a multi-chunk rollout on 2 CPU cores in seconds; head_dim 16 keeps the 3-D RoPE split
    # non-trivial: (frame, height, width) = (8, 4, 4) channels (`rope.rope_split`).
    "tiny": WanConfig(dim=64, ffn_dim=128, num_heads=4, num_layers=2, text_dim=32, text_len=16, freq_dim=32),
}


def preset(name: str) -> WanConfig:
    """Returns the named preset; raises ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown Wan preset {name!r}; known presets: {sorted(PRESETS)}") from None
