"""Reading two FP8 KV caches written from K/V that agree only to float32 rounding (other summation orders): a value
lying at an e4m3 rounding boundary may round one e4m3 step the other way, so the caches agree to one step, not bit
for bit, and nearly every byte is equal."""

from __future__ import annotations

import numpy as np


def assert_within_one_e4m3_step(got, want, scale, chunk: int, err_msg: str = "") -> None:
    """Dequantized K or V ``got`` / ``want`` (float [..., slots * chunk, heads, head_dim]) apart by at most one e4m3
    step: 2**-3 of the value, or the subnormal step ``scale`` * 2**-9 near zero (``scale`` [..., slots, heads], one
    per chunk slot and head, as `jaxkv.cache.Fp8Cache` keeps them)."""
    got, want = np.asarray(got), np.asarray(want)
    per_token = np.repeat(np.asarray(scale), chunk, axis=-2)[..., None]
    assert np.all(np.abs(got - want) <= 2.0**-3 * np.abs(want) + per_token * 2.0**-9 * 1.0001), err_msg


def equal_byte_share(got, want) -> float:
    """The share of equal bytes of two FP8 (or uint8-viewed) arrays of one shape."""
    got, want = np.asarray(got), np.asarray(want)
    return float((got.view(np.uint8) == want.view(np.uint8)).mean())
