"""KV caches for streaming attention: a pinned sink plus a rolling window of chunks.

`RingCache` (circular, O(chunk) per chunk) and `RollingCache` (shift-by-copy baseline, O(window) per chunk) share
one interface and one logical content; `RingSpec` holds their static sizes (and `RingSpec.mask()` the attention
mask of what they hold). `POLICIES` maps the policy names that models and the CLI accept to the classes.
"""

from jaxkv.cache.base import EMPTY, ChunkCache
from jaxkv.cache.ring import RingCache
from jaxkv.cache.rolling import RollingCache
from jaxkv.cache.spec import RingSpec

POLICIES: dict[str, type[ChunkCache]] = {"ring": RingCache, "rolling": RollingCache}


def policy_class(name: str) -> type[ChunkCache]:
    """The cache class of a policy name in `POLICIES`; ValueError listing the names otherwise."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"cache policy must be one of {sorted(POLICIES)}, got {name!r}") from None


__all__ = ["EMPTY", "POLICIES", "ChunkCache", "RingCache", "RingSpec", "RollingCache", "policy_class"]
