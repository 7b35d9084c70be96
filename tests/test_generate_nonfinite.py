"""Non-finite numbers never pass `jaxkv generate` silently: NaN/Inf in a context file or in the parameters is refused
before generating (exit 2, nothing written); latents that turn NaN/Inf stop the run (exit 1) with the chunks before
them written and the files finished."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import generate as G
from jaxkv.generate import loop
from jaxkv.models import wan
from jaxkv.models.wan import checkpoint

FAST = ["--num-chunks", "3", "--no-progress", "--no-video"]  # the mp4 path: test_generate_media.py
RANDOM = ["--preset", "tiny", "--random-weights"]  # the random-weight model


@pytest.mark.parametrize("flag", ["--context", "--negative-context"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_context_file_is_refused(tmp_path, capsys, flag, bad):
    config = wan.preset("tiny")
    ctx = G.standin_context(0, config.text_dim, config.text_len)
    np.save(tmp_path / "good.npy", ctx)
    ctx[5, 7] = bad
    np.save(tmp_path / "bad.npy", ctx)
    files = {"--context": "good.npy", "--negative-context": "good.npy", flag: "bad.npy"}
    argv = [
        "--out",
        str(tmp_path / "o"),
        *RANDOM,
        *FAST,
        "--guidance-scale",
        "3",
        "--context",
        str(tmp_path / files["--context"]),
        "--negative-context",
        str(tmp_path / files["--negative-context"]),
    ]
    assert G.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} in" in err and "1 NaN/Inf value(s), the first at token 5, channel 7" in err
    assert not (tmp_path / "o").exists()


def test_nonfinite_parameters_are_refused_naming_the_leaf(tmp_path, capsys):
    config = wan.preset("tiny")
    params = wan.init_params(config, jax.random.key(0))
    params["blocks"]["ffn"]["fc1"]["kernel"] = params["blocks"]["ffn"]["fc1"]["kernel"].at[1, 2, 3].set(jnp.nan)
    params["head"]["modulation"] = params["head"]["modulation"].at[0, 0].set(jnp.inf)
    checkpoint.save(str(tmp_path / "ckpt"), config, params)
    assert G.main(["--out", str(tmp_path / "o"), *FAST, "--checkpoint", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "NaN or Inf values in blocks.ffn.fc1.kernel, head.modulation" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_latents_that_overflow_stop_the_run(tmp_path, capsys):
    """Finite but absurd weights (1e38) overflow in the first forward: the first chunk is NaN/Inf."""
    config = wan.preset("tiny")
    params = wan.init_params(config, jax.random.key(0))
    params["patch_embedding"]["kernel"] = jnp.full_like(params["patch_embedding"]["kernel"], 1e38)
    checkpoint.save(str(tmp_path / "ckpt"), config, params)
    out = tmp_path / "o"
    assert G.main(["--out", str(out), *FAST, "--checkpoint", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert "chunk 0 holds NaN/Inf latents" in err and "Traceback" not in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["chunks"] == 0 and "chunk 0" in manifest["reason"]
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"
    assert G.load_latents(str(out)).shape[1] == 0


@pytest.mark.slow
def test_a_later_nonfinite_chunk_keeps_the_chunks_before_it(tmp_path, capsys, monkeypatch):
    """The loop's handling of a bad chunk k > 0 (the check itself is pinned by the test above): chunks 0..k-1 are
    written and loadable, the files say why the run stopped."""
    real = loop._chunk_finite
    calls = []

    def third_is_bad(x):
        calls.append(1)
        return real(x) if len(calls) != 3 else jnp.asarray(False)

    monkeypatch.setattr(loop, "_chunk_finite", third_is_bad)
    out = tmp_path / "o"
    assert G.main(["--out", str(out), *RANDOM, "--num-chunks", "5", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "chunk 2 holds NaN/Inf latents" in err and "chunks 0..1 are written" in err
    assert G.load_latents(str(out)).shape[1] == 6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["chunks_written"] == 2
