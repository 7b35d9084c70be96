"""benchmarks/motion.py: the stream readings, the next chunk on canonical and random scenes, --sampler-steps."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmarks import load_benchmark

motion = load_benchmark("motion")


@pytest.mark.slow
def test_motion_writes_every_prompt_and_both_next_chunk_readings_with_the_steps_it_used(tmp_path, capsys):
    path = tmp_path / "motion.json"
    assert motion.main(["--frames", "30", "--sampler-steps", "1000,500", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["settings"]["sampler_steps"] == [1000, 500]
    named = sum(len(p.split(" and ")) for p in motion.PROMPTS)
    assert len(out["rows"]) == named
    for row in out["rows"]:  # 30 frames: the world's shapes cover a few px of the box, never none
        assert row["world_roam_px"] > 1
        assert row["roam_ratio"] == pytest.approx(row["model_roam_px"] / row["world_roam_px"], nan_ok=True)
    for scenes in ("canonical", "random"):
        step = out["next_chunk"][scenes]
        assert len(step["model"]) == len(step["still"]) == len(step["world"]) == 3
        assert max(step["world"]) <= 0.5  # each scene's frames are read against that scene's own paths
    assert "random scenes" in capsys.readouterr().out


@pytest.mark.parametrize("steps", ["1000,1000", "500,750", "1000,0", "1001", "a,b"])
def test_motion_refuses_sampler_steps_that_do_not_fall_within_1000_to_0(steps, capsys):
    with pytest.raises(SystemExit) as e:
        motion.main(["--frames", "30", "--sampler-steps", steps])
    assert e.value.code == 2 and "--sampler-steps" in capsys.readouterr().err
