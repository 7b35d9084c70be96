"""Many independent streams in one batch: a fixed number of rows, each holding one stream at its own position.

- `jaxkv.pool.state`: `PoolState` and the pure row operations `init_pool`, `admit`, `finish`, `step` (rows traced:
  one compilation per pool shape; a step advances every occupied row or a traced subset, the others wait bit for
  bit); any cache a rollout runs (ring, rolling, dilated, mixed, FP8).
- `jaxkv.pool.rows`: one row on its own: `switch_row` (per-row prompt switch with KV re-cache), `take_row` /
  `put_row` (a row out as a solo stream's state, or in).
- `jaxkv.pool.driver`: `StreamPool`, the host-side driver.

Each row is exactly its solo `jaxkv.stream.Stream`, prompt switches included.
"""

from jaxkv.pool.driver import StreamPool
from jaxkv.pool.rows import jit_put_row, jit_switch_row, jit_take_row, put_row, switch_row, take_row
from jaxkv.pool.state import (
    PoolState,
    admit,
    finish,
    init_pool,
    jit_admit,
    jit_finish,
    jit_init_pool,
    jit_step,
    step,
    switchable,
)

__all__ = [
    "PoolState",
    "StreamPool",
    "admit",
    "finish",
    "init_pool",
    "jit_admit",
    "jit_finish",
    "jit_init_pool",
    "jit_put_row",
    "jit_step",
    "jit_switch_row",
    "jit_take_row",
    "put_row",
    "step",
    "switch_row",
    "switchable",
    "take_row",
]
