"""One process of a two-process `jaxkv.parallel` job on this machine (run by tests/test_parallel_multihost.py):
``python tests/parallel_multihost.py PROCESS_ID NUM_PROCESSES PORT``.

Each process has 2 CPU devices; the (data=2, model=2) mesh puts one data group in each process, so the model
all-reduces stay inside a process and nothing but the inputs crosses. Every process runs the same code: it loads the
params into its shards from one checkpoint, runs the MeshStream, and compares its own rows of the latents with a
single-device stream computed locally. Prints ``OK PROCESS_ID``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import jax

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"localhost:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=120,
)

import jax.experimental.multihost_utils
import numpy as np

from jaxkv import parallel as PL
from jaxkv import rollout as R
from jaxkv.models.wan import checkpoint
from jaxkv.models.wan import config as C
from jaxkv.models.wan import model as M
from jaxkv.schedule import Schedule
from jaxkv.stream import Stream

assert jax.process_count() == num_processes and len(jax.local_devices()) == 2 and len(jax.devices()) == 4

config = C.preset("tiny")
params = M.init_params(config, jax.random.key(0))  # the same on every process (same key)
rc = R.RolloutConfig(4, 4, chunk_frames=1, window_frames=2, sink_frames=1, schedule=Schedule(steps=(1000, 500)))
context = np.random.default_rng(0).standard_normal((2, 5, config.text_dim)).astype(np.float32)

path = os.path.join(tempfile.gettempdir(), f"jaxkv_multihost_{port}", "ckpt")
if process_id == 0:
    checkpoint.save(path, config, params)
jax.experimental.multihost_utils.sync_global_devices("checkpoint written")

mesh = PL.make_mesh(2, 2)
assert {d.process_index for d in mesh.devices[process_id].flat} == {process_id}  # a data group is one process
_, sharded = PL.load_sharded(path, mesh)
stream = PL.MeshStream(sharded, config, rc, context, mesh=mesh, num_chunks=3, key=jax.random.key(7))
reference = Stream(params, config, rc, context, num_chunks=3, key=jax.random.key(7))
for n, (x, want) in enumerate(zip(stream, reference)):
    rows, local = PL.local_rows(x)
    assert rows == slice(process_id, process_id + 1), rows
    np.testing.assert_allclose(local, np.asarray(want)[rows], rtol=1e-5, atol=2e-5, err_msg=f"chunk {n}")
from jaxkv.compilation import compile_count

assert compile_count(stream.step) == 1, compile_count(stream.step)
jax.experimental.multihost_utils.sync_global_devices("done")
print(f"OK {process_id}", flush=True)
