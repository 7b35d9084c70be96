"""umT5 encoder configuration and presets.

A `UMT5Config` is static (hashable, never traced): it fixes every parameter shape, plus the two facts of Wan's
text-encoder wrapper that shape its output (``text_len`` and the special-token ids). ``umt5-xxl`` is the encoder of
every Wan 2.1 release; ``tiny`` is a small random encoder for tests and the embedded default, sized to feed the
``tiny`` Wan DiT (``text_dim`` 32, ``text_len`` 16).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from jaxkv.validate import MAX_INDEX, MAX_LAYERS, MAX_TEXT_LEN, MAX_WIDTH, check_int


@dataclasses.dataclass(frozen=True)
class UMT5Config:
    """Static shape of a umT5 encoder (encoder only: Wan never runs the decoder).

    Attributes:
      vocab_size: rows of the token embedding.
      dim: model width D (the context width the DiT receives, Wan's ``text_dim``).
      ffn_dim: hidden width of the gated feed-forward block.
      num_heads: attention heads H.
      head_dim: width of one head; the attention width ``H * head_dim`` need not equal ``dim``.
      num_layers: encoder blocks, each with its own relative position bias (umT5; T5 shares layer 0's).
      num_buckets: relative-position buckets (bidirectional: half for keys before the query, half after).
      max_distance: distance beyond which every offset falls in the last bucket.
      eps: epsilon of the RMS norms.
      text_len: tokens per prompt after padding/truncation (Wan: 512).
      pad_id: id of the padding token (attention-masked, its output zeroed).
      eos_id: id of the end-of-sequence token appended to every prompt.
    """

    vocab_size: int
    dim: int
    ffn_dim: int
    num_heads: int
    head_dim: int
    num_layers: int
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6
    text_len: int = 512
    pad_id: int = 0
    eos_id: int = 1

    def __post_init__(self):
        for name in (
            "vocab_size",
            "dim",
            "ffn_dim",
            "num_heads",
            "head_dim",
            "num_layers",
            "num_buckets",
            "max_distance",
            "text_len",
        ):
            # sizes no model has (`jaxkv.validate`): refused at conversion and at load, not at allocation
            limit = {"text_len": MAX_TEXT_LEN, "num_layers": MAX_LAYERS, "vocab_size": MAX_INDEX}.get(name, MAX_WIDTH)
            object.__setattr__(
                self, name, check_int(f"UMT5Config.{name}", getattr(self, name), minimum=1, maximum=limit)
            )
        for name in ("pad_id", "eos_id"):
            object.__setattr__(
                self, name, check_int(f"UMT5Config.{name}", getattr(self, name), minimum=0, maximum=self.vocab_size - 1)
            )
        if self.pad_id == self.eos_id:
            raise ValueError(f"UMT5Config.pad_id and eos_id must differ, both are {self.pad_id}")
        # Bidirectional buckets: num_buckets // 2 per direction, half of them exact offsets, so at least 4 buckets,
        # an even count, and a max_distance past the exact ones (the log bins need max_distance > max_exact).
        if self.num_buckets < 4 or self.num_buckets % 2:
            raise ValueError(f"UMT5Config.num_buckets must be an even int >= 4, got {self.num_buckets}")
        if self.max_distance <= self.num_buckets // 4:
            raise ValueError(
                f"UMT5Config.max_distance ({self.max_distance}) must exceed the exact-offset buckets per "
                f"direction ({self.num_buckets // 4})"
            )
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"UMT5Config.eps must be a finite float > 0, got {eps!r}")
        object.__setattr__(self, "eps", float(eps))

    @property
    def attn_dim(self) -> int:
        """Width of q/k/v: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    def num_params(self) -> int:
        d, a, f, L = self.dim, self.attn_dim, self.ffn_dim, self.num_layers
        per_layer = 2 * d + 4 * d * a + 3 * d * f + self.num_buckets * self.num_heads
        return self.vocab_size * d + L * per_layer + d

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "UMT5Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown UMT5Config fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


PRESETS: dict[str, UMT5Config] = {
    # google/umt5-xxl's encoder as Wan 2.1 ships it (models_t5_umt5-xxl-enc-bf16.pth): 5.68 B parameters.
    "umt5-xxl": UMT5Config(vocab_size=256384, dim=4096, ffn_dim=10240, num_heads=64, head_dim=64, num_layers=24),
    # Feeds the tiny Wan DiT (text_dim 32, text_len 16); vocab 256 holds the embedded tiny tokenizer's pieces.
    # Small max_distance so 16 tokens reach the logarithmic buckets too.
    "tiny": UMT5Config(
        vocab_size=256,
        dim=32,
        ffn_dim=64,
        num_heads=4,
        head_dim=8,
        num_layers=2,
        num_buckets=8,
        max_distance=12,
        text_len=16,
    ),
}


def preset(name: str) -> UMT5Config:
    """Returns the named preset; raises ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown umT5 preset {name!r}; known presets: {sorted(PRESETS)}") from None
