"""KV caches for streaming attention: retention policies over chunks of tokens.

Sink + window policies (`RingSpec`): `RingCache` (circular, O(chunk) per chunk) and `RollingCache` (shift-by-copy
baseline, O(window) per chunk) share one interface and one logical content (and `RingSpec.mask()` is the attention
mask of what they hold). `DilatedCache` (`DilatedSpec`) keeps every d-th frame in a ring of frame buckets plus a
scratch chunk, for long-range layers; `MixedCache` (`MixedSpec`) puts both kinds in one model, every k-th layer
dilated. `WindowSchedule` is the arithmetic of windowed generation and `jaxkv.cache.prefix` the protected prefix
(the sink) with its `PrefixEpoch` and the `release` of what a schedule frees.

`POLICIES` maps the policy names that models and the CLI accept to the classes: the one registry. Every class is
created by the same ``init(spec, batch, heads, head_dim, dtype, layers)``; the spec's type is the class's
`spec_type` (`RingSpec` for "ring" and "rolling", `DilatedSpec` for "dilated"), which `policy_class(name, spec)`
checks. Derived from it and the classes' attributes: `WINDOW_POLICIES` names those of a sink + window (what a
model's dense layers and ``--policy`` choose from), `WRAPPING_POLICIES` those whose clock wraps (``wraps``:
cache-relative RoPE without end, `jaxkv.cache.clock`), `RECACHE_POLICIES` those a prompt switch can re-cache
(``recaches``), `CACHE_CLASSES` the classes by class name (what a saved session records).

The cache rules a stream follows live here too: the slot of a chunk, the int32 position limit and the wrapped
clock in `jaxkv.cache.clock`, the per-layer layout of a mixed model in `MixedCache`.
"""

from jaxkv.cache.base import EMPTY, ChunkCache
from jaxkv.cache.dilated import DilatedCache, DilatedSpec
from jaxkv.cache.fp8 import Fp8Cache
from jaxkv.cache.mixed import MixedCache, MixedSpec
from jaxkv.cache.prefix import PrefixEpoch, prefix_complete, release, rewrite_prefix
from jaxkv.cache.ring import RingCache
from jaxkv.cache.rolling import RollingCache
from jaxkv.cache.spec import RingSpec
from jaxkv.cache.window_schedule import Window, WindowSchedule

POLICIES: dict[str, type[ChunkCache]] = {"ring": RingCache, "rolling": RollingCache, "dilated": DilatedCache}
# Every other view of the policies is derived here, from the classes' own attributes (`ChunkCache.spec_type`,
# ``wraps``, ``recaches``): a new policy or capability is one class, not an edit in each module that asks.
WINDOW_POLICIES: tuple[str, ...] = tuple(sorted(n for n, c in POLICIES.items() if c.spec_type is RingSpec))
WRAPPING_POLICIES: frozenset[str] = frozenset(n for n, c in POLICIES.items() if c.wraps)
RECACHE_POLICIES: frozenset[str] = frozenset(n for n, c in POLICIES.items() if c.recaches)
# The classes by name, as a session file names them: every policy's, a `MixedCache` (two of them, a dense stack
# and a dilated one) and the FP8 ring (`Fp8Cache`).
CACHE_CLASSES: dict[str, type] = {c.__name__: c for c in (*POLICIES.values(), MixedCache, Fp8Cache)}


def policy_class(name: str, spec=None) -> type[ChunkCache]:
    """The cache class of a policy name in `POLICIES`; ValueError listing the names otherwise. With ``spec``, also
    checks that it is of the class's `spec_type` (e.g. "dilated" needs a `DilatedSpec`)."""
    try:
        cls = POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"cache policy must be one of {sorted(POLICIES)}, got {name!r}") from None
    if spec is not None and not isinstance(spec, cls.spec_type):
        raise ValueError(
            f"cache policy {name!r} takes a {cls.spec_type.__name__}, got a {type(spec).__name__} "
            f"(policies of a {type(spec).__name__}: "
            f"{sorted(n for n, c in POLICIES.items() if isinstance(spec, c.spec_type))})"
        )
    return cls


__all__ = [
    "CACHE_CLASSES",
    "EMPTY",
    "Fp8Cache",
    "POLICIES",
    "RECACHE_POLICIES",
    "WINDOW_POLICIES",
    "WRAPPING_POLICIES",
    "ChunkCache",
    "DilatedCache",
    "DilatedSpec",
    "MixedCache",
    "MixedSpec",
    "PrefixEpoch",
    "RingCache",
    "RingSpec",
    "RollingCache",
    "Window",
    "WindowSchedule",
    "policy_class",
    "prefix_complete",
    "release",
    "rewrite_prefix",
]
