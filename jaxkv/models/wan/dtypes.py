"""Which dtype each weight and activation of the Wan model runs in under a `jaxkv.precision.Precision`, and the one
place an entry point resolves its `jaxkv.run_options.RunOptions` and checks the params against it (`_run_of`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.run_options import RunOptions, resolve

# Top-level weights whose matmuls stay float32 under any policy (Wan computes them under autocast(float32)).
_FLOAT32_MATMULS = ("time_embedding", "time_projection", "head")


def _cast_kernels(tree, dtype):
    """Every ``kernel`` leaf of ``tree`` in ``dtype`` (a no-op when it already is); biases, norm scales and
    modulation tables are left as they are: the layers use them in float32."""
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if getattr(path[-1], "key", None) == "kernel" and x.dtype != dtype else x, tree
    )


def _compute_params(params, run: RunOptions):
    """The non-block params with each kernel in the dtype its matmul runs in. Block params are cast one layer at
    a time inside the layer scan (`_block_params`), so a cast never materialises a copy of the whole stack."""
    compute = run.precision.compute_dtype
    return {
        name: (tree if name == "blocks" else _cast_kernels(tree, jnp.float32 if name in _FLOAT32_MATMULS else compute))
        for name, tree in params.items()
    }


def _block_params(p, run: RunOptions):
    """One layer's block params with every kernel in the compute dtype."""
    return _cast_kernels(p, run.precision.compute_dtype)


def _activation_dtype(run: RunOptions):
    """The dtype the large GEMMs emit and the norms, modulation and RoPE write: the compute dtype (float32 under
    `Precision.f32()`, bfloat16 under `Precision.bf16()`, as Self-Forcing's bf16 inference). The residual stream,
    the time embedding, the modulation tables and the head stay float32 whatever it is."""
    return jnp.dtype(run.precision.compute_dtype)


def _run_of(params, run, backend, precision, where: str) -> RunOptions:
    """The `RunOptions` of a public entry point (``run=``, or the older ``backend=`` / ``precision=``; TypeError for
    both), with the params checked against its precision: once per entry, never in the helpers it calls."""
    run = resolve(run, backend, precision, where)
    run.precision.check_params(params)
    return run
