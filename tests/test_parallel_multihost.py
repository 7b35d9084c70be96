"""The same `jaxkv.parallel` code as a two-process job (``jax.distributed.initialize`` on localhost, CPU backend
with gloo collectives): see tests/parallel_multihost.py."""

from __future__ import annotations

import pytest

from tests.helpers.processes import run_processes


@pytest.mark.slow
def test_two_processes_run_the_mesh_stream():
    run_processes("parallel_multihost.py", 2, timeout=900)
