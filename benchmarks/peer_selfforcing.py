"""jaxkv's streaming rollout against Self-Forcing's own PyTorch pipeline, same weights, noise and context, interleaved.

Self-Forcing is imported at run time from a checkout the user points to (``SF_SRC=/path/to/Self-Forcing``); nothing
of it is copied here. Its causal Wan (``wan.modules.causal_model.CausalWanModel``), its diffusion wrapper and
scheduler (``utils.wan_wrapper``, ``utils.scheduler``) and its ``CausalInferencePipeline`` (state: KV and
cross-attention caches, warped denoising steps) run unmodified, except for what a CPU run needs, patched in memory:

* the umT5 text encoder, the VAE and the tokenizer are stubbed (the context is passed as embeddings; no decode);
* its attention (flash-attn, CUDA only; its SDPA fallback casts to bf16) is replaced by float32
  ``torch.nn.functional.scaled_dot_product_attention`` on the same tensors;
* ``CausalWanModel.from_pretrained`` builds the benchmark's model with random weights (every parameter re-drawn,
  so none is zero), and the pipeline's caches are sized for it (its code hard-codes 30 layers, 12 x 128 heads and
  1,560 tokens per frame).

Per chunk, the Self-Forcing side runs the body of ``CausalInferencePipeline.inference`` (its steps 3.1-3.3: four
denoising passes with re-noising by ``scheduler.add_noise``, then the context pass at ``context_noise``) with the
eps drawn here instead of ``torch.randn_like``. jaxkv runs `jaxkv.stream.Stream` (one jitted, cache-donating step
per chunk) on the weights converted from the PyTorch model's state dict by this repo's converters. Chunks alternate
(torch, jaxkv, torch, ...) in this one process; every chunk's latents are compared (float32), and the table shows the
median ms per chunk of the timed chunks (after both caches have filled and wrapped) and torch / jaxkv (> 1: jaxkv is
faster).

Model (the issue's medium Wan): dim 256, 2 heads of 128, 4 layers, ffn 1024, text 512 x 256, 16 latent channels,
latent frames 20 x 26 (130 tokens), 3-frame chunks; rows: a 6-frame window; 21 frames with a 3-frame sink; 42 frames.

    SF_SRC=/path/to/Self-Forcing python benchmarks/peer_selfforcing.py [--timed N] [--rows a,b,c]
        [--backends auto,xla_dense] [--torch-threads N] [--json PATH]

On a shared, loaded machine pin the process and give torch one thread (`taskset -c 1 ... --torch-threads 1`):
torch's OpenMP threads busy-wait and lose several-fold to oversubscription (measured: 3.6 s/chunk at 1 thread vs
16-22 s at 2 threads with a load average of 12 on 2 cores), which would flatter jaxkv.

Without SF_SRC it says so, times the jaxkv half alone (random weights) and exits 0.

``--torch-only`` times Self-Forcing's pipeline alone (no jaxkv stream, no comparison). ``--device cuda`` does that on
the GPU at the shapes of `benchmarks/gpu_check.py` (which runs the jaxkv side in its own process and takes the
ratio): Wan 2.1 1.3B with random weights in bfloat16, 480x832 (60 x 104 latents, 1,560 tokens per frame), 3-frame
chunks, local_attn_size 21 frames with a 3-frame sink, the pipeline's own attention (flash-attn when installed, else
its SDPA fallback), CUDA-synchronised ms per chunk after the cache has filled and wrapped, and the peak of
``torch.cuda.max_memory_allocated``:

    SF_SRC=/path/to/Self-Forcing python benchmarks/peer_selfforcing.py --device cuda [--timed N] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import rollout as R
from jaxkv.models.wan import checkpoint
from jaxkv.models.wan import model as M
from jaxkv.models.wan.config import WanConfig, preset
from jaxkv.stream import Stream

CONFIG = WanConfig(
    dim=256, ffn_dim=1024, num_heads=2, num_layers=4, in_dim=16, out_dim=16, text_dim=256, text_len=512, freq_dim=256
)
LATENT_HW = (20, 26)  # 10 x 13 patches = 130 tokens per frame
CHUNK_FRAMES = 3
# name -> (Self-Forcing local_attn_size frames, sink_size frames)
ROWS = {"window6": (6, 0), "sink3_window21": (21, 3), "window42": (42, 0)}
STEPS = (1000, 750, 500, 250)
# --device cuda: gpu_check.py's shapes (Wan 1.3B, 480x832, local_attn_size 21 frames with a 3-frame sink), bf16
GPU_CONFIG = preset("wan2.1-t2v-1.3b")
GPU_LATENT_HW = (60, 104)
GPU_ROW = (21, 3)


# ------------------------------------------------------------------------------------------------ Self-Forcing


def _stub(name: str, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _package(name: str, path: str):
    """A package shell whose __init__ is not run (Self-Forcing's pull in the text encoder, VAE, CUDA helpers)."""
    return _stub(name, __path__=[path])


def _unavailable(what: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is stubbed out in this benchmark")

    return fail


@functools.lru_cache(maxsize=None)
def import_self_forcing(src: str, device: str = "cpu"):
    """Imports Self-Forcing's causal model, wrapper and pipeline from the checkout at `src`, patched for a run on
    ``device`` (on "cpu" its attention is replaced by float32 SDPA; on "cuda" it keeps its own).
    Returns (CausalWanModel class, WanDiffusionWrapper class, CausalInferencePipeline class)."""
    import torch

    if not os.path.isfile(os.path.join(src, "wan", "modules", "causal_model.py")):
        raise SystemExit(f"SF_SRC={src!r} is not a Self-Forcing checkout (no wan/modules/causal_model.py)")
    sys.path.insert(0, src)
    try:
        import einops  # noqa: F401
    except ModuleNotFoundError:  # used only by the GAN register-token path, never here
        _stub("einops", repeat=_unavailable("einops.repeat"), rearrange=_unavailable("einops.rearrange"))
    _package("wan", os.path.join(src, "wan"))
    _package("wan.modules", os.path.join(src, "wan", "modules"))
    _package("pipeline", os.path.join(src, "pipeline"))
    _stub("wan.modules.t5", umt5_xxl=_unavailable("umT5"))
    _stub("wan.modules.vae", _video_vae=_unavailable("the Wan VAE"))
    _stub("wan.modules.tokenizers", HuggingfaceTokenizer=_unavailable("the tokenizer"))
    _stub("demo_utils", __path__=[])
    _stub(
        "demo_utils.memory",
        gpu=torch.device(device),
        get_cuda_free_memory_gb=_unavailable("CUDA memory"),
        DynamicSwapInstaller=None,
        move_model_to_device_with_memory_preservation=_unavailable("offloading"),
    )

    from pipeline.causal_inference import CausalInferencePipeline
    from utils import wan_wrapper
    from wan.modules import causal_model
    from wan.modules import model as wan_model

    def sdpa(q, k, v, q_lens=None, k_lens=None):
        # [B, L, H, D] in and out, float32 throughout (Self-Forcing's own fallback casts q, k, v to bf16). Its
        # causal inference passes no lengths (every cached key and every text token is attended).
        if q_lens is not None or k_lens is not None:
            raise NotImplementedError("the benchmark's attention stand-in takes no q_lens/k_lens")
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).contiguous()

    if device == "cpu":
        causal_model.attention = sdpa  # self-attention over the KV cache
        wan_model.flash_attention = sdpa  # cross-attention (WanT2VCrossAttention)
    else:
        from wan.modules import attention as sf_attention

        if not (sf_attention.FLASH_ATTN_2_AVAILABLE or sf_attention.FLASH_ATTN_3_AVAILABLE):
            # its cross-attention calls flash-attn directly (an assert without it); route it through the pipeline's
            # own fallback, the SDPA path its self-attention already takes without flash-attn
            wan_model.flash_attention = sf_attention.attention
    return causal_model.CausalWanModel, wan_wrapper, CausalInferencePipeline


def build_self_forcing(
    src: str,
    local_attn_size: int,
    sink_size: int,
    seed: int = 0,
    *,
    config: WanConfig = CONFIG,
    latent_hw=LATENT_HW,
    device: str = "cpu",
    dtype=None,
):
    """Self-Forcing's pipeline around ``config`` with random weights, built on ``device`` (in ``dtype`` when given).
    Returns (pipeline, state_dict)."""
    import torch

    CausalWanModel, wan_wrapper, CausalInferencePipeline = import_self_forcing(src, device)
    c = config

    def from_pretrained(path, local_attn_size=-1, sink_size=0):
        torch.manual_seed(seed)
        with torch.device(device):
            model = _causal_wan(CausalWanModel, c, local_attn_size, sink_size)
        with torch.no_grad():  # Wan zero-initialises some outputs; re-draw everything so every weight matters
            for name, p in model.named_parameters():
                if p.ndim >= 2 and "modulation" not in name:
                    p.copy_(torch.randn_like(p) / float(np.prod(p.shape[1:])) ** 0.5)
                elif "norm" in name and name.endswith("weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                elif "modulation" in name:
                    p.copy_(torch.randn_like(p) / c.dim**0.5)
                else:
                    p.copy_(0.02 * torch.randn_like(p))
        return model if dtype is None else model.to(dtype)

    wan_wrapper.CausalWanModel = types.SimpleNamespace(from_pretrained=from_pretrained)
    generator = wan_wrapper.WanDiffusionWrapper(
        timestep_shift=5.0, is_causal=True, local_attn_size=local_attn_size, sink_size=sink_size
    )
    args = types.SimpleNamespace(
        denoising_step_list=list(STEPS),
        warp_denoising_step=True,
        num_frame_per_block=3,
        independent_first_frame=False,
        context_noise=0,
    )
    pipe = CausalInferencePipeline(args, device=device, generator=generator, text_encoder=object(), vae=object())
    pipe.num_transformer_blocks = c.num_layers
    pipe.frame_seq_length = latent_hw[0] * latent_hw[1] // 4
    return pipe, generator.model.state_dict()


def _causal_wan(CausalWanModel, c: WanConfig, local_attn_size: int, sink_size: int):
    return CausalWanModel(
        model_type="t2v",
        patch_size=c.patch_size,
        text_len=c.text_len,
        in_dim=c.in_dim,
        dim=c.dim,
        ffn_dim=c.ffn_dim,
        freq_dim=c.freq_dim,
        text_dim=c.text_dim,
        out_dim=c.out_dim,
        num_heads=c.num_heads,
        num_layers=c.num_layers,
        local_attn_size=local_attn_size,
        sink_size=sink_size,
        eps=c.eps,
    )


def reset_self_forcing(pipe, batch: int, config: WanConfig = CONFIG, device: str = "cpu", dtype=None):
    """The pipeline's KV and cross-attention caches, sized for ``config`` (its own initialisers hard-code Wan 1.3B's
    12 x 128 heads), on ``device`` in ``dtype`` (default float32)."""
    import torch

    c, size = config, pipe.local_attn_size * pipe.frame_seq_length
    zeros = lambda n: torch.zeros([batch, n, c.num_heads, c.head_dim], dtype=dtype or torch.float32, device=device)
    pipe.kv_cache1 = [
        {
            "k": zeros(size),
            "v": zeros(size),
            "global_end_index": torch.tensor([0], device=device),
            "local_end_index": torch.tensor([0], device=device),
        }
        for _ in range(c.num_layers)
    ]
    pipe.crossattn_cache = [
        {"k": zeros(c.text_len), "v": zeros(c.text_len), "is_init": False} for _ in range(c.num_layers)
    ]


def self_forcing_chunk(pipe, cond: dict, noise, start_frame: int):
    """One chunk as ``CausalInferencePipeline.inference`` computes it (steps 3.1-3.3), with explicit eps.

    noise: torch [steps, batch, frames, channels, h, w]: noise[0] the initial input, noise[i] the eps of step i.
    Returns the denoised chunk [batch, frames, channels, h, w].
    """
    import torch

    b, f = noise.shape[1:3]
    steps = pipe.denoising_step_list
    x = noise[0]
    start = start_frame * pipe.frame_seq_length
    with torch.no_grad():
        for i, t in enumerate(steps):
            timestep = torch.ones([b, f], dtype=torch.int64, device=x.device) * t
            _, x0 = pipe.generator(
                noisy_image_or_video=x,
                conditional_dict=cond,
                timestep=timestep,
                kv_cache=pipe.kv_cache1,
                crossattn_cache=pipe.crossattn_cache,
                current_start=start,
            )
            if i < len(steps) - 1:
                x = pipe.scheduler.add_noise(
                    x0.flatten(0, 1),
                    noise[i + 1].flatten(0, 1),
                    steps[i + 1] * torch.ones([b * f], dtype=torch.long, device=x.device),
                ).unflatten(0, x0.shape[:2])
        pipe.generator(
            noisy_image_or_video=x0,
            conditional_dict=cond,
            timestep=torch.ones_like(timestep) * pipe.args.context_noise,
            kv_cache=pipe.kv_cache1,
            crossattn_cache=pipe.crossattn_cache,
            current_start=start,
        )
    return x0


def convert_state_dict(state_dict) -> dict:
    """The PyTorch model's weights through this repo's converter (original Wan layout, safetensors) -> params."""
    from safetensors.torch import save_file

    from jaxkv.convert.convert import convert_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "wan"))
        save_file(
            {k: v.contiguous() for k, v in state_dict.items()},
            os.path.join(tmp, "wan", "diffusion_pytorch_model.safetensors"),
        )
        convert_checkpoint(os.path.join(tmp, "wan"), os.path.join(tmp, "out"), config=CONFIG, dtype="f32")
        config, params = checkpoint.load(os.path.join(tmp, "out"))
    if config != CONFIG:
        raise AssertionError(f"converted config {config} != {CONFIG}")
    return params


# ------------------------------------------------------------------------------------------------ the benchmark


def rollout_config(local_attn_size: int, sink_size: int, backend: str) -> R.RolloutConfig:
    # Self-Forcing's local_attn_size counts the sink; jaxkv's window does not (DESIGN.md, cache semantics).
    return R.RolloutConfig(
        latent_height=LATENT_HW[0],
        latent_width=LATENT_HW[1],
        chunk_frames=CHUNK_FRAMES,
        window_frames=local_attn_size - sink_size,
        sink_frames=sink_size,
        backend=backend,
    )


def run_row(name: str, sf_src: str | None, timed: int, backends: tuple[str, ...], seed: int = 0) -> dict:
    local, sink = ROWS[name]
    capacity_chunks = local // CHUNK_FRAMES
    num_chunks = capacity_chunks + 1 + timed  # fill, wrap once, then time
    rng = np.random.default_rng(seed)
    h, w = LATENT_HW
    noise = rng.standard_normal((num_chunks, len(STEPS), 1, CHUNK_FRAMES, h, w, CONFIG.in_dim), np.float32)
    context = rng.standard_normal((1, CONFIG.text_len, CONFIG.text_dim), np.float32)

    pipe = None
    if sf_src:
        import torch

        pipe, state_dict = build_self_forcing(sf_src, local, sink, seed)
        params = convert_state_dict(state_dict)
        reset_self_forcing(pipe, 1)
        cond = {"prompt_embeds": torch.from_numpy(context)}
        sf_noise = torch.from_numpy(np.ascontiguousarray(np.moveaxis(noise, -1, 4)))  # [..., F, C, H, W]
    else:
        params = M.init_params(CONFIG, jax.random.key(seed))

    streams = {
        b: Stream(params, CONFIG, rollout_config(local, sink, b), jnp.asarray(context), noise=jnp.asarray(noise))
        for b in backends
    }
    times = {k: [] for k in (["torch"] if pipe is not None else []) + list(backends)}
    max_diff, max_between = 0.0, 0.0
    for n in range(num_chunks):
        outs = {}
        if pipe is not None:
            t0 = time.perf_counter()
            sf_out = self_forcing_chunk(pipe, cond, sf_noise[n], n * CHUNK_FRAMES)
            times["torch"].append(time.perf_counter() - t0)
        for b, stream in streams.items():
            t0 = time.perf_counter()
            outs[b] = np.asarray(jax.block_until_ready(next(stream)))
            times[b].append(time.perf_counter() - t0)
        first = outs[backends[0]]
        for b in backends[1:]:
            max_between = max(max_between, float(np.abs(outs[b] - first).max()))
        if pipe is not None:
            want = np.moveaxis(sf_out.numpy(), 2, -1)
            max_diff = max(max_diff, max(float(np.abs(o - want).max()) for o in outs.values()))
    skip = capacity_chunks + 1
    row = {
        "row": name,
        "local_attn_frames": local,
        "sink_frames": sink,
        "keys": local * h * w // 4,
        "chunks": num_chunks,
        "timed_chunks": timed,
    }
    for k, t in times.items():
        row[f"{k}_ms"] = statistics.median(t[skip:]) * 1e3
    for b in backends:
        if pipe is not None:
            row[f"torch/{b}"] = row["torch_ms"] / row[f"{b}_ms"]
    row["max_abs_diff_vs_torch"] = max_diff if pipe is not None else None
    row["max_abs_diff_between_backends"] = max_between if len(backends) > 1 else None
    row["compiles"] = {b: R.stream_step._cache_size() for b in backends[:1]}
    return row


def run_torch_only(sf_src: str, device: str, timed: int, seed: int = 0) -> dict:
    """Self-Forcing's pipeline alone on ``device``: on "cuda" at `GPU_CONFIG` / `GPU_LATENT_HW` / `GPU_ROW` in
    bfloat16, on "cpu" at the medium model's window6 row in float32 (the dry run of the GPU command). ms per chunk
    (median of ``timed`` chunks after fill + wrap, synchronised), peak device memory on CUDA."""
    import torch

    torch.set_grad_enabled(False)
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    config, hw, (local, sink) = (GPU_CONFIG, GPU_LATENT_HW, GPU_ROW) if cuda else (CONFIG, LATENT_HW, ROWS["window6"])
    dtype = torch.bfloat16 if cuda else torch.float32
    pipe, _ = build_self_forcing(sf_src, local, sink, seed, config=config, latent_hw=hw, device=device, dtype=dtype)
    reset_self_forcing(pipe, 1, config, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    cond = {
        "prompt_embeds": torch.randn([1, config.text_len, config.text_dim], generator=gen, device=device, dtype=dtype)
    }
    shape = (len(STEPS), 1, CHUNK_FRAMES, config.in_dim, *hw)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    fill = local // CHUNK_FRAMES + 1
    times = []
    for n in range(fill + timed):
        noise = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        sync()
        t0 = time.perf_counter()
        out = self_forcing_chunk(pipe, cond, noise, n * CHUNK_FRAMES)
        sync()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times[fill:]) * 1e3
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor(),
        "torch": torch.__version__,
        "self_forcing": sf_src,
        "config": dataclasses.asdict(config),
        "latent_hw": list(hw),
        "local_attn_frames": local,
        "sink_frames": sink,
        "dtype": str(dtype),
        "first_chunk_s": times[0],
        "torch_ms": ms,
        "video_fps": 12 / (ms / 1e3),
        "timed_chunks": timed,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "finite": bool(torch.isfinite(out).all()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timed", type=int, default=5, help="timed chunks per row (after fill + wrap)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {list(ROWS)}")
    parser.add_argument("--backends", default="auto", help="jaxkv attention backends to run side by side")
    parser.add_argument("--tol", type=float, default=1e-4, help="max |jaxkv - torch| allowed on the latents")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch intra-op threads (default: the CPUs this process may use; on a loaded "
        "machine torch's OpenMP threads spin against other processes, so compare pinned, "
        "e.g. `taskset -c 1 ... --torch-threads 1`)",
    )
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: Self-Forcing alone on the GPU")
    parser.add_argument("--torch-only", action="store_true", help="time Self-Forcing's pipeline alone (needs SF_SRC)")
    args = parser.parse_args(argv)
    if args.device == "cuda" or args.torch_only:
        sf_src = os.environ.get("SF_SRC")
        if not sf_src:
            print("--device cuda / --torch-only time Self-Forcing's own pipeline: set SF_SRC to its checkout")
            return 2
        result = run_torch_only(sf_src, args.device, args.timed)
        print(json.dumps(result, indent=1, default=str))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
        return 0
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    backends = tuple(args.backends.split(","))
    sf_src = os.environ.get("SF_SRC")
    if not sf_src:
        print(
            "SF_SRC is not set: no Self-Forcing checkout to compare against; timing the jaxkv half alone "
            "(random weights). Point SF_SRC at a checkout of github.com/guandeh17/Self-Forcing for the comparison."
        )
    else:
        import torch

        torch.set_grad_enabled(False)
        torch.set_num_threads(args.torch_threads)
    load = os.getloadavg()
    results = [run_row(r, sf_src, args.timed, backends) for r in rows]
    cols = (
        (["torch_ms"] if sf_src else [])
        + [f"{b}_ms" for b in backends]
        + ([f"torch/{b}" for b in backends] if sf_src else [])
    )
    print(f"\n{'row':<16}{'keys':>6}" + "".join(f"{c:>18}" for c in cols) + f"{'max|diff|':>12}")
    for row in results:
        diff = row["max_abs_diff_vs_torch"]
        print(
            f"{row['row']:<16}{row['keys']:>6}"
            + "".join(f"{row[c]:>18.2f}" for c in cols)
            + (f"{diff:>12.2e}" if diff is not None else f"{'-':>12}")
        )
    meta = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "jax": jax.__version__,
        "loadavg_before": load,
        "loadavg_after": os.getloadavg(),
        "config": CONFIG.__dict__ | {},
        "latent_hw": LATENT_HW,
        "chunk_frames": CHUNK_FRAMES,
        "self_forcing": sf_src,
    }
    if sf_src:
        import torch

        meta["torch"] = torch.__version__
        meta["torch_threads"] = torch.get_num_threads()
    print(f"load average before/after: {load} / {meta['loadavg_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1, default=str)
    bad = [
        r["row"] for r in results if r["max_abs_diff_vs_torch"] is not None and r["max_abs_diff_vs_torch"] > args.tol
    ]
    if bad:
        print(f"outputs disagree beyond --tol {args.tol} on rows {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
