"""``jaxkv convert SRC DST``: a Wan 2.1 PyTorch / safetensors checkpoint (DiT, VAE, umT5 text encoder, or a whole
release) -> a jaxkv checkpoint directory."""

from __future__ import annotations

import argparse
import sys

from jaxkv.argparsing import Parser

_EPILOG = """\
SRC may be:
  a directory or .safetensors file in the original Wan 2.1 layout (diffusion_pytorch_model.safetensors, or shards
    with a *.safetensors.index.json), e.g. a download of Wan-AI/Wan2.1-T2V-1.3B;
  a diffusers WanTransformer3DModel directory (config.json + safetensors; a pipeline root is entered at
    transformer/), e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers;
  a Self-Forcing / CausVid training checkpoint (.pt with generator_ema / generator / model entries), read with
    torch.load(weights_only=True); needs torch.
  a Wan VAE: Wan2.1_VAE.pth, or a diffusers AutoencoderKLWan directory (vae/ of a pipeline);
  a umT5 text encoder: models_t5_umt5-xxl-enc-bf16.pth (tokenizer beside it, e.g. google/umt5-xxl/), or a
    Hugging Face UMT5EncoderModel directory (text_encoder/ of a pipeline);
  a whole Wan release: a directory holding the DiT weights + Wan2.1_VAE.pth + models_t5*.pth + the tokenizer
    folder, or a diffusers pipeline root with transformer/, vae/, text_encoder/, tokenizer/. It becomes
    DST/dit/, DST/vae/ and DST/text_encoder/, written as one unit.
The family is detected from the key names (--family forces one; given a release directory it converts that part
alone). The format and the DiT config are detected; the head count comes from a config.json beside the weights
or a matching preset, else pass --num-heads or --preset.

DST is a directory (config.json + params.safetensors) for `jaxkv generate --checkpoint DST` and
jaxkv.models.wan.checkpoint.load(DST). It is built beside DST in a hidden .DST.tmp-* directory and renamed into
place when complete; an error, Ctrl-C, SIGTERM or SIGHUP leaves nothing behind, and a leftover of a killed run is
removed by the next conversion into DST. --force replaces only a jaxkv checkpoint directory of the same family
(for a release: a directory of exactly dit/, vae/, text_encoder/, each one of ours), or an empty one;
DST may never be, contain or lie inside SRC.
"""


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="jaxkv convert",
        epilog=_EPILOG,
        description="Convert a Wan 2.1 PyTorch / safetensors checkpoint (DiT, VAE, umT5 text "
        "encoder, or a whole release) to a jaxkv checkpoint directory.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="checkpoint file or directory to convert")
    p.add_argument("dst", metavar="DST", nargs="?", help="output directory (must not exist unless --force)")
    p.add_argument(
        "--family",
        choices=("dit", "vae", "umt5"),
        help="convert SRC as this model family instead of detecting it (in a release directory: that part alone)",
    )
    p.add_argument(
        "--dtype", choices=("bf16", "f32"), default="bf16", help="output dtype of every part (default: bf16)"
    )
    ema = p.add_mutually_exclusive_group()
    ema.add_argument(
        "--ema",
        dest="ema",
        action="store_true",
        default=None,
        help="training checkpoints: convert generator_ema (the default when present)",
    )
    ema.add_argument(
        "--no-ema",
        dest="ema",
        action="store_false",
        help="training checkpoints: convert generator (or model) instead of generator_ema",
    )
    cfg = p.add_mutually_exclusive_group()
    cfg.add_argument(
        "--preset", help="check the checkpoint against this WanConfig preset (wan2.1-t2v-1.3b, wan2.1-t2v-14b, tiny)"
    )
    cfg.add_argument("--config", metavar="JSON", help="a JSON file of WanConfig fields to check against")
    p.add_argument("--num-heads", type=int, help="attention heads (tensors cannot show them)")
    p.add_argument(
        "--text-len",
        type=int,
        help="text tokens the model was trained with (tensors cannot show it and "
        "diffusers configs do not store it; default: the matching preset's)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="umT5: the tokenizer.json / spiece.model (or its folder) to use instead of the one found "
        "beside the weights",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing DST, only if it is a jaxkv checkpoint directory (config.json + "
        "params.safetensors and nothing else), and only once the new one is complete",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="convert tensors holding NaN/Inf (listed in the summary) instead of refusing",
    )
    p.add_argument("--dry-run", action="store_true", help="check and report; write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.dst is None and not args.dry_run:
        _parser().error("DST is required (or pass --dry-run)")
    from jaxkv import files

    # SIGTERM / SIGHUP clean up like Ctrl-C: the temporary directory goes, one line, exit 128 + signal.
    with files.signals_as_exceptions():
        try:
            return _run(args)
        except KeyboardInterrupt:
            _say("jaxkv convert: interrupted; nothing was written")
            return 130
        except files.Terminated as e:
            _say(f"jaxkv convert: {e}; nothing was written")
            return e.exit_code


def _run(args) -> int:
    """Every family through one path: destination checked first, plan from headers, report, atomic write; the
    same messages and exit codes (0 written or dry run, 1 for any conversion or file problem)."""
    from jaxkv.convert import release
    from jaxkv.convert.errors import ConversionError
    from jaxkv.convert.stream import describe_nonfinite

    def fail(message: str) -> int:
        _say(f"jaxkv convert: error: {message}")
        return 1

    try:
        family = args.family or release.detect_family(args.src)
    except ConversionError as e:
        return fail(str(e))
    if family == "dit" and args.tokenizer is not None:
        return fail(f"--tokenizer applies to a umT5 text encoder; {args.src} is a DiT")
    # A forced DiT is read from its part of a release (the others resolve inside `plan_family`).
    src = release.resolve(args.src, "dit") if family == "dit" and args.family else args.src
    options = dict(
        tokenizer=args.tokenizer,
        preset=args.preset,
        config=args.config,
        num_heads=args.num_heads,
        text_len=args.text_len,
        ema=args.ema,
    )
    try:
        if args.dst is not None and not args.dry_run:
            release.check_output(src, args.dst, family, force=args.force)
        if family == "release":
            plan = release.plan_release(src, **options)
            parts = plan.plans
        else:
            plan = release.plan_family(family, src, **options)
            parts = {family: plan}
    except ConversionError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot read {src} ({e})")
    try:
        if family == "release":
            _say(
                f"source: Wan release directory {src} ({plan.layout} layout) -> "
                + ", ".join(f"{release.RELEASE_PARTS[f]}/" for f in parts)
            )
        for line in _describe_dit(plan) if family == "dit" else [_describe(f, p) for f, p in parts.items()]:
            _say(line)
        if args.dry_run:
            _say("dry run: nothing written (tensor values are not read, so NaN/Inf are not checked)")
            return 0
        kw = dict(
            dtype=args.dtype,
            force=args.force,
            progress=not args.no_progress,
            allow_nonfinite=args.allow_nonfinite,
            log=_say,
        )
        try:
            if family == "release":
                results = release.write_release(plan, args.dst, **kw)
            else:
                results = {family: release.write_family(family, plan, args.dst, **kw)}
        except ConversionError as e:
            return fail(str(e))
        except OSError as e:
            return fail(f"writing {args.dst} failed, nothing was written ({e})")
    finally:
        for part in parts.values():
            part.source.close()
    # In a release, say which part a non-finite tensor is in.
    nonfinite = [
        f"{release.RELEASE_PARTS[f]}/{line}" if family == "release" else line
        for f, result in results.items()
        for line in result.nonfinite
    ]
    if nonfinite:
        _say("warning: " + describe_nonfinite(nonfinite))
    size = sum(result.params_bytes for result in results.values())
    _say(f"wrote {args.dst} ({size / 2**20:.1f} MiB of {args.dtype} params)")
    return 0


def _describe_dit(plan) -> list[str]:
    """What a single DiT conversion reports: the source, the full config, and any value that was defaulted."""
    c = plan.config
    entry = getattr(plan.source, "entry", None)
    lines = [
        f"source: {plan.source.description}, {plan.naming} naming, {len(plan.source.shapes)} tensors"
        + (f", using entry {entry!r}" if entry else ""),
        f"config: dim {c.dim}, ffn_dim {c.ffn_dim}, {c.num_heads} heads, {c.num_layers} layers, patch "
        f"{list(c.patch_size)}, in/out {c.in_dim}/{c.out_dim}, text_dim {c.text_dim}, text_len {c.text_len} "
        f"({plan.config_origin})",
    ]
    if plan.defaulted:
        hint = (
            " (set it with --text-len N if the model was trained with another)" if "text_len" in plan.defaulted else ""
        )
        lines.append(
            "defaulted (not stored in the checkpoint): "
            + ", ".join(f"{field} {getattr(c, field)} from the {origin}" for field, origin in plan.defaulted.items())
            + hint
        )
    return lines


def _describe(family: str, plan) -> str:
    """One line per part of a release, or for a single VAE / umT5 conversion."""
    if family == "vae":
        c = plan.config
        return (
            f"vae: {plan.source.description}, {plan.naming} naming, {len(plan.items)} tensors; base_dim "
            f"{c.base_dim}, z_dim {c.z_dim}, dim_mult {list(c.dim_mult)}"
        )
    if family == "umt5":
        c = plan.config
        skipped = f", skipping {len(plan.skipped)} ({', '.join(plan.skipped[:4])})" if plan.skipped else ""
        return (
            f"text encoder: {plan.source.description}, {plan.layout} layout, {plan.num_tensors} tensors"
            f"{skipped}; dim {c.dim}, {c.num_layers} layers, {c.num_heads} heads, vocab {c.vocab_size} "
            f"({plan.config_origin}); tokenizer {plan.tokenizer_origin}"
        )
    c = plan.config
    return (
        f"dit: {plan.source.description}, {plan.naming} naming, {plan.num_tensors} tensors; dim {c.dim}, "
        f"{c.num_heads} heads, {c.num_layers} layers, text_len {c.text_len} ({plan.config_origin})"
    )


if __name__ == "__main__":
    sys.exit(main())
