"""A quality metric of toy-world video that can fail: find the shapes in the frames, then score how well they follow
the prompt, how plausibly they move, and how both hold up over a long stream. Numpy only.

Detection (`detect`: colour masks, denoising, one object per colour, features) is `jaxkv.toyworld.detect`, whose
names this module re-exports.

Scoring (`score`): prompt adherence per frame (`frame_adherence`), temporal continuity per transition
(`transitions`), their product `overall`, and the same per window of chunks for drift. The world's shapes bounce
off each other and never overlap (`world.paths`), but a model may draw one over another: later-named objects are
read as on top, so an earlier one may be partly or wholly under a later one (`occlusion`): its shape is then not
checked, its centroid is not trusted, and it may be missing while its path keeps it under the other one (the
world's own ``bounce=False`` clips, in which shapes pass over each other, are how the tests check this). Real
clips, bouncing or passing over each other, score 1.0 on every score.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxkv.toyworld import world
from jaxkv.toyworld.detect import COLOUR_NAMES as COLOUR_NAMES  # re-exported, as jaxkv.toyworld.metric.X
from jaxkv.toyworld.detect import MIN_AREA as MIN_AREA  # re-exported, as jaxkv.toyworld.metric.X
from jaxkv.toyworld.detect import Detections as Detections  # re-exported, as jaxkv.toyworld.metric.X
from jaxkv.toyworld.detect import check_frames
from jaxkv.toyworld.detect import detect as detect  # re-exported, as jaxkv.toyworld.metric.X
from jaxkv.validate import check_int

LAG = 4  # frames between the centroids of the speed and straightness checks
CENTROID_ERROR = 0.6  # px, the largest per-axis gap between a detected centroid and the true centre
STEP_SLACK = 2 * np.sqrt(2) * CENTROID_ERROR  # both ends of a displacement off by CENTROID_ERROR per axis
CURVE_SLACK = 4 * CENTROID_ERROR  # c[t] - 2 c[t - LAG] + c[t - 2 LAG]: weights 1 + 2 + 1
COVER_MARGIN = 2  # px by which bounding boxes are grown to decide that one object covers another
# One frame's step of a covered object's visible centroid, beyond the speed, as its visible part shrinks or splits:
# measured on world clips up to 4.6 px over ~7,900 covered steps (75 two-object clips), 6.0 px once in 20 more
# clips. 8 px lets those through and stays well under the hard bound (the visible part lies inside the object's
# outline, so its centroid is within the square's half-diagonal, 9.9 px, of the true centre: 19.8 px), which would
# let a shuffled clip keep ~14 % of its transitions rather than ~4 %.
COVERED_SLACK = 8.0
# Frames an object may spend wholly out of sight under another (no pixel left): measured on 75 two-object clips of
# 300 frames, at most 26 in one passage (an absent run, tips peeking out, lasted up to 94); twice that is allowed.
HIDE_FRAMES = 60
# px per axis between a hidden object's centre, carried on along its path, and the centroid of the one above it
# (`_on_its_path`): it is all but wholly covered (under MIN_AREA left) only this near. Measured on 3 x 75 two-object
# world clips of 300 frames, each clean, through a principal-component map and blurred: 8 keeps every hidden frame
# the rule without a path keeps, 7 drops 1-2 %; 9 leaves a pixel to spare.
HIDE_REACH = 9.0
OUTLINE_REACH = world.HALF_SIDE * np.sqrt(2)  # px: the farthest any shape's pixel lies from its centre (9.9)
# the most clear frames before an object went under from which its velocity is read (`_on_its_path`)
TRACK_FRAMES = 12
# The travel check: over any `STOP_FRAMES` frames in at least `STOP_SEEN` of which an object is present, its centre
# must span `STOP_SPAN` px along x or y. The world's shapes move 1 or 2 px a frame: over such windows of 100 world
# scenes of 300 frames (20 canonical, 80 random; bounces and crossings included), each decoded by a principal-
# component map and by a blurring decoder, every centre spanned at least 9.0 px (slow) and 15 px (fast);
# a shape the model has stopped spans under 3. Covered frames count (a covered shape's visible centroid moves with
# it), so two blobs stuck together, covered in every frame, do not pass for a crossing. The speed check cannot
# see a stop within reach of a wall (it passes for a bounce), nor a covered object's; this one can.
STOP_FRAMES = 30
STOP_SEEN = 15
STOP_SPAN = 6.0


# What a viewer sees of motion (`travel`): per named shape, how far its centre gets within `TRAVEL_FRAMES` frames
# (a second at 30 fps), median over the stream. The travel check above only asks that a shape has not stopped; this
# reading says how far it goes, to be compared with the world's own clips of the same prompt (`quality.travel`).
TRAVEL_FRAMES = 30


def travel(detections: Detections, prompt: str, *, frames: int = TRAVEL_FRAMES) -> np.ndarray:
    """float64 [N]: per named object of ``prompt`` (prompt order), the median over every window of ``frames``
    consecutive frames in which the object is present in at least half of them, of the diagonal of the box its
    detected centre covers there (px: a shape moving straight at v px per frame spans ``(frames - 1) * v``,
    less where it bounces). NaN for an object with no such window (never seen, or the stream shorter than
    ``frames``). Frames where it is absent are left out of a window's box, not counted as standing still."""
    frames = check_int("frames", frames, minimum=2)
    colours, _, _ = _objects(prompt)
    centre = detections.centroid[:, colours]  # [T, N, 2], NaN where absent
    present = detections.present[:, colours]  # [T, N]
    if len(present) < frames:
        return np.full(len(colours), np.nan)
    windows = lambda x: np.lib.stride_tricks.sliding_window_view(x, frames, axis=0)  # [W, N, (2,) F]
    hi = windows(np.where(present[..., None], centre, -np.inf)).max(-1)  # [W, N, 2]
    lo = windows(np.where(present[..., None], centre, np.inf)).min(-1)
    judged = windows(present).sum(-1) * 2 >= frames  # [W, N]
    span = np.where(judged, np.linalg.norm(np.where(judged[..., None], hi - lo, 0.0), axis=-1), np.nan)
    out = np.full(len(colours), np.nan)
    for n in range(len(colours)):
        if judged[:, n].any():
            out[n] = float(np.nanmedian(span[:, n]))
    return out


# How far across the box a named shape gets over a whole stream (`roam`): the per-window `travel` cannot tell a shape
# that crosses the box from one that loops near its start at the same speed. The box is the middle `ROAM_PERCENT`..
# 100 - `ROAM_PERCENT` % of the detected centres along each axis, so that a few stray detections do not stretch it;
# the reading is its longer side. On the world's own clips of `quality.PROMPTS` over 300 frames that is 32-33 px in
# the canonical scenes and 0.85-1.08x that in 240 random scenes of the same prompts (whatever the heading, a shape
# crosses the box along one axis or both); the box's area would not do: the side of a square of that area depends
# on the heading (0.22-1.54x).
# A model's shapes circling near their start read 7-10 px.
ROAM_PERCENT = 5


def roam(detections: Detections, prompt: str) -> np.ndarray:
    """float64 [N]: per named object of ``prompt`` (prompt order), the longer side (px) of the box its detected
    centre keeps to over the whole stream (per axis, from the `ROAM_PERCENT` th to the 100 - `ROAM_PERCENT` th
    percentile over the frames where it is present). NaN for an object never seen."""
    colours, _, _ = _objects(prompt)
    out = np.full(len(colours), np.nan)
    for n, k in enumerate(colours):
        centre = detections.centroid[detections.present[:, k], k]  # [seen, 2]
        if len(centre):
            lo, hi = np.percentile(centre, [ROAM_PERCENT, 100 - ROAM_PERCENT], axis=0)
            out[n] = float((hi - lo).max())
    return out


class Scores(NamedTuple):
    """What `score` returns; every score is in [0, 1], 1 = perfect.

    adherence          mean over frames of matched / max(named, detected) (see `frame_adherence`)
    continuity         fraction of plausible frame-to-frame transitions over objects (see `transitions`)
    overall            adherence * continuity: both must hold, either failing pulls it down
    drift              the worst window's overall score (1 = no window worse than perfect)
    window_start       int64 [N]    first chunk of each window (0, window_chunks, 2 window_chunks, ...)
    window_adherence   float64 [N]  adherence over each window's frames
    window_continuity  float64 [N]  continuity over the transitions into each window's frames
    window_overall     float64 [N]  their product
    """

    adherence: float
    continuity: float
    overall: float
    drift: float
    window_start: np.ndarray
    window_adherence: np.ndarray
    window_continuity: np.ndarray
    window_overall: np.ndarray


def _objects(prompt: str) -> tuple[np.ndarray, np.ndarray, float]:
    """(colour indices int [N], shape indices int [N], speed) of the prompt's objects, in prompt order."""
    objects, speed = world.parse_prompt(prompt)
    colours = np.array([COLOUR_NAMES.index(c) for c, _ in objects])
    shapes = np.array([world.SHAPES.index(s) for _, s in objects])
    return colours, shapes, world.SPEEDS[speed]


class Occlusion(NamedTuple):
    """Where the prompt's objects may hide under each other, per frame T and object N (prompt order). The world
    draws later-named objects on top of earlier ones.

    covered   bool [T, N]  present, and its bounding box grown by `COVER_MARGIN` meets that of a present object
                           named after it: it may be partly under it, its outline cut and its visible centroid
                           shifted. The last-named object is never covered.
    hidden    bool [T, N]  absent (under `MIN_AREA`) while an object named after it is present, in a run of
                           absent frames that starts after a covered frame and ends before one (or at an end of
                           the stream), and in which at most `HIDE_FRAMES` frames show none of its pixels beside
                           an object named after it: it went under another and came out from under it;
                           and only while the path it was on before (`_on_its_path`) keeps it under one of them,
                           so an object lost where it went under, or merged into the one above, is missing once
                           its path would have carried it out; and only while the object above it moves
                           plausibly (its steps into and out of the frame pass `transitions`' checks).
    """

    covered: np.ndarray
    hidden: np.ndarray


def _meets(box: np.ndarray, other: np.ndarray) -> np.ndarray:
    """bool [T]: boxes int [T, 4] (x0, y0, x1, y1) meet ``other`` grown by `COVER_MARGIN`."""
    g = COVER_MARGIN
    return (
        (box[:, 0] <= other[:, 2] + g)
        & (other[:, 0] <= box[:, 2] + g)
        & (box[:, 1] <= other[:, 3] + g)
        & (other[:, 1] <= box[:, 3] + g)
    )


def occlusion(detections: Detections, prompt: str) -> Occlusion:
    """`Occlusion` of the prompt's objects in ``detections``."""
    return _judge(detections, prompt)[0]


def _judge(detections: Detections, prompt: str) -> tuple[Occlusion, np.ndarray]:
    """(`occlusion`, `transitions`): each object's steps are judged with its own occlusion, which depends on
    the steps of the objects above it, so both come out of one pass from the top object down."""
    colours, shapes, speed = _objects(prompt)
    present = detections.present[:, colours]  # [T, N]
    seen_any = detections.area[:, colours] > 0  # some pixels, maybe under MIN_AREA
    box = detections.bbox[:, colours]  # [T, N, 4]
    frames, count = present.shape
    covered = np.zeros_like(present)
    near = np.zeros_like(present)  # pixels of n beside a present object named after it
    above = np.zeros_like(present)  # an object named after n is present
    for n in range(count):
        for other in range(n + 1, count):
            meets = _meets(box[:, n], box[:, other]) & seen_any[:, n] & present[:, other]
            covered[:, n] |= meets & present[:, n]
            near[:, n] |= meets
            above[:, n] |= present[:, other]
    index = np.arange(frames)[:, None]
    column = np.arange(count)[None]
    before = np.maximum.accumulate(np.where(present, index, -1), axis=0)  # last present frame <= t
    after = np.minimum.accumulate(np.where(present, index, frames)[::-1], axis=0)[::-1]  # first present >= t
    went_under = (before < 0) | covered[np.maximum(before, 0), column]
    came_out = (after >= frames) | covered[np.minimum(after, frames - 1), column]
    bare = np.concatenate([np.zeros((1, count), np.int64), (~present & ~near).cumsum(0)])  # running count
    bare_in_run = bare[after, column] - bare[before + 1, column]
    hidden = (
        ~present & above & went_under & came_out & (bare_in_run <= HIDE_FRAMES) & ((before >= 0) | (after < frames))
    )
    # from the top down, as an object's steps are judged with its own occlusion: a frame may hide n under an
    # object named after it only if that one moves as the world moves things there (a still or jumping blob of its
    # colour is no cover), and only while n's own path keeps it under one
    centre = detections.centroid[:, colours]
    moving = np.zeros_like(present)  # present, with plausible steps into and out of the frame
    steps = np.zeros((frames - 1, count), bool)
    for n in range(count - 1, -1, -1):
        if n < count - 1:
            hidden[:, n] &= moving[:, n + 1 :].any(1) & _on_its_path(
                hidden[:, n],
                present[:, n] & ~covered[:, n],
                centre[:, n],
                centre[:, n + 1 :],
                speed,
                after[:, n] < frames,
            )
        others = np.delete(centre, n, axis=1)  # [T, N - 1, 2]
        contact = np.array(
            [
                world.contact(world.SHAPES[shapes[n]], world.SHAPES[shapes[m]])  # [N - 1]
                for m in range(count)
                if m != n
            ]
        )
        steps[:, n] = _steps(
            present[:, n], hidden[:, n], covered[:, n] | hidden[:, n], centre[:, n], speed, others, contact
        )
        moving[:, n] = present[:, n] & np.append(steps[:, n], True) & np.insert(steps[:, n], 0, True)
    return Occlusion(covered, hidden), steps


def _runs(flags: np.ndarray):
    """(first, last) inclusive of each run of True in flags bool [T]."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return zip(np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0] - 1)


def _on_its_path(
    hidden: np.ndarray, clear: np.ndarray, centre: np.ndarray, above: np.ndarray, speed: float, comes_out: np.ndarray
) -> np.ndarray:
    """bool [T]: the frames of each run of ``hidden`` [T] (one object's) during which the object, moving on from
    its last ``clear`` frame (present, not covered: centroid trusted) as it moved before, is still under an object
    named after it (``above`` [T, M, 2] centroids, NaN where absent) -- up to the first frame it is not.

    The path: the last clear centroid c[u] moved on at the velocity read from the clear frames before u along each
    axis (since the axis was last within a step of a wall, at most `TRACK_FRAMES`), folded at the walls as
    `world.trajectory` folds it. Under: within `HIDE_REACH` px of an upper centroid on both axes, plus the
    velocity's uncertainty (2 `CENTROID_ERROR` over the frames it was read from; the speed on an axis with fewer
    than 2) times the frames since u. With no clear frame before the run, c[u] is the last centroid seen (covered),
    the reach starts `OUTLINE_REACH` wider and the slack is the speed on both axes; with no centroid at all, the
    run counts only if the object comes out (``comes_out`` [T])."""
    out = np.zeros_like(hidden)
    lo, span = world.MARGIN, world.SIZE - 2 * world.MARGIN
    # frames whose centre lies beyond a step of either wall: no bounce between them and the next
    far = np.minimum(centre - lo, lo + span - centre) > speed + CENTROID_ERROR  # [T, 2]; NaN: False
    for first, last in _runs(hidden):
        anchors = np.nonzero(clear[:first])[0]
        seen = np.nonzero(~np.isnan(centre[:first, 0]))[0]
        if not len(anchors) and not len(seen):
            out[first : last + 1] = comes_out[first]
            continue
        u = anchors[-1] if len(anchors) else seen[-1]
        velocity, slack = np.zeros(2), np.full(2, speed)
        for axis in range(2 if len(anchors) else 0):
            k = 0
            while k < TRACK_FRAMES and u - k - 1 >= 0 and clear[u - k - 1] and far[u - k - 1 : u + 1, axis].all():
                k += 1
            if k >= 2:
                velocity[axis] = (centre[u, axis] - centre[u - k, axis]) / k
                slack[axis] = 2 * CENTROID_ERROR / k
        t = np.arange(first, last + 1)
        free = centre[u] - lo + (t - u)[:, None] * velocity  # [run, 2]
        folded = np.mod(free, 2 * span)
        path = lo + np.where(folded > span, 2 * span - folded, folded)
        # a covered object's visible centroid lies within its outline's reach of its centre
        reach = HIDE_REACH + (0.0 if len(anchors) else OUTLINE_REACH) + (t - u)[:, None] * slack  # [run, 2]
        gap = np.abs(above[first : last + 1] - path[:, None])  # [run, M, 2]
        under = (gap <= reach[:, None]).all(-1).any(-1)  # NaN (absent) compares False
        out[first : last + 1] = np.logical_and.accumulate(under)
    return out


def frame_adherence(detections: Detections, prompt: str) -> np.ndarray:
    """float64 [T]: per frame, matched / max(named, detected).

    matched: the prompt's objects seen in their colour and shape; a covered object (see `occlusion`), or one with
    an earlier-named object hidden under it, needs only its colour, and a hidden one counts as seen. detected:
    the colours seen, plus one for each colour with a second blob (``stray >= MIN_AREA``), so an object the prompt
    does not name, or a duplicate, costs as much as a missing one."""
    colours, shapes, _ = _objects(prompt)
    d = detections
    cover, hidden = occlusion(d, prompt)
    # an object with another hidden under it: the slivers of the lower one blend into its outline
    over_hidden = np.cumsum(hidden, 1) - hidden > 0
    unsure = cover | over_hidden
    right = (d.present[:, colours] & ((d.shape[:, colours] == shapes) | unsure)) | hidden
    detected = d.present.sum(1) + (d.stray >= MIN_AREA).sum(1)
    return right.sum(1) / np.maximum(len(colours), detected)


def _any_in(flags: np.ndarray, first: np.ndarray, last: int) -> np.ndarray:
    """bool [len(first), ...]: any of ``flags`` bool [T, ...] set over frames first[i] .. first[i] + last
    (inclusive)."""
    running = np.concatenate([np.zeros_like(flags[:1], np.int64), flags.cumsum(0)])
    return running[first + last + 1] - running[first] > 0


def transitions(detections: Detections, prompt: str) -> np.ndarray:
    """bool [T - 1, N]: whether the step of the prompt's object n from frame t to t + 1 is plausible.

    A transition is plausible when the object is seen in both frames (present, or hidden: see `occlusion`) and
      * step: it moved at most speed + `STEP_SLACK` (more is a teleport; `COVERED_SLACK` instead while it is
        covered, as its visible part's centroid shifts as it goes under);
      * speed, over `LAG` frames (one frame's step is too coarse: a square's pixels, hence its centroid, move in
        whole pixels): the displacement from frame t + 1 - LAG is at most LAG * speed + STEP_SLACK (reflection
        only shortens a path), and at least LAG * speed - STEP_SLACK where no wall is within reach and it does
        not come within bouncing distance of another (a frozen or too slow object fails);
      * straightness (velocity changes only at walls and where two shapes bounce off each other): along each
        axis whose wall is out of reach of the middle point, c[t + 1] - 2 c[t + 1 - LAG] + c[t + 1 - 2 LAG] is at
        most `CURVE_SLACK`; a bounce flips only the axis that reached a wall; not checked where the object comes
        within bouncing distance of another (its contact distance + both steps + detection) in any frame spanned;
      * travel: over the `STOP_FRAMES` frames up to t + 1, if it is present in at least `STOP_SEEN` of them, its
        centre spans at least `STOP_SPAN` px along x or y there (a stop within reach of a wall passes the speed
        check as a bounce, and a covered object's speed is not checked; no bounce or crossing holds a shape still
        for long).
    "Within reach" means within LAG * speed + CENTROID_ERROR of a wall of the centres' box [MARGIN, SIZE -
    MARGIN] (an object can only have bounced on an axis if it was that near). The speed and straightness checks
    are skipped where a frame they need is missing (that absence already failed) or the object is covered or
    hidden in any frame they span.
    """
    return _judge(detections, prompt)[1]


def _steps(
    present: np.ndarray,
    hidden: np.ndarray,
    shaded: np.ndarray,
    centre: np.ndarray,
    speed: float,
    others: np.ndarray,
    contact: np.ndarray,
) -> np.ndarray:
    """`transitions` of one object: bool [T - 1] from its present, hidden, shaded (covered or hidden) bool [T],
    centroid float [T, 2], the other objects' centroids ``others`` float [T, M, 2] (NaN where absent) and the
    centre distance at which it bounces off each, ``contact`` float [M] (`world.paths`)."""
    frames = len(present)
    seen = present | hidden
    later = np.arange(1, frames)  # frame t + 1 of each transition

    step = np.linalg.norm(centre[1:] - centre[:-1], axis=-1)  # NaN where an end is absent
    limit = speed + np.where(shaded[:-1] | shaded[1:], COVERED_SLACK, STEP_SLACK)
    ok = seen[:-1] & seen[1:] & ~(step > limit)

    reach = LAG * speed + CENTROID_ERROR
    wall = np.minimum(centre - world.MARGIN, world.SIZE - world.MARGIN - centre)  # [T, 2]
    far = wall > reach  # no bounce on that axis within LAG frames
    # a frame from which the object may bounce off another before the next: `world.paths` turns two shapes round
    # when their next step would bring them under contact, so they are within contact + both steps (+ detection)
    gap = np.linalg.norm(others - centre[:, None], axis=-1)  # [T, M]; NaN where either is absent
    touching = (gap <= contact + 2 * speed + 2 * CENTROID_ERROR).any(-1)

    sel = later >= LAG  # transitions with a speed check
    if sel.any():
        t, s = later[sel], later[sel] - LAG
        checked = present[s] & present[t] & ~_any_in(shaded, s, LAG)
        disp = np.linalg.norm(centre[t] - centre[s], axis=-1)
        no_bounce = (far[t] | far[s]).all(-1) & ~_any_in(touching, s, LAG)
        bad = (disp > LAG * speed + STEP_SLACK) | (no_bounce & (disp < LAG * speed - STEP_SLACK))
        ok[sel] &= ~(checked & bad)

    sel = later >= 2 * LAG  # transitions with a straightness check
    if sel.any():
        t = later[sel]
        m, s = t - LAG, t - 2 * LAG
        checked = present[s] & present[m] & present[t] & ~_any_in(shaded, s, 2 * LAG)
        curve = np.abs(centre[t] - 2 * centre[m] + centre[s])  # [.., 2]
        bad = (far[m] & (curve > CURVE_SLACK)).any(-1) & ~_any_in(touching, s, 2 * LAG)
        ok[sel] &= ~(checked & bad)

    if frames >= STOP_FRAMES:  # transitions into frames STOP_FRAMES - 1 on
        windows = lambda x: np.lib.stride_tricks.sliding_window_view(x, STOP_FRAMES, axis=0)
        hi = windows(np.where(present[:, None], centre, -np.inf)).max(-1)  # [T - STOP_FRAMES + 1, 2]
        lo = windows(np.where(present[:, None], centre, np.inf)).min(-1)
        judged = windows(present).sum(-1) >= STOP_SEEN
        stopped = judged & ((hi - lo).max(-1) < STOP_SPAN) & present[STOP_FRAMES - 1 :]
        ok[STOP_FRAMES - 2 :] &= ~stopped
    return ok


def score(frames, prompt: str, *, chunk_frames: int = 3, window_chunks: int = 50) -> Scores:
    """Scores of a generated stream ``frames`` uint8 [T, SIZE, SIZE, 3] against its ``prompt``.

    T must be a whole number of chunks of ``chunk_frames`` frames, and at least 2 frames (one transition). The
    stream is cut into windows of ``window_chunks`` chunks (the last may be shorter) for the drift table; a
    transition t -> t + 1 belongs to the window of frame t + 1, so every transition counts once.
    """
    chunk_frames = check_int("chunk_frames", chunk_frames, minimum=1)
    window_chunks = check_int("window_chunks", window_chunks, minimum=1)
    frames = check_frames(frames)
    _objects(prompt)  # a bad prompt fails before any work
    if window_chunks * chunk_frames < 2:
        raise ValueError(
            f"a drift window must span at least 2 frames (one transition), got window_chunks="
            f"{window_chunks} x chunk_frames={chunk_frames}"
        )
    if len(frames) < 2 or len(frames) % chunk_frames:
        raise ValueError(
            f"score needs a whole number of {chunk_frames}-frame chunks and at least 2 frames, got {len(frames)} frames"
        )
    found = detect(frames)
    adherence = frame_adherence(found, prompt)  # [T]
    plausible = transitions(found, prompt)  # [T - 1, N]
    window = window_chunks * chunk_frames
    starts = np.arange(0, len(frames), window)
    window_adherence = np.add.reduceat(adherence, starts) / np.diff(np.append(starts, len(frames)))
    # transition i ends at frame i + 1: window w holds transitions starts[w] - 1 .. starts[w + 1] - 2
    bounds = np.maximum(starts - 1, 0)
    per_transition = plausible.mean(1)
    window_continuity = np.add.reduceat(per_transition, bounds) / np.diff(np.append(bounds, len(per_transition)))
    window_overall = window_adherence * window_continuity
    a, c = float(adherence.mean()), float(per_transition.mean())
    return Scores(
        a,
        c,
        a * c,
        float(window_overall.min()),
        starts // chunk_frames,
        window_adherence,
        window_continuity,
        window_overall,
    )
