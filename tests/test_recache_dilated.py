"""Prompt switching (KV re-cache) on caches with dilated layers (`jaxkv.recache_dilated`): a mixed dense/dilated
cache and an all-dilated one, against a cache-free reference that runs the held chunks' clean latents (from the
test's own record, chronologically) through one plain forward at their absolute positions under each layer's
visibility (the dense window and the chronological dilated model, tests/test_rollout_mixed.layer_masks,
restricted to the held chunks) and the new context; every layer's K/V must equal it at every position its cache
holds (pending dilated frames included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import rollout as R
from jaxkv.cache import MixedCache
from jaxkv.models.wan import model as M
from jaxkv.models.wan.dit import dit
from jaxkv.run_options import RunOptions
from jaxkv.stream import Stream
from tests.test_rollout_mixed import CFG, SCHEDULE, H, W, _ctx, _params, layer_masks

XLA = RunOptions.of(backend="xla")  # how the model runs in the hand-built references


def _rc(**kw):
    return R.RolloutConfig(H, W, schedule=SCHEDULE, **kw)


def _layer_slots(cache, layer):
    """(k, v, stored positions) of model layer ``layer``: [batch, capacity, heads, head_dim] x 2, int [batch,
    capacity] (a pending dilated slot's -(p) - 2 read as p; -1 empty)."""
    if isinstance(cache, MixedCache):
        kind, i = cache.locate(layer)
        stack = getattr(cache, kind)
    else:
        stack, i = cache, layer
    pos = np.asarray(stack.positions)
    pos = np.where(pos <= -2, -pos - 2, pos)
    return np.asarray(stack.k[i]), np.asarray(stack.v[i]), pos


def held_chunks(cache, chunk):
    """Sorted chunk indices any layer holds, read off the stored positions."""
    found = set()
    for layer in range(CFG.num_layers):
        pos = _layer_slots(cache, layer)[2]
        found |= {int(p) // chunk for p in pos[0] if p >= 0}
    return sorted(found)


def reference_kv(params, rc, old_cache, clean, context, keep_sink, num_chunks):
    """{layer: (k, v)} [batch, held tokens, heads, head_dim] in chronological order, and the held positions."""
    t_frame = rc.tokens_per_frame(CFG)
    chunk = rc.chunk_frames * t_frame
    held = held_chunks(old_cache, chunk)
    frames = [f for i in held for f in range(i * rc.chunk_frames, (i + 1) * rc.chunk_frames)]
    masks = layer_masks(rc, num_chunks)[:, frames][:, :, frames]
    token_masks = jnp.asarray(np.repeat(np.repeat(masks, t_frame, axis=1), t_frame, axis=2))
    batch = old_cache.batch
    positions = np.concatenate([np.arange(f * t_frame, (f + 1) * t_frame) for f in frames]).astype(np.int32)
    n = positions.size
    sink = positions < rc.sink_frames * t_frame if keep_sink else np.zeros(n, bool)
    # keep_sink: a layer that holds a sink token keeps its old K/V there; one that no longer holds it (a dilated
    # layer past its horizon) does not see it (zeroed, masked)
    keep, old_k, old_v = [], [], []
    for layer in range(CFG.num_layers):
        k, v, pos = _layer_slots(old_cache, layer)
        mine = sink & np.isin(positions, pos[0])
        idx = [int(np.flatnonzero(pos[0] == p)[0]) if m else 0 for p, m in zip(positions, mine)]
        keep.append(mine)
        old_k.append(np.where(mine[None, :, None, None], k[:, idx], 0.0))
        old_v.append(np.where(mine[None, :, None, None], v[:, idx], 0.0))
    drop = jnp.asarray(sink[None, :] & ~np.stack(keep))[:, None, :, None, None]  # [layers, 1, n, 1, 1]
    keep = jnp.asarray(np.stack(keep))[:, None, :, None, None]
    old_k, old_v = jnp.asarray(np.stack(old_k)), jnp.asarray(np.stack(old_v))
    token_masks = token_masks & ~drop[:, 0, None, :, 0, 0] | jnp.eye(n, dtype=bool)[None]
    latents = jnp.concatenate([clean[i] for i in held], axis=1)
    if latents.shape[0] != batch:  # guidance: the negative sessions hold the same frames
        latents = jnp.concatenate([latents, latents], axis=0)
    cross = M.cross_kv(params, CFG, context)
    pos_b = jnp.broadcast_to(jnp.asarray(positions), (batch, n))

    def self_attention(q, k, v, kv, layer):
        k = jnp.where(keep[layer] | drop[layer], old_k[layer], k)
        v = jnp.where(keep[layer] | drop[layer], old_v[layer], v)
        ks, vs = kv
        kv = (ks.at[layer].set(k), vs.at[layer].set(v))
        mask = jax.lax.dynamic_index_in_dim(token_masks, layer, 0, keepdims=False)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        p = jax.nn.softmax(jnp.where(mask[None, None], logits, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), kv

    zeros = jnp.zeros((CFG.num_layers, batch, n, CFG.num_heads, CFG.head_dim))
    t = jnp.full((batch,), rc.schedule.context_noise)
    ks, vs = jax.jit(lambda p, x: dit(p, CFG, x, t, pos_b, cross, self_attention, (zeros, zeros), XLA)[1])(
        params, latents
    )
    return ks, vs, positions, held


CASES = {
    # layers 1 and 3 dilated (every 2nd), a 1-frame chunk, a 2-frame window + 1-frame sink, horizon 4 frames
    "mixed": dict(chunk_frames=1, window_frames=2, sink_frames=1, dilated_every=2, dilation=2, buckets=2),
    # every layer dilated, 2-frame chunks (frame 1 of a chunk is never kept at dilation 3), horizon 6 frames
    "dilated": dict(chunk_frames=2, window_frames=2, sink_frames=0, dilated_every=1, dilation=3, buckets=2),
}


@pytest.mark.parametrize(
    "name,keep_sink,before,guided",
    [
        ("mixed", False, 7, False),
        pytest.param("mixed", True, 7, False, marks=pytest.mark.slow),
        pytest.param("mixed", False, 6, True, marks=pytest.mark.slow),  # both sessions of each row re-cached
        pytest.param("dilated", True, 5, False, marks=pytest.mark.slow),
    ],
)
def test_switch_rebuilds_every_layer_as_the_cache_free_reference(name, keep_sink, before, guided):
    rc = _rc(**CASES[name], guidance_scale=3.0 if guided else None)
    params, ctx_a, ctx_b = _params(), _ctx(1), _ctx(2)
    neg_a, neg_b = (_ctx(4), _ctx(5)) if guided else (None, None)
    noise = jax.random.normal(jax.random.key(3), rc.noise_shape(CFG, 1, before + 1))
    s = Stream(params, CFG, rc, ctx_a, noise=noise, negative_context=neg_a)
    chunks = [next(s) for _ in range(before)]
    old = jax.tree.map(jnp.copy, s.state)  # the switch donates the state
    s.switch_prompt(ctx_b, neg_b, keep_sink=keep_sink)
    new = jax.tree.map(jnp.copy, s.state)

    both = ctx_b if not guided else jnp.concatenate([ctx_b, neg_b], axis=0)
    ref_k, ref_v, positions, held = reference_kv(params, rc, old.cache, chunks, both, keep_sink, before)
    chunk = rc.chunk_frames * rc.tokens_per_frame(CFG)
    dense_window = (rc.sink_frames + rc.window_frames) // rc.chunk_frames
    assert held[0] < before - dense_window + (rc.sink_frames // rc.chunk_frames), held  # a dilated-only chunk held
    assert jax.tree.map(lambda x: x.shape, new.cache) == jax.tree.map(lambda x: x.shape, old.cache)
    for a, b in zip(jax.tree.leaves(new.cache), jax.tree.leaves(old.cache), strict=True):
        if a.dtype == jnp.int32:  # positions and clock unchanged
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed = False
    for layer in range(CFG.num_layers):
        k, v, pos = _layer_slots(new.cache, layer)
        old_k = _layer_slots(old.cache, layer)[0]
        rows, slots = np.nonzero(pos >= 0)
        assert {int(p) // chunk for p in pos[rows, slots]} <= set(held)
        idx = np.searchsorted(positions, pos[rows, slots])
        assert (positions[idx] == pos[rows, slots]).all()
        got_k, want_k = k[rows, slots], np.asarray(ref_k[layer])[rows, idx]
        got_v, want_v = v[rows, slots], np.asarray(ref_v[layer])[rows, idx]
        scale = float(np.abs(ref_k).max())
        assert np.abs(got_k - want_k).max() <= 1e-5 * scale, (layer, np.abs(got_k - want_k).max())
        assert np.abs(got_v - want_v).max() <= 1e-5 * float(np.abs(ref_v).max()), layer
        changed |= float(np.abs(k[rows, slots] - old_k[rows, slots]).max()) > 1e-3
    assert changed  # the prompt matters: the comparison can fail
    assert np.isfinite(np.asarray(next(s))).all()  # and the stream goes on


def test_a_history_that_lacks_a_held_chunk_or_rows_out_of_step_are_refused():
    """`check_history` (run by `Stream.switch_prompt` before anything changes) names the missing chunk."""
    from jaxkv import recache_dilated as D

    rc = _rc(**CASES["mixed"])
    cache = R.empty_cache(CFG, rc, 2)
    kv = jnp.ones((2, rc.chunk_frames * rc.tokens_per_frame(CFG), CFG.num_heads, CFG.head_dim))
    for _ in range(3):  # chunks 0, 1, 2 committed in every layer
        cache = cache.begin_chunk()
        cache = cache.replace(
            dense=cache.dense.write(kv, kv, layer=0), dilated=cache.dilated.write(kv, kv, layer=0, commit=True)
        )
    D.check_history(cache, jnp.array([[0, 1, 2], [0, 1, 2]], jnp.int32))
    with pytest.raises(ValueError, match="lacks chunk 1 \\(row 1\\)"):
        D.check_history(cache, jnp.array([[0, 1, 2], [0, -1, 2]], jnp.int32))
    behind = cache.replace(dense=cache.dense.replace(chunk_start=jnp.array([4, 2], jnp.int32)))
    with pytest.raises(ValueError, match="rows must be in step"):
        D.check_history(behind, jnp.array([[0, 1, 2], [0, 1, 2]], jnp.int32))
    assert D.history_window_chunks(rc) == 7  # (buckets + 1) * dilation / chunk_frames + 1 > the 2-chunk window
