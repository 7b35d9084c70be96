"""Which model family a checkpoint holds (Wan DiT, Wan VAE, umT5 text encoder), and a Wan release as one unit.

`detect_family(src)` tells the three converters' sources apart from key names alone. `find_release(src)` finds the
three parts of a Wan release directory, in either layout:

* original: the DiT weights (``diffusion_pytorch_model*.safetensors`` / a shard index) beside ``Wan2.1_VAE.pth``,
  ``models_t5_umt5-xxl-enc-bf16.pth`` and a tokenizer folder (``google/umt5-xxl/``);
* diffusers pipeline root: ``transformer/``, ``vae/``, ``text_encoder/`` and ``tokenizer/``.

`convert_release` writes ``DST/dit/``, ``DST/vae/``, ``DST/text_encoder/`` (each a jaxkv checkpoint directory of its
family) atomically as a whole: every part is planned (headers only) before anything is written, and the three are
built inside one hidden temporary directory renamed onto DST at the end. `write_family` writes any one part with
its family's writer; all three stream through `jaxkv.convert.stream.write_tensor_directory`, so the destination,
``--force`` (each family's own replace rule) and NaN/Inf rules are the same for every family.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
from typing import Any, Callable

from jaxkv import files
from jaxkv.convert.errors import ConversionError
from jaxkv.convert.sources import open_source
from jaxkv.convert.stream import WriteResult
from jaxkv.models.release import PARTS

FAMILIES = ("dit", "vae", "umt5")
RELEASE_PARTS = PARTS  # family -> subdirectory of a release DST (the layout `jaxkv generate` reads)
_VAE_FILES = ("Wan2.1_VAE.pth",)
_T5_GLOB = "models_t5*.pth"
_DIT_ONLY = (
    "patch_embedding.",
    "time_embedding.",
    "time_projection.",
    "text_embedding.",
    "condition_embedder.",
    "head.head.",
    "proj_out.",
    "scale_shift_table",
)
_DIFFUSERS_PARTS = {"dit": "transformer", "vae": "vae", "umt5": "text_encoder"}
LOOKED_FOR = (
    "a Wan 2.1 DiT (original blocks.N.self_attn.* / diffusers blocks.N.attn1.*, condition_embedder.*)",
    "a Wan VAE (original Wan2.1_VAE.pth keys decoder.conv1, decoder.upsamples.N...; diffusers "
    "AutoencoderKLWan keys decoder.conv_in, post_quant_conv, ...)",
    "a umT5 encoder (original models_t5_umt5-xxl-enc-bf16.pth keys token_embedding, blocks.N.attn.*; "
    "Hugging Face UMT5EncoderModel keys encoder.block.N.*)",
    "a Wan release directory (DiT weights + Wan2.1_VAE.pth + models_t5*.pth + a tokenizer folder, or a "
    "diffusers pipeline root with transformer/, vae/, text_encoder/, tokenizer/)",
)


# --- detection --------------------------------------------------------------------------------------------------


def find_release(src: str) -> dict[str, Any] | None:
    """{'dit': path, 'vae': path, 'umt5': path, 'tokenizer': path or None, 'layout': 'original' | 'diffusers'}
    when ``src`` is a Wan release directory, else None. A directory holding only some of the parts is not one."""
    if not os.path.isdir(src):
        return None
    parts = {f: os.path.join(src, d) for f, d in _DIFFUSERS_PARTS.items()}
    if all(os.path.isdir(p) for p in parts.values()):
        tok = os.path.join(src, "tokenizer")
        return {**parts, "tokenizer": tok if os.path.isdir(tok) else None, "layout": "diffusers"}
    vaes = [os.path.join(src, n) for n in _VAE_FILES if os.path.isfile(os.path.join(src, n))]
    t5s = sorted(glob.glob(os.path.join(src, _T5_GLOB)))
    dits = glob.glob(os.path.join(src, "*.safetensors")) + glob.glob(os.path.join(src, "*.safetensors.index.json"))
    if len(vaes) == 1 and len(t5s) == 1 and dits:
        return {"dit": src, "vae": vaes[0], "umt5": t5s[0], "tokenizer": None, "layout": "original"}
    return None


def _looks_like_dit(src: str) -> bool | None:
    """True / False from the key names; None when the source cannot be opened (the DiT converter then reports
    why, as it always has)."""
    from jaxkv.convert.layouts import detect_naming

    try:
        source = open_source(src)
    except (ConversionError, OSError):
        return None
    try:
        detect_naming(source.shapes)
    except ConversionError:
        return False
    else:  # block names alone are loose (a umT5's blocks.N.norm2 is a diffusers DiT name too): need a DiT-only one
        return any(k.startswith(_DIT_ONLY) for k in source.shapes)
    finally:
        source.close()


def detect_family(src: str) -> str:
    """'release', 'dit', 'vae' or 'umt5' for ``src``, from file and key names only (no tensor data is read).

    Raises ConversionError listing what was looked for when ``src`` matches several families or none of them. A
    source that cannot be opened at all is handed to the DiT converter ('dit'), whose messages say why."""
    from jaxkv.convert.umt5 import is_umt5_source
    from jaxkv.convert.wan_vae import is_vae_source

    if find_release(src) is not None:
        return "release"
    found = [f for f, test in (("vae", is_vae_source), ("umt5", is_umt5_source)) if test(src)]
    dit = _looks_like_dit(src)
    if dit:
        found.insert(0, "dit")
    if len(found) > 1:
        raise ConversionError(
            f"{src} is ambiguous: its tensor names fit {' and '.join(found)}; pass --family {'|'.join(found)} to choose"
        )
    if found:
        return found[0]
    if dit is None:
        return "dit"
    raise ConversionError(
        f"{src} holds none of the model families jaxkv converts; looked for "
        + "; ".join(LOOKED_FOR)
        + " (pass --family dit|vae|umt5 to see one converter's complaint)"
    )


def resolve(src: str, family: str) -> str:
    """The path inside a release directory that holds ``family`` (``src`` itself otherwise)."""
    release = find_release(src)
    if release is None:
        return src
    return release[family]


# --- destinations -----------------------------------------------------------------------------------------------


def replace_problem(family: str, path: str) -> str | None:
    """None if ``path`` is a jaxkv checkpoint directory of ``family`` ('dit', 'vae', 'umt5' or 'release') that
    ``--force`` may replace; otherwise why not."""
    if family == "dit":
        from jaxkv.models.wan import checkpoint

        return checkpoint.replace_problem(path)
    if family == "vae":
        from jaxkv.convert.wan_vae import replace_problem as vae_rule

        return vae_rule(path)
    if family == "umt5":
        from jaxkv.convert.umt5 import replace_problem as umt5_rule

        return umt5_rule(path)
    if family == "release":
        if os.path.islink(path) or not os.path.isdir(path):
            return f"{path} is not a directory"
        entries = sorted(os.listdir(path))
        if entries != sorted(RELEASE_PARTS.values()):
            return f"{path} holds {entries}, not exactly the jaxkv release parts {sorted(RELEASE_PARTS.values())}"
        for fam, sub in RELEASE_PARTS.items():
            problem = replace_problem(fam, os.path.join(path, sub))
            if problem is not None:
                return problem
        return None
    raise ConversionError(f"unknown model family {family!r}; expected one of {list(FAMILIES)}")


def check_output(src: str, dst: str, family: str, *, force: bool = False) -> None:
    """ConversionError unless writing ``dst`` from ``src`` destroys nothing but a previous output of ``family``."""
    try:
        files.check_destination(dst, sources=[src], force=force, replaceable=functools.partial(replace_problem, family))
    except files.DestinationError as e:
        raise ConversionError(str(e)) from None


# --- planning and writing ---------------------------------------------------------------------------------------


def plan_family(family: str, src: str, *, tokenizer: str | None = None, **dit_options):
    """The family's plan for ``src`` (a release directory is entered at that family's part). ``dit_options`` go to
    `jaxkv.convert.convert.plan_conversion` (preset, config, num_heads, text_len, ema); the VAE and umT5 take none."""
    path = resolve(src, family)
    if family == "dit":
        from jaxkv.convert.convert import plan_conversion

        return plan_conversion(path, **dit_options)
    given = sorted(k for k, v in dit_options.items() if v is not None)
    if given:
        raise ConversionError(
            f"--{', --'.join(given).replace('_', '-')} only apply to the DiT; {path} is a "
            f"{'VAE' if family == 'vae' else 'umT5 text encoder'}"
        )
    if family == "vae":
        from jaxkv.convert.wan_vae import plan_vae_conversion

        if tokenizer is not None:
            raise ConversionError(f"--tokenizer applies to a umT5 text encoder; {path} is a VAE")
        return plan_vae_conversion(path)
    if family == "umt5":
        from jaxkv.convert.umt5 import plan_umt5_conversion

        return plan_umt5_conversion(path, tokenizer=tokenizer)
    raise ConversionError(f"unknown model family {family!r}; expected one of {list(FAMILIES)}")


def write_family(
    family: str,
    plan,
    dst: str,
    *,
    dtype: str = "bf16",
    force: bool = False,
    progress: bool = False,
    allow_nonfinite: bool = False,
    log: Callable[[str], None] | None = None,
) -> WriteResult:
    """Streams a DiT / VAE / umT5 ``plan`` into ``dst`` with that family's writer, atomically and under the one
    set of rules (`jaxkv.convert.stream.write_tensor_directory`): ``force`` replaces only a jaxkv directory of the
    same family (see `replace_problem`), a NaN/Inf tensor is refused by name unless ``allow_nonfinite`` (then
    listed in the result's ``nonfinite``). Returns what was written."""
    if family == "dit":
        from jaxkv.convert.convert import write_checkpoint as write
    elif family == "vae":
        from jaxkv.convert.wan_vae import write_vae_checkpoint as write
    elif family == "umt5":
        from jaxkv.convert.umt5 import write_umt5_checkpoint as write
    else:
        raise ConversionError(f"unknown model family {family!r}; expected one of {list(FAMILIES)}")
    return write(plan, dst, dtype=dtype, force=force, progress=progress, allow_nonfinite=allow_nonfinite, log=log)


@dataclasses.dataclass
class ReleasePlan:
    """The three checked plans of a release ({family: plan}) and where they came from."""

    src: str
    layout: str
    plans: dict[str, Any]

    def close(self) -> None:
        for plan in self.plans.values():
            plan.source.close()


def plan_release(src: str, *, tokenizer: str | None = None, **dit_options) -> ReleasePlan:
    """Plans every part of the release directory ``src`` (headers only); ConversionError naming the part that
    fails, with nothing left open. ``tokenizer`` overrides the one found in the release."""
    release = find_release(src)
    if release is None:
        raise ConversionError(f"{src} is not a Wan release directory; expected {LOOKED_FOR[3]}")
    plans: dict[str, Any] = {}
    try:
        for family in FAMILIES:
            options = (
                dit_options
                if family == "dit"
                else {"tokenizer": tokenizer or release["tokenizer"]}
                if family == "umt5"
                else {}
            )
            try:
                plans[family] = plan_family(family, release[family], **options)
            except ConversionError as e:
                raise ConversionError(f"release part {RELEASE_PARTS[family]}/ ({release[family]}): {e}") from None
    except BaseException:
        for plan in plans.values():
            plan.source.close()
        raise
    return ReleasePlan(src, release["layout"], plans)


def write_release(
    plan: ReleasePlan,
    dst: str,
    *,
    dtype: str = "bf16",
    force: bool = False,
    progress: bool = False,
    allow_nonfinite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, WriteResult]:
    """Writes ``DST/dit``, ``DST/vae``, ``DST/text_encoder`` as one atomic directory (an error or signal in any
    part leaves nothing); ``force`` replaces only a previous jaxkv release directory. Every part is written by
    `write_family` (``allow_nonfinite`` applies to each). Returns {family: what was written}."""
    replace = functools.partial(replace_problem, "release") if force else None
    results = {}
    with files.atomic_directory(dst, replace=replace, log=log) as tmp:
        for family, part in plan.plans.items():
            results[family] = write_family(
                family,
                part,
                os.path.join(tmp, RELEASE_PARTS[family]),
                dtype=dtype,
                progress=progress,
                allow_nonfinite=allow_nonfinite,
                log=log,
            )
    return results


def convert_release(
    src: str,
    dst: str,
    *,
    dtype: str = "bf16",
    force: bool = False,
    progress: bool = False,
    allow_nonfinite: bool = False,
    log=None,
    **dit_options,
) -> ReleasePlan:
    """`check_output` + `plan_release` + `write_release`; returns the (closed) plan."""
    check_output(src, dst, "release", force=force)
    plan = plan_release(src, **dit_options)
    try:
        write_release(plan, dst, dtype=dtype, force=force, progress=progress, allow_nonfinite=allow_nonfinite, log=log)
    finally:
        plan.close()
    return plan
