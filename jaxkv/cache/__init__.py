"""KV caches for streaming attention: a pinned sink plus a rolling window of chunks.

`RingCache` (circular, O(chunk) per chunk) and `RollingCache` (shift-by-copy baseline, O(window) per chunk) share
one interface and one logical content; `RingSpec` holds their static sizes.
"""

from jaxkv.cache.base import EMPTY, ChunkCache
from jaxkv.cache.ring import RingCache
from jaxkv.cache.rolling import RollingCache
from jaxkv.cache.spec import RingSpec

__all__ = ["EMPTY", "ChunkCache", "RingCache", "RingSpec", "RollingCache"]
