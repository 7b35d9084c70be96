"""The quality bar (`jaxkv.toyworld.quality`): the world's own clips clear it, random weights do not, the shipped
model (release 9) does; `tracking` against the world's own scenes."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxkv.models import wan
from jaxkv.toyworld import metric, quality, world
from jaxkv.toyworld import model as toy_model


@pytest.fixture(scope="module")
def shipped():
    return toy_model.load()


def test_the_worlds_own_clips_score_at_the_top(shipped):
    videos = quality.world_videos(shipped)
    report = quality.scores_of(videos, quality.PROMPTS, shipped.settings.chunk_frames)
    assert report.overall >= 0.95 and report.passed


def test_tracking_scores_the_canonical_scene_and_not_other_motion(shipped):
    truth = quality.world_videos(shipped, canonical=True)
    elsewhere = quality.world_videos(shipped)  # the same prompts, random layouts and headings
    frozen = np.repeat(truth[:, :1], truth.shape[1], axis=1)  # the right first frame, never moving
    for video, other, still, prompt in zip(truth, elsewhere, frozen, quality.PROMPTS):
        assert quality.tracking(video, prompt) >= 0.9, prompt
        assert quality.tracking(other, prompt) <= 0.1, prompt
        # the first frame held still can only track a shape while the world brings it back near where it started
        # (two shapes that meet head on bounce back along their paths): at most those frames, from the world's path
        path = world.paths(world.canonical_scene(prompt), len(still))
        home = np.linalg.norm(path - path[:1], axis=-1) <= quality.TRACK_RADIUS + 1.0  # [T, N]
        assert quality.tracking(still, prompt) <= home.mean() + 0.05, prompt


def test_a_shape_lost_where_two_meet_fails_the_metric_as_it_fails_tracking():
    # two shapes meet, and from then on only the later-named one is drawn, on its own path: the metric reads the
    # first as missing from there (shapes bounce off each other, nothing covers it), as tracking does
    prompt = "a red circle and a blue square, slow"
    scene = world.canonical_scene(prompt)
    frames = 48
    path = world.paths(scene, frames)
    contact = world.contact("circle", "square")
    met = int(np.argmax(np.linalg.norm(path[:, 0] - path[:, 1], axis=-1) < contact + 2.0))
    assert 0 < met < frames // 2
    video = world.render(scene, frames)
    video[met:] = world.empty_frames(frames - met)
    video[met:][world.shape_mask("square", path[met:, 1])] = world.COLOURS["blue"]
    assert not metric.occlusion(metric.detect(video), prompt).hidden.any()
    scores = metric.score(video, prompt, window_chunks=frames // 3)
    assert scores.adherence == pytest.approx(1 - 0.5 * (frames - met) / frames)
    assert quality.tracking(video, prompt) <= 0.5 + 0.5 * met / frames  # the first shape missed from `met` on
    assert metric.score(world.render(scene, frames), prompt, window_chunks=frames // 3).overall == 1.0
    assert quality.tracking(world.render(scene, frames), prompt) > 0.9


@pytest.fixture(scope="module")
def reports(shipped):
    random = dataclasses.replace(shipped, params=wan.init_params(shipped.config, jax.random.key(1)))
    return quality.check(random), quality.check(shipped)


@pytest.mark.acceptance
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


@pytest.mark.acceptance
@pytest.mark.slow
def test_the_shipped_model_clears_the_bar(reports):
    assert reports[1].passed, reports[1]


def test_chunk_errors_measure_against_the_world():
    # the world's own chunks are on the path (up to detection: pixels quantise a centre); the frame before a chunk
    # held still is off by the path's own steps, computed here from world.paths, give or take that frame's
    # own detection error (the triangle inequality); a blank chunk finds nothing
    rng = np.random.default_rng(4)
    prompts = [world.random_prompt(rng) for _ in range(6)]
    starts = rng.integers(10, 500, 6)
    scenes = [world.canonical_scene(p) for p in prompts]
    truth = np.stack([world.render(sc, 3, int(t)) for sc, t in zip(scenes, starts)])
    before = np.stack([world.render(sc, 1, int(t) - 1) for sc, t in zip(scenes, starts)])
    assert quality.chunk_errors(truth, prompts, starts).max() <= np.sqrt(2) * metric.CENTROID_ERROR
    steps = np.concatenate(
        [
            np.linalg.norm(world.paths(sc, 4, int(t) - 1)[1:] - world.paths(sc, 1, int(t) - 1), axis=-1).T
            for sc, t in zip(scenes, starts)
        ]
    )
    assert steps.min() > 0.5
    held = quality.chunk_errors(before.repeat(3, axis=1), prompts, starts)
    assert (np.abs(held - steps) <= quality.chunk_errors(before, prompts, starts - 1) + 1e-9).all()
    assert np.isinf(quality.chunk_errors(world.empty_frames(3)[None].repeat(6, 0), prompts, starts)).all()


def test_random_scene_chunks_are_measured_against_their_own_scenes(shipped):
    canonical = quality._world_chunks(shipped, 8, quality.SEED)
    drawn = quality._world_chunks(shipped, 8, quality.SEED, scenes="random")
    assert drawn.prompts == canonical.prompts and (drawn.starts == canonical.starts).all()
    assert [sc.prompt for sc in drawn.scenes] == drawn.prompts
    assert all(a != b for a, b in zip(drawn.scenes, canonical.scenes))
    own = quality.chunk_errors(drawn.truth, drawn.prompts, drawn.starts, drawn.scenes)
    assert own.max() <= np.sqrt(2) * metric.CENTROID_ERROR
    # read against each prompt's canonical scene instead, the same frames are mostly far off
    assert np.median(quality.chunk_errors(drawn.truth, drawn.prompts, drawn.starts)) > 5.0
    with pytest.raises(ValueError, match="scenes"):
        quality._world_chunks(shipped, 2, quality.SEED, scenes="anywhere")


@pytest.mark.slow
def test_next_chunk_reads_the_world_the_still_frame_and_the_model(shipped):
    step = quality.next_chunk(shipped, clips=12)
    assert step.model.shape == step.still.shape == step.world.shape == (shipped.settings.chunk_frames,)
    assert (step.world <= 0.5).all()
    # half the prompts are slow (1 px a frame), half fast (2 px): the still frame's median error grows by a step
    assert (np.diff(step.still) > 0.5).all() and 0.5 < step.still[0] < 2.5
    assert np.isfinite(step.model).all()
    elsewhere = quality.next_chunk(shipped, clips=12, scenes="random")
    assert (elsewhere.world <= 0.5).all() and (np.diff(elsewhere.still) > 0.5).all()
    random = dataclasses.replace(shipped, params=wan.init_params(shipped.config, jax.random.key(1)))
    assert np.isinf(quality.next_chunk(random, clips=4).model).all()


def test_check_cli_refuses_a_directory_that_is_not_a_release(tmp_path, capsys):
    from jaxkv.toyworld import cli

    assert cli.main(["check", str(tmp_path)]) == 2
    assert "not a toy-world release" in capsys.readouterr().err


@pytest.mark.acceptance
@pytest.mark.slow
def test_check_cli_prints_the_bar_tracking_the_next_chunk_and_the_survey(reports, shipped, capsys):
    from jaxkv.toyworld import cli

    code = cli.main(["check", "--survey", "--long"])
    out = capsys.readouterr().out
    assert code == (0 if reports[1].passed else 1)
    assert f"mean overall {reports[1].overall:.3f}" in out and f"tracking {reports[1].tracking:.3f}" in out
    assert "next chunk from the world's own frames" in out and "held still" in out
    assert f"default stream ('{shipped.settings.prompt}' alone, 600 frames, seed 0" in out
    assert out.count("said fast / slow") == 2 and "default stream passes: each named shape seen in >= 99%" in out
    assert "x the world's travel and roam (least " in out and out.count(" roam ") >= 6  # a row per named shape
    assert "survey (16 prompts x 2 seeds, 48 frames): overall" in out
    assert "denoising that chunk once at each noise level" in out
    for sigma in shipped.settings.schedule().sigmas():  # every level of the shipped sampler
        assert f"level {sigma:g}: " in out
    long = out[out.index("long streams (4 prompts x 300 frames), per 30 frames: ") :].splitlines()[0]
    parts = long.split(": ", 1)[1].split("; ")
    assert len(parts) == 4
    for part, name in zip(parts, ("overall", "continuity", "named shapes seen", "named shapes moving")):
        values = [float(v) for v in part.removeprefix(name).split()]
        assert len(values) == 10 and all(0 <= v <= 1 for v in values), part


def test_long_scores_see_shapes_fade_and_freeze_after_the_bars_frames():
    """`long_scores` per 30-frame window: the world's canonical streams score at the top in every window; the same
    streams with the box emptied from frame 30 on lose every named shape there; held still from frame 30 on, the
    shapes are still seen but their continuity falls and none reads as moving (the fast prompts' stops within
    reach of a wall included, which the speed check forgives)."""
    truth = np.stack([world.render(world.canonical_scene(p), 60) for p in quality.PROMPTS])
    faded, frozen = truth.copy(), truth.copy()
    faded[:, 30:] = world.empty_frames(30)
    frozen[:, 30:] = truth[:, 29:30]
    top = quality.long_scores(truth, quality.PROMPTS, 3)
    assert top.window_frames == 30 and top.overall.shape == top.seen.shape == (2,)
    assert (top.seen >= 0.95).all() and (top.overall >= 0.9).all() and (top.moving == 1).all()
    gone = quality.long_scores(faded, quality.PROMPTS, 3)
    assert gone.seen[0] == top.seen[0] and gone.seen[1] == 0 and gone.overall[1] == 0 and gone.moving[1] == 0
    # (the fast prompts' shapes, and the default prompt's, which have bounced off each other back towards where
    # they started, are held within reach of a wall, where the speed check cannot tell a stop from a bounce: 0.65-
    # 0.68, the travel check failing only the window's last transitions, whose 30 frames back hold less than its
    # span; the slow one-shape prompt's, held away from the walls, 0.03)
    still = quality.long_scores(frozen, quality.PROMPTS, 3)
    assert still.seen[1] >= 0.95 and still.continuity[1] < 0.55 and still.continuity[0] == top.continuity[0]
    assert still.moving[0] == 1 and still.moving[1] == 0
    # a shape that moves by less than the span: 2 px each way over the window, the stops the model makes
    crawl = truth.copy()
    crawl[:, 30:] = np.stack([np.roll(truth[:, 29], (i // 10) - 1, axis=2) for i in range(30)], axis=1)
    assert (quality.long_scores(crawl, quality.PROMPTS, 3).moving == [1, 0]).all()
    with pytest.raises(ValueError, match="windows of 25 frames must be whole 3-frame chunks"):
        quality.long_scores(truth, quality.PROMPTS, 3, 25)
    with pytest.raises(ValueError, match="divide the 60 frames"):
        quality.long_scores(truth, quality.PROMPTS, 3, 27)


def test_long_streams_refuse_windows_that_do_not_divide_the_stream_before_streaming(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("streamed before checking its windows")

    monkeypatch.setattr(quality.sample, "video", never)
    toy = toy_model.load()
    with pytest.raises(ValueError, match="divide the 100 frames"):
        quality.long_streams(toy, frames=100)
    with pytest.raises(ValueError, match="windows of 20 frames must be whole 3-frame chunks"):
        quality.long_streams(toy, frames=120, window_frames=20)


def test_survey_prompts_are_the_checks_then_distinct_valid_ones():
    prompts = quality.survey_prompts(40)
    assert prompts[: len(quality.PROMPTS)] == quality.PROMPTS
    assert len(set(prompts)) == 40 and prompts == quality.survey_prompts(40)
    for p in prompts:
        world.parse_prompt(p)
    assert quality.survey_prompts(16) == quality.survey_prompts()
    everything = quality.survey_prompts(240)  # every prompt the vocabulary makes: 2 x (4 x 3 + 4 x 3 x 3 x 3)
    assert len(set(everything)) == 240
    for bad in (3, 241):
        with pytest.raises(ValueError, match="count"):
            quality.survey_prompts(bad)


@pytest.mark.acceptance
@pytest.mark.slow
def test_survey_of_the_checks_prompts_and_seed_is_the_check(reports, shipped):
    one = quality.survey(shipped, prompts=len(quality.PROMPTS), seeds=1)
    assert one.overall == reports[1].overall and one.tracking == reports[1].tracking
    assert one.by_seed == (reports[1].overall,) and one.prompts == quality.PROMPTS
    wide = quality.survey(shipped, prompts=6, seeds=2)
    assert len(wide.by_seed) == 2 and wide.overall == pytest.approx(np.mean(wide.by_seed))
    assert len(wide.prompts) == 6
    with pytest.raises(ValueError, match="seeds"):
        quality.survey(shipped, seeds=0)


def test_denoising_errors_scale_as_sigma_squared_for_a_dit_that_predicts_no_flow(shipped):
    # a zero head predicts zero flow, so its x0 is the noisy input itself: error sigma^2 * mean((eps - x0)^2)
    params = dict(shipped.params, head=jax.tree.map(np.zeros_like, shipped.params["head"]))
    errors = quality.denoising_errors(dataclasses.replace(shipped, params=params), clips=6)
    # the shipped steps 1000 / 750 / 500 / 100 (release 9) warped with shift 3: 3 d / (1 + 2 d) for d = 1, 0.75,
    # 0.5, 0.1
    assert errors.sigmas.tolist() == pytest.approx([1.0, 0.9, 0.75, 0.25])
    np.testing.assert_allclose(
        errors.model / errors.model[:1], np.broadcast_to(errors.sigmas[:, None] ** 2, errors.model.shape), rtol=1e-4
    )
    assert (errors.model[0] > 1.0).all()  # eps - x0: unit noise plus the latents
    _, _, context, truth, _ = quality._world_chunks(shipped, 6, quality.SEED)
    x = shipped.latent_map.encode(np.concatenate([context[:, -1:], truth], axis=1))
    np.testing.assert_allclose(errors.still, np.mean((x[:, 1:] - x[:, :1]) ** 2, axis=(0, 2, 3, 4)), rtol=1e-5)


@pytest.mark.slow
def test_denoising_errors_first_level_is_the_streams_first_step(shipped):
    from jaxkv import rollout as R
    from jaxkv.schedule import Schedule

    clips, st = 4, shipped.settings
    errors = quality.denoising_errors(shipped, clips=clips)
    # the same clips streamed: the world's frames committed, then one sampler step from the same noise
    prompts, _, context, truth, _ = quality._world_chunks(shipped, clips, quality.SEED)
    x0 = shipped.latent_map.encode(np.concatenate([context, truth], axis=1))
    eps = np.random.default_rng([quality.SEED, clips, 1]).standard_normal(x0.shape).astype(np.float32)
    rc = st.rollout_config(schedule=Schedule(steps=(1000,), shift=st.shift))
    state = R.init_state(shipped.params, shipped.config, rc, shipped.context(prompts))
    state = R.commit(shipped.params, shipped.config, rc, state, x0[:, : context.shape[1]])
    out = R.rollout(
        shipped.params,
        shipped.config,
        rc,
        None,
        num_chunks=1,
        noise=eps[None, None, :, -3:],
        state=state,
        first_chunk=context.shape[1] // 3,
    )
    streamed = np.mean((np.asarray(out.latents) - x0[:, -3:]) ** 2, axis=(0, 2, 3, 4))
    np.testing.assert_allclose(errors.model[0], streamed, rtol=2e-3)
    # each lower level holds more of the answer: the shipped model's error falls step by step, to well under the
    # still frame's
    assert (np.diff(errors.model, axis=0) < 0).all() and (errors.model[-1] < 0.5 * errors.still).all()
