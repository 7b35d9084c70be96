"""The ``jaxkv`` command: ``jaxkv generate``, ``jaxkv convert``, ``jaxkv toyworld`` and ``jaxkv serve`` (benchmarks
run as scripts from ``benchmarks/``).

Each subcommand lives in its own module and is imported only when used, so ``jaxkv convert`` does not pay for
importing the model and ``jaxkv generate`` does not need the converters.
"""

from __future__ import annotations

import sys


def _generate(argv: list[str]) -> int:
    from jaxkv import generate

    return generate.main(argv)


def _convert(argv: list[str]) -> int:
    from jaxkv.convert import cli

    return cli.main(argv)


def _serve(argv: list[str]) -> int:
    from jaxkv.serve import cli

    return cli.main(argv)


def _toyworld(argv: list[str]) -> int:
    from jaxkv.toyworld import cli

    return cli.main(argv)


_COMMANDS = {
    "generate": (_generate, "streaming video-latent generation on ring caches (Wan 2.1, causal)"),
    "convert": (_convert, "convert a PyTorch/safetensors Wan 2.1 checkpoint to jaxkv params"),
    "toyworld": (_toyworld, "train the toy world's model from scratch; check a release's quality"),
    "serve": (_serve, "a live, steerable video stream in the browser (WebSocket server and page)"),
}


def _usage() -> str:
    lines = ["usage: jaxkv COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "Run `jaxkv COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"jaxkv: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(_COMMANDS[name][0](rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
