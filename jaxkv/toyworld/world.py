"""The toy world: coloured shapes moving in a box and bouncing off its walls, rendered with numpy.

A scene is one to `MAX_OBJECTS` shapes (circle, square, triangle), each in its own colour, all moving at the
scene's speed ("slow" or "fast" pixels per frame) in random directions. Physics is deterministic: every frame each
centre moves by its velocity and reflects off the walls (the shape stays inside the ``SIZE x SIZE`` box), and two
shapes bounce off each other before they touch (`paths`), so no shape ever hides another. Any number of frames can
be rendered from any frame on, so a clip is a window of an endless, exactly reproducible stream.

The walls are drawn: a `WALL_WIDTH`-pixel grey border (`empty_frames`). Wan's DiT has no absolute position
embedding (its 3-D RoPE only sees differences of positions), so from a frame of a uniform background it cannot tell
where the box ends: the toy models trained without a border let shapes leave the box and, drawing a first frame from
noise, could hardly place anything. A visible wall is something its attention can find.

A prompt names the scene: ``"a red circle and a blue square, fast"`` (`format_prompt` / `parse_prompt`); the words
are `VOCABULARY`. `sample_scene` draws the unnamed parts (positions, directions) from a numpy Generator;
`canonical_scene` fixes them per prompt (the scenes the toy model streams).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from jaxkv.validate import shorten

SIZE = 64  # frames are SIZE x SIZE RGB
BACKGROUND = (16, 16, 24)
WALL = (110, 110, 120)  # the border; far from every shape colour (see jaxkv.toyworld.metric)
WALL_WIDTH = 4  # pixels: one latent patch, so a wall patch is flat grey
COLOURS = {"red": (230, 50, 50), "green": (40, 200, 70), "blue": (60, 100, 240), "yellow": (235, 215, 40)}
SHAPES = ("circle", "square", "triangle")
SPEEDS = {"slow": 1.0, "fast": 2.0}  # pixels per frame
RADIUS = 8.0  # circle radius; square half-side 7; triangle circumradius 9.5
HALF_SIDE = 7.0
TRIANGLE_R = 9.5
MARGIN = 14.0  # centres stay in [MARGIN, SIZE - MARGIN]: shapes fit inside the walls
MAX_OBJECTS = 2
# The farthest any pixel of a shape lies from its centre: two shapes whose centres are `REACH` [a] + `REACH` [b]
# apart cannot overlap.
REACH = {"circle": RADIUS, "square": HALF_SIDE * math.sqrt(2.0), "triangle": TRIANGLE_R}
CONTACT_GAP = 1.0  # px kept between two shapes' reaches: they bounce before they touch
VOCABULARY = ("a", "and", *COLOURS, *SHAPES, *SPEEDS)


def contact(a: str, b: str) -> float:
    """The distance between the centres of shapes ``a`` and ``b`` at which they bounce off each other (`paths`)."""
    return REACH[a] + REACH[b] + CONTACT_GAP


@dataclasses.dataclass(frozen=True)
class Thing:
    """One shape of a scene: its colour and kind, and its state at frame 0 (pixel units, y down)."""

    colour: str
    shape: str
    position: tuple[float, float] = (SIZE / 2, SIZE / 2)  # (x, y) centre
    velocity: tuple[float, float] = (0.0, 0.0)  # (dx, dy) per frame


@dataclasses.dataclass(frozen=True)
class Scene:
    things: tuple[Thing, ...]
    speed: str = "slow"

    @property
    def prompt(self) -> str:
        return format_prompt([(t.colour, t.shape) for t in self.things], self.speed)


def format_prompt(objects, speed: str) -> str:
    """[("red", "circle"), ("blue", "square")], "fast" -> "a red circle and a blue square, fast"."""
    _check_objects(objects, speed)
    return " and ".join(f"a {c} {s}" for c, s in objects) + f", {speed}"


def parse_prompt(prompt: str) -> tuple[list[tuple[str, str]], str]:
    """The inverse of `format_prompt`: "a red circle, slow" -> ([("red", "circle")], "slow"). ValueError naming
    the problem (and the vocabulary) for anything else."""
    if not isinstance(prompt, str):
        raise ValueError(f"a toy-world prompt is a str, got {prompt!r}")
    text = " ".join(prompt.strip().lower().split())
    speed_words = "|".join(SPEEDS)
    match = re.fullmatch(rf"(.+?),?\s+({speed_words})", text)
    if not match:
        raise ValueError(
            f"toy-world prompt {shorten(prompt)} must end with a speed ({', '.join(SPEEDS)}), like "
            f"'a red circle and a blue square, fast'"
        )
    objects = []
    for part in match.group(1).split(" and "):
        words = part.split()
        if len(words) != 3 or words[0] != "a" or words[1] not in COLOURS or words[2] not in SHAPES:
            raise ValueError(
                f"toy-world prompt {shorten(prompt)}: {shorten(part)} is not 'a <colour> <shape>' (colours "
                f"{', '.join(COLOURS)}; shapes {', '.join(SHAPES)})"
            )
        objects.append((words[1], words[2]))
    _check_objects(objects, match.group(2))
    return objects, match.group(2)


def _check_objects(objects, speed: str) -> None:
    if not 1 <= len(objects) <= MAX_OBJECTS:
        raise ValueError(f"a toy-world scene holds 1..{MAX_OBJECTS} shapes, got {len(objects)}")
    colours = [c for c, _ in objects]
    for c, s in objects:
        if c not in COLOURS or s not in SHAPES:
            raise ValueError(f"unknown toy-world object {c!r} {s!r}: colours {list(COLOURS)}, shapes {list(SHAPES)}")
    if len(set(colours)) != len(colours):
        raise ValueError(f"each shape of a toy-world scene has its own colour, got {colours}")
    if speed not in SPEEDS:
        raise ValueError(f"unknown toy-world speed {speed!r}: {list(SPEEDS)}")


def random_prompt(rng: np.random.Generator) -> str:
    """A prompt drawn uniformly: 1..MAX_OBJECTS shapes of distinct colours, any shapes, either speed."""
    n = int(rng.integers(1, MAX_OBJECTS + 1))
    colours = rng.choice(list(COLOURS), size=n, replace=False)
    shapes = rng.choice(SHAPES, size=n)
    return format_prompt(list(zip(colours.tolist(), shapes.tolist())), str(rng.choice(list(SPEEDS))))


def sample_scene(rng: np.random.Generator, prompt: str | None = None) -> Scene:
    """The scene of ``prompt`` (a `random_prompt` when None) with positions uniform in the box where the shapes
    do not overlap (a later shape's position is drawn again until it is apart from the earlier ones, as `paths`
    keeps them) and directions uniform on the circle. A later shape whose start and direction would bring the pair
    closer than contact on the first step whatever `paths` does (a wall turns one into the other, with no frame
    before to turn back to) is drawn again, position and direction."""
    objects, speed = parse_prompt(prompt if prompt is not None else random_prompt(rng))
    v = SPEEDS[speed]
    things = []
    for colour, shape in objects:
        while True:
            x, y = rng.uniform(MARGIN, SIZE - MARGIN, size=2)
            while any(math.hypot(x - t.position[0], y - t.position[1]) < contact(shape, t.shape) for t in things):
                x, y = rng.uniform(MARGIN, SIZE - MARGIN, size=2)
            angle = rng.uniform(0.0, 2.0 * np.pi)
            thing = Thing(colour, shape, (float(x), float(y)), (float(v * np.cos(angle)), float(v * np.sin(angle))))
            if not things or _first_step_apart(Scene((*things, thing), speed)):
                break
        things.append(thing)
    return Scene(tuple(things), speed)


def _first_step_apart(scene: Scene) -> bool:
    """Whether `paths` keeps a two-shape scene's shapes at least contact apart on frame 1 (from then on it always
    can: it turns both back to the frame before when mirroring does not part them)."""
    a, b = scene.things
    second = _pair_path(scene, 64)[1]  # 64: the least length `paths` asks for (its cache then holds this path)
    return math.dist(second[0], second[1]) >= contact(a.shape, b.shape)


# Where and whither the k-th named shape of a prompt starts in `canonical_scene` (x, y; degrees, y down).
CANONICAL_STARTS = (((20.0, 22.0), 35.0), ((44.0, 42.0), 215.0))


def canonical_scene(prompt: str) -> Scene:
    """The scene a toy model streams for ``prompt``: the k-th named shape starts at `CANONICAL_STARTS` [k] (so the
    whole video is a function of the prompt). Training clips start anywhere along such a scene's endless path;
    `sample_scene` draws the random scenes the metric is tested on."""
    objects, speed = parse_prompt(prompt)
    v = SPEEDS[speed]
    things = tuple(
        Thing(colour, shape, position, (v * float(np.cos(np.radians(angle))), v * float(np.sin(np.radians(angle)))))
        for (colour, shape), (position, angle) in zip(objects, CANONICAL_STARTS)
    )
    return Scene(things, speed)


def trajectory(thing: Thing, frames: int, start: int = 0) -> np.ndarray:
    """Centres float64 [frames, 2] (x, y) of frames start .. start + frames - 1.

    Reflection off the walls [MARGIN, SIZE - MARGIN] in closed form: the free motion folded into the box (a
    triangle wave), so any frame is computed directly and a stream never accumulates rounding."""
    t = np.arange(start, start + frames, dtype=np.float64)[:, None]
    free = np.asarray(thing.position)[None] - MARGIN + t * np.asarray(thing.velocity)[None]
    span = SIZE - 2 * MARGIN
    folded = np.mod(free, 2 * span)
    return MARGIN + np.where(folded > span, 2 * span - folded, folded)


_YY, _XX = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64) + 0.5  # pixel centres


def shape_mask(shape: str, centres: np.ndarray) -> np.ndarray:
    """bool [frames, SIZE, SIZE]: the pixels whose centres lie inside ``shape`` at each of ``centres [frames, 2]``."""
    dx = _XX[None] - centres[:, 0, None, None]
    dy = _YY[None] - centres[:, 1, None, None]
    if shape == "circle":
        return dx * dx + dy * dy <= RADIUS * RADIUS
    if shape == "square":
        return (np.abs(dx) <= HALF_SIDE) & (np.abs(dy) <= HALF_SIDE)
    if shape == "triangle":  # pointing up: apex at -R, base at +R/2, half-width R*sqrt(3)/2
        r = TRIANGLE_R
        return (np.sqrt(3.0) * np.abs(dx) - dy <= r) & (dy <= r / 2)  # the slanted edges, the base
    raise ValueError(f"unknown shape {shape!r}; shapes are {SHAPES}")


def empty_frames(frames: int) -> np.ndarray:
    """uint8 [frames, SIZE, SIZE, 3]: the empty box, background inside a `WALL_WIDTH`-pixel wall."""
    video = np.empty((frames, SIZE, SIZE, 3), np.uint8)
    video[:] = WALL
    video[:, WALL_WIDTH : SIZE - WALL_WIDTH, WALL_WIDTH : SIZE - WALL_WIDTH] = BACKGROUND
    return video


def paths(scene: Scene, frames: int, start: int = 0, *, bounce: bool = True) -> np.ndarray:
    """Centres float64 [frames, len(scene.things), 2] (x, y) of frames start .. start + frames - 1.

    A lone shape follows `trajectory`. Two shapes also bounce off each other: when the next step would bring their
    centres closer than `contact` while they approach, each one moving towards the other
    mirrors its velocity in the plane between them (its speed is kept: the scene's speed holds for every shape),
    so shapes never overlap and nothing is ever hidden. The motion is stepped from frame 0 (`_pair_path`, cached
    per scene). With ``bounce=False`` every shape follows its own `trajectory` and shapes pass over each other
    (later-named ones drawn on top): occlusion, which a model may still draw and the metric must judge."""
    if frames < 1 or start < 0:
        raise ValueError(f"paths needs frames >= 1 and start >= 0, got frames={frames}, start={start}")
    if len(scene.things) == 1 or not bounce:
        return np.stack([trajectory(thing, frames, start) for thing in scene.things], axis=1)
    return _pair_path(scene, max(64, 1 << (start + frames - 1).bit_length()))[start : start + frames]


@functools.lru_cache(maxsize=1024)  # a training run asks for the same few hundred prompts' scenes again and again
def _pair_path(scene: Scene, frames: int) -> np.ndarray:
    """float64 [frames, 2, 2]: a two-shape scene's centres from frame 0, stepped frame by frame (`paths` asks for
    powers of two, so a longer request steps again at most log2 times).

    Each frame both shapes take their step (reflected at the walls, as `trajectory` folds them). If that would
    leave them closer than contact, each one whose step heads towards the other mirrors its velocity in the plane
    between them and steps again from where it was; if they still close in (one is held against a wall), both turn
    back the way they came, to where they were a frame before, which was far enough apart (a scene that starts
    with its shapes overlapping only mirrors until they are apart; so does a hand-made scene whose first step a
    wall forces within contact, which `sample_scene` never draws). Python floats: a step
    of numpy calls on 2-vectors costs ~7x as much."""
    a, b = scene.things
    apart = contact(a.shape, b.shape)
    (ax, ay), (bx, by) = a.position, b.position
    (avx, avy), (bvx, bvy) = a.velocity, b.velocity
    out = np.empty((frames, 4))
    was_apart = False  # the frame before was at least contact apart
    for t in range(frames):
        out[t] = ax, ay, bx, by
        dx, dy = bx - ax, by - ay
        dist = math.hypot(dx, dy)
        (qax, qay, wax, way), (qbx, qby, wbx, wby) = _wall_step(ax, ay, avx, avy), _wall_step(bx, by, bvx, bvy)
        if math.hypot(qbx - qax, qby - qay) < apart and dist > 0:
            nx, ny = dx / dist, dy / dist  # from shape a towards shape b
            along = wax * nx + way * ny
            if along > 0:  # a closes on b
                qax, qay, wax, way = _wall_step(ax, ay, wax - 2 * along * nx, way - 2 * along * ny)
            along = wbx * nx + wby * ny
            if along < 0:  # b closes on a
                qbx, qby, wbx, wby = _wall_step(bx, by, wbx - 2 * along * nx, wby - 2 * along * ny)
            if math.hypot(qbx - qax, qby - qay) < apart and dist >= apart and was_apart:
                qax, qay, wax, way = _wall_step(ax, ay, -avx, -avy)
                qbx, qby, wbx, wby = _wall_step(bx, by, -bvx, -bvy)
        was_apart = dist >= apart
        ax, ay, avx, avy, bx, by, bvx, bvy = qax, qay, wax, way, qbx, qby, wbx, wby
    out = out.reshape(frames, 2, 2)
    out.flags.writeable = False  # shared by every caller of the cache
    return out


def _wall_step(x: float, y: float, vx: float, vy: float) -> tuple[float, float, float, float]:
    """(x, y, vx, vy) one frame on: a coordinate that leaves [MARGIN, SIZE - MARGIN] is mirrored back and its
    velocity component flipped (as `trajectory` folds a path; a step is shorter than the box)."""
    lo, hi = MARGIN, SIZE - MARGIN
    x, y = x + vx, y + vy
    if x < lo or x > hi:
        x, vx = (2 * lo if x < lo else 2 * hi) - x, -vx
    if y < lo or y > hi:
        y, vy = (2 * lo if y < lo else 2 * hi) - y, -vy
    return x, y, vx, vy


def render(scene: Scene, frames: int, start: int = 0, *, bounce: bool = True) -> np.ndarray:
    """uint8 [frames, SIZE, SIZE, 3]: frames start .. start + frames - 1 of the scene (shapes bounce off each
    other; with ``bounce=False`` they pass over each other, see `paths`)."""
    path = paths(scene, frames, start, bounce=bounce)  # [frames, N, 2]; checks frames and start
    video = empty_frames(frames)
    for thing, centres in zip(scene.things, np.moveaxis(path, 1, 0)):
        mask = shape_mask(thing.shape, centres)
        video[mask] = COLOURS[thing.colour]
    return video


def clips(rng: np.random.Generator, batch: int, frames: int) -> tuple[np.ndarray, list[str]]:
    """A training batch: (uint8 [batch, frames, SIZE, SIZE, 3], their prompts), each clip a fresh random scene."""
    scenes = [sample_scene(rng) for _ in range(batch)]
    return np.stack([render(s, frames) for s in scenes]), [s.prompt for s in scenes]
