"""The README's Python examples run as written (documentation that cannot silently rot)."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.compilation import compile_count

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert commands == ["pip install -e . && jaxkv generate", "pip install -e '.[test]' && python -m pytest -q -n 2"]


def test_cache_example_runs_and_streams_past_the_window():
    block = next(b for b in _python_blocks() if "RingSpec.from_frames" in b)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    cache, step, spec = scope["cache"], scope["step"], scope["spec"]
    q = jnp.ones((2, spec.chunk, 12, 128), jnp.bfloat16)
    for _ in range(spec.num_slots + 3):  # past the first eviction
        cache, out = step(cache, q, q, q)
    assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert compile_count(step) == 1


@pytest.mark.slow
def test_rollout_example_runs_and_stream_equals_scan():
    block = next(b for b in _python_blocks() if "jit_rollout" in b)
    chunks = []
    block = block.replace("print(chunk.shape)", "chunks.append(chunk)")
    scope: dict = {"chunks": chunks}
    exec(compile(block, "README.md", "exec"), scope)
    latents = scope["out"].latents
    assert latents.shape == (1, 18, 16, 16, 16)
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), latents, rtol=1e-5, atol=1e-5)
