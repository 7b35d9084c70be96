"""Latent (de)normalisation with the published per-channel statistics: the DiT works on ``(z - mean) / std``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.models.wan_vae.config import WanVAEConfig


def _stats(config: WanVAEConfig, z: jax.Array):
    if z.shape[-1] != config.z_dim:
        raise ValueError(f"latents must have {config.z_dim} channels last, got shape {tuple(z.shape)}")
    return (jnp.asarray(config.latents_mean, jnp.float32), jnp.asarray(config.latents_std, jnp.float32))


def normalize(config: WanVAEConfig, z: jax.Array) -> jax.Array:
    """VAE latents ``[..., z_dim]`` -> DiT latents ``(z - mean) / std`` (float32)."""
    mean, std = _stats(config, z)
    return (z.astype(jnp.float32) - mean) / std


def denormalize(config: WanVAEConfig, z: jax.Array) -> jax.Array:
    """DiT latents ``[..., z_dim]`` -> VAE latents ``z * std + mean`` (float32), the decoder's input."""
    mean, std = _stats(config, z)
    return z.astype(jnp.float32) * std + mean
