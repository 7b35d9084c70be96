"""The scan rollout on a ``(data, seq, model)`` mesh: `jaxkv.rollout.rollout` (the whole rollout as one ``lax.scan``
over chunks) run by each data group on its own sessions, one compiled program per (mesh, config, rc, num_chunks).

The layout is `jaxkv.parallel.rollout`'s: params by the rule table, the state in `state_shardings` with rows in
`session_order`, the latents [batch, ...] split over ``data`` in batch order. The program is ``jit`` over the same
kind of ``shard_map`` as `mesh_step` (manual on ``data``, ``model`` and ``seq`` automatic, the Ulysses layouts when
``seq`` > 1), so a data group scans `jaxkv.rollout.generate_chunk` exactly as one device scans its batch.

Noise drawn from a key is drawn for the global batch, chunk n from ``fold_in(key, first_chunk + n)`` as `rollout`
draws it (``jax_threefry_partitionable``: each device computes only its rows), then split over ``data``; so
`mesh_rollout`, `jaxkv.rollout.rollout` and a `MeshStream` give the same chunks for the same key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import rollout as R
from jaxkv.models.wan.config import WanConfig
from jaxkv.parallel.mesh import DATA, mesh_sizes
from jaxkv.parallel.rollout import _layout, _out_state, check_mesh, init_state, state_partition_specs, state_shardings
from jaxkv.parallel.rules import put_global, shard_params
from jaxkv.validate import check_int

NOISE_SPEC = P(None, None, DATA)  # [num_chunks, steps, batch, chunk_frames, h, w, in_dim]: batch on data


@functools.lru_cache(maxsize=None)
def mesh_rollout_program(mesh: Mesh, config: WanConfig, rc: R.RolloutConfig, num_chunks: int):
    """The jitted, state-donating scan rollout on ``mesh``:
    ``run(params, state, key_data, first_chunk, noise) -> Rollout(latents [batch, num_chunks * chunk_frames, h, w,
    in_dim], state)``.

    params on the mesh (`jaxkv.parallel.shard_params`); state laid out on the mesh (`jaxkv.parallel.init_state`, or a
    previous run's state: it is consumed); key_data: uint32 raw key (``jax.random.key_data``) with first_chunk
    int32 [] (traced: any offset runs the same program), or None with explicit noise float32
    [num_chunks, steps, batch, chunk_frames, h, w, in_dim] (batch order). Differentiable in params and noise. One
    program per (mesh, config, rc, num_chunks) and input signature (``jaxkv.compilation.compile_count(run)``); the
    returned state has the shardings of `state_shardings`, the latents are split over ``data``.
    """
    num_chunks = check_int("num_chunks", num_chunks, minimum=1)

    def local(params, state, noise):
        with _layout(mesh):
            out = R.rollout(params, config, rc, None, num_chunks=num_chunks, noise=noise, state=state)
        return out.latents, out.state

    def run(params, state, key_data, first_chunk, noise):
        if noise is None:
            batch = state.cache.batch // (2 if rc.guidance_scale is not None else 1)
            key = jax.random.wrap_key_data(key_data)
            chunks = jnp.asarray(first_chunk, jnp.int32) + jnp.arange(num_chunks, dtype=jnp.int32)
            noise = jax.vmap(lambda n: R.chunk_noise(key, config, rc, batch, n))(chunks)
        noise = jax.lax.with_sharding_constraint(noise.astype(jnp.float32), NamedSharding(mesh, NOISE_SPEC))
        specs = state_partition_specs(state, manual_only=True)
        latents, state = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), specs, NOISE_SPEC),
            out_specs=(P(DATA), specs),
            axis_names=frozenset({DATA}),
            check_vma=False,
        )(params, state, noise)
        return R.Rollout(latents, state)

    out = R.Rollout(NamedSharding(mesh, P(DATA)), _out_state(mesh, config, rc))
    return jax.jit(run, out_shardings=out, donate_argnums=(1,))


def mesh_rollout(
    params,
    config: WanConfig,
    rc: R.RolloutConfig,
    context,
    *,
    mesh: Mesh,
    num_chunks: int,
    key=None,
    noise=None,
    negative_context=None,
    state: R.RolloutState | None = None,
    first_chunk: int = 0,
) -> R.Rollout:
    """`jaxkv.rollout.rollout` on ``mesh`` (arguments as there), run by `mesh_rollout_program`.

    params: host/single-device arrays (placed by the rule table) or already on the mesh. context
    [batch, text_tokens, text_dim] (and negative_context, iff guidance) make a fresh sharded state (`init_state`);
    or ``state``, a mesh state of this mesh (rows in `session_order`, arrays in `state_shardings`: a previous
    `mesh_rollout`'s, `MeshStream.state`), which is consumed. noise [num_chunks, steps, batch, ...] is in batch order.
    Returns Rollout(latents [batch, num_chunks * chunk_frames, h, w, in_dim] split over ``data`` in batch order, the
    final mesh state). ValueError before anything runs for arguments that do not fit the mesh or the rollout.
    """
    num_chunks = check_int("num_chunks", num_chunks, minimum=1)
    if (context is None) == (state is None):
        raise ValueError("mesh_rollout needs exactly one of a context (a fresh state) or a state to continue")
    if (key is None) == (noise is None):
        raise ValueError("pass exactly one of key= (noise drawn per chunk) or noise= (explicit noise)")
    guided = rc.guidance_scale is not None
    batch = int(np.shape(context)[0]) if state is None else state.cache.batch // (2 if guided else 1)
    check_mesh(mesh, config, rc, batch)
    if isinstance(first_chunk, (bool, np.bool_)) or not isinstance(first_chunk, (int, np.integer)) or first_chunk < 0:
        raise ValueError(f"first_chunk must be an int >= 0, got {first_chunk!r}")
    R.check_position_room(config, rc, num_chunks, None if state is None else state.cache)
    if noise is not None and tuple(np.shape(noise)) != rc.noise_shape(config, batch, num_chunks):
        raise ValueError(
            f"noise must be [num_chunks, steps, batch, chunk_frames, h, w, in_dim] = "
            f"{list(rc.noise_shape(config, batch, num_chunks))}, got {list(np.shape(noise))}"
        )
    if state is not None:
        _check_laid_out(state, mesh)
    params = shard_params(params, mesh)
    if state is None:
        state = init_state(params, config, rc, mesh, context, negative_context)
    run = mesh_rollout_program(mesh, config, rc, num_chunks)
    if noise is not None:
        return run(params, state, None, None, put_global(noise, NamedSharding(mesh, NOISE_SPEC)))
    replicated = NamedSharding(mesh, P())
    key_data = put_global(jax.random.key_data(key), replicated)
    return run(params, state, key_data, put_global(np.int32(first_chunk), replicated), None)


def _check_laid_out(state: R.RolloutState, mesh: Mesh) -> None:
    """ValueError unless every array of ``state`` is a global array in its `state_shardings` on ``mesh``."""
    want = state_shardings(state, mesh)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        if not (isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)):
            raise ValueError(
                f"the state is not laid out on this mesh ({mesh_sizes(mesh)}): an array {list(np.shape(leaf))} has "
                f"sharding {getattr(leaf, 'sharding', 'none (host)')}; continue a mesh_rollout's or MeshStream's "
                f"state, or place a single-device session with jaxkv.parallel.checkpoint.to_mesh"
            )
