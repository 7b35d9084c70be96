"""The quality bar (`jaxkv.toyworld.quality`): the world's own clips clear it, random weights do not, the shipped
model does not yet (strict xfail); `tracking` against the world's own scenes."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxkv.models import wan
from jaxkv.toyworld import model as toy_model
from jaxkv.toyworld import metric, quality, world


@pytest.fixture(scope="module")
def shipped():
    return toy_model.load()


def test_the_worlds_own_clips_score_at_the_top(shipped):
    videos = quality.world_videos(shipped)
    report = quality.scores_of(videos, quality.PROMPTS, shipped.settings.chunk_frames)
    assert report.overall >= 0.95 and report.passed


def test_tracking_scores_the_canonical_scene_and_not_other_motion(shipped):
    truth = quality.world_videos(shipped, canonical=True)
    elsewhere = quality.world_videos(shipped)                    # the same prompts, random layouts and headings
    frozen = np.repeat(truth[:, :1], truth.shape[1], axis=1)     # the right first frame, never moving
    for video, other, still, prompt in zip(truth, elsewhere, frozen, quality.PROMPTS):
        assert quality.tracking(video, prompt) >= 0.9, prompt  # under 1 only where shapes cross
        assert quality.tracking(other, prompt) <= 0.1, prompt
        assert quality.tracking(still, prompt) <= 0.15, prompt


def test_a_shape_lost_under_another_fails_the_metric_as_it_fails_tracking():
    # two shapes meet, and from then on only the later-named (upper) one is drawn: the metric reads the first as
    # hidden under it (the world draws later-named shapes on top) only while the path it was on stays under the
    # upper one (the canonical layout sends them head on: a few frames), then as missing, as tracking does
    prompt = "a red circle and a blue square, slow"
    scene = world.canonical_scene(prompt)
    frames = 48
    gap = np.linalg.norm(world.trajectory(scene.things[0], frames) - world.trajectory(scene.things[1], frames), axis=-1)
    met = int(np.argmax(gap < 4.0))
    assert 0 < met < frames // 2
    video = np.concatenate([world.render(scene, met),
                            world.render(world.Scene(scene.things[1:], scene.speed), frames - met, met)])
    hidden = metric.occlusion(metric.detect(video), prompt).hidden[:, 0]
    assert 0 < hidden.sum() <= 12
    scores = metric.score(video, prompt, window_chunks=frames // 3)
    assert scores.adherence == pytest.approx(1 - 0.5 * (frames - met - hidden.sum()) / frames)
    assert quality.tracking(video, prompt) <= 0.5 + 0.5 * met / frames     # the first shape missed from `met` on
    assert metric.score(world.render(scene, frames), prompt, window_chunks=frames // 3).overall == 1.0
    assert quality.tracking(world.render(scene, frames), prompt) > 0.9


@pytest.fixture(scope="module")
def reports(shipped):
    random = dataclasses.replace(shipped, params=wan.init_params(shipped.config, jax.random.key(1)))
    return quality.check(random), quality.check(shipped)


@pytest.mark.slow
def test_random_weights_fail_and_the_shipped_model_moves_the_prompts_shapes(reports, shipped):
    low, report = reports
    assert low.overall < 0.1 and not low.passed and low.tracking == 0
    assert all(r["adherence"] == 0 for r in low.per_prompt)
    # what the shipped model does (jaxkv generate's default): it draws the prompt's shapes and starts them on
    # their paths, so it tracks the world better than its own first frames held still would
    assert report.overall > low.overall
    first = quality.sample.video(shipped, list(quality.PROMPTS), num_chunks=1, seed=quality.SEED)[:, :1]
    held = np.repeat(first, quality.FRAMES, axis=1)
    assert report.tracking > 2 * np.mean([quality.tracking(v, p) for v, p in zip(held, quality.PROMPTS)])


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="the shipped model merges or blurs its shapes after a few chunks (issue #15 "
                                       "stays open); strict: when a retrained model passes, this must become a "
                                       "plain test")
def test_the_shipped_model_clears_the_bar(reports):
    assert reports[1].passed, reports[1]
