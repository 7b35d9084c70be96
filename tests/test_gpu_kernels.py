"""The attention kernels compiled for a GPU (not interpreted) against the dense reference, at Wan-like shapes: run
with ``python -m pytest -m gpu`` on a machine with a CUDA jaxlib; skipped elsewhere (tests/conftest.py). On CPU the
same kernels' logic is covered by tests/test_pallas.py (interpret mode, CUDA lowering) and tests/test_cudnn.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import attend, dense_attention
from tests.helpers.attention_cases import ring_positions

pytestmark = pytest.mark.gpu

CHUNK = 1560  # tokens of one latent frame of Wan at 480x832: a chunk of one frame keeps the test short
HEADS, HEAD_DIM = 12, 128


def _ring(seed, *, sink_chunks, window_chunks, written):
    """bf16 q [1, CHUNK, H, D] for the last written chunk and k, v [1, slots, H, D] of a ring with ``written``
    chunks in it (wrapped past its capacity when written > sink_chunks + window_chunks), with their positions."""
    pos = ring_positions(CHUNK, sink_chunks, window_chunks, written)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (1, CHUNK, HEADS, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(kk, (1, len(pos), HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(kv, (1, len(pos), HEADS, HEAD_DIM), jnp.bfloat16)
    qp = jnp.arange((written - 1) * CHUNK, written * CHUNK, dtype=jnp.int32)[None]
    return q, k, v, qp, jnp.asarray(pos, jnp.int32)[None]


CASES = {
    "partially filled, no sink": dict(sink_chunks=0, window_chunks=6, written=2),
    "wrapped, sink + window": dict(sink_chunks=1, window_chunks=5, written=17),
    "full, not wrapped": dict(sink_chunks=1, window_chunks=5, written=6),
}


@pytest.mark.parametrize("backend", ["pallas", "cudnn"])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_kernel_matches_the_dense_reference(backend, name):
    q, k, v, qp, kp = _ring(0, **CASES[name])
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: dense_attention(*(x.astype(jnp.float32) for x in a[:3]), *a[3:], chunk=CHUNK))(
            q, k, v, qp, kp
        )
    got = jax.jit(lambda *a: attend(*a, backend=backend, chunk=CHUNK))(q, k, v, qp, kp)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
    assert np.isfinite(err) and err < 3e-2, f"{backend} on {name}: max abs error {err}"
