"""Wan 2.1's DiT as pure functions of a params pytree (layout: `jaxkv.models.wan.params`), in three forms that share
every numeric:

* `forward`: the plain bidirectional Wan forward over a whole clip.
* `forward_block_causal`: the same sequence under the chunk-causal training mask of causal Wan (Self-Forcing /
  CausVid), optionally with a pinned sink and a local window, all by token position.
* `forward_chunk`: one chunk of a stream on a stacked KV cache (`jaxkv.RingCache` or `jaxkv.RollingCache` with
  ``layers=num_layers``); the chunk's keys are rotated at their absolute positions, written into the chunk's reserved
  slot, and attention reads the whole cache in physical order with masks from stored positions. With
  ``rope="cache-relative"`` keys are cached unrotated and rotated at read by their rank in the cache instead
  (`cache_relative_rope`).

Blocks run under ``lax.scan`` over the stacked layer axis. In `forward_chunk` the stacked cache rides in the scan
carry and each layer writes ``[layer, session, slot]`` with a dynamic update slice, so XLA updates it in place rather
than copying every layer's cache per forward (see DESIGN.md, "Making XLA do what the design promises"). A
`jaxkv.cache.MixedCache` (dense layers plus every k-th layer dilated) is scanned period by period with both of its
stacks in the carry (`jaxkv.models.wan.dit._scan_periods`), each still updated in place.

The inference layout: with per-layer params (`jaxkv.models.wan.params.per_layer_params`), a per-layer cache
(``init_cache(..., per_layer=True)``) or per-layer cross K/V (what `cross_kv` builds from per-layer params), the
layer loop is unrolled instead (`jaxkv.models.wan.dit.dit`): each layer reads its weights, its K/V and its text K/V
where they lie, with no per-layer slice of a stack (a copy per layer per forward inside the scan, which kernels that
take whole buffers, cuDNN's attention and cuBLAS's GEMMs, cannot avoid). Same results either way; the unrolled
program compiles slower.

In `forward_chunk` the cuDNN attention plan (`jaxkv.attention.plan_attention`: no mask, per-session lengths or the
fallback kernel) is made once per forward from the cache's read positions, before the layer loop, and shared by
every layer; cross-attention to the text keys takes the static all-visible plan (no check, no branch).

Cross-attention keys/values depend only on the text context, so `cross_kv` computes them once for all layers; a
streaming rollout calls it once and passes the result to every `forward_chunk`.

How the model runs is one `jaxkv.run_options.RunOptions` (``run=``; the older ``backend=`` / ``precision=`` keywords
build one): each entry point resolves it and checks the params against its precision once, then passes ``run``
down whole; ``run.backend`` stops at the calls into `jaxkv.attend`.
Dtypes follow ``run.precision``, a `jaxkv.precision.Precision` (default float32 throughout): `_compute_params`
(`jaxkv.models.wan.dtypes`) is the one place that casts weights for their matmuls (the large projections to
``compute_dtype``; the time embedding, time projection and head to float32, as Wan runs them), `cross_kv` stores the
text K/V in the policy's ``cache_dtype``, and every attention reads q, k, v in ``cache_dtype`` (the whole-sequence
forwards cast to it as the cache would hold them, so a stream and the block-causal forward attend alike). The layers
themselves never choose a dtype: every activation between the float32 residual stream and a GEMM is in
`_activation_dtype` (the compute dtype: the GEMMs emit it with float32 accumulation, bias and GELU applied in it;
norms, modulation and RoPE compute in float32 and write it), while the residual stream, the time embedding,
modulation tables and head stay float32.

Conventions: latents are channels-last ``[batch, frames, height, width, channels]`` on the latent grid; timesteps
are on Wan's 0..1000 scale, one per batch row ``[batch]`` or one per (patch) frame ``[batch, frames // pt]``; text
context is ``[batch, text_tokens, text_dim]`` with ``text_tokens <= text_len`` and is zero-padded to ``text_len``
before the text embedding, as Wan does (so padding tokens are attended, as in Wan 2.1 T2V; pass exactly
``text_len`` tokens to compare against a transformer that does not pad, e.g. diffusers' WanTransformer3DModel).

This module is the model's public face: it re-exports the entry points from the modules that hold them, one concept
each (none imports this one):

* `jaxkv.models.wan.inputs`: the input checks (latents, timesteps, text context, `ROPE_MODES`);
* `jaxkv.models.wan.init`: `init_params`;
* `jaxkv.models.wan.dtypes`: the dtype of each weight and activation, and `_run_of` (an entry point's options);
* `jaxkv.models.wan.attention`: `CrossKV` / `cross_kv`, the self-attention's q/k/v, cache-relative RoPE and the
  cross-attention;
* `jaxkv.models.wan.block`: one block and the output head;
* `jaxkv.models.wan.dit`: patch embedding, the layer loop (scan, unrolled, or period by period) and the head;
* `jaxkv.models.wan.sequence`: `forward`, `forward_block_causal`, `forward_teacher_forcing`;
* `jaxkv.models.wan.streaming`: `init_cache`, `forward_chunk`, `recompute_cache`.
"""

from jaxkv.models.wan.attention import CrossKV, cache_relative_rope, cross_kv
from jaxkv.models.wan.init import init_params
from jaxkv.models.wan.inputs import ROPE_MODES, check_rope_mode
from jaxkv.models.wan.sequence import block_causal_spec, forward, forward_block_causal, forward_teacher_forcing
from jaxkv.models.wan.streaming import forward_chunk, init_cache, recompute_cache

__all__ = [
    "ROPE_MODES",
    "CrossKV",
    "block_causal_spec",
    "cache_relative_rope",
    "check_rope_mode",
    "cross_kv",
    "forward",
    "forward_block_causal",
    "forward_chunk",
    "forward_teacher_forcing",
    "init_cache",
    "init_params",
    "recompute_cache",
]
