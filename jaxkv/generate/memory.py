"""What a ``jaxkv generate`` run must hold in memory at least, checked before anything is loaded or compiled.

`estimate` adds up the arrays a stream cannot do without, from shapes alone (nothing is allocated): the weights,
the KV cache (its exact shapes, from `jax.eval_shape` of the stream's own `jaxkv.rollout.empty_cache`), the
cross-attention K/V of the text, and one chunk's widest activation (a layer's feed-forward hidden state). It is a
lower bound: compilation, temporaries and the runtime come on top. `check` refuses a run whose lower bound exceeds
the memory available, with the figures, so a size typo (``--height 100000``) costs a message, not minutes of
tracing and an out-of-memory kill.

Available memory: on the CPU backend the host's (``MemAvailable`` of /proc/meminfo, else ``os.sysconf``); on an
accelerator its memory limit when the runtime reports one (``memory_stats()["bytes_limit"]``), else no check.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from jaxkv import rollout as R
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import flat_param_shapes


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def estimate(config: WanConfig, rc: R.RolloutConfig, batch: int) -> dict[str, int]:
    """The bytes a stream of ``batch`` videos holds at least: {"params", "kv_cache", "text_kv", "activations"}.

    params: every weight in the precision's param dtype. kv_cache: the stacked cache of every layer and session
    (``batch``, twice that with guidance), exact. text_kv: the cross-attention K and V of every layer
    [layers, sessions, text_len, dim] in the cache dtype. activations: one layer's feed-forward hidden state
    [sessions, chunk tokens, ffn_dim] in float32.
    """
    sessions = batch * (2 if rc.guidance_scale is not None else 1)
    param_bytes = np.dtype(rc.precision.param_dtype).itemsize
    params = sum(math.prod(shape) for shape in flat_param_shapes(config).values()) * param_bytes
    cache = jax.eval_shape(lambda: R.empty_cache(config, rc, sessions))
    kv_cache = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(cache))
    cache_bytes = np.dtype(rc.precision.cache_dtype).itemsize
    text_kv = 2 * config.num_layers * sessions * config.text_len * config.dim * cache_bytes
    chunk_tokens = rc.chunk_frames * rc.tokens_per_frame(config)
    activations = sessions * chunk_tokens * config.ffn_dim * 4
    return {"params": params, "kv_cache": kv_cache, "text_kv": text_kv, "activations": activations}


def available() -> tuple[int, str] | None:
    """(bytes, what they are) that the default backend can hold, or None when it cannot be told."""
    if jax.default_backend() == "cpu":
        return _host_available(), "available host memory"
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a runtime without memory statistics: no check
        return None
    limit = stats.get("bytes_limit")
    return (int(limit), f"memory of {jax.devices()[0].device_kind}") if limit else None


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check(config: WanConfig, rc: R.RolloutConfig, batch: int, settings: str, *, devices: int = 1) -> dict[str, int]:
    """Raises ValueError when `estimate` exceeds `available` memory, with the figures; returns the estimate.
    ``settings`` names what sets the size, for the message (e.g. "--height 60 --width 104 --batch 1");
    ``devices``: accelerators the run is spread over (a mesh), whose memories add up (host memory does not)."""
    need = estimate(config, rc, batch)
    have = available()
    total = sum(need.values())
    if have is not None and jax.default_backend() != "cpu" and devices > 1:
        have = (have[0] * devices, f"{have[1]} x {devices} devices")
    if have is not None and total > have[0]:
        parts = ", ".join(f"{name.replace('_', ' ')} {_gib(n)}" for name, n in need.items())
        raise ValueError(
            f"{settings} needs at least {_gib(total)} ({parts}) before compilation, but the {have[1]} is "
            f"{_gib(have[0])}; lower the frame size, --window-frames or --batch, or use a smaller model"
        )
    return need
