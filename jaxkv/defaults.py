"""The one table of defaults: what a stream uses when nobody says otherwise.

`ROLLOUT` holds the defaults of the library (`jaxkv.rollout.RolloutConfig`'s fields read them); `GENERATE` holds
``jaxkv generate``'s flag defaults (`jaxkv.generate.options` builds its parser from it, `jaxkv.generate.settings`
starts every resolution from it). `GENERATE` is `ROLLOUT` plus the command's own rows, with two rows replaced:

- ``sink_frames`` 3 (library 0) and ``window_frames`` 9 (library 12): the command streams without end by default,
  so it pins the first chunk as a sink (Self-Forcing / LongLive's global sink) and keeps the cache at the same 12
  frames (3 sink + 9 window). The bare `RolloutConfig` keeps no sink, as the plain-rollout papers and the
  library's parity tests assume. Making them equal would change every stream already drawn with either default
  (saved sessions and the tests' recorded outputs).

A release's own settings (the toy world's ``toyworld.json``: window 6, cache-relative RoPE, shift 3.0, ...) are
not defaults: they are what that model was trained for, a layer above this table
(`jaxkv.generate.settings`: defaults < release settings < saved session < flags given).
"""

from __future__ import annotations

from types import MappingProxyType

# RolloutConfig's defaults (latent frames).
ROLLOUT = MappingProxyType(
    dict(
        chunk_frames=3,  # Self-Forcing's 3-frame chunks
        window_frames=12,
        sink_frames=0,
        policy="ring",
        rope="absolute",
        backend="auto",  # `jaxkv.attend` picks per platform
    )
)

# jaxkv generate's defaults (the flags' destinations); see the module docstring for the rows that differ.
GENERATE = MappingProxyType(
    {
        **ROLLOUT,
        "window_frames": 9,
        "sink_frames": 3,
        "preset": "tiny",
        "height": 16,
        "width": 16,
        "num_chunks": 200,  # 200 three-frame chunks of the toy world: 600 frames, 37.5 s at 16 fps
        "steps": "1000,750,500,250",
        "shift": 5.0,
        "context_noise": 0.0,
        "seed": 0,
        "weights_seed": 0,
        "batch": 1,
        "precision": "float32",
        "out": "jaxkv_out",
        "format": "npy",
        "preview_scale": 4,
        "preview_frames": 12,
        "fps": 16,  # Wan's
        "dilated_every": 0,
    }
)
