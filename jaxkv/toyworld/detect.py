"""Finding the shapes in toy-world frames, the first half of the quality metric (`jaxkv.toyworld.metric` scores
what is found here). Numpy only.

Detection (`detect`), per frame and per colour of `world.COLOURS`, vectorised over frames (`score` of 3,000
frames: 3.4 s with one object, 4.3 s with two, on 2 shared CPU cores):

1. **Colour masks.** A pixel belongs to colour c when c is its nearest palette entry (the background included) and
   lies within half of c's distance to the background (`COLOUR_FRACTION`): a pixel more than half covered by an
   object. Nearest-entry assignment puts a blurred edge's boundary half-way between the two colours, so a
   symmetric blur keeps an object's area; the cap rejects off-palette pixels. The wall's `world.WALL_WIDTH`-pixel
   border is left out (no shape reaches it; a decoder's colour offset once moved its grey within blue's cap). A
   fixed cap would not do: yellow is 296 from the background, green 191, so one number either clips yellow's
   blurred edges or admits too much noise.
   Measured (world clips through a 16-of-48 principal-component map of 4x4 patches, like the toy model's latent
   map, 32 dB; and through a 3x3 box blur with a per-clip colour offset of up to 10 per channel): the masks keep
   >= 96 % / >= 84 % of each object's pixels; uniform noise fills 13-20 % of each colour's mask before step 2.
2. **Denoising.** A 3x3 majority filter (a pixel stays when at least 5 of its 9 neighbourhood pixels are in the
   mask) removes isolated pixels and one-pixel lines, which is what noise leaves, and keeps every world shape but
   its sharpest corner pixels. After it, uniform noise left at most 43 pixels of a colour in an object box (300
   frames), under `MIN_AREA` (60, about half the smallest shape, the triangle: ~114 pixels as detected).
3. **One object per colour.** The object is the mask within `WINDOW` pixels of the mask's per-axis median (a shape
   reaches at most 9.5 pixels from its centre), re-centred once on the centre of mass of what that box holds (the
   median of two blobs lies at the edge of one), so stray pixels elsewhere neither drag the centroid nor enlarge the
   box. The whole mask is not one blob necessarily: an object cut in two by another one drawn over it stays one
   object. What lies outside the box is ``stray``: a second object of the same colour when it reaches `MIN_AREA`.
4. **Features.** Area, centroid (x, y in the world's units: pixel i's centre is at i + 0.5, as in
   `world.trajectory`), bounding box, and the shape: the one whose own mask (`world.shape_mask`, so shapes never
   drift from the renderer's) placed at the centroid overlaps the object best by IoU, if by at least `SHAPE_IOU`.
   Measured on the clips above: an object's IoU with its own shape is >= 0.87 (blurred triangles, whose corners
   are cut), with another shape at most 0.87 (circle vs square are alike), triangle vs either <= 0.62; 0.75 lets
   the world's shapes through and not blobs of the right colour.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxkv.toyworld import world

# [1 + C, 3]; entry 0 background. The wall (`world.WALL`) is left out on purpose: its grey lies between the background
# and the colours, so as an entry it would take blurred object edges; it lies outside every colour's cap (each colour
# is farther from it than its cap: green, the nearest, 124 against a cap of 96), so wall pixels are never an object's.
PALETTE = np.array([world.BACKGROUND, *world.COLOURS.values()], np.float32)
COLOUR_NAMES = tuple(world.COLOURS)  # detection's colour axis order
COLOUR_FRACTION = 0.5  # a colour's mask reaches this fraction of the way from it to the background
_CAP2 = (COLOUR_FRACTION * np.linalg.norm(PALETTE - PALETTE[0], axis=-1)) ** 2  # squared caps [1 + C]
MAJORITY = 5  # of the 9 pixels of a 3x3 neighbourhood, for a pixel to stay in a mask
WINDOW = 13  # half-size of the box (around the mask's median) that holds one object
MIN_AREA = 60  # pixels of an object (or of stray mask) to count as present
SHAPE_IOU = 0.75  # least overlap (IoU) of an object with its shape's mask to be that shape
_BLOCK = 256  # frames per vectorised block (bounds the temporaries to ~100 MB)


class Detections(NamedTuple):
    """What `detect` finds: per frame T and per colour C (the order of `COLOUR_NAMES`).

    present   bool    [T, C]      an object of that colour is seen (``area >= MIN_AREA``)
    area      int32   [T, C]      its pixels (within the object box)
    centroid  float64 [T, C, 2]   its (x, y) centre of mass; NaN where not present
    bbox      int32   [T, C, 4]   its bounding box (x0, y0, x1, y1), inclusive pixel indices; -1 where area is 0
    shape     int8    [T, C]      index into `world.SHAPES`, -1 where not present or no shape fits
    stray     int32   [T, C]      pixels of that colour outside the object box (a duplicate when >= MIN_AREA)
    """

    present: np.ndarray
    area: np.ndarray
    centroid: np.ndarray
    bbox: np.ndarray
    shape: np.ndarray
    stray: np.ndarray


def check_frames(frames) -> np.ndarray:
    """``frames`` as a numpy array, checked: uint8 [T >= 1, SIZE, SIZE, 3]; ValueError naming the problem."""
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (world.SIZE, world.SIZE, 3):
        raise ValueError(
            f"toy-world frames must be uint8 [T, {world.SIZE}, {world.SIZE}, 3], got {frames.dtype}{list(frames.shape)}"
        )
    if frames.shape[0] < 1:
        raise ValueError("toy-world frames must hold at least one frame, got 0")
    return frames


def colour_masks(frames) -> np.ndarray:
    """bool [T, C, SIZE, SIZE]: per colour, the pixels of ``frames`` uint8 [T, SIZE, SIZE, 3] nearest to it and
    within its cap (`COLOUR_FRACTION`), after the 3x3 majority filter."""
    frames = check_frames(frames)
    return np.concatenate([_masks(frames[i : i + _BLOCK]) for i in range(0, len(frames), _BLOCK)])


def _masks(block: np.ndarray) -> np.ndarray:
    rgb = block.astype(np.float32)
    # squared distances to the palette as |p|^2 - 2 p.c + |c|^2: a matmul, 20x faster than broadcasting
    d2 = (
        (rgb[..., 0] ** 2 + rgb[..., 1] ** 2 + rgb[..., 2] ** 2)[..., None] - 2 * rgb @ PALETTE.T + (PALETTE**2).sum(-1)
    )  # [B, H, W, 1 + C]
    nearest = d2.argmin(-1)
    near = np.take_along_axis(d2, nearest[..., None], -1)[..., 0] <= _CAP2[nearest]
    colours = np.arange(1, len(PALETTE))[None, :, None, None]
    raw = ((nearest[:, None] == colours) & near[:, None]).astype(np.uint8)  # [B, C, H, W]
    # the wall is no shape's: no world shape reaches it (centres stay MARGIN from the edge, a shape reaches at most
    # 9.9 px), and its grey, shifted by a decoder's colour offset, can fall within a colour's cap
    w = world.WALL_WIDTH
    raw[..., :w, :] = raw[..., -w:, :] = 0
    raw[..., :, :w] = raw[..., :, -w:] = 0
    # 3x3 neighbourhood counts by two separable box sums over a zero-padded border
    padded = np.pad(raw, ((0, 0), (0, 0), (1, 1), (1, 1)))
    rows = padded[:, :, :-2] + padded[:, :, 1:-1] + padded[:, :, 2:]
    counts = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]
    return counts >= MAJORITY


def detect(frames) -> Detections:
    """The objects of ``frames`` uint8 [T, SIZE, SIZE, 3], one per colour of `COLOUR_NAMES` (see the module
    docstring for how). Vectorised over frames in blocks of `_BLOCK`."""
    frames = check_frames(frames)
    parts = [_features(_masks(frames[i : i + _BLOCK])) for i in range(0, len(frames), _BLOCK)]
    return Detections(*(np.concatenate(field) for field in zip(*parts)))


_INDEX = np.arange(world.SIZE)


def _first(mask: np.ndarray) -> np.ndarray:
    """Index of the first True along the last axis (-1 where none)."""
    return np.where(mask.any(-1), mask.argmax(-1), -1)


def _boxed(masks: np.ndarray, mx: np.ndarray, my: np.ndarray):
    """The part of masks bool [B, C, H, W] within `WINDOW` of pixel (mx, my) int [B, C], with its column and row
    counts [B, C, SIZE], area [B, C] and centre of mass cx, cy [B, C] (NaN where empty)."""
    inx = np.abs(_INDEX - mx[..., None]) <= WINDOW  # [B, C, SIZE]
    iny = np.abs(_INDEX - my[..., None]) <= WINDOW
    obj = masks & iny[..., :, None] & inx[..., None, :]
    columns, rows = obj.sum(2), obj.sum(3)
    area = columns.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cx = (columns * (_INDEX + 0.5)).sum(-1) / area
        cy = (rows * (_INDEX + 0.5)).sum(-1) / area
    return obj, columns, rows, area, cx, cy


def _features(masks: np.ndarray) -> Detections:
    """Detections of one block of masks bool [B, C, H, W]."""
    columns, rows = masks.sum(2), masks.sum(3)  # per-x and per-y pixel counts [B, C, SIZE]
    total = columns.sum(-1)
    # per-axis median of the mask: the first index where the running count reaches half the total
    half = (total[..., None] + 1) // 2
    mx = np.where(total > 0, (columns.cumsum(-1) >= half).argmax(-1), 0)
    my = np.where(total > 0, (rows.cumsum(-1) >= half).argmax(-1), 0)
    obj, columns, rows, area, cx, cy = _boxed(masks, mx, my)
    # the median of two blobs lies at the edge of one, so centre the box once more on what it holds
    obj, columns, rows, area, cx, cy = _boxed(
        masks, np.where(area > 0, np.floor(cx), mx).astype(int), np.where(area > 0, np.floor(cy), my).astype(int)
    )
    x0, y0 = _first(columns > 0), _first(rows > 0)
    x1 = np.where(area > 0, world.SIZE - 1 - _first(columns[..., ::-1] > 0), -1)
    y1 = np.where(area > 0, world.SIZE - 1 - _first(rows[..., ::-1] > 0), -1)
    present = area >= MIN_AREA
    centroid = np.where(present[..., None], np.stack([cx, cy], -1), np.nan)
    shape = np.where(present, _classify(obj, centroid), -1).astype(np.int8)
    return Detections(
        present,
        area.astype(np.int32),
        centroid,
        np.stack([x0, y0, x1, y1], -1).astype(np.int32),
        shape,
        (total - area).astype(np.int32),
    )


def _classify(obj: np.ndarray, centroid: np.ndarray) -> np.ndarray:
    """Shape index (into `world.SHAPES`) of each object mask bool [B, C, H, W] with a centroid float [B, C, 2]
    (NaN: absent, -1): the shape whose own mask (`world.shape_mask`) placed at the centroid overlaps the object
    best, by intersection over union, if that IoU reaches `SHAPE_IOU`; else -1."""
    out = np.full(obj.shape[:2], -1)
    found = ~np.isnan(centroid[..., 0])
    if not found.any():
        return out
    masks, centres = obj[found], centroid[found]  # [K, H, W], [K, 2]
    area = masks.sum((1, 2))
    ious = []
    for shape in world.SHAPES:
        template = world.shape_mask(shape, centres)
        inter = (template & masks).sum((1, 2))
        ious.append(inter / (template.sum((1, 2)) + area - inter))
    ious = np.stack(ious, -1)
    out[found] = np.where(ious.max(-1) >= SHAPE_IOU, ious.argmax(-1), -1)
    return out
