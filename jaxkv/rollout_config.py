"""`RolloutConfig`: the static settings of a streaming rollout (a frozen, validated, hashable dataclass).

Kept apart from `jaxkv.rollout` (which re-exports it as ``jaxkv.rollout.RolloutConfig``) because it is a value
with its own checks: sessions, pools, meshes and the command read it without the sampler it configures.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxkv.cache import WINDOW_POLICIES, WRAPPING_POLICIES, DilatedSpec, MixedSpec, RingSpec
from jaxkv.defaults import ROLLOUT
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.precision import Precision
from jaxkv.run_options import RunOptions
from jaxkv.schedule import Schedule
from jaxkv.validate import check_int, is_real


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static settings of a streaming rollout (hashable: a jit static argument).

    Attributes:
      latent_height, latent_width: latent grid of every frame (divisible by the patch).
      chunk_frames: latent frames per chunk (Self-Forcing: 3).
      window_frames: frames of the rolling attention window, including the chunk being generated; a multiple of
        chunk_frames.
      sink_frames: frames pinned at the start (the first chunks), a multiple of chunk_frames; 0 for none.
      schedule: the denoising schedule.
      guidance_scale: classifier-free guidance scale, a finite number; None (default) for no guidance. Needs a
        negative context.
      policy: the (dense) layers' policy, a name in `jaxkv.cache.WINDOW_POLICIES`: "ring" (circular, O(chunk) per
        chunk) or "rolling" (shift-by-copy baseline).
      cache_dtype: init-only shorthand kept for compatibility: ``RolloutConfig(cache_dtype="bfloat16")`` is
        ``precision=Precision(..., cache_dtype="bfloat16")`` (it replaces the given precision's cache_dtype). Read
        back as ``rc.cache_dtype`` = ``rc.precision.cache_dtype``.
      backend: attention backend name passed to `jaxkv.attend` (one of `jaxkv.attention.dispatch.BACKENDS`).
      dilated_every: k >= 1 makes every k-th layer (layers k-1, 2k-1, ...) a dilated long-range layer
        (`jaxkv.cache.DilatedCache`) and keeps ``policy``'s sink + window on the others (a `jaxkv.cache.MixedCache`;
        num_layers must be a multiple of k); k = 1 makes every layer dilated (then window_frames and policy are
        unused and sink_frames must be 0). 0 (default): no dilated layer, the plain rollout.
      dilation: with dilated_every: dilated layers keep frames f with f % dilation == 0 (>= 1).
      buckets: with dilated_every: frame slots of a dilated layer's ring (>= ceil(chunk_frames / dilation)); it
        reaches ``dilation * buckets`` frames back (`DilatedSpec.horizon_frames`) for the memory of ``buckets``
        frames plus one chunk of scratch.
      precision: the dtype policy of the run (`jaxkv.precision.Precision` or a preset name, "float32" or
        "bfloat16"): params must be in its param_dtype; the KV cache and the cross-attention K/V are built in its
        cache_dtype.
      remat: run each DiT block under `jax.checkpoint` (`jaxkv.models.wan.forward_chunk`), for a gradient through
        the rollout (Self-Forcing training): the blocks' activations are recomputed, not stored. Equal to float
        rounding; no effect on what a rollout draws beyond that.
      rope: "absolute" (default; Self-Forcing: keys rotated at their absolute frame before the write) or
        "cache-relative" (keys cached unrotated and rotated at read by their rank in the cache, so the frame
        indices the model sees stay below the cache's frames; the positions then run on a wrapped clock
        (`wrap_clock`), so the int32 limit no longer bounds the stream). See `jaxkv.models.wan.cache_relative_rope`.
    """

    latent_height: int
    latent_width: int
    chunk_frames: int = ROLLOUT["chunk_frames"]
    window_frames: int = ROLLOUT["window_frames"]
    sink_frames: int = ROLLOUT["sink_frames"]
    schedule: Schedule = Schedule()
    guidance_scale: float | None = None
    policy: str = ROLLOUT["policy"]
    cache_dtype: dataclasses.InitVar[str | None] = None
    backend: str = ROLLOUT["backend"]
    dilated_every: int = 0
    dilation: int | None = None
    buckets: int | None = None
    precision: Precision = Precision()
    rope: str = ROLLOUT["rope"]
    remat: bool = False

    def __post_init__(self, cache_dtype):
        for name in ("latent_height", "latent_width", "chunk_frames", "window_frames", "sink_frames"):
            value = getattr(self, name)
            object.__setattr__(
                self, name, check_int(f"RolloutConfig.{name}", value, minimum=0 if name == "sink_frames" else 1)
            )
        if self.window_frames % self.chunk_frames or self.sink_frames % self.chunk_frames:
            raise ValueError(
                f"window_frames ({self.window_frames}) and sink_frames ({self.sink_frames}) must be "
                f"whole multiples of chunk_frames ({self.chunk_frames})"
            )
        g = self.guidance_scale
        if g is not None and (not is_real(g) or not math.isfinite(g)):
            raise ValueError(f"RolloutConfig.guidance_scale must be None or a finite number, got {g!r}")
        if g is not None:
            object.__setattr__(self, "guidance_scale", float(g))
        if not isinstance(self.policy, str) or self.policy not in WINDOW_POLICIES:
            hint = (
                " (dilated layers are set with dilated_every / dilation / buckets; policy is the dense layers')"
                if self.policy == "dilated"
                else ""
            )
            raise ValueError(f"RolloutConfig.policy must be one of {list(WINDOW_POLICIES)}, got {self.policy!r}{hint}")
        if not isinstance(self.schedule, Schedule):
            raise ValueError(f"RolloutConfig.schedule must be a jaxkv.schedule.Schedule, got {self.schedule!r}")
        if self.precision is None:
            raise ValueError("RolloutConfig.precision must be a jaxkv.precision.Precision or a preset name, got None")
        precision = RunOptions.of(self.precision, self.backend, owner="RolloutConfig").precision  # both checked
        if cache_dtype is not None:
            precision = dataclasses.replace(precision, cache_dtype=cache_dtype)
        object.__setattr__(self, "precision", precision)
        self._check_dilated()
        M.check_rope_mode(self.rope)
        if not isinstance(self.remat, (bool, np.bool_)):
            raise ValueError(f"RolloutConfig.remat must be a bool, got {self.remat!r}")
        object.__setattr__(self, "remat", bool(self.remat))
        if precision.fp8_kv and (self.policy != "ring" or self.dilated_every):
            raise ValueError(
                f"an FP8 KV cache (precision.fp8_kv) is a ring cache: policy must be 'ring' with no dilated layers, "
                f"got policy {self.policy!r}, dilated_every {self.dilated_every}"
            )
        if self.rope == "cache-relative" and self.policy not in WRAPPING_POLICIES:
            raise ValueError(
                f"rope='cache-relative' runs the positions on a wrapped clock, which keeps the slot of "
                f"every chunk only for the policies {sorted(WRAPPING_POLICIES)}; got policy {self.policy!r}"
            )

    def _check_dilated(self):
        every = check_int("RolloutConfig.dilated_every", self.dilated_every, minimum=0)
        object.__setattr__(self, "dilated_every", every)
        if every == 0:
            for name in ("dilation", "buckets"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"RolloutConfig.{name} is set but dilated_every is 0 (no dilated layer); set "
                        f"dilated_every=k to make every k-th layer dilated"
                    )
            return
        for name in ("dilation", "buckets"):
            if getattr(self, name) is None:
                raise ValueError(f"RolloutConfig.dilated_every={every} needs {name} (an int >= 1)")
            object.__setattr__(self, name, check_int(f"RolloutConfig.{name}", getattr(self, name), minimum=1))
        if every == 1 and self.sink_frames:
            raise ValueError(
                f"RolloutConfig.dilated_every=1 makes every layer dilated, which has no sink, but "
                f"sink_frames={self.sink_frames}; use sink_frames=0 or dilated_every >= 2"
            )
        DilatedSpec(1, self.chunk_frames, self.dilation, self.buckets)  # its own checks (buckets vs dilation)

    @property
    def run(self) -> RunOptions:
        """``precision`` and ``backend`` as the `jaxkv.run_options.RunOptions` the model's entry points take
        (``run=rc.run``); built from the fields, so the fields (and what sessions record) stay as they are."""
        return RunOptions(self.precision, self.backend)

    @property
    def bounded(self) -> bool:
        """True when the int32 positions bound the stream (absolute RoPE); False on the wrapped clock."""
        return self.rope == "absolute"

    @property
    def steps(self) -> int:
        return len(self.schedule.steps)

    def tokens_per_frame(self, config: WanConfig) -> int:
        return config.tokens_per_frame(self.latent_height, self.latent_width)

    def spec(self, config: WanConfig) -> RingSpec:
        """The cache spec in tokens for this model's patch grid."""
        return RingSpec.from_frames(
            self.tokens_per_frame(config), self.chunk_frames, self.window_frames, self.sink_frames
        )

    def dilated_spec(self, config: WanConfig) -> DilatedSpec | None:
        """The dilated layers' spec (None without dilated_every)."""
        if not self.dilated_every:
            return None
        return DilatedSpec(self.tokens_per_frame(config), self.chunk_frames, self.dilation, self.buckets)

    def cache_spec(self, config: WanConfig):
        """What `jaxkv.models.wan.init_cache` takes for every layer: the `RingSpec` (no dilated layer), a
        `DilatedSpec` (dilated_every=1) or a `MixedSpec` (dilated_every >= 2; ValueError unless it divides
        num_layers)."""
        if not self.dilated_every:
            return self.spec(config)
        if self.dilated_every == 1:
            return self.dilated_spec(config)
        mixed = MixedSpec(self.spec(config), self.dilated_spec(config), self.dilated_every)
        mixed.check_layers(config.num_layers)
        return mixed

    def chunk_shape(self, config: WanConfig, batch: int) -> tuple[int, ...]:
        """[batch, chunk_frames, latent_height, latent_width, in_dim]."""
        return (batch, self.chunk_frames, self.latent_height, self.latent_width, config.in_dim)

    def noise_shape(self, config: WanConfig, batch: int, num_chunks: int) -> tuple[int, ...]:
        """Explicit noise: [num_chunks, steps, batch, chunk_frames, latent_height, latent_width, in_dim]."""
        return (num_chunks, self.steps, *self.chunk_shape(config, batch))


# Read-only view of the init-only shorthand (the class attribute the InitVar left behind is its default, None).
RolloutConfig.cache_dtype = property(
    lambda self: self.precision.cache_dtype, doc="The KV cache dtype name: ``precision.cache_dtype``."
)
