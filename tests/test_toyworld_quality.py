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


@pytest.mark.slow
def test_random_weights_fail_and_the_shipped_model_passes(shipped):
    random = dataclasses.replace(shipped, params=wan.init_params(shipped.config, jax.random.key(1)))
    low = quality.check(random)
    assert low.overall < 0.1 and not low.passed
    report = quality.check(shipped)
    assert report.passed, report
    # every prompt of the check, not only their mean, is far above random weights
    assert min(r["overall"] for r in report.per_prompt) > low.overall
