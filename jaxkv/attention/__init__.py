"""Position-addressed attention over caches held in any physical order."""

from jaxkv.attention.masks import visible
from jaxkv.attention.reference import dense_attention


def attend(q, k, v, q_positions, kv_positions, *, causal=False, chunk=None, window=None, sink=0, scale=None,
           backend="auto"):
    """Attention of queries at absolute positions to keys/values at absolute positions (any physical order).

    Shapes: q [batch, q_len, q_heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim]; q_positions int32
    [batch, q_len]; kv_positions int32 [batch, kv_len] (negative = empty slot). Returns [batch, q_len, q_heads,
    head_dim]. Mask arguments: see `jaxkv.attention.masks.visible`.
    """
    # Provisional: the dense XLA reference only; the blockwise and Pallas backends replace this dispatch.
    del backend
    return dense_attention(q, k, v, q_positions, kv_positions, causal=causal, chunk=chunk, window=window,
                           sink=sink, scale=scale)


__all__ = ["attend", "dense_attention", "visible"]
