"""Training the toy model from scratch on CPU, with optax: ``python -m jaxkv.toyworld train --out DIR``.

1. The latent map is fitted on world frames (`latents.LatentMap.fit`, a second).
2. **Diffusion forcing under the streaming mask.** Clips of `TrainConfig.chunks` chunks go through
   `jaxkv.models.wan.forward_block_causal` with the sink + window mask the stream will use. A clip's first j chunks
   (j uniform in 0..chunks-1) are clean, as committed chunks are in the cache at generation (timestep 0); the
   others each get their own noise level, drawn from the sampler's levels (`Settings.steps`): the model only has
   to be right where it will be asked, which is what makes a few thousand steps enough. Loss: the flow ``eps - x0`` on the noisy chunks (rectified flow, Wan's
   parameterisation). The text encoder trains with the DiT. The DiT starts from `init_dit`: Wan's random init
   with every residual branch's output projection and the head zeroed (the DiT "adaLN-zero" start), which
   trained markedly faster here than the test-oriented `wan.init_params` alone.
3. **Self-forcing through the ring.** The first chunk of a clip is committed to an empty cache as generation
   commits a chunk; then `jaxkv.rollout.rollout` samples the next ``sf_chunks`` chunks with the model's own few-step
   sampler on the ring cache (its own samples fill the cache; the ring wraps), and the loss is the squared error of
   the rolled-out latents to the world's true continuation, differentiated through the whole rollout. The world
   is deterministic once its first frames are seen, so the true continuation is the target; what this stage adds
   over stage 2 is that the model learns from the inputs it will really see: its own samples, not the truth.

Every random draw is a function of (seed, stage, step), so a run is reproducible and a resumed run
(`--resume`, from the snapshot written every ``snapshot_every`` steps and on Ctrl-C) continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv import rollout as R
from jaxkv.models import wan
from jaxkv.models.umt5.encoder import _encode_masked
from jaxkv.models.wan import model as M
from jaxkv.toyworld import latents, text, world
from jaxkv.toyworld.model import WAN_CONFIG, Settings
from jaxkv.toyworld.model import save as save_release


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    batch: int = 8
    chunks: int = 5              # chunks per diffusion-forcing clip: the last sees the sink + window, not chunk 1
    steps: int = 2000            # diffusion-forcing steps
    lr: float = 1e-3
    warmup: int = 100
    first_steps: int = 400       # first-chunk steps
    first_batch: int = 32
    first_lr: float = 5e-4
    sf_steps: int = 100          # self-forcing steps
    sf_batch: int = 4
    sf_chunks: int = 4           # chunks rolled out after the true first chunk (the 4-chunk cache wraps)
    sf_lr: float = 2e-4
    fit_frames: int = 2048       # frames the latent map is fitted on
    snapshot_every: int = 250


# ------------------------------------------------------------------------------------------------ data


def fit_latent_map(tc: TrainConfig) -> latents.LatentMap:
    rng = np.random.default_rng([tc.seed, 0])
    frames, _ = world.clips(rng, tc.fit_frames // 4, 4)
    return latents.LatentMap.fit(frames.reshape(-1, *frames.shape[2:]))


def batch(latent_map, tokenizer, seed: int, stage: int, step: int, size: int, frames: int, start_share: float = 0.5):
    """(latents float32 [size, frames, 16, 16, 16], ids int32 [size, text_len], mask int32 [size, text_len],
    at_start bool [size]) of random prompts' `world.canonical_scene`, each clip starting at the scene's first frame
    (``at_start``, a ``start_share`` of them) or at a frame uniform in 1..`MAX_START`; drawn from (seed, stage,
    step) alone."""
    rng = np.random.default_rng([seed, stage, step])
    prompts = [world.random_prompt(rng) for _ in range(size)]
    at_start = rng.random(size) < start_share
    starts = np.where(at_start, 0, rng.integers(1, MAX_START + 1, size))
    video = np.stack([world.render(world.canonical_scene(p), frames, int(t)) for p, t in zip(prompts, starts)])
    ids, mask, _ = tokenizer(prompts, text.CONFIG.text_len)
    return latent_map.encode(video), ids, mask, at_start


# Training clips start anywhere in the first MAX_START frames of a scene: its paths (a fold of period 88 or 44
# frames per axis, `world.trajectory`) have long covered every state by then.
MAX_START = 4096


# ------------------------------------------------------------------------------------------------ losses


# Leaves that start at zero: every residual branch's output projection and the head, so the untrained DiT is the
# identity on its residual stream and predicts zero flow.
_ZERO_INIT = ("self_attn.o.", "cross_attn.o.", "ffn.fc2.", "head.head.")


def init_dit(key) -> dict:
    """The DiT's starting params: `wan.init_params`, then the `_ZERO_INIT` leaves zeroed, biases zero and norm
    scales one."""
    def start(path, x):
        name = jax.tree_util.keystr(path, simple=True, separator=".") + "."
        if any(part in name for part in _ZERO_INIT) or name.endswith(".bias."):
            return jnp.zeros_like(x)
        return jnp.ones_like(x) if name.endswith(".scale.") else x

    return jax.tree_util.tree_map_with_path(start, wan.init_params(WAN_CONFIG, key))


def _context(text_params, ids, mask):
    return _encode_masked(text_params, text.CONFIG, ids, mask)


def diffusion_forcing_loss(params, x0, ids, mask, at_start, key, tc: TrainConfig, settings: Settings):
    """Flow-matching loss of clips x0 [B, F, h, w, c] with independent per-chunk noise levels (see the module)."""
    b, f = x0.shape[:2]
    chunks = f // settings.chunk_frames
    k_level, k_clean, k_eps = jax.random.split(key, 3)
    levels = jnp.asarray(settings.schedule().sigmas(), jnp.float32)        # the sampler's noise levels
    sigma = levels[jax.random.randint(k_level, (b, chunks), 0, levels.shape[0])]
    # a clean prefix, of at least one chunk unless the clip starts the scene: chunk 0 without context is only ever
    # a scene's first frame, which the prompt fixes (`world.canonical_scene`)
    prefix = jax.random.randint(k_clean, (b, 1), jnp.where(at_start, 0, 1)[:, None], chunks)
    clean = jnp.arange(chunks)[None] < prefix
    sigma = jnp.where(clean, 0.0, sigma)
    sigma = jnp.repeat(sigma, settings.chunk_frames, axis=1)                     # [B, F]
    eps = jax.random.normal(k_eps, x0.shape)
    xt = (1 - sigma[..., None, None, None]) * x0 + sigma[..., None, None, None] * eps
    flow = wan.forward_block_causal(params["dit"], WAN_CONFIG, xt, 1000.0 * sigma, _context(params["text"], ids, mask),
                                    chunk_frames=settings.chunk_frames, window_frames=settings.window_frames,
                                    sink_frames=settings.sink_frames)
    per_frame = jnp.mean((flow - (eps - x0)) ** 2, axis=(2, 3, 4))              # [B, F]
    noisy = (sigma > 0).astype(jnp.float32)
    return jnp.sum(per_frame * noisy) / jnp.maximum(jnp.sum(noisy), 1.0)


def self_forcing_loss(params, x0, ids, mask, at_start, key, settings: Settings):
    """x0 [B, (1 + K) * chunk_frames, ...]: commit chunk 0, roll out K chunks, squared error to chunks 1..K."""
    rc = settings.rollout_config()
    cf = settings.chunk_frames
    state = R.init_state(params["dit"], WAN_CONFIG, rc, _context(params["text"], ids, mask))
    cache = state.cache.begin_chunk()
    _, cache = M.forward_chunk(params["dit"], WAN_CONFIG, cache, state.cross, x0[:, :cf],
                               jnp.full((x0.shape[0],), rc.schedule.context_noise), rope=rc.rope)
    out = R.rollout(params["dit"], WAN_CONFIG, rc, None, num_chunks=(x0.shape[1] - cf) // cf, key=key,
                    state=R.RolloutState(cache, state.cross), first_chunk=1)
    return jnp.mean((out.latents - x0[:, cf:]) ** 2)


def _optimizer(lr: float, steps: int, warmup: int):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, max(steps - 1, 1)), max(steps, 2),
                                                  end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


def _step_fn(loss_fn, optimizer):
    @jax.jit
    def step(params, opt_state, x0, ids, mask, at_start, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, x0, ids, mask, at_start, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# ------------------------------------------------------------------------------------------------ snapshots


def _save_snapshot(path: str, stage: int, step: int, params, opt_state, losses: list[float], done: list) -> None:
    """params + optimizer state + position, atomically (a Ctrl-C while writing keeps the previous snapshot)."""
    from safetensors.numpy import save_file

    leaves = jax.tree.leaves((params, opt_state))
    tmp = path + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file({f"{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}, os.path.join(tmp, "state.safetensors"))
    with open(os.path.join(tmp, "position.json"), "w") as f:
        json.dump({"stage": stage, "step": step, "losses": losses, "finished_stages": done}, f)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def _read_position(path: str) -> dict:
    """The snapshot's stage, step, losses and finished stages (position.json)."""
    with open(os.path.join(path, "position.json")) as f:
        return json.load(f)


def _load_snapshot(path: str, template):
    from safetensors.numpy import load_file

    position = _read_position(path)
    flat = load_file(os.path.join(path, "state.safetensors"))
    leaves, treedef = jax.tree.flatten(template)
    if len(flat) != len(leaves):
        raise ValueError(f"snapshot {path} holds {len(flat)} arrays, this training run has {len(leaves)}")
    restored = [jnp.asarray(flat[f"{i:05d}"], leaf.dtype) for i, leaf in enumerate(leaves)]
    return position, jax.tree.unflatten(treedef, restored)


# ------------------------------------------------------------------------------------------------ the run


def train(out: str, tc: TrainConfig = TrainConfig(), settings: Settings = Settings(), *, resume: bool = False,
          progress: bool = True, command: str | None = None, force: bool = False) -> dict[str, Any]:
    """Trains from scratch (or from the snapshot in ``out + '.partial'`` with ``resume``) and writes the release to
    ``out`` (`jaxkv.toyworld.model.save`). Returns the training record stored in its toyworld.json."""
    from tqdm import tqdm

    snapshot = os.path.abspath(out) + ".partial"
    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass force=True (--overwrite) to replace a toy-world release")
    if resume and not os.path.isdir(snapshot):
        raise FileNotFoundError(f"--resume: no snapshot at {snapshot}")
    started = time.perf_counter()
    latent_map = fit_latent_map(tc)
    tokenizer = text.tokenizer()
    key = jax.random.key(tc.seed)
    params = {"dit": init_dit(jax.random.fold_in(key, 0)),
              "text": text.init_text_params(tc.seed)}
    # (name, steps, batch, chunks per clip, share of clips at a scene's start, loss, optimizer)
    stages = [
        ("diffusion forcing", tc.steps, tc.batch, tc.chunks, 0.5,
         lambda p, x, i, m, a, k: diffusion_forcing_loss(p, x, i, m, a, k, tc, settings),
         _optimizer(tc.lr, tc.steps, tc.warmup)),
        ("first chunks", tc.first_steps, tc.first_batch, 1, 1.0,
         lambda p, x, i, m, a, k: diffusion_forcing_loss(p, x, i, m, a, k, tc, settings),
         _optimizer(tc.first_lr, tc.first_steps, 20)),
        ("self-forcing", tc.sf_steps, tc.sf_batch, 1 + tc.sf_chunks, 0.5,
         lambda p, x, i, m, a, k: self_forcing_loss(p, x, i, m, a, k, settings),
         _optimizer(tc.sf_lr, tc.sf_steps, 20)),
    ]
    record: dict[str, Any] = {"stages": []}
    first_stage, first_step, losses = 0, 0, []
    opt_state = stages[0][6].init(params)
    if resume:
        first_stage = _read_position(snapshot)["stage"]
        opt_state = stages[first_stage][6].init(params)
        position, (params, opt_state) = _load_snapshot(snapshot, (params, opt_state))
        first_step, losses = position["step"], position["losses"]
        record["stages"] = position["finished_stages"]
    for stage in range(first_stage, len(stages)):
        name, steps, size, chunks, start_share, loss_fn, optimizer = stages[stage]
        if stage != first_stage:
            opt_state, first_step, losses = optimizer.init(params), 0, []
        step_fn = _step_fn(loss_fn, optimizer)
        t0 = time.perf_counter()
        bar = tqdm(range(first_step, steps), desc=name, disable=not progress, file=sys.stderr, initial=first_step,
                   total=steps)
        done = first_step                     # steps of this stage whose update is in params
        try:
            for step in bar:
                x0, ids, mask, at_start = batch(latent_map, tokenizer, tc.seed, stage + 1, step, size,
                                                chunks * settings.chunk_frames, start_share)
                params, opt_state, loss = step_fn(params, opt_state, x0, ids, mask, at_start,
                                                  jax.random.fold_in(jax.random.fold_in(key, stage + 1), step))
                done = step + 1
                losses.append(float(loss))
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
                if done % tc.snapshot_every == 0 and done < steps:
                    _save_snapshot(snapshot, stage, done, params, opt_state, losses, record["stages"])
        except KeyboardInterrupt:
            bar.close()
            _save_snapshot(snapshot, stage, done, params, opt_state, losses[:done], record["stages"])
            print(f"interrupted: snapshot at {name} step {done} in {snapshot}; continue with --resume",
                  file=sys.stderr)
            raise
        bar.close()
        record["stages"].append({"name": name, "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
                                 "loss_first_50": float(np.mean(losses[:50])) if losses else None,
                                 "loss_last_50": float(np.mean(losses[-50:])) if losses else None})
        if stage + 1 < len(stages):
            _save_snapshot(snapshot, stage + 1, 0, params, stages[stage + 1][6].init(params), [], record["stages"])
    record.update(seed=tc.seed, train_config=dataclasses.asdict(tc), seconds=round(time.perf_counter() - started, 1),
                  command=command or f"python -m jaxkv.toyworld train --out {out} --seed {tc.seed}",
                  jax_version=jax.__version__)
    save_release(out, params["dit"], params["text"], latent_map, settings, {"training": record}, force=force)
    shutil.rmtree(snapshot, ignore_errors=True)
    return record
