"""Writes the weighted average of toy-world releases' weights as a release directory (issue 44: a stream that keeps
both of its shapes drawn, travelling and crossing the box).

    python benchmarks/average_releases.py --out DIR A:0.55 B:0.3 C:0.15 [--overwrite]

Each ``RELEASE:WEIGHT`` names a release and its share; the weights must be > 0 and add up to 1. The releases must
be of one architecture (the DiT's config and every parameter's shape), with the same latent map and the same
settings (sampler steps, chunk, sink and window): only the DiT's and the text encoder's weights are averaged,
parameter by parameter in float32 (the DiT is stored in bfloat16 and read as float32, `jaxkv.toyworld.model.load`).
Averaging the weights of fine-tunes of one model is what the model-soup and task-arithmetic papers call a soup: the
fine-tunes here start from one release and move away from it in directions that each fix one failing (shapes that
travel and lose each other, shapes that stay drawn and circle, shapes that cross the box and slow down), and their
average keeps more of each than any of them alone (docs/toyworld.md, Release 10).

The release written keeps the first release's "training" record and adds "average": this command, and each part's
path, weight and whole record (its training and fine-tunes), so the release says how to make it again.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.toyworld import model as toy_model

SUM_TOLERANCE = 1e-6  # how far the weights may add up from 1 (they are typed in decimals)


def parse_part(spec: str) -> tuple[str, float]:
    """``"DIR:WEIGHT"`` -> (DIR, WEIGHT); the last colon splits, so DIR may hold colons."""
    release, sep, weight = spec.rpartition(":")
    if not sep or not release:
        raise argparse.ArgumentTypeError(f"expected RELEASE:WEIGHT, got {spec!r}")
    try:
        value = float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the weight of {spec!r} is not a number") from None
    if not (0.0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"the weight of {spec!r} must be finite and > 0")
    return release, value


def _shapes(tree) -> dict:
    return {jax.tree_util.keystr(path): np.shape(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_compatible(models: list, texts: list, names: list[str]) -> None:
    """ValueError naming the first release that differs from the first one in what averaging cannot mix."""
    first = models[0]
    for name, toy, text_params in zip(names[1:], models[1:], texts[1:]):
        differs = [
            what
            for what, same in (
                ("DiT config", toy.config == first.config),
                ("DiT parameter shapes", _shapes(toy.params) == _shapes(first.params)),
                ("text encoder parameter shapes", _shapes(text_params) == _shapes(texts[0])),
                ("settings", toy.settings == first.settings),
                (
                    "latent map",
                    all(
                        np.array_equal(getattr(toy.latent_map, f), getattr(first.latent_map, f))
                        for f in ("basis", "mean", "std")
                    ),
                ),
            )
            if not same
        ]
        if differs:
            raise ValueError(f"{name} differs from {names[0]} in its {', '.join(differs)}: only weights are averaged")


def average(parts: list[tuple[str, float]], out: str, *, force: bool = False, command: str | None = None) -> dict:
    """Writes the release ``out``, the ``parts`` (release, weight) averaged; returns its "average" record."""
    if len(parts) < 2:
        raise ValueError(f"averaging needs at least two releases, got {len(parts)}")
    total = sum(w for _, w in parts)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise ValueError(f"the weights must add up to 1, got {total:g}")
    names = [os.path.abspath(r) for r, _ in parts]
    if os.path.abspath(out) in names:
        raise ValueError(f"--out {out} is one of the releases averaged")
    models = [toy_model.load(r) for r, _ in parts]
    texts = [toy_model.load_text_params(r) for r, _ in parts]
    check_compatible(models, texts, [r for r, _ in parts])
    weights = [w for _, w in parts]

    def mix(*leaves):
        return sum(w * jnp.asarray(x, jnp.float32) for w, x in zip(weights, leaves))

    dit = jax.tree.map(mix, *[m.params for m in models])
    text_params = jax.tree.map(mix, *texts)
    record = {
        "command": command,
        "parts": [{"release": n, "weight": w, "record": m.info} for n, w, m in zip(names, weights, models)],
        "jax_version": jax.__version__,
    }
    first = models[0]
    info = {**({"training": first.info["training"]} if "training" in first.info else {}), "average": record}
    toy_model.save(out, dit, text_params, first.latent_map, first.settings, info, config=first.config, force=force)
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="DIR", help="the release directory to write")
    ap.add_argument("parts", nargs="+", type=parse_part, metavar="RELEASE:WEIGHT", help="a release and its share")
    ap.add_argument("--overwrite", action="store_true", help="replace DIR if it is a toy-world release")
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and not args.overwrite:
        print(f"average_releases: {args.out} exists; pass --overwrite to replace a toy-world release", file=sys.stderr)
        return 2
    command = "python benchmarks/average_releases.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        average(args.parts, args.out, force=args.overwrite, command=command)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"average_releases: {e}", file=sys.stderr)
        return 2
    shares = ", ".join(f"{w:g} x {r}" for r, w in args.parts)
    print(f"wrote {args.out}: {shares}; read it with: jaxkv toyworld check {args.out} --survey")
    return 0


if __name__ == "__main__":
    sys.exit(main())
