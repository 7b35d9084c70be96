"""`StreamPool`: the host-side driver of a pool (`jaxkv.pool.state`, `jaxkv.pool.rows`).

It picks free rows, checks row numbers, contexts and sessions before anything changes, and runs each operation as
one compiled program per pool shape (rows traced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import recache as RC
from jaxkv import rollout as R
from jaxkv import session as S
from jaxkv.models.wan.config import WanConfig
from jaxkv.pool import rows as PR
from jaxkv.pool import state as PS
from jaxkv.validate import check_int


class StreamPool:
    """Many independent streams as the rows of one batch.

    ``admit(context, key) -> row``, ``step(rows=None) -> {row: latents [chunk_frames, h, w, in_dim]}`` for the
    occupied rows (or some of them: the others wait, bit for bit), ``finish(row)``; ``switch_prompt(row, context)``
    switches one row's prompt (KV re-cache, as `jaxkv.stream.Stream.switch_prompt`); ``session(row)`` takes a row
    out as a `jaxkv.session.Session` and ``admit_session(session) -> row`` puts one in (a pool row resumes solo and a
    solo stream joins a pool, bit for bit). Each operation is one compiled program per pool shape (`jit_admit`,
    `jit_step`, `jit_finish`, `jit_switch_row`, `jit_take_row`, `jit_put_row`), counted by
    ``jaxkv.compilation.compile_count``.
    """

    def __init__(self, params, config: WanConfig, rc: R.RolloutConfig, rows: int):
        self.params, self.config, self.rc = params, config, rc
        self.state = PS.jit_init_pool(params, config, rc, check_int("rows", rows, minimum=1))
        self._occupied = [False] * rows
        self._chunks = [0] * rows

    @property
    def rows(self) -> int:
        return len(self._occupied)

    @property
    def free_rows(self) -> list[int]:
        return [r for r, busy in enumerate(self._occupied) if not busy]

    @property
    def busy_rows(self) -> list[int]:
        return [r for r, busy in enumerate(self._occupied) if busy]

    def chunks(self, row: int) -> int:
        """Chunks the stream in ``row`` has generated (its next chunk's index)."""
        return self._chunks[self._busy(row)]

    def _busy(self, row) -> int:
        row = check_int("row", row, minimum=0)
        if row >= self.rows or not self._occupied[row]:
            raise ValueError(f"row {row} holds no stream (occupied rows: {self.busy_rows})")
        return row

    def _free_row(self) -> int:
        free = self.free_rows
        if not free:
            raise RuntimeError(f"all {self.rows} rows of the pool are occupied; finish one first")
        return free[0]

    def _one_context(self, what: str, context, negative_context):
        """The checked context (and negative) of one stream, as arrays; ValueError before anything changes."""
        ctx = R._check_context(self.config, self.rc, context, negative_context)
        if ctx.shape[0] != (2 if self.rc.guidance_scale is not None else 1):
            raise ValueError(
                f"{what} takes one stream: context [1, text_tokens, text_dim], got {list(jnp.shape(context))}"
            )
        return jnp.asarray(context), None if negative_context is None else jnp.asarray(negative_context)

    def admit(self, context, key, negative_context=None) -> int:
        """Admits a stream (context [1, text_tokens, text_dim], a PRNG key; with guidance the row's own
        negative_context [1, text_tokens, text_dim]) into the first free row; returns the row. RuntimeError when
        every row is occupied (nothing changes)."""
        row = self._free_row()
        context, negative_context = self._one_context("admit", context, negative_context)
        self.state = PS.jit_admit(
            self.params, self.config, self.rc, self.state, np.int32(row), context, key, negative_context
        )
        self._occupied[row], self._chunks[row] = True, 0
        return row

    def finish(self, row: int) -> None:
        """Frees an occupied ``row``; ValueError for a row that is out of range or free (nothing changes)."""
        row = self._busy(row)
        self.state = PS.jit_finish(self.rc, self.state, np.int32(row))
        self._occupied[row] = False

    def step(self, rows=None) -> dict[int, jax.Array]:
        """One chunk for every occupied row, or for the occupied ``rows`` given (a list of row numbers, each once):
        {row: latents float32 [chunk_frames, h, w, in_dim]}. The rows that do not step wait: their state stays bit
        for bit, and later they go on as their solo streams would. One compiled program for every subset.
        ValueError, before anything changes, when no row is occupied, ``rows`` is empty, repeats a row or names a
        free or out-of-range row; OverflowError when a stepping row's next chunk would pass the int32 positions
        (absolute RoPE)."""
        busy = self.busy_rows
        if not busy:
            raise ValueError("no stream in the pool; admit one first")
        stepping = busy if rows is None else self._step_rows(rows)
        limit = self.rc.spec(self.config).max_chunks
        if self.rc.bounded and max(self._chunks[r] for r in stepping) >= limit:
            raise OverflowError(
                f"a row's next chunk would pass the int32 position limit ({limit} chunks to a stream); finish it"
            )
        mask = np.zeros(self.rows, bool)
        mask[stepping] = True
        x, self.state = PS.jit_step(self.params, self.config, self.rc, self.state, mask)
        for r in stepping:
            self._chunks[r] += 1
        return {r: x[r] for r in stepping}

    def _step_rows(self, rows) -> list[int]:
        """``rows`` checked: a non-empty list (or tuple) of distinct occupied rows, in the order given."""
        if not isinstance(rows, (list, tuple)):
            raise ValueError(f"rows must be a list of occupied row numbers or None, got {type(rows).__name__}")
        if not rows:
            raise ValueError(f"rows is empty: name at least one occupied row (occupied rows: {self.busy_rows})")
        checked = [self._busy(r) for r in rows]
        if len(set(checked)) != len(checked):
            raise ValueError(f"rows repeats a row: {list(rows)}; a row steps once per step")
        return checked

    def switch_prompt(self, row: int, context, negative_context=None, *, keep_sink: bool = True) -> None:
        """Switches ``row``'s prompt before its next chunk (context [1, text_tokens, text_dim]; with guidance the
        row's new negative_context, same shape): its cross K/V are replaced and its retained frames re-cached, as a
        solo `jaxkv.stream.Stream.switch_prompt` does; the other rows are untouched. ValueError, before
        anything changes, for a free row, a bad context, a pool that cannot switch (`jaxkv.recache.switch_refusal`)
        or a row whose ring lacks a chunk its cache holds (a session admitted without its ring)."""
        row = self._busy(row)
        why = RC.switch_refusal(self.rc)
        if why is not None:
            raise ValueError(f"this pool cannot switch prompts: {why}")
        if not isinstance(keep_sink, bool):
            raise ValueError(f"keep_sink must be a bool, got {keep_sink!r}")
        context, negative_context = self._one_context("switch_prompt", context, negative_context)
        sub, _, _, ring = PR.jit_take_row(self.rc, self.state, np.int32(row))
        RC.check_ring(self.config, self.rc, sub, ring)
        self.state = PR.jit_switch_row(
            self.params, self.config, self.rc, self.state, np.int32(row), context, negative_context, keep_sink=keep_sink
        )

    def session(self, row: int) -> S.Session:
        """The stream in ``row`` as a `jaxkv.session.Session` of batch 1 (in buffers of its own; the row goes
        on): `jaxkv.stream.Stream.from_session` continues it solo bit for bit as the row would. Its typed key is
        rebuilt from the row's key data (the default PRNG impl); its ring, when the pool keeps rings, is in
        ``extras[jaxkv.recache.RING_EXTRA]`` (`jaxkv.stream.Stream.from_session` restores it)."""
        row = self._busy(row)
        sub, key_data, chunks, ring = PR.jit_take_row(self.rc, self.state, np.int32(row))
        extras = {} if ring is None else {RC.RING_EXTRA: {"latents": ring.latents, "chunks": ring.chunks}}
        key = jax.random.wrap_key_data(key_data)
        return S.Session.create(self.config, self.rc, sub, key=key, next_chunk=chunks, extras=extras)

    def admit_session(self, session: S.Session) -> int:
        """Admits a saved stream (a `jaxkv.session.Session` of batch 1 with a noise key, e.g. a solo `Stream`'s
        ``session()`` or another pool's `session(row)`) into the first free row and returns the row; the row then
        continues it bit for bit. Its ``extras[RING_EXTRA]`` (a `Stream`'s ring), if any, becomes the
        row's ring. The session is read, not consumed. Raises, before anything changes: RuntimeError when every
        row is occupied; `jaxkv.session.SessionError` for other settings, a batch other than 1, no key, offloaded
        caches, or extras the pool does not carry (a VAE decoder state)."""
        if not isinstance(session, S.Session):
            raise TypeError(f"admit_session needs a jaxkv.session.Session, got {type(session).__name__}")
        session.check(self.config, self.rc)
        want = 2 if self.rc.guidance_scale is not None else 1
        if session.sessions != want:
            raise S.SessionError(
                f"a pool row holds one stream ({want} cache sessions), the session has {session.sessions}"
            )
        if session.on_host:
            raise S.SessionError("the session's caches are offloaded; jaxkv.session.reload() it first")
        if session.key is None:
            raise S.SessionError(
                "a pool draws each row's noise from its key; this session was made from explicit noise"
            )
        data = jax.random.key_data(session.key) if S._is_typed_key(session.key) else jnp.asarray(session.key)
        if data.shape != self.state.keys.shape[1:]:
            raise S.SessionError(
                f"the session's key data is {list(data.shape)}, the pool's keys {list(self.state.keys.shape[1:])} "
                f"(the default PRNG impl)"
            )
        other = sorted(set(session.extras) - {RC.RING_EXTRA})
        if other:
            raise S.SessionError(f"a pool row carries no {other} (session extras); take them out of the session first")
        ring = self._ring_of(session)
        row = self._free_row()
        self.state = PR.jit_put_row(self.rc, self.state, np.int32(row), session.state, data, session.next_chunk, ring)
        self._occupied[row], self._chunks[row] = True, int(session.next_chunk)
        return row

    def _ring_of(self, session: S.Session):
        """The session's saved ring as a `LatentRing` of batch 1 (checked by `jaxkv.recache.ring_from_extra`, its
        ValueError raised as a `jaxkv.session.SessionError`), or None (no ring saved, or a pool that keeps none)."""
        extra = session.extras.get(RC.RING_EXTRA)
        if extra is None or self.state.ring is None:
            return None
        empty = RC.LatentRing.init(RC.ring_spec(self.config, self.rc), self.rc.chunk_shape(self.config, 1))
        try:
            return RC.ring_from_extra(extra, empty)
        except ValueError as e:
            raise S.SessionError(str(e)) from None
