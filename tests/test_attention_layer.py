"""`attend(..., layer=)`: a layer-stacked cache [layers, batch, slots, heads, head_dim] handed to attention whole
(issue 40: the Mosaic GPU kernel reads the layer in place, no copy).

On CPU: every backend returns, bit for bit, what it returns for the sliced layer (the kernels in their interpreter /
emulation, cuDNN through its CPU stand-in), with a concrete or a traced layer, and the kernels' gradient lands in
the layer; the Wan streaming step with backend "mosaic" (its emulation, `RunOptions(interpret=True)`) equals the
"xla" step over a wrapping ring (ring, rolling and mixed dense + dilated caches); and the stacked chunk step
lowered for CUDA hands the Mosaic kernel the whole cache stack (no dynamic-slice of it), where the Triton and cuDNN
steps slice each layer out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import attend, cudnn
from jaxkv.attention.mosaic_emulation import MosaicBlockSizes
from jaxkv.cache import DilatedSpec, MixedSpec
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig
from jaxkv.run_options import RunOptions
from tests.helpers.attention_cases import make_case, physical
from tests.helpers.cudnn_standin import standin
from tests.test_layer_layout import _slices_of_stacks

MASK = dict(chunk=4, window=8, sink=4)
SMALL = MosaicBlockSizes(block_q=64, block_k=64, stages=2)
KERNEL_OPTIONS = {
    "pallas": dict(interpret=True),
    "mosaic": dict(interpret=True, block_sizes=SMALL),
    "cudnn": dict(interpret=True),  # (its ring-kernel fallback)
}
BACKENDS = ["xla_dense", "xla_blockwise", "xla_cpu", "pallas", "mosaic", "cudnn"]


def _stacked_case(layers=3, dtype=jnp.bfloat16):
    """q for one layer, and a stack of ``layers`` different layers' K/V over one ring layout (wrapped, partly
    filled); empty slots hold NaN in every layer."""
    cases = [
        physical(c, c["pos"]) for c in (make_case(s, written=(6, 2), head_dim=16, dtype=dtype) for s in range(layers))
    ]
    q, _, _, qp, kp = cases[0]
    empty = (kp < 0)[:, :, None, None]
    ks = jnp.stack([jnp.where(empty, jnp.nan, c[1]) for c in cases])
    vs = jnp.stack([jnp.where(empty, jnp.nan, c[2]) for c in cases])
    return q, ks, vs, qp, kp


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stack_at_a_layer_equals_the_sliced_layer_on_every_backend(backend, monkeypatch):
    monkeypatch.setattr(cudnn, "cudnn_call", standin)  # (the real call refuses to trace on a CPU-only jaxlib)
    q, ks, vs, qp, kp = _stacked_case()
    run = lambda k, v, **kw: attend(q, k, v, qp, kp, backend=backend, **MASK, **KERNEL_OPTIONS.get(backend, {}), **kw)
    traced = jax.jit(lambda i: run(ks, vs, layer=i))
    for layer in (0, 2):
        want = run(ks[layer], vs[layer])
        assert bool(jnp.all(jnp.isfinite(want.astype(jnp.float32))))  # the NaN in empty slots stays out
        np.testing.assert_array_equal(run(ks, vs, layer=layer), want)
        np.testing.assert_array_equal(traced(jnp.int32(layer)), want)


@pytest.mark.parametrize("backend", ["mosaic", "pallas"])
def test_a_kernel_gradient_through_a_stack_lands_in_the_layer(backend):
    """The kernels' reverse mode (the blockwise path's gradient) with a stack: the sliced call's gradient at the
    layer, zeros at every other layer."""
    q, ks, vs, qp, kp = _stacked_case(dtype=jnp.float32)
    finite = [jnp.where((kp < 0)[None, :, :, None, None], 0.0, x) for x in (ks, vs)]
    opts = dict(backend=backend, **MASK, **KERNEL_OPTIONS[backend])
    loss = lambda q, k, v, **kw: jnp.sum(jnp.sin(attend(q, k, v, qp, kp, **opts, **kw)))
    gq, gk, gv = jax.grad(lambda q, k, v: loss(q, k, v, layer=1), argnums=(0, 1, 2))(q, *finite)
    wq, wk, wv = jax.grad(loss, argnums=(0, 1, 2))(q, finite[0][1], finite[1][1])
    np.testing.assert_array_equal(gq, wq)
    for got, want in ((gk, wk), (gv, wv)):
        np.testing.assert_array_equal(got[1], want)
        assert not np.any(np.asarray(got[0])) and not np.any(np.asarray(got[2]))


def test_bad_layers_are_named():
    q, ks, vs, qp, kp = _stacked_case()
    with pytest.raises(ValueError, match="needs layer="):
        attend(q, ks, vs, qp, kp)
    with pytest.raises(ValueError, match="needs layer="):
        attend(q, ks[0], vs[0], qp, kp, layer=0)
    with pytest.raises(ValueError, match="layer 3 is out of range for a cache of 3 layers"):
        attend(q, ks, vs, qp, kp, layer=3)
    with pytest.raises(ValueError, match="layer -1 is out of range"):
        attend(q, ks, vs, qp, kp, layer=-1)
    with pytest.raises(ValueError, match="layer must be an int or an integer scalar"):
        attend(q, ks, vs, qp, kp, layer=1.0)
    with pytest.raises(ValueError, match="layer must be a scalar"):
        attend(q, ks, vs, qp, kp, layer=jnp.array([1]))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attend(q, ks, vs[:2], qp, kp, layer=0)
    with pytest.raises(ValueError, match="q and k/v head_dim differ"):
        attend(q, ks[..., :8], vs[..., :8], qp, kp, layer=0)


# ------------------------------------------------------------------ the Wan model hands its stack over

CFG = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=3, in_dim=4, out_dim=4, text_dim=8, text_len=5, freq_dim=16)
H, W = 4, 6  # 6 tokens per frame


RING = jaxkv.RingSpec.from_frames(H * W // 4, 1, 2, 1)
CACHES = {
    "ring": lambda: M.init_cache(CFG, RING, 2),
    "rolling": lambda: M.init_cache(CFG, RING, 2, policy="rolling"),
    "mixed": lambda: M.init_cache(CFG, MixedSpec(RING, DilatedSpec(H * W // 4, 1, 2, 2), 3), 2),  # 2 dense + 1 dilated
}


@pytest.mark.parametrize(
    "cache_kind", ["ring", *(pytest.param(k, marks=pytest.mark.slow) for k in ("rolling", "mixed"))]
)
def test_policy_mosaic_stream_equals_xla_on_a_wrapping_ring(cache_kind):
    """Five chunks on a 1-frame sink + 2-frame window (the ring wraps twice; the mixed cache's dilated layer keeps
    every other frame), two denoising passes per chunk, two sessions started one chunk apart: "mosaic" (its
    emulation, reading the stack at the scan's layer) against "xla" (the dense path on the sliced layer), float32
    (tolerance of the other streaming comparisons)."""
    params = M.init_params(CFG, jax.random.key(0))
    ctx = jax.random.normal(jax.random.key(1), (2, CFG.text_len, CFG.text_dim))
    cross = M.cross_kv(params, CFG, ctx)
    runs = {"xla": RunOptions.of(backend="xla"), "mosaic": RunOptions(backend="mosaic", interpret=True)}
    step = jax.jit(lambda c, x, t, run: M.forward_chunk(params, CFG, c, cross, x, t, run=run), static_argnums=3)
    flows = {}
    for name, run in runs.items():
        cache = CACHES[cache_kind]()
        out = []
        for n in range(5):
            active = jnp.array([True, n > 0])
            cache = cache.begin_chunk(active=active)
            for t in (900.0, 400.0):
                x = jax.random.normal(jax.random.key(10 + n), (2, 1, H, W, CFG.in_dim))
                flow, cache = step(cache, x, jnp.full((2,), t), run)
                out.append(flow)
        flows[name] = jnp.stack(out)
    want = flows["xla"]
    assert float(jnp.abs(flows["mosaic"] - want).max() / jnp.abs(want).max()) <= 1e-5


def test_the_interpret_option_is_checked():
    with pytest.raises(ValueError, match="RunOptions.interpret must be a bool, got 1"):
        RunOptions(interpret=1)
    assert RunOptions(interpret=True) != RunOptions() and RunOptions().interpret is False


def test_the_chunk_step_lowered_for_cuda_hands_the_mosaic_kernel_the_whole_stack(monkeypatch):
    """The stacked bf16 chunk step (layer scan) lowered for CUDA, abstract params: with "mosaic" the kernel's
    custom call takes the cache stack and no dynamic-slice of the stack is left; the Triton ("pallas") and cuDNN
    steps slice the layer out of it (the copy per layer per pass issue 39 measured). The weights' and the text
    K/V's stacks are sliced in all three (a check that the counter sees slices inside the scan)."""
    monkeypatch.setattr(cudnn, "cudnn_call", standin)
    # head_dim 64 (the kernel takes 64 / 128); 8 tokens per frame, 8 text tokens: the kernel's TMA loads need
    # slot counts that are multiples of 8.
    cfg = WanConfig(dim=128, ffn_dim=96, num_heads=2, num_layers=3, in_dim=4, out_dim=4, text_dim=8, text_len=8)
    h, w = 4, 8
    bf16 = jnp.bfloat16
    params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0), dtype=bf16))
    spec = jaxkv.RingSpec.from_frames(h * w // 4, 1, 2, 1)  # capacity 24 slots, 8 text tokens: shapes differ
    cache = jax.eval_shape(lambda: M.init_cache(cfg, spec, 1, dtype=bf16).begin_chunk())
    ctx = jax.ShapeDtypeStruct((1, cfg.text_len, cfg.text_dim), bf16)
    cross = jax.eval_shape(lambda p, c: M.cross_kv(p, cfg, c, precision="bfloat16"), params, ctx)
    x = jax.ShapeDtypeStruct((1, 1, h, w, cfg.in_dim), jnp.float32)
    t = jax.ShapeDtypeStruct((1,), jnp.float32)
    cache_shape = tuple(cache.k.shape)
    stacked_shapes = {tuple(cross.k.shape)} | {tuple(a.shape) for a in jax.tree.leaves(params["blocks"])}
    assert cache_shape == (3, 1, 24, 2, 64) and cache_shape not in stacked_shapes
    counts, texts = {}, {}
    for backend in ("mosaic", "pallas", "cudnn"):
        run = RunOptions.of("bfloat16", backend)
        step = jax.jit(lambda p, c, cr, x, t, run=run: M.forward_chunk(p, cfg, c, cr, x, t, run=run))
        lowered = step.trace(params, cache, cross, x, t).lower(lowering_platforms=("cuda",))
        texts[backend] = lowered.as_text()
        counts[backend] = _slices_of_stacks(lowered.as_text(dialect="hlo"), cache_shape, stacked_shapes)
    assert "mosaic_gpu" in texts["mosaic"] and "mosaic_gpu" not in texts["pallas"] + texts["cudnn"]
    assert counts["mosaic"][0] == 0 and counts["mosaic"][1] > 0, counts
    assert counts["pallas"][0] >= 1 and counts["cudnn"][0] >= 1, counts
