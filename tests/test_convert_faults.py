"""`jaxkv convert` under faults: a stop signal that lands where Python cannot raise it (inside a garbage-collection
callback or a ``__del__``, where JAX runs code of its own) still stops the conversion; sizes no model can run are
refused. Every test here failed before its fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors.numpy import save_file

from tests.helpers.wan_checkpoints import CFG, diffusers_name, leftovers, random_original

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The signal is sent by the process to itself from inside a finaliser, so its handler runs there: Python prints
# "Exception ignored in ..." for an exception raised in a finaliser (or a gc callback, as JAX's) and carries on.
# That is where a SIGTERM landed that made a conversion print a traceback, finish and exit 0.
_SIGNAL_IN_A_FINALISER = """
import os, signal, sys
from jaxkv.convert import cli, sources
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
signum, calls, real = getattr(signal, sys.argv[1]), [], sources.SafetensorsSource.read

class Finaliser:
    def __del__(self):
        os.kill(os.getpid(), signum)
        for _ in range(10000):  # the handler runs at the next check, here, inside the finaliser
            pass

def read(self, key):
    calls.append(key)
    if len(calls) == 5:
        Finaliser()  # dropped at once: its __del__ runs now
    return real(self, key)

sources.SafetensorsSource.read = read
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_landing_in_a_finaliser_still_stops_the_conversion(tmp_path, signame, code):
    src = tmp_path / "transformer"
    src.mkdir()
    save_file(
        {diffusers_name(k): v for k, v in random_original(CFG).items()},
        str(src / "diffusion_pytorch_model.safetensors"),
    )
    dst = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _SIGNAL_IN_A_FINALISER,
            signame,
            str(src),
            str(dst),
            "--num-heads",
            "2",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    err = proc.stderr.strip()
    assert proc.returncode == code, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    last = err.splitlines()[-1]
    assert last.endswith("nothing was written") and (signame in last or signame == "SIGINT"), err
    assert not dst.exists() and not leftovers(tmp_path)


def test_an_impossible_text_len_is_refused_at_conversion(tmp_path, capsys):
    from jaxkv.convert import cli

    src = tmp_path / "m.safetensors"
    save_file(random_original(CFG), str(src))
    dst = tmp_path / "out"
    assert cli.main([str(src), str(dst), "--num-heads", "2", "--text-len", "100000000000", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err == "jaxkv convert: error: WanConfig.text_len must be at most 65536 (no model is larger), got 100000000000"
    )
    assert not dst.exists() and not leftovers(tmp_path)


def test_model_configs_refuse_sizes_no_model_has():
    import dataclasses

    from jaxkv.models.umt5.config import PRESETS as UMT5_PRESETS
    from jaxkv.models.wan.config import PRESETS

    for field, value in (("text_len", 2**16 + 1), ("dim", 2**31), ("num_layers", 10**6), ("ffn_dim", 10**12)):
        with pytest.raises(ValueError, match=f"WanConfig.{field} must be at most"):
            dataclasses.replace(PRESETS["tiny"], **{field: value})
    assert dataclasses.replace(PRESETS["tiny"], text_len=2**16).text_len == 2**16  # the limit itself is fine
    with pytest.raises(ValueError, match="UMT5Config.text_len must be <= 65536"):
        dataclasses.replace(UMT5_PRESETS["tiny"], text_len=100_000_000_000)
