"""Snapshots of a training run (`jaxkv.toyworld.train`): params, optimizer state and position (stage, step, losses,
finished stages, time, config), written atomically every ``snapshot_every`` steps and on Ctrl-C, so ``--resume``
continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np


def save_snapshot(
    path: str,
    stage: int,
    step: int,
    params,
    opt_state,
    losses: list[float],
    done: list,
    seconds: tuple[float, float],
    tc,
    extra: dict | None = None,
) -> None:
    """params + optimizer state + position, atomically (a Ctrl-C while writing keeps the previous snapshot).
    ``seconds``: (the run's, the stage's) training time so far, so a resumed run records the whole of it; ``tc``
    the run's `jaxkv.toyworld.train.TrainConfig`, which a resumed run must repeat; ``extra``: more of what a
    resumed run must repeat (JSON), kept in position.json beside the rest."""
    from safetensors.numpy import save_file

    leaves = jax.tree.leaves((params, opt_state))
    tmp = path + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file({f"{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}, os.path.join(tmp, "state.safetensors"))
    with open(os.path.join(tmp, "position.json"), "w") as f:
        json.dump(
            {
                "stage": stage,
                "step": step,
                "losses": losses,
                "finished_stages": done,
                "seconds": round(seconds[0], 1),
                "stage_seconds": round(seconds[1], 1),
                "train_config": dataclasses.asdict(tc),
                **(extra or {}),
            },
            f,
        )
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def read_position(path: str) -> dict:
    """The snapshot's stage, step, losses and finished stages (position.json)."""
    with open(os.path.join(path, "position.json")) as f:
        return json.load(f)


def load_snapshot(path: str, template):
    from safetensors.numpy import load_file

    position = read_position(path)
    flat = load_file(os.path.join(path, "state.safetensors"))
    leaves, treedef = jax.tree.flatten(template)
    if len(flat) != len(leaves):
        raise ValueError(f"snapshot {path} holds {len(flat)} arrays, this training run has {len(leaves)}")
    restored = [jnp.asarray(flat[f"{i:05d}"], leaf.dtype) for i, leaf in enumerate(leaves)]
    return position, jax.tree.unflatten(treedef, restored)
