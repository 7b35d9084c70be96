"""Windowed generation (`jaxkv.windowed`) against a cache-free reference whose visibility is derived here from the
schedule's definition (windows, commit spans, releases), over several schedules including a padded last window;
context 0 against the plain rollout; one compilation; the configuration checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import rollout as R
from jaxkv import windowed as WD
from jaxkv.cache import WindowSchedule
from jaxkv.compilation import compile_count
from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.schedule import Schedule
from tests.helpers.masked_reference import chunk_rows, reference_rollout

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 2, 4  # 2 tokens per frame
SCHEDULE = Schedule(steps=(1000, 500), context_noise=13.0)


def _params(seed=0):
    return wan.init_params(CFG, jax.random.key(seed))


def _ctx(seed=1, batch=1):
    return jax.random.normal(jax.random.key(seed), (batch, 3, CFG.text_dim))


def windowed_rows(total, window, overlap, context, prefix, chunk_frames):
    """What each chunk sees, in frames, from the definition: window j ends at min(window + j*stride, total) and
    commits from the previous end; after window j the frames [prefix, end_j - context) are gone (context 0: none)."""
    stride = window - overlap
    ends, j = [], 0
    while not ends or ends[-1] < total:
        ends.append(min(window + j * stride, total))
        j += 1
    seen_from = {}  # first chunk of each window's commit span -> first visible non-prefix frame
    start = 0
    for j, end in enumerate(ends):
        floor = 0 if j == 0 or context == 0 else max(0, ends[j - 1] - context)
        for f in range(start, end, chunk_frames):
            seen_from[f // chunk_frames] = floor
        start = end

    def seen(n):
        return [f for f in range((n + 1) * chunk_frames) if f < prefix or f >= seen_from[n]]

    return chunk_rows(seen, total, chunk_frames), len(ends)


CASES = [  # total, window, overlap, context, prefix (frames), chunk_frames
    (5, 3, 1, 1, 0, 1),  # windows [0,3) [2,5): window 1 sees frames 2.. only
    (6, 3, 1, 2, 1, 1),  # windows [0,3) [2,5) [4,7): the last one padded past 6; frame 0 protected
    (8, 4, 2, 2, 2, 2),  # two-frame chunks: windows [0,4) [2,6) [4,8); the first chunk is the prefix
]


@pytest.mark.slow  # each case: a windowed generation and ~12 reference forwards (a minute on 2 loaded cores)
@pytest.mark.parametrize("total,window,overlap,context,prefix,cf", CASES)
def test_windowed_generation_equals_cache_free_reference(total, window, overlap, context, prefix, cf):
    sched = WindowSchedule(total, window, overlap, context, prefix)
    rc = WD.windowed_config(R.RolloutConfig(H, W, chunk_frames=cf, schedule=SCHEDULE), sched)
    rows, num_windows = windowed_rows(total, window, overlap, context, prefix, cf)
    assert num_windows == sched.num_windows
    # the releases matter: some chunk does not see an earlier non-prefix frame that a plain rollout would show
    assert not np.tril(rows | (np.arange(total)[None, :] < prefix)).all()
    params, ctx = _params(), _ctx()
    noise = jax.random.normal(jax.random.key(2), rc.noise_shape(CFG, 1, total // cf))
    got = WD.windowed_rollout(params, CFG, rc, sched, ctx, noise=noise)
    want = reference_rollout(params, CFG, rc, ctx, noise, np.stack([rows] * CFG.num_layers))
    assert got.latents.shape == (1, total, H, W, CFG.in_dim)
    err = float(jnp.abs(got.latents - want).max() / jnp.abs(want).max())
    assert err <= 1e-4, err
    # what is left in the cache: the prefix, and the frames from the last release on, each once
    pos = np.asarray(got.state.cache.positions[0])
    frames = sorted(set((pos[pos >= 0] // CFG.tokens_per_frame(H, W)).tolist()))
    kept_from = 0 if sched.num_windows < 2 else sched.released_end(sched.num_windows - 2)
    assert frames == sorted(set(range(prefix)) | set(range(max(prefix, kept_from), total)))


@pytest.mark.parametrize(
    "every,cf",
    [
        (2, 1),  # layers 1 and 3 dilated (dilation 2, 2 buckets), frame 0 the protected prefix
        pytest.param(1, 2, marks=pytest.mark.slow),  # every layer dilated (no prefix), 2-frame chunks
    ],
)
def test_windowed_generation_on_dilated_layers_equals_cache_free_reference(every, cf):
    """A dilated layer sees what its own rule keeps (tests/test_rollout_mixed.dilated_rows) of what the schedule
    keeps (windowed_rows); the dense layers see windowed_rows."""
    from tests.test_rollout_mixed import dilated_rows

    total, window, overlap, context, prefix = (8, 4, 1, 1, 1) if every == 2 else (12, 6, 2, 2, 0)
    sched = WindowSchedule(total, window, overlap, context, prefix)
    base = R.RolloutConfig(H, W, chunk_frames=cf, schedule=SCHEDULE, dilated_every=every, dilation=2, buckets=3)
    rc = WD.windowed_config(base, sched)
    rows, _ = windowed_rows(total, window, overlap, context, prefix, cf)
    dilated = rows & dilated_rows(total, cf, 2, 3)
    assert (dilated != rows).any()  # the dilated rule matters
    assert not np.tril(rows | (np.arange(total)[None, :] < prefix)).all()  # and so do the releases
    masks = np.stack([dilated if layer % every == every - 1 else rows for layer in range(CFG.num_layers)])
    params, ctx = _params(), _ctx()
    noise = jax.random.normal(jax.random.key(2), rc.noise_shape(CFG, 1, total // cf))
    got = WD.windowed_rollout(params, CFG, rc, sched, ctx, noise=noise)
    want = reference_rollout(params, CFG, rc, ctx, noise, masks)
    err = float(jnp.abs(got.latents - want).max() / jnp.abs(want).max())
    assert err <= 1e-4, err


@pytest.mark.slow  # a windowed generation and a rollout
def test_windows_yield_commit_spans_and_context_zero_is_the_plain_rollout_with_one_compilation():
    sched = WindowSchedule(total_units=5, window_units=3, overlap_units=1)
    rc = WD.windowed_config(R.RolloutConfig(H, W, chunk_frames=1, schedule=SCHEDULE), sched)
    assert (rc.sink_frames, rc.window_frames) == (0, 5)
    params, ctx, key = _params(), _ctx(), jax.random.key(7)
    before = compile_count(R.stream_step)
    spans, parts = [], []
    for w, latents, _ in WD.windows(params, CFG, rc, sched, ctx, key=key):
        spans.append((w.commit_start, w.commit_stop))
        parts.append(latents)
        assert latents.shape[1] == w.commit_stop - w.commit_start
    assert spans == [(0, 3), (3, 5)] and compile_count(R.stream_step) - before <= 1
    want = R.jit_rollout(params, CFG, rc, ctx, num_chunks=5, key=key).latents
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, rtol=1e-5, atol=1e-5)


def test_windowed_configuration_errors_are_clear():
    params, ctx = _params(), _ctx()
    rc = R.RolloutConfig(H, W, chunk_frames=2, schedule=SCHEDULE)
    with pytest.raises(ValueError, match=r"schedule.window_units \(3 frames\) must be a multiple of chunk_frames"):
        WD.windowed_rollout(params, CFG, rc, WindowSchedule(8, 3, 1), ctx, key=jax.random.key(0))
    sched = WindowSchedule(8, 4, 2, 2, 2)
    with pytest.raises(ValueError, match="sink_frames = prefix_units = 2 and window_frames >= 4"):
        WD.windowed_rollout(
            params,
            CFG,
            R.RolloutConfig(H, W, chunk_frames=2, window_frames=2, sink_frames=2),
            sched,
            ctx,
            key=jax.random.key(0),
        )
    good = WD.windowed_config(rc, sched)
    with pytest.raises(ValueError, match="exactly one of key"):
        WD.windowed_rollout(params, CFG, good, sched, ctx)
    with pytest.raises(ValueError, match=r"noise must be \[chunks"):
        WD.windowed_rollout(params, CFG, good, sched, ctx, noise=jnp.zeros((3, 2, 1, 2, H, W, 4)))
    # every layer dilated has no sink, so no protected prefix
    with pytest.raises(ValueError, match="has no sink"):
        WD.windowed_config(R.RolloutConfig(H, W, chunk_frames=2, dilated_every=1, dilation=2, buckets=2), sched)
    with pytest.raises(ValueError, match="WindowSchedule"):
        WD.windowed_rollout(params, CFG, good, (8, 4, 2), ctx, key=jax.random.key(0))
