"""Position-addressed attention over caches held in any physical order.

Every mask is a function of (query position, key position), so attention over a ring cache in physical slot order
is correct without gathering it into order. Paths, all tested against the dense reference:

  dense_attention        the XLA reference (masked softmax over all keys)
  blockwise_attention    XLA flash recurrence over key blocks in chronological order, segments merged by lse
  pallas_attention       Triton-backed Pallas GPU kernel reading the ring in place, skipping empty/masked blocks
  cudnn                  cuDNN flash attention where the mask reduces to no mask or valid lengths (`plan_attention`,
                         decided once for many calls), keys optionally split and merged by LSE (`split`)

`attend` picks one by `backend` (the table is `jaxkv.attention.dispatch.PATHS`). `MaskSpec` describes the mask;
`CacheRope` adds cache-relative RoPE (keys rotated at read by their rank).
"""

from jaxkv.attention.blockwise import blockwise_attention
from jaxkv.attention.cudnn import ALL_VISIBLE_PLAN, Plan, plan_attention
from jaxkv.attention.dispatch import attend
from jaxkv.attention.masks import MaskSpec, visible
from jaxkv.attention.pallas_gpu import BlockSizes, pallas_attention
from jaxkv.attention.reference import dense_attention
from jaxkv.attention.rope import CacheRope, rope_ranks

__all__ = [
    "ALL_VISIBLE_PLAN",
    "Plan",
    "plan_attention",
    "BlockSizes",
    "CacheRope",
    "MaskSpec",
    "attend",
    "blockwise_attention",
    "dense_attention",
    "pallas_attention",
    "rope_ranks",
    "visible",
]
