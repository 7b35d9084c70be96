"""`WindowSchedule`: the arithmetic of windowed generation (pure Python ints, no arrays).

A stream of ``total_units`` units (frames or chunks) is generated window by window. Window i spans ``window_units``
units starting at ``i * stride``, stride = window - overlap: its first ``overlap`` units are the previous window's
last ones, conditioned on (their committed K/V), not generated again. So each window **commits** only the units the
previous window did not reach: window 0 commits [0, window), window i > 0 commits [end(i-1), end(i)), clipped to
``total_units``. The commit spans tile [0, total) exactly; the schedule pads to whole windows (the last window may
run past ``total``: its span is the padded one, its commit span is clipped).

Release. After window i, only the last ``context_units`` committed units must stay for what follows:
``released_end(i) = committed_end(i) - context`` (never below 0), and units [prefix, released_end(i)) may be
evicted. ``context_units = 0`` means no limit: nothing is ever released. The first ``prefix_units`` units are the
protected prefix (a sink: `jaxkv.cache.prefix`) and are never released.

Validation refuses a schedule that conditions on freed units. Window i+1 conditions on [start(i+1), end(i)), the
last ``overlap`` units of window i, and released_end(i) <= start(i+1) holds exactly when context >= overlap. The
seed's review found ``WindowSchedule(total_units=10, window_units=4, overlap_units=2, context_units=1)``: window 0
commits [0, 4), releases [0, 3), and window 1 = [2, 6) would condition on the freed unit 2. Refused whenever
0 < context < overlap, whatever the total (the knobs are meant to be used together).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxkv.validate import check_int


class Window(NamedTuple):
    """One window of a schedule, in units: ``[start, stop)`` is its (possibly padded) span, ``[commit_start,
    commit_stop)`` the part it commits, ``released_end`` the end of what may be evicted once it is done."""

    index: int
    start: int
    stop: int
    commit_start: int
    commit_stop: int
    released_end: int


@dataclasses.dataclass(frozen=True)
class WindowSchedule:
    """Window arithmetic over ``total_units`` units (see the module docstring).

    Attributes:
      total_units: units to generate, >= 1.
      window_units: units per window, >= 1.
      overlap_units: units each window shares with the previous one, 0 <= overlap < window.
      context_units: committed units kept after each window (0: keep everything); >= overlap when non-zero.
      prefix_units: protected units at the head of the stream, never released; 0 <= prefix <= window (the first
        window produces them).
    """

    total_units: int
    window_units: int
    overlap_units: int = 0
    context_units: int = 0
    prefix_units: int = 0

    def __post_init__(self):
        total = check_int("total_units", self.total_units, minimum=1)
        window = check_int("window_units", self.window_units, minimum=1)
        overlap = check_int("overlap_units", self.overlap_units, minimum=0, maximum=window - 1)
        context = check_int("context_units", self.context_units, minimum=0)
        prefix = check_int("prefix_units", self.prefix_units, minimum=0, maximum=window)
        if 0 < context < overlap:
            raise ValueError(
                f"context_units ({context}) must be 0 (keep everything) or >= overlap_units ({overlap}): after a "
                f"window only its last {context} committed units are kept, but the next window conditions on the "
                f"last {overlap}, so it would read freed units"
            )
        for name, value in (
            ("total_units", total),
            ("window_units", window),
            ("overlap_units", overlap),
            ("context_units", context),
            ("prefix_units", prefix),
        ):
            object.__setattr__(self, name, value)

    @property
    def stride(self) -> int:
        """Units between window starts: window - overlap (>= 1)."""
        return self.window_units - self.overlap_units

    @property
    def num_windows(self) -> int:
        """Fewest whole windows whose spans reach total_units: 1 + ceil((total - window) / stride), at least 1."""
        rest = max(0, self.total_units - self.window_units)
        return 1 + -(-rest // self.stride)

    @property
    def padded_total(self) -> int:
        """End of the last window's span (>= total_units): the units a padded generation produces."""
        return self.window_units + (self.num_windows - 1) * self.stride

    @property
    def padding(self) -> int:
        """Units of the last window past total_units."""
        return self.padded_total - self.total_units

    def _check_index(self, i) -> int:
        return check_int("window index", i, minimum=0, maximum=self.num_windows - 1)

    def span(self, i: int) -> tuple[int, int]:
        """[start, stop) of window i, padded: (i * stride, i * stride + window)."""
        i = self._check_index(i)
        start = i * self.stride
        return start, start + self.window_units

    def commit_span(self, i: int) -> tuple[int, int]:
        """[start, stop) that window i commits: from the previous window's end (0 for the first) to its own end,
        both clipped to total_units. Non-empty for every window; the spans tile [0, total_units)."""
        i = self._check_index(i)
        start = 0 if i == 0 else min(self.span(i - 1)[1], self.total_units)
        return start, min(self.span(i)[1], self.total_units)

    def released_end(self, i: int) -> int:
        """Units [prefix_units, released_end(i)) may be evicted once window i has committed (none when
        context_units is 0)."""
        i = self._check_index(i)
        if self.context_units == 0:
            return 0
        return max(0, self.commit_span(i)[1] - self.context_units)

    def released_span(self, i: int) -> tuple[int, int]:
        """[start, stop) of the units that may be evicted after window i: the protected prefix excluded
        (empty, start == stop, when nothing is released)."""
        lo = self.prefix_units
        return lo, max(lo, self.released_end(i))

    def window(self, i: int) -> Window:
        i = self._check_index(i)
        return Window(i, *self.span(i), *self.commit_span(i), self.released_end(i))

    def windows(self) -> list[Window]:
        """Every window, in order."""
        return [self.window(i) for i in range(self.num_windows)]
