"""`MixedCache`: one model's layers under two retention policies, dense windows plus every k-th layer dilated.

A model of L layers grouped in periods of k (``period``): in each period the first k - 1 layers keep a dense
sink + window (`RingCache` or `RollingCache`, `RingSpec`) and the last one keeps dilated frames (`DilatedCache`,
`DilatedSpec`). Layer l is dilated iff ``l % k == k - 1``; L must be a multiple of k.

Layout: two stacked caches, one per policy, each indexed by its own layer count:

  dense:   k, v [L - L/k, batch, dense capacity, heads, head_dim]    layer l -> (l // k) * (k - 1) + l % k
  dilated: k, v [L/k, batch, dilated capacity, heads, head_dim]      layer l -> l // k

Why two stacks and not one buffer both policies index: positions are shared by all layers of a stack (every layer
sees the same chunk), and the two policies keep different slots, so one stack would need per-layer positions and a
capacity of the larger of the two for every layer. A model scans its layers period by period with both stacks in
the carry (`MixedCache.scan_layers`, which `jaxkv.models.wan` runs), so each write stays an in-place O(chunk)
update of its own stack.

Both stacks advance together: `begin_chunk` and `reset` act on both, and they hold the same chunk (the same
``chunk_start``), so `chunk_positions` is one answer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxkv.cache.base import ChunkCache
from jaxkv.cache.dilated import DilatedCache, DilatedSpec
from jaxkv.cache.ring import RingCache
from jaxkv.cache.spec import RingSpec
from jaxkv.validate import check_int


@dataclasses.dataclass(frozen=True)
class MixedSpec:
    """Static sizes of a `MixedCache`.

    Attributes:
      dense: `RingSpec` of the dense layers.
      dilated: `DilatedSpec` of the dilated layers; its chunk (chunk_frames * tokens_per_frame) must equal
        dense.chunk.
      period: k >= 2: layers per period, the last of each period dilated (k = 1 would leave no dense layer: use a
        `DilatedCache` for every layer instead).
    """

    dense: RingSpec
    dilated: DilatedSpec
    period: int

    def __post_init__(self):
        if not isinstance(self.dense, RingSpec):
            raise TypeError(f"MixedSpec.dense must be a RingSpec, got {type(self.dense).__name__}")
        if not isinstance(self.dilated, DilatedSpec):
            raise TypeError(f"MixedSpec.dilated must be a DilatedSpec, got {type(self.dilated).__name__}")
        period = check_int("MixedSpec.period", self.period, minimum=2)
        if self.dense.chunk != self.dilated.chunk:
            raise ValueError(
                f"MixedSpec: the dense chunk ({self.dense.chunk} tokens) and the dilated chunk "
                f"({self.dilated.chunk} tokens) must be equal: every layer processes the same chunk"
            )
        object.__setattr__(self, "period", period)

    @property
    def chunk(self) -> int:
        return self.dense.chunk

    @property
    def max_chunks(self) -> int:
        return self.dense.max_chunks

    def check_layers(self, layers: int) -> int:
        """``layers`` checked to be a positive multiple of ``period``."""
        layers = check_int("layers", layers, minimum=1)
        if layers % self.period:
            raise ValueError(
                f"a mixed cache groups layers in periods of {self.period} (the last of each dilated); "
                f"{layers} layers is not a multiple of {self.period}"
            )
        return layers

    def is_dilated(self, layer: int) -> bool:
        """Whether layer ``layer`` (a Python int) keeps dilated frames: layer % period == period - 1."""
        return layer % self.period == self.period - 1


@struct.dataclass
class MixedCache:
    """A dense stack and a dilated stack over one model's layers (see the module docstring).

    ``dense``: a stacked `RingCache`/`RollingCache` of L - L/period layers; ``dilated``: a stacked `DilatedCache` of
    L/period layers; ``spec``: the `MixedSpec`.
    """

    dense: ChunkCache
    dilated: DilatedCache
    spec: MixedSpec = struct.field(pytree_node=False)

    @classmethod
    def init(
        cls,
        spec: MixedSpec,
        batch: int,
        heads: int,
        head_dim: int,
        dtype=jnp.float32,
        layers: int = None,
        dense_policy: type[ChunkCache] | None = None,
    ):
        """An empty mixed cache for ``layers`` layers (required, a multiple of spec.period).

        dense_policy: the dense layers' cache class (default `RingCache`), e.g. ``policy_class("rolling")``.
        """
        if not isinstance(spec, MixedSpec):
            raise TypeError(f"spec must be a MixedSpec, got {type(spec).__name__}")
        if layers is None:
            raise ValueError("a MixedCache is always stacked: pass layers= (a multiple of spec.period)")
        layers = spec.check_layers(layers)
        dense_cls = RingCache if dense_policy is None else dense_policy
        if not (isinstance(dense_cls, type) and issubclass(dense_cls, ChunkCache)) or dense_cls is DilatedCache:
            raise ValueError(
                f"dense_policy must be a sink + window cache class (RingCache, RollingCache), got {dense_cls!r}"
            )
        n_dilated = layers // spec.period
        dense = dense_cls.init(spec.dense, batch, heads, head_dim, dtype=dtype, layers=layers - n_dilated)
        dilated = DilatedCache.init(spec.dilated, batch, heads, head_dim, dtype=dtype, layers=n_dilated)
        return cls(dense=dense, dilated=dilated, spec=spec)

    # ---------------------------------------------------------------- shape facts (as ChunkCache)

    @property
    def layers(self) -> int:
        return self.dense.layers + self.dilated.layers

    @property
    def batch(self) -> int:
        return self.dense.batch

    @property
    def heads(self) -> int:
        return self.dense.heads

    @property
    def head_dim(self) -> int:
        return self.dense.head_dim

    @property
    def dtype(self):
        return self.dense.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of both stacks (k, v and positions)."""
        return self.dense.nbytes + self.dilated.nbytes

    @property
    def chunk_start(self) -> jax.Array:
        """int32 [batch]: as `ChunkCache.chunk_start` (both stacks hold the same chunk)."""
        return self.dense.chunk_start

    # ---------------------------------------------------------------- transitions (both stacks)

    def next_chunk_index(self) -> jax.Array:
        return self.dense.next_chunk_index()

    def chunk_positions(self) -> jax.Array:
        """int32 [batch, chunk]: positions of the reserved chunk (-1 where none is reserved)."""
        return self.dense.chunk_positions()

    def begin_chunk(self, active=None) -> "MixedCache":
        """`begin_chunk` of both stacks (``active``: optional bool [batch])."""
        return self.replace(dense=self.dense.begin_chunk(active), dilated=self.dilated.begin_chunk(active))

    def only_writing(self, active=None) -> "MixedCache":
        """`ChunkCache.only_writing` of both stacks (``active``: optional bool [batch])."""
        return self.replace(dense=self.dense.only_writing(active), dilated=self.dilated.only_writing(active))

    def reset(self, sessions=None) -> "MixedCache":
        """`reset` of both stacks (``sessions``: optional bool [batch])."""
        return self.replace(dense=self.dense.reset(sessions), dilated=self.dilated.reset(sessions))

    def locate(self, layer: int) -> tuple[str, int]:
        """("dense" or "dilated", index in that stack) of model layer ``layer`` (a Python int)."""
        layer = check_int("layer", layer, minimum=0, maximum=self.layers - 1)
        k = self.spec.period
        if self.spec.is_dilated(layer):
            return "dilated", layer // k
        return "dense", (layer // k) * (k - 1) + layer % k

    def scan_layers(self, layer_fn, x):
        """Runs a model's layers over this cache in model order: (x, the updated cache).

        ``layer_fn(x, stack, layer, index) -> (x, stack)`` runs model layer ``layer`` (int32, traced) on ``stack``
        (``self.dense`` or ``self.dilated``) as its layer ``index`` (int32, traced) in that stack. A ``lax.scan``
        over the L / k periods, and in each an inner ``lax.scan`` over its k - 1 dense layers, then its dilated
        layer (model layer i*k + j, j < k - 1, is dense layer i*(k - 1) + j; layer i*k + k - 1 is dilated layer i).
        Both stacks ride in the carries, so every write is an in-place update of its own stack."""
        k = self.spec.period

        def period(carry, i):
            x, dense, dilated = carry

            def dense_layer(carry, j):
                x, dense = carry
                return layer_fn(x, dense, i * k + j, i * (k - 1) + j), None

            (x, dense), _ = lax.scan(dense_layer, (x, dense), jnp.arange(k - 1, dtype=jnp.int32))
            x, dilated = layer_fn(x, dilated, i * k + k - 1, i)
            return (x, dense, dilated), None

        periods = jnp.arange(self.layers // k, dtype=jnp.int32)
        (x, dense, dilated), _ = lax.scan(period, (x, self.dense, self.dilated), periods)
        return x, self.replace(dense=dense, dilated=dilated)
