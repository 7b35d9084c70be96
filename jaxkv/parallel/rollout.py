"""The streaming rollout on a ``(data, seq, model)`` mesh: the same `jaxkv.rollout.generate_chunk`, one compiled
step.

Layout:
  * params: the rule table of `jaxkv.parallel.rules` (Megatron tensor parallel over ``model``, copies over ``data``
    and ``seq``);
  * KV ring k, v [layers, sessions, capacity, heads, head_dim]: sessions on ``data``, heads on ``(model, seq)``;
    positions [sessions, capacity] and chunk_start [sessions] on ``data`` (with dilated layers, ``dilated_every``:
    the `DilatedCache`, or each stack of the `MixedCache`, the same way: `jaxkv.cache.sharding`);
  * cross-attention K/V [layers, sessions, text_tokens, heads, head_dim]: sessions on ``data``, heads on
    ``(model, seq)``;
  * noise [steps, batch, ...] and the chunk latents [batch, ...]: batch on ``data``.

The step is ``jit`` over a ``shard_map`` that is manual on ``data`` only: each data group runs `generate_chunk` on
its own sessions (so a chunk write is a per-session dynamic update slice, in place, instead of the whole-shard select
the partitioner makes of a write into a row of a batch-sharded buffer), while ``model`` and ``seq`` stay automatic
and the partitioner inserts the all-reduces after each o projection and FFN.

Ulysses sequence parallelism (``seq`` = s > 1): outside attention (patch embedding, norms, modulation, FFN, head)
the chunk's activations [batch, tokens, dim] are split by tokens over ``seq``. Around self- and cross-attention q,
k, v go from token-split to head-split (an all-to-all within each sequence group): each device then holds every
token of the chunk for heads / (model * s) heads, writes them into its own heads of the ring and attends against
that head group's whole ring (and its heads of the cross K/V); the output goes back to token-split by another
all-to-all before the o projection. No cache layer ever moves. The layouts are pinned by sharding constraints at
the model's hooks (`jaxkv.models.wan.activation_sharding`, entered by `mesh_step` while tracing when s > 1) and the
partitioner inserts the all-to-alls. Needs heads % (model * s) == 0 and the chunk's tokens % s == 0 (`check_mesh`).
With s = 1 no constraint is added and the step traces exactly as on a ``(data, model)`` mesh.

The state is created sharded (`init_state`, under ``jit`` with ``out_shardings``), donated to every step and
returned with the same shardings, so no cache is ever gathered (tests/test_parallel.py checks the compiled HLO).
Given latents (`MeshStream.commit`) are committed the same way (`mesh_commit`), and a prompt switch
(`MeshStream.switch_prompt`, the latent history kept in batch order) too (`mesh_switch`): per data group, one program,
the state donated.

With classifier-free guidance a session's conditional and negative rows must sit in the same data group:
`init_state` orders the state's rows shard by shard, ``[cond rows of group 0, negative rows of group 0, cond rows
of group 1, ...]`` (on one data group that is `jaxkv.rollout`'s order). The latents come back in batch order.

Noise drawn from a key is drawn for the global batch (``jax_threefry_partitionable``: the values do not depend on
the sharding), so a mesh stream and `jaxkv.stream.Stream` give the same chunks for the same key.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import recache
from jaxkv import rollout as R
from jaxkv.cache.sharding import cache_partition_specs
from jaxkv.models.wan import model as M
from jaxkv.models.wan.activation_sharding import HEADS, TOKEN_HEADS, TOKENS, activation_layout
from jaxkv.models.wan.config import WanConfig
from jaxkv.parallel.mesh import DATA, MODEL, SEQ, mesh_sizes
from jaxkv.parallel.rules import put_global, shard_params
from jaxkv.stream import Stream

HEAD_AXES = (MODEL, SEQ)  # heads split model-major: a model group's heads, split again over its sequence group
CROSS_SPEC = P(None, DATA, None, HEAD_AXES, None)  # [layers, sessions, text_tokens, heads, head_dim]
# the Ulysses layouts inside a data group (the data axis is manual there): see the module docstring
ULYSSES = {
    TOKENS: P(None, SEQ, None),  # [batch, tokens, dim]
    HEADS: P(None, None, HEAD_AXES, None),  # [batch, tokens, heads, head_dim]
    TOKEN_HEADS: P(None, SEQ, MODEL, None),  # [batch, tokens, heads, head_dim]
}


def session_order(batch: int, data: int, guided: bool) -> np.ndarray:
    """int [sessions]: row i of a mesh state holds `jaxkv.rollout`'s session ``order[i]`` (identity without
    guidance; with guidance each data group's cond rows are followed by its negative rows)."""
    if not guided:
        return np.arange(batch)
    local = batch // data
    return np.concatenate(
        [np.concatenate([d * local + np.arange(local), batch + d * local + np.arange(local)]) for d in range(data)]
    )


def state_partition_specs(state: R.RolloutState, *, manual_only: bool = False) -> R.RolloutState:
    """The `PartitionSpec`s of a mesh state; ``manual_only`` drops the head axes ``model`` and ``seq`` (the specs
    of the shard_map, which is manual on ``data`` only)."""
    head = None if manual_only else HEAD_AXES
    cross = P(None, DATA, None, head, None)
    return R.RolloutState(cache_partition_specs(state.cache, data_axis=DATA, head_axis=head), M.CrossKV(cross, cross))


def _canonical(spec: P, mesh: Mesh) -> P:
    """``spec`` in the form jit gives its outputs (axes of size 1 dropped, no trailing Nones), so the state that
    `init_state` makes and the one a step returns have equal (not merely equivalent) shardings and hit one
    compiled program."""

    def keep(axis):
        if isinstance(axis, tuple):
            axis = tuple(a for a in axis if mesh.shape[a] > 1)
            return axis[0] if len(axis) == 1 else axis or None
        return None if axis is not None and mesh.shape[axis] == 1 else axis

    parts = [keep(axis) for axis in spec]
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def state_shardings(state, mesh: Mesh) -> R.RolloutState:
    """`NamedSharding`s of a mesh state (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, _canonical(spec, mesh)),
        state_partition_specs(state),
        is_leaf=lambda x: isinstance(x, P),
    )


def check_mesh(mesh: Mesh, config: WanConfig, rc: R.RolloutConfig, batch: int) -> dict[str, int]:
    """The mesh sizes, after checking that batch divides over ``data``, heads over ``model * seq``, FFN over
    ``model`` and the chunk's tokens over ``seq`` (ValueError naming the one that does not)."""
    sizes = mesh_sizes(mesh)
    if batch % sizes[DATA]:
        raise ValueError(
            f"batch {batch} is not divisible by the mesh's data axis ({sizes[DATA]}): each data group "
            f"runs batch / data sessions"
        )
    for what, n in (("num_heads", config.num_heads), ("ffn_dim", config.ffn_dim)):
        if n % sizes[MODEL]:
            raise ValueError(
                f"the model's {what} ({n}) is not divisible by the mesh's model axis ({sizes[MODEL]}): "
                f"tensor parallelism splits whole heads and FFN columns"
            )
    if config.num_heads % (sizes[MODEL] * sizes[SEQ]):
        raise ValueError(
            f"the model's num_heads ({config.num_heads}) is not divisible by the mesh's model x seq axes "
            f"({sizes[MODEL]} x {sizes[SEQ]}): sequence parallelism gives each device whole heads of its model group"
        )
    tokens = rc.tokens_per_frame(config) * rc.chunk_frames
    if tokens % sizes[SEQ]:
        raise ValueError(
            f"the chunk's {tokens} tokens ({rc.chunk_frames} frames x {rc.tokens_per_frame(config)} tokens per "
            f"frame) are not divisible by the mesh's seq axis ({sizes[SEQ]}): sequence parallelism splits a "
            f"chunk's tokens evenly"
        )
    return sizes


def init_state(params, config: WanConfig, rc: R.RolloutConfig, mesh: Mesh, context, negative_context=None):
    """`jaxkv.rollout.init_state` created directly in its mesh shardings (`state_shardings`), rows in
    `session_order`. ``params`` must already be on the mesh (`jaxkv.parallel.shard_params`); context
    [batch, text_tokens, text_dim] (and negative_context) may be host or global arrays."""
    batch = int(np.shape(context)[0])
    sizes = check_mesh(mesh, config, rc, batch)
    guided = rc.guidance_scale is not None
    order = session_order(batch, sizes[DATA], guided)
    replicated = NamedSharding(mesh, P())
    context = put_global(context, replicated)
    negative_context = None if negative_context is None else put_global(negative_context, replicated)

    def build(params, context, negative_context):
        state = R.init_state(params, config, rc, context, negative_context)
        cross = M.CrossKV(state.cross.k[:, order], state.cross.v[:, order])  # the empty cache needs no reorder
        return R.RolloutState(state.cache, cross)

    shapes = jax.eval_shape(build, params, context, negative_context)
    return jax.jit(build, out_shardings=state_shardings(shapes, mesh))(params, context, negative_context)


@functools.lru_cache(maxsize=None)
def mesh_step(mesh: Mesh, config: WanConfig, rc: R.RolloutConfig):
    """The jitted, state-donating chunk step on ``mesh``:
    ``step(params, state, key_data, index, noise) -> (latents [batch, chunk_frames, h, w, in_dim], state)``.

    key_data: uint32 raw key (``jax.random.key_data``) with index int32 [] to draw the chunk's noise, or None with
    explicit noise float32 [steps, batch, chunk_frames, h, w, in_dim]. One program per (mesh, config, rc) and shape
    (``jaxkv.compilation.compile_count(step)``); the returned state has the shardings of `state_shardings`.
    """
    noise_sharding = NamedSharding(mesh, P(None, DATA))
    out_sharding = NamedSharding(mesh, P(DATA))

    def chunk(params, state, noise):
        with _layout(mesh):
            return R.generate_chunk(params, config, rc, state, noise)

    def step(params, state, key_data, index, noise):
        batch = state.cache.batch // (2 if rc.guidance_scale is not None else 1)
        if noise is None:
            noise = R.chunk_noise(jax.random.wrap_key_data(key_data), config, rc, batch, index)
        noise = jax.lax.with_sharding_constraint(noise.astype(jnp.float32), noise_sharding)
        specs = state_partition_specs(state, manual_only=True)
        local = jax.shard_map(
            chunk,
            mesh=mesh,
            in_specs=(P(), specs, P(None, DATA)),
            out_specs=(P(DATA), specs),
            axis_names=frozenset({DATA}),
            check_vma=False,
        )
        return local(params, state, noise)

    return jax.jit(step, out_shardings=(out_sharding, _out_state(mesh, config, rc)), donate_argnums=(1,))


def _layout(mesh: Mesh):
    """The context a data group's model runs in: the Ulysses activation layouts when ``seq`` > 1 (read while the
    step traces: the model's constraints), nothing otherwise (the step then traces as on a (data, model) mesh)."""
    return activation_layout(ULYSSES) if mesh_sizes(mesh)[SEQ] > 1 else contextlib.nullcontext()


def _out_state(mesh: Mesh, config: WanConfig, rc: R.RolloutConfig) -> R.RolloutState:
    """The `state_shardings` a mesh program pins its returned state to (heads on model included). They need the
    cache's pytree structure, which the config and rc fix (the batch does not change it)."""
    cache = jax.eval_shape(lambda: R.empty_cache(config, rc, 1))
    return state_shardings(R.RolloutState(cache, None), mesh)


@functools.lru_cache(maxsize=None)
def mesh_commit(mesh: Mesh, config: WanConfig, rc: R.RolloutConfig):
    """The jitted, state-donating commit of given clean latents on ``mesh`` (`jaxkv.rollout.commit` run by each
    data group on its own sessions, as `mesh_step` runs a chunk): ``commit(params, state, latents) -> state`` with
    latents float32 [batch, n * chunk_frames, h, w, in_dim] split over ``data`` (batch order). With guidance a data
    group's rows are its cond rows then its negative rows (`session_order`), the order in which `commit` gives each
    row's frames to both its sessions. One program per (mesh, config, rc) and shape; the returned state has the
    shardings of `state_shardings`."""

    def local(params, state, latents):
        with _layout(mesh):
            return R.commit(params, config, rc, state, latents)

    def commit(params, state, latents):
        specs = state_partition_specs(state, manual_only=True)
        run = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), specs, P(DATA)),
            out_specs=specs,
            axis_names=frozenset({DATA}),
            check_vma=False,
        )
        return run(params, state, latents)

    return jax.jit(commit, out_shardings=_out_state(mesh, config, rc), donate_argnums=(1,))


class MeshStream(Stream):
    """`jaxkv.stream.Stream` on a mesh: the same iterator (``next()`` -> the chunk's latents float32
    [batch, chunk_frames, h, w, in_dim], a global array sharded on ``data``; ``stream.state``), run by `mesh_step`.

    ``params`` may be host/single-device arrays (placed by the rule table) or already on the mesh
    (`jaxkv.parallel.shard_params`, `jaxkv.parallel.load_sharded`: kept as they are). In a multi-process job every
    process constructs the same MeshStream with the same arguments; each holds only its devices' shards, and
    `local_rows` gives a process its rows of the latents.
    """

    def __init__(
        self,
        params,
        config: WanConfig,
        rc: R.RolloutConfig,
        context,
        *,
        mesh: Mesh,
        num_chunks: int | None = None,
        key=None,
        noise=None,
        negative_context=None,
        history: bool = True,
    ):
        check_mesh(mesh, config, rc, int(np.shape(context)[0]))
        self.mesh = mesh
        self.step = mesh_step(mesh, config, rc)
        self._replicated = NamedSharding(mesh, P())
        super().__init__(
            shard_params(params, mesh),
            config,
            rc,
            context,
            num_chunks=num_chunks,
            key=key,
            noise=noise,
            negative_context=negative_context,
            history=history,
        )

    @classmethod
    def from_session(
        cls,
        params,
        config: WanConfig,
        rc: R.RolloutConfig,
        session,
        *,
        mesh: Mesh,
        num_chunks=None,
        noise=None,
        history: bool = True,
    ) -> "MeshStream":
        """A mesh stream that continues ``session``, a session laid out on ``mesh`` (rows in `session_order`, arrays
        in `state_shardings`): `jaxkv.parallel.checkpoint.load` with this mesh, `jaxkv.parallel.checkpoint.to_mesh`
        of a single-device session, or ``MeshStream.session()`` of a stream on the same mesh. Otherwise as
        `jaxkv.stream.Stream.from_session` (the session is consumed; SessionError for other settings), and
        ValueError, before anything runs, for a session laid out otherwise."""
        from jaxkv import session as S

        if not isinstance(session, S.Session):
            raise TypeError(f"from_session needs a jaxkv.session.Session, got {type(session).__name__}")
        check_mesh(mesh, config, rc, session.sessions // (2 if rc.guidance_scale is not None else 1))
        want = state_shardings(session.state, mesh)
        for leaf, sharding in zip(jax.tree.leaves(session.state), jax.tree.leaves(want)):
            if not (isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)):
                raise ValueError(
                    f"the session is not laid out on this mesh ({mesh_sizes(mesh)}): an array "
                    f"{list(leaf.shape)} has sharding {getattr(leaf, 'sharding', 'none (host)')}; load it with "
                    f"jaxkv.parallel.checkpoint.load(..., mesh=mesh) or place it with checkpoint.to_mesh"
                )
        self = super().from_session(
            shard_params(params, mesh), config, rc, session, num_chunks=num_chunks, noise=noise, history=history
        )
        self.mesh = mesh
        self.step = mesh_step(mesh, config, rc)
        self._replicated = NamedSharding(mesh, P())
        return self

    def _init_state(self, context, negative_context) -> R.RolloutState:
        return init_state(self.params, self.config, self.rc, self.mesh, context, negative_context)

    def _commit_chunk(self, chunk) -> R.RolloutState:
        # `jaxkv.stream.Stream.commit` checks the latents and calls this once per chunk [batch, chunk_frames, ...]
        step = mesh_commit(self.mesh, self.config, self.rc)
        return step(self.params, self.state, put_global(chunk, NamedSharding(self.mesh, P(DATA))))

    def _switch(self, context, negative_context, keep_sink: bool) -> R.RolloutState:
        # `Stream.switch_prompt` checked the history and keep_sink; the contexts are checked here, before placing
        sessions = R._check_context(self.config, self.rc, jnp.asarray(context), negative_context)
        if sessions.shape[0] != self.state.cache.batch:
            raise ValueError(
                f"the new context has {sessions.shape[0]} sessions but the state has {self.state.cache.batch}"
            )
        rows = NamedSharding(self.mesh, P(DATA))  # the ring and contexts in batch order, split over data
        negative = () if negative_context is None else (put_global(negative_context, rows),)
        step = mesh_switch(self.mesh, self.config, self.rc, keep_sink)
        return step(self.params, self.state, self.ring, put_global(context, rows), *negative)

    def _run_step(self, key, index, noise):
        if noise is not None:
            return self.step(
                self.params, self.state, None, None, put_global(noise, NamedSharding(self.mesh, P(None, DATA)))
            )
        return self.step(
            self.params,
            self.state,
            put_global(jax.random.key_data(key), self._replicated),
            put_global(index, self._replicated),
            None,
        )


def local_rows(x: jax.Array) -> tuple[slice, np.ndarray]:
    """(rows, values) of this process's part of ``x`` sharded on its leading axis (the latents of a
    `MeshStream`): ``values == x[rows]`` on the host. Raises ValueError if the process's shards are not one
    contiguous block of rows."""
    shards = sorted({(s.index[0].start or 0, s.index[0].stop or x.shape[0]): s for s in x.addressable_shards}.items())
    start, stop = shards[0][0][0], shards[-1][0][1]
    if any(a[0][1] != b[0][0] for a, b in zip(shards, shards[1:])):
        raise ValueError(f"this process's rows of {list(x.shape)} are not contiguous: {[s[0] for s in shards]}")
    return slice(start, stop), np.concatenate([np.asarray(s.data) for _, s in shards], axis=0)


@functools.lru_cache(maxsize=None)
def mesh_switch(mesh: Mesh, config: WanConfig, rc: R.RolloutConfig, keep_sink: bool):
    """The jitted, state-donating prompt switch on ``mesh`` (`jaxkv.recache.switch_prompt` run by each data group
    on its own sessions, as `mesh_step` runs a chunk): ``switch(params, state, ring, context[, negative_context])
    -> state`` with the ring (`jaxkv.recache.LatentRing`, rows in batch order) and the contexts
    [batch, text_tokens, text_dim] split over ``data``; a data group's rows of the state are its cond rows then its
    negative rows (`session_order`), which is the order `switch_prompt` expects of one group. The returned state
    has the shardings of `state_shardings`."""

    guided = rc.guidance_scale is not None

    def local(params, state, ring, context, *negative):
        return recache.switch_prompt(
            params, config, rc, state, ring, context, *negative, keep_sink=keep_sink, cross=state.cross
        )

    def switch(params, state, ring, context, *negative):
        # The new cross K/V are projected for the whole batch (replicated), as `init_state` does: a data group of
        # one row would round its projection differently from one device's batch (up to 4e-7 on CPU)
        replicated = NamedSharding(mesh, P())
        whole = [jax.lax.with_sharding_constraint(c, replicated) for c in (context, *negative)]
        sessions = R._check_context(config, rc, whole[0], whole[1] if negative else None)
        cross = M.cross_kv(params, config, sessions, run=rc.run)
        cross = jax.lax.with_sharding_constraint(cross, replicated)
        order = session_order(int(context.shape[0]), mesh.shape[DATA], guided)
        state = R.RolloutState(state.cache, M.CrossKV(cross.k[:, order], cross.v[:, order]))
        specs = state_partition_specs(state, manual_only=True)
        ring_specs = ring.replace(latents=P(DATA), chunks=P(DATA))
        run = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), specs, ring_specs, P(DATA), *(P(DATA),) * len(negative)),
            out_specs=specs,
            axis_names=frozenset({DATA}),
            check_vma=False,
        )
        return run(params, state, ring, context, *negative)

    return jax.jit(switch, out_shardings=_out_state(mesh, config, rc), donate_argnums=(1,))
