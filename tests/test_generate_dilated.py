"""``jaxkv generate --dilated-every/--dilation/--buckets``: the flags reach the rollout, and bad combinations are one
clear line before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxkv.generate as G

RANDOM = ["--preset", "tiny", "--random-weights"]  # the 2-layer random-weight model
FAST = [
    *RANDOM,
    "--num-chunks",
    "3",
    "--no-progress",
    "--no-video",
    "--chunk-frames",
    "1",
    "--sink-frames",
    "0",
    "--window-frames",
    "2",
    "--height",
    "8",
    "--width",
    "8",
]


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--dilation", "2"], "--dilation needs --dilated-every"),
        (["--buckets", "2"], "--buckets needs --dilated-every"),
        (["--dilated-every", "2", "--dilation", "2"], "--dilated-every needs --dilation and --buckets"),
        (["--dilated-every", "-1"], "--dilated-every: expected an int >= 0"),
        (["--dilated-every", "3", "--dilation", "2", "--buckets", "2"], "2 layers is not a multiple of 3"),
        (["--dilated-every", "1", "--dilation", "2", "--buckets", "2", "--sink-frames", "3"], "has no sink"),
        (["--dilated-every", "2", "--dilation", "1", "--buckets", "2"], "buckets (2) must be >= ceil"),
    ],
)
def test_bad_dilated_flags_print_one_clear_line(tmp_path, capsys, argv, expect):
    out = tmp_path / "out"
    code = G.main(["--out", str(out), "--no-progress", *RANDOM, *argv])
    err = capsys.readouterr().err
    assert code == 2 and expect in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.slow  # two generations of the tiny model
def test_dilation_one_layers_reproduce_the_dense_window(tmp_path):
    # a dilated layer with dilation 1 and as many buckets as the window keeps the dense window's frames
    assert G.main(["--out", str(tmp_path / "dense"), *FAST]) == 0
    assert (
        G.main(["--out", str(tmp_path / "mixed"), *FAST, "--dilated-every", "2", "--dilation", "1", "--buckets", "2"])
        == 0
    )
    summary = json.loads((tmp_path / "mixed" / "summary.json").read_text())
    assert (summary["dilated_every"], summary["dilation"], summary["buckets"]) == (2, 1, 2)
    dense, mixed = G.load_latents(str(tmp_path / "dense")), G.load_latents(str(tmp_path / "mixed"))
    np.testing.assert_allclose(mixed, dense, rtol=1e-5, atol=1e-5 * np.abs(dense).max())
