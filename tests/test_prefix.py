"""The protected prefix (the sink) and its epoch: never evicted, rebuilt in place, staleness visible."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.cache.prefix import PrefixEpoch, prefix_complete, rewrite_prefix
from tests.helpers.cache_reference import ReferenceHistory

POLICIES = [jaxkv.RingCache, jaxkv.RollingCache]


def _chunk(rng, spec, batch):
    return jnp.asarray(rng.standard_normal((batch, spec.chunk, 2, 4)), jnp.float32)


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_eviction_never_touches_the_prefix(cls):
    spec = jaxkv.RingSpec(chunk=2, window=6, sink=4)
    rng = np.random.default_rng(0)
    cache = cls.init(spec, 2, 2, 4)
    for _ in range(spec.sink_chunks):
        x = _chunk(rng, spec, 2)
        cache = cache.begin_chunk().write(x, -x)
    pinned = (np.asarray(cache.k[:, :4]), np.asarray(cache.v[:, :4]), np.asarray(cache.positions[:, :4]))
    np.testing.assert_array_equal(pinned[2], [[0, 1, 2, 3]] * 2)
    for _ in range(25):  # eight wraps of the window
        x = _chunk(rng, spec, 2)
        cache = cache.begin_chunk().write(x, -x)
        now = (np.asarray(cache.k[:, :4]), np.asarray(cache.v[:, :4]), np.asarray(cache.positions[:, :4]))
        for a, b in zip(pinned, now, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cls", POLICIES, ids=lambda c: c.__name__)
def test_rewrite_replaces_the_prefix_in_place_and_bumps_the_epoch(cls):
    spec = jaxkv.RingSpec(chunk=2, window=4, sink=4)
    rng = np.random.default_rng(1)
    cache = cls.init(spec, 3, 2, 4)
    ref = ReferenceHistory(spec.chunk, spec.window, spec.sink, 3)
    for _ in range(7):
        x = np.asarray(_chunk(rng, spec, 3))
        cache = cache.begin_chunk().write(jnp.asarray(x), jnp.asarray(-x))
        ref.begin()
        ref.write(x, -x)
    epoch = PrefixEpoch.init(3)
    derived_at = epoch.epoch  # e.g. a cached partial over the prefix, built now
    new_k = np.asarray(rng.standard_normal((3, 4, 2, 4)), np.float32)
    chosen = np.array([True, False, True])
    cache, epoch = rewrite_prefix(cache, epoch, jnp.asarray(new_k), jnp.asarray(-new_k), sessions=jnp.asarray(chosen))
    np.testing.assert_array_equal(epoch.epoch, [1, 0, 1])
    np.testing.assert_array_equal(epoch.is_stale(derived_at), chosen)
    # The reference: the two sink chunks of the chosen sessions replaced, everything else as it was.
    for b in np.flatnonzero(chosen):
        for j in range(spec.sink_chunks):
            rows = new_k[b, j * 2 : (j + 1) * 2]
            ref.sessions[b]["chunks"][j] = (rows, -rows)
    k, v, pos = cache.chronological()
    for b in range(3):
        rk, rv, rpos = ref.logical(b)
        np.testing.assert_array_equal(pos[b, : len(rpos)], rpos)
        np.testing.assert_array_equal(k[b, : len(rpos)], rk)
        np.testing.assert_array_equal(v[b, : len(rpos)], rv)
    # The prefix stays protected afterwards.
    x = _chunk(rng, spec, 3)
    later = cache.begin_chunk().write(x, -x)
    np.testing.assert_array_equal(later.k[:, :4], cache.k[:, :4])


def test_rewrite_of_a_stacked_cache_under_jit():
    spec = jaxkv.RingSpec(chunk=2, window=4, sink=2)
    cache = jaxkv.RingCache.init(spec, 2, 1, 2, layers=3)
    cache = cache.begin_chunk(active=jnp.array([True, False]))  # session 1 has not reserved its sink chunk
    for layer in range(3):
        cache = cache.write(jnp.ones((2, 2, 1, 2)), jnp.ones((2, 2, 1, 2)), layer=layer)
    new = jnp.arange(3 * 2 * 2 * 2, dtype=jnp.float32).reshape(3, 2, 2, 1, 2)
    out, epoch = jax.jit(rewrite_prefix)(cache, PrefixEpoch.init(2), new, -new)
    np.testing.assert_array_equal(epoch.epoch, [1, 0])  # session 1 was not ready: untouched
    np.testing.assert_array_equal(out.k[:, 0, :2], new[:, 0])
    np.testing.assert_array_equal(out.v[:, 0, :2], -new[:, 0])
    np.testing.assert_array_equal(out.k[:, 1], cache.k[:, 1])
    np.testing.assert_array_equal(out.positions, cache.positions)
    np.testing.assert_array_equal(prefix_complete(cache), [True, False])


def test_bad_rewrites_are_refused():
    spec = jaxkv.RingSpec(chunk=2, window=4, sink=4)
    cache = jaxkv.RingCache.init(spec, 2, 1, 2).begin_chunk()
    good = jnp.zeros((2, 4, 1, 2))
    with pytest.raises(ValueError, match=r"sessions \[0, 1\] have not reserved all 2 sink chunks"):
        rewrite_prefix(cache, PrefixEpoch.init(2), good, good)
    cache = cache.begin_chunk()
    with pytest.raises(ValueError, match=r"float32\[2, 4, 1, 2\]"):
        rewrite_prefix(cache, PrefixEpoch.init(2), jnp.zeros((2, 2, 1, 2)), good)
    with pytest.raises(ValueError, match="PrefixEpoch of 2 sessions"):
        rewrite_prefix(cache, PrefixEpoch.init(3), good, good)
    with pytest.raises(ValueError, match="bool array of shape"):
        rewrite_prefix(cache, PrefixEpoch.init(2), good, good, sessions=jnp.array([1, 0]))
    no_sink = jaxkv.RingCache.init(jaxkv.RingSpec(chunk=2, window=4), 2, 1, 2).begin_chunk()
    with pytest.raises(ValueError, match="needs a cache with a sink"):
        rewrite_prefix(no_sink, PrefixEpoch.init(2), good, good)
    with pytest.raises(ValueError, match="seen must be an int array"):
        PrefixEpoch.init(2).is_stale(jnp.zeros((3,), jnp.int32))
    np.testing.assert_array_equal(PrefixEpoch.init(2).bump(jnp.array([False, True])).epoch, [0, 1])
