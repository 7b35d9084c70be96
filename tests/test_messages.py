"""Messages that say what is wrong: each case here was once answered by a message about something else."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxkv import generate as G
from jaxkv.convert import cli as convert_cli
from jaxkv.toyworld import cli as toy_cli

RANDOM = ["--random-weights", "--no-progress", "--no-video", "--num-chunks", "1"]


@pytest.mark.parametrize(
    "main, argv",
    [
        (G.main, ["--precision", "float16"]),
        (G.main, ["--bogus"]),
        (toy_cli.main, ["train", "--bogus"]),
        (convert_cli.main, ["--bogus"]),
    ],
)
def test_argument_errors_are_one_line_pointing_at_help(main, argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "error:" in err and "--help)" in err and "usage:" not in err


def test_a_symlink_as_out_is_named_as_a_symlink(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert G.main([*RANDOM, "--out", str(tmp_path / "link")]) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link (to " in err and "not a directory" not in err
    assert os.listdir(tmp_path / "real") == []


def test_save_state_into_the_output_directory_says_so(tmp_path, capsys):
    out = str(tmp_path / "X")
    assert G.main([*RANDOM, "--out", out, "--save-state", out]) == 2
    err = capsys.readouterr().err
    assert "--save-state" in err and "is the --out directory" in err and "source" not in err
    assert not os.path.exists(out)


def test_a_text_file_named_npy_is_not_called_pickled_data(tmp_path, capsys):
    fake = tmp_path / "ctx.npy"
    fake.write_text("hello\n")
    assert G.main([*RANDOM, "--out", str(tmp_path / "o"), "--context", str(fake)]) == 2
    err = capsys.readouterr().err
    assert "is not a .npy array file" in err and "allow_pickle" not in err
    np.save(tmp_path / "ok.npy", np.zeros((2, 16), np.float32))  # a real array file still reads


def test_toyworld_train_names_the_flag_not_the_python_argument(tmp_path, capsys):
    (tmp_path / "release").mkdir()
    assert toy_cli.main(["train", "--out", str(tmp_path / "release")]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite" in err and "force=True" not in err


def test_help_names_the_toy_worlds_own_rope():
    from jaxkv.generate import options

    text = " ".join(options.build_parser().format_help().split())
    group = text[text.index("video and cache (frames are latent frames):") :]
    note = group[: group.index("--height HEIGHT")]  # the group's note, before its first flag
    assert "--rope" in note and "cache-relative" in note
