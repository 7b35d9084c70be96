"""A `Stream` keeps its latent history and switches itself (issue 38, "one driver"): the same chunks as the retired
`SwitchableStream` wrapper (spelled out here from the pieces it was made of), a fork that diverges on its own, a
session that carries the ring by itself (in the format the wrapper saved), ``history=False``, and the deprecated
shims. The switch's own numbers are checked against a cache-free reference in tests/test_recache.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import parallel as PL
from jaxkv import recache as RC
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.compilation import compile_count
from jaxkv.precision import Precision
from jaxkv.stream import Stream
from tests.test_recache import CFG, _ctx, _params, _rc


def _key_stream(rc, seed=1, **kw):
    return Stream(_params(), CFG, rc, _ctx(seed, 2), key=jax.random.key(7), **kw)


def _old_wrapper_chunks(rc, before, total, ctx_b):
    """The chunks of the retired ``SwitchableStream(Stream(...))`` switched to ``ctx_b`` before chunk ``before``,
    rebuilt from what it was: a Stream without history, a `LatentRing` pushed by `push_chunk` after each chunk,
    `check_ring` and `jit_switch_prompt` on the stream's state."""
    s = _key_stream(rc, history=False)
    batch = s.state.cache.batch
    ring = RC.LatentRing.init(RC.ring_spec(CFG, rc), rc.chunk_shape(CFG, batch))
    out = []
    for n in range(total):
        if n == before:
            RC.check_ring(CFG, rc, s.state, ring)
            new = RC.jit_switch_prompt(s.params, CFG, rc, s.state, ring, ctx_b, None, keep_sink=True)
            s.carry = s.carry.replace(cache=new.cache, cross=new.cross)
        x = next(s)
        ring = RC.push_chunk(ring, x, s.state.cache.chunk_start, s.state.cache.spec.chunk)
        out.append(np.asarray(x))
    return out, ring


def test_a_switched_stream_equals_the_old_wrapper_and_the_shim_bit_for_bit():
    rc, ctx_b = _rc(), _ctx(2, 2)
    want, want_ring = _old_wrapper_chunks(rc, 4, 6, ctx_b)

    s = _key_stream(rc)
    got = [np.asarray(next(s)) for _ in range(4)]
    s.switch_prompt(ctx_b)
    got += [np.asarray(next(s)) for _ in range(2)]
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"chunk {n}")
    np.testing.assert_array_equal(s.ring.latents, want_ring.latents)
    np.testing.assert_array_equal(s.ring.chunks, want_ring.chunks)

    # the deprecated shim returns the stream itself, and `switch` is a deprecated alias of switch_prompt
    plain = _key_stream(rc, history=False)
    with pytest.warns(DeprecationWarning, match="SwitchableStream is deprecated"):
        shim = RC.SwitchableStream(plain)
    assert shim is plain and shim.ring is not None  # the wrapper started a ring; so does the shim
    old = [np.asarray(next(shim)) for _ in range(4)]
    with pytest.warns(DeprecationWarning, match="use Stream.switch_prompt"):
        shim.switch(ctx_b)
    old += [np.asarray(next(shim)) for _ in range(2)]
    for n, (a, b) in enumerate(zip(old, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"shim chunk {n}")
    with pytest.raises(TypeError, match="MeshSwitchableStream wraps a MeshStream, got Stream"):
        PL.MeshSwitchableStream(plain)  # its mesh form: tests/parallel_checks.py check_switch


def test_history_does_not_change_the_step_or_its_chunks():
    rc = _rc()
    with_ring = _key_stream(rc)
    first = [np.asarray(next(with_ring)) for _ in range(4)]
    steps = compile_count(R.stream_step)
    without = _key_stream(rc, history=False)
    assert without.ring is None
    for n, a in enumerate(first):
        np.testing.assert_array_equal(np.asarray(next(without)), a, err_msg=f"chunk {n}")
    assert compile_count(R.stream_step) == steps  # one step program, with or without the ring push
    # the ring holds what the cache holds: the sink chunk 0 and the window's chunks 2, 3 (ring rule)
    assert sorted(np.asarray(with_ring.ring.chunks[0]).tolist()) == [0, 2, 3]


def test_fork_diverges_independently():
    rc, ctx_b = _rc(), _ctx(2, 2)
    whole = [np.asarray(x) for x in _key_stream(rc, num_chunks=6)]
    switched, _ = _old_wrapper_chunks(rc, 3, 6, ctx_b)

    s = _key_stream(rc, num_chunks=6)
    for _ in range(3):
        next(s)
    twin = s.fork()
    assert (twin.index, twin.start, twin.num_chunks) == (3, 0, 6)
    twin.switch_prompt(ctx_b)  # donates the twin's state only
    assert not any(x.is_deleted() for x in jax.tree.leaves((s.state, s.ring)))
    for n, x in enumerate(twin):
        np.testing.assert_array_equal(np.asarray(x), switched[3 + n], err_msg=f"fork chunk {3 + n}")
    for n, x in enumerate(s):  # the original, stepped after its twin, is the unswitched stream
        np.testing.assert_array_equal(np.asarray(x), whole[3 + n], err_msg=f"original chunk {3 + n}")


def test_the_session_carries_the_ring_by_itself(tmp_path):
    rc, ctx_b = _rc(), _ctx(2, 2)
    switched, _ = _old_wrapper_chunks(rc, 4, 6, ctx_b)
    s = _key_stream(rc)
    for _ in range(4):
        next(s)
    session = s.session(extras={"note": {"x": jnp.arange(3)}})  # merged with the caller's extras
    assert set(session.extras) == {RC.RING_EXTRA, "note"}
    # the format the wrapper saved (`extras={RING_EXTRA: stream.ring_extra()}`): the same entry and arrays
    old_style = s.session(extras={RC.RING_EXTRA: s.ring_extra()})
    chex.assert_trees_all_equal(session.extras[RC.RING_EXTRA], old_style.extras[RC.RING_EXTRA])
    path = S.save(str(tmp_path / "s.session"), session)
    resumed = Stream.from_session(_params(), CFG, rc, S.load(path, CFG, rc))
    np.testing.assert_array_equal(resumed.ring.latents, s.ring.latents)
    resumed.switch_prompt(ctx_b)  # at once: every chunk the cache holds came back in the ring
    for n in range(4, 6):
        np.testing.assert_array_equal(np.asarray(next(resumed)), switched[n], err_msg=f"chunk {n}")


def test_a_session_without_the_ring_refills_it_and_a_bad_ring_is_refused_first():
    rc = _rc()
    s = _key_stream(rc, history=False)
    for _ in range(2):
        next(s)
    bare = s.session()
    assert RC.RING_EXTRA not in bare.extras  # a stream without history saves none
    resumed = Stream.from_session(_params(), CFG, rc, bare.fork())
    with pytest.raises(ValueError, match="lacks chunk 0"):  # chunks 0, 1 were not pushed here
        resumed.switch_prompt(_ctx(2, 2))
    assert not any(x.is_deleted() for x in jax.tree.leaves(resumed.state))
    bad = bare.replace(extras={RC.RING_EXTRA: {"latents": jnp.zeros((1, 3)), "chunks": jnp.zeros((2, 3), jnp.int32)}})
    with pytest.raises(ValueError, match="saved latent ring's latents are float32"):
        Stream.from_session(_params(), CFG, rc, bad)
    assert not any(x.is_deleted() for x in jax.tree.leaves(bad.state))  # refused before anything ran
    wrong = bare.replace(extras={RC.RING_EXTRA: {"latents": jnp.zeros(3)}})
    with pytest.raises(ValueError, match="must hold 'latents' and 'chunks'"):
        Stream.from_session(_params(), CFG, rc, wrong)
    ignored = Stream.from_session(_params(), CFG, rc, bad.fork(), history=False)  # keeps none: nothing to check
    assert ignored.ring is None


def test_history_false_refuses_a_switch_before_the_state_changes():
    rc = _rc()
    s = _key_stream(rc, history=False)
    next(s)
    before = s.state
    with pytest.raises(ValueError, match="cannot switch prompts: it was built with history=False"):
        s.switch_prompt(_ctx(2, 2))
    assert s.state.cache is before.cache and not s.state.cache.k.is_deleted()
    with pytest.raises(ValueError, match="keeps no latent history"):
        s.ring_extra()
    with pytest.raises(ValueError, match="history must be a bool"):
        _key_stream(rc, history=1)
    with pytest.raises(ValueError, match="keep_sink must be a bool"):
        _key_stream(rc).switch_prompt(_ctx(2, 2), keep_sink=1)


def test_an_fp8_stream_keeps_its_history_switches_and_resumes_switched_from_disk_bit_for_bit(tmp_path):
    """Every cache a RolloutConfig builds can be re-cached now (an FP8 cache re-quantized, `jaxkv.recache.recompute`;
    its numbers against the cache-free reference: tests/test_recache.py): an FP8 stream keeps its latent history,
    switches, and a session saved to disk after the switch, with its ring, resumes and switches again bit for bit
    as the uninterrupted stream."""
    fp8 = _rc(precision=Precision("float32", "float32", "bfloat16", fp8_kv=True))
    assert RC.switch_refusal(fp8) is None and RC.switch_refusal(_rc(policy="rolling")) is None
    s = _key_stream(fp8)
    assert s.ring is not None
    for _ in range(3):
        next(s)
    s.switch_prompt(_ctx(2, 2))
    next(s)
    path = S.save(str(tmp_path / "fp8.session"), s.session())
    resumed = Stream.from_session(_params(), CFG, fp8, S.load(path, CFG, fp8))
    np.testing.assert_array_equal(resumed.ring.latents, s.ring.latents)
    for stream in (s, resumed):
        stream.switch_prompt(_ctx(3, 2), keep_sink=False)
    for n in range(2):
        np.testing.assert_array_equal(np.asarray(next(resumed)), np.asarray(next(s)), err_msg=f"chunk {4 + n}")


def test_a_per_layer_fp8_stream_switches_as_the_stacked_one():
    """Per-layer params (the unrolled layer loop) hold the FP8 cache per layer; its switches (keeping the sink, then
    re-running it) re-quantize layer by layer and give the stacked stream's chunks to float32 rounding."""
    from jaxkv.models.wan.params import per_layer_params

    fp8 = _rc(precision=Precision("float32", "float32", "float32", fp8_kv=True))
    chunks = {}
    for name, params in (("stacked", _params()), ("per layer", per_layer_params(_params()))):
        s = Stream(params, CFG, fp8, _ctx(1, 2), key=jax.random.key(7))
        xs = [np.asarray(next(s)) for _ in range(3)]
        s.switch_prompt(_ctx(2, 2))
        xs.append(np.asarray(next(s)))
        s.switch_prompt(_ctx(3, 2), keep_sink=False)
        xs.append(np.asarray(next(s)))
        assert s.state.cache.is_per_layer == (name == "per layer"), name
        chunks[name] = xs
    for n, (a, b) in enumerate(zip(chunks["per layer"], chunks["stacked"], strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"chunk {n}")
    unswitched = Stream(_params(), CFG, fp8, _ctx(1, 2), key=jax.random.key(7))
    plain = [np.asarray(next(unswitched)) for _ in range(4)]
    np.testing.assert_array_equal(chunks["stacked"][2], plain[2])
    assert not np.allclose(chunks["stacked"][3], plain[3], atol=1e-3)  # the switch changes the next chunk
