"""Every checkpoint family's `save(..., force=True)` replaces a directory of its own format, and only that."""

from __future__ import annotations

import pytest

from jaxkv.files import DestinationError
from jaxkv.models import wan_vae
from jaxkv.models.umt5 import checkpoint as t5_checkpoint
from jaxkv.models.umt5.config import preset as t5_preset
from jaxkv.models.umt5.params import init_params as t5_init
from jaxkv.models.umt5.tokenizer import tiny_tokenizer_json
from jaxkv.models.wan_vae import checkpoint as vae_checkpoint


def _vae(path, force=False):
    config = wan_vae.preset("tiny")
    vae_checkpoint.save(str(path), config, wan_vae.init_params(0, config), force=force)


def _t5(path, force=False):
    config = t5_preset("tiny")
    t5_checkpoint.save(
        str(path),
        config,
        t5_init(config, 0),
        force=force,
        tokenizer_files={"tokenizer.json": tiny_tokenizer_json().encode()},
    )


@pytest.mark.parametrize("write", [_vae, _t5], ids=["vae", "umt5"])
def test_force_replaces_a_checkpoint_of_the_same_family(tmp_path, write):
    write(tmp_path / "ckpt")
    with pytest.raises(FileExistsError):
        write(tmp_path / "ckpt")
    write(tmp_path / "ckpt", force=True)  # its own files (tokenizer included) are recognised


def test_force_never_replaces_another_family(tmp_path):
    _t5(tmp_path / "t5")
    _vae(tmp_path / "vae")
    with pytest.raises(DestinationError, match="tokenizer.json"):
        _vae(tmp_path / "t5", force=True)
    with pytest.raises(DestinationError, match="format"):
        _t5(tmp_path / "vae", force=True)
    assert sorted(p.name for p in (tmp_path / "t5").iterdir()) == [
        "config.json",
        "params.safetensors",
        "tokenizer.json",
    ]
