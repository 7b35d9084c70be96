"""Self-Forcing's few-step flow-matching schedule.

The training scheduler of Self-Forcing / CausVid is a 1000-step flow-matching table with ``sigma_min = 0``, one
extra step, and a shift s: ``sigma_lin[i] = 1 - i/1000`` (i = 0..999), ``sigma[i] = s*sigma_lin / (1 + (s-1)*
sigma_lin)``, ``timestep[i] = 1000 * sigma[i]``. A few-step sampler picks "denoising steps" d (e.g. 1000, 750, 500,
250) and *warps* them through the table: ``t = cat(timestep, [0])[1000 - d]`` (so 1000 -> 1000, 750 -> 937.5,
500 -> 833.3, 250 -> 625 for s = 5), with the matching sigma. A step predicts the flow v at (x_t, t), takes
``x0 = x_t - sigma_t * v``, and re-noises ``x_{t'} = (1 - sigma_t') * x0 + sigma_t' * eps`` for the next step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxkv.validate import check_int, is_int, is_real

SAMPLERS = ("self-forcing", "euler")


def shifted(sigma, shift: float):
    """The flow-matching shift of noise levels: ``s * sigma / (1 + (s - 1) * sigma)`` (numpy or jax arrays; s > 1
    moves levels towards 1). The table's warp below, and the level distribution a model is trained on
    (`jaxkv.toyworld.losses.noise_levels`), so the two cannot drift apart."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The denoising schedule of a streaming rollout (static, hashable).

    Attributes:
      steps: denoising steps on the 1000-step grid, strictly decreasing, each in 1..1000 (Self-Forcing:
        1000, 750, 500, 250).
      shift: flow-matching shift of the table, finite and > 0 (Self-Forcing: 5.0).
      warp: map steps through the shifted table (Self-Forcing's ``warp_denoising_step``); when False, a step d is
        used directly as timestep d with sigma d/1000.
      context_noise: timestep of the extra forward that commits the chunk's clean K/V, in
        0..num_train_timesteps (Self-Forcing: 0).
      num_train_timesteps: size of the table (1000).
      sampler: what a step re-noises its x0 with: "self-forcing" (default): fresh noise, Self-Forcing's sampler;
        "euler": the noise the prediction implies, ``eps = x + (1 - sigma) v``, which makes each step the Euler
        step of the flow ODE from sigma to the next sigma (deterministic after the first input; for a model
        trained with plain flow matching rather than distilled for a few fresh-noise steps).
    """

    steps: tuple[int, ...] = (1000, 750, 500, 250)
    shift: float = 5.0
    warp: bool = True
    context_noise: float = 0.0
    num_train_timesteps: int = 1000
    sampler: str = "self-forcing"

    def __post_init__(self):
        n = check_int("Schedule.num_train_timesteps", self.num_train_timesteps, minimum=1)
        object.__setattr__(self, "num_train_timesteps", n)
        if self.sampler not in SAMPLERS:
            raise ValueError(f"Schedule.sampler must be one of {list(SAMPLERS)}, got {self.sampler!r}")
        if not isinstance(self.warp, (bool, np.bool_)):
            raise ValueError(f"Schedule.warp must be a bool, got {self.warp!r}")
        for name in ("shift", "context_noise"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value):
                raise ValueError(f"Schedule.{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        try:
            steps = tuple(self.steps)
        except TypeError:
            raise ValueError(f"Schedule.steps must be a sequence of ints, got {self.steps!r}") from None
        if not steps:
            raise ValueError("Schedule.steps must list at least one denoising step")
        for s in steps:
            if not is_int(s) or not 1 <= s <= n:
                raise ValueError(f"Schedule.steps must be ints in 1..{n}, got {steps}")
        object.__setattr__(self, "steps", tuple(int(s) for s in steps))
        if any(a <= b for a, b in zip(steps, steps[1:])):
            raise ValueError(f"Schedule.steps must be strictly decreasing, got {steps}")
        if not self.shift > 0:
            raise ValueError(f"Schedule.shift must be a finite number > 0, got {self.shift}")
        if not 0 <= self.context_noise <= n:
            raise ValueError(f"Schedule.context_noise must be in 0..{n}, got {self.context_noise}")

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(timesteps, sigmas) float64 [num_train_timesteps + 1] of the shifted table, with the appended 0."""
        n = self.num_train_timesteps
        lin = np.linspace(1.0, 0.0, n + 1)[:-1]
        sigma = np.append(shifted(lin, self.shift), 0.0)
        return sigma * n, sigma

    def timesteps(self) -> np.ndarray:
        """float64 [len(steps)]: the model timestep of each denoising step."""
        return self.sigmas() * self.num_train_timesteps

    def sigmas(self) -> np.ndarray:
        """float64 [len(steps)]: the noise level sigma of each denoising step."""
        steps = np.asarray(self.steps)
        if not self.warp:
            return steps / self.num_train_timesteps
        _, sigma = self.table()
        return sigma[self.num_train_timesteps - steps]

    def passes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The model passes of one chunk, as arrays a scan can walk: (timestep, sigma, next_sigma), each float64
        [len(steps) + 1].

        Pass i < len(steps) is denoising step i: x0 = x - sigma[i] * v; the next input is
        (1 - next_sigma[i]) * x0 + next_sigma[i] * noise (next_sigma = 0 after the last step, so the input of the
        final pass is the clean x0). The final pass runs at ``context_noise`` to commit the chunk's K/V; its
        sigma and next_sigma are 0, so it leaves x unchanged.
        """
        t = np.append(self.timesteps(), self.context_noise)
        sigma = np.append(self.sigmas(), 0.0)
        next_sigma = np.append(self.sigmas()[1:], [0.0, 0.0])
        return t, sigma, next_sigma
