"""`jaxkv.run_options.RunOptions`: the dtype policy and the attention backend resolved once into one static value
(issue 38, item 3): validated on construction, hashable (equal options share a compiled program), what
`RolloutConfig.run` and ``jaxkv generate``'s settings hold."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxkv.attention.dispatch import BACKENDS
from jaxkv.compilation import compile_count
from jaxkv.generate import settings
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
    with pytest.raises(ValueError, match="RolloutConfig.backend: RunOptions.backend must be one of .* got 'flash'"):
        RolloutConfig(8, 8, backend="flash")


def test_generate_settings_use_the_library_run_options():
    assert settings.RunOptions is RunOptions
    assert settings.from_argv(["--random-weights", "--precision", "bfloat16"]).run == RunOptions.of("bfloat16")
