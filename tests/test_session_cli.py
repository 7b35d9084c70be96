"""``jaxkv generate --save-state`` / ``--resume``: 6 chunks, save, resume for 6 more == one 12-chunk run (latents
bit for bit; with video the decoded frames too), also when the first run is stopped by a signal and across real
processes; conflicting flags and bad destinations are refused before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from jaxkv import generate as G
from jaxkv import session as S
from jaxkv.generate import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANDOM = ["--preset", "tiny", "--random-weights"]  # the random-weight model (a toy session: test_generate_toy.py)
FAST = ["--no-progress", "--no-video", *RANDOM]  # default settings otherwise: the programs test_generate.py compiles


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def test_six_saved_then_six_resumed_equal_twelve(tmp_path, capsys):
    assert G.main(["--out", str(tmp_path / "full"), "--num-chunks", "12", *FAST]) == 0
    assert G.main(["--out", str(tmp_path / "a"), "--num-chunks", "6", "--save-state", str(tmp_path / "S"), *FAST]) == 0
    assert "continue with --resume" in capsys.readouterr().out
    assert _summary(tmp_path / "a")["session"] == str(tmp_path / "S")
    assert S.read_manifest(str(tmp_path / "S"))["next_chunk"] == 6
    # --resume takes the session's settings: only --out, --num-chunks and output flags are passed
    assert (
        G.main(["--resume", str(tmp_path / "S"), "--out", str(tmp_path / "b"), "--num-chunks", "6", "--no-progress"])
        == 0
    )
    printed = capsys.readouterr().out
    assert f"resumed      {tmp_path / 'S'} at stream chunk 6" in printed
    full, a, b = (G.load_latents(str(tmp_path / n)) for n in ("full", "a", "b"))
    assert a.shape[1] == b.shape[1] == 18 and full.shape[1] == 36
    assert np.concatenate([a, b], axis=1).tobytes() == full.tobytes()
    assert not np.array_equal(a, b)
    s = _summary(tmp_path / "b")
    assert s["first_chunk"] == 6 and s["resumed_from"] == str(tmp_path / "S") and s["status"] == "complete"
    assert s["compilations"] == 0  # the same program as the first run's (compiled in this process)
    # a resumed run can be saved and resumed again
    assert (
        G.main(
            [
                "--resume",
                str(tmp_path / "S"),
                "--out",
                str(tmp_path / "b2"),
                "--num-chunks",
                "3",
                "--save-state",
                str(tmp_path / "S2"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        G.main(["--resume", str(tmp_path / "S2"), "--out", str(tmp_path / "c"), "--num-chunks", "3", "--no-progress"])
        == 0
    )
    parts = [G.load_latents(str(tmp_path / n)) for n in ("a", "b2", "c")]
    assert np.concatenate(parts, axis=1).tobytes() == full.tobytes()


def test_a_mixed_dense_dilated_stream_saved_and_resumed_equals_the_uninterrupted_run(tmp_path, capsys):
    """--dilated-every 2 (a MixedCache: layer 0 dense, layer 1 dilated): 3 chunks saved + 3 resumed == 6 at once."""
    small = [*FAST, "--chunk-frames", "1", "--window-frames", "2", "--sink-frames", "0", "--height", "8"]
    small += ["--width", "8", "--dilated-every", "2", "--dilation", "2", "--buckets", "2"]
    assert G.main(["--out", str(tmp_path / "full"), "--num-chunks", "6", *small]) == 0
    assert G.main(["--out", str(tmp_path / "a"), "--num-chunks", "3", "--save-state", str(tmp_path / "S"), *small]) == 0
    manifest = S.read_manifest(str(tmp_path / "S"))
    assert manifest["cache_class"] == "MixedCache" and "cache/dilated/k" in manifest["tensors"]
    argv = ["--resume", str(tmp_path / "S"), "--out", str(tmp_path / "b"), "--num-chunks", "3", "--no-progress"]
    assert G.main(argv) == 0
    capsys.readouterr()
    full, a, b = (G.load_latents(str(tmp_path / n)) for n in ("full", "a", "b"))
    assert a.shape[1] == b.shape[1] == 3 and full.shape[1] == 6
    assert np.concatenate([a, b], axis=1).tobytes() == full.tobytes()
    assert not np.array_equal(a, b)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--seed", "3"], "--seed 3 (the session's: 0)"),
        (["--window-frames", "12"], "--window-frames 12 (the session's: 9)"),
        (["--preset", "1.3B"], "--preset '1.3B' (the session's: 'tiny')"),
        (["--steps", "1000,750"], "--steps [1000, 750] (the session's: [1000, 750, 500, 250])"),
        (["--seed", "3", "--policy", "rolling"], "--policy 'rolling' (the session's: 'ring')"),
    ],
)
def test_resume_refuses_conflicting_flags(tmp_path, capsys, flags, named):
    session = tmp_path / "S"
    _tiny_session(session)
    capsys.readouterr()
    out = tmp_path / "b"
    assert G.main(["--resume", str(session), "--out", str(out), "--num-chunks", "2", *FAST, *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "drop these flags" in err
    assert not out.exists()
    # the session's own values may be repeated
    assert (
        G.main(
            [
                "--resume",
                str(session),
                "--out",
                str(out),
                "--num-chunks",
                "1",
                *FAST,
                "--seed",
                "0",
                "--window-frames",
                "9",
            ]
        )
        == 0
    )


_MADE = {}


def _tiny_session(path):
    """A 2-chunk session (made once per test session, copied)."""
    import shutil

    if "dir" not in _MADE:
        base = path.parent.parent / "tiny_session_src"
        assert G.main(["--out", str(base / "o"), "--num-chunks", "2", "--save-state", str(base / "S"), *FAST]) == 0
        _MADE["dir"] = base / "S"
    shutil.copytree(_MADE["dir"], path)


def test_bad_resume_and_save_state_destinations(tmp_path, capsys):
    _tiny_session(tmp_path / "S")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("mine")
    cases = [
        (["--resume", str(tmp_path / "junk")], "not a complete jaxkv session"),
        (["--resume", str(tmp_path / "nope")], "does not exist"),
        (["--save-state", str(tmp_path / "junk"), "--overwrite"], "refusing to replace"),
        (["--save-state", str(tmp_path / "S")], "already exists; pass --overwrite"),
        (["--save-state", str(tmp_path / "o" / "S")], "--save-state"),
        (["--resume", str(tmp_path / "S"), "--save-state", str(tmp_path / "S")], "--save-state is the --resume"),
    ]
    for flags, message in cases:
        assert G.main(["--out", str(tmp_path / "o"), "--num-chunks", "1", *FAST, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err, (flags, err)
        assert not (tmp_path / "o").exists()
    assert (tmp_path / "junk" / "x.txt").read_text() == "mine"
    # --overwrite replaces a previous session
    assert (
        G.main(
            [
                "--out",
                str(tmp_path / "o"),
                "--num-chunks",
                "1",
                *FAST,
                "--save-state",
                str(tmp_path / "S"),
                "--overwrite",
            ]
        )
        == 0
    )
    assert S.read_manifest(str(tmp_path / "S"))["next_chunk"] == 1


def test_signal_saves_the_session_at_the_last_written_chunk(tmp_path, capsys, monkeypatch):
    """SIGINT while a chunk is computed: the run writes the chunk already dispatched, saves the session there,
    exits 130; resuming for the remaining chunks gives the uninterrupted run's latents."""
    real, calls = loop._chunk_finite, []

    def signal_on_third(x):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(x)

    monkeypatch.setattr(loop, "_chunk_finite", signal_on_third)
    code = G.main(["--out", str(tmp_path / "a"), "--num-chunks", "8", "--save-state", str(tmp_path / "S"), *FAST])
    monkeypatch.setattr(loop, "_chunk_finite", real)
    assert code == 130
    s = _summary(tmp_path / "a")
    written = s["chunks_written"]
    assert s["status"] == "interrupted" and 1 <= written < 8
    assert S.read_manifest(str(tmp_path / "S"))["next_chunk"] == written
    capsys.readouterr()
    assert (
        G.main(
            [
                "--resume",
                str(tmp_path / "S"),
                "--out",
                str(tmp_path / "b"),
                "--num-chunks",
                str(8 - written),
                "--no-progress",
            ]
        )
        == 0
    )
    assert G.main(["--out", str(tmp_path / "full"), "--num-chunks", "8", *FAST]) == 0
    joined = np.concatenate([G.load_latents(str(tmp_path / "a")), G.load_latents(str(tmp_path / "b"))], axis=1)
    assert joined.tobytes() == G.load_latents(str(tmp_path / "full")).tobytes()


@pytest.mark.slow  # the VAE's compile and decode: ~30 s on 2 cores
def test_resumed_video_continues_the_decoder(tmp_path):
    """With video, the VAE decoder's caches travel in the session: the resumed run's frames are exactly the
    uninterrupted run's frames after the first run's (no second first frame, no seam)."""
    media = ["--no-progress", "--frames", "npy", *RANDOM]
    assert G.main(["--out", str(tmp_path / "full"), "--num-chunks", "4", *media]) == 0
    assert G.main(["--out", str(tmp_path / "a"), "--num-chunks", "2", "--save-state", str(tmp_path / "S"), *media]) == 0
    assert S.VAE_DECODER in str(S.read_manifest(str(tmp_path / "S"))["tensors"])
    assert (
        G.main(
            [
                "--resume",
                str(tmp_path / "S"),
                "--out",
                str(tmp_path / "b"),
                "--num-chunks",
                "2",
                "--no-progress",
                "--frames",
                "npy",
            ]
        )
        == 0
    )

    def frames(out, n):
        return np.concatenate([np.load(out / "frames" / f"chunk_{i:06d}.npy") for i in range(n)], axis=1)

    full = frames(tmp_path / "full", 4)
    joined = np.concatenate([frames(tmp_path / "a", 2), frames(tmp_path / "b", 2)], axis=1)
    assert joined.shape == full.shape and full.shape[1] == 1 + 4 * (4 * 3 - 1)
    assert joined.tobytes() == full.tobytes()
    assert _summary(tmp_path / "b")["video_frames"] == 4 * 2 * 3
    # --no-video on resume would drop the decoder state: refused
    assert (
        G.main(
            [
                "--resume",
                str(tmp_path / "S"),
                "--out",
                str(tmp_path / "c"),
                "--num-chunks",
                "1",
                "--no-progress",
                "--no-video",
            ]
        )
        == 2
    )


@pytest.mark.slow  # three fresh processes, each compiling the step (~15-40 s each on 2 busy cores)
def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def cli(*argv):
        done = subprocess.run(
            [sys.executable, "-m", "jaxkv.cli", "generate", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        return done

    cli("--out", "full", "--num-chunks", "6", *FAST)
    cli("--out", "a", "--num-chunks", "3", "--save-state", "S", *FAST)
    cli("--resume", "S", "--out", "b", "--num-chunks", "3", "--no-progress")
    joined = np.concatenate([G.load_latents(str(tmp_path / "a")), G.load_latents(str(tmp_path / "b"))], axis=1)
    assert joined.tobytes() == G.load_latents(str(tmp_path / "full")).tobytes()


def test_resume_refuses_another_fps_for_the_continued_video(tmp_path, capsys):
    """Part 2's mp4 at another frame rate than part 1's would not play on as one video: --fps is a session setting
    like every other (the default toy world, with video)."""
    session = tmp_path / "S"
    first = ["--out", str(tmp_path / "a"), "--num-chunks", "2", "--save-state", str(session), "--no-progress"]
    assert G.main(first) == 0
    capsys.readouterr()
    resumed = ["--resume", str(session), "--num-chunks", "1", "--no-progress"]
    assert G.main([*resumed, "--out", str(tmp_path / "b"), "--fps", "30"]) == 2
    err = capsys.readouterr().err
    assert "--fps 30 (the session's: 16)" in err
    assert not (tmp_path / "b").exists()
    assert G.main([*resumed, "--out", str(tmp_path / "c"), "--fps", "16"]) == 0  # the session's own rate


TOY = ["--no-progress", "--no-video"]  # the shipped toy world (the default model)
P0, P1 = "a red circle and a blue square, slow", "a green triangle, fast"
# the toy world's 4 layers, every 2nd dilated, under absolute RoPE (the toy's own is cache-relative; this test
# keeps the absolute clock it was written for)
MIXED_FLAGS = ["--dilated-every", "2", "--dilation", "2", "--buckets", "2", "--rope", "absolute"]


def _schedule(path, *entries):
    path.write_text(json.dumps([{"chunk": c, "prompt": p} for c, p in entries]))
    return str(path)


@pytest.mark.parametrize(
    "cache",
    [
        [],
        pytest.param(MIXED_FLAGS, marks=pytest.mark.slow, id="mixed"),
    ],
)
def test_a_resumed_session_follows_a_prompt_schedule_as_the_uninterrupted_run(tmp_path, capsys, cache):
    """--save-state keeps the latent ring, so --resume takes a --prompt-schedule (counting this run's chunks; its
    chunk-0 entry switches only if it is not what the session was drawing): 3 + 5 chunks with a switch at stream
    chunk 4 equal one 8-chunk run switching there, bit for bit; another chunk-0 prompt switches at the resume.
    Also on a mixed dense/dilated cache, whose switches replay the held chunks."""
    full = _schedule(tmp_path / "full.json", (0, P0), (4, P1))
    assert G.main(["--out", str(tmp_path / "full"), "--num-chunks", "8", "--prompt-schedule", full, *TOY, *cache]) == 0
    first = _schedule(tmp_path / "first.json", (0, P0))
    argv = ["--out", str(tmp_path / "a"), "--num-chunks", "3", "--prompt-schedule", first, *TOY, *cache]
    assert G.main([*argv, "--save-state", str(tmp_path / "S")]) == 0
    manifest = S.read_manifest(str(tmp_path / "S"))
    assert manifest["metadata"]["text_now"] == {"prompt": P0}
    rest = _schedule(tmp_path / "rest.json", (0, P0), (1, P1))
    argv = ["--resume", str(tmp_path / "S"), "--prompt-schedule", rest, "--num-chunks", "5", *TOY[:1]]
    assert G.main([*argv, "--out", str(tmp_path / "b")]) == 0
    whole = G.load_latents(str(tmp_path / "full"))
    parts = np.concatenate([G.load_latents(str(tmp_path / n)) for n in ("a", "b")], axis=1)
    assert parts.tobytes() == whole.tobytes()
    assert [e["chunk"] for e in _summary(tmp_path / "b")["prompt_schedule"]] == [0, 1]
    # a chunk-0 entry other than the session's prompt switches at the resume: chunk 3 differs from then on
    other = _schedule(tmp_path / "other.json", (0, P1))
    argv = ["--resume", str(tmp_path / "S"), "--prompt-schedule", other, "--num-chunks", "2", *TOY[:1]]
    assert G.main([*argv, "--out", str(tmp_path / "c")]) == 0
    c = G.load_latents(str(tmp_path / "c"))
    b = G.load_latents(str(tmp_path / "b"))
    assert not np.array_equal(c[:, :3], b[:, :3])


def test_a_plain_save_resumes_with_a_schedule_and_an_old_session_is_refused(tmp_path, capsys):
    """A run without a schedule saves the ring too (a later --prompt-schedule can switch at once); a session
    without a ring (as older jaxkv saved them) is refused with a schedule, before anything is written."""
    argv = ["--out", str(tmp_path / "a"), "--num-chunks", "2", "--prompt", P0, *TOY]
    assert G.main([*argv, "--save-state", str(tmp_path / "S")]) == 0
    assert S.read_manifest(str(tmp_path / "S"))["metadata"]["text_now"] == {"prompt": P0}
    switch = _schedule(tmp_path / "switch.json", (0, P0), (1, P1))
    argv = ["--resume", str(tmp_path / "S"), "--prompt-schedule", switch, "--num-chunks", "2", *TOY[:1]]
    assert G.main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert G.load_latents(str(tmp_path / "b")).shape[1] == 6
    # the same session saved without its ring
    from jaxkv.toyworld import model as toy_model

    model = toy_model.load()
    session = S.load(str(tmp_path / "S"), model.config, model.settings.rollout_config())
    extras = {k: v for k, v in session.extras.items() if k != "latent_ring"}
    meta = S.read_metadata(str(tmp_path / "S"))
    S.save(str(tmp_path / "old"), session.replace(extras=extras), metadata=meta)
    capsys.readouterr()
    argv = ["--resume", str(tmp_path / "old"), "--prompt-schedule", switch, "--num-chunks", "2", *TOY[:1]]
    assert G.main([*argv, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "holds no latent ring" in err and "resume without --prompt-schedule" in err
    assert not (tmp_path / "c").exists()
    # and --prompt passed with a schedule is still refused on a resume
    argv = ["--resume", str(tmp_path / "S"), "--prompt-schedule", switch, "--prompt", P0, "--num-chunks", "2"]
    assert G.main([*argv, "--out", str(tmp_path / "d"), *TOY[:1]]) == 2
    assert "--prompt-schedule gives the text context; not with --prompt" in capsys.readouterr().err
