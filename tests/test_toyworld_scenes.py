"""Training clips of random scenes (`TrainConfig.scenes`, ``jaxkv toyworld train --scenes random``, issue 44): each
clip shows its prompt's shapes, colours and speed at a random start, reproducibly from (seed, stage, step), while
the canonical clips (the shipped recipe) stay what they were."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from jaxkv.toyworld import clips as C
from jaxkv.toyworld import latents, metric, text, world
from jaxkv.toyworld.model import Settings

SIZE = 12  # clips per batch drawn here


@pytest.fixture(scope="module")
def fitted():
    frames, _ = world.clips(np.random.default_rng(0), 64, 4)
    return latents.LatentMap.fit(frames.reshape(-1, *frames.shape[2:]))


def _draw(fitted, scenes, step=2, after_sink=None):
    return C.batch(fitted, text.tokenizer(), Settings(), 0, 3, step, SIZE, 0.5, 0.0, after_sink, scenes)


def _first_frame_centres(fitted, clips: C.Batch) -> list[np.ndarray]:
    """Per clip, float [named objects, 2]: each named object's detected centre in the clip's first frame (the
    sink's), in prompt order; every named object must be found there, as the shape its row names."""
    found = metric.detect(np.asarray(fitted.decode_uint8(clips.latents[:, 0])))
    out = []
    for objects, present, shape, centre in zip(clips.objects, found.present, found.shape, found.centroid):
        named = objects[objects[:, 0] >= 0]
        assert sorted(named[:, 0]) == list(np.flatnonzero(present))  # world.COLOURS order = metric's
        assert [shape[c] for c in named[:, 0]] == list(named[:, 1])
        out.append(centre[named[:, 0]])
    return out


def test_random_clips_show_the_prompts_shapes_at_random_starts_and_share_every_other_draw(fitted):
    canonical, random = _draw(fitted, "canonical"), _draw(fitted, "random")
    # the prompts, captions, layout and named objects are the canonical batch's draws; only the scenes differ
    for a, b in zip(canonical[1:], random[1:], strict=True):
        np.testing.assert_array_equal(a, b)
    starts = np.asarray(world.CANONICAL_STARTS, dtype=object)
    near, far = [], []
    for clips, distances in ((canonical, near), (random, far)):
        for centres in _first_frame_centres(fitted, clips):
            for k, centre in enumerate(centres):
                distances.append(np.hypot(*(centre - np.asarray(starts[k][0]))))
    # the canonical sink shows every shape at its canonical start; the random sinks almost never do
    assert max(near) < 1.5, near
    assert np.median(far) > 8.0 and sum(d < 3.0 for d in far) <= 1, far
    first = np.stack([c[0] for c in _first_frame_centres(fitted, random)])  # each clip's first-named shape
    assert np.ptp(first[:, 0]) > 15 and np.ptp(first[:, 1]) > 15  # spread over the box, not one place
    assert not np.array_equal(canonical.latents, random.latents)


def test_random_clips_are_a_function_of_seed_stage_and_step(fitted):
    a, b, other = _draw(fitted, "random"), _draw(fitted, "random"), _draw(fitted, "random", step=3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.latents, other.latents)
    # a clip's scene is its own draw: self-forcing's longer clips of a step show the same scenes run on
    long = _draw(fitted, "random", after_sink=15)
    cache = Settings().sink_frames + Settings().window_frames
    np.testing.assert_array_equal(long.latents[:, :cache], a.latents)
    # clip i's scene is `world.sample_scene` of its prompt from the generator seeded (seed, stage, step, i)
    rng = np.random.default_rng([0, 3, 2])
    prompts = [world.random_prompt(rng) for _ in range(SIZE)]  # batch's first draws
    for i, (prompt, centres) in enumerate(zip(prompts, _first_frame_centres(fitted, a))):
        scene = world.sample_scene(np.random.default_rng([0, 3, 2, i]), prompt)
        assert scene.prompt == prompt and len(centres) == len(scene.things)
        for centre, thing in zip(centres, scene.things):
            assert np.hypot(*(centre - np.asarray(thing.position))) < 1.5


def test_mixed_clips_are_random_or_canonical_clip_by_clip_from_each_clips_own_generator(fitted):
    canonical, random, mixed = _draw(fitted, "canonical"), _draw(fitted, "random"), _draw(fitted, "mixed")
    # prompts, captions, layout and objects: the canonical batch's first draws
    for a, b in zip(canonical[1:], mixed[1:], strict=True):
        np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng([0, 3, 2])
    prompts = [world.random_prompt(rng) for _ in range(SIZE)]
    kinds = []
    for i, (prompt, centres) in enumerate(zip(prompts, _first_frame_centres(fitted, mixed))):
        own = np.random.default_rng([0, 3, 2, i])
        is_random = own.random() < C.MIXED_RANDOM_SHARE
        scene = world.sample_scene(own, prompt) if is_random else world.canonical_scene(prompt)
        for centre, thing in zip(centres, scene.things):
            assert np.hypot(*(centre - np.asarray(thing.position))) < 1.5
        if is_random:  # not the random batch's scene either: its generator has made one draw more
            assert not np.array_equal(mixed.latents[i], canonical.latents[i])
            assert not np.array_equal(mixed.latents[i], random.latents[i])
        else:
            np.testing.assert_array_equal(mixed.latents[i], canonical.latents[i])
        kinds.append(is_random)
    assert 0 < sum(kinds) < SIZE, kinds  # both kinds in one batch


def test_scenes_is_checked_by_the_batch_the_config_and_the_cli_before_anything_is_written(fitted, tmp_path, capsys):
    from jaxkv.toyworld import cli
    from jaxkv.toyworld import train as T

    with pytest.raises(ValueError, match=r"scenes is one of \('canonical', 'random', 'mixed'\), got 'sampled'"):
        _draw(fitted, "sampled")
    for bad in ("Random", None, ["random"]):
        with pytest.raises(ValueError, match="TrainConfig.scenes is one of"):
            T.TrainConfig(scenes=bad)
    assert T.TrainConfig().scenes == "canonical" and T.TrainConfig(scenes="random").scenes == "random"
    out = tmp_path / "release"
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--out", str(out), "--scenes", "sampled"])
    assert stop.value.code == 2 and "--scenes: invalid choice: 'sampled'" in capsys.readouterr().err
    assert not out.exists() and not os.path.exists(str(out) + ".partial")


def test_resuming_with_other_scenes_is_refused_and_old_snapshots_read_as_canonical():
    from jaxkv.toyworld import train as T

    def position(stage, step, **config):
        return {"stage": stage, "step": step, "train_config": {**dataclasses.asdict(T.TrainConfig()), **config}}

    random = T.TrainConfig(scenes="random")
    assert T.resume_conflicts(position(0, 0), random) == []  # nothing begun yet
    for stage in (0, 1, 2):  # every stage's clips
        assert T.resume_conflicts(position(stage, 1), random) == [("scenes", "canonical", "random")]
    assert T.resume_conflicts(position(2, 1, scenes="random"), random) == []
    old = position(2, 4)
    del old["train_config"]["scenes"]  # a snapshot from before the field: its clips were canonical
    assert T.resume_conflicts(old, T.TrainConfig()) == []
    assert T.resume_conflicts(old, random) == [("scenes", "canonical", "random")]


@pytest.mark.slow
def test_a_random_scenes_run_trains_every_stage_on_its_own_clips(tmp_path, monkeypatch):
    """`train` hands ``scenes`` to every stage's clips (self-forcing's included) and records it; a random-scenes
    run and a canonical one of the same config take other steps."""
    from safetensors.numpy import load_file

    from jaxkv.toyworld import train as T

    seen = []
    draw = T.batch

    def recording(*args):
        seen.append((args[4], args[-1]))  # (stage, scenes)
        return draw(*args)

    monkeypatch.setattr(T, "batch", recording)
    # (a stage's first step has learning rate 0 (warm-up): 2 teacher-forcing steps change the weights)
    small = dict(steps=2, refine_steps=1, refine_warmup=1, sf_steps=1, sf_chunks=1, batch=1, sf_batch=1)
    small.update(fit_frames=64, warmup=1, dit_dim=32, dit_ffn_dim=32, dit_heads=1, dit_layers=1)
    records = {}
    for scenes in ("random", "canonical"):
        records[scenes] = T.train(str(tmp_path / scenes), T.TrainConfig(scenes=scenes, **small), progress=False)
    stages = [1, 1, 2, 3]
    assert seen == [(s, "random") for s in stages] + [(s, "canonical") for s in stages]
    assert records["random"]["train_config"]["scenes"] == "random"
    weights = {s: load_file(str(tmp_path / s / "dit" / "params.safetensors")) for s in records}
    assert any(not np.array_equal(weights["random"][k], weights["canonical"][k]) for k in weights["canonical"])
