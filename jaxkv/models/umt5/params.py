"""The jaxkv parameter layout of a umT5 encoder: one nested dict of arrays, the contract between the converter
(which writes it), the checkpoint loader and `encode` (which read them).

Conventions: linear layers have no bias and are ``{"kernel": [in, out]}`` (PyTorch ``weight`` transposed); the
blocks are stacked on a leading layer axis ``L`` so `encode` scans over them; norm weights are ``scale``.

Layout (shapes for a `UMT5Config` with A = num_heads * head_dim)::

  embedding                    [vocab, D]
  blocks.norm1.scale           [L, D]            pre-attention RMS norm
  blocks.attn.{q,k,v}.kernel   [L, D, A]
  blocks.attn.o.kernel         [L, A, D]
  blocks.attn.rel_bias         [L, buckets, H]   each layer's own relative position bias
  blocks.norm2.scale           [L, D]            pre-FFN RMS norm
  blocks.ffn.gate.kernel       [L, D, F]         goes through tanh-GELU
  blocks.ffn.up.kernel         [L, D, F]         linear, multiplied by the gate
  blocks.ffn.down.kernel       [L, F, D]
  final_norm.scale             [D]

Source names (Wan ``wan/modules/t5.py`` | Hugging Face ``UMT5EncoderModel``), block i:
  token_embedding.weight               | shared.weight / encoder.embed_tokens.weight
  blocks.i.norm1.weight                | encoder.block.i.layer.0.layer_norm.weight
  blocks.i.attn.{q,k,v,o}.weight       | encoder.block.i.layer.0.SelfAttention.{q,k,v,o}.weight
  blocks.i.pos_embedding.embedding.weight | encoder.block.i.layer.0.SelfAttention.relative_attention_bias.weight
  blocks.i.norm2.weight                | encoder.block.i.layer.1.layer_norm.weight
  blocks.i.ffn.gate.0.weight           | encoder.block.i.layer.1.DenseReluDense.wi_0.weight
  blocks.i.ffn.fc1.weight              | encoder.block.i.layer.1.DenseReluDense.wi_1.weight
  blocks.i.ffn.fc2.weight              | encoder.block.i.layer.1.DenseReluDense.wo.weight
  norm.weight                          | encoder.final_layer_norm.weight
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxkv.models.param_tree import check_shapes, flatten, unflatten  # flatten re-exported
from jaxkv.models.umt5.config import UMT5Config
from jaxkv.validate import check_int


def param_shapes(config: UMT5Config) -> dict[str, Any]:
    """Nested dict with the structure of the params whose leaves are shape tuples."""
    d, a, f, L = config.dim, config.attn_dim, config.ffn_dim, config.num_layers
    return {
        "embedding": (config.vocab_size, d),
        "blocks": {
            "norm1": {"scale": (L, d)},
            "attn": {
                "q": {"kernel": (L, d, a)},
                "k": {"kernel": (L, d, a)},
                "v": {"kernel": (L, d, a)},
                "o": {"kernel": (L, a, d)},
                "rel_bias": (L, config.num_buckets, config.num_heads),
            },
            "norm2": {"scale": (L, d)},
            "ffn": {"gate": {"kernel": (L, d, f)}, "up": {"kernel": (L, d, f)}, "down": {"kernel": (L, f, d)}},
        },
        "final_norm": {"scale": (d,)},
    }


def flat_param_shapes(config: UMT5Config) -> dict[str, tuple[int, ...]]:
    """{"blocks.attn.q.kernel": (L, D, A), ...} for every parameter."""
    return flatten(param_shapes(config))


def validate_params(params: dict[str, Any], config: UMT5Config) -> None:
    """Raises ValueError naming every missing key, unexpected key and shape mismatch."""
    check_shapes(params, flat_param_shapes(config), "umT5")


def init_params(config: UMT5Config, seed: int = 0, dtype=jnp.float32) -> dict[str, Any]:
    """Random params (seeded NumPy, so no compilation) with the scales of Wan's ``init_weights``: unit-variance
    activations through the stack, hence well-conditioned outputs; norm scales are 1 plus noise so tests see them.
    Returns jax arrays in ``dtype``."""
    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    d, a, f = config.dim, config.attn_dim, config.ffn_dim
    std = {
        "embedding": 1.0,
        "blocks.attn.q.kernel": a**-0.5,
        "blocks.attn.k.kernel": d**-0.5,
        "blocks.attn.v.kernel": d**-0.5,
        "blocks.attn.o.kernel": a**-0.5,
        "blocks.attn.rel_bias": 1.0,
        "blocks.ffn.gate.kernel": d**-0.5,
        "blocks.ffn.up.kernel": d**-0.5,
        "blocks.ffn.down.kernel": f**-0.5,
    }
    out = {}
    for name, shape in sorted(flat_param_shapes(config).items()):
        noise = rng.standard_normal(shape, dtype=np.float32)
        value = 1.0 + 0.1 * noise if name.endswith("scale") else std[name] * noise
        out[name] = jnp.asarray(value, dtype)
    return unflatten(out)
