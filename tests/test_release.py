"""`jaxkv.cache.release`: what a window schedule frees is evicted, the protected prefix never, against a
chronological history of which chunks a ring holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.cache as C


def _filled(policy, chunks, batch=2):
    spec = C.RingSpec(chunk=2, window=8, sink=2)
    cache = C.policy_class(policy, spec).init(spec, batch, 1, 1, layers=2)
    for n in range(chunks):
        cache = cache.begin_chunk()
        k = jnp.full((batch, 2, 1, 1), float(n))
        for layer in range(2):
            cache = cache.write(k, k, layer=layer)
    return cache


def _held(cache, b):
    pos = np.asarray(cache.positions[b])
    return sorted(set((pos[pos >= 0] // 2).tolist()))  # chunks held


@pytest.mark.parametrize("policy", ["ring", "rolling"])
def test_release_evicts_the_span_and_never_the_prefix(policy):
    cache = _filled(policy, 6)  # sink chunk 0 + window of chunks 2..5
    assert _held(cache, 0) == [0, 2, 3, 4, 5]
    out = C.release(cache, 8)  # positions [2, 8): chunks 1..3 (chunk 1 already evicted)
    assert _held(out, 0) == _held(out, 1) == [0, 4, 5]
    np.testing.assert_array_equal(out.k, cache.k)  # nothing moves
    assert _held(C.release(cache, 0), 0) == [0, 2, 3, 4, 5]
    only = C.release(cache, 100, sessions=jnp.array([False, True]))
    assert _held(only, 0) == [0, 2, 3, 4, 5] and _held(only, 1) == [0]
    traced = jax.jit(C.release)(cache, jnp.asarray(8, jnp.int32))
    np.testing.assert_array_equal(traced.positions, out.positions)
    # the ring keeps going after a release: later chunks land in their usual slots and are seen
    after = out.begin_chunk()
    assert _held(after, 0) == [0, 4, 5] and int(after.chunk_start[0]) == 12


def test_release_refuses_bad_arguments():
    cache = _filled("ring", 3)
    with pytest.raises(ValueError, match="stop must be >= 0"):
        C.release(cache, -1)
    with pytest.raises(ValueError, match="stop must be an int"):
        C.release(cache, 2.5)
    with pytest.raises(ValueError, match="sessions must be a bool array of shape"):
        C.release(cache, 4, sessions=jnp.array([True]))
    dil = C.DilatedCache.init(C.DilatedSpec(1, 2, 2, 2), 1, 1, 1)
    with pytest.raises(ValueError, match="sink \\+ window cache"):
        C.release(dil, 4)
