"""`jaxkv.Pipeline` against ``jaxkv generate``: the same prompt and seed give the frames the command writes
(``--frames npy``, the mp4's own decode), a switch gives what ``--prompt-schedule`` writes, a saved session resumes
bit for bit (from a pipeline's save and from ``--save-state``), forks are independent, and bad input is refused
before the stream changes.

One pipeline (the shipped toy world) serves the module: the step compiles once, and the command, run in this
process, reuses the compiled programs.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import generate as G
from jaxkv import session as S
from jaxkv.pipeline import Pipeline, PipelineStream

P0 = "a red circle and a blue square, slow"
P1 = "a green triangle, fast"


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return jaxkv.Pipeline.from_pretrained()


def _cli_frames(out, chunks: int) -> list[np.ndarray]:
    return [np.load(out / "frames" / f"chunk_{i:06d}.npy")[0] for i in range(chunks)]


def _generate(argv: list[str]) -> None:
    assert G.main([*argv, "--no-progress", "--frames", "npy"]) == 0


def test_the_default_is_the_shipped_toy_world(pipe):
    assert pipe.toy and pipe.model is None
    assert pipe.frame_shape == (64, 64, 3) and pipe.fps == 16
    assert pipe.default_prompt == P0
    assert (pipe.rc.chunk_frames, pipe.rc.window_frames, pipe.rc.sink_frames, pipe.rc.rope) == (
        3,
        6,
        3,
        "cache-relative",
    )


def test_frames_equal_what_jaxkv_generate_writes(pipe, tmp_path):
    out = tmp_path / "cli"
    _generate(["--out", str(out), "--num-chunks", "3", "--seed", "3", "--prompt", P1])
    want = _cli_frames(out, 3)
    s = pipe.start(P1, seed=3, num_chunks=3)
    assert (s.chunk_index, s.prompt, s.frame_shape, s.frames_per_chunk) == (0, P1, (64, 64, 3), 3)
    got = list(s)  # stops after num_chunks
    assert len(got) == 3 and s.chunk_index == 3 and s.remaining == 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == np.uint8 and a.shape == (3, 64, 64, 3)
        np.testing.assert_array_equal(a, b, err_msg=f"chunk {i}")
    assert not np.array_equal(got[0], got[2])  # the video moves
    # the generator form draws the same frames
    for a, b in zip(pipe.stream(P1, 2, seed=3), want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(StopIteration):
        s.step()


def test_switch_prompt_equals_the_prompt_schedule(pipe, tmp_path):
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"chunk": 0, "prompt": P0}, {"chunk": 2, "prompt": P1}]))
    out = tmp_path / "cli"
    _generate(["--out", str(out), "--num-chunks", "4", "--prompt-schedule", str(schedule)])
    want = _cli_frames(out, 4)
    s = pipe.start(P0, seed=0)
    got = [s.step(), s.step()]
    assert s.switch_prompt(P1) == 2
    assert s.prompt == P1 and s.switches == [(0, P0), (2, P1)]
    got += [s.step(), s.step()]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"chunk {i}")
    # and the switch changed the video: the unswitched stream differs from chunk 2 on
    plain = pipe.start(P0, seed=0)
    unswitched = [plain.step() for _ in range(4)]
    np.testing.assert_array_equal(unswitched[1], got[1])
    assert not np.array_equal(unswitched[3], got[3])


def test_save_and_resume_continue_bit_for_bit(pipe, tmp_path):
    s = pipe.start(P0, seed=1)
    s.step(), s.step()
    path = s.save(tmp_path / "sess")
    meta = S.read_metadata(path)["pipeline"]
    assert meta["prompt"] == P0 and meta["seed"] == 1 and meta["model"] is None
    twin = s.fork()
    ref = [s.step(), s.step()]  # uninterrupted
    twin.switch_prompt(P1)
    ref_switched = [twin.step()]

    r = pipe.resume(path)
    assert isinstance(r, PipelineStream) and r.chunk_index == 2 and r.prompt == P0 and r.seed == 1
    for a, b in zip([r.step(), r.step()], ref, strict=True):
        np.testing.assert_array_equal(a, b)
    # the saved latent ring lets a resumed stream switch at once, as the uninterrupted one did
    r2 = Pipeline.resume(path)  # on the class: loads the model the session names
    assert r2.pipeline is not pipe and r2.chunk_index == 2
    assert r2.switch_prompt(P1) == 2
    np.testing.assert_array_equal(r2.step(), ref_switched[0])
    assert r2.switches == [(0, P0), (2, P1)]
    with pytest.raises(S.SessionError, match="already exists"):
        r2.save(path)
    assert r2.save(path, overwrite=True) == str(path)


def test_an_fp8_pipeline_switches_as_generate_does_and_resumes_bit_for_bit(tmp_path):
    """``precision="fp8"`` (what ``jaxkv serve --precision fp8`` loads): a switch gives what ``jaxkv generate
    --precision fp8 --prompt-schedule`` writes, and a session saved after it resumes (on the class: the precision
    comes from the session) to the uninterrupted stream's frames."""
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"chunk": 0, "prompt": P0}, {"chunk": 2, "prompt": P1}]))
    out = tmp_path / "cli"
    _generate(["--out", str(out), "--num-chunks", "4", "--prompt-schedule", str(schedule), "--precision", "fp8"])
    want = _cli_frames(out, 4)
    fp8 = Pipeline.from_pretrained(precision="fp8")
    assert fp8.rc.precision.fp8_kv and fp8.rc.precision.fp8_attention
    s = fp8.start(P0, seed=0)
    got = [s.step(), s.step()]
    assert s.switch_prompt(P1) == 2
    got.append(s.step())
    path = s.save(tmp_path / "sess")
    assert S.read_metadata(path)["pipeline"]["precision"] == "fp8"
    got.append(s.step())
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"chunk {i}")
    r = Pipeline.resume(path)
    assert r.pipeline.rc.precision == fp8.rc.precision and r.chunk_index == 3 and r.prompt == P1
    np.testing.assert_array_equal(r.step(), want[3])


def test_a_generate_session_resumes_in_the_pipeline(pipe, tmp_path):
    out, state = tmp_path / "cli", tmp_path / "state"
    _generate(["--out", str(out), "--num-chunks", "2", "--seed", "5", "--save-state", str(state)])
    r = pipe.resume(state)
    assert r.chunk_index == 2 and r.prompt == P0 and r.seed == 5
    s = pipe.start(P0, seed=5)
    s.step(), s.step()
    want = s.step()
    np.testing.assert_array_equal(r.step(), want)
    # on the class: the model and the settings come from the command's recorded flags
    r2 = Pipeline.resume(state)
    assert r2.pipeline.rc == pipe.rc and r2.pipeline.model is None
    np.testing.assert_array_equal(r2.step(), want)
    # --save-state keeps the latent ring: the resumed stream switches at once, as the uninterrupted one does
    assert r2.switch_prompt(P1) == 3 and s.switch_prompt(P1) == 3
    np.testing.assert_array_equal(r2.step(), s.step())
    assert r2.prompt == P1 and r2.chunk_index == 4


def test_forks_are_independent(pipe):
    s = pipe.start(P0, seed=2)
    s.step()
    f = s.fork()
    assert f.chunk_index == 1 and f.switches == s.switches
    np.testing.assert_array_equal(f.step(), s.step())
    f.switch_prompt(P1)
    assert s.prompt == P0 and f.prompt == P1
    ref = pipe.start(P0, seed=2)
    ref_frames = [ref.step() for _ in range(3)]
    a, b = s.step(), f.step()
    np.testing.assert_array_equal(a, ref_frames[2])
    assert not np.array_equal(a, b)


def test_bad_input_is_refused_before_the_stream_changes(pipe, tmp_path):
    s = pipe.start(P0, seed=4)
    s.step()
    twin = s.fork()
    with pytest.raises(ValueError, match="not a toy-world prompt.*toy world's words are"):
        s.switch_prompt("a purple dog, fast")
    with pytest.raises(ValueError, match="must be a string"):
        s.switch_prompt(None)
    assert s.chunk_index == 1 and s.prompt == P0 and s.switches == [(0, P0)]
    np.testing.assert_array_equal(s.step(), twin.step())
    with pytest.raises(ValueError, match="not a toy-world prompt"):
        pipe.start("hello")
    with pytest.raises(ValueError, match="seed must be >= 0"):
        pipe.start(P0, seed=-1)
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        pipe.start(P0, num_chunks=0)
    with pytest.raises(ValueError, match="negative_prompt needs a model run with guidance"):
        pipe.start(P0, negative_prompt="")
    with pytest.raises(ValueError, match="is not a directory"):
        Pipeline.from_pretrained(tmp_path / "missing")
    with pytest.raises(TypeError, match="unknown settings"):
        Pipeline.from_pretrained(height_px=64)
    with pytest.raises(ValueError, match="precision must be one of"):
        Pipeline.from_pretrained(precision="float8")
    with pytest.raises(ValueError, match="not a complete jaxkv session"):
        pipe.resume(tmp_path)


# ------------------------------------------------------------------------------------------------ a Wan release

WAN_PROMPT = "a red fox, snow"


@pytest.fixture(scope="module")
def wan_release(tmp_path_factory):
    """A converted release of tiny random parts (dit/, vae/, text_encoder/)."""
    import jax

    from jaxkv.models import umt5, wan, wan_vae
    from jaxkv.models.release import PARTS
    from jaxkv.models.umt5.tokenizer import tiny_tokenizer_json
    from jaxkv.models.wan import checkpoint as dit_checkpoint

    root = tmp_path_factory.mktemp("release")
    config = wan.preset("tiny")
    dit_checkpoint.save(str(root / PARTS["dit"]), config, wan.init_params(config, jax.random.key(7)))
    vae = wan_vae.preset("tiny")
    wan_vae.checkpoint.save(str(root / PARTS["vae"]), vae, wan_vae.init_params(5, vae))
    text = umt5.preset("tiny")
    umt5.save(
        str(root / PARTS["umt5"]),
        text,
        umt5.init_params(text, 5),
        tokenizer_files={"tokenizer.json": tiny_tokenizer_json().encode()},
    )
    return root


def test_a_wan_release_streams_its_vae_frames_and_resumes_them(wan_release, tmp_path):
    """A converted Wan release: the VAE's frames (9 for the first 3-frame chunk, 12 after) equal what
    ``jaxkv generate --checkpoint`` writes, and a resumed stream continues the VAE decoder's caches."""
    out = tmp_path / "cli"
    small = ["--height", "4", "--width", "4"]
    _generate(
        ["--checkpoint", str(wan_release), "--prompt", WAN_PROMPT, *small, "--num-chunks", "3", "--out", str(out)]
    )
    want = _cli_frames(out, 3)
    pipe = Pipeline.from_pretrained(wan_release, height=4, width=4)
    assert not pipe.toy and pipe.model == str(wan_release) and pipe.frame_shape == (32, 32, 3)
    s = pipe.start(WAN_PROMPT, seed=0)
    assert s.frames_per_chunk == 9
    first = s.step()
    assert first.shape == (9, 32, 32, 3) and s.frames_per_chunk == 12
    np.testing.assert_array_equal(first, want[0])
    path = s.save(tmp_path / "sess")
    np.testing.assert_array_equal(s.step(), want[1])
    np.testing.assert_array_equal(s.step(), want[2])
    r = Pipeline.resume(path)  # the release and its settings from the session
    assert r.pipeline.model == str(wan_release) and r.frames_per_chunk == 12
    np.testing.assert_array_equal(r.step(), want[1])
    f = r.fork()
    np.testing.assert_array_equal(f.step(), want[2])
    np.testing.assert_array_equal(r.step(), want[2])


def test_a_forked_wan_stream_decodes_the_same_frames_from_the_fork_point(wan_release):
    """The VAE decoder's feature caches are part of the stream's carried state: a fork takes them (in buffers of
    its own), so the fork's frames equal the original's bit for bit from the fork point, whichever steps first."""
    pipe = Pipeline.from_pretrained(wan_release, height=4, width=4)
    s = pipe.start(WAN_PROMPT, seed=1)
    s.step()
    carried = s._stream.carry.extras[S.VAE_DECODER]
    f = s.fork()
    assert f.frames_per_chunk == s.frames_per_chunk == 12
    twin = f._stream.carry.extras[S.VAE_DECODER]
    for a, b in zip(jax.tree.leaves(carried), jax.tree.leaves(twin), strict=True):
        assert a is not b
        np.testing.assert_array_equal(a, b)
    fork_frames = [f.step() for _ in range(2)]  # the fork first: its decodes leave the original's state alone
    for n in range(2):
        np.testing.assert_array_equal(s.step(), fork_frames[n], err_msg=f"frames of chunk {n + 1}")
    assert s._stream.carry.extras[S.VAE_DECODER] is not carried  # each decode put its new state back in the carry


def test_a_stream_continues_a_video_as_jaxkv_generate_does(pipe, tmp_path):
    # start(video=PATH) against jaxkv generate --video PATH: the same committed chunks and the same frames after
    from jaxkv.toyworld import world
    from jaxkv.video import VideoWriter

    clip = world.render(world.canonical_scene(P0), 10, 3)  # 10 frames: the latest 9 make 3 chunks, 1 dropped
    path = str(tmp_path / "clip.mp4")
    with VideoWriter(path, 16, crf=0) as writer:
        writer.append(clip)
    _generate(["--video", path, "--num-chunks", "2", "--out", str(tmp_path / "cli")])
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    s = pipe.start(video=path, num_chunks=2)
    assert s.chunk_index == summary["first_chunk"] == 3 and s.switches == [(3, P0)]
    assert {k: s.given[k] for k in ("chunks", "dropped", "padded", "frames_used")} == {
        "chunks": 3,
        "dropped": 1,
        "padded": 0,
        "frames_used": 9,
    }
    assert s.given["kind"] == "video" and s.given["path"] == path and s.given["source_frames"] == 10
    for got, want in zip(list(s), _cli_frames(tmp_path / "cli", 2), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_picture_of_any_size_starts_a_stream_that_saves_and_resumes(pipe, tmp_path):
    from jaxkv import continuation as C
    from jaxkv.toyworld import world

    frame = world.render(world.canonical_scene(P0), 1, 5)[0]
    big = np.repeat(np.repeat(frame, 2, axis=0), 3, axis=1)  # 128x192: mapped back by cover-and-crop
    a = pipe.start(image=big, seed=4, num_chunks=3)
    assert a.chunk_index == 1 and a.given["padded"] == 2 and a.given["source_size"] == [128, 192]
    assert a.given["path"] is None
    fitted = C.fit_frames(big, 64, 64)
    b = pipe.start(image=fitted[0], seed=4, num_chunks=3)  # the mapped picture given directly: the same stream
    first = a.step()
    np.testing.assert_array_equal(first, b.step())
    a.save(str(tmp_path / "s"))
    r = Pipeline.resume(str(tmp_path / "s"), num_chunks=2)
    assert r.given == a.given and r.chunk_index == 2
    for got, want in zip(list(r), list(a), strict=True):
        np.testing.assert_array_equal(got, want)


def test_bad_given_frames_are_refused_before_anything_runs(pipe, tmp_path):
    (tmp_path / "notes.png").write_text("not a picture")
    for kwargs, message in [
        ({"image": np.zeros((2, 64, 64, 3), np.uint8)}, "one uint8 RGB frame"),
        ({"video": np.zeros((64, 64, 3), np.uint8)}, r"frames \[T, H, W, 3\]"),
        ({"video": np.zeros((4, 64, 64, 3), np.float32)}, "uint8"),
        ({"image": str(tmp_path / "missing.png")}, "no such file"),
        ({"image": str(tmp_path / "notes.png")}, "not an image that can be decoded"),
        ({"image": np.zeros((64, 64, 3), np.uint8), "video": np.zeros((3, 64, 64, 3), np.uint8)}, "pass one"),
    ]:
        with pytest.raises(ValueError, match=message):
            pipe.start(**kwargs)
