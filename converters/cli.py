"""``jaxkv convert SRC DST``: a Wan 2.1 PyTorch / safetensors checkpoint -> a jaxkv checkpoint directory."""

from __future__ import annotations

import argparse
import os
import sys

_EPILOG = """\
SRC may be:
  a directory or .safetensors file in the original Wan 2.1 layout (diffusion_pytorch_model.safetensors, or shards
    with a *.safetensors.index.json), e.g. a download of Wan-AI/Wan2.1-T2V-1.3B;
  a diffusers WanTransformer3DModel directory (config.json + safetensors; a pipeline root is entered at
    transformer/), e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers;
  a Self-Forcing / CausVid training checkpoint (.pt with generator_ema / generator / model entries), read with
    torch.load(weights_only=True); needs torch.
The format and the config are detected; the head count comes from a config.json beside the weights or a matching
preset, else pass --num-heads or --preset.

DST is a directory (config.json + params.safetensors) for `jaxkv generate --checkpoint DST` and
jaxkv.models.wan.checkpoint.load(DST).
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxkv convert", epilog=_EPILOG,
                                description="Convert a Wan 2.1 PyTorch / safetensors checkpoint to a jaxkv "
                                            "checkpoint directory.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="checkpoint file or directory to convert")
    p.add_argument("dst", metavar="DST", nargs="?", help="output directory (must not exist unless --force)")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16", help="output dtype (default: bf16)")
    ema = p.add_mutually_exclusive_group()
    ema.add_argument("--ema", dest="ema", action="store_true", default=None,
                     help="training checkpoints: convert generator_ema (the default when present)")
    ema.add_argument("--no-ema", dest="ema", action="store_false",
                     help="training checkpoints: convert generator (or model) instead of generator_ema")
    cfg = p.add_mutually_exclusive_group()
    cfg.add_argument("--preset", help="check the checkpoint against this WanConfig preset "
                                      "(wan2.1-t2v-1.3b, wan2.1-t2v-14b, tiny)")
    cfg.add_argument("--config", metavar="JSON", help="a JSON file of WanConfig fields to check against")
    p.add_argument("--num-heads", type=int, help="attention heads (tensors cannot show them)")
    p.add_argument("--force", action="store_true", help="replace an existing DST (only once the new one is complete)")
    p.add_argument("--dry-run", action="store_true", help="check and report; write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.dst is None and not args.dry_run:
        _parser().error("DST is required (or pass --dry-run)")
    from converters.convert import plan_conversion, write_checkpoint
    from converters.errors import ConversionError

    if args.dst is not None and not args.dry_run and os.path.lexists(args.dst) and not args.force:
        print(f"jaxkv convert: error: {args.dst} already exists; pass --force to replace it", file=sys.stderr)
        return 1
    try:
        plan = plan_conversion(args.src, preset=args.preset, config=args.config, num_heads=args.num_heads,
                               ema=args.ema)
    except ConversionError as e:
        print(f"jaxkv convert: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"jaxkv convert: error: cannot read {args.src} ({e})", file=sys.stderr)
        return 1
    c = plan.config
    entry = getattr(plan.source, "entry", None)
    print(f"source: {plan.source.description}, {plan.naming} naming, {len(plan.source.shapes)} tensors"
          + (f", using entry {entry!r}" if entry else ""), file=sys.stderr)
    print(f"config: dim {c.dim}, ffn_dim {c.ffn_dim}, {c.num_heads} heads, {c.num_layers} layers, patch "
          f"{list(c.patch_size)}, in/out {c.in_dim}/{c.out_dim}, text_dim {c.text_dim} ({plan.config_origin})",
          file=sys.stderr)
    if args.dry_run:
        plan.source.close()
        print("dry run: nothing written", file=sys.stderr)
        return 0
    try:
        size = write_checkpoint(plan, args.dst, dtype=args.dtype, force=args.force, progress=not args.no_progress)
    except ConversionError as e:
        print(f"jaxkv convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("jaxkv convert: interrupted; nothing was written", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"jaxkv convert: error: writing {args.dst} failed, nothing was written ({e})", file=sys.stderr)
        return 1
    finally:
        plan.source.close()
    print(f"wrote {args.dst} ({size / 2**20:.1f} MiB of {args.dtype} params)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
