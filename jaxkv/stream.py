"""`Stream`: a streaming rollout as an iterator, one jitted, cache-donating step per ``next()``.

The step itself is `jaxkv.rollout.stream_step` (one chunk: `jaxkv.rollout.generate_chunk` on noise drawn from the
key or given); this module drives it chunk by chunk, checks what a stream is given (noise, context, position room),
commits given latents (`Stream.commit`), moves a stream's state to and from a `jaxkv.session.Session`
(`Stream.session`, `Stream.from_session`), forks it (`Stream.fork`) and switches its prompt (`Stream.switch_prompt`).

Everything that changes between two chunks is one object, ``stream.carry``: a `jaxkv.session.Session` (cache and
cross K/V, noise key, clock, extras such as a VAE decoder's state, the settings' fingerprint); each step, commit and
switch replaces it by a new one (host-side: the step's donated cache is replaced by its successor, nothing is
copied), and ``state``, ``key``, ``index`` and ``ring`` are read-only views of it, so no part can drift from the
rest. A fork, an offload, a save acts on it whole (``stream.session()`` returns it, a copy by default).

A stream keeps its latent history: the `jaxkv.recache.LatentRing` of the clean chunks the cache retains (what a
prompt switch re-caches from), pushed by a small jitted program of its own after each step (the step's program is
not changed), carried as ``carry.extras[jaxkv.recache.RING_EXTRA]`` (so its sessions save it, in the format of
earlier releases) and restored from them. ``history=False``
skips it for a stream that never switches. It sits above `jaxkv.rollout`, `jaxkv.session` and `jaxkv.recache`, which
know nothing of it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import recache as RC
from jaxkv import session as S
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import is_per_layer
from jaxkv.rollout import (
    RolloutConfig,
    RolloutState,
    _init_state_jit,
    check_position_room,
    commit_step,
    per_layer_state,
    stacked_state,
    stream_step,
)
from jaxkv.validate import is_concrete, is_int


def _stream_noise(config: WanConfig, rc: RolloutConfig, batch: int, noise, num_chunks):
    """A stream's (explicit noise or None, num_chunks) after checking both: num_chunks None or > 0, noise
    [chunks, steps, batch, chunk_frames, h, w, in_dim] holding at least num_chunks chunks (num_chunks defaults to
    all of them)."""
    if num_chunks is not None and not (is_int(num_chunks) and num_chunks > 0):
        raise ValueError(f"num_chunks must be None or a positive int, got {num_chunks!r}")
    if noise is None:
        return None, num_chunks
    noise = jnp.asarray(noise)
    if noise.ndim != 7 or tuple(noise.shape[1:]) != rc.noise_shape(config, batch, 1)[1:]:
        raise ValueError(
            f"noise must be [num_chunks, steps, batch, chunk_frames, h, w, in_dim] with "
            f"[steps, ...] = {list(rc.noise_shape(config, batch, 1)[1:])}, got {list(noise.shape)}"
        )
    if num_chunks is None:
        num_chunks = noise.shape[0]
    elif num_chunks > noise.shape[0]:
        raise ValueError(
            f"num_chunks={num_chunks} but the noise holds only {noise.shape[0]} chunks; pass "
            f"noise [num_chunks, ...] for every chunk, or num_chunks <= {noise.shape[0]}"
        )
    return noise, num_chunks


def _check_finite(name: str, x) -> None:
    """ValueError when the concrete array ``x`` (None and traced values pass) holds NaN or Inf: a stream of it would
    return NaN latents for every chunk."""
    if x is None or not is_concrete(x):
        return
    bad = int(jnp.size(x) - jnp.count_nonzero(jnp.isfinite(jnp.asarray(x))))
    if bad:
        raise ValueError(
            f"{name} holds {bad} non-finite value(s) (NaN or Inf) of {jnp.size(x)}: every chunk would be NaN"
        )


class Stream:
    """Iterator over chunks of a streaming rollout: each ``next()`` runs one jitted, cache-donating step and returns
    that chunk's clean latents float32 [batch, chunk_frames, h, w, in_dim].

    The step compiles once per shape (positions and slots are traced), so an unbounded stream runs one program;
    ``jaxkv.compilation.compile_count(stream_step)`` counts its compilations. With absolute RoPE a stream holds at
    most `RingSpec.max_chunks` chunks (int32 positions): a larger ``num_chunks`` is a ValueError here, and an
    endless stream raises OverflowError at that chunk instead of wrapping; with ``rope="cache-relative"`` the
    clock wraps (`wrap_clock`) and the stream is unbounded. ``num_chunks=None`` streams forever (with explicit
    ``noise [chunks, steps, batch, chunk_frames, h, w, in_dim]``: all its chunks; a larger num_chunks is a
    ValueError). What the stream carries is one `jaxkv.session.Session`, ``stream.carry`` (replaced
    after each chunk); ``stream.state`` (the `RolloutState` after the latest chunk: ``stream.state.cache``),
    ``stream.key``, ``stream.index`` (the stream index of the next chunk) and ``stream.ring`` are read-only views
    of it. Per-layer params run on a per-layer carried cache (the fingerprint is the stacked one's).
    `Stream.from_session` continues a saved `jaxkv.session.Session` (``num_chunks`` then counts the
    continuation's chunks); ``stream.session()`` takes one; ``stream.fork()`` is an independent copy.

    Prompt switching: ``stream.switch_prompt(context)`` re-caches the retained chunks under a new prompt before the
    next chunk (`jaxkv.recache`). It needs the latent history ``stream.ring`` (a `jaxkv.recache.LatentRing`, batch
    rows), which a stream keeps whenever its cache can be re-cached (`jaxkv.recache.switch_refusal`) unless built
    with ``history=False``; otherwise ``stream.ring`` is None.
    """

    def __init__(
        self,
        params,
        config: WanConfig,
        rc: RolloutConfig,
        context,
        *,
        num_chunks: int | None = None,
        key=None,
        noise=None,
        negative_context=None,
        history: bool = True,
    ):
        if (key is None) == (noise is None):
            raise ValueError("pass exactly one of key= (noise drawn per chunk) or noise= (explicit noise)")
        noise, num_chunks = _stream_noise(config, rc, jnp.shape(context)[0], noise, num_chunks)
        if num_chunks is not None:
            check_position_room(config, rc, int(num_chunks))
        for name, x in (("context", context), ("negative_context", negative_context)):
            _check_finite(name, x)
        self.params, self.config, self.rc = params, config, rc
        self.noise, self.num_chunks = noise, num_chunks
        _check_history(history)
        state = self._init_state(context, negative_context)
        # the fingerprint is the stacked state's (a per-layer state is stacked only in its shapes here)
        carry = S.Session.create(config, rc, jax.eval_shape(stacked_state, state), key=key, next_chunk=0)
        self.carry = carry.replace(cache=state.cache, cross=state.cross, next_chunk=np.int32(0))
        self.start = 0  # the chunk index of this Stream's first chunk
        ring = self._empty_ring() if history else None
        if ring is not None:
            self._put_ring(ring)

    @classmethod
    def from_session(
        cls,
        params,
        config: WanConfig,
        rc: RolloutConfig,
        session,
        *,
        num_chunks: int | None = None,
        noise=None,
        history: bool = True,
    ) -> "Stream":
        """A stream that continues ``session`` (`jaxkv.session.Session`, e.g. `jaxkv.session.load`ed): its chunks
        are those an uninterrupted stream yields from chunk ``session.next_chunk`` on, bit for bit.

        ``num_chunks`` counts the chunks of this continuation (None: endless); ``noise`` [chunks, steps, batch, ...]
        is this continuation's explicit noise (required iff the session has no key). The session is **consumed**:
        its buffers are donated to the first step; continue from ``session.fork()`` to keep it.
        SessionError when the session's settings differ from (config, rc).

        The latent history: a session that holds one (``extras[jaxkv.recache.RING_EXTRA]``, as ``stream.session()``
        saves it) gives it back, so the stream can switch prompts at once (ValueError, before anything runs, when it
        does not fit); without one the ring starts empty and refills as the stream goes on (a switch is refused
        until every chunk the cache holds is in it). ``history=False`` keeps none."""
        if not isinstance(session, S.Session):
            raise TypeError(f"from_session needs a jaxkv.session.Session, got {type(session).__name__}")
        session.check(config, rc)
        if session.on_host:
            raise S.SessionError("the session's caches are offloaded; jaxkv.session.reload() it first")
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(session.state)):
            raise S.SessionError(
                "the session was consumed: an earlier Stream.from_session donated its buffers to its first step; "
                "continue from session.fork() to keep a session for more than one stream"
            )
        _check_history(history)
        if (session.key is None) == (noise is None):
            raise ValueError(
                "a session with a noise key continues from its key (pass no noise=); one without "
                "(made from explicit noise) needs noise="
            )
        batch = session.sessions // (2 if rc.guidance_scale is not None else 1)
        noise, num_chunks = _stream_noise(config, rc, batch, noise, num_chunks)
        if num_chunks is not None:
            check_position_room(config, rc, int(num_chunks), session.cache)
        ring = None
        if history and RC.switch_refusal(rc) is None:
            ring = RC.LatentRing.init(RC.ring_spec(config, rc), rc.chunk_shape(config, batch))
            if RC.RING_EXTRA in session.extras:  # checked before anything is built
                ring = RC.ring_from_extra(session.extras[RC.RING_EXTRA], ring)
        self = cls.__new__(cls)
        self.params, self.config, self.rc = params, config, rc
        self.noise, self.num_chunks = noise, num_chunks
        # Sessions hold stacked states; per-layer params run on a per-layer state (a copy, made once here).
        state = per_layer_state(session.state) if is_per_layer(params) else session.state
        self.start = int(session.next_chunk)
        extras = {k: v for k, v in session.extras.items() if k != RC.RING_EXTRA}  # the ring: `_put_ring`
        self.carry = session.replace(
            cache=state.cache, cross=state.cross, next_chunk=np.int32(self.start), extras=extras
        )
        if ring is not None:
            self._put_ring(ring)
        return self

    # ------------------------------------------------------------------------------ the one state and its views

    @property
    def state(self) -> RolloutState:
        """The `jaxkv.rollout.RolloutState` (cache, cross K/V) the next step continues: a view of ``carry``."""
        return self.carry.state

    @property
    def key(self):
        """The noise key (None for a stream fed explicit noise): a view of ``carry``."""
        return self.carry.key

    @property
    def index(self) -> int:
        """The stream index of the next chunk: a view of ``carry.next_chunk``."""
        return int(self.carry.next_chunk)

    @property
    def ring(self):
        """The latent history (`jaxkv.recache.LatentRing`), or None for a stream that keeps none: a view of
        ``carry.extras[jaxkv.recache.RING_EXTRA]``."""
        extra = self.carry.extras.get(RC.RING_EXTRA)
        if extra is None:
            return None
        spec = RC.ring_spec(self.config, self.rc)
        return RC.LatentRing(extra["latents"], extra["chunks"], spec.sink_chunks, spec.window_chunks)

    def _put_ring(self, ring) -> None:
        """Stores ``ring`` (a `LatentRing`) as the carry's latent history (host-side: a new extras dict)."""
        entry = {"latents": ring.latents, "chunks": ring.chunks}
        self.carry = self.carry.replace(extras={**self.carry.extras, RC.RING_EXTRA: entry})

    def _put_state(self, state: RolloutState, next_chunk: int | None = None) -> None:
        """Replaces the carry's cache and cross K/V by ``state`` (and its clock by ``next_chunk``): host-side."""
        nxt = self.carry.next_chunk if next_chunk is None else np.int32(next_chunk)
        self.carry = self.carry.replace(cache=state.cache, cross=state.cross, next_chunk=nxt)

    def commit(self, latents) -> None:
        """Commits given clean latents float32 [batch, n * chunk_frames, h, w, in_dim] as the stream's first ``n``
        chunks, before it generates any: each chunk goes through the pass at ``rc.schedule.context_noise`` that
        commits a generated chunk (`commit`, one chunk per call of one compiled program, the cache donated), so
        the cache holds what a stream that had generated these latents would hold, and its latent history
        (``ring``) holds them, so a later prompt switch re-caches them as it re-caches generated chunks. The stream
        then continues them: ``index`` and ``start`` become ``n`` (the key's noise of its first chunk is chunk n's, a
        session taken later resumes at the right chunk) and ``num_chunks`` still counts the chunks it generates.

        ValueError, before the cache is touched, when the stream has already started (generated, committed or
        resumed: ``index`` > 0), the latents are not whole chunks of the stream's shape, hold NaN/Inf, or would
        leave no int32 position room for ``num_chunks`` more chunks."""
        if self.index != 0:
            raise ValueError(
                f"commit gives a stream its first chunks; this one is already at chunk {self.index} "
                f"(commit before the first next(), on a fresh Stream)"
            )
        latents = jnp.asarray(latents, jnp.float32)
        cf = self.rc.chunk_frames
        batch = self.state.cache.batch // (2 if self.rc.guidance_scale is not None else 1)
        frame = self.rc.chunk_shape(self.config, batch)[2:]
        if latents.ndim != 5 or latents.shape[0] != batch or latents.shape[1] % cf or latents.shape[1] == 0:
            raise ValueError(
                f"commit needs latents [batch, n * chunk_frames, h, w, in_dim] = [{batch}, n * {cf}, "
                f"{', '.join(map(str, frame))}] (whole chunks, n >= 1), got {list(latents.shape)}"
            )
        if tuple(latents.shape[2:]) != tuple(frame):
            raise ValueError(
                f"commit needs latent frames [h, w, in_dim] = {list(frame)} (the stream's), got "
                f"{list(latents.shape[2:])}"
            )
        _check_finite("latents", latents)
        n = latents.shape[1] // cf
        check_position_room(self.config, self.rc, n + (self.num_chunks or 0), self.state.cache)
        for c in range(n):
            self._put_state(self._commit_chunk(latents[:, c * cf : (c + 1) * cf]), c + 1)
            if self.ring is not None:  # committed at a fresh stream's start: chunk c is stream chunk c
                self._put_ring(self.ring.push(latents[:, c * cf : (c + 1) * cf], jnp.full((batch,), c, jnp.int32)))
        self.start = n

    def _commit_chunk(self, chunk) -> RolloutState:  # a mesh stream's own: `jaxkv.parallel.MeshStream`
        return commit_step(self.params, self.config, self.rc, self.state, chunk)

    def session(self, *, copy: bool = True, extras: dict | None = None):
        """The stream's state before its next chunk as a `jaxkv.session.Session` (with ``extras``, e.g. the VAE
        decoder's, and the latent history as ``extras[jaxkv.recache.RING_EXTRA]`` when the stream keeps one).
        ``copy`` (default): in buffers of its own, valid whatever the stream does next; without it the session
        shares the stream's buffers, which its next step donates (save it before stepping again). A stream on
        per-layer params holds its state per layer: the session gets a stacked copy either way."""
        carry, state = self.carry, stacked_state(self.state)
        if extras:
            S._flat_extras(extras)  # checks the names
        s = carry.replace(
            cache=state.cache,
            cross=state.cross,
            next_chunk=jnp.asarray(carry.next_chunk, jnp.int32),
            extras={**carry.extras, **(extras or {})},
        )
        return s.fork() if copy and state.cache is carry.cache else s

    def fork(self) -> "Stream":
        """An independent copy of this stream before its next chunk: state and latent history in buffers of their
        own (stepping or switching either leaves the other as it was), the same key, clock, remaining
        ``num_chunks`` and explicit noise, so both draw the same chunks until one switches prompts."""
        twin = copy.copy(self)
        twin.carry = self.carry.fork().replace(next_chunk=self.carry.next_chunk)  # (the clock stays on the host)
        return twin

    # ---------------------------------------------------------------------------------------- prompt switching

    def switch_prompt(self, context, negative_context=None, *, keep_sink: bool = True) -> None:
        """Switches to a new ``context`` [batch, text_tokens, text_dim] (and ``negative_context``, the same, with
        guidance) from the next chunk on: new cross-attention K/V, and the chunks the cache retains re-cached from
        their clean latents under it (`jaxkv.recache.switch_prompt`; ``keep_sink`` keeps the sink chunks' K/V).
        ValueError, before the state changes, for a stream without latent history (``history=False``, or a cache a
        switch cannot re-cache), a history that lacks a chunk the cache holds, or contexts that do not fit."""
        if self.ring is None:
            why = RC.switch_refusal(self.rc) or "it was built with history=False (it keeps no latent history)"
            raise ValueError(f"this stream cannot switch prompts: {why}")
        if not isinstance(keep_sink, bool):
            raise ValueError(f"keep_sink must be a bool, got {keep_sink!r}")
        RC.check_ring(self.config, self.rc, self.state, self.ring)
        self._put_state(self._switch(context, negative_context, keep_sink))

    def switch(self, context, negative_context=None, *, keep_sink: bool = True) -> None:
        """Deprecated alias of `switch_prompt` (the name of the retired ``SwitchableStream``)."""
        warnings.warn("Stream.switch is deprecated: use Stream.switch_prompt", DeprecationWarning, stacklevel=2)
        self.switch_prompt(context, negative_context, keep_sink=keep_sink)

    def ring_extra(self) -> dict:
        """The latent history as a session extras entry ({"latents", "chunks"}, what ``session()`` saves as
        ``extras[jaxkv.recache.RING_EXTRA]``). ValueError for a stream that keeps none."""
        if self.ring is None:
            raise ValueError("this stream keeps no latent history (history=False, or a cache no switch re-caches)")
        return {"latents": self.ring.latents, "chunks": self.ring.chunks}

    def restore_ring(self, extra: dict) -> None:
        """Puts back a latent history saved by `ring_extra` (`Stream.from_session` does it for a session that holds
        one). ValueError, before anything changes, when it does not fit this stream or the stream keeps none."""
        if self.ring is None:
            raise ValueError("this stream keeps no latent history (history=False, or a cache no switch re-caches)")
        self._put_ring(RC.ring_from_extra(extra, self.ring))

    def _empty_ring(self):
        """An empty `jaxkv.recache.LatentRing` for this stream, or None when its cache cannot be re-cached."""
        if RC.switch_refusal(self.rc) is not None:
            return None
        batch = self.state.cache.batch // (2 if self.rc.guidance_scale is not None else 1)
        return RC.LatentRing.init(RC.ring_spec(self.config, self.rc), self.rc.chunk_shape(self.config, batch))

    # The hooks a mesh stream (`jaxkv.parallel.MeshStream`) replaces; ``step`` is the jitted step function
    # (count its programs with `jaxkv.compilation.compile_count`).
    step = staticmethod(stream_step)

    def _switch(self, context, negative_context, keep_sink: bool) -> RolloutState:
        # the remaining checks (contexts, policy) run while it traces, before the donated state is touched
        return RC.jit_switch_prompt(
            self.params,
            self.config,
            self.rc,
            self.state,
            self.ring,
            jnp.asarray(context),
            None if negative_context is None else jnp.asarray(negative_context),
            keep_sink=keep_sink,
        )

    def _init_state(self, context, negative_context) -> RolloutState:
        return _init_state_jit(self.params, self.config, self.rc, context, negative_context)

    def _run_step(self, key, index, noise):
        return self.step(self.config, self.rc, self.params, self.state, key, index, noise)

    def __iter__(self) -> Iterator[jax.Array]:
        return self

    def __next__(self) -> jax.Array:
        if self.num_chunks is not None and self.index - self.start >= self.num_chunks:
            raise StopIteration
        if self.rc.bounded and self.index >= self.rc.spec(self.config).max_chunks:  # an endless stream's int32 limit
            raise OverflowError(
                f"chunk {self.index} would pass the int32 position limit "
                f"({self.rc.spec(self.config).max_chunks} chunks to a stream); start a new Stream"
            )
        index = jnp.asarray(self.index, jnp.int32)
        if self.noise is not None:
            x, state = self._run_step(None, None, self.noise[self.index - self.start])
        else:
            x, state = self._run_step(self.key, index, None)
        ring = self.ring
        self._put_state(state, self.index + 1)  # the donated cache's successor replaces it in the one carry
        if ring is not None:  # the chunk the step reserved (wrapped clock included) holds x
            self._put_ring(RC.push_chunk(ring, x, state.cache.chunk_start, state.cache.spec.chunk))
        return x


def _check_history(history) -> None:
    if not isinstance(history, bool):
        raise ValueError(f"history must be a bool, got {history!r}")
