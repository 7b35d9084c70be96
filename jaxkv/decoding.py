"""Decoding a stream's chunks into frames, with the decoder state the stream carries.

A Wan VAE `jaxkv.models.wan_vae.StreamDecoder` carries causal feature caches from chunk to chunk. They are part of
the stream's state: ``stream.carry.extras["vae_decoder"]`` (`jaxkv.session.VAE_DECODER`, {"caches": {conv name:
[B, 2, h_l, w_l, C_l]}, "first": bool []}), so a save, fork or offload of the stream takes them along, in the format
sessions have always had. `decode` is the one way a chunk is decoded, by `jaxkv.pipeline.PipelineStream` and by
``jaxkv generate``'s mp4 (`jaxkv.generate.video.Mp4Sink`): the decoder works from the carried state and its new
state replaces it (host-side, nothing waits for the device). A toy-world `jaxkv.toyworld.latents.FrameDecoder`
decodes each latent frame alone and carries nothing.

The decoder object keeps one host-side flag of its own, ``first`` (the stream's first chunk drops the VAE's padding
frames); `adopt` sets it from the carried state when a decoder takes over a resumed or forked stream.
"""

from __future__ import annotations

from jaxkv import session as S

__all__ = ["adopt", "carry", "decode", "stateful"]


def stateful(decoder) -> bool:
    """True for a decoder whose state the stream carries (a Wan VAE `StreamDecoder`), False for a stateless one."""
    from jaxkv.models.wan_vae import StreamDecoder

    return isinstance(decoder, StreamDecoder)


def carry(stream, decoder) -> None:
    """Puts ``decoder``'s current state (fresh, primed or just used) into ``stream.carry``: what the next `decode`
    continues. Nothing for a stateless decoder."""
    if stateful(decoder):
        extras = {**stream.carry.extras, S.VAE_DECODER: S.vae_extra(decoder.state)}
        stream.carry = stream.carry.replace(extras=extras)


def adopt(stream, decoder) -> None:
    """Makes ``decoder`` continue the decoder state ``stream`` carries (a resumed or forked stream), or, when it
    carries none (a new stream), gives the stream ``decoder``'s state. ValueError, the stream untouched, when the
    carried caches do not fit ``decoder`` (another VAE, video size or batch)."""
    if not stateful(decoder):
        return
    extra = stream.carry.extras.get(S.VAE_DECODER)
    if extra is None:
        carry(stream, decoder)
        return
    state = S.vae_state(extra)
    got = {k: (tuple(v.shape), v.dtype) for k, v in state.caches.items()}
    want = {k: (tuple(v.shape), v.dtype) for k, v in decoder.state.caches.items()}
    if got != want:
        raise ValueError("the carried VAE decoder caches do not fit this VAE and video size")
    decoder.state = state
    decoder.first = bool(state.first)  # fetched once, when the decoder takes over


def decode(stream, decoder, latents):
    """The frames of the chunk ``latents`` float32 [batch, T, h, w, C]: uint8 [batch, n, H, W, 3] (dispatched, not
    waited for). A stateful decoder decodes from the state ``stream`` carries (`adopt` or `carry` put it there) and
    its new state replaces it; the carried buffers are donated to the decode."""
    if not stateful(decoder):
        return decoder(latents)
    decoder.state = S.vae_state(stream.carry.extras[S.VAE_DECODER])
    frames = decoder(latents)
    carry(stream, decoder)
    return frames
