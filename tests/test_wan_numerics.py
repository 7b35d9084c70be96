"""Wan 2.1 numerics against independent references: a float64 NumPy port written from the architecture description
(complex-number RoPE, explicit per-token modulation) and, when torch and diffusers are installed, diffusers'
WanTransformer3DModel loaded with the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.models import wan
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.rope import apply_rope, rope_angles, rope_cos_sin

# head_dim 16 (RoPE split (frame, height, width) = (8, 4, 4), see rope_split) and a non-square grid exercise every
# axis.
CFG = WanConfig(
    dim=64, ffn_dim=96, num_heads=4, num_layers=2, in_dim=4, out_dim=6, text_dim=24, text_len=7, freq_dim=16
)


def _np(params):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), params)


# ------------------------------------------------------------------------------------------- NumPy reference


def _ref_linear(p, x):
    return x @ p["kernel"] + p["bias"]


def _ref_layer_norm(x, eps, w=None, b=None):
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w + b


def _ref_rms(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1 + np.exp(-x))


def _ref_rope_table(head_dim, coords, theta=10000.0):
    """Complex rotation per token [N, head_dim/2] from integer (frame, row, col) coords [N, 3], Wan's layout."""
    d = head_dim
    parts = [d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)]
    rots = []
    for axis, n in enumerate(parts):
        inv = theta ** -(np.arange(0, n, 2) / n)
        rots.append(np.exp(1j * coords[:, axis : axis + 1] * inv[None]))
    return np.concatenate(rots, axis=1)


def _ref_attention(q, k, v, mask=None):
    """q [N, H, D], k/v [M, H, D]."""
    logits = np.einsum("nhd,mhd->hnm", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        logits = np.where(mask[None], logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hnm,mhd->nhd", p, v)


def reference_forward(params, cfg, latents, timesteps, context, mask=None):
    """Float64 Wan 2.1 forward, one batch row at a time. latents [B, F, H, W, C]; timesteps [B, F]; context padded."""
    p = _np(params)
    lat = np.asarray(latents, np.float64)
    b, f, h, w, _ = lat.shape
    pt, ph, pw = cfg.patch_size
    gf, gh, gw = f // pt, h // ph, w // pw
    nh, hd = cfg.num_heads, cfg.head_dim
    coords = np.stack(np.meshgrid(np.arange(gf), np.arange(gh), np.arange(gw), indexing="ij"), -1).reshape(-1, 3)
    rot = _ref_rope_table(hd, coords)
    outs = []
    for bi in range(b):
        # patch embedding as an explicit sum over the patch (a Conv3d with stride = kernel)
        x = np.zeros((gf, gh, gw, cfg.dim))
        k = p["patch_embedding"]["kernel"]
        for a in range(pt):
            for c in range(ph):
                for d_ in range(pw):
                    x += lat[bi, a::pt, c::ph, d_::pw] @ k[a, c, d_]
        x = (x + p["patch_embedding"]["bias"]).reshape(-1, cfg.dim)
        ctx = np.zeros((cfg.text_len, cfg.text_dim))
        ctx[: context.shape[1]] = np.asarray(context[bi], np.float64)
        ctx = _ref_linear(p["text_embedding"]["fc2"], _gelu_tanh(_ref_linear(p["text_embedding"]["fc1"], ctx)))
        # per-token timestep (each token carries its frame's t)
        t_tok = np.repeat(np.asarray(timesteps[bi], np.float64), gh * gw)
        half = cfg.freq_dim // 2
        ang = t_tok[:, None] * np.power(10000.0, -np.arange(half) / half)[None]
        sin_emb = np.concatenate([np.cos(ang), np.sin(ang)], 1)
        e = _ref_linear(p["time_embedding"]["fc2"], _silu(_ref_linear(p["time_embedding"]["fc1"], sin_emb)))
        e0 = _ref_linear(p["time_projection"], _silu(e)).reshape(-1, 6, cfg.dim)
        for layer in range(cfg.num_layers):
            bp = jax.tree.map(lambda a: a[layer], p["blocks"])  # noqa: B023 - called in the iteration that defines it
            mod = bp["modulation"][None] + e0
            sa = bp["self_attn"]
            hin = _ref_layer_norm(x, cfg.eps) * (1 + mod[:, 1]) + mod[:, 0]
            q = _ref_rms(_ref_linear(sa["q"], hin), sa["norm_q"]["scale"], cfg.eps).reshape(-1, nh, hd)
            kk = _ref_rms(_ref_linear(sa["k"], hin), sa["norm_k"]["scale"], cfg.eps).reshape(-1, nh, hd)
            v = _ref_linear(sa["v"], hin).reshape(-1, nh, hd)
            cq = (q[..., 0::2] + 1j * q[..., 1::2]) * rot[:, None]
            ck = (kk[..., 0::2] + 1j * kk[..., 1::2]) * rot[:, None]
            q = np.stack([cq.real, cq.imag], -1).reshape(q.shape)
            kk = np.stack([ck.real, ck.imag], -1).reshape(kk.shape)
            y = _ref_linear(sa["o"], _ref_attention(q, kk, v, mask).reshape(-1, cfg.dim))
            x = x + y * mod[:, 2]
            ca = bp["cross_attn"]
            hin = _ref_layer_norm(x, cfg.eps, bp["norm3"]["scale"], bp["norm3"]["bias"])
            q = _ref_rms(_ref_linear(ca["q"], hin), ca["norm_q"]["scale"], cfg.eps).reshape(-1, nh, hd)
            kk = _ref_rms(_ref_linear(ca["k"], ctx), ca["norm_k"]["scale"], cfg.eps).reshape(-1, nh, hd)
            v = _ref_linear(ca["v"], ctx).reshape(-1, nh, hd)
            x = x + _ref_linear(ca["o"], _ref_attention(q, kk, v).reshape(-1, cfg.dim))
            hin = _ref_layer_norm(x, cfg.eps) * (1 + mod[:, 4]) + mod[:, 3]
            y = _ref_linear(bp["ffn"]["fc2"], _gelu_tanh(_ref_linear(bp["ffn"]["fc1"], hin)))
            x = x + y * mod[:, 5]
        hm = p["head"]["modulation"][None] + e[:, None]
        out = _ref_linear(p["head"]["head"], _ref_layer_norm(x, cfg.eps) * (1 + hm[:, 1]) + hm[:, 0])
        out = out.reshape(gf, gh, gw, pt, ph, pw, cfg.out_dim).transpose(0, 3, 1, 4, 2, 5, 6)
        outs.append(out.reshape(f, h, w, cfg.out_dim))
    return np.stack(outs)


def _inputs(seed=0, batch=2, frames=3, h=4, w=6, text_tokens=5, per_frame=True):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    latents = jax.random.normal(k1, (batch, frames, h, w, CFG.in_dim))
    shape = (batch, frames) if per_frame else (batch,)
    timesteps = jax.random.uniform(k2, shape, minval=0.0, maxval=1000.0)
    context = jax.random.normal(k3, (batch, text_tokens, CFG.text_dim))
    return latents, timesteps, context


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_forward_matches_numpy_reference_per_frame_timesteps():
    params = wan.init_params(CFG, jax.random.key(1))
    latents, t, ctx = _inputs()
    got = jax.jit(lambda p, x, t, c: wan.forward(p, CFG, x, t, c))(params, latents, t, ctx)
    assert got.shape == (2, 3, 4, 6, CFG.out_dim) and got.dtype == jnp.float32
    want = reference_forward(params, CFG, latents, np.asarray(t), ctx)
    assert _rel_err(got, want) < 1e-5


@pytest.mark.slow
def test_forward_scalar_timestep_equals_broadcast_per_frame():
    params = wan.init_params(CFG, jax.random.key(2))
    latents, t, ctx = _inputs(per_frame=False)
    a = wan.forward(params, CFG, latents, t, ctx)
    b = wan.forward(params, CFG, latents, jnp.broadcast_to(t[:, None], (2, 3)), ctx)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_block_causal_matches_numpy_reference_with_sink_and_window():
    params = wan.init_params(CFG, jax.random.key(3))
    latents, t, ctx = _inputs(frames=6, h=2, w=4, batch=1)
    tpf = 2  # (2/2) * (4/2)
    got = wan.forward_block_causal(params, CFG, latents, t, ctx, chunk_frames=1, window_frames=2, sink_frames=1)
    pos = np.arange(6 * tpf)
    qc, kc = pos[:, None] // tpf, pos[None, :] // tpf
    mask = (kc <= qc) & (((qc - kc) < 2) | (pos[None, :] < tpf))
    want = reference_forward(params, CFG, latents, np.asarray(t), ctx, mask=mask)
    assert _rel_err(got, want) < 1e-5
    # and the mask matters: the plain forward differs
    assert _rel_err(wan.forward(params, CFG, latents, t, ctx), want) > 1e-3


@pytest.mark.slow
def test_every_parameter_matters():
    """Perturbing any single leaf changes the output (nothing is dead or silently ignored)."""
    params = wan.init_params(CFG, jax.random.key(4))
    latents, t, ctx = _inputs(batch=1, frames=2, h=2, w=2)
    f = jax.jit(lambda p: wan.forward(p, CFG, latents, t, ctx))
    base = f(params)
    leaves, treedef = jax.tree.flatten(params)
    for i, leaf in enumerate(leaves):
        bumped = list(leaves)
        bumped[i] = leaf * 1.1 + 0.01
        assert float(jnp.abs(f(jax.tree.unflatten(treedef, bumped)) - base).max()) > 1e-6, i


def test_rope_any_position_matches_complex_reference_beyond_1024_frames():
    head_dim, grid = 16, (3, 5)
    positions = jnp.array([[0, 7, 14, 15, 1024 * 15 + 4, 5000 * 15 + 13]], jnp.int32)
    x = jax.random.normal(jax.random.key(5), (1, 6, 2, head_dim))
    got = apply_rope(x, *rope_cos_sin(rope_angles(positions, grid, head_dim)))
    pos = np.asarray(positions[0])
    coords = np.stack([pos // 15, (pos % 15) // 5, pos % 5], -1)
    rot = _ref_rope_table(head_dim, coords)
    xn = np.asarray(x[0], np.float64)
    c = (xn[..., 0::2] + 1j * xn[..., 1::2]) * rot[:, None]
    want = np.stack([c.real, c.imag], -1).reshape(xn.shape)
    # float32 angles at frame 5000 carry ~1e-4 rad of rounding
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-3)
    np.testing.assert_allclose(np.asarray(got[0, :4]), want[:4], atol=1e-6)


def test_bad_inputs_raise_clear_errors():
    params = wan.init_params(CFG, jax.random.key(6))
    latents, t, ctx = _inputs()
    with pytest.raises(ValueError, match="in_dim"):
        wan.forward(params, CFG, latents[..., :3], t, ctx)
    with pytest.raises(ValueError, match="divisible by the patch"):
        wan.forward(params, CFG, latents[:, :, :3], t, ctx)
    with pytest.raises(ValueError, match="timesteps"):
        wan.forward(params, CFG, latents, t[:, :2], ctx)
    with pytest.raises(ValueError, match="text_len"):
        wan.forward(params, CFG, latents, t, jnp.zeros((2, CFG.text_len + 1, CFG.text_dim)))
    with pytest.raises(ValueError, match="context"):
        wan.forward(params, CFG, latents, t, jnp.zeros((2, 3, CFG.text_dim + 1)))
    with pytest.raises(ValueError, match="window_frames"):
        wan.forward_block_causal(params, CFG, latents, t, ctx, chunk_frames=2, window_frames=1)


# ------------------------------------------------------------------------------------------- diffusers parity


def to_diffusers_state_dict(params, cfg):
    """jaxkv params -> diffusers WanTransformer3DModel state dict (torch tensors)."""
    import torch

    p = _np(params)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32))
    lin = lambda q: {"weight": t(q["kernel"].T), "bias": t(q["bias"])}
    sd = {}

    def put(prefix, tensors):
        for k, v in tensors.items():
            sd[f"{prefix}.{k}"] = v

    sd["patch_embedding.weight"] = t(p["patch_embedding"]["kernel"].transpose(4, 3, 0, 1, 2))
    sd["patch_embedding.bias"] = t(p["patch_embedding"]["bias"])
    put("condition_embedder.time_embedder.linear_1", lin(p["time_embedding"]["fc1"]))
    put("condition_embedder.time_embedder.linear_2", lin(p["time_embedding"]["fc2"]))
    put("condition_embedder.time_proj", lin(p["time_projection"]))
    put("condition_embedder.text_embedder.linear_1", lin(p["text_embedding"]["fc1"]))
    put("condition_embedder.text_embedder.linear_2", lin(p["text_embedding"]["fc2"]))
    for i in range(cfg.num_layers):
        bp = jax.tree.map(lambda a: a[i], p["blocks"])  # noqa: B023 - called in the iteration that defines it
        for ours, theirs in (("self_attn", "attn1"), ("cross_attn", "attn2")):
            a = bp[ours]
            for q_, name in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0")):
                put(f"blocks.{i}.{theirs}.{name}", lin(a[q_]))
            sd[f"blocks.{i}.{theirs}.norm_q.weight"] = t(a["norm_q"]["scale"])
            sd[f"blocks.{i}.{theirs}.norm_k.weight"] = t(a["norm_k"]["scale"])
        # diffusers calls Wan's norm3 (the affine cross-attention norm) norm2
        sd[f"blocks.{i}.norm2.weight"] = t(bp["norm3"]["scale"])
        sd[f"blocks.{i}.norm2.bias"] = t(bp["norm3"]["bias"])
        put(f"blocks.{i}.ffn.net.0.proj", lin(bp["ffn"]["fc1"]))
        put(f"blocks.{i}.ffn.net.2", lin(bp["ffn"]["fc2"]))
        sd[f"blocks.{i}.scale_shift_table"] = t(bp["modulation"][None])
    put("proj_out", lin(p["head"]["head"]))
    sd["scale_shift_table"] = t(p["head"]["modulation"][None])
    return sd


def _diffusers_model(params, cfg):
    pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.WanTransformer3DModel(
        patch_size=cfg.patch_size,
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_dim,
        out_channels=cfg.out_dim,
        text_dim=cfg.text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=cfg.eps,
    )
    missing, unexpected = model.load_state_dict(to_diffusers_state_dict(params, cfg), strict=True)
    assert not missing and not unexpected
    return model.eval().float()


@pytest.mark.torch
@pytest.mark.parametrize("per_frame", [False, True])
def test_forward_matches_diffusers(per_frame):
    torch = pytest.importorskip("torch")

    params = wan.init_params(CFG, jax.random.key(7))
    model = _diffusers_model(params, CFG)
    # diffusers does not pad the context: give it exactly text_len tokens, zero-padded as Wan's pipeline does
    latents, t, ctx = _inputs(per_frame=per_frame, text_tokens=4)
    ctx_full = jnp.pad(ctx, ((0, 0), (0, CFG.text_len - 4), (0, 0)))
    got = wan.forward(params, CFG, latents, t, ctx)
    tpf = (4 // 2) * (6 // 2)
    # diffusers takes per-token timesteps [B, seq] (the Wan 2.2 path), so per-frame t becomes per-token t
    t_torch = torch.tensor(np.repeat(np.asarray(t), tpf, axis=1)) if per_frame else torch.tensor(np.asarray(t))
    with torch.no_grad():
        want = model(
            torch.tensor(np.asarray(latents)).permute(0, 4, 1, 2, 3),
            t_torch,
            torch.tensor(np.asarray(ctx_full)),
            return_dict=False,
        )[0]
    want = want.permute(0, 2, 3, 4, 1).numpy()
    assert _rel_err(got, want) < 1e-4


def _primitives(jaxpr, inside_scan=False):
    """(primitive name, inside a scan body) of every equation of a jaxpr, recursively."""
    out = []
    for eqn in jaxpr.eqns:
        out.append((eqn.primitive.name, inside_scan))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    out += _primitives(sub, inside_scan or eqn.primitive.name == "scan")
    return out


def test_rope_cos_sin_are_computed_once_per_forward_outside_the_layer_scan():
    latents, t, ctx = _inputs(batch=1, frames=2, h=2, w=2)
    params = wan.init_params(CFG, jax.random.key(0))
    prims = _primitives(jax.make_jaxpr(lambda p: wan.forward(p, CFG, latents, t, ctx))(params).jaxpr)
    # one cos for RoPE and one for the sinusoidal timestep embedding, none per layer inside the scan
    assert [name for name, _ in prims].count("cos") == 2, [p for p in prims if p[0] in ("cos", "sin")]
    assert not [p for p in prims if p[0] in ("cos", "sin") and p[1]]


def test_config_rejects_non_int_patch_and_bad_eps_or_theta():
    base = dict(dim=64, ffn_dim=96, num_heads=4, num_layers=2)
    assert WanConfig(**base, patch_size=[1, np.int64(2), 2]).patch_size == (1, 2, 2)
    assert WanConfig(**base, rope_theta=10000).rope_theta == 10000.0
    for bad in (
        {"patch_size": (1, 2.5, 2)},
        {"patch_size": (1.0, 2, 2)},
        {"patch_size": (True, 2, 2)},
        {"patch_size": (1, 2)},
        {"patch_size": (0, 2, 2)},
        {"eps": float("inf")},
        {"eps": float("nan")},
        {"eps": 0.0},
        {"eps": -1e-6},
        {"eps": True},
        {"eps": "1e-6"},
        {"rope_theta": float("inf")},
        {"rope_theta": 0.0},
        {"num_layers": True},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WanConfig(**{**base, **bad})


@pytest.mark.slow  # over 12 s on 2 loaded cores
def test_bfloat16_precision_is_close_to_float32_on_the_same_rounded_weights():
    """Precision.bf16(): bf16 matmuls (float32 accumulation, bf16 out), activations and K/V; norm statistics, the
    modulation tables and the residual stream in float32.
    Bf16 params under the default float32 precision are refused, naming the leaf."""
    latents, t, ctx = _inputs(batch=1, frames=2, h=2, w=2)
    params = wan.init_params(CFG, jax.random.key(0), dtype=jnp.bfloat16)
    rounded = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    with pytest.raises(ValueError, match="is bfloat16 but the precision's param_dtype is float32"):
        wan.forward(params, CFG, latents, t, ctx)
    got = wan.forward(params, CFG, latents, t, ctx, precision="bfloat16")
    want = wan.forward(rounded, CFG, latents, t, ctx)
    assert got.dtype == jnp.float32 and bool(jnp.isfinite(got).all())
    assert _rel_err(got, want) <= 2e-2
