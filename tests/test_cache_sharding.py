"""A cache sharded over 8 CPU devices behaves exactly like the unsharded one, and its writes stay in place.

JAX fixes its device count when it initialises, so the check runs in a fresh interpreter with 8 host devices.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxkv
    from jaxkv.cache.sharding import cache_partition_specs, cache_shardings, shard_cache
    from jaxkv.compilation import compile_count

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    LAYERS = 3

    def step(cache, k, v):
        cache = cache.begin_chunk()
        for layer in range(LAYERS):
            cache = cache.write(k + layer, v - layer, layer=layer)
        return cache

    def heads_only(cache):  # plain jit, heads sharded
        sh = cache_shardings(cache, mesh, data_axis=None)
        return jax.jit(step, in_shardings=(sh, None, None), out_shardings=sh, donate_argnums=0), sh

    def sessions_and_heads(cache):  # shard_map, sessions x heads
        specs = cache_partition_specs(cache)
        kv = P("data", None, "model", None)
        fn = jax.shard_map(step, mesh=mesh, in_specs=(specs, kv, kv), out_specs=specs)
        sh = cache_shardings(cache, mesh)
        return jax.jit(fn, in_shardings=(sh, None, None), out_shardings=sh, donate_argnums=0), sh

    mesh3 = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "seq", "model"))

    def heads_over_two_axes(cache):  # plain jit, heads split over model x seq (Ulysses' cache layout)
        sh = cache_shardings(cache, mesh3, data_axis=None, head_axis=("model", "seq"))
        return jax.jit(step, in_shardings=(sh, None, None), out_shardings=sh, donate_argnums=0), sh

    spec = jaxkv.RingSpec(chunk=4, window=12, sink=4)
    rng = np.random.default_rng(0)
    data = [jnp.asarray(rng.standard_normal((2, 4, 8, 16)), jnp.float32) for _ in range(11)]
    plain = jaxkv.RingCache.init(spec, 2, 8, 16, layers=LAYERS)
    step_plain = jax.jit(step)
    for k in data:  # several wraps of the 3-chunk window
        plain = step_plain(plain, k, -k)

    for make, shard_bytes_div in ((heads_only, 4), (sessions_and_heads, 8), (heads_over_two_axes, 4)):
        cache = jaxkv.RingCache.init(spec, 2, 8, 16, layers=LAYERS)
        fn, sh = make(cache)
        cache = jax.device_put(cache, sh)
        for k in data:
            cache = fn(cache, k, -k)
        assert compile_count(fn) == 1, (make.__name__, compile_count(fn))
        for name in ("k", "v", "positions", "chunk_start"):
            np.testing.assert_array_equal(np.asarray(getattr(cache, name)), np.asarray(getattr(plain, name)), name)
        assert cache.k.sharding.is_equivalent_to(sh.k, cache.k.ndim)
        assert cache.k.addressable_shards[0].data.nbytes == cache.k.nbytes // shard_bytes_div
        # In place: temp memory does not grow with the window and stays far below one device's shard.
        temps = []
        for window_chunks in (4, 64):
            big = jaxkv.RingCache.init(jaxkv.RingSpec(chunk=4, window=4 * window_chunks), 2, 8, 16, layers=LAYERS)
            fn, sh = make(big)
            k = jnp.zeros((2, 4, 8, 16), jnp.float32)
            temps.append(fn.lower(jax.device_put(big, sh), k, k).compile().memory_analysis().temp_size_in_bytes)
        shard_bytes = big.k.nbytes // shard_bytes_div
        assert temps[1] < shard_bytes / 16, (make.__name__, temps, shard_bytes)

    try:
        cache_shardings(jaxkv.RingCache.init(spec, 3, 8, 16), mesh)
    except ValueError as e:
        assert "not divisible" in str(e)
    else:
        raise AssertionError("batch 3 on a data axis of 2 was accepted")
    try:
        cache_shardings(jaxkv.RingCache.init(spec, 2, 6, 16), mesh3, head_axis=("model", "seq"))
    except ValueError as e:
        assert "heads = 6 is not divisible by mesh axis ('model', 'seq') of size 4" in str(e), str(e)
    else:
        raise AssertionError("6 heads on model x seq = 4 were accepted")
    print("OK")
""")


@pytest.mark.slow
def test_sharded_cache_matches_unsharded_in_place():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_dilated_and_mixed_caches_shard_as_the_ring_cache():
    """A `DilatedCache` gets the ring cache's specs (sessions on data, heads on the head axes, slots whole); a
    `MixedCache` gets them for each of its two stacks, in a pytree of its own structure (in-process: no mesh)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jaxkv.cache import DilatedCache, DilatedSpec, MixedCache, MixedSpec, RingSpec
    from jaxkv.cache.sharding import cache_partition_specs

    def assert_ring_specs(specs, head):
        assert specs.k == specs.v == P(None, "data", None, head, None), specs.k
        assert specs.positions == P("data", None) and specs.chunk_start == P("data")

    dilated = DilatedSpec(tokens_per_frame=2, chunk_frames=1, dilation=2, buckets=2)
    cache = DilatedCache.init(dilated, 2, 4, 8, layers=2)
    specs = cache_partition_specs(cache)
    assert_ring_specs(specs, "model")
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(cache)
    mixed = MixedCache.init(MixedSpec(RingSpec(chunk=2, window=4, sink=2), dilated, 2), 2, 4, 8, layers=4)
    specs = cache_partition_specs(mixed, head_axis=("model", "seq"))
    assert isinstance(specs, MixedCache) and specs.spec == mixed.spec
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(mixed)
    for part in (specs.dense, specs.dilated):
        assert_ring_specs(part, ("model", "seq"))
    assert cache_partition_specs(mixed, data_axis=None).dilated.positions == P(None, None)


def test_an_fp8_cache_shards_its_ring_and_its_scales_by_session_and_head():
    """An `Fp8Cache` gets its inner ring's specs, and its per-(slot, head) scales [layers, batch, slots, heads] split
    by session and head like the K/V they scale (in-process: no mesh); a per-layer cache is refused, not mis-specced."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jaxkv.cache import Fp8Cache, RingSpec
    from jaxkv.cache.sharding import cache_partition_specs

    cache = Fp8Cache.init(RingSpec(chunk=2, window=4, sink=2), 2, 4, 8, dtype="float32", layers=3)
    specs = cache_partition_specs(cache, head_axis=("model", "seq"))
    assert isinstance(specs, Fp8Cache)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(cache)
    assert specs.k == specs.v == P(None, "data", None, ("model", "seq"), None)
    assert specs.positions == P("data", None) and specs.chunk_start == P("data")
    assert specs.k_scale == specs.v_scale == P(None, "data", None, ("model", "seq"))
    assert cache_partition_specs(cache, data_axis=None, head_axis=None).k_scale == P(None, None, None, None)
    with pytest.raises(ValueError, match="a per-layer cache is not sharded; stack it first"):
        cache_partition_specs(cache.per_layer())
