"""One process of a multi-process save / resume job on this machine (run by tests/test_multiprocess_session.py):
``python tests/multiprocess_session.py PROCESS_ID NUM_PROCESSES PORT DIR``.

Each process has 2 CPU devices (gloo collectives); the (data=2, model=2) mesh puts one data group in each process.
The stream is tests/parallel_checks.py's guided stream (same params, contexts, key). Every process:
1. saves the mesh session after chunk 0 to DIR/s (`jaxkv.parallel.checkpoint.save`: its own shard file; process 0
   checks the directory: one file per process, each holding that process's rows and nothing else);
2. loads it on the same mesh, reading only the pieces of its own rows (its own file), and continues: its rows of
   chunks 1.. equal the uninterrupted stream's bit for bit, on the step program already compiled;
3. loads it on data=1,model=4 (the heads split over both processes) and continues: the single-device stream's
   chunks to f32 rounding;
4. saves again with process 1's write failing: every process raises (process 0 naming process 1), and neither the
   directory nor a temporary is left.
Prints ``OK PROCESS_ID``. The single-process loads of DIR/s (one device, other meshes) are
``parallel_checks.py multiprocess_resume``.
"""

from __future__ import annotations

import errno
import os
import sys
import time

import jax

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
out = sys.argv[4]
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"localhost:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=120,
)

import numpy as np
from jax.experimental import multihost_utils

import parallel_checks as PC  # after jax.distributed.initialize, which must come before any computation
from jaxkv import parallel as PL
from jaxkv.compilation import compile_count
from jaxkv.parallel import checkpoint as CK
from jaxkv.parallel.processes import ProcessFailed

assert jax.process_count() == num_processes == 2 and len(jax.local_devices()) == 2 and len(jax.devices()) == 4
rc, batch = PC.rc_of(guidance=3.0), 2
m22 = PL.make_mesh(2, 2)
assert {d.process_index for d in m22.devices[process_id].flat} == {process_id}  # a data group is one process
mine = slice(process_id, process_id + 1)  # this process's row of the latents (batch 2, data=2)


whole = []
for x in PC.stream_of(m22, rc, batch, PC.CHUNKS):
    rows, values = PL.local_rows(x)
    assert rows == mine, rows
    whole.append(values)
first = PC.stream_of(m22, rc, batch, 1)
np.testing.assert_array_equal(PL.local_rows(next(first))[1], whole[0])
session = first.session(copy=False)

# 1. save: each process its own file
started = time.perf_counter()
path = CK.save(os.path.join(out, "s"), session, mesh=m22, metadata={"processes": num_processes})
print(f"process {process_id}: save took {time.perf_counter() - started:.2f} s", flush=True)
files = sorted(os.listdir(path))
assert files == ["session.json", "shards-00000.safetensors", "shards-00001.safetensors"], files
manifest = CK.read_manifest(path)
by_file: dict[str, dict[str, list]] = {}
for piece in manifest["pieces"]:
    by_file.setdefault(piece["file"], {}).setdefault(piece["tensor"], []).append(piece["index"])
for p in range(num_processes):
    rows = sorted({tuple(index[1]) for index in by_file[CK.shard_file(p)]["cache/k"]})
    assert rows == [(p, p + 1), (batch + p, batch + p + 1)], (p, rows)  # its cond row and its negative row
    assert len(by_file[CK.shard_file(p)]["cache/k"]) == 2 * 2  # 2 head shards x 2 runs of rows
assert set(by_file[CK.shard_file(1)]) == {n for n in by_file[CK.shard_file(0)] if CK.rows_axis(n) is not None}
assert "next_chunk" in by_file[CK.shard_file(0)] and "key" in by_file[CK.shard_file(0)]

# 2. the same multi-process mesh: this process reads only its own file's row pieces; bit for bit
read = []
real_piece = CK._Reader._piece
CK._Reader._piece = lambda self, piece: read.append(piece) or real_piece(self, piece)
s22 = CK.load(path, PC.CONFIG, rc, mesh=m22)
CK._Reader._piece = real_piece
assert read and {p["file"] for p in read if CK.rows_axis(p["tensor"]) is not None} == {CK.shard_file(process_id)}
resumed = PL.MeshStream.from_session(PC.PARAMS, PC.CONFIG, rc, s22, mesh=m22, num_chunks=PC.CHUNKS - 1)
before = compile_count(resumed.step)
xs = [PL.local_rows(x)[1] for x in resumed]
assert compile_count(resumed.step) == before  # the uninterrupted stream's program
for n, (a, b) in enumerate(zip(xs, whole[1:], strict=True)):
    np.testing.assert_array_equal(a, b, err_msg=f"2x2 chunk {n + 1}")
assert not np.array_equal(xs[0], xs[1])

# 3. data=1, model=4: every process holds every row, half the heads
ref_xs, _ = PC.reference(rc, batch)  # the single-device stream, run in this process
m14 = PL.make_mesh(1, 4)
s14 = CK.load(path, PC.CONFIG, rc, mesh=m14)
for n, x in enumerate(PL.MeshStream.from_session(PC.PARAMS, PC.CONFIG, rc, s14, mesh=m14, num_chunks=PC.CHUNKS - 1)):
    rows, values = PL.local_rows(x)
    assert rows == slice(0, batch), rows
    np.testing.assert_allclose(values, ref_xs[n + 1], **PC.TOL, err_msg=f"1x4 chunk {n + 1}")

# 4. a failure in one process: everyone raises, nothing is left
if process_id == 1:
    import safetensors.numpy

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    safetensors.numpy.save_file = full_disk
try:
    CK.save(os.path.join(out, "broken"), session, mesh=m22)
except (OSError, ProcessFailed) as e:
    if process_id == 1:
        assert isinstance(e, OSError) and "No space left" in str(e), repr(e)
    else:
        assert isinstance(e, ProcessFailed) and "process 1 of 2" in str(e) and "No space left" in str(e), str(e)
else:
    raise AssertionError("a save whose process 1 failed returned")
multihost_utils.sync_global_devices("after the failed save")  # process 0 has cleaned up
left = sorted(e for e in os.listdir(out) if "broken" in e)
assert left == [], left  # neither the directory nor its temporary
multihost_utils.sync_global_devices("done")
print(f"OK {process_id}", flush=True)
