"""Attention test cases: ring layouts of positions (`ring_positions`, `physical`, `permuted`), random cases
(`make_case`), the masks every backend is checked under (`MASKS`), and brute-force references (`brute_visible`,
`numpy_attention`)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np

MASKS = [
    dict(),
    dict(causal=True),
    dict(chunk=4),
    dict(chunk=4, window=8),
    dict(chunk=4, window=8, sink=4),
    dict(causal=True, window=6, sink=4),
    dict(causal=True, chunk=4, window=12, sink=8),
]


def ring_positions(chunk, sink_chunks, window_chunks, chunks_written):
    """int [capacity]: absolute positions held by each slot after writing chunks 0 .. chunks_written-1."""
    pos = np.full((sink_chunks + window_chunks) * chunk, -1)
    for n in range(chunks_written):
        slot = n if n < sink_chunks else sink_chunks + (n - sink_chunks) % window_chunks
        pos[slot * chunk : (slot + 1) * chunk] = np.arange(n * chunk, (n + 1) * chunk)
    return pos


def unwrapped_positions(ring):
    """The same logical content as `ring`, laid out in chronological slot order (empty slots last)."""
    valid = np.sort(ring[ring >= 0])
    out = np.full_like(ring, -1)
    out[: len(valid)] = valid
    return out


def make_case(
    seed,
    *,
    batch=2,
    chunk=4,
    sink_chunks=1,
    window_chunks=3,
    written=(6, 2),
    q_heads=4,
    kv_heads=2,
    head_dim=8,
    dtype=jnp.float32,
):
    """A ring (one row per session, each `written[b]` chunks in), keys/values drawn per absolute position, and
    queries for the last written chunk of each session (the chunk being denoised, already in the cache)."""
    rng = np.random.default_rng(seed)
    pos = np.stack([ring_positions(chunk, sink_chunks, window_chunks, n) for n in written])
    horizon = chunk * max(written) + 1
    k_table = rng.normal(size=(batch, horizon, kv_heads, head_dim))
    v_table = rng.normal(size=(batch, horizon, kv_heads, head_dim))
    qpos = np.stack([np.arange((n - 1) * chunk, n * chunk) for n in written])
    q = rng.normal(size=(batch, chunk, q_heads, head_dim))
    case = dict(q=q, qpos=qpos, pos=pos, k_table=k_table, v_table=v_table, dtype=dtype)
    return case


def physical(case, pos):
    """(q, k, v, q_positions, kv_positions) as jnp arrays for slot layout `pos`; empty slots hold noise."""
    rng = np.random.default_rng(123)
    b = np.arange(pos.shape[0])[:, None]
    k = np.where((pos >= 0)[..., None, None], case["k_table"][b, np.maximum(pos, 0)], rng.normal(size=(1,)))
    v = np.where((pos >= 0)[..., None, None], case["v_table"][b, np.maximum(pos, 0)], rng.normal(size=(1,)))
    dt = case["dtype"]
    return (
        jnp.asarray(case["q"], dt),
        jnp.asarray(k, dt),
        jnp.asarray(v, dt),
        jnp.asarray(case["qpos"], jnp.int32),
        jnp.asarray(pos, jnp.int32),
    )


def permuted(pos, seed):
    rng = np.random.default_rng(seed)
    return np.stack([row[rng.permutation(len(row))] for row in pos])


def brute_visible(qp, kp, causal=False, chunk=None, window=None, sink=0):
    """The mask by its definition, one pair at a time in Python."""
    out = np.zeros((len(qp), len(kp)), bool)
    for i, j in itertools.product(range(len(qp)), range(len(kp))):
        q, k = int(qp[i]), int(kp[j])
        ok = k >= 0
        if causal:
            ok = ok and k <= q
        if chunk is not None:
            ok = ok and k // chunk <= q // chunk
        if window is not None:
            qr, kr = (q // chunk * chunk, k // chunk * chunk) if chunk is not None else (q, k)
            ok = ok and (qr - kr < window or k < sink)
        out[i, j] = ok
    return out


def numpy_attention(q, k, v, qpos, kpos, **mask):
    """Float64 NumPy attention over the valid keys only (compacted), one row and head at a time."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, lq, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        m = brute_visible(np.asarray(qpos[bi]), np.asarray(kpos[bi]), **mask)
        for h in range(hq):
            logits = q[bi, :, h] @ k[bi, :, h // g].T / np.sqrt(d)
            for i in range(lq):
                if m[i].any():
                    w = np.exp(logits[i, m[i]] - logits[i, m[i]].max())
                    out[bi, i, h] = (w / w.sum()) @ v[bi, m[i], h // g]
    return out
