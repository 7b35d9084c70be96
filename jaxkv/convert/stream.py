"""The write half of every converter: stream planned tensors into ``DST/params.safetensors`` atomically.

A converter (the Wan DiT one in convert.py; the VAE and text-encoder ones alike) first plans from headers alone,
then hands `write_tensor_directory` the output tensors in file order, each as one or more `Piece`s that are read
one at a time (a stacked ``[L, ...]`` parameter is L pieces). The shared rules live here once:

* the destination is checked first (`jaxkv.files.check_destination`: never a source, never something that is not
  a previous output of this converter), and written through `jaxkv.files.atomic_directory` (nothing left behind on
  an error, Ctrl-C, SIGTERM or SIGHUP; stale temporaries of killed runs removed and reported);
* each piece is cast to the output dtype and checked for NaN / Inf as it streams (bounded memory); a non-finite
  tensor stops the conversion with its name unless ``allow_nonfinite``, and is listed in the result otherwise;
* a progress bar per piece.

Two hooks cover what some families add: ``on_piece`` sees every piece's bytes exactly as written (the umT5
fingerprint hashes them), and ``extra_files`` may be a function of the finished params file (a config.json that
records that fingerprint) and may hold binary files (a copied tokenizer).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import ml_dtypes
import numpy as np

from jaxkv import files
from jaxkv.convert.errors import ConversionError, listing
from jaxkv.convert.safetensors_io import StreamWriter

_CHECK_BLOCK = 1 << 20  # elements per finiteness test: the boolean scratch stays at 1 MiB
OUTPUT_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}  # what every family writes


def output_dtype(name: str) -> np.dtype:
    """The numpy dtype of an output dtype name ('bf16' / 'f32'); ConversionError for any other."""
    if name not in OUTPUT_DTYPES:
        raise ConversionError(f"output dtype {name!r} is not supported; expected one of {sorted(OUTPUT_DTYPES)}")
    return OUTPUT_DTYPES[name]


class Piece(NamedTuple):
    """One source array of an output tensor.

    label: what messages call it (the source key, e.g. ``blocks.3.ffn.0.weight``).
    read: () -> the piece's values in the output layout (any float dtype; a view is fine).
    release: called once the piece is written (e.g. to drop a memory map's pages), or None.
    """

    label: str
    read: Callable[[], np.ndarray]
    release: Callable[[], None] | None = None


def source_piece(
    source,
    key: str,
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
    *,
    label: str | None = None,
    release: bool = True,
) -> Piece:
    """A Piece of tensor ``key`` of the open `jaxkv.convert.sources.Source` ``source``: read (memory-mapped where the
    format allows), passed through ``transform`` (a layout change; a view where possible) and, with ``release``,
    released once written. ``label`` defaults to ``key``."""

    def read() -> np.ndarray:
        array = source.read(key)
        return array if transform is None else transform(array)

    return Piece(key if label is None else label, read, (lambda: source.release(key)) if release else None)


@dataclasses.dataclass
class WriteResult:
    """What `write_tensor_directory` wrote: ``params_bytes`` (size of the params file) and ``nonfinite``
    (one "label: n NaN, n +Inf, n -Inf of N values" line per non-finite piece, only with allow_nonfinite)."""

    params_bytes: int
    nonfinite: list[str]


def nonfinite_summary(array: np.ndarray) -> str | None:
    """None if every value is finite, else "n NaN, n +Inf, n -Inf of N values"; checked in blocks so the boolean
    scratch stays small whatever the array size."""
    flat = array.reshape(-1)
    counts = None
    for begin in range(0, flat.size, _CHECK_BLOCK):
        block = flat[begin : begin + _CHECK_BLOCK]
        if np.isfinite(block).all():
            continue
        if counts is None:
            counts = [0, 0, 0]
        counts[0] += int(np.isnan(block).sum())
        counts[1] += int(np.isposinf(block).sum())
        counts[2] += int(np.isneginf(block).sum())
    if counts is None:
        return None
    return f"{counts[0]} NaN, {counts[1]} +Inf, {counts[2]} -Inf of {flat.size} values"


ExtraFiles = Mapping[str, str | bytes]  # file name -> text, or bytes written as they are


def write_tensor_directory(
    dst: str,
    tensors: Sequence[tuple[str, tuple[int, ...], Sequence[Piece]]],
    *,
    dtype,
    extra_files: ExtraFiles | Callable[[str], ExtraFiles],
    metadata: Mapping[str, str] | None = None,
    replaceable: Callable[[str], str | None],
    force: bool = False,
    sources: Iterable[str] = (),
    allow_nonfinite: bool = False,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    params_file: str = "params.safetensors",
    on_piece: Callable[[np.ndarray], None] | None = None,
    desc: str = "convert",
) -> WriteResult:
    """Streams ``tensors`` [(output key, output shape, pieces)] into ``dst/params_file`` and writes
    ``extra_files`` beside it, all atomically.

    ``extra_files``: {name: text (str) or content (bytes)}, e.g. config.json; or a function that takes the path of
    the complete params file and returns that mapping (for files that depend on the written bytes).
    Every piece is cast to ``dtype`` (round to nearest even when narrowing), made contiguous, checked for NaN/Inf,
    passed to ``on_piece`` (if given) and appended; the pieces of one tensor must concatenate (C order) to its
    shape, so ``on_piece`` sees the params file's data region in order. ``desc`` labels the progress bar.

    ``replaceable`` says whether an existing ``dst`` may be replaced under ``force`` (see
    `jaxkv.files.check_destination`); ``sources`` are the paths being read, which ``dst`` must not be, contain or
    lie in. ``log`` receives one-line notes (stale temporaries removed). Raises ConversionError (nothing written,
    nothing touched) for a refused destination or a non-finite piece without ``allow_nonfinite``;
    KeyboardInterrupt / `jaxkv.files.Terminated` pass through after cleanup.
    """
    out = np.dtype(dtype)
    sources = list(sources)
    try:
        files.check_destination(dst, sources=sources, force=force, replaceable=replaceable)
    except files.DestinationError as e:
        raise ConversionError(str(e)) from None
    from tqdm import tqdm

    bad: list[str] = []
    try:
        with files.atomic_directory(dst, replace=replaceable if force else None, log=log) as tmp:
            params_path = os.path.join(tmp, params_file)
            writer = StreamWriter(params_path, [(key, out, shape) for key, shape, _ in tensors], metadata)
            try:
                total = sum(len(p) for _, _, p in tensors)
                with tqdm(total=total, unit="tensor", desc=desc, disable=not progress, dynamic_ncols=True) as bar:
                    for key, _, pieces in tensors:
                        for piece in pieces:
                            files.check_signals()  # a SIGTERM / Ctrl-C that landed in a gc callback
                            source = piece.read()
                            values = np.ascontiguousarray(source, dtype=out)
                            problem = nonfinite_summary(values)
                            if problem is not None:
                                if nonfinite_summary(source) is None:
                                    problem += f" after casting to {out.name} (the source values are finite)"
                                if not allow_nonfinite:
                                    raise ConversionError(
                                        f"tensor {piece.label} holds non-finite values ({problem}); the "
                                        f"conversion stopped and nothing was written; pass --allow-nonfinite "
                                        f"(allow_nonfinite=True) to convert it anyway"
                                    )
                                bad.append(f"{piece.label}: {problem}")
                            if on_piece is not None:
                                on_piece(values)
                            writer.write(key, values)
                            del values, source
                            if piece.release is not None:
                                piece.release()
                            bar.update(1)
                writer.close()
            except BaseException:
                writer.abort()
                raise
            if callable(extra_files):
                extra_files = extra_files(params_path)
            for name, content in extra_files.items():
                with open(os.path.join(tmp, name), "wb" if isinstance(content, bytes) else "w") as f:
                    f.write(content)
            size = os.path.getsize(params_path)
    except files.DestinationError as e:  # the destination changed between the check and the write
        raise ConversionError(str(e)) from None
    return WriteResult(size, bad)


def describe_nonfinite(bad: Sequence[str]) -> str:
    """One line for a summary: the non-finite tensors that were converted anyway."""
    return f"non-finite values kept in {len(bad)} tensor(s): {listing(bad, 6)}"
