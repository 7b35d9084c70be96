"""`jaxkv.run_options.RunOptions`: the dtype policy and the attention backend resolved once into one static value
(issue 38, item 3): validated on construction, hashable (equal options share a compiled program), what
`RolloutConfig.run` and ``jaxkv generate``'s settings hold."""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.attention.dispatch import BACKENDS
from jaxkv.compilation import compile_count
from jaxkv.generate import settings
from jaxkv.models import wan
from jaxkv.nn import CachedSelfAttention
from jaxkv.precision import Precision
from jaxkv.rollout_config import RolloutConfig
from jaxkv.run_options import RunOptions, resolve


def test_of_parses_presets_and_backends():
    assert RunOptions() == RunOptions.of() == RunOptions(Precision.f32(), "auto")
    bf16 = RunOptions.of("bfloat16", "xla")
    assert bf16.precision == Precision.bf16() and bf16.backend == "xla"
    assert RunOptions.of(Precision.bf16(), "xla") == bf16 == RunOptions("bfloat16", "xla")  # name or Precision
    assert RunOptions.of(backend="xla_cpu").precision == Precision.f32()
    for backend in BACKENDS:
        assert RunOptions.of(backend=backend).backend == backend
    with pytest.raises(dataclasses.FrozenInstanceError):
        bf16.backend = "auto"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(precision="bf16"), "unknown precision 'bf16'"),
        (dict(precision=jnp.bfloat16), "RunOptions.precision must be a jaxkv.precision.Precision or one of"),
        (dict(backend="flash"), r"RunOptions.backend must be one of \['auto', 'xla'.*got 'flash'"),
        (dict(backend=3), "RunOptions.backend must be one of .* got 3"),
    ],
)
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunOptions.of(**kwargs)
    with pytest.raises(ValueError, match=match):
        RunOptions(**kwargs)


def test_equal_options_share_one_compiled_program():
    a, b = RunOptions.of("float32", "xla"), RunOptions.of("float32", "xla")
    assert a is not b and a == b and hash(a) == hash(b)
    assert RunOptions.of("bfloat16", "xla") != a and RunOptions.of("float32", "auto") != a

    step = jax.jit(lambda x, run: x.astype(run.precision.compute_dtype) * 2, static_argnums=1)
    x = jnp.ones(3)
    step(x, a)
    step(x, b)
    assert compile_count(step) == 1
    step(x, RunOptions.of("bfloat16", "xla"))
    assert compile_count(step) == 2


def test_resolve_takes_run_or_the_old_keywords_not_both():
    run = RunOptions.of("bfloat16", "xla")
    assert resolve(None, None, None, "f") == RunOptions()
    assert resolve(None, "xla", "bfloat16", "f") == run
    assert resolve(run, None, None, "f") is run
    for backend, precision, named in (
        ("xla", None, "backend="),
        (None, "float32", "precision="),
        ("xla", "float32", "backend= / precision="),
    ):
        with pytest.raises(TypeError, match=f"f: pass either run= or {named}, not both"):
            resolve(run, backend, precision, "f")
    with pytest.raises(TypeError, match="run must be a jaxkv.run_options.RunOptions, got Precision"):
        resolve(Precision(), None, None, "f")


def test_rollout_config_run_is_built_from_its_fields():
    rc = RolloutConfig(8, 8, precision="bfloat16", backend="xla")
    assert rc.run == RunOptions.of("bfloat16", "xla") and rc.run.precision is rc.precision
    assert "run" not in {f.name for f in dataclasses.fields(RolloutConfig)}  # a property: fingerprints unchanged
    assert RolloutConfig(8, 8).run == RunOptions()
    with pytest.raises(ValueError, match="RolloutConfig.precision must be a jaxkv.precision.Precision"):
        RolloutConfig(8, 8, precision=None)
    with pytest.raises(ValueError, match="RolloutConfig.backend must be one of .* got 'flash'"):
        RolloutConfig(8, 8, backend="flash")


def test_generate_settings_use_the_library_run_options():
    assert settings.RunOptions is RunOptions
    assert settings.from_argv(["--random-weights", "--precision", "bfloat16"]).run == RunOptions.of("bfloat16")


# ------------------------------------------------------------------------------------------------ one run crosses


ROOT = pathlib.Path(__file__).resolve().parents[1]
# The public entry points, the only functions in jaxkv/models/wan and jaxkv/nn that take `backend=` / `precision=`
# (each builds one RunOptions at its top); everything they call takes `run`. jaxkv/models/wan/model.py re-exports the
# model's ones.
ENTRY_POINTS = {
    "jaxkv/models/wan/attention.py": {"cross_kv"},
    "jaxkv/models/wan/sequence.py": {"forward", "forward_block_causal", "forward_teacher_forcing"},
    "jaxkv/models/wan/streaming.py": {"forward_chunk", "recompute_cache"},
    "jaxkv/models/wan/module.py": {"__call__", "block_causal", "cross_kv", "step"},  # WanModel: pass them through
    "jaxkv/nn/attention.py": {"__init__"},  # CachedSelfAttention(backend=...), held as self.run
}
CHECKS = {"as_precision", "check_params", "named", "resolve"}  # parse or check a precision / resolve the options
RESOLVER = "jaxkv/models/wan/dtypes.py"  # `_run_of`: what the entry points hand the keywords to
MODEL = ("jaxkv/models/wan/attention.py", "jaxkv/models/wan/sequence.py", "jaxkv/models/wan/streaming.py")
MODEL_ENTRY_POINTS = {name for path in MODEL for name in ENTRY_POINTS[path]}  # the pure functions' entry points


def _modules():
    files = sorted((ROOT / "jaxkv/models/wan").glob("*.py")) + sorted((ROOT / "jaxkv/nn").glob("*.py"))
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for p in files}


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def _name(node) -> str:
    return getattr(node, "name", "<lambda>")


def _calls(fn) -> list[str]:
    """The names called in ``fn``'s own body (nested defs included), ``f(...)`` and ``x.f(...)`` alike."""
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            f = n.func
            out.append(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def test_only_the_entry_points_take_backend_or_precision():
    modules = _modules()
    assert set(ENTRY_POINTS) <= set(modules)
    found = {}
    for path, tree in modules.items():
        for fn in _functions(tree):
            a = fn.args
            names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
            if names & {"backend", "precision"}:
                found.setdefault(path, set()).add(_name(fn))
    assert found == {**ENTRY_POINTS, RESOLVER: {"_run_of"}}


def test_the_precision_is_checked_once_per_entry_point():
    """In jaxkv/models/wan only `_run_of` (dtypes.py) resolves the options and checks the params; each of the model's
    entry points calls it once; no other function of the model's modules calls it or an entry point (which would
    check again); module.py (WanModel, which calls the entry points) and nn/ check nothing themselves."""
    modules = _modules()
    model = {path: tree for path, tree in modules.items() if path.startswith("jaxkv/models/wan/")}
    model.pop("jaxkv/models/wan/module.py")
    top = {(path, n.name): n for path, tree in model.items() for n in tree.body if isinstance(n, ast.FunctionDef)}
    checking = {key for key, fn in top.items() if CHECKS & set(_calls(fn))}
    assert checking == {(RESOLVER, "_run_of")}
    for (path, name), fn in top.items():
        calls = _calls(fn)
        if name in ENTRY_POINTS.get(path, ()):
            assert calls.count("_run_of") == 1, name
        else:
            assert "_run_of" not in calls, name
        assert not set(calls) & MODEL_ENTRY_POINTS, name
    for path, tree in modules.items():
        if path != RESOLVER:
            assert not CHECKS & set(_calls(tree)), path


# ------------------------------------------------------------------------------------------------ the entry points

CFG = wan.preset("tiny")  # dim 64, 4 x 16 heads, 2 layers, text 16 x 32, 16 latent channels


def test_entry_points_take_run_or_the_old_keywords_alike():
    params = wan.init_params(CFG, jax.random.key(0))
    k1, k2 = jax.random.split(jax.random.key(1))
    latents = jax.random.normal(k1, (1, 2, 8, 8, CFG.in_dim))
    context = jax.random.normal(k2, (1, CFG.text_len, CFG.text_dim))
    t = jnp.array([500.0])
    run = RunOptions.of("float32", "xla")
    old = wan.forward(params, CFG, latents, t, context, backend="xla", precision="float32")
    np.testing.assert_array_equal(wan.forward(params, CFG, latents, t, context, run=run), old)
    causal = dict(chunk_frames=1)
    np.testing.assert_array_equal(
        wan.forward_block_causal(params, CFG, latents, t, context, run=run, **causal),
        wan.forward_block_causal(params, CFG, latents, t, context, backend="xla", **causal),
    )
    cross = wan.cross_kv(params, CFG, context, precision="float32")
    assert jax.tree.all(jax.tree.map(np.array_equal, wan.cross_kv(params, CFG, context, run=run), cross))
    model = wan.WanModel.from_params(CFG, params)
    np.testing.assert_array_equal(model(latents, t, context, run=run), old)

    with pytest.raises(TypeError, match="forward: pass either run= or backend=, not both"):
        wan.forward(params, CFG, latents, t, context, run=run, backend="xla")
    with pytest.raises(TypeError, match="forward_block_causal: pass either run= or precision=, not both"):
        wan.forward_block_causal(params, CFG, latents, t, context, run=run, precision="float32", **causal)
    with pytest.raises(TypeError, match="cross_kv: pass either run= or precision=, not both"):
        model.cross_kv(context, run=run, precision="float32")
    with pytest.raises(TypeError, match="run must be a jaxkv.run_options.RunOptions, got str"):
        wan.forward(params, CFG, latents, t, context, run="xla")
    with pytest.raises(ValueError, match="RunOptions.backend must be one of .* got 'flash'"):
        wan.forward(params, CFG, latents, t, context, backend="flash")
    with pytest.raises(ValueError, match=r"params\[.*\] is float32 but the precision's param_dtype is bfloat16"):
        wan.forward(params, CFG, latents, t, context, run=RunOptions.of("bfloat16"))


def test_a_bad_backend_is_refused_before_anything_loads():
    from jaxkv.pipeline import Pipeline

    with pytest.raises(ValueError, match="RunOptions.backend must be one of .* got 'flash'"):
        Pipeline.from_pretrained(backend="flash")  # the shipped toy world: resolved, not loaded
    with pytest.raises(ValueError, match="RunOptions.backend must be one of .* got 'flash'"):
        CachedSelfAttention(8, 2, backend="flash", rngs=nnx.Rngs(0))


def test_a_precision_is_parsed_in_run_options_and_the_flag_parser_only():
    """Issue 38 named three places parsing precision strings; what is left: `RunOptions` (the model's entry points
    and `RolloutConfig` parse through it) and ``jaxkv generate``'s --precision (a one-line UsageError)."""
    sites = set()
    for path in sorted((ROOT / "jaxkv").rglob("*.py")):
        for fn in _functions(ast.parse(path.read_text())):
            if {"as_precision", "named"} & set(_calls(fn)):
                sites.add(f"{path.relative_to(ROOT).as_posix()}:{_name(fn)}")
    assert sites == {
        "jaxkv/precision.py:as_precision",  # a Precision or a preset name -> Precision.named
        "jaxkv/run_options.py:_checked",
        "jaxkv/generate/settings.py:resolve",
    }
