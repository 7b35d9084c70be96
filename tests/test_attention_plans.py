"""Attention decided once for many calls (`jaxkv.attention.cudnn.plan_attention`) and split-KV merged by float32
log-sum-exp (`jaxkv.attention.split`), on CPU: the XLA path returns an LSE, so split + merge is checked against one
call and the dense masked reference; the cuDNN dispatch runs with a stand-in kernel (the real call refuses to trace
on a CPU-only jaxlib; benchmarks/gpu_check.py runs it on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import ALL_VISIBLE_PLAN, MaskSpec, attend, cudnn, dense_attention, plan_attention
from jaxkv.attention.split import merge_by_lse, split_attention
from jaxkv.attention.xla_cpu import xla_cpu_attention
from tests.helpers.attention_cases import make_case, permuted, physical
from tests.helpers.cudnn_standin import standin


def xla_lse_kernel(q, k, v):
    """Every key visible: (out, float32 lse) from the XLA:CPU path."""
    b, lk = k.shape[:2]
    pos = jnp.zeros((b, lk), jnp.int32)
    return xla_cpu_attention(q, k, v, jnp.zeros(q.shape[:2], jnp.int32), pos, return_lse=True)


@pytest.mark.parametrize("parts", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_split_and_merge_equals_one_call_and_the_dense_reference(parts, dtype):
    case = make_case(0, written=(8, 9), head_dim=16, dtype=dtype)  # both rings full and wrapped
    q, k, v, qp, pos = physical(case, case["pos"])
    mask = MaskSpec(chunk=4)
    want = np.asarray(dense_attention(q, k, v, qp, pos, mask=mask), np.float32)
    one, one_lse = jax.jit(xla_lse_kernel)(q, k, v)
    got, lse = jax.jit(lambda q, k, v: split_attention(xla_lse_kernel, q, k, v, parts))(q, k, v)
    assert got.dtype == dtype and lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(one, np.float32), atol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(one_lse), atol=1e-4 if dtype == jnp.float32 else 2e-2)


def test_merge_gives_empty_parts_no_weight_and_unseen_queries_zeros():
    rng = np.random.default_rng(1)
    outs = jnp.asarray(rng.normal(size=(1, 3, 2, 1, 4)), jnp.float32)  # [b, parts, q, h, d]
    lses = jnp.asarray([[[[0.5], [-jnp.inf]], [[-jnp.inf], [-jnp.inf]], [[1.5], [-jnp.inf]]]], jnp.float32)
    out, lse = merge_by_lse(outs, lses, axis=1)
    w = np.exp(np.array([0.5, 1.5]) - np.logaddexp(0.5, 1.5))
    np.testing.assert_allclose(out[0, 0, 0], w[0] * outs[0, 0, 0, 0] + w[1] * outs[0, 2, 0, 0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lse[0, 0, 0], np.logaddexp(0.5, 1.5), rtol=1e-6)
    assert np.all(np.asarray(out[0, 1]) == 0) and np.isneginf(np.asarray(lse[0, 1])).all()  # no part seen
    with pytest.raises(ValueError, match="lses must be"):
        merge_by_lse(outs, lses[..., 0], axis=1)


def test_split_refuses_parts_that_do_not_divide_the_keys():
    case = make_case(0, written=(8, 9), head_dim=16)
    q, k, v, _, _ = physical(case, case["pos"])  # 16 keys
    with pytest.raises(ValueError, match="16 keys are not 3 equal parts"):
        split_attention(xla_lse_kernel, q, k, v, 3)


def test_plan_modes():
    plan = jax.jit(plan_attention, static_argnums=2)
    mask = MaskSpec(chunk=4)
    full = make_case(0, written=(8, 5), head_dim=16)  # both wrapped: every slot valid and visible
    _, _, _, qp, pos = physical(full, full["pos"])
    p = plan(qp, pos, mask)
    assert int(p.mode) == cudnn.ALL_VISIBLE and np.asarray(p.lengths).tolist() == [16, 16]
    partial = make_case(0, written=(8, 2), head_dim=16)  # session 1 fills in order: a valid prefix
    _, _, _, qp, pos = physical(partial, partial["pos"])
    p = plan(qp, pos, mask)
    assert int(p.mode) == cudnn.LENGTHS and np.asarray(p.lengths).tolist() == [16, 8]
    shuffled = jnp.asarray(permuted(np.asarray(pos), 4))
    assert int(plan(qp, shuffled, mask).mode) == cudnn.FALLBACK  # empty slots amid the valid ones
    assert int(plan(qp, pos.at[0].set(-1), mask).mode) == cudnn.FALLBACK  # an empty session
    # Full but not all visible: a causal mask hides later keys of the chunk.
    _, _, _, qp, pos = physical(full, full["pos"])
    assert int(plan(qp, pos, MaskSpec(causal=True)).mode) == cudnn.FALLBACK


def _marking(tag_lengths, tag_full, tag_split):
    """A stand-in that computes the right values and adds a tag saying which call ran (split calls see a batch
    of 2x the sessions)."""

    def kernel(q, k, v, lengths, scale, return_lse=False):
        res = standin(q, k, v, lengths, scale, return_lse)
        if return_lse:
            out, lse = res
            return out + tag_split, lse
        return res + (tag_lengths if lengths is not None else tag_full)

    return kernel


@pytest.mark.parametrize("written, parts, mode", [((8, 2), 1, "lengths"), ((8, 5), 1, "full"), ((8, 5), 2, "split")])
def test_cudnn_dispatch_follows_the_plan_and_matches_the_dense_reference(written, parts, mode):
    case = make_case(2, written=written, head_dim=16)
    q, k, v, qp, pos = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in physical(case, case["pos"]))
    mask = MaskSpec(chunk=4)
    want = np.asarray(dense_attention(q, k, v, qp, pos, mask=mask), np.float32)
    fallback = lambda *a: dense_attention(*a, mask=mask)

    def run(kernel, plan):
        f = lambda q, k, v, qp, pos: cudnn.cudnn_attention(
            q, k, v, qp, pos, fallback=fallback, mask=mask, plan=plan(qp, pos), parts=parts, kernel=kernel
        )
        return np.asarray(jax.jit(f)(q, k, v, qp, pos), np.float32)

    shared = lambda qp, pos: plan_attention(qp, pos, mask)
    np.testing.assert_allclose(run(standin, shared), want, atol=2e-2)
    np.testing.assert_allclose(run(standin, lambda *_: None), want, atol=2e-2)  # plan made per call: the same
    tags = dict(lengths=8.0, full=16.0, split=24.0)  # bf16 keeps out + tag to 0.125
    tagged = run(_marking(tags["lengths"], tags["full"], tags["split"]), shared)
    np.testing.assert_allclose(tagged - tags[mode], want, atol=0.5)  # the tagged branch ran


def test_static_all_visible_plan_calls_the_kernel_directly():
    # Cross-attention's text keys: no check, no branch in the program, no mask handed to the kernel.
    case = make_case(3, written=(8, 5), head_dim=16)
    q, k, v, _, _ = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in physical(case, case["pos"]))
    zq, zk = jnp.zeros(q.shape[:2], jnp.int32), jnp.zeros(k.shape[:2], jnp.int32)
    seen = []

    def kernel(q, k, v, lengths, scale, return_lse=False):
        seen.append(lengths)
        return standin(q, k, v, lengths, scale, return_lse)

    f = lambda q, k, v: cudnn.cudnn_attention(
        q, k, v, zq, zk, fallback=dense_attention, plan=ALL_VISIBLE_PLAN, parts=1, kernel=kernel
    )
    jaxpr = str(jax.make_jaxpr(f)(q, k, v))
    assert "cond" not in jaxpr and "reduce_min" not in jaxpr and seen == [None]
    want = dense_attention(q, k, v, zq, zk)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v), np.float32), np.asarray(want, np.float32), atol=2e-2)
    with pytest.raises(ValueError, match="static plan must be ALL_VISIBLE"):
        cudnn.cudnn_attention(q, k, v, zq, zk, fallback=dense_attention, plan=cudnn.Plan(cudnn.LENGTHS, None))


def test_attend_hands_the_plan_to_the_cudnn_path(monkeypatch):
    # backend="cudnn" on CPU with the module's kernel replaced: the plan given to attend decides the branch.
    monkeypatch.setattr(cudnn, "cudnn_call", _marking(8.0, 16.0, 24.0))
    case = make_case(4, written=(8, 2), head_dim=16)
    q, k, v, qp, pos = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in physical(case, case["pos"]))
    want = np.asarray(dense_attention(q, k, v, qp, pos, chunk=4), np.float32)
    # interpret: the Pallas fallback branch is compiled too (it runs only when the plan says FALLBACK)
    got = jax.jit(lambda *a: attend(*a, chunk=4, backend="cudnn", interpret=True))(q, k, v, qp, pos)
    np.testing.assert_allclose(np.asarray(got, np.float32) - 8.0, want, atol=0.5)  # lengths (session 1 partial)
    forced = jax.jit(lambda *a: attend(*a, chunk=4, backend="cudnn", plan=ALL_VISIBLE_PLAN))(q, k, v, qp, pos)
    assert float(jnp.min(forced.astype(jnp.float32))) > 12.0  # the static plan is taken at its word


def test_split_table_lookup():
    assert cudnn.split_parts(32760, 4680) == (2 if cudnn.lse_entry_point() is not None else 1)
    assert cudnn.split_parts(9360, 4680) == 1  # not in the table: one call
    with pytest.raises(ValueError, match="equal parts"):
        cudnn.cudnn_attention(
            *(jnp.zeros((1, 8, 1, 16), jnp.bfloat16),) * 3,
            jnp.zeros((1, 8), jnp.int32),
            jnp.zeros((1, 8), jnp.int32),
            fallback=dense_attention,
            parts=3,
            kernel=standin,
        )
