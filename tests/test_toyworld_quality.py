"""The quality bar (`jaxkv.toyworld.quality`): the world's own clips clear it, random weights do not, the shipped
model does."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxkv.models import wan
from jaxkv.toyworld import model as toy_model
from jaxkv.toyworld import quality


@pytest.fixture(scope="module")
def shipped():
    return toy_model.load()


def test_the_worlds_own_clips_score_at_the_top(shipped):
    videos = quality.world_videos(shipped)
    report = quality.scores_of(videos, quality.PROMPTS, shipped.settings.chunk_frames)
    assert report.overall >= 0.95 and report.passed


@pytest.fixture(scope="module")
def reports(shipped):
    random = dataclasses.replace(shipped, params=wan.init_params(shipped.config, jax.random.key(1)))
    return quality.check(random), quality.check(shipped)


@pytest.mark.slow
def test_random_weights_fail_and_the_shipped_model_draws_the_prompt(reports):
    low, report = reports
    assert low.overall < 0.1 and not low.passed
    assert all(r["adherence"] == 0 for r in low.per_prompt)
    # what the shipped model does (jaxkv generate's default): it draws the prompt's shapes in their colours on
    # most frames, far above random weights, even where it fails the bar below
    assert report.overall > low.overall
    assert sum(r["adherence"] for r in report.per_prompt) / len(report.per_prompt) > 0.25


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="the shipped model does not move its shapes yet (issue #15 stays open); "
                                       "strict: when a retrained model passes, this must become a plain test")
def test_the_shipped_model_clears_the_bar(reports):
    assert reports[1].passed, reports[1]
