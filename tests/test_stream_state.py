"""One stream state (issue 38 item 1): a `Stream` carries exactly one `jaxkv.session.Session` (``stream.carry``)
and its ``state`` / ``key`` / ``index`` / ``ring`` are views of it; a fork, an offload + reload and a save + load of
that one object continue bit for bit as the uninterrupted stream; a session directory in the format saved before
(`Session.create` with the ring as ``extras["latent_ring"]``, the old ``stream.session()``) has the same files and
loads and continues. The VAE decoder's share of the carried state is tested in tests/test_pipeline.py."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxkv import recache as RC
from jaxkv import session as S
from jaxkv.session_format import ARRAYS, MANIFEST
from jaxkv.stream import Stream
from tests.test_recache import CFG, _ctx, _params, _rc

TOTAL, SPLIT = 6, 3


def _stream(rc, seed=7):
    return Stream(_params(), CFG, rc, _ctx(1, 2), key=jax.random.key(seed))


@pytest.fixture(scope="module")
def whole():
    """The uninterrupted stream's chunks 0..TOTAL-1 and its latent history after chunk SPLIT-1."""
    s = _stream(_rc())
    chunks = [np.asarray(next(s)) for _ in range(SPLIT)]
    ring = jax.tree.map(np.asarray, (s.ring.latents, s.ring.chunks))
    chunks += [np.asarray(next(s)) for _ in range(TOTAL - SPLIT)]
    return chunks, ring


def _continues(stream, whole, what):
    chunks, ring = whole
    assert stream.index == SPLIT
    np.testing.assert_array_equal(stream.ring.latents, ring[0], err_msg=f"{what}: latent history")
    np.testing.assert_array_equal(stream.ring.chunks, ring[1], err_msg=f"{what}: latent history's chunks")
    for n in range(SPLIT, TOTAL):
        np.testing.assert_array_equal(np.asarray(next(stream)), chunks[n], err_msg=f"{what}: chunk {n}")


def test_the_views_are_the_carried_state_and_nothing_else_is_stored():
    rc = _rc()
    s = _stream(rc)
    next(s)
    assert isinstance(s.carry, S.Session)
    assert not {"state", "key", "index", "ring"} & set(vars(s))  # no second copy to drift
    assert s.state.cache is s.carry.cache and s.state.cross is s.carry.cross and s.key is s.carry.key
    assert s.index == 1 and s.ring.latents is s.carry.extras[RC.RING_EXTRA]["latents"]
    for name in ("state", "key", "index", "ring"):
        with pytest.raises(AttributeError):
            setattr(s, name, None)
    # another stream's carried state, further on, with another key: every view follows it at once
    other = _stream(rc, seed=8)
    for _ in range(3):
        next(other)
    want = [np.asarray(x) for x in (next(other.fork()), next(other.fork()))]
    s.carry = other.carry.fork().replace(next_chunk=other.carry.next_chunk)
    assert s.index == 3 and s.key is not other.key
    np.testing.assert_array_equal(jax.random.key_data(s.key), jax.random.key_data(other.key))
    np.testing.assert_array_equal(s.ring.chunks, other.ring.chunks)
    assert s.state.cache.k is not other.state.cache.k
    np.testing.assert_array_equal(np.asarray(next(s)), want[0])  # drawn from the new key at the new clock


def test_a_step_replaces_the_carry_and_session_returns_it():
    s = _stream(_rc())
    before = s.carry
    next(s)
    assert s.carry is not before and before.cache.k.is_deleted()  # the cache donated, as before
    assert s.session(copy=False).cache is s.carry.cache  # the carried object itself (stacked already)
    forked = s.session()
    assert forked.cache.k is not s.carry.cache.k and int(forked.next_chunk) == 1
    assert set(forked.extras) == {RC.RING_EXTRA}


def test_fork_offload_and_save_of_the_one_state_continue_bit_for_bit(whole, tmp_path):
    rc = _rc()
    s = _stream(rc)
    for _ in range(SPLIT):
        next(s)
    twin = s.fork()
    session = s.session()
    offloaded = S.offload(s.session(), memory_kind=None)
    assert offloaded.on_host and all(isinstance(x, np.ndarray) for x in jax.tree.leaves(offloaded.extras))
    back = S.reload(offloaded)
    path = S.save(str(tmp_path / "s.session"), session)
    _continues(s, whole, "the original")
    _continues(twin, whole, "the fork")
    _continues(Stream.from_session(_params(), CFG, rc, back), whole, "offload + reload")
    _continues(Stream.from_session(_params(), CFG, rc, S.load(path, CFG, rc)), whole, "save + load")


OLD_TENSORS = {
    "cache/k",
    "cache/v",
    "cache/positions",
    "cache/chunk_start",
    "cross/k",
    "cross/v",
    "key",
    "next_chunk",
    "extras/latent_ring/latents",
    "extras/latent_ring/chunks",
}


def test_an_old_format_session_has_the_same_files_and_loads_and_continues(whole, tmp_path):
    rc = _rc()
    s = _stream(rc)
    for _ in range(SPLIT):
        next(s)
    # the session as the code before the one carried state built it: Session.create, the ring as an extras entry
    old = S.Session.create(
        CFG, rc, s.state, key=s.key, next_chunk=s.index, extras={RC.RING_EXTRA: s.ring_extra()}
    ).fork()
    old_dir = S.save(str(tmp_path / "old.session"), old)
    new_dir = S.save(str(tmp_path / "new.session"), s.session())
    assert sorted(os.listdir(old_dir)) == sorted(os.listdir(new_dir)) == sorted([ARRAYS, MANIFEST])
    old_arrays, new_arrays = (load_file(os.path.join(d, ARRAYS)) for d in (old_dir, new_dir))
    assert set(old_arrays) == set(new_arrays) == OLD_TENSORS
    for name in OLD_TENSORS:
        np.testing.assert_array_equal(new_arrays[name], old_arrays[name], err_msg=name)
        assert new_arrays[name].dtype == old_arrays[name].dtype
    manifests = []
    for d in (old_dir, new_dir):
        with open(os.path.join(d, MANIFEST)) as f:
            manifests.append(json.load(f))
    assert manifests[0] == manifests[1]  # the same manifest, checksums of every tensor included
    _continues(Stream.from_session(_params(), CFG, rc, S.load(old_dir, CFG, rc)), whole, "the old-format session")
