"""The toy world's text path: a word-level umT5 tokenizer over `world.VOCABULARY` and a tiny umT5 encoder.

The prompt "a red circle and a blue square, fast" is 10 pieces (the comma is one) plus ``</s>``, so every prompt
fits the 16 tokens of the tiny encoder. The encoder is `jaxkv.models.umt5` at a tiny size, trained with the DiT
(`jaxkv.toyworld.train`); at generation it is loaded like any converted umT5 (`TextEncoder.load`).
"""

from __future__ import annotations

import hashlib

from jaxkv.models.umt5 import init_params
from jaxkv.models.umt5.config import UMT5Config
from jaxkv.models.umt5.tokenizer import Tokenizer
from jaxkv.toyworld.world import VOCABULARY

SPECIAL = ("<pad>", "</s>", "<unk>", ",")
CONFIG = UMT5Config(
    vocab_size=32,
    dim=32,
    ffn_dim=64,
    num_heads=4,
    head_dim=8,
    num_layers=2,
    num_buckets=8,
    max_distance=12,
    text_len=16,
)


def tokenizer_json() -> str:
    """``tokenizer.json`` text: a lower-casing WordLevel model over the special pieces and `VOCABULARY`; other
    words become ``<unk>``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    vocab = {piece: i for i, piece in enumerate((*SPECIAL, *VOCABULARY))}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words, and the comma as its own piece
    return tok.to_str()


def tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    text = tokenizer_json()
    return Tokenizer.from_tokenizers(
        HFTokenizer.from_str(text), source="toy-world tokenizer", digest=hashlib.sha256(text.encode()).hexdigest()
    )


def init_text_params(seed: int) -> dict:
    """Random float32 encoder params of `CONFIG` (the start of training; seeded numpy, see `umt5.init_params`)."""
    return init_params(CONFIG, seed)
