"""Activation sharding hooks of the Wan DiT: the points where a sequence-parallel (Ulysses) mesh pins its layouts.

The model calls `constrain(x, kind)` at a few fixed points; outside an `activation_layout` block (the default, and
every single-device or data x model run) it returns ``x`` itself, so those paths trace exactly as before. Inside one
(`jaxkv.parallel.rollout` enters it while tracing a step with ``seq > 1``) each kind maps to a `PartitionSpec` and
``x`` gets ``jax.lax.with_sharding_constraint``; the partitioner inserts the all-to-alls between the layouts:

* ``TOKENS``      [batch, tokens, dim]: the residual stream and every block input / branch output (tokens split);
* ``HEADS``       [batch, tokens, heads, head_dim]: q, k, v inside self- and cross-attention (all of the chunk's
  tokens, heads split), so the cache write and the attention over the ring are local;
* ``TOKEN_HEADS`` [batch, tokens, heads, head_dim]: the attention output on its way back to the o projection
  (tokens split again, heads split as the o projection's rows are).

The layout is read when the model is traced (a context variable), so it belongs inside the traced function.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import PartitionSpec

TOKENS, HEADS, TOKEN_HEADS = "tokens", "heads", "token_heads"
KINDS = (TOKENS, HEADS, TOKEN_HEADS)

_LAYOUT: contextvars.ContextVar[dict[str, PartitionSpec] | None] = contextvars.ContextVar("wan_layout", default=None)


@contextlib.contextmanager
def activation_layout(specs: dict[str, PartitionSpec]):
    """Within the block, `constrain` pins each kind of ``specs`` (one `PartitionSpec` per name of `KINDS`, over the
    axes of the mesh being traced under)."""
    if set(specs) != set(KINDS):
        raise ValueError(f"activation_layout needs a PartitionSpec for each of {list(KINDS)}, got {sorted(specs)}")
    token = _LAYOUT.set(dict(specs))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def constrain(x, kind: str):
    """``x`` with the sharding of ``kind`` in the current `activation_layout`; ``x`` unchanged outside one."""
    specs = _LAYOUT.get()
    if specs is None:
        return x
    return jax.lax.with_sharding_constraint(x, specs[kind])
