"""``jaxkv generate --prompt-schedule FILE``: which prompt (or context file) drives which chunks.

The file is JSON: a list of entries, each an object with

  "chunk":   int >= 0, the first chunk generated under this entry (the first entry must be chunk 0, and chunks
             strictly increase; every chunk must be < --num-chunks);
  exactly one of
  "prompt":  text, encoded by --text-encoder (default: the embedded tiny umT5), or
  "context": a text-embeddings file [tokens, text_dim] (.npy or .safetensors, read as --context reads it); a
             relative path is relative to the schedule file's directory.

Example: ``[{"chunk": 0, "prompt": "a cat on a sofa"}, {"chunk": 8, "prompt": "the cat jumps down"}]``.
At each later entry the stream switches prompts with KV re-cache (`jaxkv.recache`); ``--switch-sink`` chooses
whether the sink's K/V are kept (default) or recomputed. The negative context for guidance stays the one given by
--negative-prompt / --negative-context for the whole run.

With ``--resume`` the schedule counts the resumed run's chunks, and its chunk-0 entry switches only if it differs
from what the session was drawing (its recorded ``"text_now"``); the session must hold its latent ring (every
``--save-state`` of a ring or rolling cache does).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxkv.generate import inputs
from jaxkv.generate.options import UsageError
from jaxkv.validate import is_int, shorten, utf8_problem


class Entry(NamedTuple):
    chunk: int
    prompt: str | None  # text to encode, or
    context: str | None  # path of an embeddings file (resolved)


def entry_text(entry: Entry) -> dict:
    """What an entry draws under, as a session records it (`jaxkv.generate.resume.text_of`): {"prompt": text}
    or {"context": absolute path}."""
    if entry.prompt is not None:
        return {"prompt": entry.prompt}
    return {"context": os.path.abspath(entry.context)}


def read_schedule(path: str, num_chunks: int) -> list[Entry]:
    """The checked entries of a schedule file (no model needed). UsageError naming the entry otherwise."""
    if not os.path.isfile(path):
        raise UsageError(f"--prompt-schedule file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--prompt-schedule {path!r} is not readable JSON ({e})") from None
    if not isinstance(raw, list) or not raw:
        raise UsageError(
            f"--prompt-schedule {path!r} must hold a non-empty JSON list of "
            f'{{"chunk": N, "prompt": TEXT}} or {{"chunk": N, "context": FILE}} entries'
        )
    base = os.path.dirname(os.path.abspath(path))
    entries: list[Entry] = []
    for i, item in enumerate(raw):
        where = f"--prompt-schedule entry {i}"
        if not isinstance(item, dict):
            raise UsageError(f"{where} must be an object, got {item!r}")
        unknown = sorted(set(item) - {"chunk", "prompt", "context"})
        if unknown:
            raise UsageError(f"{where} has unknown keys {unknown}; expected chunk and one of prompt/context")
        chunk = item.get("chunk")
        if not is_int(chunk) or chunk < 0:
            raise UsageError(f"{where}: chunk must be an int >= 0, got {chunk!r}")
        if ("prompt" in item) == ("context" in item):
            raise UsageError(f'{where} must give exactly one of "prompt" and "context"')
        if "prompt" in item and not isinstance(item["prompt"], str):
            raise UsageError(f"{where}: prompt must be a string, got {shorten(repr(item['prompt']))}")
        if "prompt" in item and utf8_problem(item["prompt"]):
            raise UsageError(f"{where}: prompt: {utf8_problem(item['prompt'])}")
        if "context" in item and not (isinstance(item["context"], str) and item["context"]):
            raise UsageError(f"{where}: context must be a file path, got {item['context']!r}")
        if not entries and chunk != 0:
            raise UsageError(f"{where}: the first entry must start at chunk 0, got {chunk}")
        if entries and chunk <= entries[-1].chunk:
            raise UsageError(f"{where}: chunks must strictly increase, got {chunk} after {entries[-1].chunk}")
        if chunk >= num_chunks:
            raise UsageError(f"{where}: chunk {chunk} is not generated (--num-chunks {num_chunks})")
        context = item.get("context")
        entries.append(Entry(int(chunk), item.get("prompt"), None if context is None else os.path.join(base, context)))
    return entries


def schedule_contexts(args, config, entries: list[Entry]) -> tuple[list[np.ndarray], np.ndarray | None, dict]:
    """(each entry's context float32 [batch, tokens, text_dim], the negative context likewise or None without
    guidance, summary entries). Prompts (and --negative-prompt) are encoded in one call; files are checked as
    --context's are."""
    texts = [e.prompt for e in entries if e.prompt is not None]
    encoded, negative, info = [], None, {}
    if texts or args.negative_prompt is not None:
        encoder = inputs.text_encoder(args, config)
        out = encoder.encode(texts + ([args.negative_prompt] if args.negative_prompt is not None else []))
        encoded = list(out[: len(texts)])
        if args.negative_prompt is not None:
            negative = np.asarray(out[len(texts)], np.float32)
        if args.offload_text_encoder:
            encoder.release()
        info.update(text_encoder=encoder.name, text_encoder_released=encoder.released)
    contexts = []
    for i, e in enumerate(entries):
        if e.prompt is not None:
            contexts.append(np.asarray(encoded.pop(0), np.float32))
        else:
            contexts.append(
                inputs.load_context(e.context, config.text_dim, config.text_len, f"--prompt-schedule entry {i} context")
            )
    if args.guidance_scale is None:
        negative = None
    elif negative is None:  # options.check: guidance with a schedule has --negative-prompt or this
        negative = inputs.load_context(args.negative_context, config.text_dim, config.text_len, "--negative-context")
    info["prompt_schedule"] = [
        {"chunk": e.chunk, **({"prompt": e.prompt} if e.prompt is not None else {"context": e.context})}
        for e in entries
    ]
    batched = [np.broadcast_to(c, (args.batch, *c.shape)) for c in contexts]
    return batched, None if negative is None else np.broadcast_to(negative, (args.batch, *negative.shape)), info


class Texts(NamedTuple):
    """What a run draws its chunks under (`starting_texts`)."""

    context: np.ndarray | None  # the first chunk's text context; None: a resumed session holds its cross K/V
    negative: np.ndarray | None  # the negative context (guidance), or None
    info: dict  # how the texts were made (the summary's)
    switches: dict  # chunk of this run -> (the schedule entry, its context as a jax array): where the stream switches
    drawing: dict | None  # the text the next chunk is drawn under (recorded in a saved session)


def starting_texts(args, config, entries: list[Entry] | None, drawing: dict | None, *, resumed: bool) -> Texts:
    """The contexts a run starts from and the switches its schedule makes, ``drawing`` being what a resumed
    session was drawing (`jaxkv.generate.resume.text_of`). A resumed run encodes only its schedule's texts (the
    session holds the cross-attention K/V), and its chunk-0 entry switches only if it differs from ``drawing``;
    a fresh run starts from --prompt / --context, or from the schedule's first entry."""
    if entries is None:
        if resumed:
            return Texts(None, None, {}, {}, drawing)
        context, negative, info = inputs.contexts(args, config)  # encodes --prompt (after the cheap checks)
        return Texts(context, negative, info, {}, drawing)
    scheduled, negative, info = schedule_contexts(args, config, entries)
    if resumed:  # the schedule counts this run's chunks
        switches = {
            e.chunk: (e, jnp.asarray(c)) for e, c in zip(entries, scheduled) if e.chunk > 0 or entry_text(e) != drawing
        }
        return Texts(None, negative, info, switches, drawing)
    switches = {e.chunk: (e, jnp.asarray(c)) for e, c in zip(entries[1:], scheduled[1:])}
    return Texts(scheduled[0], negative, info, switches, entry_text(entries[0]))
