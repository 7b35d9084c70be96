"""umT5 without torch: config checks, bucket structure, encoder invariances (padding, per-layer bias), compile
counts, Wan's cleaning and tokenization (tokenizers and sentencepiece), the context post-processing, TextEncoder
(tiny default, embeddings cache, release), checkpoints, and a torch-free conversion of a Wan-layout safetensors file
carrying its sentencepiece model as a tensor. Parity with transformers is in test_umt5_parity.py.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.compilation import count_compiles
from jaxkv.models.umt5 import (
    PromptTruncated,
    TextEncoder,
    Tokenizer,
    TokenizerNotFound,
    UMT5Config,
    checkpoint,
    clean_text,
    encode,
    encode_jit,
    encode_prompts,
    init_params,
    preset,
    relative_buckets,
    tiny_tokenizer,
)
from jaxkv.models.umt5.encoder import CacheError
from jaxkv.models.umt5.model import check_ids
from jaxkv.models.umt5.params import flatten
from jaxkv.models.umt5.tokenizer import fix_text_subset
from jaxkv.models.wan.checkpoint import CheckpointError
from tests.helpers.umt5_checkpoints import CFG, sentencepiece_model, wan_layout


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def test_config_checks():
    assert preset("umt5-xxl").num_params() == 5_680_910_336  # DESIGN.md: 5.68 B
    with pytest.raises(ValueError, match="num_buckets must be an even int >= 4"):
        UMT5Config(vocab_size=8, dim=8, ffn_dim=8, num_heads=1, head_dim=8, num_layers=1, num_buckets=7)
    with pytest.raises(ValueError, match="pad_id and eos_id must differ"):
        UMT5Config(vocab_size=8, dim=8, ffn_dim=8, num_heads=1, head_dim=8, num_layers=1, eos_id=0)
    with pytest.raises(ValueError, match="max_distance"):
        UMT5Config(
            vocab_size=8, dim=8, ffn_dim=8, num_heads=1, head_dim=8, num_layers=1, num_buckets=32, max_distance=8
        )
    with pytest.raises(ValueError, match="unknown umT5 preset"):
        preset("t5-xxl")


def test_bucket_structure():
    """From the definition: offset 0 -> bucket 0; keys after the query use the upper half; exact buckets for small
    offsets, non-decreasing log bins after, the last bucket from max_distance on."""
    n, half = 300, CFG.num_buckets // 2
    b = relative_buckets(n, CFG)
    assert b.shape == (n, n) and b.dtype == np.int32
    assert np.all(np.diag(b) == 0)
    q, k = np.triu_indices(n, 1)
    np.testing.assert_array_equal(b[q, k] - b[k, q], half)  # after = before + half, same distance
    d = b[0]  # bucket of distance j, key after the query, minus half
    f = d[1:] - half
    assert list(f[: half // 2 - 1]) == list(range(1, half // 2))  # exact offsets 1 .. max_exact-1
    assert np.all(np.diff(f) >= 0) and f.max() == half - 1
    assert np.all(f[CFG.max_distance - 1 :] == half - 1)  # distance >= max_distance: the last bucket


def test_padding_and_masked_ids_do_not_change_valid_outputs(params):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (2, 7))
    alone = np.asarray(encode_jit(params, CFG, ids, np.ones_like(ids)))
    padded = np.concatenate([ids, rng.integers(0, CFG.vocab_size, (2, 9))], axis=1)  # junk at masked positions
    mask = np.concatenate([np.ones((2, 7), int), np.zeros((2, 9), int)], axis=1)
    out = np.asarray(encode_jit(params, CFG, padded, mask))
    np.testing.assert_allclose(out[:, :7], alone, atol=2e-5, rtol=2e-5)
    # ...whereas unmasking the junk changes them: the mask is what does it.
    assert np.abs(np.asarray(encode_jit(params, CFG, padded, np.ones_like(padded)))[:, :7] - alone).max() > 1e-3


def test_each_layer_uses_its_own_bias(params):
    ids = np.arange(10)[None] % CFG.vocab_size
    mask = np.ones_like(ids)
    base = np.asarray(encode_jit(params, CFG, ids, mask))
    for layer in range(CFG.num_layers):
        bias = params["blocks"]["attn"]["rel_bias"].at[layer].add(1.0 * jnp.arange(CFG.num_buckets)[:, None])
        changed = jax.tree.map(lambda x: x, params)
        changed["blocks"]["attn"]["rel_bias"] = bias
        assert np.abs(np.asarray(encode_jit(changed, CFG, ids, mask)) - base).max() > 1e-3, layer


def test_one_compile_per_padded_length(params):
    ids = np.zeros((2, 9), np.int32)
    with count_compiles(encode_jit) as new:
        encode_jit(params, CFG, ids, np.ones_like(ids))
        encode_jit(params, CFG, ids + 3, np.ones_like(ids))
        assert new() == 1
        encode_jit(params, CFG, np.zeros((2, 11), np.int32), np.ones((2, 11), np.int32))
        assert new() == 2


def test_bf16_params_keep_f32_statistics(params):
    ids = np.arange(12)[None] % CFG.vocab_size
    mask = np.ones_like(ids)
    ref = np.asarray(encode_jit(params, CFG, ids, mask))
    low = encode_jit(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), CFG, ids, mask)
    assert low.dtype == jnp.bfloat16
    rel = np.linalg.norm(np.asarray(low, np.float32) - ref) / np.linalg.norm(ref)
    assert 0 < rel < 0.05, rel


def test_bad_ids_and_masks_are_refused(params):
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 64\)"):
        check_ids(np.array([[1, 64]]), np.ones((1, 2)), CFG)
    with pytest.raises(ValueError, match="at least one token"):
        check_ids(np.array([[1, 2]]), np.array([[1, 1]]) * np.array([[0], [1]])[:1], CFG)
    with pytest.raises(ValueError, match="must both be"):
        encode(params, CFG, np.zeros((2, 3), np.int32), np.ones((2, 4)))


# ------------------------------------------------------------------ cleaning and tokenization

CLEAN_CASES = {
    # input: what Wan's cleaning gives, worked out by hand from its steps
    "  a  red\t\tfox \n\n jumps ": "a red fox jumps",
    "no\u00a0break\u3000ideographic\u2003em": "no break ideographic em",
    "&amp;lt;b&amp;gt; tom &amp; jerry": "<b> tom & jerry",
    "&amp;amp;amp; three deep": "& three deep",  # ftfy's own unescape, then Wan's two
    "<b>&amp;amp;amp;</b>": "<b>&amp;</b>",  # ...which ftfy skips when the text holds '<'
    "fish &amp;chips": "fish &chips",
    "\u201cquoted\u201d and \u2018single\u2019": "\"quoted\" and 'single'",
    "\uff26\uff55\uff4c\uff4c\uff57\uff49\uff44\uff54\uff48 \ufb01ne \ufb02ow": "Fullwidth fine flow",
    "caf\u00c3\u00a9 na\u00c3\u00afve \u00e2\u20ac\u201cdash": "caf\u00e9 na\u00efve \u2013dash",
    "already caf\u00e9, stays": "already caf\u00e9, stays",
    "bell\x07 and \x1b[31mred\x1b[0m": "bell and red",
    "e\u0301 composed": "\u00e9 composed",
    "\u65e5\u672c\u8a9e\u3067 \U0001f600": "\u65e5\u672c\u8a9e\u3067 \U0001f600",
}


@pytest.mark.parametrize("text", sorted(CLEAN_CASES))
def test_clean_text_subset(text):
    assert clean_text(text, use_ftfy=False) == CLEAN_CASES[text]


@pytest.mark.parametrize("text", sorted(CLEAN_CASES))
def test_subset_agrees_with_ftfy(text):
    ftfy = pytest.importorskip("ftfy")
    assert fix_text_subset(text) == ftfy.fix_text(text)
    assert clean_text(text, use_ftfy=True) == clean_text(text, use_ftfy=False)


def test_whitespace_set_is_regex_s():
    regex = pytest.importorskip("regex")
    from jaxkv.models.umt5.tokenizer import _WHITESPACE

    chars = "".join(map(chr, range(0x3400))) + "".join(map(chr, range(0xFE00, 0x10000)))
    theirs = {c for c in chars if regex.fullmatch(r"\s", c)}
    ours = {c for c in chars if _WHITESPACE.fullmatch(c)}
    assert ours == theirs and len(ours) >= 20


def test_truncation_keeps_eos_and_pads():
    tok = tiny_tokenizer()
    pieces = tok.pieces("abc d")
    # The tiny vocabulary puts "\u2581c" at 4 + 2 (ord(c) - 0x21) and "c" one after: "\u2581a b c \u2581d".
    word, char = (lambda c: 4 + 2 * (ord(c) - 0x21)), (lambda c: 5 + 2 * (ord(c) - 0x21))
    assert pieces == [word("a"), char("b"), char("c"), word("d")]
    ids, mask, dropped = tok(["abc d", "a" * 30, ""], 8)
    assert list(ids[0]) == pieces + [1, 0, 0, 0] and list(mask[0]) == [1] * 5 + [0] * 3
    assert list(ids[1, -1:]) == [1] and mask[1].all() and dropped == [0, 30 - 7, 0]
    assert list(ids[2]) == [1] + [0] * 7 and list(mask[2]) == [1] + [0] * 7
    assert list(tok(["hello"], 1)[0][0]) == [1]
    with pytest.raises(ValueError, match="list of str"):
        tok("a prompt", 8)


def test_missing_tokenizer_names_every_path(tmp_path):
    with pytest.raises(TokenizerNotFound) as e:
        Tokenizer.from_dir(str(tmp_path))
    for expected in (
        "tokenizer.json",
        "spiece.model",
        os.path.join("google", "umt5-xxl", "spiece.model"),
        os.path.join("tokenizer", "tokenizer.json"),
    ):
        assert os.path.join(str(tmp_path), expected) in str(e.value)


def test_sentencepiece_tokenizer_file_and_bytes(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    data = sentencepiece_model()
    sp = spm.SentencePieceProcessor(model_proto=data)
    (tmp_path / "spiece.model").write_bytes(data)
    tok = Tokenizer.from_dir(str(tmp_path))
    assert (tok.eos_id, tok.pad_id) == (1, 0) and tok.source.endswith("spiece.model")
    prompt = "  a red   fox\non the beach  "
    ids, mask, _ = tok([prompt], 48)
    want = sp.encode("a red fox on the beach") + [1]
    assert list(ids[0, : len(want)]) == want and mask[0].sum() == len(want) and not ids[0, len(want) :].any()
    with pytest.raises(ValueError, match="not a valid sentencepiece model"):
        Tokenizer.from_sentencepiece(b"not a model", source="junk")


# ------------------------------------------------------------------ context and TextEncoder


def test_encode_prompts_zeroes_past_each_length(params):
    tok = tiny_tokenizer()
    cfg = UMT5Config(**{**CFG.to_dict(), "vocab_size": 256})
    p = init_params(cfg, 1)
    prompts = ["ab", "a b c d", "a" * 40]
    ids, mask, _ = tok(prompts, cfg.text_len)
    with pytest.warns(PromptTruncated, match="prompt 2 has 40 pieces"):
        out = encode_prompts(p, cfg, tok, prompts)
    raw = np.asarray(encode_jit(p, cfg, ids, mask))
    assert out.dtype == np.float32 and out.shape == (3, cfg.text_len, cfg.dim)
    for row, n in enumerate(mask.sum(1)):
        np.testing.assert_array_equal(out[row, :n], raw[row, :n])
        assert np.all(out[row, n:] == 0)
        assert n == cfg.text_len or np.abs(raw[row, n:]).max() > 0  # the encoder's own pad outputs are not 0


def test_tiny_text_encoder_feeds_the_tiny_dit():
    from jaxkv.models.wan.config import preset as wan_preset

    enc = TextEncoder.tiny()
    out = enc.encode(["a red fox", "a red fox", "hi"])
    dit = wan_preset("tiny")
    assert out.shape == (3, dit.text_len, dit.text_dim) and out.dtype == np.float32
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(TextEncoder.tiny().encode(["hi"])[0], out[2])  # seeded: reproducible
    assert np.abs(TextEncoder.tiny(seed=1).encode(["hi"])[0] - out[2]).max() > 1e-3


def test_embeddings_cache_and_release(tmp_path):
    cache = str(tmp_path / "cache")
    enc = TextEncoder.tiny(cache_dir=cache)
    first = enc.encode(["a cat", "a dog"])
    files = sorted(os.listdir(cache))
    assert len(files) == 2 and all(f.endswith(".npy") for f in files)  # no temporaries left behind
    leaves = jax.tree.leaves(enc._params)
    enc.release()
    assert enc.released and all(leaf.is_deleted() for leaf in leaves)
    np.testing.assert_array_equal(enc.encode(["a dog", "a cat"]), first[::-1])  # served from disk
    with pytest.raises(RuntimeError, match="released; 1 prompt"):
        enc.encode(["a bird"])
    # Another process / instance shares it; a different encoder does not.
    assert TextEncoder.tiny(cache_dir=cache).cache_key("a cat") == enc.cache_key("a cat")
    assert TextEncoder.tiny(seed=2, cache_dir=cache).cache_key("a cat") != enc.cache_key("a cat")
    with open(os.path.join(cache, files[0]), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(CacheError, match="unreadable"):
        TextEncoder.tiny(cache_dir=cache).encode(["a cat", "a dog"])


def test_checkpoint_round_trip_and_errors(tmp_path, params):
    from tokenizers import Tokenizer as HFTokenizer

    from jaxkv.models.umt5.tokenizer import tiny_tokenizer_json

    cfg = preset("tiny")
    p = init_params(cfg, 3)
    fp = checkpoint.save(
        str(tmp_path / "enc"), cfg, p, tokenizer_files={"tokenizer.json": tiny_tokenizer_json().encode()}
    )
    assert fp == checkpoint.params_fingerprint(str(tmp_path / "enc" / "params.safetensors"))
    enc = TextEncoder.load(str(tmp_path / "enc"))
    assert enc.fingerprint == fp and enc.config == cfg
    ref = TextEncoder(
        cfg, p, Tokenizer.from_tokenizers(HFTokenizer.from_str(tiny_tokenizer_json()), source="x"), fingerprint="x"
    ).encode(["a cat"])
    np.testing.assert_array_equal(enc.encode(["a cat"]), ref)
    with pytest.raises(FileExistsError):
        checkpoint.save(str(tmp_path / "enc"), cfg, p)
    bad = dict(flatten(p))
    bad.pop("final_norm.scale")
    with pytest.raises(ValueError, match="missing keys"):
        checkpoint.save(str(tmp_path / "bad"), cfg, bad)
    assert not (tmp_path / "bad").exists()
    os.remove(tmp_path / "enc" / "tokenizer.json")
    with pytest.raises(TokenizerNotFound, match="looked for"):
        TextEncoder.load(str(tmp_path / "enc"))
    from jaxkv.models.wan import checkpoint as wan_checkpoint
    from jaxkv.models.wan.config import preset as wan_preset

    (tmp_path / "dit").mkdir()  # a Wan DiT checkpoint's config.json (its params are not read first)
    (tmp_path / "dit" / "config.json").write_text(wan_checkpoint.config_json(wan_preset("tiny")))
    with pytest.raises(CheckpointError, match="not a jaxkv umT5 config.*'jaxkv-wan'"):
        TextEncoder.load(str(tmp_path / "dit"), tokenizer=tiny_tokenizer())


def test_tokenizer_must_fit_the_encoder(params):
    with pytest.raises(ValueError, match="192 pieces, more than the encoder's vocabulary of 64"):
        TextEncoder(CFG, params, tiny_tokenizer(), fingerprint="x")


# ------------------------------------------------------------------ conversion without torch


def test_convert_single_file_with_embedded_sentencepiece(tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    from jaxkv.convert import umt5 as conv
    from jaxkv.convert.errors import ConversionError
    from jaxkv.convert.umt5 import convert_umt5, is_umt5_source

    monkeypatch.setattr(conv, "PIECE_BYTES", 200)  # the embedding then goes out in many row blocks

    data = sentencepiece_model()
    cfg = UMT5Config(**{**CFG.to_dict(), "vocab_size": 40, "max_distance": 128, "text_len": 512})
    p = init_params(cfg, 4)
    tensors = wan_layout(p, cfg)
    tensors["spiece_model"] = np.frombuffer(data, np.uint8).copy()
    save_file(tensors, str(tmp_path / "umt5.safetensors"))
    assert is_umt5_source(str(tmp_path / "umt5.safetensors"))
    plan = convert_umt5(str(tmp_path / "umt5.safetensors"), str(tmp_path / "out"), dtype="f32")
    assert plan.config == cfg and plan.skipped == ["spiece_model"] and "spiece_model" in plan.tokenizer_origin
    assert (tmp_path / "out" / "spiece.model").read_bytes() == data
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["fingerprint"] == checkpoint.params_fingerprint(str(tmp_path / "out" / "params.safetensors"))
    enc = TextEncoder.load(str(tmp_path / "out"))
    ids, mask, _ = enc.tokenizer(["a red fox"], 512)
    np.testing.assert_array_equal(
        np.asarray(encode_jit(enc._params, cfg, ids, mask)), np.asarray(encode_jit(p, cfg, ids, mask))
    )
    # A missing tensor is named, and nothing is written.
    tensors.pop("blocks.1.ffn.fc1.weight")
    save_file(tensors, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ConversionError, match="missing blocks.ffn.up.kernel of layer 1"):
        convert_umt5(str(tmp_path / "broken.safetensors"), str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()
    with pytest.raises(ConversionError, match="already exists"):
        convert_umt5(str(tmp_path / "umt5.safetensors"), str(tmp_path / "out"))


def test_docs_text_encoder_example_runs(tmp_path, monkeypatch):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "wan.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "TextEncoder.tiny(" in b)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "docs/wan.md", "exec"), scope)
    assert scope["context"].shape == (2, 16, 32) and scope["enc"].released
    np.testing.assert_array_equal(np.load(tmp_path / "prompt_embeds.npy"), scope["context"][0])
    assert len(os.listdir(tmp_path / "embeddings-cache")) == 2


def test_without_ftfy_the_subset_is_used_and_keyed(monkeypatch):
    import importlib.util
    import sys

    from jaxkv.models.umt5.tokenizer import fix_text

    enc = TextEncoder.tiny()
    monkeypatch.setitem(sys.modules, "ftfy", None)  # `import ftfy` now raises ImportError
    text = "\u00c3 la carte"  # ftfy reads 'Ã ' as a mangled 'à'; the subset leaves it
    assert fix_text(text) == fix_text_subset(text) == text
    with pytest.raises(ImportError, match=r"jaxkv\[text\]"):
        clean_text("x", use_ftfy=True)
    key_subset = enc.cache_key("a cat")
    monkeypatch.undo()
    if importlib.util.find_spec("ftfy") is not None:
        # Different cleaning can give different ids: the embeddings cache must not mix them.
        assert enc.cache_key("a cat") != key_subset
