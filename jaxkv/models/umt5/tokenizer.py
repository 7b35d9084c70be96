"""Prompts -> token ids the way Wan's text-encoder wrapper makes them.

Wan (``wan/modules/tokenizers.py``, ``HuggingfaceTokenizer(seq_len=text_len, clean='whitespace')``) cleans each
prompt with ``ftfy.fix_text``, unescapes HTML twice, collapses every run of Unicode whitespace to one space and
strips; then the ``google/umt5-xxl`` tokenizer appends ``</s>``, truncates to ``text_len`` keeping ``</s>`` last,
and right-pads with ``<pad>`` (attention mask 0).

ftfy is an optional dependency (``pip install 'jaxkv[text]'``): when it is installed `clean_text` calls
``ftfy.fix_text`` itself, exactly as Wan does. Without it, `fix_text_subset` applies the parts of ftfy's default
pipeline that change real prompts: curly quotes to straight ones, Latin ligatures, full-width forms, ANSI escapes,
control characters, NFC, one HTML unescape (unless the text holds '<'), and the commonest mojibake (UTF-8 read as
Windows-1252 or Latin-1, repaired once).
`tests/test_umt5_tokenizer.py` checks the subset against ftfy on those cases; rarer repairs (nested or partial
mojibake, lossy sequences) are only done by ftfy.

Tokenizer files are read, never downloaded: ``tokenizer.json`` with the ``tokenizers`` library, ``spiece.model``
with ``sentencepiece``, or the sentencepiece model stored as a uint8 tensor inside a checkpoint.
"""

from __future__ import annotations

import html
import os
import re
import unicodedata
from typing import Sequence

import numpy as np

from jaxkv.validate import check_int

TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
# Where a Wan release, a diffusers pipeline or a jaxkv checkpoint keeps them, relative to the directory given.
TOKENIZER_SUBDIRS = ("", "tokenizer", os.path.join("google", "umt5-xxl"), os.path.join("..", "tokenizer"))

# Unicode White_Space, which is what Wan's ``regex`` ``\s`` matches (Python's ``re`` would add U+001C..U+001F).
_WHITESPACE = re.compile("[\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")

# ftfy's default-pipeline tables, restated: quotes, ligatures, widths, terminal escapes and control characters.
_SINGLE_QUOTES = re.compile("[\u02bc\u2018-\u201b]")
_DOUBLE_QUOTES = re.compile("[\u201c-\u201f]")
_ANSI = re.compile("\x1b\\[((?:\\d|;)*)([a-zA-Z])")
_LIGATURES = {
    c: unicodedata.normalize("NFKC", chr(c))
    for c in (*range(0x0132, 0x0134), 0x0149, *range(0x01C4, 0x01CD), *range(0x01F1, 0x01F4), *range(0xFB00, 0xFB07))
}
_LIGATURES[0xFB05] = "\u017ft"  # long-s + t: ftfy keeps the long s, NFKC would not
_WIDTH = {
    0x3000: " ",
    **{
        c: unicodedata.normalize("NFKC", chr(c))
        for c in range(0xFF01, 0xFFF0)
        if unicodedata.normalize("NFKC", chr(c)) != chr(c)
    },
}
_CONTROL = {
    c: None
    for c in (
        *range(0x00, 0x09),
        0x0B,
        *range(0x0E, 0x20),
        0x7F,
        *range(0x206A, 0x2070),
        0xFEFF,
        *range(0xFFF9, 0xFFFD),
    )
}
# Mojibake: UTF-8 bytes shown through Windows-1252 (or Latin-1, for cp1252's five undefined bytes). Each
# character of such text stands for one byte; a lead byte C2..F4 followed by its continuation bytes 80..BF is one
# misread character, repaired in place (so correct accented text around it is left alone).
_BYTE_OF: dict[str, int] = {}
for _b in range(0x80, 0x100):
    _BYTE_OF[chr(_b)] = _b
    try:
        _BYTE_OF[bytes([_b]).decode("cp1252")] = _b
    except UnicodeDecodeError:
        pass
_CONT = "".join(re.escape(c) for c, b in _BYTE_OF.items() if 0x80 <= b <= 0xBF)
_MOJIBAKE = re.compile(f"[\u00c2-\u00df][{_CONT}]|[\u00e0-\u00ef][{_CONT}]{{2}}|[\u00f0-\u00f4][{_CONT}]{{3}}")


def _repair_one(match: re.Match) -> str:
    try:
        return bytes(_BYTE_OF[c] for c in match.group()).decode("utf-8")
    except UnicodeDecodeError:
        return match.group()


def _repair_mojibake(text: str) -> str:
    """Undoes one round of 'UTF-8 bytes decoded as cp1252 / latin-1', sequence by sequence."""
    return _MOJIBAKE.sub(_repair_one, text)


def fix_text_subset(text: str) -> str:
    """The parts of ``ftfy.fix_text`` (default config) that matter for prompts, without ftfy (module docstring).
    Like ftfy, the steps repeat until the text stops changing."""
    markup = "<" in text  # ftfy decides once: entities are unescaped only in text that does not look like HTML
    while True:
        before = text
        if not markup:
            text = html.unescape(text)
        text = _ANSI.sub("", text)
        text = _repair_mojibake(text)
        text = text.translate(_LIGATURES).translate(_WIDTH)
        text = _DOUBLE_QUOTES.sub('"', _SINGLE_QUOTES.sub("'", text))
        text = text.translate(_CONTROL)
        text = unicodedata.normalize("NFC", text)
        if text == before:
            return text


def fix_text(text: str) -> str:
    """``ftfy.fix_text`` when ftfy is installed, else `fix_text_subset`."""
    try:
        import ftfy
    except ImportError:
        return fix_text_subset(text)
    return ftfy.fix_text(text)


def clean_text(text: str, *, use_ftfy: bool | None = None) -> str:
    """Wan's ``clean='whitespace'``: fix_text, HTML-unescape twice, strip, collapse whitespace runs, strip.

    ``use_ftfy`` None uses ftfy when installed; False forces the built-in subset; True requires ftfy.
    """
    if not isinstance(text, str):
        raise ValueError(f"a prompt must be a str, got {type(text).__name__}")
    if use_ftfy is None:
        text = fix_text(text)
    elif use_ftfy:
        try:
            import ftfy
        except ImportError:
            raise ImportError("use_ftfy=True needs ftfy (pip install 'jaxkv[text]')") from None
        text = ftfy.fix_text(text)
    else:
        text = fix_text_subset(text)
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE.sub(" ", text).strip()


class TokenizerNotFound(FileNotFoundError):
    """No tokenizer file where one was looked for; the message lists every path tried."""


class Tokenizer:
    """A umT5 tokenizer (``tokenizers`` or ``sentencepiece`` backend) with Wan's cleaning and special tokens.

    Attributes:
      source: where it was loaded from (for messages and the embeddings-cache key).
      eos_id, pad_id: ids of ``</s>`` and ``<pad>``.
      vocab_size: number of pieces.
    """

    def __init__(
        self,
        encode_pieces,
        *,
        eos_id: int,
        pad_id: int,
        vocab_size: int,
        source: str,
        digest: str,
        use_ftfy: bool | None = None,
    ):
        self._encode_pieces = encode_pieces
        self.eos_id, self.pad_id, self.vocab_size = int(eos_id), int(pad_id), int(vocab_size)
        self.source, self.digest, self.use_ftfy = source, digest, use_ftfy

    # -- constructors

    @classmethod
    def from_tokenizers(cls, tok, *, source: str, digest: str | None = None, **kw) -> "Tokenizer":
        """Wraps a ``tokenizers.Tokenizer`` whose vocabulary holds ``</s>`` and ``<pad>``."""
        ids = {name: tok.token_to_id(name) for name in ("</s>", "<pad>")}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"{source}: the tokenizer has no {missing} token; a umT5 tokenizer has '</s>' and '<pad>'")
        if digest is None:
            import hashlib

            digest = hashlib.sha256(tok.to_str().encode()).hexdigest()
        return cls(
            lambda text: tok.encode(text, add_special_tokens=False).ids,
            eos_id=ids["</s>"],
            pad_id=ids["<pad>"],
            vocab_size=tok.get_vocab_size(),
            source=source,
            digest=digest,
            **kw,
        )

    @classmethod
    def from_sentencepiece(cls, model_proto: bytes, *, source: str, **kw) -> "Tokenizer":
        """A serialized sentencepiece model (the bytes of ``spiece.model``)."""
        import hashlib

        try:
            import sentencepiece
        except ImportError:
            raise ImportError(
                f"{source} is a sentencepiece model; reading it needs sentencepiece (pip install sentencepiece)"
            ) from None
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(bytes(model_proto))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{source} is not a valid sentencepiece model ({e})") from None
        eos, pad = sp.eos_id(), sp.pad_id()
        if eos < 0 or pad < 0:
            raise ValueError(f"{source}: the sentencepiece model defines no eos/pad id (eos {eos}, pad {pad})")
        return cls(
            lambda text: sp.encode(text, out_type=int),
            eos_id=eos,
            pad_id=pad,
            vocab_size=sp.get_piece_size(),
            source=source,
            digest=hashlib.sha256(model_proto).hexdigest(),
            **kw,
        )

    @classmethod
    def from_file(cls, path: str, **kw) -> "Tokenizer":
        """``tokenizer.json`` (tokenizers) or a sentencepiece ``.model`` file."""
        if not os.path.isfile(path):
            raise TokenizerNotFound(f"tokenizer file {path} does not exist")
        if path.endswith(".json"):
            import hashlib

            from tokenizers import Tokenizer as HFTokenizer

            with open(path, "rb") as f:
                raw = f.read()
            try:
                tok = HFTokenizer.from_str(raw.decode("utf-8"))
            except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
                raise ValueError(f"{path} is not a valid tokenizers tokenizer.json ({e})") from None
            return cls.from_tokenizers(tok, source=path, digest=hashlib.sha256(raw).hexdigest(), **kw)
        with open(path, "rb") as f:
            return cls.from_sentencepiece(f.read(), source=path, **kw)

    @classmethod
    def from_dir(cls, directory: str, **kw) -> "Tokenizer":
        """The tokenizer in ``directory`` or where Wan/diffusers keep it beside the weights (`TOKENIZER_SUBDIRS`):
        ``tokenizer.json`` preferred, else ``spiece.model``. TokenizerNotFound lists every path looked at."""
        return cls.from_file(find_tokenizer(directory), **kw)

    # -- use

    def pieces(self, prompt: str) -> list[int]:
        """Ids of the cleaned prompt, without special tokens."""
        return list(self._encode_pieces(clean_text(prompt, use_ftfy=self.use_ftfy)))

    def __call__(self, prompts: Sequence[str], text_len: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Tokenizes a batch to a fixed length.

        Returns:
          ids int32 ``[batch, text_len]``: pieces, ``</s>``, then ``<pad>``; a prompt with more than
          ``text_len - 1`` pieces keeps its first ``text_len - 1`` and ends with ``</s>``.
          mask int32 ``[batch, text_len]``: 1 for pieces and ``</s>``, 0 for padding.
          dropped: per prompt, how many pieces truncation removed (0 when it fit).
        """
        text_len = check_int("text_len", text_len, minimum=1)
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be a list of str")
        if not prompts:
            raise ValueError("prompts is empty")
        ids = np.full((len(prompts), text_len), self.pad_id, np.int32)
        mask = np.zeros((len(prompts), text_len), np.int32)
        dropped = []
        for row, prompt in enumerate(prompts):
            pieces = self.pieces(prompt)
            keep = pieces[: text_len - 1] + [self.eos_id]
            dropped.append(len(pieces) + 1 - len(keep))
            ids[row, : len(keep)] = keep
            mask[row, : len(keep)] = 1
        return ids, mask, dropped


def find_tokenizer(directory: str) -> str:
    """Path of the tokenizer file for ``directory`` (see `Tokenizer.from_dir`)."""
    looked = []
    for sub in TOKENIZER_SUBDIRS:
        for name in TOKENIZER_FILES:
            path = os.path.normpath(os.path.join(directory, sub, name))
            looked.append(path)
            if os.path.isfile(path):
                return path
    raise TokenizerNotFound(
        f"no umT5 tokenizer found for {directory}: looked for {', '.join(looked)}. Copy the "
        f"tokenizer files of the Wan release (google/umt5-xxl/tokenizer.json or spiece.model) "
        f"there; jaxkv never downloads them"
    )


def tiny_tokenizer_json() -> str:
    """The embedded default's tokenizer as ``tokenizer.json`` text, built with ``tokenizers`` (no download).

    A unigram model over printable ASCII: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, ``\u2581`` (word start) 3, then per
    character c ``\u2581c`` (word-initial) and ``c``: 192 pieces, fitting the ``tiny`` encoder's vocab of 256.
    Other characters become ``<unk>``.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -4.0)]
    for c in map(chr, range(0x21, 0x7F)):
        vocab += [("\u2581" + c, -2.0), (c, -3.0)]
    tok = HFTokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return tok.to_str()


def tiny_tokenizer() -> Tokenizer:
    """The embedded default's tokenizer (`tiny_tokenizer_json`), in memory."""
    import hashlib

    from tokenizers import Tokenizer as HFTokenizer

    text = tiny_tokenizer_json()
    return Tokenizer.from_tokenizers(
        HFTokenizer.from_str(text), source="embedded tiny tokenizer", digest=hashlib.sha256(text.encode()).hexdigest()
    )
