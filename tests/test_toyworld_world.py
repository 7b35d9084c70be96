"""The toy world (jaxkv.toyworld.world) against independent references: a step-by-step bouncing simulation, the
shapes' analytic areas, and a prompt grammar enumerated in full."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxkv.toyworld import world

LO, HI = world.MARGIN, world.SIZE - world.MARGIN


def simulate(position, velocity, frames: int) -> np.ndarray:
    """Centres [frames, 2] by stepping: move by the velocity, and where a coordinate left [LO, HI] mirror it back
    and flip that velocity component. Independent of `world.trajectory`'s closed form (valid while a step is
    shorter than the box)."""
    p, v = np.array(position, np.float64), np.array(velocity, np.float64)
    out = np.empty((frames, 2))
    for t in range(frames):
        out[t] = p
        p = p + v
        for i in range(2):
            if p[i] > HI:
                p[i], v[i] = 2 * HI - p[i], -v[i]
            elif p[i] < LO:
                p[i], v[i] = 2 * LO - p[i], -v[i]
    return out


coordinate = st.floats(LO, HI, allow_nan=False)
component = st.floats(-9.0, 9.0, allow_nan=False)


@settings(max_examples=25, deadline=None)
@given(x=coordinate, y=coordinate, vx=component, vy=component)
def test_trajectory_matches_a_step_by_step_bounce_over_thousands_of_frames(x, y, vx, vy):
    thing = world.Thing("red", "circle", (x, y), (vx, vy))
    closed = world.trajectory(thing, 4000)
    np.testing.assert_allclose(closed, simulate((x, y), (vx, vy), 4000), rtol=0, atol=1e-7)
    assert closed.min() >= LO - 1e-9 and closed.max() <= HI + 1e-9


@pytest.mark.parametrize("speed", sorted(world.SPEEDS))
def test_trajectory_at_the_world_speeds_bounces_and_keeps_its_speed(speed):
    # a sampled scene: direction uniform, speed exact; every step away from a wall has exactly that length
    scene = world.sample_scene(np.random.default_rng(3), f"a red circle and a blue square, {speed}")
    v = world.SPEEDS[speed]
    for thing in scene.things:
        assert math.hypot(*thing.velocity) == pytest.approx(v)
        path = world.trajectory(thing, 3000)
        np.testing.assert_allclose(path, simulate(thing.position, thing.velocity, 3000), rtol=0, atol=1e-7)
        steps = np.linalg.norm(np.diff(path, axis=0), axis=1)
        inside = ((path[:-1] > LO + v) & (path[:-1] < HI - v)).all(1)
        np.testing.assert_allclose(steps[inside], v, atol=1e-9)
        assert (steps <= v + 1e-9).all()
        assert (np.diff(np.sign(np.diff(path, axis=0)), axis=0) != 0).any()  # it did bounce


@settings(max_examples=20, deadline=None)
@given(start=st.integers(0, 100_000), frames=st.integers(1, 50), x=coordinate, vx=component)
def test_trajectory_from_any_start_is_the_same_stream(start, frames, x, vx):
    thing = world.Thing("red", "circle", (x, 20.0), (vx, 1.3))
    whole = world.trajectory(thing, start + frames)
    np.testing.assert_allclose(world.trajectory(thing, frames, start), whole[start:], rtol=0, atol=1e-9)


AREA = {
    "circle": math.pi * world.RADIUS**2,
    "square": (2 * world.HALF_SIDE) ** 2,
    "triangle": 3 * math.sqrt(3) / 4 * world.TRIANGLE_R**2,
}  # equilateral, circumradius R
PERIMETER = {
    "circle": 2 * math.pi * world.RADIUS,
    "square": 8 * world.HALF_SIDE,
    "triangle": 3 * math.sqrt(3) * world.TRIANGLE_R,
}


@pytest.mark.parametrize("shape", world.SHAPES)
def test_shape_pixel_counts_match_the_analytic_area(shape):
    # a pixel is in when its centre is: over uniform sub-pixel offsets the mean count is the area exactly, and a
    # single count can only be off by the pixels the boundary crosses (fewer than the perimeter)
    centres = np.random.default_rng(0).uniform(LO, HI, size=(400, 2))
    counts = world.shape_mask(shape, centres).sum((1, 2))
    assert np.abs(counts - AREA[shape]).max() < PERIMETER[shape]
    assert counts.mean() == pytest.approx(AREA[shape], rel=0.01)


@pytest.mark.parametrize("shape", world.SHAPES)
def test_shapes_fit_inside_the_frame_anywhere_in_the_centre_box(shape):
    # the same sub-pixel phase at the centre and at the box's four corners: equal counts (nothing clipped)
    centres = np.array(
        [
            [32.3, 32.7],
            [LO + 0.3, LO + 0.7],
            [HI + 0.3 - 1, LO + 0.7],
            [LO + 0.3, HI + 0.7 - 1],
            [HI + 0.3 - 1, HI + 0.7 - 1],
            [LO, LO],
            [HI, HI],
        ]
    )
    counts = world.shape_mask(shape, centres).sum((1, 2))
    assert (counts[:5] == counts[0]).all()
    assert counts[5] == counts[6] == world.shape_mask(shape, np.array([[32.0, 32.0]])).sum()


def test_shape_mask_rejects_an_unknown_shape():
    with pytest.raises(ValueError, match="unknown shape 'hexagon'"):
        world.shape_mask("hexagon", np.zeros((1, 2)))


def test_render_colours_are_exact_and_later_objects_are_drawn_on_top():
    below = world.Thing("red", "square", (30.0, 30.0), (0.7, 0.0))
    above = world.Thing("blue", "circle", (34.0, 31.0), (-0.7, 0.0))
    scene = world.Scene((below, above), "slow")
    video = world.render(scene, 12, bounce=False)
    assert video.dtype == np.uint8 and video.shape == (12, world.SIZE, world.SIZE, 3)
    m_below = world.shape_mask("square", world.trajectory(below, 12))
    m_above = world.shape_mask("circle", world.trajectory(above, 12))
    assert (m_below & m_above).any(1).any(1).all()  # they overlap in every frame
    expected = np.empty_like(video)
    expected[:] = world.BACKGROUND
    w = world.WALL_WIDTH
    expected[:, :w] = expected[:, -w:] = expected[:, :, :w] = expected[:, :, -w:] = world.WALL
    expected[m_below & ~m_above] = world.COLOURS["red"]
    expected[m_above] = world.COLOURS["blue"]
    np.testing.assert_array_equal(video, expected)
    # the palette only: no blending anywhere
    palette = {world.BACKGROUND, world.WALL, world.COLOURS["red"], world.COLOURS["blue"]}
    assert {tuple(p) for p in video.reshape(-1, 3)} == palette


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), start=st.integers(0, 400), frames=st.integers(1, 8))
def test_render_from_any_start_equals_rendering_from_zero_and_slicing(seed, start, frames):
    scene = world.sample_scene(np.random.default_rng(seed))
    np.testing.assert_array_equal(world.render(scene, frames, start), world.render(scene, start + frames)[start:])


@pytest.mark.parametrize("frames, start", [(0, 0), (-1, 0), (3, -1)])
def test_render_and_paths_reject_bad_ranges(frames, start):
    for prompt in ("a red circle, slow", "a red circle and a blue square, fast"):
        scene = world.sample_scene(np.random.default_rng(0), prompt)
        for bounce in (True, False):
            with pytest.raises(ValueError, match="frames >= 1 and start >= 0"):
                world.render(scene, frames, start, bounce=bounce)
            with pytest.raises(ValueError, match="frames >= 1 and start >= 0"):
                world.paths(scene, frames, start, bounce=bounce)


def every_scene():
    """Every (objects, speed) the grammar allows: 1..MAX_OBJECTS objects of distinct colours, any shapes."""
    for n in range(1, world.MAX_OBJECTS + 1):
        for colours in itertools.permutations(world.COLOURS, n):
            for shapes in itertools.product(world.SHAPES, repeat=n):
                for speed in world.SPEEDS:
                    yield list(zip(colours, shapes)), speed


def test_prompt_round_trip_over_every_combination():
    seen = set()
    for objects, speed in every_scene():
        prompt = world.format_prompt(objects, speed)
        assert world.parse_prompt(prompt) == (objects, speed)
        assert prompt.endswith(f", {speed}") and prompt.startswith("a ")
        assert set(prompt.replace(",", "").split()) <= set(world.VOCABULARY)
        seen.add(prompt)
    # 4 colours x 3 shapes x 2 speeds, plus ordered colour pairs x shape pairs x speeds
    assert len(seen) == 4 * 3 * 2 + (4 * 3) * (3 * 3) * 2


def test_parse_prompt_tolerates_case_spacing_and_no_comma():
    expected = ([("red", "circle"), ("blue", "square")], "fast")
    for text in ("A Red Circle and a BLUE square, FAST", "  a red  circle and a blue square   fast "):
        assert world.parse_prompt(text) == expected


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("a purple circle, fast", "'a purple circle' is not 'a <colour> <shape>'"),
        ("a red hexagon, slow", "'a red hexagon' is not 'a <colour> <shape>'"),
        ("the red circle, slow", "is not 'a <colour> <shape>'"),
        ("a red circle and a red square, fast", "its own colour"),
        ("a red circle and a blue square and a green triangle, slow", "holds 1..2 shapes, got 3"),
        ("a red circle", "must end with a speed"),
        ("a red circle, quick", "must end with a speed"),
        ("fast", "must end with a speed"),
        ("", "must end with a speed"),
        (3, "is a str"),
    ],
)
def test_parse_prompt_names_the_problem(prompt, message):
    with pytest.raises(ValueError, match=message):
        world.parse_prompt(prompt)


@pytest.mark.parametrize(
    "objects, speed, message",
    [
        ([], "slow", "holds 1..2 shapes, got 0"),
        ([("red", "circle"), ("red", "square")], "slow", "its own colour"),
        ([("red", "blob")], "slow", "unknown toy-world object"),
        ([("red", "circle")], "medium", "unknown toy-world speed"),
    ],
)
def test_format_prompt_rejects_what_parse_would(objects, speed, message):
    with pytest.raises(ValueError, match=message):
        world.format_prompt(objects, speed)


def test_sample_scene_follows_the_prompt():
    scene = world.sample_scene(np.random.default_rng(5), "a green triangle and a yellow circle, fast")
    assert [(t.colour, t.shape) for t in scene.things] == [("green", "triangle"), ("yellow", "circle")]
    assert scene.prompt == "a green triangle and a yellow circle, fast"
    for t in scene.things:
        assert LO <= t.position[0] <= HI and LO <= t.position[1] <= HI
        assert math.hypot(*t.velocity) == pytest.approx(world.SPEEDS["fast"])


def test_clips_are_deterministic_for_a_seeded_generator():
    video, prompts = world.clips(np.random.default_rng(11), 6, 5)
    again, prompts_again = world.clips(np.random.default_rng(11), 6, 5)
    other, prompts_other = world.clips(np.random.default_rng(12), 6, 5)
    assert video.dtype == np.uint8 and video.shape == (6, 5, world.SIZE, world.SIZE, 3)
    np.testing.assert_array_equal(video, again)
    assert prompts == prompts_again
    assert (prompts, video.tobytes()) != (prompts_other, other.tobytes())
    for clip, prompt in zip(video, prompts):
        world.parse_prompt(prompt)  # every prompt is well formed
        colours = {tuple(p) for p in clip.reshape(-1, 3)} - {world.BACKGROUND, world.WALL}
        named = {world.COLOURS[c] for c, _ in world.parse_prompt(prompt)[0]}
        assert colours <= named and colours  # only the named colours appear


def test_canonical_scene_is_a_function_of_the_prompt():
    scene = world.canonical_scene("a red circle and a blue square, fast")
    assert scene.prompt == "a red circle and a blue square, fast"
    for thing, (position, angle) in zip(scene.things, world.CANONICAL_STARTS):
        assert thing.position == position
        assert np.hypot(*thing.velocity) == pytest.approx(world.SPEEDS["fast"])
        assert np.degrees(np.arctan2(thing.velocity[1], thing.velocity[0])) % 360 == pytest.approx(angle)
    assert world.canonical_scene("a red circle and a blue square, fast") == scene
    with pytest.raises(ValueError, match="must end with a speed"):
        world.canonical_scene("a red circle")


# -- two shapes bounce off each other (`world.paths`)


def _contact(scene) -> float:
    a, b = scene.things
    return world.contact(a.shape, b.shape)


def test_reach_is_the_farthest_pixel_of_each_shape():
    # no pixel centre of a shape lies farther than REACH from its centre, and some lies within half a pixel of it
    for shape, reach in world.REACH.items():
        for centre in ([32.0, 32.0], [31.3, 30.8]):
            ys, xs = np.nonzero(world.shape_mask(shape, np.array([centre]))[0])
            far = np.hypot(xs + 0.5 - centre[0], ys + 0.5 - centre[1]).max()
            assert reach - 1.0 <= far <= reach, shape


two_shape_prompts = st.builds(
    lambda c, s, speed: world.format_prompt(list(zip(c, s)), speed),
    st.permutations(list(world.COLOURS)).map(lambda c: c[:2]),
    st.lists(st.sampled_from(world.SHAPES), min_size=2, max_size=2),
    st.sampled_from(sorted(world.SPEEDS)),
)


@settings(max_examples=30, deadline=None)
@given(prompt=two_shape_prompts, seed=st.integers(0, 2**32 - 1))
# a wall turns the green triangle into the red one on the first step, with no frame before to turn back to
@example(prompt="a red triangle and a green triangle, fast", seed=6970036)
def test_two_shapes_never_overlap_and_keep_their_speed(prompt, seed):
    scene = world.sample_scene(np.random.default_rng(seed), prompt)
    contact = _contact(scene)
    path = world.paths(scene, 3000)
    gap = np.linalg.norm(path[:, 0] - path[:, 1], axis=-1)
    assert gap.min() >= contact - 1e-9
    # their masks never share a pixel, and render shows every pixel of both in every frame
    video = world.render(scene, 300)
    for k, thing in enumerate(scene.things):
        mask = world.shape_mask(thing.shape, path[:300, k])
        assert (video[mask] == world.COLOURS[thing.colour]).all()
    v = world.SPEEDS[scene.speed]
    steps = np.linalg.norm(np.diff(path, axis=0), axis=-1)  # [T - 1, 2]
    assert (steps <= v + 1e-9).all()
    inside = ((path[:-1] > LO + v) & (path[:-1] < HI - v)).all(-1)  # no wall within a step: the speed exactly
    np.testing.assert_allclose(steps[inside], v, atol=1e-9)
    assert path.min() >= LO - 1e-9 and path.max() <= HI + 1e-9


def test_shapes_meeting_head_on_bounce_back_and_alone_they_pass():
    scene = world.canonical_scene("a red circle and a blue square, slow")  # the canonical layout: head on
    path = world.paths(scene, 60)
    apart = world.paths(scene, 60, bounce=False)
    np.testing.assert_array_equal(apart[:, 0], world.trajectory(scene.things[0], 60))
    assert world.paths(scene, 60).shape == apart.shape == (60, 2, 2)
    gap = np.linalg.norm(path[:, 0] - path[:, 1], axis=-1)
    turn = int(np.argmin(gap))
    assert 3 < turn < 30 and _contact(scene) <= gap[turn] < _contact(scene) + 2 * world.SPEEDS["slow"]
    np.testing.assert_allclose(path[: turn + 1], apart[: turn + 1], rtol=0, atol=1e-9)  # the same until they meet
    # then each one's velocity is mirrored in the plane between them (nearly head on: nearly back the way it came)
    n = (path[turn, 1] - path[turn, 0]) / gap[turn]
    v = apart[1] - apart[0]  # [2 shapes, 2]
    mirrored = v - 2 * (v @ n)[:, None] * n
    np.testing.assert_allclose(
        path[turn + 1 : turn + 5] - path[turn : turn + 4], np.repeat(mirrored[None], 4, 0), rtol=0, atol=1e-9
    )
    assert (mirrored @ v.T).diagonal().max() < -0.9 * world.SPEEDS["slow"] ** 2
    assert (np.linalg.norm(apart[:, 0] - apart[:, 1], axis=-1) < _contact(scene) - 5).any()  # without: they cross


def test_a_lone_shape_follows_its_trajectory():
    scene = world.canonical_scene("a green triangle, fast")
    np.testing.assert_array_equal(world.paths(scene, 500, 77)[:, 0], world.trajectory(scene.things[0], 500, 77))
    # and sampled scenes start with their shapes apart
    for seed in range(50):
        pair = world.sample_scene(np.random.default_rng(seed), "a red circle and a blue triangle, fast")
        assert np.linalg.norm(np.subtract(pair.things[0].position, pair.things[1].position)) >= _contact(pair)


@settings(max_examples=20, deadline=None)
@given(start=st.integers(0, 20_000), frames=st.integers(1, 50), prompt=two_shape_prompts)
def test_paths_from_any_start_are_the_same_stream(start, frames, prompt):
    scene = world.canonical_scene(prompt)
    whole = world.paths(scene, start + frames)
    np.testing.assert_array_equal(world.paths(scene, frames, start), whole[start:])
    np.testing.assert_array_equal(world.render(scene, frames, start), world.render(scene, start + frames)[start:])


def test_overlapping_starts_separate():
    # a scene made with its shapes already overlapping (sample_scene draws none): they move apart, and from the
    # second frame apart on (the first may follow a frame too close to turn back to) they never close in again
    scene = world.Scene(
        (
            world.Thing("red", "circle", (30.0, 30.0), (1.0, 0.0)),
            world.Thing("blue", "square", (36.0, 31.0), (-1.0, 0.0)),
        ),
        "slow",
    )
    gap = np.linalg.norm(np.subtract(*np.moveaxis(world.paths(scene, 400), 1, 0)), axis=-1)
    first = int(np.argmax(gap >= _contact(scene)))
    assert 0 < first < 20 and gap[first + 1 :].min() >= _contact(scene) - 1e-9
