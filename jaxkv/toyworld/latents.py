"""The toy world's latent space: a fixed linear map from 64x64 RGB frames to 16 x 16 x 16 latents, and back.

Each 4x4 pixel patch (48 numbers in [-1, 1]) is projected on the 16 principal components of the world's patches
(`LatentMap.fit`), and divided by one scale, the RMS of all 16 coefficients, so the DiT sees latents of unit
variance on average, as Wan's DiT sees the VAE's normalised latents. One scale, not one per channel: the basis is
orthonormal, so a squared error in these latents is a squared error in pixels, and the DiT's loss weighs each
component by what it shows (per-channel unit variance would give the last 8 components, under 5 % of the
variance, half of the loss). Decoding is the transpose (the basis is orthonormal) followed by a
clamp, so ``decode(encode(x))`` is the orthogonal projection of x onto the basis: 33 dB PSNR on world frames, edges
blurred over a pixel or two. A frame stays a frame: no temporal compression (1 latent frame = 1 video frame).

Why not the Wan VAE architecture at a tiny width (what the issue asks for first): one Adam step of a 0.64 M-param
VAE (base_dim 16, 4x spatial) on 32 frames took 10.4 s on the 2 CPU cores here, so training it well would use most
of the 30-minute training budget the DiT needs. The map is fitted in a second instead.

Files: ``latent_map.safetensors`` with ``basis`` float32 [48, 16], ``mean`` float32 [48], ``std`` float32 [16].
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

PATCH = 4  # pixels per latent pixel along height and width
CHANNELS = 16  # latent channels, like Wan's VAE
PATCH_DIM = PATCH * PATCH * 3
FILE = "latent_map.safetensors"


def _unshuffle(x, xp=np):
    """[..., H, W, 3] -> [..., H/4, W/4, 48] (each 4x4x3 patch flattened row-major)."""
    *lead, h, w, c = x.shape
    x = x.reshape(*lead, h // PATCH, PATCH, w // PATCH, PATCH, c)
    n = len(lead)
    x = xp.transpose(x, (*range(n), n, n + 2, n + 1, n + 3, n + 4))
    return x.reshape(*lead, h // PATCH, w // PATCH, PATCH_DIM)


def _shuffle(z, xp=np):
    """The inverse of `_unshuffle`: [..., h, w, 48] -> [..., 4h, 4w, 3]."""
    *lead, h, w, _ = z.shape
    z = z.reshape(*lead, h, w, PATCH, PATCH, 3)
    n = len(lead)
    z = xp.transpose(z, (*range(n), n, n + 2, n + 1, n + 3, n + 4))
    return z.reshape(*lead, h * PATCH, w * PATCH, 3)


def to_unit(frames) -> np.ndarray:
    """uint8 frames -> float32 in [-1, 1]."""
    return np.asarray(frames, np.float32) / 127.5 - 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class LatentMap:
    """basis float32 [48, 16] (orthonormal columns), mean float32 [48], std float32 [16] (the scale of each
    channel; `fit` gives all channels one)."""

    basis: np.ndarray
    mean: np.ndarray
    std: np.ndarray

    def __post_init__(self):
        for name, shape in (("basis", (PATCH_DIM, CHANNELS)), ("mean", (PATCH_DIM,)), ("std", (CHANNELS,))):
            value = np.asarray(getattr(self, name), np.float32)
            if value.shape != shape or not np.isfinite(value).all():
                raise ValueError(
                    f"LatentMap.{name} must be finite float32 {list(shape)}, got {value.dtype}{list(value.shape)}"
                )
            object.__setattr__(self, name, value)
        if (self.std <= 0).any():
            raise ValueError("LatentMap.std must be > 0")

    @classmethod
    def fit(cls, frames: np.ndarray) -> "LatentMap":
        """The principal components of the 4x4 patches of ``frames`` uint8 [N, 64, 64, 3]. Deterministic: each
        component's sign makes its largest entry positive."""
        patches = _unshuffle(to_unit(frames).astype(np.float64)).reshape(-1, PATCH_DIM)
        mean = patches.mean(0)
        values, vectors = np.linalg.eigh(np.cov((patches - mean).T))
        basis = vectors[:, ::-1][:, :CHANNELS]
        basis *= np.sign(basis[np.abs(basis).argmax(0), np.arange(CHANNELS)])
        rms = np.sqrt(values[::-1][:CHANNELS].mean())
        return cls(basis, mean, np.full(CHANNELS, rms))

    def encode(self, frames) -> np.ndarray:
        """uint8 frames [..., 64, 64, 3] -> normalised latents float32 [..., 16, 16, 16] (numpy)."""
        z = (_unshuffle(to_unit(frames)) - self.mean) @ self.basis
        return (z / self.std).astype(np.float32)

    def decode(self, latents, clamp: bool = True) -> jax.Array:
        """Normalised latents [..., h, w, 16] -> frames float32 [..., 4h, 4w, 3] in [-1, 1] (jax; jit-able).
        ``clamp=False`` leaves the linear map's values as they are (training losses: the clamp has no gradient
        outside [-1, 1])."""
        patches = (jnp.asarray(latents, jnp.float32) * self.std) @ self.basis.T + self.mean
        frames = _shuffle(patches, jnp)
        return jnp.clip(frames, -1.0, 1.0) if clamp else frames

    def decode_uint8(self, latents) -> jax.Array:
        """As `decode`, as uint8 [..., 4h, 4w, 3]."""
        return jnp.round((self.decode(latents) + 1.0) * 127.5).astype(jnp.uint8)

    # -- files

    def save(self, directory: str) -> str:
        from safetensors.numpy import save_file

        path = os.path.join(directory, FILE)
        save_file(
            {"basis": self.basis, "mean": self.mean, "std": self.std},
            path,
            metadata={"format": "jaxkv-toyworld-latent-map", "patch": str(PATCH)},
        )
        return path

    @classmethod
    def load(cls, directory: str) -> "LatentMap":
        from safetensors.numpy import load_file

        path = os.path.join(directory, FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no toy-world latent map at {path}")
        tensors = load_file(path)
        missing = {"basis", "mean", "std"} - set(tensors)
        if missing:
            raise ValueError(f"{path} lacks {sorted(missing)}")
        return cls(tensors["basis"], tensors["mean"], tensors["std"])


class FrameDecoder:
    """The `jaxkv.models.wan_vae.StreamDecoder` interface over a `LatentMap`, for ``jaxkv generate``'s mp4 sink:
    ``latents [batch, T, h, w, 16]`` -> uint8 ``[batch, T, 4h, 4w, 3]`` (one frame per latent frame, so nothing to
    carry between chunks; `reset` only restarts the frame count)."""

    def __init__(self, latent_map: LatentMap):
        self.latent_map = latent_map
        self._decode = jax.jit(latent_map.decode_uint8)
        self.frames_out = 0

    def reset(self) -> None:
        self.frames_out = 0

    def __call__(self, latents) -> jax.Array:
        frames = self._decode(latents)
        self.frames_out += frames.shape[1]
        return frames
