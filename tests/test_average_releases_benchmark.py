"""benchmarks/average_releases.py: the weighted average of toy-world releases' weights, written as a release that
loads and records how it was made; releases that differ in more than their weights are refused before anything is
written."""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxkv.toyworld import latents, text, world
from jaxkv.toyworld import losses as L
from jaxkv.toyworld import model as TM
from tests.helpers.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Three releases of the toy DiT from different initial weights (A, B) and one with other sampler steps (C)."""
    frames, _ = world.clips(np.random.default_rng(0), 16, 4)
    fitted = latents.LatentMap.fit(frames.reshape(-1, *frames.shape[2:]))
    root = tmp_path_factory.mktemp("releases")
    made = {}
    for name, seed, settings in (
        ("a", 0, TM.Settings()),
        ("b", 1, TM.Settings()),
        ("c", 2, dataclasses.replace(TM.Settings(), steps=(1000, 500))),
    ):
        made[name] = str(root / name)
        info = {"training": {"seed": seed}, "finetune": {"stage": f"made for the test ({name})"}}
        TM.save(made[name], L.init_dit(jax.random.key(seed)), text.init_text_params(seed), fitted, settings, info)
    return made


def _stored(release):
    """The DiT's weights as stored (bfloat16 read as float32) and the text encoder's, flattened by path."""
    from jaxkv.models import umt5
    from jaxkv.models.release import PARTS

    toy = TM.load(release)
    _, text_params, _ = umt5.load(f"{release}/{PARTS['umt5']}", dtype=np.float32)
    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    return flat(toy.params), flat(text_params)


def test_the_average_is_each_weight_mixed_by_its_share_and_records_its_parts(releases, tmp_path, capsys):
    bench = load_benchmark("average_releases")
    out = str(tmp_path / "avg")
    assert bench.main(["--out", out, f"{releases['a']}:0.25", f"{releases['b']}:0.75"]) == 0
    assert "wrote" in capsys.readouterr().out
    (dit_a, text_a), (dit_b, text_b), (dit, text_avg) = map(_stored, (releases["a"], releases["b"], out))
    assert dit.keys() == dit_a.keys() and text_avg.keys() == text_a.keys()
    for key in dit:  # float32 mix of the stored weights, rounded to the bfloat16 the release stores
        mixed = (0.25 * dit_a[key] + 0.75 * dit_b[key]).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_allclose(dit[key], mixed, rtol=2**-7, atol=1e-30, err_msg=key)
    moved = [k for k in dit if not np.array_equal(dit_a[k], dit_b[k])]
    assert moved and all(not np.array_equal(dit[k], dit_a[k]) and not np.array_equal(dit[k], dit_b[k]) for k in moved)
    for key in text_avg:
        np.testing.assert_allclose(text_avg[key], 0.25 * text_a[key] + 0.75 * text_b[key], rtol=1e-6, err_msg=key)
    toy = TM.load(out)
    assert toy.settings == TM.Settings() and toy.info["training"] == {"seed": 0}  # the first part's training record
    record = toy.info["average"]
    assert [(p["release"], p["weight"]) for p in record["parts"]] == [(releases["a"], 0.25), (releases["b"], 0.75)]
    assert record["parts"][1]["record"] == TM.load(releases["b"]).info  # each part's whole record
    assert record["command"].startswith("python benchmarks/average_releases.py --out ")
    assert "finetune" not in toy.info  # the parts' fine-tunes are under "average", not claimed as its own


def test_averaging_refuses_what_it_cannot_mix_before_writing_anything(releases, tmp_path, capsys):
    bench = load_benchmark("average_releases")
    a, b, c = releases["a"], releases["b"], releases["c"]
    out = tmp_path / "avg"
    assert bench.main(["--out", str(out), f"{a}:0.5", f"{b}:0.4"]) == 2
    assert "must add up to 1, got 0.9" in capsys.readouterr().err
    assert bench.main(["--out", str(out), f"{a}:1"]) == 2
    assert "at least two releases" in capsys.readouterr().err
    assert bench.main(["--out", str(out), f"{a}:0.5", f"{c}:0.5"]) == 2
    assert "differs from" in (err := capsys.readouterr().err) and "settings" in err
    assert bench.main(["--out", a, f"{a}:0.5", f"{b}:0.5", "--overwrite"]) == 2
    assert "is one of the releases averaged" in capsys.readouterr().err
    assert bench.main(["--out", str(out), f"{a}:0.5", f"{tmp_path / 'none'}:0.5"]) == 2
    assert "is not a toy-world release" in capsys.readouterr().err
    assert bench.main(["--out", str(tmp_path), f"{a}:0.5", f"{b}:0.5"]) == 2  # exists
    assert "exists; pass --overwrite" in capsys.readouterr().err
    for bad in (f"{a}:0", f"{a}:-0.5", f"{a}:nan", f"{a}:half", a):
        with pytest.raises(SystemExit):
            bench.main(["--out", str(out), bad, f"{b}:0.5"])
        assert "RELEASE:WEIGHT" in (err := capsys.readouterr().err) or "weight of" in err
    assert not out.exists()
