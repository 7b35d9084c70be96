"""`jaxkv.parallel`: the Wan rollout on a (data, model) mesh equals the single-device rollout.

The mesh checks need 8 devices, fixed when JAX initialises, so they run in a fresh interpreter
(tests/parallel_checks.py, several checks per process). The quick set runs the data x model mesh; the other meshes,
guidance, sharded loading, the HLO check and ``generate --mesh`` are slow.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxkv import safetensors_io
from jaxkv.models.wan import config as C
from jaxkv.models.wan.params import flat_param_shapes, param_shapes
from jaxkv.parallel import mesh as mesh_lib
from jaxkv.parallel import rules
from jaxkv.parallel.rollout import session_order
from jaxkv.stream import Stream

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_checks(*names: str, timeout: int = 900) -> None:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "parallel_checks.py"), *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for name in names:
        assert f"OK {name}" in result.stdout, out


@pytest.mark.slow
def test_data_x_model_mesh_matches_one_device():
    """2 x 4 mesh: latents and state equal the single-device stream, one compilation, shardings kept."""
    run_checks("data_x_model")


@pytest.mark.slow
def test_seq_meshes_match_one_device_with_all_to_all_hlo():
    """Ulysses: data=2,model=2,seq=2 / seq=4 / data=2,seq=4 (and guided) equal the single-device stream, compile once,
    keep their shardings; the compiled step exchanges tokens for heads by all-to-all and moves no cache layer."""
    run_checks("seq", "seq_guided", "seq_hlo", timeout=1800)


@pytest.mark.slow
def test_other_meshes_guidance_loading_hlo_errors():
    run_checks(
        "model_only", "one_device", "data_only", "guided", "loading", "noise", "errors", "hlo", "generate", timeout=1800
    )


@pytest.mark.slow
def test_mesh_session_saved_per_shard_resumes_on_other_meshes_and_one_device():
    """Saved on data=2,model=2 (with and without guidance), resumed on 2x2 (bit for bit), one device and 1x4 (the
    saved state bit for bit); without tensor parallelism bit for bit to one device both ways; errors; a prompt
    switch on the mesh; generate --mesh with --save-state / --resume / --prompt-schedule."""
    run_checks(
        "save_resume",
        "save_resume_guided",
        "save_resume_exact",
        "checkpoint_errors",
        "generate_save_resume",
        "switch",
        timeout=1800,
    )


@pytest.mark.slow
def test_dilated_layers_and_given_latents_on_a_mesh():
    """Dilated layers (all dilated, mixed, mixed guided; data=2,model=2 and with seq=2) equal the single-device
    stream, compile once, keep their shardings; a mixed session saved on the mesh resumes on one device and the
    mesh, and switches prompt; given latents committed on the mesh equal one device's commit; ``jaxkv generate
    --mesh`` with ``--dilated-every`` and with ``--image``."""
    run_checks("dilated", "dilated_save_resume", "commit", "generate_dilated_given", timeout=1800)


@pytest.mark.slow
def test_fp8_kv_cache_on_a_mesh():
    """An FP8 KV cache on a mesh (a traceback before): a switched `MeshStream` equals one device (data=2 bit for bit;
    2x2 its cache to one e4m3 step, its chunks to 1e-3), ring and scales split by session and head, no cache layer
    moved; a 2x2 session resumes on 2x2, one device and 1x4; ``jaxkv generate --precision fp8 --mesh`` switches,
    saves and resumes bit for bit."""
    run_checks("fp8", "generate_fp8")


# ------------------------------------------------------------------------------------------------ in-process


def test_parse_mesh():
    assert mesh_lib.parse_mesh("data=2,model=4") == {"data": 2, "seq": 1, "model": 4}
    assert mesh_lib.parse_mesh(" model=8 ") == {"data": 1, "seq": 1, "model": 8}
    assert mesh_lib.parse_mesh("data=2,model=2,seq=2") == {"data": 2, "seq": 2, "model": 2}
    for bad, words in (
        ("data=2,modl=4", "'modl=4'"),
        ("data=0", ">= 1"),
        ("data=x", "positive int"),
        ("data=2,data=2", "twice"),
        ("seq=0", ">= 1"),
        ("", "data=N"),
        ("data", "AXIS=SIZE"),
    ):
        with pytest.raises(ValueError) as e:
            mesh_lib.parse_mesh(bad)
        assert words in str(e.value), (bad, str(e.value))


def test_make_mesh_needs_every_device():
    import jax

    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {n + 1} devices"):
        mesh_lib.make_mesh(n + 1, 1)
    with pytest.raises(ValueError, match=f"needs {2 * n} devices"):
        mesh_lib.make_mesh(1, n, seq=2)
    mesh = mesh_lib.make_mesh(1, n)
    assert mesh_lib.mesh_sizes(mesh) == {"data": 1, "seq": 1, "model": n}
    assert mesh_lib.mesh_sizes(mesh_lib.make_mesh(seq=n)) == {"data": 1, "seq": n, "model": 1}


def test_rule_table_is_megatron_and_every_rule_is_used():
    config = C.preset("wan2.1-t2v-14b")
    specs = rules.param_specs(param_shapes(config))
    flat = {k: rules.spec_of(k, s) for k, s in flat_param_shapes(config).items()}
    for pattern, _ in rules.RULES:  # no dead rule: each matches some parameter
        assert any(re.fullmatch(pattern, k) for k in flat), pattern
    for which in ("self_attn", "cross_attn"):
        for name in "qkv":
            assert flat[f"blocks.{which}.{name}.kernel"] == rules.P(None, None, "model")  # columns: whole heads
        assert flat[f"blocks.{which}.o.kernel"] == rules.P(None, "model", None)  # rows: one all-reduce
        assert flat[f"blocks.{which}.o.bias"] == rules.P()  # added once, after it
    assert flat["blocks.ffn.fc1.kernel"] == rules.P(None, None, "model")
    assert flat["blocks.ffn.fc2.kernel"] == rules.P(None, "model", None)
    sharded = {k for k, s in flat.items() if any(a is not None for a in s)}
    assert all(k.startswith("blocks.") for k in sharded)  # embeddings, head: replicated
    assert specs["blocks"]["self_attn"]["q"]["kernel"] == flat["blocks.self_attn.q.kernel"]


def test_param_bytes_per_device_14b():
    """14B in bf16 on model=8: the sharded blocks split 8 ways, the rest replicated (independent sum)."""
    import jax
    import jax.numpy as jnp

    config = C.preset("wan2.1-t2v-14b")
    shapes = flat_param_shapes(config)
    total = sum(int(np.prod(s)) for s in shapes.values()) * 2
    replicated = sum(int(np.prod(s)) for k, s in shapes.items() if rules.spec_of(k, s) == rules.P()) * 2

    class FakeMesh:  # bytes_per_device reads only mesh.shape
        shape = {"data": 1, "model": 8}

    tree = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in shapes.items()}
    got = rules.bytes_per_device(rules.unflatten(tree), FakeMesh())
    assert got == replicated + (total - replicated) // 8
    assert 26e9 < total < 30e9 and got < total / 7


def test_session_order_keeps_each_groups_cond_and_negative_rows_together():
    np.testing.assert_array_equal(session_order(4, 2, True), [0, 1, 4, 5, 2, 3, 6, 7])
    np.testing.assert_array_equal(session_order(4, 1, True), np.arange(8))
    np.testing.assert_array_equal(session_order(4, 2, False), np.arange(4))


def test_read_slice_reads_only_the_slice(tmp_path, monkeypatch):
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5, 8)).astype(np.float32)
    path = str(tmp_path / "t.safetensors")
    save_file({"a": a, "b": a.astype(ml_dtypes.bfloat16)}, path)
    infos, _ = safetensors_io.read_header(path)
    read = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: read.append(real(fd, buffers, offset)) or read[-1])
    cases = 0
    for index in itertools.product(
        *[[slice(None), slice(0, 1), slice(1, d), slice(2, 3), slice(3, 3)] for d in a.shape]
    ):
        for key, stored in (("a", a), ("b", a.astype(ml_dtypes.bfloat16))):
            read.clear()
            got = safetensors_io.read_slice(path, infos[key], index, np.float32)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, stored[index].astype(np.float32))
            assert sum(read) == stored[index].nbytes  # the slice's bytes and no others
            cases += 1
    assert cases == 250
    with pytest.raises(ValueError, match="step 2"):
        safetensors_io.read_slice(path, infos["a"], (slice(0, 3, 2),))


def test_sharded_session_round_trip_on_one_device(tmp_path):
    """In process (one device): a stream's session saved by `jaxkv.parallel.checkpoint` loads back bit for bit, as a
    plain Session and on a 1x1 mesh, and both continue as the uninterrupted stream, bit for bit."""
    import jax

    from jaxkv import parallel as PL
    from jaxkv import rollout as R
    from jaxkv import session as S
    from jaxkv import session_format as SF
    from jaxkv.models.wan import model as M
    from jaxkv.parallel import checkpoint as CK
    from jaxkv.schedule import Schedule

    config = C.preset("tiny")
    params = M.init_params(config, jax.random.key(0))
    rc = R.RolloutConfig(4, 4, chunk_frames=1, window_frames=2, sink_frames=1, schedule=Schedule(steps=(1000, 500)))
    ctx = np.random.default_rng(0).standard_normal((1, 5, config.text_dim)).astype(np.float32)
    whole = [np.asarray(x) for x in Stream(params, config, rc, ctx, num_chunks=3, key=jax.random.key(7))]
    stream = Stream(params, config, rc, ctx, num_chunks=1, key=jax.random.key(7))
    next(stream)
    session = stream.session()
    path = CK.save(str(tmp_path / "s"), session)
    assert CK.read_manifest(path)["format"] == CK.FORMAT
    loaded = CK.load(path, config, rc)
    named, _ = SF.session_tensors(session)
    for name, x in SF.session_tensors(loaded)[0].items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(named[name]), err_msg=name)
    on_mesh = CK.load(path, config, rc, mesh=PL.make_mesh(1, 1, jax.devices()[:1]))
    for s, make in ((loaded, Stream.from_session), (on_mesh, PL.MeshStream.from_session)):
        kw = {} if s is loaded else {"mesh": PL.make_mesh(1, 1, jax.devices()[:1])}
        xs = [np.asarray(x) for x in make(params, config, rc, s, num_chunks=2, **kw)]
        for a, b in zip(xs, whole[1:], strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(S.SessionError, match="window_frames"):
        CK.load(path, config, dataclasses.replace(rc, window_frames=3))


@pytest.mark.slow
def test_scan_rollout_on_mesh_matches_one_device_and_mesh_stream():
    """`mesh_rollout` on data=2,model=2 (and guided, and data=2,seq=2,model=2 guided) equals `jaxkv.rollout.rollout`
    on one device and the MeshStream (latents, final state, a continuation at a chunk offset; one compilation); bit
    for bit on data=2,model=1; its gradient on data=2 equals the single-device gradient; a mixed dense/dilated cache
    equals one device; the compiled program gathers no cache and aliases the donated state; bad arguments refused
    before anything runs."""
    run_checks("scan", "scan_grad", "scan_dilated_hlo", "scan_errors", timeout=1800)


def _as_process_0_of_2(monkeypatch, other: list[dict]):
    """`jaxkv.parallel.processes` exchanges as process 0 of 2, process 1 answering ``other`` in turn."""
    import json

    from jaxkv.parallel import processes

    answers = iter(other)
    monkeypatch.setattr(processes, "gather_text", lambda text: [text, json.dumps(next(answers))])


def test_write_directory_leaves_nothing_when_another_process_fails(tmp_path, monkeypatch):
    """Process 1's write fails: process 0 raises ProcessFailed naming it and its error, and neither the directory
    nor its temporary is left (the barrier logic with a faked second process)."""
    from jaxkv.parallel import processes

    _as_process_0_of_2(monkeypatch, [{"value": ""}, {"error": "OSError: [Errno 28] No space left on device"}])
    written = []

    def write(tmp):
        (tmp_path / "seen").write_text(tmp)
        written.append(os.listdir(tmp))
        return {"mine": 1}

    with pytest.raises(processes.ProcessFailed, match=r"writing .*out failed in process 1 of 2: OSError: .*No space"):
        processes.write_directory(str(tmp_path / "out"), write=write, finish=lambda tmp, parts: None)
    assert written == [[]] and sorted(os.listdir(tmp_path)) == ["seen"]


def test_write_directory_finishes_with_every_part_and_waits_for_the_rename(tmp_path, monkeypatch):
    """Process 0 finishes with both processes' parts (process order) and renames; a failure in its finish reaches
    process 1 through the last exchange and leaves no directory; with one process nothing is exchanged."""
    from jaxkv.parallel import processes

    calls = []

    def finish(tmp, parts):
        calls.append(parts)
        with open(os.path.join(tmp, "m"), "w") as f:
            f.write("x")

    _as_process_0_of_2(monkeypatch, [{"value": ""}, {"value": {"p": 1}}, {"value": None}])
    path = processes.write_directory(str(tmp_path / "a"), write=lambda tmp: {"p": 0}, finish=finish)
    assert calls == [[{"p": 0}, {"p": 1}]] and os.listdir(path) == ["m"]

    def broken(tmp, parts):
        raise OSError("manifest not written")

    sent = []
    monkeypatch.setattr(processes, "gather_text", lambda text: sent.append(text) or [text, '{"value": null}'])
    with pytest.raises(OSError, match="manifest not written"):
        processes.write_directory(str(tmp_path / "b"), write=lambda tmp: {}, finish=broken)
    assert "manifest not written" in sent[-1]  # told to process 1 before raising
    assert sorted(os.listdir(tmp_path)) == ["a"]
    monkeypatch.undo()
    path = processes.write_directory(
        str(tmp_path / "c"), write=lambda tmp: 7, finish=lambda tmp, parts: calls.append(parts)
    )
    assert calls[-1] == [7] and os.listdir(path) == []
