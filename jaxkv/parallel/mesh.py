"""The device mesh of a sharded rollout: axes ``data`` (sessions / streams), ``seq`` (Ulysses sequence parallel: a
chunk's tokens, exchanged for heads around attention) and ``model`` (tensor parallel: attention heads and FFN
columns), in that order.

`parse_mesh` reads the ``--mesh data=2,model=4,seq=2`` notation; `make_mesh` lays the devices out with the model
axis fastest, then seq, so the devices of one tensor-parallel group are neighbours (one host, NVLink), a sequence
group next to them, and the data axis spans hosts in a multi-process job. Axes are `AxisType.Auto`: shardings
are given on the inputs and outputs of the jitted step and the partitioner places the collectives (see
`jaxkv.parallel.rules`).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxkv.validate import check_int

DATA, SEQ, MODEL = "data", "seq", "model"
AXES = (DATA, SEQ, MODEL)  # the mesh's axis order (model fastest)


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "seq": 1, "model": 4}``; an axis not named has size 1.

    Raises ValueError for an unknown or repeated axis name, a size that is not a positive int, or an empty text."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a mesh is 'data=N,model=M,seq=S' (any may be left out), got {text!r}")
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or name not in AXES:
            raise ValueError(
                f"mesh entry {part.strip()!r} is not AXIS=SIZE with AXIS one of {list(AXES)} (in {text!r})"
            )
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} is given twice in {text!r}")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name!r} needs a positive int size, got {value.strip()!r}") from None
        sizes[name] = check_int(f"mesh axis {name!r}", size, minimum=1)
    return {axis: sizes.get(axis, 1) for axis in AXES}


def make_mesh(data: int = 1, model: int = 1, devices=None, *, seq: int = 1) -> Mesh:
    """A ``(data, seq, model)`` mesh over ``devices`` (default: every device of every process, ``jax.devices()``).

    The product of the sizes must equal the number of devices (no device is silently left idle). Devices are taken
    in process order, then local order: ``devices[(i * seq + s) * model + j]`` is at (data i, seq s, model j), so
    with one process per host and ``seq * model`` dividing the local device count a tensor- or sequence-parallel
    group never spans hosts."""
    data = check_int("mesh data size", data, minimum=1)
    model = check_int("mesh model size", model, minimum=1)
    seq = check_int("mesh seq size", seq, minimum=1)
    devices = list(jax.devices() if devices is None else devices)
    if data * seq * model != len(devices):
        raise ValueError(
            f"a mesh data={data} x seq={seq} x model={model} needs {data * seq * model} devices, but {len(devices)} "
            f"are available ({devices[0].platform}); set the sizes so their product is "
            f"{len(devices)}, or pass the devices to use (Python) / limit the visible ones "
            f"(CUDA_VISIBLE_DEVICES)"
        )
    devices.sort(key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(data, seq, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """{"data": n, "seq": s, "model": m} of a mesh made by `make_mesh` (ValueError for a mesh with other axes)."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"expected a mesh with axes {AXES} (jaxkv.parallel.make_mesh), got {tuple(mesh.axis_names)}")
    return {axis: int(mesh.shape[axis]) for axis in AXES}


def describe(mesh: Mesh) -> str:
    sizes = mesh_sizes(mesh)
    seq = f",seq={sizes[SEQ]}" if sizes[SEQ] > 1 else ""
    return f"data={sizes[DATA]},model={sizes[MODEL]}{seq} ({math.prod(sizes.values())} devices)"
