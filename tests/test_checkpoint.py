"""The jaxkv Wan checkpoint directory: save/load round trips, atomic replacement and load errors."""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.models.wan import checkpoint
from jaxkv.models.wan.checkpoint import CheckpointError, load, save
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import flatten, param_shapes

CFG = WanConfig(
    dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=24, text_len=8, freq_dim=16
)


def random_params(config: WanConfig, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.standard_normal(s).astype(dtype),
        param_shapes(config),
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x),
    )


def assert_same(a, b):
    fa, fb = flatten(a), flatten(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert np.asarray(fa[k]).dtype == np.asarray(fb[k]).dtype, k
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_round_trip(tmp_path, dtype):
    params = random_params(CFG, dtype=dtype)
    save(str(tmp_path / "ck"), CFG, params)
    config, loaded = load(str(tmp_path / "ck"))
    assert config == CFG
    assert all(isinstance(v, jax.Array) for v in flatten(loaded).values())
    assert_same(loaded, params)
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert stored.pop("format") == "jaxkv-wan" and stored.pop("format_version") == 1
    assert WanConfig.from_dict(stored) == CFG


def test_load_casts(tmp_path):
    params = random_params(CFG)
    save(str(tmp_path / "ck"), CFG, jax.tree.map(jnp.asarray, params))  # jax arrays are accepted too
    _, loaded = load(str(tmp_path / "ck"), dtype=jnp.bfloat16)
    want = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), params)
    assert_same(loaded, want)


def test_save_validates_before_writing(tmp_path):
    params = random_params(CFG)
    params["blocks"]["ffn"]["fc1"]["kernel"] = np.zeros((2, 32, 47), np.float32)
    with pytest.raises(ValueError, match=r"blocks.ffn.fc1.kernel: expected shape \(2, 32, 48\), found \(2, 32, 47\)"):
        save(str(tmp_path / "ck"), CFG, params)
    assert os.listdir(tmp_path) == []


def test_save_is_atomic_and_needs_force(tmp_path):
    save(str(tmp_path / "ck"), CFG, random_params(CFG, 0))
    with pytest.raises(FileExistsError):
        save(str(tmp_path / "ck"), CFG, random_params(CFG, 1))
    save(str(tmp_path / "ck"), CFG, random_params(CFG, 1), force=True)
    assert_same(load(str(tmp_path / "ck"))[1], random_params(CFG, 1))
    assert os.listdir(tmp_path) == ["ck"]

    # An exception while writing removes the temporary directory and keeps the old checkpoint.
    with pytest.raises(RuntimeError):
        with checkpoint.atomic_directory(str(tmp_path / "ck"), force=True) as tmp:
            open(os.path.join(tmp, "partial"), "w").close()
            raise RuntimeError("disk full")
    assert os.listdir(tmp_path) == ["ck"]
    assert_same(load(str(tmp_path / "ck"))[1], random_params(CFG, 1))


def _broken(tmp_path, how: str) -> str:
    path = tmp_path / "ck"
    save(str(path), CFG, random_params(CFG))
    cfg_file, params_file = path / "config.json", path / "params.safetensors"
    stored = json.loads(cfg_file.read_text())
    if how == "no config":
        cfg_file.unlink()
    elif how == "foreign config":
        cfg_file.write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    elif how == "future version":
        cfg_file.write_text(json.dumps({**stored, "format_version": 99}))
    elif how == "bad field":
        cfg_file.write_text(json.dumps({**stored, "dim": 33}))
    elif how == "no params":
        params_file.unlink()
    elif how == "truncated params":
        params_file.write_bytes(params_file.read_bytes()[:-8])
    elif how == "wrong layers":
        cfg_file.write_text(json.dumps({**stored, "num_layers": 3}))
    with pytest.raises(CheckpointError) as e:
        load(str(path))
    return str(e.value)


@pytest.mark.parametrize(
    "how, expect",
    [
        ("no config", "config.json is missing"),
        ("foreign config", "jaxkv convert"),
        ("future version", "format_version 99"),
        ("bad field", "divisible by num_heads"),
        ("no params", "params.safetensors is missing"),
        ("truncated params", "truncated or corrupt"),
        ("wrong layers", "blocks.ffn.fc1.kernel: expected shape (3, 32, 48), found (2, 32, 48)"),
    ],
)
def test_load_errors(tmp_path, how, expect):
    assert expect in _broken(tmp_path, how)


def test_load_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="jaxkv convert"):
        load(str(tmp_path / "nothing"))


# ------------------------------------------------------------------ jaxkv.files: the rules every writer shares

from jaxkv import files


def _fake_stale(parent, name: str, pid: int, *, old: bool = False, start=None, host=None):
    """A temporary directory as a writer killed mid-way leaves it (the marker names its process)."""
    import socket

    tmp = parent / f".{name}.tmp-deadbeef"
    (tmp / "new").mkdir(parents=True)
    (tmp / "new" / "params.safetensors").write_bytes(b"partial")
    (tmp / files.MARKER).write_text(json.dumps({"pid": pid, "start": start, "host": host or socket.gethostname()}))
    if old:
        save(str(tmp / "old"), CFG, random_params(CFG, 3))
    return tmp


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no such process now (pids are not reused this quickly)


def test_remove_stale_removes_only_dead_writers_temporaries(tmp_path):
    dead = _dead_pid()
    stale = _fake_stale(tmp_path, "ck", dead)
    live = _fake_stale(tmp_path, "ck2", os.getpid())  # a running writer (this process): kept
    other_host = _fake_stale(tmp_path, "ck3", dead, host="elsewhere")  # cannot tell on a shared disk: kept
    unmarked = tmp_path / ".ck.tmp-cafef00d"  # our name pattern but no marker: not ours, kept
    unmarked.mkdir()
    assert files.remove_stale(str(tmp_path / "ck")) == [f"removed {stale}, left by an interrupted write (pid {dead})"]
    assert not stale.exists() and unmarked.exists()
    assert files.remove_stale(str(tmp_path / "ck2")) == [] and live.exists()
    assert files.remove_stale(str(tmp_path / "ck3")) == [] and other_host.exists()
    # A reused pid (alive, but started at another time than the writer) does not keep a stale directory.
    reused = _fake_stale(tmp_path, "ck4", os.getpid(), start="1")
    if os.path.exists(f"/proc/{os.getpid()}/stat"):
        assert files.remove_stale(str(tmp_path / "ck4")) and not reused.exists()


def test_remove_stale_restores_a_checkpoint_caught_between_the_two_renames(tmp_path):
    stale = _fake_stale(tmp_path, "ck", _dead_pid(), old=True)
    messages = files.remove_stale(str(tmp_path / "ck"))
    assert messages[0] == f"restored {tmp_path / 'ck'} from {stale} (a replacement was interrupted)"
    assert_same(load(str(tmp_path / "ck"))[1], random_params(CFG, 3))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_atomic_directory_puts_the_old_one_back_if_the_final_rename_fails(tmp_path, monkeypatch):
    save(str(tmp_path / "ck"), CFG, random_params(CFG, 0))
    real_rename, calls = os.rename, []

    def rename(a, b):
        calls.append((a, b))
        if len(calls) == 2:  # old moved aside; the new one cannot be moved in
            raise OSError("disk vanished")
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="disk vanished"):
        save(str(tmp_path / "ck"), CFG, random_params(CFG, 1), force=True)
    monkeypatch.setattr(os, "rename", real_rename)
    assert os.listdir(tmp_path) == ["ck"]
    assert_same(load(str(tmp_path / "ck"))[1], random_params(CFG, 0))


def test_save_force_replaces_only_a_checkpoint_or_an_empty_directory(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("mine")
    with pytest.raises(files.DestinationError, match=r"a\.txt"):
        save(str(tmp_path / "docs"), CFG, random_params(CFG), force=True)
    assert os.listdir(tmp_path / "docs") == ["a.txt"] and sorted(os.listdir(tmp_path)) == ["docs"]
    (tmp_path / "empty").mkdir()
    save(str(tmp_path / "empty"), CFG, random_params(CFG), force=True)
    assert sorted(os.listdir(tmp_path / "empty")) == ["config.json", "params.safetensors"]


def test_signals_as_exceptions_takes_over_only_default_handlers():
    import signal

    with files.signals_as_exceptions():
        with pytest.raises(files.Terminated) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                pass
    assert e.value.exit_code == 143 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    seen = []
    previous = signal.signal(signal.SIGHUP, lambda s, f: seen.append(s))
    try:
        with files.signals_as_exceptions():
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(1000):
                pass
        assert seen == [signal.SIGHUP]  # the program's own handler still ran, no exception
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_directory_problem_names_what_is_wrong(tmp_path):
    save(str(tmp_path / "ck"), CFG, random_params(CFG))
    assert checkpoint.replace_problem(str(tmp_path / "ck")) is None
    (tmp_path / "ck" / "sub").mkdir()
    assert "sub" in checkpoint.replace_problem(str(tmp_path / "ck"))
    os.rmdir(tmp_path / "ck" / "sub")
    os.remove(tmp_path / "ck" / "params.safetensors")
    assert "lacks params.safetensors" in checkpoint.replace_problem(str(tmp_path / "ck"))
    generic = files.directory_problem(str(tmp_path / "ck"), required=("config.json",))
    assert generic is None  # any "jaxkv-..." format marker, for writers of other kinds


def test_read_array_casts_in_blocks_exactly_like_numpy(tmp_path):
    from safetensors.numpy import save_file

    from jaxkv import safetensors_io

    rng = np.random.default_rng(0)
    data = {
        "a": rng.standard_normal((37, 11)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float64),
        "c": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
        "e": np.zeros((0, 3), np.float32),
    }
    save_file(data, str(tmp_path / "t.safetensors"))
    infos, _ = safetensors_io.read_header(str(tmp_path / "t.safetensors"))
    for key, want in data.items():
        for dtype in (None, np.float32, ml_dtypes.bfloat16):
            got = safetensors_io.read_array(str(tmp_path / "t.safetensors"), infos[key], dtype, block_bytes=24)
            ref = want if dtype is None else want.astype(dtype)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8), err_msg=f"{key} {dtype}")


def test_remove_stale_removes_an_old_unreadable_marker_of_ours_and_keeps_a_fresh_one(tmp_path):
    # A kill while the marker was written used to leave a 0-byte marker that no later write could clean up.
    old = tmp_path / ".ck.tmp-0badf00d"
    old.mkdir()
    (old / files.MARKER).write_text("")
    past = time.time() - 2 * files._UNREADABLE_MARKER_AGE_S
    os.utime(old / files.MARKER, (past, past))
    fresh = tmp_path / ".ck.tmp-0badbeef"  # may be a writer still writing it: kept
    fresh.mkdir()
    (fresh / files.MARKER).write_text('{"pid"')
    messages = files.remove_stale(str(tmp_path / "ck"))
    assert messages == [f"removed {old}, left by an interrupted write (pid None)"]
    assert not old.exists() and fresh.exists()


def test_atomic_directory_writes_its_marker_under_its_name_only_when_complete(tmp_path):
    with files.atomic_directory(str(tmp_path / "out")) as new:
        tmp = os.path.dirname(new)
        assert sorted(os.listdir(tmp)) == sorted([files.MARKER, os.path.basename(new)])
        assert json.loads(open(os.path.join(tmp, files.MARKER)).read())["pid"] == os.getpid()
