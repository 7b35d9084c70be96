"""jaxkv: streaming-attention KV caches for JAX.

The cache is an immutable pytree ring buffer (a pinned sink plus a rolling window of chunks) written with
`lax.dynamic_update_slice` at traced slots; attention reads it in physical order with masks computed from the
absolute positions stored beside each slot.
"""

from jaxkv.attention import MaskSpec, attend
from jaxkv.cache import RingCache, RingSpec, RollingCache

__version__ = "0.1.0"

__all__ = ["MaskSpec", "Pipeline", "RingSpec", "RingCache", "RollingCache", "attend", "__version__"]


def __getattr__(name: str):
    # `jaxkv.Pipeline` imports the model and the generate command's loaders: only when asked for, so that
    # `import jaxkv` (and `jaxkv convert`) stays light.
    if name == "Pipeline":
        from jaxkv.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")
