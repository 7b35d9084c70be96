"""`RingSpec`: the static sizes of a sink + window chunk cache, in tokens, and the attention mask they imply."""

from __future__ import annotations

import dataclasses

from jaxkv.attention.masks import MaskSpec
from jaxkv.validate import check_int

# Positions are int32: the last token of a chunk must be <= 2**31 - 1.
POSITION_LIMIT = 2**31


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Sizes of a chunked KV cache with a pinned sink and a rolling window, all in tokens.

    Attributes:
      chunk: tokens written per chunk, C > 0 (Wan 2.1 at 480p: 3 latent frames x 1560 = 4680).
      window: tokens of the rolling part, a whole number of chunks >= 1 chunk; it includes the chunk being
        denoised.
      sink: tokens pinned at the start of the stream (the first ``sink // chunk`` chunks), a whole number of chunks,
        possibly 0.

    Capacity is ``sink + window``. Chunk alignment guarantees that a chunk never straddles the end of the buffer
    (``lax.dynamic_update_slice`` would clamp, not wrap).

    Mapping from Self-Forcing / CausVid (``local_attn_size`` L frames in total, ``sink_size`` s frames, T tokens per
    frame, chunks of c frames): ``RingSpec.from_frames(T, c, window_frames=L - s, sink_frames=s)``, i.e.
    ``sink = s*T`` and ``window = (L - s)*T``. ``local_attn_size=-1`` (global attention) has no fixed capacity: use
    a window as long as the whole video.

    Positions are int32, so a stream holds at most `max_chunks` chunks (``2**31 // chunk``; for Wan 2.1 at 480p,
    4,680-token chunks: chunks 0 .. 458,863, about 95 hours of 16 fps video); `begin_chunk` refuses the next one.
    """

    chunk: int
    window: int
    sink: int = 0

    def __post_init__(self):
        chunk = check_int("chunk", self.chunk)
        window = check_int("window", self.window)
        sink = check_int("sink", self.sink)
        if chunk <= 0:
            raise ValueError(f"chunk must be positive, got {chunk}")
        if sink < 0:
            raise ValueError(f"sink must be >= 0, got {sink}")
        if window < chunk:
            raise ValueError(f"window ({window} tokens) must hold at least one chunk ({chunk} tokens)")
        if window % chunk:
            raise ValueError(f"window ({window} tokens) must be a whole number of chunks of {chunk} tokens")
        if sink % chunk:
            raise ValueError(f"sink ({sink} tokens) must be a whole number of chunks of {chunk} tokens")
        object.__setattr__(self, "chunk", chunk)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "sink", sink)

    @classmethod
    def from_frames(
        cls, tokens_per_frame: int, chunk_frames: int, window_frames: int, sink_frames: int = 0
    ) -> "RingSpec":
        """Spec from frame counts: chunk = chunk_frames*T, window = window_frames*T, sink = sink_frames*T.

        ``window_frames`` and ``sink_frames`` must be whole multiples of ``chunk_frames``.
        """
        t = check_int("tokens_per_frame", tokens_per_frame)
        c = check_int("chunk_frames", chunk_frames)
        w = check_int("window_frames", window_frames)
        s = check_int("sink_frames", sink_frames)
        if t <= 0 or c <= 0:
            raise ValueError(f"tokens_per_frame ({t}) and chunk_frames ({c}) must be positive")
        if w % c or s % c:
            raise ValueError(f"window_frames ({w}) and sink_frames ({s}) must be whole multiples of chunk_frames ({c})")
        return cls(chunk=c * t, window=w * t, sink=s * t)

    @property
    def capacity(self) -> int:
        """Tokens held: sink + window."""
        return self.sink + self.window

    @property
    def sink_chunks(self) -> int:
        return self.sink // self.chunk

    @property
    def window_chunks(self) -> int:
        return self.window // self.chunk

    @property
    def num_slots(self) -> int:
        """Chunk slots: sink_chunks + window_chunks."""
        return self.capacity // self.chunk

    @property
    def max_chunks(self) -> int:
        """How many chunks a stream can hold before its int32 positions overflow: chunks 0 .. max_chunks - 1."""
        return POSITION_LIMIT // self.chunk

    def mask(self) -> MaskSpec:
        """The attention mask of what this cache holds: chunk-causal, a window of ``window`` tokens counted from
        chunk starts, the first ``sink`` tokens pinned.

        Streaming over the cache with this mask and running the whole sequence at once with it (training, the
        block-causal forward) see the same keys for every query: the cache keeps exactly the sink chunks and the
        ``window // chunk`` most recent chunks, which is what the mask lets a chunk see.
        """
        return MaskSpec(chunk=self.chunk, window=self.window, sink=self.sink)
