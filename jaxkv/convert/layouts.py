"""Key names of the PyTorch Wan 2.1 layouts and how each tensor becomes a jaxkv parameter.

Two namings exist in the wild: the original Wan 2.1 one (``blocks.0.self_attn.q.weight``; also used inside
Self-Forcing / CausVid training checkpoints) and diffusers' ``WanTransformer3DModel`` one
(``blocks.0.attn1.to_q.weight``, ``condition_embedder.*``, ``scale_shift_table``, ``proj_out``). diffusers names
Wan's affine cross-attention LayerNorm ``norm2`` (Wan's ``norm2`` has no parameters; diffusers calls that one
``norm3``), so diffusers ``blocks.N.norm2.*`` is jaxkv ``blocks.norm3.*``.

Each source tensor maps to (jaxkv flat key, layer or None, transform); the target layout is
`jaxkv.models.wan.params`. Transforms are pure shape/axis changes (see `apply`), never arithmetic.
"""

from __future__ import annotations

import re

import numpy as np

from jaxkv.convert.errors import ConversionError

# Transform kinds.
LINEAR = "linear"  # torch Linear weight [out, in] -> kernel [in, out]
CONV3D = "conv3d"  # Conv3d weight [dim, in, pt, ph, pw] -> [pt, ph, pw, in, dim]
COPY = "copy"  # biases, norm scales
SQUEEZE = "squeeze"  # modulation tables [1, n, dim] -> [n, dim]


def _linear(src: str, dst: str) -> dict[str, tuple[str, str]]:
    return {f"{src}.weight": (f"{dst}.kernel", LINEAR), f"{src}.bias": (f"{dst}.bias", COPY)}


def _attention(src_prefix: str, names: dict[str, str], norm_q: str, norm_k: str, dst: str) -> dict:
    table = {}
    for src, out in names.items():
        table.update(_linear(f"{src_prefix}.{src}", f"{dst}.{out}"))
    table[f"{src_prefix}.{norm_q}.weight"] = (f"{dst}.norm_q.scale", COPY)
    table[f"{src_prefix}.{norm_k}.weight"] = (f"{dst}.norm_k.scale", COPY)
    return table


def _wan_tables():
    top = {
        "patch_embedding.weight": ("patch_embedding.kernel", CONV3D),
        "patch_embedding.bias": ("patch_embedding.bias", COPY),
        **_linear("text_embedding.0", "text_embedding.fc1"),
        **_linear("text_embedding.2", "text_embedding.fc2"),
        **_linear("time_embedding.0", "time_embedding.fc1"),
        **_linear("time_embedding.2", "time_embedding.fc2"),
        **_linear("time_projection.1", "time_projection"),
        **_linear("head.head", "head.head"),
        "head.modulation": ("head.modulation", SQUEEZE),
    }
    qkvo = {n: n for n in "qkvo"}
    block = {
        **_attention("self_attn", qkvo, "norm_q", "norm_k", "blocks.self_attn"),
        **_attention("cross_attn", qkvo, "norm_q", "norm_k", "blocks.cross_attn"),
        "norm3.weight": ("blocks.norm3.scale", COPY),
        "norm3.bias": ("blocks.norm3.bias", COPY),
        **_linear("ffn.0", "blocks.ffn.fc1"),
        **_linear("ffn.2", "blocks.ffn.fc2"),
        "modulation": ("blocks.modulation", SQUEEZE),
    }
    return top, block


def _diffusers_tables():
    top = {
        "patch_embedding.weight": ("patch_embedding.kernel", CONV3D),
        "patch_embedding.bias": ("patch_embedding.bias", COPY),
        **_linear("condition_embedder.text_embedder.linear_1", "text_embedding.fc1"),
        **_linear("condition_embedder.text_embedder.linear_2", "text_embedding.fc2"),
        **_linear("condition_embedder.time_embedder.linear_1", "time_embedding.fc1"),
        **_linear("condition_embedder.time_embedder.linear_2", "time_embedding.fc2"),
        **_linear("condition_embedder.time_proj", "time_projection"),
        **_linear("proj_out", "head.head"),
        "scale_shift_table": ("head.modulation", SQUEEZE),
    }
    qkvo = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
    block = {
        **_attention("attn1", qkvo, "norm_q", "norm_k", "blocks.self_attn"),
        **_attention("attn2", qkvo, "norm_q", "norm_k", "blocks.cross_attn"),
        "norm2.weight": ("blocks.norm3.scale", COPY),  # diffusers' norm2 is Wan's norm3 (see module docstring)
        "norm2.bias": ("blocks.norm3.bias", COPY),
        **_linear("ffn.net.0.proj", "blocks.ffn.fc1"),
        **_linear("ffn.net.2", "blocks.ffn.fc2"),
        "scale_shift_table": ("blocks.modulation", SQUEEZE),
    }
    return top, block


NAMINGS = {"wan": _wan_tables(), "diffusers": _diffusers_tables()}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")

# Wrapper modules that training code inserts into key paths (FSDP, torch.compile, activation checkpointing, DDP).
_WRAPPERS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module", "module")
# Leading prefixes of whole-model state dicts: Self-Forcing/CausVid wrap the DiT as `model`; ComfyUI-style files
# use `model.diffusion_model.`.
_LEADING = ("model.", "diffusion_model.")


def strip_prefixes(key: str) -> str:
    """``model._fsdp_wrapped_module.blocks.0.x`` -> ``blocks.0.x``."""
    parts = [p for p in key.split(".") if p not in _WRAPPERS]
    key = ".".join(parts)
    changed = True
    while changed:
        changed = False
        for lead in _LEADING:
            if key.startswith(lead):
                key, changed = key[len(lead) :], True
    return key


def detect_naming(keys) -> str:
    """'wan' or 'diffusers' from the (prefix-stripped) key names; ConversionError if neither fits."""
    votes = {name: 0 for name in NAMINGS}
    for key in keys:
        m = _BLOCK.match(key)
        for name, (top, block) in NAMINGS.items():
            if (m and m.group(2) in block) or key in top:
                votes[name] += 1
    # Keys shared by both namings (patch_embedding) count for both; the distinctive ones decide.
    best = max(votes, key=votes.get)
    others = [v for n, v in votes.items() if n != best]
    if votes[best] == 0 or votes[best] == max(others):
        sample = sorted(keys)[:8]
        raise ConversionError(
            "unknown checkpoint format: the tensor names match neither the original Wan 2.1 naming "
            "(blocks.0.self_attn.q.weight, text_embedding.0.weight, ...) nor the diffusers WanTransformer3DModel "
            f"naming (blocks.0.attn1.to_q.weight, condition_embedder.*, ...); first keys found: {sample}"
        )
    return best


def map_key(key: str, naming: str) -> tuple[str, int | None, str] | None:
    """Source key -> (jaxkv flat key, layer or None, transform kind), or None for a key the naming does not know."""
    top, block = NAMINGS[naming]
    m = _BLOCK.match(key)
    if m:
        hit = block.get(m.group(2))
        return None if hit is None else (hit[0], int(m.group(1)), hit[1])
    hit = top.get(key)
    return None if hit is None else (hit[0], None, hit[1])


def source_keys(naming: str, num_layers: int) -> dict[tuple[str, int | None], str]:
    """(jaxkv flat key, layer) -> source key name: every tensor a complete checkpoint of this naming holds."""
    top, block = NAMINGS[naming]
    out = {(dst, None): src for src, (dst, _) in top.items()}
    for layer in range(num_layers):
        out.update({(dst, layer): f"blocks.{layer}.{src}" for src, (dst, _) in block.items()})
    return out


def target_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Shape a source tensor of ``shape`` has after ``kind``; None if the source rank does not fit the kind."""
    if kind == LINEAR:
        return (shape[1], shape[0]) if len(shape) == 2 else None
    if kind == CONV3D:
        return (*shape[2:5], shape[1], shape[0]) if len(shape) == 5 else None
    if kind == SQUEEZE:
        return tuple(shape[1:]) if len(shape) == 3 and shape[0] == 1 else None
    return tuple(shape)


def source_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Inverse of `target_shape`: the source shape that yields jaxkv ``shape`` (for error messages)."""
    if kind == LINEAR:
        return (shape[1], shape[0])
    if kind == CONV3D:
        return (shape[4], shape[3], *shape[0:3])
    if kind == SQUEEZE:
        return (1, *shape)
    return tuple(shape)


def apply(kind: str, array: np.ndarray) -> np.ndarray:
    """The jaxkv view of one source tensor (a transposed/reshaped view; no copy yet)."""
    if kind == LINEAR:
        return array.T
    if kind == CONV3D:
        return array.transpose(2, 3, 4, 1, 0)
    if kind == SQUEEZE:
        return array.reshape(array.shape[1:])
    return array
