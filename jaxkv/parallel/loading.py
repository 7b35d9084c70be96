"""Loading a jaxkv Wan checkpoint straight into its shards on a mesh.

Each parameter becomes a global array of its rule-table sharding (`jaxkv.parallel.rules`) built with
``jax.make_array_from_callback``: every process reads, for each of its devices, only that device's slice of the
safetensors file, so a 14B checkpoint never materialises whole on one device or one host (a replicated parameter
is read once per local device; those are the small ones).
"""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding

from jaxkv.models.checkpoint_dir import load_params
from jaxkv.models.wan.checkpoint import read_config
from jaxkv.models.wan.config import WanConfig
from jaxkv.models.wan.params import param_shapes, validate_params
from jaxkv.parallel.rules import param_shardings, spec_of


def load_sharded(path: str, mesh: Mesh, dtype=None) -> tuple[WanConfig, dict]:
    """(WanConfig, params as global arrays sharded on ``mesh``) of the checkpoint directory ``path``.

    ``dtype`` casts (None keeps the stored dtype). Shapes are checked against the config from the file header
    before any data is read; CheckpointError names a missing or foreign directory, a bad file or a mismatch, and
    ValueError a parameter the mesh's model axis does not divide."""
    config = read_config(path)
    param_shardings(param_shapes(config), mesh)  # a mesh that does not divide the model fails before any read

    def sharding_of(key: str, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(mesh, spec_of(key, shape))

    return config, load_params(path, lambda tree: validate_params(tree, config), dtype, sharding_of=sharding_of)
