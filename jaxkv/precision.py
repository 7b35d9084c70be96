"""`Precision`: the one place that says which dtype parameters, matmuls and caches use.

A `Precision` is static (frozen, hashable: a jit static argument) and is passed to the model and the rollout; the
layers never pick a dtype themselves. Three choices, each a dtype name:

* ``param_dtype``: the dtype the weights are held in (`jaxkv.models.wan.init_params`, checkpoint loading,
  ``jaxkv generate``). A forward checks that the params it is given are in it.
* ``compute_dtype``: the dtype of the inputs and outputs of the large matmuls (patch and text embeddings, every
  attention and feed-forward projection) and of the activations between the residual stream and them. Products
  always accumulate in float32; a bf16 GEMM emits bf16 with its bias (and the FFN's GELU) applied in bf16, so they
  fuse into its epilogue; norms, modulation and RoPE compute in float32 and write bf16.
* ``cache_dtype``: the dtype of the cached self-attention K/V and of the hoisted cross-attention K/V. Attention
  reads them as they are stored (queries are cast to it); softmax and accumulation are float32 on every path.

Two FP8 switches (off unless set; see docs/precision-fp8.md for what they cost in quality):

* ``fp8_kv``: the self-attention KV cache is stored in float8_e4m3fn with a float32 scale per (layer, session,
  chunk slot, head) (`jaxkv.cache.fp8.Fp8Cache`; ring policy only): half the cache bytes of bfloat16. Reads
  dequantize to ``cache_dtype``, so attention is unchanged otherwise. The cross-attention K/V stay ``cache_dtype``.
* ``fp8_attention``: the streaming self-attention runs with FP8 q, k, v, probabilities and output
  (`jaxkv.attention.fp8.fp8_attend`): cuDNN's FP8 flash attention on a GPU that has it, an emulation of its
  roundings on CPU.

What no policy changes (as Wan 2.1 runs its bf16 inference: norm statistics on ``x.float()``, the time embedding,
time projection, modulation and head under ``autocast(float32)``, RoPE in float64; diffusers keeps the same modules in
float32): the residual stream, the norms' statistics, the modulation tables, the sinusoidal timestep embedding and
its two linears, the time projection and the output head run in float32 whatever the policy (jaxkv computes RoPE in
float32, as its float32 path always has, and writes its result in the compute dtype).

Presets: `Precision.f32()` (the default, everything float32), `Precision.bf16()` (Self-Forcing's inference:
bfloat16 weights, matmuls, activations and caches) and `Precision.fp8()` (bf16 with both FP8 switches on).
`Precision.named("bfloat16")` looks a preset up by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_FLOATS = ("float32", "bfloat16", "float16")


def _dtype_name(field: str, value) -> str:
    try:
        name = jnp.dtype(value).name
    except TypeError:
        raise ValueError(f"Precision.{field} {value!r} is not a dtype (expected one of {_FLOATS})") from None
    if name not in _FLOATS:
        raise ValueError(f"Precision.{field} must be one of {_FLOATS}, got {value!r}")
    return name


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtype policy of a model run (static, hashable). Fields hold dtype names; pass names or dtypes.

    Attributes:
      param_dtype: dtype of the weights.
      compute_dtype: dtype of the large matmuls' inputs and outputs and of the activations around them (float32
        accumulation always; the residual stream stays float32).
      cache_dtype: dtype of the self-attention KV cache (the dtype it is written and read in) and the
        cross-attention K/V.
      fp8_kv: store the self-attention KV cache in FP8 e4m3 with float32 per-(chunk, head) scales.
      fp8_attention: run the streaming self-attention in FP8 (cuDNN on GPU, emulated on CPU).
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    cache_dtype: str = "float32"
    fp8_kv: bool = False
    fp8_attention: bool = False

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "cache_dtype"):
            object.__setattr__(self, field, _dtype_name(field, getattr(self, field)))
        for field in ("fp8_kv", "fp8_attention"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"Precision.{field} must be a bool, got {getattr(self, field)!r}")

    @classmethod
    def f32(cls) -> "Precision":
        """Everything float32 (the default; the reference the other modes are measured against)."""
        return cls("float32", "float32", "float32")

    @classmethod
    def bf16(cls) -> "Precision":
        """Self-Forcing's inference: bfloat16 weights, matmul inputs and KV caches; float32 accumulation, norms,
        softmax, modulation, time embedding and head."""
        return cls("bfloat16", "bfloat16", "bfloat16")

    @classmethod
    def fp8(cls) -> "Precision":
        """`bf16` with an FP8 (e4m3) KV cache and FP8 self-attention: half the cache bytes; see
        docs/precision-fp8.md for its measured distance from bf16."""
        return cls("bfloat16", "bfloat16", "bfloat16", fp8_kv=True, fp8_attention=True)

    @classmethod
    def named(cls, name: str) -> "Precision":
        """The preset called ``name``: one of `PRESETS` ("float32", "bfloat16", "fp8")."""
        try:
            return PRESETS[name]()
        except (KeyError, TypeError):
            raise ValueError(f"unknown precision {name!r}; expected one of {sorted(PRESETS)}") from None

    @property
    def name(self) -> str | None:
        """The preset name of this policy, or None for a custom one."""
        return next((n for n, make in PRESETS.items() if make() == self), None)

    def check_params(self, params) -> None:
        """ValueError naming the first floating leaf of ``params`` not held in ``param_dtype`` (trace time)."""
        want = jnp.dtype(self.param_dtype)
        for path, leaf in jax.tree.flatten_with_path(params)[0]:
            dtype = getattr(leaf, "dtype", None)  # arrays and ShapeDtypeStructs alike
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype != want:
                raise ValueError(
                    f"params{jax.tree_util.keystr(path)} is {dtype.name} but the precision's "
                    f"param_dtype is {self.param_dtype}; pass a matching precision (e.g. "
                    f"precision=Precision.bf16() for bfloat16 weights, or Precision(param_dtype="
                    f"{dtype.name!r}, ...)) or cast the params"
                )


PRESETS = {"float32": Precision.f32, "bfloat16": Precision.bf16, "fp8": Precision.fp8}


def as_precision(value, name: str = "precision") -> Precision:
    """A `Precision` from a `Precision` or a preset name; ValueError otherwise."""
    if isinstance(value, Precision):
        return value
    if isinstance(value, str):
        return Precision.named(value)
    raise ValueError(f"{name} must be a jaxkv.precision.Precision or one of {sorted(PRESETS)}, got {value!r}")
