"""Sessions (`jaxkv.session`): a stream saved and resumed, in process, equals the uninterrupted stream bit for bit
for every cache policy; a snapshot of other settings is refused naming the difference; saves are atomic; forks are
independent of each other's donated steps; host offload round-trips bit for bit and a failed one keeps the device
copy. (Across processes: tests/test_session_cli.py.)"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.cache as C
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.cache.dilated import DilatedCache, DilatedSpec
from jaxkv.compilation import count_compiles
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4  # 2 tokens per frame
RC = R.RolloutConfig(H, W, chunk_frames=1, window_frames=2, sink_frames=1, schedule=Schedule(steps=(1000, 500)))
PARAMS = wan.init_params(CFG, jax.random.key(0))
CTX = jax.random.normal(jax.random.key(1), (1, 3, CFG.text_dim))
KEY = jax.random.key(7)
CACHE_OF = {"ring": "RingCache", "rolling": "RollingCache"}


def _chunks(stream):
    return [np.asarray(x) for x in stream]


def _bits(tree):
    """Every leaf's raw bytes (so -0.0 / NaN payloads count), for bit-identity checks."""

    def raw(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(jax.device_get(x)).tobytes()

    return [raw(x) for x in jax.tree.leaves(tree)]


def _dilated_state(rc, batch=1):
    spec = DilatedSpec(tokens_per_frame=rc.tokens_per_frame(CFG), chunk_frames=rc.chunk_frames, dilation=2, buckets=2)
    cache = DilatedCache.init(spec, batch, CFG.num_heads, CFG.head_dim, layers=CFG.num_layers)
    return R.RolloutState(cache, wan.cross_kv(PARAMS, CFG, CTX))


def _dilated_stream(rc, num_chunks, key=KEY):
    """A Stream over a DilatedCache (RolloutConfig builds only ring / rolling caches): same step, another cache."""
    stream = Stream(PARAMS, CFG, rc, CTX, num_chunks=num_chunks, key=key)
    # the one carried state, rebuilt around the other cache (its fingerprint names the DilatedCache)
    stream.carry = S.Session.create(CFG, rc, _dilated_state(rc), key=key, next_chunk=0, extras=stream.carry.extras)
    return stream


_MIXED = dict(
    chunk_frames=1,
    window_frames=2,
    sink_frames=1,
    dilated_every=2,
    dilation=2,
    buckets=2,
    schedule=Schedule(steps=(1000, 500)),
)
CASES = {
    "ring": (RC, None),
    "rolling": (
        R.RolloutConfig(
            H, W, chunk_frames=1, window_frames=2, sink_frames=1, policy="rolling", schedule=Schedule(steps=(1000, 500))
        ),
        None,
    ),
    "ring-bf16-guided": (
        R.RolloutConfig(
            H,
            W,
            chunk_frames=1,
            window_frames=3,
            sink_frames=0,
            cache_dtype="bfloat16",
            guidance_scale=3.0,
            schedule=Schedule(steps=(1000, 500)),
        ),
        "guided",
    ),
    "dilated": (RC, "dilated"),
    # a MixedCache (layer 0 dense, layer 1 dilated: dilated_every=2 on 2 layers), with each dense policy
    "mixed": (R.RolloutConfig(H, W, **_MIXED), None),
    "mixed-rolling": (R.RolloutConfig(H, W, policy="rolling", **_MIXED), None),
}


def _stream(rc, kind, num_chunks):
    if kind == "dilated":
        return _dilated_stream(rc, num_chunks)
    neg = jnp.zeros_like(CTX) if kind == "guided" else None
    return Stream(PARAMS, CFG, rc, CTX, num_chunks=num_chunks, key=KEY, negative_context=neg)


@pytest.mark.parametrize(
    "name", [n if n in ("ring", "mixed") else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CASES)]
)
def test_save_and_resume_equals_the_uninterrupted_stream(tmp_path, name):
    """6 chunks at once vs 3 chunks, save, load, 3 more: the last 3 chunks bit-identical, and so is the state
    after them; the continuation reuses the compiled step (no new compilation)."""
    rc, kind = CASES[name]
    full = _stream(rc, kind, 6)
    whole = _chunks(full)
    first = _stream(rc, kind, 3)
    head = _chunks(first)
    S.save(str(tmp_path / "s"), first.session())
    cache_like = first.state.cache if kind == "dilated" else None
    loaded = S.load(str(tmp_path / "s"), CFG, rc, cache_like=cache_like)
    assert int(loaded.next_chunk) == 3 and type(loaded.cache) is type(first.state.cache)
    assert _bits(loaded.state) == _bits(first.state)
    if rc.dilated_every:
        # both stacks were saved (the dilated one holds committed frames) and a mixed cache of other settings is
        # refused naming them
        assert isinstance(loaded.cache, C.MixedCache) and type(loaded.cache.dense).__name__ == CACHE_OF[rc.policy]
        assert int((np.asarray(loaded.cache.dilated.positions) >= 0).sum()) > 0
        other = dataclasses.replace(rc, policy="rolling" if rc.policy == "ring" else "ring")
        with pytest.raises(S.SessionError, match=f"cache.dense_class: saved '{CACHE_OF[rc.policy]}'"):
            S.load(str(tmp_path / "s"), CFG, other)
        with pytest.raises(S.SessionError, match="cache.spec.dilated.dilation: saved 2, now 3"):
            S.load(str(tmp_path / "s"), CFG, dataclasses.replace(rc, dilation=3))
    with count_compiles(R.stream_step) as compiles:
        tail = _chunks(Stream.from_session(PARAMS, CFG, rc, loaded, num_chunks=3))
    assert compiles() == 0
    assert len(tail) == 3
    for i, (a, b) in enumerate(zip(whole, head + tail, strict=True)):
        assert a.tobytes() == b.tobytes(), f"chunk {i} differs"
    # a different continuation really is different (the comparison can fail)
    assert whole[3].tobytes() != whole[2].tobytes()


@pytest.mark.slow  # compiles another program (~20 s on 2 busy cores)
def test_resume_from_a_stream_with_explicit_noise():
    noise = jax.random.normal(jax.random.key(3), RC.noise_shape(CFG, 1, 5))
    whole = _chunks(Stream(PARAMS, CFG, RC, CTX, noise=noise))
    first = Stream(PARAMS, CFG, RC, CTX, noise=noise[:2])
    head = _chunks(first)
    s = first.session()
    assert s.key is None
    with pytest.raises(ValueError, match="needs noise="):
        Stream.from_session(PARAMS, CFG, RC, s)
    tail = _chunks(Stream.from_session(PARAMS, CFG, RC, s, noise=noise[2:]))
    assert [c.tobytes() for c in whole] == [c.tobytes() for c in head + tail]


@pytest.mark.slow  # compiles another program (~20 s on 2 busy cores)
def test_scan_rollout_continues_a_session():
    """`advance` (the scan rollout from the session's state and next chunk) equals the stream's chunks 3..5, and
    continues itself (advance twice == advance once over both)."""
    whole = _chunks(Stream(PARAMS, CFG, RC, CTX, num_chunks=6, key=KEY))
    first = Stream(PARAMS, CFG, RC, CTX, num_chunks=3, key=KEY)
    _chunks(first)
    s = first.session()
    latents, s6 = S.advance(PARAMS, CFG, RC, s.fork(), 3)
    expected = np.concatenate(whole[3:], axis=1)
    np.testing.assert_allclose(np.asarray(latents), expected, rtol=0, atol=1e-6)
    assert int(s6.next_chunk) == 6
    a, s4 = S.advance(PARAMS, CFG, RC, s.fork(), 1)
    b, _ = S.advance(PARAMS, CFG, RC, s4, 2)
    assert np.concatenate([np.asarray(a), np.asarray(b)], 1).tobytes() == np.asarray(latents).tobytes()


def _saved(tmp_path):
    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=2, key=KEY)
    _chunks(st)
    path = S.save(str(tmp_path / "s"), st.session(), metadata={"note": "x"})
    return st, path


@pytest.mark.parametrize(
    "change, named",
    [
        (
            dict(
                config=WanConfig(
                    dim=32,
                    ffn_dim=64,
                    num_heads=2,
                    num_layers=2,
                    in_dim=4,
                    out_dim=4,
                    text_dim=8,
                    text_len=5,
                    freq_dim=16,
                )
            ),
            "model.ffn_dim: saved 48, now 64",
        ),
        (dict(rc=dict(window_frames=3)), "sampler.window_frames: saved 2, now 3"),
        (dict(rc=dict(policy="rolling")), "cache.class: saved 'RingCache', now 'RollingCache'"),
        (dict(rc=dict(cache_dtype="bfloat16")), "cache.dtype: saved 'float32', now 'bfloat16'"),
        (
            dict(rc=dict(schedule=Schedule(steps=(1000, 250)))),
            "sampler.schedule.steps: saved [1000, 500], now [1000, 250]",
        ),
        (dict(rc=dict(schedule=Schedule(steps=(1000, 500), shift=3.0))), "sampler.schedule.shift: saved 5.0, now 3.0"),
        (dict(rc=dict(guidance_scale=2.0)), "sampler.guidance_scale: saved None, now 2.0"),
    ],
)
def test_load_refuses_other_settings_naming_the_difference(tmp_path, change, named):
    _, path = _saved(tmp_path)
    config = change.get("config", CFG)
    rc = R.RolloutConfig(
        **{
            **{
                f: getattr(RC, f)
                for f in (
                    "latent_height",
                    "latent_width",
                    "chunk_frames",
                    "window_frames",
                    "sink_frames",
                    "schedule",
                    "guidance_scale",
                    "policy",
                    "cache_dtype",
                )
            },
            **change.get("rc", {}),
        }
    )
    with pytest.raises(S.SessionError) as e:
        S.load(path, config, rc)
    assert named in str(e.value)
    # the same snapshot loads under its own settings
    assert int(S.load(path, CFG, RC).next_chunk) == 2


def test_from_session_refuses_other_settings_and_a_dilated_cache_of_another_spec(tmp_path):
    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=1, key=KEY)
    _chunks(st)
    other = R.RolloutConfig(H, W, chunk_frames=1, window_frames=4, sink_frames=1, schedule=RC.schedule)
    with pytest.raises(S.SessionError, match="window_frames: saved 2, now 4"):
        Stream.from_session(PARAMS, CFG, other, st.session())
    d = _dilated_stream(RC, 1)
    _chunks(d)
    S.save(str(tmp_path / "d"), d.session())
    spec = DilatedSpec(tokens_per_frame=2, chunk_frames=1, dilation=3, buckets=2)
    like = jax.eval_shape(lambda: DilatedCache.init(spec, 1, CFG.num_heads, CFG.head_dim, layers=CFG.num_layers))
    with pytest.raises(S.SessionError, match="cache.spec.dilation: saved 2, now 3"):
        S.load(str(tmp_path / "d"), CFG, RC, cache_like=like)
    with pytest.raises(S.SessionError, match="cache.class: saved 'DilatedCache', now 'RingCache'"):
        S.load(str(tmp_path / "d"), CFG, RC)


def test_manifest_and_files(tmp_path):
    st, path = _saved(tmp_path)
    assert sorted(os.listdir(path)) == [S.ARRAYS, S.MANIFEST]
    manifest = json.loads(open(os.path.join(path, S.MANIFEST)).read())
    assert manifest["format"] == S.FORMAT and manifest["next_chunk"] == 2 and manifest["key_impl"] == "threefry2x32"
    assert manifest["metadata"] == {"note": "x"} and S.read_metadata(path) == {"note": "x"}
    positions = manifest["tensors"]["cache/positions"]
    assert {k: positions[k] for k in ("dtype", "shape")} == {"dtype": "int32", "shape": [1, RC.spec(CFG).capacity]}
    assert len(positions["sha256"]) == 64 and len(manifest[S.MANIFEST_DIGEST]) == 64
    # the key round-trips as a typed key that draws the same noise
    loaded = S.load(path, CFG, RC)
    assert jnp.array_equal(jax.random.key_data(loaded.key), jax.random.key_data(KEY))


def test_extras_round_trip(tmp_path):
    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=1, key=KEY, history=False)  # only the caller's extras
    _chunks(st)
    extras = {
        "vae_decoder": {
            "caches": {"mid.res0.conv1": jnp.arange(6, dtype=jnp.bfloat16).reshape(1, 2, 3)},
            "first": jnp.asarray(False),
        },
        "ring": jnp.ones((2, 3), jnp.float32),
    }
    S.save(str(tmp_path / "s"), st.session(extras=extras))
    loaded = S.load(str(tmp_path / "s"), CFG, RC)
    assert jax.tree.structure(loaded.extras) == jax.tree.structure(extras)
    assert _bits(loaded.extras) == _bits(extras)
    assert loaded.extras["vae_decoder"]["caches"]["mid.res0.conv1"].dtype == jnp.bfloat16
    with pytest.raises(S.SessionError, match="without '/'"):
        st.session(extras={"a/b": jnp.ones(1)})


def test_save_is_atomic_and_never_overwrites_silently(tmp_path, monkeypatch):
    """A save that dies half way (the arrays file half written) leaves nothing at the path and no temporary; an
    existing path is refused without force, and force replaces only a session directory."""
    import safetensors.numpy

    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=1, key=KEY)
    _chunks(st)
    session = st.session()
    real = safetensors.numpy.save_file

    def dies(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        S.save(str(tmp_path / "s"), session)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(safetensors.numpy, "save_file", real)

    path = S.save(str(tmp_path / "s"), session)
    with pytest.raises(S.SessionError, match="already exists"):
        S.save(path, session)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="refusing to replace"):
        S.save(str(tmp_path / "other"), session, force=True)
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"
    _chunks(Stream.from_session(PARAMS, CFG, RC, session.fork(), num_chunks=1))
    S.save(path, session, force=True)  # a session directory may be replaced
    assert int(S.load(path, CFG, RC).next_chunk) == 1


def test_incomplete_or_corrupt_directories_are_refused(tmp_path):
    _, path = _saved(tmp_path)
    arrays = os.path.join(path, S.ARRAYS)
    data = open(arrays, "rb").read()
    with open(arrays, "wb") as f:
        f.write(data[: len(data) - 16])
    with pytest.raises(S.SessionError, match="truncated or corrupt"):
        S.load(path, CFG, RC)
    os.remove(arrays)
    with pytest.raises(S.SessionError, match="not a complete jaxkv session.*lacks arrays.safetensors"):
        S.load(path, CFG, RC)
    with pytest.raises(S.SessionError, match="not a complete jaxkv session"):
        S.load(str(tmp_path / "nothing"), CFG, RC)


def test_inconsistent_clock_is_refused(tmp_path):
    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=2, key=KEY)
    _chunks(st)
    bad = st.session().replace(next_chunk=jnp.asarray(5, jnp.int32))
    S.save(str(tmp_path / "s"), bad)
    with pytest.raises(S.SessionError, match="next_chunk is 5 but the cache has reserved 2 chunks"):
        S.load(str(tmp_path / "s"), CFG, RC)


def test_forks_diverge_and_survive_each_others_donated_steps():
    """Two forks of one history: stepping one (its buffers donated, so deleted) leaves the other and the original
    valid; a fork with another key diverges, a fork with the same key repeats the first fork's chunks."""
    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=2, key=KEY)
    _chunks(st)
    base = st.session()
    before = _bits(base)
    a, b, c = base.fork(), base.fork(), base.fork().replace(key=jax.random.key(99))
    sa = Stream.from_session(PARAMS, CFG, RC, a, num_chunks=2)
    xa = _chunks(sa)
    assert a.cache.k.is_deleted()  # the step donated fork a's buffers ...
    assert not b.cache.k.is_deleted() and not base.cache.k.is_deleted()
    xb = _chunks(Stream.from_session(PARAMS, CFG, RC, b, num_chunks=2))
    xc = _chunks(Stream.from_session(PARAMS, CFG, RC, c, num_chunks=2))
    assert [x.tobytes() for x in xa] == [x.tobytes() for x in xb]
    assert all(x.tobytes() != y.tobytes() for x, y in zip(xa, xc))
    assert _bits(base) == before
    # without copy the session shares the stream's buffers (and is invalidated by its next step)
    st2 = Stream(PARAMS, CFG, RC, CTX, num_chunks=2, key=KEY)
    next(st2)
    shared = st2.session(copy=False)
    next(st2)
    assert shared.cache.k.is_deleted()


@pytest.mark.parametrize("memory_kind", ["auto", None])
@pytest.mark.slow
def test_offload_and_reload_are_bit_identical(memory_kind):
    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=2, key=KEY)
    _chunks(st)
    s = st.session(extras={"ring": jnp.arange(4.0)})
    before = _bits(s)
    host = S.offload(s, memory_kind=memory_kind)
    assert host.on_host and s.cache.k.is_deleted()
    if memory_kind is None:
        assert isinstance(host.cache.k, np.ndarray)
    else:
        assert host.cache.k.sharding.memory_kind == S.host_memory_kind()
    assert _bits(host) == before
    with pytest.raises(S.SessionError, match="offloaded"):
        Stream.from_session(PARAMS, CFG, RC, host)
    back = S.reload(host)
    assert not back.on_host and _bits(back) == before
    assert back.cache.k.sharding.memory_kind == jax.devices()[0].default_memory().kind
    whole = _chunks(Stream(PARAMS, CFG, RC, CTX, num_chunks=4, key=KEY))
    tail = _chunks(Stream.from_session(PARAMS, CFG, RC, back, num_chunks=2))
    assert [x.tobytes() for x in whole[2:]] == [x.tobytes() for x in tail]


def test_failed_offload_raises_and_keeps_the_device_copy(monkeypatch):
    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=2, key=KEY)
    _chunks(st)
    s = st.session()
    before = _bits(s)
    real, calls = S._to_host, []

    def fails_third(x, kind):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: host memory exhausted")
        return real(x, kind)

    monkeypatch.setattr(S, "_to_host", fails_third)
    with pytest.raises(S.OffloadError, match="offload failed at array 2 of .*injected.*untouched"):
        S.offload(s)
    assert not any(x.is_deleted() for x in jax.tree.leaves(s.state))
    assert not s.on_host and _bits(s) == before
    monkeypatch.setattr(S, "_to_host", real)
    tail = _chunks(Stream.from_session(PARAMS, CFG, RC, s, num_chunks=1))
    whole = _chunks(Stream(PARAMS, CFG, RC, CTX, num_chunks=3, key=KEY))
    assert tail[0].tobytes() == whole[2].tobytes()


def test_bad_arguments():
    st = Stream(PARAMS, CFG, RC, CTX, num_chunks=1, key=KEY)
    with pytest.raises(S.SessionError, match="RolloutState"):
        S.Session.create(CFG, RC, (st.state.cache, st.state.cross), key=KEY, next_chunk=0)
    with pytest.raises(S.SessionError, match=">= 0"):
        S.Session.create(CFG, RC, st.state, key=KEY, next_chunk=-1)
    with pytest.raises(TypeError, match="Session"):
        Stream.from_session(PARAMS, CFG, RC, st.state)
    with pytest.raises(ValueError, match="positive int"):
        Stream.from_session(PARAMS, CFG, RC, st.session(), num_chunks=0)
    with pytest.raises(S.SessionError, match="not offloaded"):
        S.reload(st.session())
    with pytest.raises(S.SessionError, match="memory_kind"):
        S.offload(st.session(), memory_kind="device")


def test_a_consumed_session_is_named_as_consumed_not_as_a_deleted_buffer():
    stream = Stream(PARAMS, CFG, RC, CTX, num_chunks=2, key=jax.random.key(2))
    _chunks(stream)
    session = stream.session()
    kept = session.fork()
    next(Stream.from_session(PARAMS, CFG, RC, session, num_chunks=1))  # donates the session's buffers
    with pytest.raises(S.SessionError, match="the session was consumed.*session.fork"):
        Stream.from_session(PARAMS, CFG, RC, session, num_chunks=1)
    assert next(Stream.from_session(PARAMS, CFG, RC, kept, num_chunks=1)).shape[0] == 1  # a fork is its own


@pytest.mark.parametrize("which", ["context", "negative_context"])
def test_a_stream_refuses_a_non_finite_context_before_any_step(which):
    bad = CTX.at[0, 1, 2].set(jnp.nan)
    kw = {"context": bad} if which == "context" else {"context": CTX, "negative_context": bad.at[0, 0, 0].set(jnp.inf)}
    rc = (
        RC
        if which == "context"
        else R.RolloutConfig(
            H,
            W,
            chunk_frames=1,
            window_frames=2,
            sink_frames=1,
            schedule=Schedule(steps=(1000, 500)),
            guidance_scale=3.0,
        )
    )
    with pytest.raises(ValueError, match=f"{which} holds \\d non-finite value"):
        Stream(PARAMS, CFG, rc, num_chunks=1, key=jax.random.key(2), **kw)


def test_corrupted_tensor_bytes_are_refused_naming_the_tensor(tmp_path):
    """A flipped byte in the cache's data resumed silently before the manifest held checksums."""
    from safetensors.numpy import load_file, save_file

    _, path = _saved(tmp_path)
    file = os.path.join(path, S.ARRAYS)
    arrays = load_file(file)
    arrays["cache/k"] = arrays["cache/k"].copy()
    arrays["cache/k"].reshape(-1)[7] += 1.0  # same dtype and shape: only the checksum can tell
    save_file(arrays, file, metadata={"format": S.FORMAT})
    with pytest.raises(S.SessionError, match="tensor cache/k does not match the checksum"):
        S.load(path, CFG, RC)


@pytest.mark.parametrize("edit", ["next_chunk", "seed"])
def test_an_edited_manifest_is_refused(tmp_path, edit):
    """An edited next_chunk was ignored and an edited seed copied into the summary: the manifest is checksummed."""
    _, path = _saved(tmp_path)
    file = os.path.join(path, S.MANIFEST)
    manifest = json.loads(open(file).read())
    if edit == "next_chunk":
        manifest["next_chunk"] = 5
    else:
        manifest["metadata"]["seed"] = 7
    with open(file, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(S.SessionError, match="was changed after the session was saved"):
        S.load(path, CFG, RC)
    with pytest.raises(S.SessionError, match="was changed after the session was saved"):
        S.read_metadata(path)
