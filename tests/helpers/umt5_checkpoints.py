"""A tiny umT5 encoder in Wan's layout: its config (`CFG`), a SentencePiece model written for the tests
(`sentencepiece_model`) and Wan's original tensor names for jaxkv params (`wan_layout`)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from jaxkv.models.umt5 import (
    UMT5Config,
)

CFG = UMT5Config(
    vocab_size=64,
    dim=16,
    ffn_dim=24,
    num_heads=2,
    head_dim=6,
    num_layers=2,
    num_buckets=8,
    max_distance=10,
    text_len=12,
)


def sentencepiece_model() -> bytes:
    """A tiny unigram sentencepiece model trained here, with umT5's special ids (pad 0, eos 1, unk 2)."""
    spm = pytest.importorskip("sentencepiece")
    corpus = [
        "a red fox jumps over the lazy dog",
        "the cat sits on the mat",
        "a video of a beach at dusk",
        "waves roll onto the sand",
        "caf\u00e9 in paris at night",
    ] * 20
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=out,
        vocab_size=40,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        minloglevel=2,
    )
    return out.getvalue()


def wan_layout(params, cfg) -> dict[str, np.ndarray]:
    """Wan's original T5Encoder names for jaxkv params, spelled out by hand (PyTorch Linear weights are [out, in])."""
    a = lambda x: np.asarray(x, np.float32)
    b = params["blocks"]
    out = {"token_embedding.weight": a(params["embedding"]), "norm.weight": a(params["final_norm"]["scale"])}
    for i in range(cfg.num_layers):
        out[f"blocks.{i}.norm1.weight"] = a(b["norm1"]["scale"][i])
        out[f"blocks.{i}.norm2.weight"] = a(b["norm2"]["scale"][i])
        for p in "qkvo":
            out[f"blocks.{i}.attn.{p}.weight"] = a(b["attn"][p]["kernel"][i]).T.copy()
        out[f"blocks.{i}.pos_embedding.embedding.weight"] = a(b["attn"]["rel_bias"][i])
        out[f"blocks.{i}.ffn.gate.0.weight"] = a(b["ffn"]["gate"]["kernel"][i]).T.copy()
        out[f"blocks.{i}.ffn.fc1.weight"] = a(b["ffn"]["up"]["kernel"][i]).T.copy()
        out[f"blocks.{i}.ffn.fc2.weight"] = a(b["ffn"]["down"]["kernel"][i]).T.copy()
    return out
