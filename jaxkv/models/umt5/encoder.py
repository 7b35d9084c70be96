"""Prompts -> the context Wan feeds its DiT, and `TextEncoder`, the object a CLI holds.

Wan's ``T5EncoderModel.__call__`` tokenizes to ``text_len`` (512) with padding, encodes, and returns each prompt's
hidden states cut to its own length (pieces + ``</s>``); the DiT's forward then pads every one back to ``text_len``
with zeros (``torch.cat([u, u.new_zeros(text_len - len(u), dim)])``; Self-Forcing's wrapper writes the zeros in
place). `encode_prompts` returns that padded array directly: the encoder's output where the mask is 1, exact zeros
after, float32 ``[batch, text_len, dim]`` — what ``jaxkv generate --context`` takes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models.umt5 import checkpoint
from jaxkv.models.umt5.config import UMT5Config, preset
from jaxkv.models.umt5.model import check_ids, encode
from jaxkv.models.umt5.params import init_params
from jaxkv.models.umt5.tokenizer import Tokenizer, tiny_tokenizer
from jaxkv.validate import check_int


class PromptTruncated(UserWarning):
    """A prompt had more than ``text_len - 1`` pieces; the tail was dropped (``</s>`` kept), as Wan does."""


def _encode_masked(params, config: UMT5Config, ids, mask):
    out = encode(params, config, ids, mask)
    return jnp.where(mask[..., None].astype(bool), out.astype(jnp.float32), 0.0)


# One compilation per (config, batch, params dtype); every prompt is padded to config.text_len.
encode_masked_jit = jax.jit(_encode_masked, static_argnames=("config",))


def check_tokenizer(tokenizer: Tokenizer, config: UMT5Config) -> None:
    """The tokenizer's special ids and vocabulary must be the encoder's."""
    if (tokenizer.eos_id, tokenizer.pad_id) != (config.eos_id, config.pad_id):
        raise ValueError(
            f"{tokenizer.source}: eos/pad ids ({tokenizer.eos_id}, {tokenizer.pad_id}) differ from the "
            f"encoder's ({config.eos_id}, {config.pad_id}); the tokenizer does not belong to this encoder"
        )
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{tokenizer.source} has {tokenizer.vocab_size} pieces, more than the encoder's vocabulary "
            f"of {config.vocab_size}; the tokenizer does not belong to this encoder"
        )


def encode_prompts(
    params: dict[str, Any], config: UMT5Config, tokenizer: Tokenizer, prompts: Sequence[str]
) -> np.ndarray:
    """Wan's text context for ``prompts``: float32 ``[batch, config.text_len, config.dim]``, zero past each prompt's
    length. A prompt longer than ``text_len - 1`` pieces is truncated with a `PromptTruncated` warning."""
    ids, mask, dropped = tokenizer(prompts, config.text_len)
    for i, n in enumerate(dropped):
        if n:
            warnings.warn(
                f"prompt {i} has {config.text_len - 1 + n} pieces, more than text_len - 1 = "
                f"{config.text_len - 1}; its last {n} were dropped (as Wan's tokenizer truncates)",
                PromptTruncated,
                stacklevel=2,
            )
    check_ids(ids, mask, config)
    return np.asarray(encode_masked_jit(params, config, ids, mask))


class CacheError(RuntimeError):
    """An embeddings-cache entry is unreadable or does not have the expected shape."""


class EmbeddingsCache:
    """One ``.npy`` file per (encoder fingerprint, tokenizer, cleaning, dtype, text_len, prompt), written
    atomically (a temporary file in the same directory, fsynced, renamed over), so a crash never leaves a partial
    entry and concurrent writers of one prompt leave one whole file."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.npy")

    def get(self, key: str, shape: tuple[int, ...]) -> np.ndarray | None:
        path = self.path(key)
        if not os.path.exists(path):
            return None
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise CacheError(f"embeddings-cache entry {path} is unreadable ({e}); delete it to recompute") from None
        if array.shape != shape or array.dtype != np.float32:
            raise CacheError(
                f"embeddings-cache entry {path} is {array.dtype} {array.shape}, expected float32 "
                f"{shape}; delete it to recompute"
            )
        return array

    def put(self, key: str, array: np.ndarray) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, np.ascontiguousarray(array, np.float32), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise


class TextEncoder:
    """A umT5 encoder with its tokenizer: ``encode(prompts) -> float32 [batch, text_len, dim]``.

    Build with `load` (a jaxkv text-encoder checkpoint directory) or `tiny` (the embedded default: a seeded random
    tiny encoder and the in-memory tiny tokenizer, offline). ``cache_dir`` enables an on-disk embeddings cache
    (`EmbeddingsCache`), so a repeated prompt is never encoded twice; `release` frees the weights' device memory
    (cached prompts can still be served afterwards).
    """

    def __init__(
        self,
        config: UMT5Config,
        params: dict[str, Any],
        tokenizer: Tokenizer,
        *,
        fingerprint: str,
        cache_dir: str | None = None,
        name: str = "",
    ):
        check_tokenizer(tokenizer, config)
        self.config, self.tokenizer, self.fingerprint, self.name = config, tokenizer, fingerprint, name
        self._params = params
        self._dtype = str(jnp.asarray(params["embedding"]).dtype)
        self.cache = EmbeddingsCache(cache_dir) if cache_dir is not None else None

    @classmethod
    def load(
        cls, path: str, *, dtype=None, tokenizer: Tokenizer | None = None, cache_dir: str | None = None
    ) -> "TextEncoder":
        """Loads a checkpoint written by `jaxkv.convert.umt5` / `checkpoint.save`; the tokenizer comes from the same
        directory unless given (`tokenizer.TokenizerNotFound` lists where it looked)."""
        tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(path)
        config, params, meta = checkpoint.load(path, dtype=dtype)
        return cls(
            config,
            params,
            tokenizer,
            fingerprint=str(meta.get("fingerprint")),
            cache_dir=cache_dir,
            name=os.path.abspath(path),
        )

    @classmethod
    def tiny(cls, seed: int = 0, *, cache_dir: str | None = None) -> "TextEncoder":
        """The embedded default: the ``tiny`` preset with seeded random float32 weights (feeds the tiny Wan DiT)."""
        seed = check_int("seed", seed, minimum=0)
        config = preset("tiny")
        params = init_params(config, seed)
        return cls(
            config,
            params,
            tiny_tokenizer(),
            fingerprint=f"embedded-tiny-v1-seed{seed}",
            cache_dir=cache_dir,
            name=f"embedded tiny (seed {seed})",
        )

    @property
    def released(self) -> bool:
        return self._params is None

    def release(self) -> None:
        """Deletes the weights' device buffers now (not at garbage collection); encoding new prompts afterwards is
        an error, cached ones are still returned."""
        if self._params is not None:
            for leaf in jax.tree.leaves(self._params):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()
            self._params = None

    def cache_key(self, prompt: str) -> str:
        clean = "ftfy" if self.tokenizer.use_ftfy is not False and _has_ftfy() else "subset"
        fields = [
            checkpoint.FORMAT,
            self.fingerprint,
            self.tokenizer.digest,
            clean,
            self._dtype,
            self.config.text_len,
            prompt,
        ]
        return hashlib.sha256(json.dumps(fields, ensure_ascii=True).encode()).hexdigest()

    def encode(self, prompts: Sequence[str]) -> np.ndarray:
        """float32 ``[len(prompts), text_len, dim]``, zero past each prompt's length (`encode_prompts`)."""
        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts must be a non-empty list of str, got {prompts!r:.80}")
        shape = (self.config.text_len, self.config.dim)
        out: list[np.ndarray | None] = [None] * len(prompts)
        keys = [self.cache_key(p) for p in prompts] if self.cache is not None else [None] * len(prompts)
        if self.cache is not None:
            out = [self.cache.get(k, shape) for k in keys]
        todo = sorted({p for p, o in zip(prompts, out) if o is None})
        if todo:
            if self._params is None:
                raise RuntimeError(
                    f"the text encoder was released; {len(todo)} prompt(s) are not in the embeddings "
                    f"cache and cannot be encoded (load it again)"
                )
            fresh = dict(zip(todo, encode_prompts(self._params, self.config, self.tokenizer, todo)))
            for i, p in enumerate(prompts):
                if out[i] is None:
                    out[i] = fresh[p]
                    if self.cache is not None:
                        self.cache.put(keys[i], fresh[p])
        return np.stack(out)


def _has_ftfy() -> bool:
    try:
        import ftfy  # noqa: F401
    except ImportError:
        return False
    return True
