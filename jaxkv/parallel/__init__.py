"""The Wan rollout past one device, on a ``jax.sharding`` mesh: ``data`` (sessions) x ``seq`` (Ulysses sequence
parallel) x ``model`` (tensor parallel).

* `make_mesh`, `parse_mesh` (``"data=2,model=4,seq=2"``): the mesh (`jaxkv.parallel.mesh`).
* `RULES`, `param_shardings`, `shard_params`: parameter shardings from one rule table (`jaxkv.parallel.rules`).
* `load_sharded`: a checkpoint read straight into its shards (`jaxkv.parallel.loading`).
* `MeshStream`, `mesh_step`, `init_state`, `state_shardings`: the sharded streaming rollout
  (`jaxkv.parallel.rollout`); `mesh_switch`: prompt switching on the mesh (`MeshStream.switch_prompt`);
  `mesh_commit`: given latents committed on the mesh (`MeshStream.commit`); `MeshSwitchableStream`: a deprecated
  shim (returns the MeshStream itself).
* `mesh_rollout`, `mesh_rollout_program`: the scan rollout (`jaxkv.rollout.rollout`) on the mesh
  (`jaxkv.parallel.scan`).
* `jaxkv.parallel.checkpoint`: a mesh session saved shard by shard (by every process of a multi-process job,
  `jaxkv.parallel.processes`), loaded onto any mesh shape or one device.
"""

from jaxkv import recache
from jaxkv.parallel.loading import load_sharded
from jaxkv.parallel.mesh import AXES, DATA, MODEL, SEQ, make_mesh, mesh_sizes, parse_mesh
from jaxkv.parallel.rollout import (
    MeshStream,
    check_mesh,
    init_state,
    local_rows,
    mesh_commit,
    mesh_step,
    mesh_switch,
    session_order,
    state_shardings,
)
from jaxkv.parallel.rules import RULES, param_shardings, param_specs, put_global, shard_params
from jaxkv.parallel.scan import mesh_rollout, mesh_rollout_program


def MeshSwitchableStream(stream: MeshStream) -> MeshStream:
    """Deprecated (one release): a `MeshStream` switches itself (``switch_prompt``, run by `mesh_switch`); returns
    ``stream`` itself after a DeprecationWarning (`jaxkv.recache.SwitchableStream`)."""
    if not isinstance(stream, MeshStream):
        raise TypeError(f"MeshSwitchableStream wraps a MeshStream, got {type(stream).__name__}")
    return recache.SwitchableStream(stream)


__all__ = [
    "AXES",
    "DATA",
    "MODEL",
    "RULES",
    "SEQ",
    "MeshStream",
    "MeshSwitchableStream",
    "check_mesh",
    "init_state",
    "load_sharded",
    "local_rows",
    "mesh_commit",
    "mesh_rollout",
    "mesh_rollout_program",
    "make_mesh",
    "mesh_sizes",
    "mesh_step",
    "mesh_switch",
    "param_shardings",
    "param_specs",
    "parse_mesh",
    "put_global",
    "session_order",
    "shard_params",
    "state_shardings",
]
