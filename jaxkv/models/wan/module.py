"""`WanModel`: the Flax NNX form of the Wan 2.1 DiT.

The module holds the parameters as ``nnx.Param`` variables in exactly the nested layout of
`jaxkv.models.wan.params` (``model.blocks.self_attn.q.kernel`` is ``params["blocks"]["self_attn"]["q"]["kernel"]``)
and its methods call the pure functions of `jaxkv.models.wan.model`, so the module and a params pytree under plain
``jax.jit`` compute the same numbers by construction. Use the module where NNX is convenient (``nnx.jit``,
``nnx.Optimizer``, ``nnx.split``); use `params()` / `from_params` to move between the two forms.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import validate_params
from jaxkv.precision import Precision
from jaxkv.run_options import RunOptions


class _ParamTree(nnx.Module):
    """A nested dict of arrays as a module: dicts become submodules, arrays become ``nnx.Param``s."""

    def __init__(self, tree: dict[str, Any]):
        for name, value in tree.items():
            setattr(self, name, _ParamTree(value) if isinstance(value, dict) else nnx.Param(jnp.asarray(value)))

    def tree(self) -> dict[str, Any]:
        """The nested dict of arrays, read straight from the variables (no `nnx.State` built, nothing copied)."""
        return {
            name: node.tree() if isinstance(node, _ParamTree) else node[...]
            for name, node in vars(self).items()
            if isinstance(node, (_ParamTree, nnx.Param))
        }


class WanModel(_ParamTree):
    """Wan 2.1 DiT (text-to-video) as an NNX module.

    ``WanModel(config, rngs=nnx.Rngs(0))`` initialises random weights (`jaxkv.models.wan.init_params`);
    ``WanModel.from_params(config, params)`` wraps converted ones. Attributes mirror the params layout:
    ``patch_embedding``, ``text_embedding``, ``time_embedding``, ``time_projection``, ``blocks`` (stacked on a
    leading layer axis), ``head``.
    """

    def __init__(
        self,
        config: WanConfig,
        *,
        rngs: nnx.Rngs | None = None,
        params: dict[str, Any] | None = None,
        dtype=jnp.float32,
    ):
        if (rngs is None) == (params is None):
            raise ValueError("WanModel needs exactly one of rngs= (random init) or params= (existing weights)")
        if params is None:
            params = M.init_params(config, rngs.params(), dtype=dtype)
        validate_params(params, config)
        super().__init__(params)
        self.config = config

    @classmethod
    def from_params(cls, config: WanConfig, params: dict[str, Any]) -> "WanModel":
        return cls(config, params=params)

    def params(self) -> dict[str, Any]:
        """The parameters as a plain nested dict of arrays (the `jaxkv.models.wan.params` layout); a walk over the
        variables, cheap enough to run on every call."""
        return self.tree()

    def __call__(
        self,
        latents,
        timesteps,
        context,
        *,
        pad_context: bool = True,
        backend: str | None = None,
        precision: Precision | str | None = None,
        run: RunOptions | None = None,
    ):
        """Bidirectional forward: see `jaxkv.models.wan.forward`. Returns float32 [batch, frames, h, w, out_dim]."""
        return M.forward(
            self.params(),
            self.config,
            latents,
            timesteps,
            context,
            pad_context=pad_context,
            backend=backend,
            precision=precision,
            run=run,
        )

    def block_causal(
        self,
        latents,
        timesteps,
        context,
        *,
        chunk_frames: int,
        window_frames: int | None = None,
        sink_frames: int = 0,
        pad_context: bool = True,
        backend: str | None = None,
        precision: Precision | str | None = None,
        run: RunOptions | None = None,
    ):
        """Block-causal full-sequence forward: see `jaxkv.models.wan.forward_block_causal`."""
        return M.forward_block_causal(
            self.params(),
            self.config,
            latents,
            timesteps,
            context,
            chunk_frames=chunk_frames,
            window_frames=window_frames,
            sink_frames=sink_frames,
            pad_context=pad_context,
            backend=backend,
            precision=precision,
            run=run,
        )

    def cross_kv(
        self,
        context,
        *,
        pad_context: bool = True,
        precision: Precision | str | None = None,
        run: RunOptions | None = None,
    ) -> M.CrossKV:
        """Cross-attention K/V of all layers, computed once per text context: see `jaxkv.models.wan.cross_kv`."""
        return M.cross_kv(self.params(), self.config, context, pad_context=pad_context, precision=precision, run=run)

    def init_cache(self, spec, batch: int, *, policy: str = "ring", dtype=jnp.float32):
        """Empty stacked cache for every layer: see `jaxkv.models.wan.init_cache`."""
        return M.init_cache(self.config, spec, batch, policy=policy, dtype=dtype)

    def step(
        self,
        cache,
        cross: M.CrossKV,
        latents,
        timesteps,
        *,
        backend: str | None = None,
        precision: Precision | str | None = None,
        run: RunOptions | None = None,
    ):
        """One streaming chunk on the reserved slot: (flow, cache). See `jaxkv.models.wan.forward_chunk`."""
        return M.forward_chunk(
            self.params(),
            self.config,
            cache,
            cross,
            latents,
            timesteps,
            backend=backend,
            precision=precision,
            run=run,
        )
