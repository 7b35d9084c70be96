"""Continuation from pixels on the toy world: continue a clip of the world from its first frames and compare the
next frames with the world's own, against starting from noise with the same prompt.

For each kind of scene (`jaxkv.toyworld.continuation.measure`: "offset", the canonical scenes the model was trained
on from a random frame; "random", random scenes of random prompts; "canonical", the canonical scene from frame 0,
where a stream from noise is meant to show the very same frames) it reports per method (the model's continuation of
the given frames; its stream from noise, same prompt and seed; the last given frame held still; the world's own
frames through the latent map, the floor) the median distance (px) over (clip, named shape, frame) from each shape's
detected centre to the world's, a shape not detected counting as infinitely far, and the share within 3 px ("hits").

    python benchmarks/continuation.py [--clips 16] [--given 9] [--ahead 12] [--seed 0] [--release DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from jaxkv.toyworld import continuation, quality
from jaxkv.toyworld import model as toy_model


def _px(v) -> str:
    return "   inf" if v is None else f"{v:6.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=continuation.CLIPS, help="clips per scene kind")
    ap.add_argument("--given", type=int, default=continuation.GIVEN, help="frames given (whole chunks)")
    ap.add_argument("--ahead", type=int, default=continuation.AHEAD, help="frames compared after them (whole chunks)")
    ap.add_argument("--seed", type=int, default=continuation.SEED)
    ap.add_argument("--scenes", choices=(*continuation.SCENES, "all"), default="all")
    ap.add_argument("--release", default=toy_model.RELEASE_DIR, help="a toy-world release (default: the shipped one)")
    ap.add_argument("--json", help="write the readings and the settings here")
    args = ap.parse_args(argv)
    model = toy_model.load(args.release)
    kinds = continuation.SCENES if args.scenes == "all" else (args.scenes,)
    results = {}
    print(
        f"{args.clips} clips per scene kind, {args.given} frames given, {args.ahead} compared after them, seed "
        f"{args.seed}; error = px from the world's centre of each named shape (median), hits = share within "
        f"{quality.TRACK_RADIUS:g} px"
    )
    print(f"{'scenes':<10} {'method':<10} {'median px':>9} {'hits':>6}   median px per frame ahead")
    for kind in kinds:
        t0 = time.perf_counter()
        reading = continuation.measure(
            model, clips=args.clips, given=args.given, ahead=args.ahead, seed=args.seed, scenes=kind
        )
        summary = reading.summary()
        results[kind] = {"seconds": round(time.perf_counter() - t0, 1), **summary}
        for method, s in summary.items():
            frames = " ".join(_px(v) for v in s["by_frame_px"])
            print(f"{kind:<10} {method:<10} {_px(s['median_px']):>9} {s['hits']:6.3f}   {frames}")
    out = {
        "benchmark": "continuation",
        "settings": {
            "clips": args.clips,
            "given": args.given,
            "ahead": args.ahead,
            "seed": args.seed,
            "release": args.release,
            "track_radius_px": quality.TRACK_RADIUS,
        },
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "results": results,
    }
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
