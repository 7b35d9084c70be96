"""WindowSchedule against a unit-by-unit simulation, over the whole small parameter space."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.cache.window_schedule import Window, WindowSchedule


def simulate(total, window, overlap, context, prefix):
    """Windows generated greedily on sets of units, knowing nothing of the schedule's formulas.

    Returns [(span units, committed units, freed-so-far units)] per window: a window commits the units of its span
    below ``total`` that nothing committed yet; after it, all committed units but the newest ``context`` are
    free to evict (none when context is 0), except the first ``prefix`` units.
    """
    out, committed, start = [], [], 0
    while True:
        span = list(range(start, start + window))
        new = [u for u in span if u < total and u not in committed]
        committed += new
        freed = set() if context == 0 else set(committed[: max(0, len(committed) - context)]) - set(range(prefix))
        out.append((span, new, freed))
        if start + window >= total:
            return out
        start += window - overlap


def _check_against_simulation(s: WindowSchedule):
    sim = simulate(s.total_units, s.window_units, s.overlap_units, s.context_units, s.prefix_units)
    assert s.num_windows == len(sim)
    assert s.stride == s.window_units - s.overlap_units
    tiled = []
    for i, (span, new, freed) in enumerate(sim):
        w = s.window(i)
        assert (w.start, w.stop) == s.span(i) == (span[0], span[-1] + 1)
        assert s.commit_span(i) == (w.commit_start, w.commit_stop)
        assert list(range(w.commit_start, w.commit_stop)) == new and new, (i, w, new)
        lo, hi = s.released_span(i)
        assert set(range(lo, hi)) == freed, (i, (lo, hi), freed)
        tiled += new
        if i + 1 < len(sim):  # the next window never conditions on a freed unit
            needed = set(sim[i + 1][0]) - set(sim[i + 1][1])
            assert not needed & freed, (i, needed, freed)
            assert s.released_end(i) <= s.span(i + 1)[0]
    assert tiled == list(range(s.total_units))  # commit spans tile [0, total): no gap, no double commit
    assert s.padded_total == sim[-1][0][-1] + 1 and s.padding == s.padded_total - s.total_units
    assert s.padded_total >= s.total_units > s.padded_total - s.stride or s.num_windows == 1
    assert s.windows() == [s.window(i) for i in range(s.num_windows)]


SPACE = dict(total=range(1, 13), window=range(1, 7), overlap=range(0, 6), context=range(0, 8), prefix=range(0, 7))


def _cases():
    for total, window, overlap, context, prefix in itertools.product(*SPACE.values()):
        if overlap < window and prefix <= window:
            yield total, window, overlap, context, prefix


def test_whole_small_space_matches_simulation_or_is_refused():
    accepted = refused = 0
    for total, window, overlap, context, prefix in _cases():
        if 0 < context < overlap:
            with pytest.raises(ValueError, match="context_units"):
                WindowSchedule(total, window, overlap, context, prefix)
            refused += 1
            # Refused for a reason: with two or more windows the simulation frees a unit the next window needs.
            sim = simulate(total, window, overlap, context, prefix)
            if len(sim) > 1 and prefix <= window - overlap:
                needed = set(sim[1][0]) - set(sim[1][1])
                assert needed & sim[0][2], (total, window, overlap, context, prefix)
            continue
        _check_against_simulation(WindowSchedule(total, window, overlap, context, prefix))
        accepted += 1
    assert accepted > 5000 and refused > 500, (accepted, refused)


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 200), window=st.integers(1, 40), data=st.data())
def test_property_larger_schedules_match_simulation(total, window, data):
    overlap = data.draw(st.integers(0, window - 1))
    context = data.draw(st.one_of(st.just(0), st.integers(max(overlap, 1), 60)))
    prefix = data.draw(st.integers(0, window))
    _check_against_simulation(WindowSchedule(total, window, overlap, context, prefix))


def test_the_review_case_is_refused():
    with pytest.raises(ValueError, match=r"context_units \(1\) must be 0 .* or >= overlap_units \(2\)"):
        WindowSchedule(total_units=10, window_units=4, overlap_units=2, context_units=1)
    # What it would have done: window 0 commits [0, 4) and frees [0, 3); window 1 = [2, 6) needs unit 2.
    sim = simulate(10, 4, 2, 1, 0)
    assert sim[0][2] == {0, 1, 2} and sim[1][0] == [2, 3, 4, 5]


def test_worked_examples():
    s = WindowSchedule(total_units=10, window_units=4, overlap_units=2, context_units=2)
    assert s.windows() == [
        Window(0, 0, 4, 0, 4, 2),
        Window(1, 2, 6, 4, 6, 4),
        Window(2, 4, 8, 6, 8, 6),
        Window(3, 6, 10, 8, 10, 8),
    ]
    padded = WindowSchedule(total_units=9, window_units=4, overlap_units=1, context_units=3, prefix_units=2)
    assert (padded.num_windows, padded.padded_total, padded.padding) == (3, 10, 1)
    assert [padded.commit_span(i) for i in range(3)] == [(0, 4), (4, 7), (7, 9)]
    assert padded.span(2) == (6, 10)  # the last window runs one unit past the end
    assert [padded.released_span(i) for i in range(3)] == [(2, 2), (2, 4), (2, 6)]  # the prefix is never freed
    keep_all = WindowSchedule(total_units=7, window_units=3, overlap_units=2)
    assert keep_all.num_windows == 5 and all(keep_all.released_end(i) == 0 for i in range(5))
    short = WindowSchedule(total_units=2, window_units=5)
    assert short.windows() == [Window(0, 0, 5, 0, 2, 0)] and short.padding == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(total_units=0, window_units=4), "total_units must be >= 1"),
        (dict(total_units=4, window_units=0), "window_units must be >= 1"),
        (dict(total_units=4, window_units=3, overlap_units=3), "overlap_units must be <= 2"),
        (dict(total_units=4, window_units=3, overlap_units=-1), "overlap_units must be >= 0"),
        (dict(total_units=4, window_units=3, context_units=-1), "context_units must be >= 0"),
        (dict(total_units=4, window_units=3, prefix_units=4), "prefix_units must be <= 3"),
        (dict(total_units=4.0, window_units=3), "total_units must be an int"),
        (dict(total_units=4, window_units=True), "window_units must be an int"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WindowSchedule(**kwargs)


def test_window_index_is_range_checked():
    s = WindowSchedule(total_units=5, window_units=2)
    assert s.num_windows == 3
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="window index"):
            s.span(bad)
    with pytest.raises(ValueError, match="window index must be an int"):
        s.commit_span(1.0)
