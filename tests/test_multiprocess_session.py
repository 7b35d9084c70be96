"""A mesh session saved from a two-process job (``jax.distributed.initialize`` on localhost, 2 CPU devices per
process, gloo collectives): each process writes its own shard file, process 0 the manifest after a barrier.
tests/multiprocess_session.py runs the processes (save, resume on the same and on another multi-process mesh, a
failure in one process); the directory they saved is then loaded here, in one process, on one device and on other
mesh shapes (tests/parallel_checks.py ``multiprocess_resume``). The barrier logic alone, with one process, is
covered in process by tests/test_parallel.py."""

from __future__ import annotations

import pytest

from tests.helpers.processes import run_processes
from tests.test_parallel import run_checks


@pytest.mark.slow
def test_two_processes_save_a_mesh_session_that_resumes_anywhere(tmp_path, monkeypatch):
    """Two processes save after chunk 0 on data=2,model=2 (one shard file each, holding that process's rows), resume
    on the same mesh bit for bit (each reading only its own file's rows) and on data=1,model=4 across both; a
    write failing in process 1 makes both raise and leaves nothing. One process then loads the directory on one
    device, on data=2,model=2 and on data=1,model=4: the state bit for bit, and chunks as the single-process save
    resumes (tests/parallel_checks.py ``resumes_everywhere``)."""
    run_processes("multiprocess_session.py", 2, str(tmp_path))
    monkeypatch.setenv("JAXKV_MULTIPROCESS_SESSION", str(tmp_path / "s"))
    run_checks("multiprocess_resume")
