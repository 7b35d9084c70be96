"""Training the toy model from scratch on CPU, with optax: ``python -m jaxkv.toyworld train --out DIR``.

1. The latent map is fitted on world frames (`latents.LatentMap.fit`, a second).
2. **Teacher forcing on the stream's own layout.** A clip is what the cache holds once it is full: the sink (the
   prompt's first `Settings.sink_frames` frames, `world.canonical_scene`, or with ``scenes="random"`` a random scene
   of the prompt, `clips.batch`) and then `Settings.window_frames` frames
   from anywhere along the scene's path (or, for ``start_share`` of the clips, straight on from the sink: a stream's
   beginning). `jaxkv.models.wan.forward_teacher_forcing` denoises every chunk of it at once as a stream denoises it,
   after the clean chunks before it, each chunk at its own noise level (`noise_levels`: every level in [0, 1),
   drawn with the shift the sampler's steps are warped by, `Settings.shift`, so the sampler's steps are a setting
   and not baked into the weights; an earlier recipe trained on the 4 sampler levels alone scored lower on the quality
   survey, docs/toyworld.md). Loss: the flow ``eps - x0``
   (rectified flow, Wan's parameterisation) on every chunk but those whose answer the clip does not fix: a window
   chunk that does not follow the sink, seen after fewer than `CONTEXT_FRAMES` frames of its own path, cannot know
   which way the shapes go. The text encoder trains with the DiT. The DiT starts from `init_dit`: Wan's random init
   with every residual branch's output projection and the head zeroed (the DiT "adaLN-zero" start).
   The clip is never longer than the cache, so with cache-relative RoPE (`Settings.rope`) its positions are the
   ranks a full cache gives: training and a stream of any length see the same relative distances.
3. **Teacher forcing with a level-1 share** (``refine_steps``): stage 2's loss for a few more steps at a lower
   learning rate (``refine_lr``), with a quarter of the chunks at noise level 1 exactly (``refine_pure_noise_share``),
   where the sampler's first step decides from the context alone where the shapes go. From scratch, that share
   taught the one-step motion but loosened the shapes' outlines (their budget moved away from the low levels); after
   stage 2 has spent its steps on every level, it lifts the quality survey (docs/toyworld.md).
4. **Self-forcing through the ring, past the cache** (``sf_steps``). A clip is the sink and `context_chunks`
   window chunks (committed to an empty cache as generation commits chunks) followed by ``sf_chunks`` more chunks
   of the same scene (`batch` with ``after_sink``); `jaxkv.rollout.rollout` samples those with the model's own
   few-step sampler on the ring cache, past its capacity once ``sf_chunks`` > 1 (the ring evicts the true frames
   and the model continues from its own). The loss, differentiated through the whole rollout, is the squared error
   of the rolled-out latents to the world's true continuation (the world is deterministic once its first frames
   are seen) plus ``sf_colour_weight`` x `colour_share_error` plus ``sf_outline_weight`` x `outline_error`. The
   colour term is what makes the stage work: where the model is unsure of a shape's place the squared error rewards
   a fainter, wider shape, and without the term such rollouts faded the shapes into the empty box; the term, blind
   to place, holds each colour's pixel share to the world's. With it, 100 steps lift the quality survey and the
   check over stage 3's weights, and 300 and 600 (the default) lift the survey further and keep the shapes drawn
   through 300-frame streams; at the default width they still stop moving after ~30 frames there (release 6), and
   with a DiT twice as wide (``dit_*``, release 7 with 300 steps, release 8 with 1,000) they keep moving. The outline
   term (off in the shipped recipe, ``sf_outline_weight`` 0), also blind to place, holds each named colour's mask
   to its own shape, whole and sharp, wherever the rollout draws it (the squared error rewards a blob spread over
   the shape's possible places, and the metric needs the shape's outline to tell it); docs/toyworld-experiments.md, "The
   outline term". The position and apart terms (``sf_position_weight``, ``sf_apart_weight``, off too:
   `position_error`, `apart_error`) are measured under "Motion" in docs/toyworld.md.

Two options of stage 2, off in the shipped recipe (each measured worse there on the quality survey, docs/toyworld.md):
``text_dropout`` captions a share of the clips with the empty prompt, so the model can stream with
classifier-free guidance (`Settings.guidance_scale`); ``pure_noise_share`` trains a share of the chunks at level 1
exactly (stage 3's ``refine_pure_noise_share`` from the start).

Every random draw is a function of (seed, stage, step), so a run is reproducible and a resumed run
(`--resume`, from the snapshot written every ``snapshot_every`` steps and on Ctrl-C) continues exactly.

Where the parts live: the clips in `jaxkv.toyworld.clips`, the losses in `jaxkv.toyworld.losses`, the snapshots in
`jaxkv.toyworld.snapshot`; here the recipe's settings (`TrainConfig`), what a resumed run may change and the run.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from typing import Any

import jax
import numpy as np
import optax

from jaxkv.models.wan.config import WanConfig
from jaxkv.toyworld import latents, text, world
from jaxkv.toyworld.clips import SCENES, Batch, batch, context_chunks
from jaxkv.toyworld.losses import init_dit, self_forcing_loss, teacher_forcing_loss
from jaxkv.toyworld.model import WAN_CONFIG, Settings
from jaxkv.toyworld.model import save as save_release
from jaxkv.toyworld.snapshot import load_snapshot, read_position, save_snapshot
from jaxkv.validate import is_real


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    batch: int = 8  # clips per teacher-forcing step
    steps: int = 1300  # teacher-forcing steps
    lr: float = 2e-3
    warmup: int = 100
    start_share: float = 0.5  # clips that run straight on from the sink (a stream's beginning)
    text_dropout: float = 0.0  # clips whose text is the empty prompt (what classifier-free guidance subtracts)
    # every stage's clips: each prompt's canonical scene (the shipped recipe), random scenes of it, or mixed (clips.py)
    scenes: str = "canonical"
    pure_noise_share: float = 0.0  # chunks trained at sigma 1 exactly (the sampler's first step) among `noise_levels`
    refine_steps: int = 300  # stage 3: teacher-forcing steps from stage 2's weights (see the module docstring)
    refine_lr: float = 5e-4
    refine_warmup: int = 20
    refine_pure_noise_share: float = 0.25  # `pure_noise_share` of stage 3
    sf_steps: int = 600  # self-forcing steps (see the module docstring)
    sf_chunks: int = 4  # chunks a self-forcing clip rolls out after its committed frames (past the cache)
    sf_batch: int = 4
    sf_lr: float = 1e-4
    sf_colour_weight: float = 0.1  # weight of stage 4's colour-share term (`colour_share_error`)
    # weight of stage 4's outline term (`outline_error`); 0 in the shipped recipe so far (docs/toyworld-experiments.md,
    # "The outline term")
    sf_outline_weight: float = 0.0
    # weight of stage 4's position term (`position_error`, px); 0 in the shipped recipe (docs/toyworld.md, "Motion")
    sf_position_weight: float = 0.0
    # weight of stage 4's apart term (`apart_error`, px); 0 in the shipped recipe (docs/toyworld.md, "Motion")
    sf_apart_weight: float = 0.0
    fit_frames: int = 2048  # frames the latent map is fitted on
    snapshot_every: int = 250
    # Recompute each DiT block's activations in the backward pass instead of storing them (`jax.checkpoint`):
    # on 2 CPU cores teacher-forcing steps 1.2-1.3x and self-forcing steps 1.7-2.1x faster (benchmarks/train_step.py),
    # but the weights differ from a run without it in float rounding from the first step: the defaults (release 6's
    # run) are without it; releases 7 and 8 were trained with it.
    remat: bool = False
    # The DiT's shape (`wan_config`): release 6's by default; the shipped release 8 (as release 7) is dim 192,
    # ffn 512, 6 heads (2.3 M parameters, 4.6 MB). A release must stay under 5 MB (its DiT is stored in bfloat16:
    # 2 bytes a parameter).
    dit_dim: int = WAN_CONFIG.dim
    dit_ffn_dim: int = WAN_CONFIG.ffn_dim
    dit_heads: int = WAN_CONFIG.num_heads
    dit_layers: int = WAN_CONFIG.num_layers

    def wan_config(self) -> WanConfig:
        """The DiT's `WanConfig`: `jaxkv.toyworld.model.WAN_CONFIG` with this config's width, heads and depth."""
        return dataclasses.replace(
            WAN_CONFIG, dim=self.dit_dim, ffn_dim=self.dit_ffn_dim, num_heads=self.dit_heads, num_layers=self.dit_layers
        )

    def __post_init__(self):
        for name in ("start_share", "text_dropout", "pure_noise_share", "refine_pure_noise_share"):
            value = getattr(self, name)
            if not is_real(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"TrainConfig.{name} is a share of clips or chunks, in [0, 1]; got {value!r}")
        for name in ("sf_colour_weight", "sf_outline_weight", "sf_position_weight", "sf_apart_weight"):
            value = getattr(self, name)
            if not is_real(value) or not 0.0 <= value < float("inf"):
                raise ValueError(f"TrainConfig.{name} is a loss weight, finite and >= 0; got {value!r}")
        if self.scenes not in SCENES:
            raise ValueError(f"TrainConfig.scenes is one of {SCENES}, got {self.scenes!r}")
        if isinstance(self.sf_chunks, bool) or not isinstance(self.sf_chunks, int) or self.sf_chunks < 1:
            raise ValueError(f"TrainConfig.sf_chunks is a number of chunks, >= 1; got {self.sf_chunks!r}")
        if not isinstance(self.remat, bool):
            raise ValueError(f"TrainConfig.remat is a bool; got {self.remat!r}")
        for name in ("dit_dim", "dit_ffn_dim", "dit_heads", "dit_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} is a size, an int >= 1; got {value!r}")
        if self.dit_dim % (2 * self.dit_heads):
            raise ValueError(
                f"TrainConfig.dit_dim ({self.dit_dim}) must split into dit_heads ({self.dit_heads}) "
                f"heads of an even width (RoPE rotates channel pairs)"
            )


# ------------------------------------------------------------------------------------------------ a stage's parts


def fit_latent_map(tc: TrainConfig) -> latents.LatentMap:
    rng = np.random.default_rng([tc.seed, 0])
    frames, _ = world.clips(rng, tc.fit_frames // 4, 4)
    return latents.LatentMap.fit(frames.reshape(-1, *frames.shape[2:]))


def _optimizer(lr: float, steps: int, warmup: int):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, min(warmup, max(steps - 1, 1)), max(steps, 2), end_value=lr * 0.1
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


def _step_fn(loss_fn, optimizer):
    """One optax step of ``loss_fn(params, batch: Batch, key)``, jit-compiled."""

    @jax.jit
    def step(params, opt_state, clips: Batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, clips, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def stage_table(tc: TrainConfig, settings: Settings, latent_map: latents.LatentMap) -> list[tuple]:
    """The stages of the recipe, 2, 3 and 4 of the module docstring, as (name, steps, clips per step, frames after
    the sink, loss ``(params, batch: Batch, key) -> float``, optax optimizer): what `train` runs and what a fine-tune
    of a release runs of stage 4 (benchmarks/finetune_scenes.py)."""
    config = tc.wan_config()

    def teacher_forcing(pure_noise_share):
        return lambda p, b, k: teacher_forcing_loss(
            p, b.latents, b.ids, b.mask, b.at_start, k, settings, pure_noise_share, tc.remat, config
        )

    def self_forcing(p, b, k):
        options = (tc.sf_colour_weight, tc.remat, b.objects, tc.sf_outline_weight, config, tc.sf_position_weight)
        options += (tc.sf_apart_weight,)
        return self_forcing_loss(p, b.latents, b.ids, b.mask, b.at_start, k, settings, latent_map, *options)

    sf_frames = (context_chunks(settings) + tc.sf_chunks) * settings.chunk_frames
    return [
        (
            "teacher forcing",
            tc.steps,
            tc.batch,
            settings.window_frames,
            teacher_forcing(tc.pure_noise_share),
            _optimizer(tc.lr, tc.steps, tc.warmup),
        ),
        (
            "teacher forcing, level-1 share",
            tc.refine_steps,
            tc.batch,
            settings.window_frames,
            teacher_forcing(tc.refine_pure_noise_share),
            _optimizer(tc.refine_lr, tc.refine_steps, tc.refine_warmup),
        ),
        (
            "self-forcing",
            tc.sf_steps,
            tc.sf_batch,
            sf_frames,
            self_forcing,
            _optimizer(tc.sf_lr, tc.sf_steps, 20),
        ),
    ]


# ------------------------------------------------------------------------------------------------ the run


# What a resumed run may change (`resume_conflicts`). The stages (0, 1, 2: the docstring's 2, 3, 4) each TrainConfig
# field changes; fields not listed change every stage (seed, fit_frames, start_share, text_dropout, scenes: the latent
# map and the clips) but those in _RESUME_FREE, which change how a step is computed, not what (remat: float rounding
# only, like resuming on another machine; each stage's record says whether it ran with remat).
_FIELD_STAGES = {
    "batch": (0, 1),
    "steps": (0,),
    "lr": (0,),
    "warmup": (0,),
    "pure_noise_share": (0,),
    "refine_steps": (1,),
    "refine_lr": (1,),
    "refine_warmup": (1,),
    "refine_pure_noise_share": (1,),
    "sf_steps": (2,),
    "sf_chunks": (2,),
    "sf_batch": (2,),
    "sf_lr": (2,),
    "sf_colour_weight": (2,),
    "sf_outline_weight": (2,),
    "sf_position_weight": (2,),
    "sf_apart_weight": (2,),
}
_RESUME_FREE = ("remat",)
# The value a field added after snapshots began recording their config had before it existed (else its default).
_BEFORE_FIELD = {"sf_outline_weight": 0.0, "sf_position_weight": 0.0, "sf_apart_weight": 0.0, "scenes": "canonical"}


def resume_conflicts(position: dict, tc: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(field, the snapshot's value, ``tc``'s value) of each TrainConfig field that a run resuming the snapshot
    ``position`` (its position.json) would change in a stage the snapshot has begun: a resumed run must repeat
    the steps already taken, while a stage not yet begun may run with other settings (a run stopped between
    stages continues with, say, more self-forcing steps). Empty for snapshots that record no config."""
    saved = position.get("train_config")
    if saved is None:
        return []
    begun = set(range(position["stage"] + (position["step"] > 0)))
    out = []
    for name, value in dataclasses.asdict(tc).items():
        there = saved.get(name, _BEFORE_FIELD.get(name, getattr(TrainConfig(), name)))
        if name not in _RESUME_FREE and begun & set(_FIELD_STAGES.get(name, (0, 1, 2))) and there != value:
            out.append((name, there, value))
    return out


def step_inputs(latent_map, tokenizer, settings: Settings, tc: TrainConfig, seed, stage, step, size, after_sink, key):
    """A training step's clips (`clips.batch`) and noise key, drawn from (seed, stage, step) alone as `train` draws
    them (``stage`` counted from 1, ``key`` the run's ``jax.random.key(seed)``)."""
    args = (tc.start_share, tc.text_dropout, after_sink, tc.scenes)
    clips = batch(latent_map, tokenizer, settings, seed, stage, step, size, *args)
    return clips, jax.random.fold_in(jax.random.fold_in(key, stage), step)


def train(
    out: str,
    tc: TrainConfig = TrainConfig(),
    settings: Settings = Settings(),
    *,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Trains from scratch (or from the snapshot in ``out + '.partial'`` with ``resume``) and writes the release to
    ``out`` (`jaxkv.toyworld.model.save`). Returns the training record stored in its toyworld.json."""
    from tqdm import tqdm

    snapshot = os.path.abspath(out) + ".partial"
    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass force=True (--overwrite) to replace a toy-world release")
    if resume and not os.path.isdir(snapshot):
        raise FileNotFoundError(f"--resume: no snapshot at {snapshot}")
    if resume:  # a resumed run is the interrupted one continued: same config, or its steps would not be its own
        interrupted = read_position(snapshot)
        saved = interrupted.get("train_config")  # (snapshots before this check hold none)
        changed = resume_conflicts(interrupted, tc)
        if changed:
            raise ValueError(
                f"--resume: the snapshot at {snapshot} was written by a run with other settings ("
                + ", ".join(f"{k} {there!r} there, {here!r} here" for k, there, here in changed)
                + "); resume with the flags it was started with"
            )
    started = time.perf_counter()
    latent_map = fit_latent_map(tc)
    tokenizer = text.tokenizer()
    key = jax.random.key(tc.seed)
    config = tc.wan_config()
    params = {"dit": init_dit(jax.random.fold_in(key, 0), config), "text": text.init_text_params(tc.seed)}

    stages = stage_table(tc, settings, latent_map)
    record: dict[str, Any] = {"stages": []}
    first_stage, first_step, losses = 0, 0, []
    before, stage_before = 0.0, 0.0  # seconds spent in earlier processes (a resumed run): run, stage
    opt_state = stages[0][5].init(params)
    if resume:
        first_stage = read_position(snapshot)["stage"]
        opt_state = stages[first_stage][5].init(params)
        position, (params, opt_state) = load_snapshot(snapshot, (params, opt_state))
        first_step, losses = position["step"], position["losses"]
        # stage records written before they carried remat: the interrupted run's setting (remat is _RESUME_FREE)
        ran_with = (saved or {}).get("remat", False)
        record["stages"] = [{**s, "remat": s.get("remat", ran_with)} for s in position["finished_stages"]]
        resumed_remat = ran_with if first_step else tc.remat  # the setting of the stage's steps before this run
        before, stage_before = position.get("seconds", 0.0), position.get("stage_seconds", 0.0)
    for stage in range(first_stage, len(stages)):
        name, steps, size, after_sink, loss_fn, optimizer = stages[stage]
        if stage != first_stage:
            opt_state, first_step, losses, stage_before = optimizer.init(params), 0, [], 0.0
        step_fn = _step_fn(loss_fn, optimizer)
        t0 = time.perf_counter()

        def seconds():
            now = time.perf_counter()
            return before + now - started, stage_before + now - t0  # noqa: B023 - called in the iteration that defines it

        bar = tqdm(
            range(first_step, steps), desc=name, disable=not progress, file=sys.stderr, initial=first_step, total=steps
        )
        done = first_step  # steps of this stage whose update is in params
        try:
            for step in bar:
                clips, step_key = step_inputs(
                    latent_map, tokenizer, settings, tc, tc.seed, stage + 1, step, size, after_sink, key
                )
                params, opt_state, loss = step_fn(params, opt_state, clips, step_key)
                done = step + 1
                losses.append(float(loss))
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
                if done % tc.snapshot_every == 0 and done < steps:
                    save_snapshot(snapshot, stage, done, params, opt_state, losses, record["stages"], seconds(), tc)
        except KeyboardInterrupt:
            bar.close()
            save_snapshot(snapshot, stage, done, params, opt_state, losses[:done], record["stages"], seconds(), tc)
            print(f"interrupted: snapshot at {name} step {done} in {snapshot}; continue with --resume", file=sys.stderr)
            raise
        bar.close()
        remat = tc.remat if stage != first_stage or not resume or resumed_remat == tc.remat else "mixed"
        record["stages"].append(
            {
                "name": name,
                "steps": steps,
                "seconds": round(seconds()[1], 1),
                "remat": remat,
                "loss_first_50": float(np.mean(losses[:50])) if losses else None,
                "loss_last_50": float(np.mean(losses[-50:])) if losses else None,
            }
        )
        if stage + 1 < len(stages):
            save_snapshot(
                snapshot,
                stage + 1,
                0,
                params,
                stages[stage + 1][5].init(params),
                [],
                record["stages"],
                (seconds()[0], 0.0),
                tc,
            )
    record.update(
        seed=tc.seed,
        train_config=dataclasses.asdict(tc),
        seconds=round(before + time.perf_counter() - started, 1),
        command=command or f"python -m jaxkv.toyworld train --out {out} --seed {tc.seed}",
        jax_version=jax.__version__,
    )
    save_release(
        out, params["dit"], params["text"], latent_map, settings, {"training": record}, config=config, force=force
    )
    shutil.rmtree(snapshot, ignore_errors=True)
    return record
