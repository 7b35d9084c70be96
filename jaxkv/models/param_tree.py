"""Params as nested dicts of arrays, shared by every model family (Wan DiT, Wan VAE, umT5).

Checkpoint files store them flat (``"blocks.self_attn.q.kernel"``); `flatten` / `unflatten` convert, and
`check_shapes` compares a tree with the shapes a config expects, naming every problem at once.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def flatten(tree: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """{"a": {"b": x}} -> {"a.b": x}. Used for safetensors files."""
    out: dict[str, Any] = {}

    def visit(prefix: str, node):
        if isinstance(node, dict):
            for key, value in node.items():
                visit(f"{prefix}{sep}{key}" if prefix else key, value)
        else:
            out[prefix] = node

    visit("", tree)
    return out


def unflatten(flat: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """Inverse of `flatten`."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split(sep)
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _listing(keys: list[str], most: int = 12) -> str:
    return f"{keys[:most]}" + (f" and {len(keys) - most} more" if len(keys) > most else "")


def check_shapes(
    params: dict[str, Any], expected: Mapping[str, tuple[int, ...]], what: str, prefixes: tuple[str, ...] | None = None
) -> None:
    """ValueError naming every missing key, unexpected key and shape mismatch of ``params`` against ``expected``
    (flat key -> shape); ``prefixes`` restricts both sides to keys starting with one of them."""
    found = {k: tuple(np.shape(v)) for k, v in flatten(params).items()}
    if prefixes is not None:
        expected = {k: v for k, v in expected.items() if k.startswith(prefixes)}
        found = {k: v for k, v in found.items() if k.startswith(prefixes)}
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    for key in sorted(set(expected) & set(found)):
        if expected[key] != found[key]:
            problems.append(f"{key}: expected shape {expected[key]}, found {found[key]}")
    if problems:
        raise ValueError(f"params do not match the {what} config:\n  " + "\n  ".join(problems))
