"""umT5 against the PyTorch references: `transformers.UMT5EncoderModel` (f32, every parameter re-randomised) for the
encoder, the bucket function and both converter layouts; Wan's wrapper logic (trim each prompt to its length, pad
back with zeros) for the context; `transformers`' fast tokenizer after Wan's cleaning for the ids.

The original-layout fixture spells Wan's key names out by hand (`wan_state_dict`), independently of
jaxkv/convert/umt5.py's table.
"""

from __future__ import annotations

import html
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from jaxkv.convert.errors import ConversionError
from jaxkv.convert.umt5 import convert_umt5, is_umt5_source, plan_umt5_conversion
from jaxkv.models.umt5 import TextEncoder, UMT5Config, encode, encode_prompts, relative_buckets
from jaxkv.models.umt5.params import unflatten
from jaxkv.models.umt5.tokenizer import Tokenizer

pytestmark = pytest.mark.torch

# head_dim * heads (15) != dim (24), ffn != dim, 3 layers, few buckets and a short max_distance so the 30-token
# prompts reach the logarithmic buckets and the clamp.
HF_KW = dict(
    vocab_size=300,
    d_model=24,
    d_kv=5,
    d_ff=40,
    num_layers=3,
    num_heads=3,
    relative_attention_num_buckets=10,
    relative_attention_max_distance=20,
    dropout_rate=0.0,
    feed_forward_proj="gated-gelu",
    pad_token_id=0,
    eos_token_id=1,
)
CFG = UMT5Config(
    vocab_size=300,
    dim=24,
    ffn_dim=40,
    num_heads=3,
    head_dim=5,
    num_layers=3,
    num_buckets=10,
    max_distance=20,
    text_len=30,
)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = transformers.UMT5EncoderModel(transformers.UMT5Config(**HF_KW)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Every parameter re-randomised (norm weights around 1, the rest N(0, 0.4)): nothing left at init.
            p.copy_(1 + 0.2 * torch.randn_like(p) if "layer_norm" in name else 0.4 * torch.randn_like(p))
    return model


def hf_to_jaxkv(sd: dict) -> dict:
    """The jaxkv layout from a Hugging Face state dict, written out by hand for the test."""
    L = CFG.num_layers
    a = lambda k: sd[k].detach().numpy()
    stack = lambda f: np.stack([f(i) for i in range(L)])
    blk = "encoder.block.{}.layer."
    flat = {
        "embedding": a("shared.weight"),
        "final_norm.scale": a("encoder.final_layer_norm.weight"),
        "blocks.norm1.scale": stack(lambda i: a(blk.format(i) + "0.layer_norm.weight")),
        "blocks.norm2.scale": stack(lambda i: a(blk.format(i) + "1.layer_norm.weight")),
        "blocks.attn.rel_bias": stack(lambda i: a(blk.format(i) + "0.SelfAttention.relative_attention_bias.weight")),
    }
    for p in "qkvo":
        flat[f"blocks.attn.{p}.kernel"] = stack(lambda i: a(blk.format(i) + f"0.SelfAttention.{p}.weight").T)  # noqa: B023 - called in the iteration that defines it
    for ours, theirs in (("gate", "wi_0"), ("up", "wi_1"), ("down", "wo")):
        flat[f"blocks.ffn.{ours}.kernel"] = stack(lambda i: a(blk.format(i) + f"1.DenseReluDense.{theirs}.weight").T)  # noqa: B023 - called in the iteration that defines it
    return unflatten(flat)


def wan_state_dict(sd: dict) -> dict:
    """The same weights under Wan's original names (wan/modules/t5.py T5Encoder), spelled out by hand."""
    out = {"token_embedding.weight": sd["shared.weight"], "norm.weight": sd["encoder.final_layer_norm.weight"]}
    for i in range(CFG.num_layers):
        h, w = f"encoder.block.{i}.layer.", f"blocks.{i}."
        out[w + "norm1.weight"] = sd[h + "0.layer_norm.weight"]
        out[w + "norm2.weight"] = sd[h + "1.layer_norm.weight"]
        for p in "qkvo":
            out[w + f"attn.{p}.weight"] = sd[h + f"0.SelfAttention.{p}.weight"]
        out[w + "pos_embedding.embedding.weight"] = sd[h + "0.SelfAttention.relative_attention_bias.weight"]
        out[w + "ffn.gate.0.weight"] = sd[h + "1.DenseReluDense.wi_0.weight"]
        out[w + "ffn.fc1.weight"] = sd[h + "1.DenseReluDense.wi_1.weight"]
        out[w + "ffn.fc2.weight"] = sd[h + "1.DenseReluDense.wo.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def batch(lengths, width, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, (len(lengths), width))
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n - 1] = 1
        ids[row, n:] = 0
    return ids, mask


def hf_hidden(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()


def test_buckets_equal_transformers(hf_model):
    attn = hf_model.encoder.block[0].layer[0].SelfAttention
    for n in (1, 7, 64, 700):
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        np.testing.assert_array_equal(relative_buckets(n, CFG), attn._relative_position_bucket(rel).numpy())
    # The real configuration, to text_len 512.
    real = transformers.UMT5Config(relative_attention_num_buckets=32, relative_attention_max_distance=128)
    real_attn = type(attn)(real, has_relative_attention_bias=True)
    rel = torch.arange(512)[None, :] - torch.arange(512)[:, None]
    ours = relative_buckets(512, UMT5Config(vocab_size=8, dim=8, ffn_dim=8, num_heads=1, head_dim=8, num_layers=1))
    np.testing.assert_array_equal(ours, real_attn._relative_position_bucket(rel).numpy())


def test_encoder_matches_transformers_with_padding(hf_model):
    ids, mask = batch([30, 17, 5, 1], 30)
    ref = hf_hidden(hf_model, ids, mask)
    out = np.asarray(encode(hf_to_jaxkv(hf_model.state_dict()), CFG, ids, mask))
    assert out.dtype == np.float32 and out.shape == (4, 30, CFG.dim)
    valid = mask.astype(bool)
    np.testing.assert_allclose(out[valid], ref[valid], atol=1e-4, rtol=1e-4)
    # Padded query rows too (they attend to the valid keys only in both).
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert np.abs(ref).max() > 0.5  # a meaningful comparison, not two near-zero arrays


def test_context_equals_wan_trim_and_zero_pad(hf_model):
    """Wan: context = [u[:len] for u in encoder(ids, mask)], then the DiT pads each back to text_len with zeros."""
    tok = small_tokenizer()
    prompts = ["a cat", "a dog runs   on the   beach at dusk", "x"]
    ids, mask = reference_ids(tok, prompts, CFG.text_len)
    hidden = torch.tensor(hf_hidden(hf_model, ids, mask))
    lens = torch.tensor(mask).gt(0).sum(dim=1).long()
    trimmed = [u[:v] for u, v in zip(hidden, lens)]
    ref = torch.stack([torch.cat([u, u.new_zeros(CFG.text_len - u.size(0), u.size(1))]) for u in trimmed]).numpy()
    params = hf_to_jaxkv(hf_model.state_dict())
    out = encode_prompts(params, CFG, Tokenizer.from_tokenizers(tok, source="test"), prompts)
    assert out.dtype == np.float32 and out.shape == (3, CFG.text_len, CFG.dim)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    for row, n in enumerate(lens.tolist()):
        assert np.all(out[row, n:] == 0.0) and np.all(np.abs(out[row, :n]).sum(-1) > 0)


# ------------------------------------------------------------------ tokenizer vs transformers + Wan's cleaning


def small_tokenizer():
    """A word-level-ish unigram tokenizer built here with `tokenizers`: specials at Wan's ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    words = [
        "\u2581a",
        "\u2581cat",
        "\u2581dog",
        "\u2581runs",
        "\u2581on",
        "\u2581the",
        "\u2581beach",
        "\u2581at",
        "\u2581dusk",
        "\u2581caf\u00e9",
        "\u2581\u65e5\u672c",
        "\u2581&",
        '\u2581"',
        "\u2581'",
        "\u2581",
        "\u00e9",
    ]
    chars = [chr(c) for c in range(0x21, 0x7F)]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(w, -1.0) for w in words]
    vocab += [(c, -5.0) for c in chars] + [("\u2581" + c, -4.0) for c in chars]
    tok = HFTokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    assert tok.get_vocab_size() < CFG.vocab_size
    return tok


def wan_clean(text: str) -> str:
    """Wan's HuggingfaceTokenizer._clean('whitespace'), restated with the libraries it uses."""
    ftfy = pytest.importorskip("ftfy")
    regex = pytest.importorskip("regex")
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return regex.sub(r"\s+", " ", text).strip()


def reference_ids(tok, prompts, text_len):
    """Wan's HuggingfaceTokenizer call (padding to max_length, truncation, special tokens) via transformers."""
    from tokenizers import processors

    # What the google/umt5-xxl tokenizer.json post-processor does: append </s>.
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    enc = fast(
        [wan_clean(p) for p in prompts],
        padding="max_length",
        truncation=True,
        max_length=text_len,
        add_special_tokens=True,
        return_tensors="np",
    )
    tok.post_processor = None
    return enc["input_ids"], enc["attention_mask"]


def test_tokenizer_ids_equal_the_reference_wrapper():
    tok = small_tokenizer()
    prompts = [
        "a cat",
        "  a\tcat \n\n on\u00a0the   beach\u3000at dusk  ",  # repeated / unicode whitespace
        "caf\u00c3\u00a9 &amp;amp; \u201cthe\u201d dog\u2019s \uff21",  # mojibake, HTML, curly quotes, full width
        "\u65e5\u672c \u00e9 \u2603 \U0001f600 a",  # CJK, unknown symbols, emoji
        " ".join(["a cat"] * 40),  # over-long: truncated, eos kept
        "",  # empty: just </s>
    ]
    ref_ids, ref_mask = reference_ids(tok, prompts, CFG.text_len)
    ours = Tokenizer.from_tokenizers(tok, source="test")
    ids, mask, dropped = ours(prompts, CFG.text_len)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert ids[4, -1] == 1 and mask[4].all() and dropped[4] == 80 - (CFG.text_len - 1)
    assert dropped[:4] == [0, 0, 0, 0] and list(ids[5, :2]) == [1, 0]


# ------------------------------------------------------------------ converters: both layouts, both errors


def write_tokenizer_json(folder):
    os.makedirs(folder, exist_ok=True)
    small_tokenizer().save(os.path.join(folder, "tokenizer.json"))


@pytest.mark.slow
def test_convert_wan_pth_then_load_matches_transformers(hf_model, tmp_path):
    release = tmp_path / "Wan2.1-T2V-1.3B"
    release.mkdir()
    torch.save(wan_state_dict(hf_model.state_dict()), release / "models_t5_umt5-xxl-enc-bf16.pth")
    write_tokenizer_json(release / "google" / "umt5-xxl")
    src = str(release / "models_t5_umt5-xxl-enc-bf16.pth")
    assert is_umt5_source(src)
    # The Wan layout does not store max_distance (Wan's code fixes 128): the default, unless given.
    assert plan_umt5_conversion(src, text_len=CFG.text_len).config.max_distance == 128
    plan = convert_umt5(src, str(tmp_path / "t5"), dtype="f32", text_len=CFG.text_len, max_distance=20)
    assert plan.layout == "wan" and plan.config == CFG, plan.config
    assert sorted(os.listdir(tmp_path / "t5")) == ["config.json", "params.safetensors", "tokenizer.json"]
    enc = TextEncoder.load(str(tmp_path / "t5"))
    ids, mask = batch([30, 9, 2], 30)
    ref = hf_hidden(hf_model, ids, mask)
    out = np.asarray(encode(enc._params, enc.config, ids, mask))
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("embeddings", ["both", "shared", "embed_tokens"])
def test_convert_hf_sharded_matches_transformers(hf_model, tmp_path, embeddings):
    from safetensors.torch import save_file

    folder = tmp_path / "text_encoder"
    hf_model.save_pretrained(folder, max_shard_size="20KB")  # several shards + index
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    if embeddings != "both":
        # Rewrite so exactly one of the tied names is stored (as different exporters do).
        keep, drop = (
            ("shared.weight", "encoder.embed_tokens.weight")
            if embeddings == "shared"
            else ("encoder.embed_tokens.weight", "shared.weight")
        )
        sd = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != drop}
        sd[keep] = hf_model.state_dict()["shared.weight"].clone()
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        save_file(sd, folder / "model.safetensors")
    write_tokenizer_json(tmp_path / "tokenizer")  # diffusers pipelines keep it in a sibling folder
    assert is_umt5_source(str(folder))
    plan = convert_umt5(str(folder), str(tmp_path / "t5"), dtype="f32", text_len=CFG.text_len)
    assert plan.layout == "hf" and plan.config == CFG
    enc = TextEncoder.load(str(tmp_path / "t5"))
    ids, mask = batch([30, 4], 30, seed=1)
    np.testing.assert_allclose(
        np.asarray(encode(enc._params, enc.config, ids, mask)), hf_hidden(hf_model, ids, mask), atol=1e-4, rtol=1e-4
    )


@pytest.mark.slow
def test_convert_bf16_and_fingerprint(hf_model, tmp_path):
    from jaxkv.models.umt5 import checkpoint

    torch.save(wan_state_dict(hf_model.state_dict()), tmp_path / "t5.pth")
    write_tokenizer_json(tmp_path)
    convert_umt5(str(tmp_path / "t5.pth"), str(tmp_path / "out"), text_len=CFG.text_len, max_distance=20)
    config, params, meta = checkpoint.load(str(tmp_path / "out"))
    assert str(params["embedding"].dtype) == "bfloat16"
    assert meta["fingerprint"] == checkpoint.params_fingerprint(str(tmp_path / "out" / "params.safetensors"))
    ids, mask = batch([30, 12], 30)
    out = np.asarray(encode(params, config, ids, mask)).astype(np.float32)
    ref = hf_hidden(hf_model, ids, mask)
    # The yardstick for bf16: the PyTorch reference itself run in bf16 (as Wan runs it). Ours keeps f32
    # accumulation, norms and softmax, so it must not stray further from the f32 result than that.
    import copy

    with torch.no_grad():
        ref_bf16 = (
            copy.deepcopy(hf_model)
            .to(torch.bfloat16)(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
            .last_hidden_state.float()
            .numpy()
        )
    valid = mask.astype(bool)
    rel = lambda a: np.linalg.norm(a[valid] - ref[valid]) / np.linalg.norm(ref[valid])
    assert 0 < rel(out) <= 1.25 * rel(ref_bf16), (rel(out), rel(ref_bf16))


def test_plain_t5_and_dit_are_refused_and_nothing_written(tmp_path):
    from safetensors.numpy import save_file

    t5 = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu"
        )
    )
    t5.save_pretrained(tmp_path / "t5")
    write_tokenizer_json(tmp_path / "t5")
    assert is_umt5_source(str(tmp_path / "t5"))  # routed here, then refused with the reason
    with pytest.raises(ConversionError, match="model_type 't5'"):
        plan_umt5_conversion(str(tmp_path / "t5"))
    os.remove(tmp_path / "t5" / "config.json")
    with pytest.raises(ConversionError, match="only layer 0 has a relative_attention_bias"):
        plan_umt5_conversion(str(tmp_path / "t5"))
    with pytest.raises(ConversionError, match="only layer 0"):
        convert_umt5(str(tmp_path / "t5"), str(tmp_path / "out"))
    dit = tmp_path / "dit.safetensors"
    save_file(
        {
            "patch_embedding.weight": np.zeros((8, 4, 1, 2, 2), np.float32),
            "blocks.0.self_attn.q.weight": np.zeros((8, 8), np.float32),
        },
        str(dit),
    )
    assert not is_umt5_source(str(dit))
    with pytest.raises(ConversionError, match="Wan DiT checkpoint, not a text encoder"):
        convert_umt5(str(dit), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]
