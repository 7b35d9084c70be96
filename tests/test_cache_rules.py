"""The cache rules other modules read from `jaxkv.cache`: the registries derived from the policy classes, the ring
slot rule shared by the cache and the latent ring, the position limit, and the mixed cache's layer order."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import cache as C
from jaxkv import recache, rollout, session
from jaxkv.cache.clock import check_chunk_room, ring_slot
from jaxkv.generate import options


def test_every_registry_is_read_from_the_policy_classes():
    assert set(C.POLICIES) == {"ring", "rolling", "dilated"}
    assert C.RECACHE_POLICIES == {"ring", "rolling"} and C.WRAPPING_POLICIES == {"ring", "rolling", "dilated"}
    assert C.CACHE_CLASSES == {
        "RingCache": C.RingCache,
        "RollingCache": C.RollingCache,
        "DilatedCache": C.DilatedCache,
        "MixedCache": C.MixedCache,
        "Fp8Cache": C.Fp8Cache,
    }
    # the modules that ask hold the registry's own objects, not copies that could drift
    assert rollout.WRAPPING_POLICIES is C.WRAPPING_POLICIES and recache.RECACHE_POLICIES is C.RECACHE_POLICIES
    assert session.CACHE_CLASSES is C.CACHE_CLASSES and options.POLICIES is C.WINDOW_POLICIES
    assert rollout.wrap_period is C.clock.wrap_period and rollout.wrap_clock is C.clock.wrap_clock
    assert C.DilatedCache.wraps and not C.DilatedCache.recaches


@pytest.mark.parametrize("sink_chunks, window_chunks", [(0, 1), (0, 3), (1, 2), (2, 5)])
def test_ring_slot_is_the_ring_rule_for_the_cache_and_the_latent_ring(sink_chunks, window_chunks):
    n = np.arange(40)
    want = [i if i < sink_chunks else sink_chunks + (i - sink_chunks) % window_chunks for i in n]  # by hand
    np.testing.assert_array_equal(ring_slot(jnp.asarray(n), sink_chunks, window_chunks), want)
    spec = C.RingSpec(chunk=2, window=2 * window_chunks, sink=2 * sink_chunks)
    cache = C.RingCache.init(spec, batch=1, heads=1, head_dim=2)
    ring = recache.LatentRing.init(spec, (1, 1, 1, 1, 1))
    np.testing.assert_array_equal(cache.slot_of_chunk(jnp.asarray(n)), want)
    np.testing.assert_array_equal(ring.slot_of_chunk(jnp.asarray(n)), want)


def test_chunk_room_counts_the_chunks_a_cache_holds():
    spec = C.RingSpec(chunk=2**20, window=2**21)  # 2048 chunks fit int32 positions
    assert spec.max_chunks == 2048
    check_chunk_room(spec, 2048)
    with pytest.raises(ValueError, match="num_chunks=2049 after 0 chunks would pass the int32 position limit"):
        check_chunk_room(spec, 2049)
    cache = C.RingCache.init(spec, batch=1, heads=1, head_dim=1).begin_chunk().begin_chunk()  # chunks 0 and 1
    check_chunk_room(spec, 2046, cache)
    with pytest.raises(ValueError, match="after 2 chunks .* generate at most 2046 more"):
        check_chunk_room(spec, 2047, cache)


def test_mixed_cache_scans_layers_in_model_order_on_their_own_stacks():
    ring, dil = C.RingSpec(chunk=4, window=8, sink=4), C.DilatedSpec(2, 2, 3, 2)
    cache = C.MixedCache.init(C.MixedSpec(ring, dil, 3), batch=1, heads=1, head_dim=1, layers=6)
    assert cache.dense.layers == 4 and cache.dilated.layers == 2

    def layer_fn(x, stack, layer, index):
        # records (model layer, stack, index in it) in visiting order; marks the stack's own k at that index
        kind = 0 if stack.spec is ring else 1
        step = jnp.sum(x[:, 0] >= 0)
        x = x.at[step].set(jnp.stack([layer, kind, index]))
        return x, stack.replace(k=stack.k.at[index].add(layer + 1.0))

    x, out = cache.scan_layers(layer_fn, jnp.full((6, 3), -1, jnp.int32))
    want = [(layer, *cache.locate(layer)) for layer in range(6)]
    assert [(int(a), "dilated" if b else "dense", int(c)) for a, b, c in np.asarray(x)] == want
    np.testing.assert_array_equal(out.dense.k[:, 0, 0, 0, 0], [1, 2, 4, 5])  # model layers 0, 1, 3, 4
    np.testing.assert_array_equal(out.dilated.k[:, 0, 0, 0, 0], [3, 6])  # model layers 2, 5
