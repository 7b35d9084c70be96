"""Checks of `jaxkv.parallel` on 8 simulated CPU devices, run by tests/test_parallel.py in a fresh interpreter
(JAX fixes its device count when it initialises): ``python tests/parallel_checks.py CHECK [CHECK ...]`` prints
``OK CHECK`` for each check that passed and exits non-zero at the first failure.

Every sharded result is compared with the single-device `jaxkv.stream.Stream` on the same params, context and key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import warnings

import chex
import jax

if __name__ == "__main__":  # (tests/multiprocess_session.py imports this module on its own devices)
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import parallel as PL
from jaxkv import rollout as R
from jaxkv.compilation import compile_count
from jaxkv.models.wan import config as C
from jaxkv.models.wan import model as M
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream

CONFIG = C.preset("tiny")  # 4 heads, ffn 128: model axes of 1, 2, 4 divide it
PARAMS = M.init_params(CONFIG, jax.random.key(0))
CHUNKS = 3
TOL = dict(rtol=1e-5, atol=2e-5)  # f32: the tensor-parallel sums associate differently
COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(-start)?\(")


def rc_of(window_frames=4, guidance=None):
    return R.RolloutConfig(
        4,
        4,
        chunk_frames=1,
        window_frames=window_frames,
        sink_frames=1,
        schedule=Schedule(steps=(1000, 500)),
        guidance_scale=guidance,
    )


def contexts(batch):
    rng = np.random.default_rng(batch)
    return (
        rng.standard_normal((batch, 5, CONFIG.text_dim)).astype(np.float32),
        rng.standard_normal((batch, 3, CONFIG.text_dim)).astype(np.float32),
    )


_REFERENCE = {}


def reference(rc, batch):
    """Single-device chunks and final state (cache rows in rollout order)."""
    if (rc, batch) not in _REFERENCE:
        ctx, neg = contexts(batch)
        stream = Stream(
            PARAMS,
            CONFIG,
            rc,
            ctx,
            num_chunks=CHUNKS,
            key=jax.random.key(7),
            negative_context=neg if rc.guidance_scale is not None else None,
        )
        _REFERENCE[rc, batch] = ([np.asarray(x) for x in stream], jax.device_get(stream.state))
    return _REFERENCE[rc, batch]


def run_mesh(mesh, rc, batch, params=None):
    """Runs a MeshStream; checks one compilation, latents sharded on data and state shardings kept every step."""
    ctx, neg = contexts(batch)
    stream = PL.MeshStream(
        PARAMS if params is None else params,
        CONFIG,
        rc,
        ctx,
        mesh=mesh,
        num_chunks=CHUNKS,
        key=jax.random.key(7),
        negative_context=neg if rc.guidance_scale is not None else None,
    )
    want = PL.state_shardings(stream.state, mesh)
    before = compile_count(stream.step)
    xs = []
    for x in stream:
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, P(PL.DATA)), x.ndim), x.sharding
        for leaf, sharding in zip(jax.tree.leaves(stream.state), jax.tree.leaves(want), strict=True):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)
        xs.append(np.asarray(x))
    assert compile_count(stream.step) - before == 1, compile_count(stream.step) - before
    return xs, stream


def compare(mesh, rc, batch, params=None):
    ref_xs, ref_state = reference(rc, batch)
    xs, stream = run_mesh(mesh, rc, batch, params)
    for n, (a, b) in enumerate(zip(xs, ref_xs, strict=True)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"chunk {n}")
    assert not any(np.array_equal(xs[0], x) for x in xs[1:])  # the chunks differ: a real comparison
    # the state, rows mapped back to the rollout's order
    order = PL.session_order(batch, mesh.shape[PL.DATA], rc.guidance_scale is not None)
    cache = stream.state.cache
    np.testing.assert_array_equal(np.asarray(cache.positions), ref_state.cache.positions[order])
    np.testing.assert_allclose(np.asarray(cache.k), ref_state.cache.k[:, order], **TOL)
    np.testing.assert_allclose(np.asarray(stream.state.cross.v), ref_state.cross.v[:, order], **TOL)
    return stream


def largest_collectives(hlo: str) -> dict[str, int]:
    """{collective op: most elements of any result it produces} in a compiled HLO text."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        found = COLLECTIVE.search(line)
        if not found or "=" not in line[: found.start()]:
            continue
        result = line[line.index("=") + 1 : found.start()]
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", result)]
        out[found.group(1)] = max(out.get(found.group(1), 0), max(sizes, default=0))
    return out


def compiled(mesh, config, rc, batch):
    """(abstract state, compiled mesh step) lowered from shapes and shardings alone (nothing is run)."""
    shapes = jax.eval_shape(lambda: M.init_params(config, jax.random.key(0)))
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, PL.param_shardings(shapes, mesh)
    )
    ctx = jax.ShapeDtypeStruct((batch, 5, config.text_dim), np.float32)
    neg = None if rc.guidance_scale is None else jax.ShapeDtypeStruct((batch, 3, config.text_dim), np.float32)
    state = jax.eval_shape(lambda p, c, n: R.init_state(p, config, rc, c, n), params, ctx, neg)
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, PL.state_shardings(state, mesh)
    )
    replicated = NamedSharding(mesh, P())
    key_data = jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated)
    index = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
    return state, PL.mesh_step(mesh, config, rc).lower(params, state, key_data, index, None).compile()


# ------------------------------------------------------------------------------------------------ checks


def check_data_x_model():
    compare(PL.make_mesh(2, 4), rc_of(), 2)


def check_model_only():
    compare(PL.make_mesh(1, 4, jax.devices()[:4]), rc_of(), 1)


def check_one_device():
    # a 1 x 1 mesh: every sharding is equivalent, and the step must still compile once
    compare(PL.make_mesh(1, 1, jax.devices()[:1]), rc_of(), 1)


def check_data_only():
    compare(PL.make_mesh(2, 1, jax.devices()[:2]), rc_of(), 2)


def check_guided():
    # batch 2 with guidance = 4 sessions; each data group must hold its own cond + negative rows
    compare(PL.make_mesh(2, 4), rc_of(guidance=3.0), 2)


def check_noise():
    """Explicit noise [chunks, steps, batch, ...] instead of a key: the same chunks as one device."""
    mesh, rc, batch = PL.make_mesh(2, 4), rc_of(), 2
    ctx, _ = contexts(batch)
    noise = np.random.default_rng(3).standard_normal(rc.noise_shape(CONFIG, batch, CHUNKS)).astype(np.float32)
    want = [np.asarray(x) for x in Stream(PARAMS, CONFIG, rc, ctx, noise=noise)]
    stream = PL.MeshStream(PARAMS, CONFIG, rc, ctx, mesh=mesh, noise=noise)
    before = compile_count(stream.step)  # the step is shared with any key-driven stream of this mesh
    got = [np.asarray(x) for x in stream]
    assert len(got) == CHUNKS and compile_count(stream.step) - before == 1
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def check_hlo():
    """No collective moves a cache-sized array (no gather of the ring or the cross K/V), the donated state aliases
    the outputs, and per-device scratch grows with the window by far less than the device's cache shard (it is one
    layer's attention working set; 8 layers here)."""
    import dataclasses

    config = dataclasses.replace(CONFIG, num_layers=8)
    mesh = PL.make_mesh(2, 4)
    temps = []
    for window in (16, 64):
        state, exe = compiled(mesh, config, rc_of(window), 2)
        shard = state.cache.k.sharding.shard_shape(state.cache.k.shape)  # [layers, sessions, slots, heads, d]
        layer_shard = int(np.prod(shard[1:]))
        sizes = largest_collectives(exe.as_text())
        assert sizes.get("all-reduce", 0) > 0, sizes  # tensor parallel does communicate
        for op, elements in sizes.items():
            assert elements < layer_shard, (op, elements, layer_shard)
        assert "all-gather" not in sizes, sizes
        stats = exe.memory_analysis()
        state_bytes = sum(
            int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)
        )
        assert stats.alias_size_in_bytes >= state_bytes, (stats.alias_size_in_bytes, state_bytes)
        temps.append((stats.temp_size_in_bytes, 2 * int(np.prod(shard)) * 4))  # k + v shard bytes
    (temp_small, kv_small), (temp_big, kv_big) = temps
    assert temp_big - temp_small < (kv_big - kv_small) / 4, temps


def check_seq_hlo():
    """Ulysses (data=2, seq=2, model=2): the compiled step exchanges tokens for heads by all-to-all, no collective
    moves as much as one layer of a device's cache shard (the ring stays whole per head group, split over
    model x seq), and the donated state aliases the outputs."""
    import dataclasses

    config = dataclasses.replace(CONFIG, num_layers=8)
    mesh = PL.make_mesh(2, 2, seq=2)
    state, exe = compiled(mesh, config, rc_of(16), 2)
    shard = state.cache.k.sharding.shard_shape(state.cache.k.shape)  # [layers, sessions, slots, heads, d]
    assert shard[3] == CONFIG.num_heads // 4, shard  # heads split over model x seq
    cross = state.cross.k.sharding.shard_shape(state.cross.k.shape)
    assert cross[3] == CONFIG.num_heads // 4, cross
    layer_shard = int(np.prod(shard[1:]))
    hlo = exe.as_text()
    sizes = largest_collectives(hlo)
    print("seq_hlo collectives (most elements):", sizes, "cache layer shard:", layer_shard, flush=True)
    assert sizes.get("all-to-all", 0) > 0, sizes  # Ulysses: tokens <-> heads
    # inside the layer loop activations are exchanged (all-to-all), never gathered: an all-gather there would mean
    # the partitioner replicates tokens (e.g. projects v from all-gathered inputs) instead of the Ulysses layout
    in_loop = [line for line in hlo.splitlines() if "all-gather" in line and "/while/body/" in line]
    assert not in_loop, in_loop
    for op, elements in sizes.items():
        assert elements < layer_shard, (op, elements, layer_shard)
    stats = exe.memory_analysis()
    state_bytes = sum(
        int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)
    )
    assert stats.alias_size_in_bytes >= state_bytes, (stats.alias_size_in_bytes, state_bytes)


def check_loading():
    """A checkpoint loaded into its shards equals the params, each device holds only its slice, and the sharded
    rollout on it equals the single-device one."""
    from jaxkv.models.wan import checkpoint

    mesh = PL.make_mesh(2, 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        checkpoint.save(path, CONFIG, PARAMS)
        config, params = PL.load_sharded(path, mesh)
    assert config == CONFIG
    q = params["blocks"]["self_attn"]["q"]["kernel"]
    assert q.addressable_shards[0].data.shape == (CONFIG.num_layers, CONFIG.dim, CONFIG.dim // 4)
    o = params["blocks"]["self_attn"]["o"]["kernel"]
    assert o.addressable_shards[0].data.shape == (CONFIG.num_layers, CONFIG.dim // 4, CONFIG.dim)
    chex.assert_trees_all_equal(params, PARAMS)
    compare(mesh, rc_of(), 2, params)


def check_seq():
    """Ulysses on every axis: data x seq x model, seq alone, data x seq (4 heads, 4 tokens per chunk)."""
    compare(PL.make_mesh(2, 2, seq=2), rc_of(), 2)
    compare(PL.make_mesh(1, 1, jax.devices()[:4], seq=4), rc_of(), 1)
    compare(PL.make_mesh(2, 1, seq=4), rc_of(), 2)


def check_seq_guided():
    compare(PL.make_mesh(2, 2, seq=2), rc_of(guidance=3.0), 2)


def check_errors():
    mesh = PL.make_mesh(2, 4)
    ctx, _ = contexts(3)
    odd_tokens = R.RolloutConfig(2, 6, chunk_frames=1, window_frames=4, sink_frames=1, schedule=Schedule(steps=(1000,)))
    cases = [
        (lambda: PL.MeshStream(PARAMS, CONFIG, rc_of(), ctx, mesh=mesh, key=jax.random.key(0)), "batch 3"),
        (lambda: PL.make_mesh(1, 8), None),
        (
            lambda: PL.MeshStream(PARAMS, CONFIG, rc_of(), ctx[:1], mesh=PL.make_mesh(1, 8), key=jax.random.key(0)),
            "num_heads (4)",
        ),
        (lambda: PL.make_mesh(2, 2), "needs 4 devices"),
        (lambda: PL.make_mesh(2, 2, seq=4), "needs 16 devices"),
        (  # 4 heads cannot split over model 2 x seq 4
            lambda: PL.MeshStream(PARAMS, CONFIG, rc_of(), ctx[:1], mesh=PL.make_mesh(1, 2, seq=4), key=None),
            "model x seq axes (2 x 4)",
        ),
        (  # a 2 x 6 latent is 1 x 3 patches: 3 tokens per chunk cannot split over seq 2
            lambda: PL.check_mesh(PL.make_mesh(1, 1, jax.devices()[:2], seq=2), CONFIG, odd_tokens, 1),
            "chunk's 3 tokens",
        ),
    ]
    for make, words in cases:
        if words is None:
            make()
            continue
        try:
            make()
        except ValueError as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"accepted: expected an error about {words!r}")


def check_generate():
    """``jaxkv generate --mesh data=2,model=4`` and ``--mesh data=2,model=2,seq=2`` (with guidance, from a
    checkpoint read into its shards) write the latents of the same run on one device; a mesh that does not fit is
    a usage error before anything is written."""
    import json

    from jaxkv.generate import load_latents
    from jaxkv.generate.loop import main
    from jaxkv.models.wan import checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        checkpoint.save(ckpt, CONFIG, PARAMS)
        common = [
            "--checkpoint",
            ckpt,
            "--height",
            "4",
            "--width",
            "4",
            "--chunk-frames",
            "1",
            "--window-frames",
            "2",
            "--sink-frames",
            "1",
            "--num-chunks",
            "2",
            "--steps",
            "1000,500",
            "--batch",
            "2",
            "--guidance-scale",
            "3",
            "--no-video",
            "--no-progress",
        ]
        one, mesh = os.path.join(tmp, "one"), os.path.join(tmp, "mesh")
        assert main([*common, "--out", one]) == 0
        assert main([*common, "--out", mesh, "--mesh", "data=2,model=4"]) == 0
        np.testing.assert_allclose(load_latents(mesh), load_latents(one), **TOL)
        with open(os.path.join(mesh, "summary.json")) as f:
            summary = json.load(f)
        assert summary["mesh"] == {"data": 2, "seq": 1, "model": 4} and summary["compilations"] == 1, summary
        seq = os.path.join(tmp, "seq")  # Ulysses with data and model
        assert main([*common, "--out", seq, "--mesh", "data=2,model=2,seq=2"]) == 0
        np.testing.assert_allclose(load_latents(seq), load_latents(one), **TOL)
        with open(os.path.join(seq, "summary.json")) as f:
            summary = json.load(f)
        assert summary["mesh"] == {"data": 2, "seq": 2, "model": 2} and summary["compilations"] == 1, summary
        bad = os.path.join(tmp, "bad")
        assert main([*common, "--out", bad, "--mesh", "data=4,model=2"]) == 2  # batch 2 on data=4
        assert main([*common, "--out", bad, "--mesh", "data=1,model=2,seq=4"]) == 2  # 4 heads on model x seq = 8
        assert not os.path.exists(bad)


# ------------------------------------------------------------------------------------------------ save / resume


def stream_of(mesh, rc, batch, num_chunks):
    """The reference's stream (same context, key 7), on ``mesh`` or (None) on one device."""
    ctx, neg = contexts(batch)
    kw = dict(num_chunks=num_chunks, key=jax.random.key(7))
    kw["negative_context"] = neg if rc.guidance_scale is not None else None
    return (
        Stream(PARAMS, CONFIG, rc, ctx, **kw)
        if mesh is None
        else PL.MeshStream(PARAMS, CONFIG, rc, ctx, mesh=mesh, **kw)
    )


def logical_tensors(session, mesh):
    """{tensor name: host array} of a session, rows put back in `jaxkv.rollout`'s order with NumPy (the session's
    rows are in ``mesh``'s `session_order`; None: already in that order)."""
    from jaxkv import session_format as SF
    from jaxkv.parallel import checkpoint as CK

    named, _ = SF.session_tensors(session)
    out = {name: np.asarray(x) for name, x in named.items()}
    if mesh is not None:
        guided = session.settings["sampler"]["guidance_scale"] is not None
        order = PL.session_order(session.sessions // (2 if guided else 1), mesh.shape[PL.DATA], guided)
        undo = np.argsort(order)
        for name in out:
            if CK.rows_axis(name) is not None:
                out[name] = np.take(out[name], undo, axis=CK.rows_axis(name))
    return out


def assert_same_tensors(got, want):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def session_from_tensors(rc, tensors, key, next_chunk):
    """A single-device Session built from host tensors in rollout order (independently of the checkpoint code)."""
    from jaxkv import session as S
    from jaxkv.cache import Fp8Cache

    like = S.expected_cache(CONFIG, rc, tensors["cache/positions"].shape[0])
    ring = like.inner if isinstance(like, Fp8Cache) else like
    fields = {f: np.asarray(tensors[f"cache/{f}"]) for f in ("k", "v", "positions", "chunk_start")}
    if isinstance(like, Fp8Cache):  # the file holds FP8 K/V as their uint8 bytes
        fields["k"], fields["v"] = fields["k"].view(ring.k.dtype), fields["v"].view(ring.v.dtype)
    cache = type(ring)(**{f: jax.numpy.asarray(x) for f, x in fields.items()}, spec=ring.spec)
    if isinstance(like, Fp8Cache):
        scales = (jax.numpy.asarray(tensors[f"cache/{f}"]) for f in ("k_scale", "v_scale"))
        cache = Fp8Cache(cache, *scales, like.read_dtype)
    state = R.RolloutState(
        cache, M.CrossKV(jax.numpy.asarray(tensors["cross/k"]), jax.numpy.asarray(tensors["cross/v"]))
    )
    return S.Session.create(CONFIG, rc, state, key=key, next_chunk=next_chunk)


def assert_resumes_on_one_device(rc, loaded, rebuilt, ref_xs):
    """A session loaded on one device continues bit for bit as ``rebuilt`` (the same tensors put into a Session
    independently of the checkpoint code) and as the uninterrupted stream ``ref_xs`` (chunk 0 on) within TOL."""
    want = [np.asarray(x) for x in Stream.from_session(PARAMS, CONFIG, rc, rebuilt, num_chunks=CHUNKS - 1)]
    xs = [np.asarray(x) for x in Stream.from_session(PARAMS, CONFIG, rc, loaded, num_chunks=CHUNKS - 1)]
    for n, (a, b, c) in enumerate(zip(xs, want, ref_xs[1:], strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"one-device chunk {n + 1}")
        np.testing.assert_allclose(a, c, **TOL, err_msg=f"one-device chunk {n + 1} vs uninterrupted")


def run_resumed(stream):
    """(chunks as host arrays, programs compiled while running them)."""
    before = compile_count(stream.step)
    xs = [np.asarray(x) for x in stream]
    return xs, compile_count(stream.step) - before


def save_resume(guidance):
    """A stream saved after its first chunk on data=2,model=2 resumes everywhere `resumes_everywhere` checks. Each
    device's shard is written once (replicated copies skipped)."""
    from jaxkv.parallel import checkpoint as CK

    rc, batch = rc_of(guidance=guidance), 2
    m22 = PL.make_mesh(2, 2, jax.devices()[:4])
    session, saved, whole = saved_on_2x2(rc, batch, m22)
    groups = 2 if guidance is not None else 1  # with guidance a data group's rows are two runs of logical rows
    with tempfile.TemporaryDirectory() as tmp:
        path = CK.save(os.path.join(tmp, "s"), session, mesh=m22, metadata={"note": "x"})
        assert sorted(os.listdir(path)) == ["session.json", "shards-00000.safetensors"], os.listdir(path)
        manifest = CK.read_manifest(path)
        pieces = {}
        for piece in manifest["pieces"]:
            pieces.setdefault(piece["tensor"], []).append(piece)
        assert len(pieces["cache/k"]) == 4 * groups  # 4 distinct shards (data x model)
        assert len(pieces["cache/positions"]) == 2 * groups  # 2 distinct shards: model copies written once
        assert len(pieces["next_chunk"]) == 1 and manifest["next_chunk"] == 1
        resumes_everywhere(path, rc, batch, saved, whole, m22)


def saved_on_2x2(rc, batch, m22):
    """(session after chunk 0 on ``m22``, its tensors in rollout order, the uninterrupted 2x2 stream's chunks)."""
    whole = [np.asarray(x) for x in stream_of(m22, rc, batch, CHUNKS)]
    first = stream_of(m22, rc, batch, 1)
    assert np.array_equal(np.asarray(next(first)), whole[0])
    session = first.session(copy=False)
    return session, logical_tensors(session, m22), whole


def resumes_everywhere(path, rc, batch, saved, whole, m22):
    """The session saved at ``path`` (after chunk 0 of the 2x2 stream, tensors ``saved`` in rollout order, the
    uninterrupted 2x2 chunks ``whole``) resumes (a) on data=2,model=2 (``m22``): its chunks bit for bit, no new
    program; (b) on one device and (c) on data=1,model=4: its loaded state is the saved one bit for bit (rows in
    rollout order), its chunks are those of the same state continued on that layout from an independently built
    session, bit for bit, and the single-device stream's to f32 rounding (tensor parallel sums associate
    differently)."""
    from jaxkv.parallel import checkpoint as CK

    groups = 2 if rc.guidance_scale is not None else 1
    ref_xs, _ = reference(rc, batch)
    m14 = PL.make_mesh(1, 4, jax.devices()[4:])
    # (a) the same mesh shape
    s22 = CK.load(path, CONFIG, rc, mesh=m22)
    assert_same_tensors(logical_tensors(s22, m22), saved)
    xs, compiled = run_resumed(PL.MeshStream.from_session(PARAMS, CONFIG, rc, s22, mesh=m22, num_chunks=CHUNKS - 1))
    assert compiled == 0, compiled  # the 2x2 step compiled for the uninterrupted stream is reused
    for n, (a, b) in enumerate(zip(xs, whole[1:], strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"2x2 chunk {n + 1}")

    # (b) one device: a plain Session in rollout order
    s1 = CK.load(path, CONFIG, rc)
    assert_same_tensors(logical_tensors(s1, None), saved)
    assert all(len(x.devices()) == 1 for x in jax.tree.leaves(s1.state))
    same = session_from_tensors(rc, saved, jax.random.key(7), 1)
    assert_resumes_on_one_device(rc, s1, same, ref_xs)

    # (c) data=1, model=4
    s14 = CK.load(path, CONFIG, rc, mesh=m14)
    assert_same_tensors(logical_tensors(s14, m14), saved)
    k = s14.cache.k
    assert k.addressable_shards[0].data.shape == (CONFIG.num_layers, 2 * groups, k.shape[2], 1, CONFIG.head_dim)
    xs, compiled = run_resumed(PL.MeshStream.from_session(PARAMS, CONFIG, rc, s14, mesh=m14, num_chunks=CHUNKS - 1))
    assert compiled == 1, compiled
    other = CK.to_mesh(session_from_tensors(rc, saved, jax.random.key(7), 1), m14)
    want, compiled = run_resumed(PL.MeshStream.from_session(PARAMS, CONFIG, rc, other, mesh=m14, num_chunks=CHUNKS - 1))
    assert compiled == 0, compiled
    for n, (a, b, c) in enumerate(zip(xs, want, ref_xs[1:], strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"1x4 chunk {n + 1}")
        np.testing.assert_allclose(a, c, **TOL, err_msg=f"1x4 chunk {n + 1} vs uninterrupted")
    assert not np.array_equal(xs[0], xs[1])


def check_multiprocess_resume():
    """The session a two-process job saved on data=2,model=2 (tests/multiprocess_session.py: one shard file per
    process; its directory in $JAXKV_MULTIPROCESS_SESSION) holds the state this process's 2x2 stream reaches, bit
    for bit, and resumes everywhere `resumes_everywhere` checks."""
    from jaxkv.parallel import checkpoint as CK

    path = os.environ["JAXKV_MULTIPROCESS_SESSION"]
    assert sorted(os.listdir(path)) == ["session.json", "shards-00000.safetensors", "shards-00001.safetensors"]
    assert CK.read_manifest(path)["metadata"] == {"processes": 2}
    rc, batch = rc_of(guidance=3.0), 2
    m22 = PL.make_mesh(2, 2, jax.devices()[:4])
    _, saved, whole = saved_on_2x2(rc, batch, m22)
    resumes_everywhere(path, rc, batch, saved, whole, m22)


def check_save_resume():
    save_resume(None)


def check_save_resume_guided():
    save_resume(3.0)


def check_save_resume_exact():
    """Without tensor parallelism a mesh stream is the single-device stream bit for bit, and so is any resume:
    saved on data=2 (guided) and resumed on one device, and saved on one device (`jaxkv.session.save`, the
    single-device format) and resumed on data=2, the chunks are the uninterrupted single-device stream's exactly."""
    from jaxkv import session as S
    from jaxkv.parallel import checkpoint as CK

    rc, batch = rc_of(guidance=3.0), 2
    m21 = PL.make_mesh(2, 1, jax.devices()[:2])
    ref_xs, _ = reference(rc, batch)
    with tempfile.TemporaryDirectory() as tmp:
        first = stream_of(m21, rc, batch, 1)
        next(first)
        path = CK.save(os.path.join(tmp, "mesh"), first.session(copy=False), mesh=m21)
        resumed = Stream.from_session(PARAMS, CONFIG, rc, CK.load(path, CONFIG, rc), num_chunks=CHUNKS - 1)
        xs = [np.asarray(x) for x in resumed]
        one = stream_of(None, rc, batch, 1)
        next(one)
        path = S.save(os.path.join(tmp, "one"), one.session())
        s21 = CK.load(path, CONFIG, rc, mesh=m21)
        ys, _ = run_resumed(PL.MeshStream.from_session(PARAMS, CONFIG, rc, s21, mesh=m21, num_chunks=CHUNKS - 1))
    for n, (a, b, c) in enumerate(zip(xs, ys, ref_xs[1:], strict=True)):
        np.testing.assert_array_equal(a, c, err_msg=f"mesh-saved, one-device chunk {n + 1}")
        np.testing.assert_array_equal(b, c, err_msg=f"one-device-saved, mesh chunk {n + 1}")


def check_checkpoint_errors():
    """Other settings, an edited manifest, a corrupted or missing shard file, and a session not laid out on the
    mesh are refused with errors that say so."""
    import json
    import shutil

    from jaxkv import session as S
    from jaxkv.parallel import checkpoint as CK

    rc, batch = rc_of(), 2
    m22 = PL.make_mesh(2, 2, jax.devices()[:4])
    stream = stream_of(m22, rc, batch, 1)  # a fresh stream's session (before chunk 0): nothing to compile
    session = stream.session()

    def refused(make, words, kind=S.SessionError):
        try:
            make()
        except kind as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"accepted: expected an error about {words!r}")

    with tempfile.TemporaryDirectory() as tmp:
        path = CK.save(os.path.join(tmp, "s"), session, mesh=m22)
        refused(lambda: CK.save(path, session, mesh=m22), "already exists")
        CK.save(path, session, mesh=m22, force=True)  # replaces a session directory
        refused(lambda: CK.load(path, CONFIG, rc_of(window_frames=3), mesh=m22), "window_frames")
        refused(lambda: S.load(path, CONFIG, rc), "not a complete jaxkv session")
        for change in ("manifest", "shard", "missing"):
            bad = os.path.join(tmp, change)
            shutil.copytree(path, bad)
            if change == "manifest":
                with open(os.path.join(bad, "session.json")) as f:
                    manifest = json.load(f)
                manifest["next_chunk"] = 5
                with open(os.path.join(bad, "session.json"), "w") as f:
                    json.dump(manifest, f)
                refused(lambda bad=bad: CK.load(bad, CONFIG, rc, mesh=m22), "changed after")
            elif change == "shard":
                file = os.path.join(bad, "shards-00000.safetensors")
                data = bytearray(open(file, "rb").read())
                data[-3] ^= 0xFF
                open(file, "wb").write(bytes(data))
                refused(lambda bad=bad: CK.load(bad, CONFIG, rc), "checksum")
                refused(
                    lambda bad=bad: CK.load(bad, CONFIG, rc, mesh=PL.make_mesh(1, 4, jax.devices()[:4])), "checksum"
                )
            else:
                os.remove(os.path.join(bad, "shards-00000.safetensors"))
                refused(lambda bad=bad: CK.load(bad, CONFIG, rc, mesh=m22), "no shards-")
        refused(lambda: CK.load(path, CONFIG, rc, mesh=PL.make_mesh(4, 2)), "batch 2", ValueError)  # before a read
        one = CK.load(path, CONFIG, rc)
        refused(
            lambda: PL.MeshStream.from_session(PARAMS, CONFIG, rc, one, mesh=m22, num_chunks=1),
            "not laid out",
            ValueError,
        )


def write_schedules(tmp):
    """Writes contexts a.npy, b.npy, neg.npy (5 x text_dim, seed 5) and prompt schedules ab.json (a, then b from
    chunk 1), a.json and b.json into ``tmp``."""
    import json

    rng = np.random.default_rng(5)
    for name in ("a", "b", "neg"):
        np.save(os.path.join(tmp, f"{name}.npy"), rng.standard_normal((5, CONFIG.text_dim)).astype(np.float32))
    for name, entries in (("ab", [(0, "a"), (1, "b")]), ("a", [(0, "a")]), ("b", [(0, "b")])):
        with open(os.path.join(tmp, f"{name}.json"), "w") as f:
            json.dump([{"chunk": c, "context": f"{e}.npy"} for c, e in entries], f)


def check_generate_save_resume():
    """``jaxkv generate --mesh data=2,model=4 --save-state`` after one chunk, then ``--resume``: on the same mesh the
    continuation is the uninterrupted mesh run's next chunk bit for bit; on ``data=4,model=2`` and on one device
    it is that chunk to f32 rounding (generate uses every device: 8 here, so batch 4). ``--prompt-schedule`` on a
    mesh, and across a mesh save / resume on another mesh shape, gives the single-device run's chunks."""
    import json

    from jaxkv.generate import load_latents
    from jaxkv.generate.loop import main
    from jaxkv.models.wan import checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        checkpoint.save(ckpt, CONFIG, PARAMS)
        common = ["--height", "4", "--width", "4", "--chunk-frames", "1", "--window-frames", "2"]
        common += ["--sink-frames", "1", "--steps", "1000,500", "--batch", "4", "--guidance-scale", "3"]
        common += ["--checkpoint", ckpt, "--no-video", "--no-progress"]
        whole, first, state = (os.path.join(tmp, n) for n in ("whole", "first", "state"))
        assert main([*common, "--num-chunks", "2", "--out", whole, "--mesh", "data=2,model=4"]) == 0
        assert (
            main([*common, "--num-chunks", "1", "--out", first, "--mesh", "data=2,model=4", "--save-state", state]) == 0
        )
        assert any(f.startswith("shards-") for f in os.listdir(state)), os.listdir(state)
        want = load_latents(whole)
        np.testing.assert_array_equal(load_latents(first), want[:, :1])
        for name, mesh in (
            ("same", ["--mesh", "data=2,model=4"]),
            ("other", ["--mesh", "data=4,model=2"]),
            ("one", []),
        ):
            out = os.path.join(tmp, name)
            assert (
                main(["--resume", state, "--num-chunks", "1", "--out", out, "--no-video", "--no-progress", *mesh]) == 0
            )
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
            assert summary["first_chunk"] == 1, summary
            if name == "same":
                np.testing.assert_array_equal(load_latents(out), want[:, 1:])
            else:
                np.testing.assert_allclose(load_latents(out), want[:, 1:], **TOL)
        # a prompt schedule on the mesh (a switch at chunk 1), and across a resume: the single-device run's chunks
        write_schedules(tmp)
        common += ["--negative-context", os.path.join(tmp, "neg.npy")]
        sched = ["--prompt-schedule", os.path.join(tmp, "ab.json"), "--num-chunks", "2"]
        one, mesh = os.path.join(tmp, "sched_one"), os.path.join(tmp, "sched_mesh")
        assert main([*common, *sched, "--out", one]) == 0
        assert main([*common, *sched, "--out", mesh, "--mesh", "data=2,model=4"]) == 0
        want = load_latents(one)
        assert not np.allclose(want[:, 1:], load_latents(whole)[:, 1:], **TOL)  # the switch changed chunk 1
        np.testing.assert_allclose(load_latents(mesh), want, **TOL)
        first, state = os.path.join(tmp, "sched_first"), os.path.join(tmp, "sched_state")
        argv = [*common, "--prompt-schedule", os.path.join(tmp, "a.json"), "--num-chunks", "1", "--out", first]
        assert main([*argv, "--mesh", "data=2,model=4", "--save-state", state]) == 0
        out = os.path.join(tmp, "sched_resumed")
        argv = ["--resume", state, "--prompt-schedule", os.path.join(tmp, "b.json"), "--num-chunks", "1"]
        assert main([*argv, "--out", out, "--no-video", "--no-progress", "--mesh", "data=4,model=2"]) == 0
        np.testing.assert_allclose(load_latents(out), want[:, 1:], **TOL)


def switched_chunks(mesh, rc, batch, context, negative_context):
    """(chunks, stream, twin) of the reference's stream (`stream_of`; ``mesh`` None: one device, else a
    `MeshStream`) switched to ``context`` / ``negative_context`` after chunk 0 (`Stream.switch_prompt`), and
    ``twin`` its fork taken before the switch (not yet stepped further); the state a switch returns runs on the
    step's program (no recompile)."""
    stream = stream_of(mesh, rc, batch, CHUNKS)
    xs = [np.asarray(next(stream))]
    twin = stream.fork()
    stream.switch_prompt(context, negative_context)
    before = compile_count(stream.step)
    xs += [np.asarray(x) for x in stream]
    assert compile_count(stream.step) == before, (compile_count(stream.step), before)
    return xs, stream, twin


def check_switch():
    """A prompt switch after chunk 0 (guided, batch 2) of a `MeshStream` on data=2,model=2 gives the single-device
    `jaxkv.stream.Stream`'s chunks to f32 rounding, and on data=2,model=1 bit for bit; one program for the switch
    and the step is not recompiled by it; a fork taken before the switch goes on unswitched, as the uninterrupted
    stream, on the step's program; a context of the wrong batch is refused before the state changes."""
    rc, batch = rc_of(guidance=3.0), 2
    ctx, neg = contexts(batch)
    other = np.random.default_rng(11).standard_normal(ctx.shape).astype(np.float32)

    want, _, _ = switched_chunks(None, rc, batch, other, neg)
    unswitched, _ = reference(rc, batch)
    assert not np.allclose(want[1], unswitched[1], **TOL)  # the switch changes the next chunk
    m22 = PL.make_mesh(2, 2, jax.devices()[:4])
    got, stream, twin = switched_chunks(m22, rc, batch, other, neg)
    assert compile_count(PL.mesh_switch(m22, CONFIG, rc, True)) == 1
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"2x2 chunk {n}")
    before = compile_count(twin.step)
    for n, x in enumerate(twin):  # the fork never switched: the uninterrupted stream's chunks 1..
        np.testing.assert_allclose(np.asarray(x), unswitched[n + 1], **TOL, err_msg=f"fork chunk {n + 1}")
    assert compile_count(twin.step) == before  # the fork's copied state runs on the step's program
    try:
        stream.switch_prompt(other[:1], neg[:1])
    except ValueError as e:
        assert "the new context has 2 sessions but the state has 4" in str(e), str(e)
    else:
        raise AssertionError("a context of batch 1 was accepted")
    assert not any(x.is_deleted() for x in jax.tree.leaves(stream.state))
    with warnings.catch_warnings(record=True) as caught:  # the deprecated shim: the stream itself
        warnings.simplefilter("always")
        assert PL.MeshSwitchableStream(stream) is stream
    assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught
    m21 = PL.make_mesh(2, 1, jax.devices()[4:6])
    got, _, _ = switched_chunks(m21, rc, batch, other, neg)
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"data=2 chunk {n}")
    # one row per data group (no guidance): the new cross K/V are projected for the whole batch, as one device does
    rc = rc_of()
    want, _, _ = switched_chunks(None, rc, batch, other, None)
    got, _, _ = switched_chunks(m21, rc, batch, other, None)
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"data=2, one row per group, chunk {n}")


# ------------------------------------------------------------------------------------------------ dilated layers


def rc_dilated(every, guidance=None):
    """``dilated_every`` = 1 (an all-dilated `DilatedCache`) or k >= 2 (a `MixedCache`): dilation 2, 2 buckets,
    one-frame chunks, a dense window of 2 frames (+ 1 sink frame when there are dense layers)."""
    return R.RolloutConfig(
        4,
        4,
        chunk_frames=1,
        window_frames=2,
        sink_frames=0 if every == 1 else 1,
        schedule=Schedule(steps=(1000, 500)),
        guidance_scale=guidance,
        dilated_every=every,
        dilation=2,
        buckets=2,
    )


def cache_rows(cache, order=None):
    """{tensor name: host array} of a cache of any class (a `MixedCache`: both stacks), rows put back in
    `jaxkv.rollout`'s order when ``order`` (a mesh's `session_order`) is given."""
    from jaxkv import session_format as SF
    from jaxkv.parallel import checkpoint as CK

    out = {name: np.asarray(x) for name, x in SF.cache_tensors(cache).items()}
    if order is not None:
        out = {name: np.take(x, np.argsort(order), axis=CK.rows_axis(name)) for name, x in out.items()}
    return out


def compare_dilated(mesh, rc, batch):
    """As `compare`, for a dilated or mixed cache: chunks to TOL, every stack's positions exact and K/V to TOL."""
    ref_xs, ref_state = reference(rc, batch)
    xs, stream = run_mesh(mesh, rc, batch)
    assert type(stream.state.cache) is type(ref_state.cache), (type(stream.state.cache), type(ref_state.cache))
    for n, (a, b) in enumerate(zip(xs, ref_xs, strict=True)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"chunk {n}")
    assert not any(np.array_equal(xs[0], x) for x in xs[1:])
    order = PL.session_order(batch, mesh.shape[PL.DATA], rc.guidance_scale is not None)
    got, want = cache_rows(stream.state.cache, order), cache_rows(ref_state.cache)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        if name.endswith(("positions", "chunk_start")):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        else:
            np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=name)
    np.testing.assert_allclose(np.asarray(stream.state.cross.v), ref_state.cross.v[:, order], **TOL)
    return stream


def check_dilated():
    """Dilated layers on data=2,model=2: all dilated (k = 1) and mixed (k = 2, also guided) equal the single-device
    stream chunk by chunk, compile once and keep the state shardings (heads split on model); mixed on
    data=2,model=2,seq=2 (Ulysses) too, and on data=2 bit for bit. Each stack of the mixed cache is sharded as a
    ring cache is."""
    from jaxkv.cache import DilatedCache, MixedCache

    m22 = PL.make_mesh(2, 2, jax.devices()[:4])
    stream = compare_dilated(m22, rc_dilated(1), 2)
    assert isinstance(stream.state.cache, DilatedCache)
    assert stream.state.cache.k.addressable_shards[0].data.shape[1:4:2] == (1, CONFIG.num_heads // 2)
    for guidance in (None, 3.0):
        stream = compare_dilated(m22, rc_dilated(2, guidance), 2)
        cache = stream.state.cache
        assert isinstance(cache, MixedCache)
        for part in (cache.dense, cache.dilated):
            shard = part.k.addressable_shards[0].data.shape  # [layers, sessions, capacity, heads, head_dim]
            assert shard[1] == part.k.shape[1] // 2 and shard[3] == CONFIG.num_heads // 2, shard
            assert part.positions.sharding.is_equivalent_to(NamedSharding(m22, P(PL.DATA)), 2)
    compare_dilated(PL.make_mesh(2, 2, seq=2), rc_dilated(2), 2)
    # without tensor parallelism nothing is summed differently: data=2 is the single-device stream bit for bit
    xs, _ = run_mesh(PL.make_mesh(2, 1, jax.devices()[:2]), rc_dilated(2), 2)
    for n, (a, b) in enumerate(zip(xs, reference(rc_dilated(2), 2)[0], strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"data=2 chunk {n}")


def check_dilated_save_resume():
    """A mixed (k = 2, guided) stream saved on data=2,model=2 after its first chunk resumes on one device: the loaded
    state is the saved one bit for bit (rows in rollout order), its chunks are those of the same state continued
    from an independently built session bit for bit and the uninterrupted single-device stream's to TOL; it also
    resumes on the same mesh, bit for bit with the uninterrupted mesh stream. A prompt switch on the mesh equals
    the single-device `jaxkv.stream.Stream`'s."""
    from jaxkv import session as S
    from jaxkv import session_format as SF
    from jaxkv.parallel import checkpoint as CK

    rc, batch = rc_dilated(2, 3.0), 2
    m22 = PL.make_mesh(2, 2, jax.devices()[:4])
    whole = [np.asarray(x) for x in stream_of(m22, rc, batch, CHUNKS)]
    ref_xs, _ = reference(rc, batch)
    first = stream_of(m22, rc, batch, 1)
    assert np.array_equal(np.asarray(next(first)), whole[0])
    session = first.session(copy=False)
    saved = logical_tensors(session, m22)
    assert "cache/dense/k" in saved and "cache/dilated/k" in saved, sorted(saved)
    with tempfile.TemporaryDirectory() as tmp:
        path = CK.save(os.path.join(tmp, "s"), session, mesh=m22)
        assert CK.read_manifest(path)["cache_class"] == "MixedCache"
        s1 = CK.load(path, CONFIG, rc)
        assert_same_tensors(logical_tensors(s1, None), saved)
        named = {n: jax.numpy.asarray(saved[n]) for n in saved if n.startswith("cache/")}
        cache = SF.cache_from(S.expected_cache(CONFIG, rc, 2 * batch), named)
        state = R.RolloutState(
            cache, M.CrossKV(jax.numpy.asarray(saved["cross/k"]), jax.numpy.asarray(saved["cross/v"]))
        )
        same = S.Session.create(CONFIG, rc, state, key=jax.random.key(7), next_chunk=1)
        assert_resumes_on_one_device(rc, s1, same, ref_xs)
        s22 = CK.load(path, CONFIG, rc, mesh=m22)
        assert_same_tensors(logical_tensors(s22, m22), saved)
        xs, compiled = run_resumed(PL.MeshStream.from_session(PARAMS, CONFIG, rc, s22, mesh=m22, num_chunks=CHUNKS - 1))
        assert compiled == 0, compiled
        for n, (a, b) in enumerate(zip(xs, whole[1:], strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"2x2 chunk {n + 1}")

    ctx, neg = contexts(batch)
    other = np.random.default_rng(11).standard_normal(ctx.shape).astype(np.float32)

    want = switched_chunks(None, rc, batch, other, neg)[0]
    assert not np.allclose(want[1], ref_xs[1], **TOL)  # the switch changes the next chunk
    for n, (a, b) in enumerate(zip(switched_chunks(m22, rc, batch, other, neg)[0], want, strict=True)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"switched chunk {n}")


# ------------------------------------------------------------------------------------------------ given latents


def check_commit():
    """Given latents committed on the mesh (`MeshStream.commit`: 2 chunks) and continued give the single-device
    stream's chunks after committing the same latents: plain on data=2,model=4, guided with a mixed cache on
    data=2,model=2 and on data=2,model=2,seq=2; one commit program, the state keeps its shardings; bad latents are
    refused before the state changes."""
    batch = 2
    for mesh, rc in (
        (PL.make_mesh(2, 4), rc_of()),
        (PL.make_mesh(2, 2, jax.devices()[:4]), rc_dilated(2, 3.0)),
        (PL.make_mesh(2, 2, seq=2), rc_of(guidance=3.0)),
    ):
        given = np.random.default_rng(4).standard_normal(rc.chunk_shape(CONFIG, batch)).astype(np.float32)
        given = np.concatenate([given, 2 * given], axis=1)  # 2 chunks
        one = stream_of(None, rc, batch, CHUNKS)
        one.commit(given)
        want_commit = cache_rows(one.state.cache)
        want = [np.asarray(x) for x in one]
        ref_xs, _ = reference(rc, batch)
        assert not np.allclose(want[0], ref_xs[2], **TOL)  # committing changed what follows
        stream = stream_of(mesh, rc, batch, CHUNKS)
        shardings = PL.state_shardings(stream.state, mesh)
        before = compile_count(PL.mesh_commit(mesh, CONFIG, rc))
        stream.commit(given)
        assert compile_count(PL.mesh_commit(mesh, CONFIG, rc)) - before == 1
        assert stream.index == stream.start == 2
        for leaf, sharding in zip(jax.tree.leaves(stream.state), jax.tree.leaves(shardings), strict=True):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)
        order = PL.session_order(batch, mesh.shape[PL.DATA], rc.guidance_scale is not None)
        committed = cache_rows(stream.state.cache, order)  # before any chunk is generated: the commit alone
        got = [np.asarray(x) for x in stream]
        for name, x in committed.items():
            assert_close = np.testing.assert_array_equal if x.dtype == np.int32 else np.testing.assert_allclose
            assert_close(x, want_commit[name], err_msg=name, **({} if x.dtype == np.int32 else TOL))
        for n, (a, b) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(a, b, **TOL, err_msg=f"{dict(mesh.shape)} chunk {n}")
    fresh = stream_of(PL.make_mesh(2, 4), rc_of(), batch, CHUNKS)
    for bad, words in ((given[:1], "[batch, n * chunk_frames"), (given * np.nan, "non-finite")):
        try:
            fresh.commit(bad)
        except ValueError as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"accepted: expected an error about {words!r}")
    assert fresh.index == 0 and not any(x.is_deleted() for x in jax.tree.leaves(fresh.state))


def check_generate_dilated_given():
    """``jaxkv generate --mesh`` with ``--dilated-every 2`` (a mixed cache, guided) and with ``--image`` (the
    frames encoded by the tiny random VAE and committed on the mesh) write the latents of the same run on one
    device, one compiled step each."""
    import json

    from PIL import Image

    from jaxkv.generate import load_latents
    from jaxkv.generate.loop import main

    with tempfile.TemporaryDirectory() as tmp:
        common = ["--random-weights", "--height", "4", "--width", "4", "--chunk-frames", "1", "--window-frames", "2"]
        common += ["--sink-frames", "1", "--steps", "1000,500", "--batch", "2", "--guidance-scale", "3"]
        common += ["--num-chunks", "3", "--no-video", "--no-progress"]
        picture = np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        png = os.path.join(tmp, "given.png")
        Image.fromarray(picture).save(png)
        runs = {
            "dilated": ["--dilated-every", "2", "--dilation", "2", "--buckets", "2"],
            "image": ["--image", png],
        }
        for name, extra in runs.items():
            one, mesh = os.path.join(tmp, f"{name}_one"), os.path.join(tmp, f"{name}_mesh")
            assert main([*common, *extra, "--out", one]) == 0
            assert main([*common, *extra, "--out", mesh, "--mesh", "data=2,model=4"]) == 0
            np.testing.assert_allclose(load_latents(mesh), load_latents(one), **TOL, err_msg=name)
            with open(os.path.join(mesh, "summary.json")) as f:
                summary = json.load(f)
            assert summary["mesh"] == {"data": 2, "seq": 1, "model": 4} and summary["compilations"] == 1, summary
            if name == "dilated":
                assert summary["dilated_every"] == 2, summary
            else:
                assert summary["first_chunk"] > 0 and summary["given"]["kind"] == "image", summary


def check_scan():
    """`mesh_rollout` (the scan rollout) on data=2,model=2 (and guided; and data=2,seq=2,model=2 guided) equals
    `jaxkv.rollout.rollout` on one device (latents and final state, rows mapped back; TOL), equals the MeshStream on
    the same mesh, continues its state at a chunk offset as one device does, and compiles once; on data=2,model=1
    (guided) it equals one device and the MeshStream bit for bit; explicit noise as one device."""
    from jaxkv.compilation import count_compiles

    key = jax.random.key(7)
    for mesh, guidance, exact in (
        (PL.make_mesh(2, 2, jax.devices()[:4]), None, False),
        (PL.make_mesh(2, 2, jax.devices()[:4]), 3.0, False),
        (PL.make_mesh(2, 1, jax.devices()[:2]), 3.0, True),
        (PL.make_mesh(2, 2, seq=2), 3.0, False),  # Ulysses inside the scan
    ):
        rc, batch = rc_of(guidance=guidance), 2
        ctx, neg = contexts(batch)
        neg = neg if guidance is not None else None
        order = PL.session_order(batch, mesh.shape[PL.DATA], guidance is not None)
        same = (
            np.testing.assert_array_equal if exact else lambda a, b, **kw: np.testing.assert_allclose(a, b, **TOL, **kw)
        )
        want = R.jit_rollout(PARAMS, CONFIG, rc, ctx, num_chunks=CHUNKS, key=key, negative_context=neg)
        want_next = R.jit_rollout(
            PARAMS, CONFIG, rc, None, num_chunks=CHUNKS, key=key, state=want.state, first_chunk=CHUNKS
        )
        run = PL.mesh_rollout_program(mesh, CONFIG, rc, CHUNKS)
        with count_compiles(run) as new:
            got = PL.mesh_rollout(PARAMS, CONFIG, rc, ctx, mesh=mesh, num_chunks=CHUNKS, key=key, negative_context=neg)
            assert got.latents.sharding.is_equivalent_to(NamedSharding(mesh, P(PL.DATA)), got.latents.ndim)
            latents = np.asarray(got.latents)
            same(latents, np.asarray(want.latents), err_msg=str(mesh.shape))
            frames = latents.reshape(batch, CHUNKS, -1)
            assert not any(np.array_equal(frames[:, 0], frames[:, n]) for n in range(1, CHUNKS))  # chunks differ
            for leaf, sharding in zip(
                jax.tree.leaves(got.state), jax.tree.leaves(PL.state_shardings(got.state, mesh)), strict=True
            ):
                assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)
            state, ref = jax.device_get(got.state), jax.device_get(want.state)
            np.testing.assert_array_equal(state.cache.positions, ref.cache.positions[order])
            same(state.cache.k, ref.cache.k[:, order])
            same(state.cache.v, ref.cache.v[:, order])
            same(state.cross.k, ref.cross.k[:, order])
            # continued at a traced chunk offset: the same program
            after = PL.mesh_rollout(
                PARAMS, CONFIG, rc, None, mesh=mesh, num_chunks=CHUNKS, key=key, state=got.state, first_chunk=CHUNKS
            )
            same(np.asarray(after.latents), np.asarray(want_next.latents))
            same(np.asarray(after.state.cache.k), np.asarray(want_next.state.cache.k)[:, order])
            assert new() == 1, new()
        # the MeshStream on the same mesh, same key: the same chunks
        stream = PL.MeshStream(PARAMS, CONFIG, rc, ctx, mesh=mesh, num_chunks=CHUNKS, key=key, negative_context=neg)
        chunks = np.concatenate([np.asarray(x) for x in stream], axis=1)
        same(latents, chunks)
        same(np.asarray(stream.state.cache.k), state.cache.k)
    # explicit noise (batch order) instead of a key, on data=2,model=2
    mesh, rc = PL.make_mesh(2, 2, jax.devices()[:4]), rc_of()
    ctx, _ = contexts(2)
    noise = np.random.default_rng(3).standard_normal(rc.noise_shape(CONFIG, 2, CHUNKS)).astype(np.float32)
    want = R.jit_rollout(PARAMS, CONFIG, rc, ctx, num_chunks=CHUNKS, noise=noise)
    got = PL.mesh_rollout(PARAMS, CONFIG, rc, ctx, mesh=mesh, num_chunks=CHUNKS, noise=noise)
    np.testing.assert_allclose(np.asarray(got.latents), np.asarray(want.latents), **TOL)


def check_scan_grad():
    """The gradient of a loss of `mesh_rollout_program`'s latents on data=2 (fresh state from the sharded params, so
    the cross K/V's path counts too) equals the single-device gradient of `jaxkv.rollout.rollout` (same scale-relative
    tolerance as tests/helpers/gradients.py); every parameter gets a non-zero gradient."""
    import jax.numpy as jnp

    mesh, rc, batch, key = PL.make_mesh(2, 1, jax.devices()[:2]), rc_of(), 2, jax.random.key(7)
    ctx, _ = contexts(batch)
    weights = np.random.default_rng(5).standard_normal((batch, CHUNKS * rc.chunk_frames, 4, 4, CONFIG.in_dim))
    weights = weights.astype(np.float32)

    def one_device(params):
        return jnp.sum(R.rollout(params, CONFIG, rc, ctx, num_chunks=CHUNKS, key=key).latents * weights)

    run = PL.mesh_rollout_program(mesh, CONFIG, rc, CHUNKS)
    replicated = NamedSharding(mesh, P())
    key_data = PL.put_global(jax.random.key_data(key), replicated)
    first = PL.put_global(np.int32(0), replicated)

    def on_mesh(params):
        state = PL.init_state(params, CONFIG, rc, mesh, ctx)
        return jnp.sum(run(params, state, key_data, first, None).latents * weights)

    v0, g0 = jax.jit(jax.value_and_grad(one_device))(PARAMS)
    v1, g1 = jax.value_and_grad(on_mesh)(PL.shard_params(PARAMS, mesh))
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0))
    assert scale > 0
    assert jax.tree.structure(g1) == jax.tree.structure(g0)
    for (path, a), b in zip(jax.tree.leaves_with_path(g0), jax.tree.leaves(g1), strict=True):
        assert np.abs(np.asarray(a)).max() > 0, path
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, rtol=0, err_msg=str(path))


def check_scan_errors():
    """`mesh_rollout` refuses, before anything runs, what does not fit the mesh or the rollout."""
    import pytest

    mesh, rc, key = PL.make_mesh(2, 2, jax.devices()[:4]), rc_of(), jax.random.key(7)
    ctx, _ = contexts(2)
    kw = dict(mesh=mesh, num_chunks=CHUNKS)
    with pytest.raises(ValueError, match="not divisible by the mesh's data axis"):
        PL.mesh_rollout(PARAMS, CONFIG, rc, contexts(3)[0], key=key, **kw)
    with pytest.raises(ValueError, match="exactly one of key"):
        PL.mesh_rollout(PARAMS, CONFIG, rc, ctx, **kw)
    with pytest.raises(ValueError, match="noise must be"):
        PL.mesh_rollout(PARAMS, CONFIG, rc, ctx, noise=np.zeros((CHUNKS, 2, 1, 1, 4, 4, 16), np.float32), **kw)
    with pytest.raises(ValueError, match="first_chunk"):
        PL.mesh_rollout(PARAMS, CONFIG, rc, ctx, key=key, first_chunk=-1, **kw)
    with pytest.raises(ValueError, match="num_chunks"):
        PL.mesh_rollout(PARAMS, CONFIG, rc, ctx, key=key, mesh=mesh, num_chunks=0)
    one_device = R.init_state(PARAMS, CONFIG, rc, ctx)
    with pytest.raises(ValueError, match="not laid out on this mesh"):
        PL.mesh_rollout(PARAMS, CONFIG, rc, None, key=key, state=one_device, **kw)
    with pytest.raises(ValueError, match="exactly one of a context"):
        PL.mesh_rollout(PARAMS, CONFIG, rc, ctx, key=key, state=one_device, **kw)


def check_scan_dilated_hlo():
    """`mesh_rollout` with a mixed dense/dilated cache (dilated_every=2, guided) on data=2,model=2 equals
    `jaxkv.rollout.rollout` on one device (every stack's positions exact, K/V and latents to TOL); the compiled
    programs, per chunk (`mesh_step`) and scanned, of a ring and of a mixed cache gather no cache
    (`assert_moves_no_cache_layer`)."""
    mesh, rc, batch, key = PL.make_mesh(2, 2, jax.devices()[:4]), rc_dilated(2, guidance=3.0), 2, jax.random.key(7)
    ctx, neg = contexts(batch)
    want = R.jit_rollout(PARAMS, CONFIG, rc, ctx, num_chunks=CHUNKS, key=key, negative_context=neg)
    got = PL.mesh_rollout(PARAMS, CONFIG, rc, ctx, mesh=mesh, num_chunks=CHUNKS, key=key, negative_context=neg)
    np.testing.assert_allclose(np.asarray(got.latents), np.asarray(want.latents), **TOL)
    order = PL.session_order(batch, mesh.shape[PL.DATA], True)
    rows, ref = cache_rows(got.state.cache, order), cache_rows(want.state.cache)
    assert set(rows) == set(ref) and any("dilated" in name for name in ref), sorted(ref)
    for name in ref:
        if name.endswith(("positions", "chunk_start")):
            np.testing.assert_array_equal(rows[name], ref[name], err_msg=name)
        else:
            np.testing.assert_allclose(rows[name], ref[name], **TOL, err_msg=name)

    # the compiled programs, per chunk (`mesh_step`) and scanned (`mesh_rollout_program`), of a ring cache and of a
    # mixed cache with windows long enough that one layer of a device's cache shard outweighs any activation
    params = PL.shard_params(PARAMS, mesh)
    for rc in (rc_of(16), dataclasses.replace(rc_dilated(2, guidance=3.0), window_frames=16, buckets=8)):
        state, exe = compiled(mesh, CONFIG, rc, batch)
        assert_moves_no_cache_layer(exe, state)
        state = PL.init_state(params, CONFIG, rc, mesh, ctx, neg if rc.guidance_scale is not None else None)
        replicated = NamedSharding(mesh, P())
        key_data = PL.put_global(jax.random.key_data(key), replicated)
        first = PL.put_global(np.int32(0), replicated)
        program = PL.mesh_rollout_program(mesh, CONFIG, rc, CHUNKS)
        assert_moves_no_cache_layer(program.lower(params, state, key_data, first, None).compile(), state)


def assert_moves_no_cache_layer(exe, state):
    """The compiled mesh program ``exe`` of ``state`` (abstract or concrete, on the mesh) gathers no cache: it
    all-reduces (tensor parallel) but never all-gathers, no collective produces as many elements as one layer of a
    device's shard of any cache stack (every stack of a `jaxkv.cache.MixedCache`), and the donated state aliases
    the outputs."""
    from jaxkv import session_format as SF

    sizes = largest_collectives(exe.as_text())
    assert sizes.get("all-reduce", 0) > 0 and "all-gather" not in sizes, sizes
    layers = {  # k [layers, sessions, slots, heads, head_dim] of every stack
        name: int(np.prod(k.sharding.shard_shape(k.shape)[1:]))
        for name, k in SF.cache_tensors(state.cache).items()
        if name.endswith("/k")
    }
    for op, elements in sizes.items():
        assert elements < min(layers.values()), (op, elements, layers)
    state_bytes = sum(
        int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)
    )
    assert exe.memory_analysis().alias_size_in_bytes >= state_bytes, (exe.memory_analysis(), state_bytes)


# ------------------------------------------------------------------------------------------------ FP8 KV cache


def rc_fp8(window_frames=4):
    """`rc_of` (guided) with its KV cache in FP8 (`jaxkv.cache.Fp8Cache`) read as float32: every other number f32."""
    from jaxkv.precision import Precision

    precision = Precision("float32", "float32", "float32", fp8_kv=True)
    return dataclasses.replace(rc_of(window_frames, guidance=3.0), precision=precision)


def assert_fp8_caches_close(got, want, order):
    """Two FP8 caches written from K/V that agree to f32 rounding (``got`` a mesh's, its rows in ``order``; ``want``
    one device's): positions equal, scales to 1e-5, the dequantized K/V to one e4m3 step and nearly every byte
    equal (tests/helpers/fp8_steps.py)."""
    from tests.helpers.fp8_steps import assert_within_one_e4m3_step, equal_byte_share

    g, w = cache_rows(got, order), cache_rows(want)
    gd, wd = cache_rows(got.dequantized(), order), cache_rows(want.dequantized())
    for name in ("cache/positions", "cache/chunk_start"):
        np.testing.assert_array_equal(g[name], w[name], err_msg=name)
    for f in ("k", "v"):
        np.testing.assert_allclose(g[f"cache/{f}_scale"], w[f"cache/{f}_scale"], rtol=1e-5, err_msg=f)
        assert_within_one_e4m3_step(gd[f"cache/{f}"], wd[f"cache/{f}"], w[f"cache/{f}_scale"], want.spec.chunk, f)
        same = equal_byte_share(g[f"cache/{f}"], w[f"cache/{f}"])
        assert same >= 0.99, (f, same)


def check_fp8():
    """An FP8 KV cache on a mesh: a `MeshStream` switched after chunk 0 gives the single-device FP8 stream's chunks
    on data=2,model=1 bit for bit. On data=2,model=2 the tensor-parallel sums associate differently, so a K/V value
    at an e4m3 rounding boundary may be stored one e4m3 step apart: its cache is the single-device one to that step
    (`assert_fp8_caches_close`) and its chunks agree to 1e-3 of their largest value (seen: on one 2-core machine all
    to f32 rounding; on an AMD EPYC without AVX-512, 2 of 10,240 K bytes a step apart, the last chunk 1.7e-5 of its
    largest value off). Its FP8 ring and its per-(slot, head) scales are split by session and head; the compiled
    step moves no cache layer and writes in place; a session saved on 2x2 resumes everywhere `resumes_everywhere`
    checks (its scales by rows too)."""
    from jaxkv.cache import Fp8Cache
    from jaxkv.parallel import checkpoint as CK

    rc, batch = rc_fp8(), 2
    ctx, neg = contexts(batch)
    other = np.random.default_rng(11).standard_normal(ctx.shape).astype(np.float32)
    want, one, _ = switched_chunks(None, rc, batch, other, neg)
    m21 = PL.make_mesh(2, 1, jax.devices()[4:6])
    got, _, _ = switched_chunks(m21, rc, batch, other, neg)
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"data=2 chunk {n}")
    m22 = PL.make_mesh(2, 2, jax.devices()[:4])
    got, stream, _ = switched_chunks(m22, rc, batch, other, neg)
    assert_fp8_caches_close(stream.state.cache, one.state.cache, PL.session_order(batch, 2, True))
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * np.abs(b).max(), err_msg=f"2x2 chunk {n}")
    cache = stream.state.cache
    assert isinstance(cache, Fp8Cache) and cache.k.dtype == jax.numpy.float8_e4m3fn, type(cache)
    slots, heads = cache.spec.num_slots, CONFIG.num_heads
    # 4 rows (batch 2, each with its negative) over data=2; 4 heads over model=2
    assert cache.k_scale.addressable_shards[0].data.shape == (CONFIG.num_layers, 2, slots, heads // 2)
    assert cache.k.addressable_shards[0].data.shape[1:4:2] == (2, heads // 2)
    state, exe = compiled(m22, CONFIG, rc_fp8(16), batch)
    assert_moves_no_cache_layer(exe, state)

    session, saved, whole = saved_on_2x2(rc, batch, m22)
    assert {"cache/k_scale", "cache/v_scale"} <= set(saved)
    with tempfile.TemporaryDirectory() as tmp:
        path = CK.save(os.path.join(tmp, "s"), session, mesh=m22)
        pieces = [p for p in CK.read_manifest(path)["pieces"] if p["tensor"] == "cache/k_scale"]
        # as the K/V: 4 distinct shards (data x model), each two runs of logical rows (guided: cond, negative)
        assert len(pieces) == 8, pieces
        resumes_everywhere(path, rc, batch, saved, whole, m22)


def check_generate_fp8():
    """``jaxkv generate --precision fp8 --mesh data=2,model=4`` (FP8 KV cache and FP8 attention, bfloat16 elsewhere)
    with a prompt switch at chunk 1: saved after chunk 0 (``--save-state``) and resumed on the same mesh, it
    continues as the uninterrupted run bit for bit; the switch changes chunk 1; and the run on one device draws
    the same chunks to bfloat16 rounding."""
    import json

    from jaxkv.generate import load_latents
    from jaxkv.generate.loop import main
    from jaxkv.models.wan import checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        checkpoint.save(ckpt, CONFIG, PARAMS)
        write_schedules(tmp)
        common = ["--height", "4", "--width", "4", "--chunk-frames", "1", "--window-frames", "2", "--sink-frames", "1"]
        common += ["--steps", "1000,500", "--batch", "2", "--guidance-scale", "3", "--precision", "fp8"]
        common += ["--checkpoint", ckpt, "--negative-context", os.path.join(tmp, "neg.npy"), "--no-video"]
        common += ["--no-progress"]
        mesh = ["--mesh", "data=2,model=4"]
        whole, plain, one = (os.path.join(tmp, n) for n in ("whole", "plain", "one"))
        sched = lambda name: ["--prompt-schedule", os.path.join(tmp, f"{name}.json")]
        assert main([*common, *sched("ab"), "--num-chunks", "2", "--out", whole, *mesh]) == 0
        assert main([*common, *sched("a"), "--num-chunks", "2", "--out", plain, *mesh]) == 0
        assert main([*common, *sched("ab"), "--num-chunks", "2", "--out", one]) == 0
        with open(os.path.join(whole, "summary.json")) as f:
            summary = json.load(f)
        assert summary["mesh"] == {"data": 2, "seq": 1, "model": 4}, summary
        want = load_latents(whole)
        assert np.isfinite(want).all() and want.dtype == np.float32
        assert not np.allclose(want[:, 1:], load_latents(plain)[:, 1:], atol=1e-2)  # the switch changed chunk 1
        np.testing.assert_array_equal(load_latents(plain)[:, :1], want[:, :1])
        np.testing.assert_allclose(load_latents(one), want, rtol=0.1, atol=0.1)
        first, state, out = (os.path.join(tmp, n) for n in ("first", "state", "resumed"))
        assert main([*common, *sched("a"), "--num-chunks", "1", "--out", first, *mesh, "--save-state", state]) == 0
        argv = ["--resume", state, *sched("b"), "--num-chunks", "1", "--out", out, "--no-video", "--no-progress"]
        assert main([*argv, *mesh]) == 0
        np.testing.assert_array_equal(load_latents(first), want[:, :1])
        np.testing.assert_array_equal(load_latents(out), want[:, 1:])


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    for name in sys.argv[1:]:
        globals()[f"check_{name}"]()
        print(f"OK {name}", flush=True)
