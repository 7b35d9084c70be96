"""Peak memory of `jaxkv convert` against the size of the checkpoint: streaming keeps it flat.

Writes a synthetic original-layout Wan checkpoint (float32 safetensors, random weights, itself written tensor by
tensor) of about --size-mb, then runs, each in a fresh subprocess whose peak resident memory is taken from
its own high-water mark (VmHWM, see `measure`) and whose anonymous / file-backed RSS is sampled from /proc every few
ms:

  dry-run:  `jaxkv convert SRC --dry-run` (imports + header parsing: the fixed cost of the process)
  convert:  `jaxkv convert SRC DST --dtype bf16` (the streamed conversion)
  dry-run-pt, convert-pt: the same for the same weights saved as a Self-Forcing `.pt` (read with
            torch.load(weights_only=True, mmap=True)); with --pt, needs torch
  load-all: `safetensors.numpy.load_file(SRC)` (what holding the checkpoint costs: shows the measure can tell)

"convert - dry-run" is the memory the conversion itself needs; compare it with the checkpoint size and the largest
single tensor. The .pt path reads tensors through one mapping of the whole file, so its file-backed RSS would grow with
the pages read unless they are dropped: the reader releases each tensor's pages (madvise) once it is written, so
that stays flat too. Anonymous and file-backed peaks are reported separately.

With --load, the same weights converted to a float32 and a bfloat16 jaxkv checkpoint are read back with
`jaxkv.models.wan.load` (each in a fresh subprocess, arrays ready on the device):

  load-baseline:        imports + one tiny jax array (the fixed cost)
  load-f32-as-bf16:     load(f32 checkpoint, dtype=bfloat16): must not hold a float32 copy of the weights
  load-f32:             load(f32 checkpoint)
  load-bf16:            load(bf16 checkpoint)

"load-X - load-baseline" against the weights' size in the loaded dtype is what `load` costs beyond its result.

    python benchmarks/convert_memory.py [--size-mb 600] [--pt] [--load] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxkv.convert.safetensors_io import StreamWriter


def synthetic_shapes(
    dim: int, ffn_dim: int, layers: int, text_dim: int = 4096, freq_dim: int = 256, in_dim: int = 16
) -> dict[str, tuple[int, ...]]:
    """Original Wan 2.1 key -> PyTorch shape (patch 1x2x2)."""
    d = dim
    shapes = {
        "patch_embedding.weight": (d, in_dim, 1, 2, 2),
        "patch_embedding.bias": (d,),
        "text_embedding.0.weight": (d, text_dim),
        "text_embedding.0.bias": (d,),
        "text_embedding.2.weight": (d, d),
        "text_embedding.2.bias": (d,),
        "time_embedding.0.weight": (d, freq_dim),
        "time_embedding.0.bias": (d,),
        "time_embedding.2.weight": (d, d),
        "time_embedding.2.bias": (d,),
        "time_projection.1.weight": (6 * d, d),
        "time_projection.1.bias": (6 * d,),
        "head.head.weight": (4 * in_dim, d),
        "head.head.bias": (4 * in_dim,),
        "head.modulation": (1, 2, d),
    }
    for i in range(layers):
        for a in ("self_attn", "cross_attn"):
            for p in "qkvo":
                shapes[f"blocks.{i}.{a}.{p}.weight"], shapes[f"blocks.{i}.{a}.{p}.bias"] = (d, d), (d,)
            shapes[f"blocks.{i}.{a}.norm_q.weight"] = shapes[f"blocks.{i}.{a}.norm_k.weight"] = (d,)
        shapes[f"blocks.{i}.norm3.weight"] = shapes[f"blocks.{i}.norm3.bias"] = (d,)
        shapes[f"blocks.{i}.ffn.0.weight"], shapes[f"blocks.{i}.ffn.0.bias"] = (ffn_dim, d), (ffn_dim,)
        shapes[f"blocks.{i}.ffn.2.weight"], shapes[f"blocks.{i}.ffn.2.bias"] = (d, ffn_dim), (d,)
        shapes[f"blocks.{i}.modulation"] = (1, 6, d)
    return shapes


def write_synthetic(path: str, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = StreamWriter(path, [(k, np.float32, s) for k, s in shapes.items()])
    for k, s in shapes.items():
        writer.write(k, rng.standard_normal(s, dtype=np.float32))
    writer.close()


def write_synthetic_pt(path: str, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> None:
    import torch

    rng = np.random.default_rng(seed)
    state = {f"model.{k}": torch.from_numpy(rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()}
    torch.save({"generator_ema": state}, path)


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
                    name, value = line.split(":")
                    out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def measure(cmd: list[str]) -> dict:
    """Runs cmd; returns wall time, peak RSS and sampled peak anonymous / file-backed RSS, bytes.

    The peak is the child's own high-water mark (VmHWM, sampled from /proc; it belongs to the program after exec).
    wait4's ru_maxrss is kept as ``peak_rss_wait4`` but is not used: Linux starts a child's ru_maxrss at the RSS of
    the parent it forked from, so under a large parent (a long pytest run) every row would read the parent's size.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    peaks = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            for k, v in _status(proc.pid).items():
                if k in peaks:
                    peaks[k] = max(peaks[k], v)
            time.sleep(0.003)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    thread.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr.decode()[-2000:]}")
    wait4_peak = usage.ru_maxrss * 1024
    return {
        "wall_s": time.perf_counter() - start,
        "peak_rss": peaks["VmHWM"] or wait4_peak,
        "peak_rss_wait4": wait4_peak,
        "peak_anon": peaks["RssAnon"],
        "peak_file": peaks["RssFile"],
    }


def _generate(path: str, dim: int, ffn_dim: int, layers: int) -> None:
    # In a subprocess: Linux carries the RSS a process had when it forked into its child's ru_maxrss, so this
    # process must stay small (torch.save needs the whole state dict in memory).
    subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--generate",
            path,
            "--dim",
            str(dim),
            "--ffn-dim",
            str(ffn_dim),
            "--layers",
            str(layers),
        ],
        check=True,
        cwd=ROOT,
    )


def run(
    size_mb: float,
    dim: int = 1024,
    ffn_dim: int = 4096,
    heads: int = 8,
    pt: bool = False,
    workdir: str | None = None,
    safetensors: bool = True,
) -> dict:
    """Builds the synthetic checkpoint(s) and measures every row; ``safetensors=False`` keeps only the control
    and the .pt rows."""
    shapes, layers = _sized(size_mb, dim, ffn_dim)
    tmp = tempfile.mkdtemp(prefix="convert_memory_", dir=workdir)
    try:
        src = os.path.join(tmp, "diffusion_pytorch_model.safetensors")
        _generate(src, dim, ffn_dim, layers)
        cli = [sys.executable, "-m", "jaxkv.convert.cli"]
        common = ["--num-heads", str(heads), "--no-progress"]
        rows = {}
        if safetensors:
            rows["dry-run"] = measure(cli + [src, "--dry-run"] + common)
            rows["convert"] = measure(cli + [src, os.path.join(tmp, "out"), "--dtype", "bf16"] + common)
        rows["load-all"] = measure(
            [sys.executable, "-c", f"from safetensors.numpy import load_file; load_file({src!r})"]
        )
        if pt:
            src_pt = os.path.join(tmp, "self_forcing.pt")
            _generate(src_pt, dim, ffn_dim, layers)
            os.remove(src)
            rows["dry-run-pt"] = measure(cli + [src_pt, "--dry-run"] + common)
            rows["convert-pt"] = measure(cli + [src_pt, os.path.join(tmp, "out_pt"), "--dtype", "bf16"] + common)
        largest = max(int(np.prod(s)) * 4 for s in shapes.values())
        return {
            "checkpoint_bytes": sum(int(np.prod(s)) * 4 for s in shapes.values()),
            "largest_tensor_bytes": largest,
            "layers": layers,
            "dim": dim,
            "ffn_dim": ffn_dim,
            "rows": rows,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_LOAD = """
import sys, jax, jax.numpy as jnp
from jaxkv.models.wan import checkpoint
path, dtype = sys.argv[1], sys.argv[2]
if path == "-":
    jax.block_until_ready(jnp.zeros(1))
else:
    _, params = checkpoint.load(path, dtype=None if dtype == "stored" else jnp.dtype(dtype))
    jax.block_until_ready(params)
"""


def run_load(size_mb: float, dim: int = 1024, ffn_dim: int = 4096, heads: int = 8, workdir: str | None = None) -> dict:
    """Peak RSS of `wan.load` on float32 / bfloat16 checkpoints of about ``size_mb`` (float32) MiB."""
    shapes, layers = _sized(size_mb, dim, ffn_dim)
    tmp = tempfile.mkdtemp(prefix="load_memory_", dir=workdir)
    try:
        src = os.path.join(tmp, "diffusion_pytorch_model.safetensors")
        _generate(src, dim, ffn_dim, layers)
        cks = {}
        for dtype in ("f32", "bf16"):
            cks[dtype] = os.path.join(tmp, f"ck_{dtype}")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "jaxkv.convert.cli",
                    src,
                    cks[dtype],
                    "--dtype",
                    dtype,
                    "--num-heads",
                    str(heads),
                    "--no-progress",
                ],
                check=True,
                cwd=ROOT,
                stderr=subprocess.DEVNULL,
            )
        os.remove(src)
        load = [sys.executable, "-c", _LOAD]
        rows = {
            "load-baseline": measure(load + ["-", "stored"]),
            "load-f32-as-bf16": measure(load + [cks["f32"], "bfloat16"]),
            "load-f32": measure(load + [cks["f32"], "stored"]),
            "load-bf16": measure(load + [cks["bf16"], "stored"]),
        }
        f32 = sum(int(np.prod(s)) * 4 for s in shapes.values())
        return {
            "weights_f32_bytes": f32,
            "weights_bf16_bytes": f32 // 2,
            "largest_tensor_f32_bytes": _largest_stacked(shapes, layers),
            "layers": layers,
            "dim": dim,
            "ffn_dim": ffn_dim,
            "rows": rows,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sized(size_mb: float, dim: int, ffn_dim: int):
    per_layer = sum(int(np.prod(s)) * 4 for k, s in synthetic_shapes(dim, ffn_dim, 1).items() if k.startswith("b"))
    top = sum(int(np.prod(s)) * 4 for k, s in synthetic_shapes(dim, ffn_dim, 0).items())
    layers = max(1, round((size_mb * 2**20 - top) / per_layer))
    return synthetic_shapes(dim, ffn_dim, layers), layers


def _largest_stacked(shapes, layers: int) -> int:
    """Bytes (float32) of the largest jaxkv parameter: block tensors are stacked over the layers."""
    per_key = {}
    for k, s in shapes.items():
        name = k.split(".", 2)[2] if k.startswith("blocks.") else k
        per_key[name] = per_key.get(name, 0) + int(np.prod(s)) * 4
    return max(per_key.values())


def _print_load(result) -> None:
    mib = lambda b: f"{b / 2**20:8.1f}"
    print(
        f"weights: {mib(result['weights_f32_bytes'])} MiB float32 = {mib(result['weights_bf16_bytes'])} MiB "
        f"bfloat16 ({result['layers']} layers, dim {result['dim']}, ffn {result['ffn_dim']}); largest stacked "
        f"parameter {mib(result['largest_tensor_f32_bytes'])} MiB float32"
    )
    rows = result["rows"]
    base = rows["load-baseline"]["peak_rss"]
    print(f"{'run':<18}{'wall s':>8}{'peak RSS MiB':>14}{'- baseline MiB':>16}{'/ result size':>15}")
    for name, r in rows.items():
        size = {"load-f32": result["weights_f32_bytes"]}.get(name, result["weights_bf16_bytes"])
        extra = r["peak_rss"] - base
        ratio = f"{extra / size:15.2f}" if name != "load-baseline" else f"{'':15}"
        print(f"{name:<18}{r['wall_s']:8.1f}{mib(r['peak_rss']):>14}{mib(extra):>16}{ratio}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=float, default=600, help="synthetic checkpoint size (float32), MiB")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn-dim", type=int, default=4096)
    p.add_argument("--pt", action="store_true", help="also convert the same weights saved as a .pt (needs torch)")
    p.add_argument("--load", action="store_true", help="measure wan.load instead of the conversion")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--generate", metavar="PATH", help=argparse.SUPPRESS)  # internal: write one synthetic file
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.generate:
        shapes = synthetic_shapes(args.dim, args.ffn_dim, args.layers)
        (write_synthetic_pt if args.generate.endswith(".pt") else write_synthetic)(args.generate, shapes)
        return 0
    if args.load:
        result = run_load(args.size_mb, args.dim, args.ffn_dim)
        _print_load(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    result = run(args.size_mb, args.dim, args.ffn_dim, pt=args.pt)
    mib = lambda b: f"{b / 2**20:8.1f}"
    print(
        f"checkpoint: {mib(result['checkpoint_bytes'])} MiB float32 ({result['layers']} layers, dim "
        f"{result['dim']}, ffn {result['ffn_dim']}); largest tensor {mib(result['largest_tensor_bytes'])} MiB"
    )
    print(f"{'run':<12}{'wall s':>8}{'peak RSS MiB':>14}{'peak anon MiB':>15}{'peak file MiB':>15}")
    for name, r in result["rows"].items():
        print(f"{name:<12}{r['wall_s']:8.1f}{mib(r['peak_rss']):>14}{mib(r['peak_anon']):>15}{mib(r['peak_file']):>15}")
    extra = result["rows"]["convert"]["peak_rss"] - result["rows"]["dry-run"]["peak_rss"]
    print(
        f"convert - dry-run peak RSS: {extra / 2**20:.1f} MiB = {extra / result['checkpoint_bytes']:.3f} x "
        f"checkpoint, {extra / result['largest_tensor_bytes']:.2f} x largest tensor"
    )
    if "convert-pt" in result["rows"]:
        extra = result["rows"]["convert-pt"]["peak_rss"] - result["rows"]["dry-run-pt"]["peak_rss"]
        print(
            f"convert-pt - dry-run-pt peak RSS: {extra / 2**20:.1f} MiB = {extra / result['checkpoint_bytes']:.3f} x "
            f"checkpoint, {extra / result['largest_tensor_bytes']:.2f} x largest tensor"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
