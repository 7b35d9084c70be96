"""One process of a multi-process ``jaxkv generate`` job on this machine, or the single-process reference run (run by
tests/test_multiprocess_generate.py): ``python tests/multiprocess_generate.py PROCESS_ID NUM_PROCESSES PORT DIR``.

With 2 processes each has 2 CPU devices (gloo collectives); with 1 process it has 4 devices and runs the same
commands without joining a job (the reference). In DIR every process runs, in order (`jaxkv.generate.loop.main`,
the same argv in every process but --process-id):
1. ``whole``: 3 chunks on ``--mesh data=2,model=2`` with the tiny random VAE's mp4 and ``--frames npy`` (the first
   command joins the job: ``--coordinator localhost:PORT --num-processes 2 --process-id I``; the later ones run in
   the joined job);
2. ``part``: the first chunk, then ``--save-state DIR/s`` (each process its own shard file; the VAE decoder's
   caches, which only process 0 keeps, saved alike);
3. ``rest``: ``--resume DIR/s`` for the next 2 chunks;
   ``switch``: 2 chunks of ``--prompt-schedule DIR/ab.json`` (a switch at chunk 1), and ``switch_resumed``:
   ``--resume DIR/s`` with ``--prompt-schedule DIR/b.json`` (a switch at the resume);
   ``image`` (``--image DIR/given.png``), ``dilated`` (``--dilated-every 2``) and ``fp8`` (``--precision fp8``);
4. (2 processes only) ``fail_write``: process 0's writes fail (a file-size limit): every process returns 1, none
   hangs;
5. (2 processes only) ``fail_check``: process 1 alone is given a --context file it cannot read (as on a file system
   it does not share): every process returns 2 or 1 before anything is written.
Each command's exit code is checked here; prints ``OK PROCESS_ID``. The parent compares the files.
"""

from __future__ import annotations

import io
import os
import resource
import sys
from contextlib import redirect_stderr, redirect_stdout

import jax

process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
out = sys.argv[4]
jax.config.update("jax_num_cpu_devices", 4 // num_processes)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

from jaxkv.generate import loop  # noqa: E402 - the job is joined by the first command, before any computation

COMMON = ["--random-weights", "--mesh", "data=2,model=2", "--batch", "2", "--height", "8", "--width", "8"]
COMMON += ["--no-progress"]
JOIN = ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(process_id)]


def generate(name: str, *argv: str, rc: int = 0) -> str:
    """Runs ``jaxkv generate`` (its output captured); checks its exit code; returns the output."""
    buffer = io.StringIO()
    with redirect_stdout(buffer), redirect_stderr(buffer):
        got = loop.main([*COMMON, "--out", os.path.join(out, name), *argv])
    text = buffer.getvalue()
    print(f"--- process {process_id}: {name} -> {got}\n{text}", flush=True)
    assert got == rc or (rc == "failed" and got in (1, 2)), (name, got, text)
    if got == 0 and process_id > 0:
        assert "wrote        nothing from this process (process 0 wrote" in text, text
    return text


first = JOIN if num_processes > 1 else []
generate("whole", "--num-chunks", "3", "--frames", "npy", *first)
if num_processes > 1:
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
generate("part", "--num-chunks", "1", "--frames", "npy", "--save-state", os.path.join(out, "s"))
generate("rest", "--num-chunks", "2", "--frames", "npy", "--resume", os.path.join(out, "s"))
# prompt switches (the schedules and contexts written by the parent): at chunk 1, and at a resume
generate("switch", "--num-chunks", "2", "--no-video", "--prompt-schedule", os.path.join(out, "ab.json"))
generate(
    "switch_resumed",
    "--num-chunks",
    "1",
    "--resume",
    os.path.join(out, "s"),
    "--prompt-schedule",
    os.path.join(out, "b.json"),
)
# given frames and other caches in the job: an image the run continues from (read and encoded by every process, the
# parent's DIR/given.png), a mixed dense / dilated cache, an FP8 KV cache with FP8 attention
generate("image", "--num-chunks", "2", "--no-video", "--image", os.path.join(out, "given.png"))
dilated = ["--chunk-frames", "1", "--window-frames", "2", "--sink-frames", "1", "--dilated-every", "2"]
generate("dilated", "--num-chunks", "3", "--no-video", *dilated, "--dilation", "2", "--buckets", "2")
generate("fp8", "--num-chunks", "2", "--no-video", "--precision", "fp8")

if num_processes > 1:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if process_id == 0:  # the first chunk (2 x 16 x 3 x 8 x 8 float32: 24 KiB) cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
    text = generate("fail_write", "--num-chunks", "3", "--no-video", rc="failed")
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert ("writing chunk 0 failed in process 0" in text) == (process_id == 1), text

    context = os.path.join(out, "no_such_context.npy" if process_id == 1 else "context.npy")
    if process_id == 0:
        import numpy as np

        from jaxkv.models.wan.config import PRESETS

        np.save(context, np.zeros((1, 8, PRESETS["tiny"].text_dim), np.float32))
    text = generate("fail_check", "--num-chunks", "1", "--context", context, rc="failed")
    assert ("failed in process 1 of 2" in text) == (process_id == 0), text
    assert not os.path.exists(os.path.join(out, "fail_check")), "nothing is written"

print(f"OK {process_id}", flush=True)
