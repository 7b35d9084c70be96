"""`RunOptions`: how the model runs (the dtype policy and the attention backend), resolved once.

One frozen, hashable value (a jit static argument) that the Wan model's entry points build at their top and pass
down whole: the layers read ``run.precision`` for dtypes and hand ``run.backend`` (and ``run.interpret``) to
`jaxkv.attend`, where the options stop (the attention functions keep their ``backend`` string). Built and checked
on construction, so a bad preset or backend name is refused before anything is traced
(``RunOptions.of("bfloat16", "xla")``).

`jaxkv.rollout.RolloutConfig` exposes its ``precision`` and ``backend`` fields as ``rc.run``; ``jaxkv generate``
parses its flags into one (``settings.run``).
"""

from __future__ import annotations

import dataclasses

from jaxkv.attention.dispatch import BACKENDS
from jaxkv.defaults import ROLLOUT
from jaxkv.precision import Precision, as_precision


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How the model runs (static, hashable; equal options share a compiled program).

    Attributes:
      precision: the dtype policy (`jaxkv.precision.Precision`; a preset name such as "bfloat16" is parsed on
        construction).
      backend: the attention backend, one of `jaxkv.attention.dispatch.BACKENDS` ("auto" picks per platform).
      interpret: run the kernel backends off their GPU, for tests on CPU: "pallas" in the Pallas interpreter,
        "mosaic" as its pure-JAX emulation (`jaxkv.attend`'s ``interpret``). Never switched on by itself.
    """

    precision: Precision = Precision()
    backend: str = ROLLOUT["backend"]
    interpret: bool = False

    def __post_init__(self):
        object.__setattr__(self, "precision", _checked(self.precision, self.backend, "RunOptions"))
        if not isinstance(self.interpret, bool):
            raise ValueError(f"RunOptions.interpret must be a bool, got {self.interpret!r}")

    @classmethod
    def of(
        cls, precision: Precision | str | None = None, backend: str | None = None, *, owner: str = "RunOptions"
    ) -> "RunOptions":
        """The options of a preset name or `Precision` and a backend name; None takes the default (float32,
        "auto"). ValueError naming a bad one as ``{owner}.precision`` / ``{owner}.backend`` (``owner``: the object
        whose fields they are, e.g. "RolloutConfig")."""
        precision = Precision() if precision is None else precision
        backend = ROLLOUT["backend"] if backend is None else backend
        return cls(_checked(precision, backend, owner), backend)


def _checked(precision, backend, owner: str) -> Precision:
    """``precision`` parsed (a `Precision` or a preset name), ``backend`` checked against `jaxkv.attend`'s names."""
    precision = as_precision(precision, f"{owner}.precision")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{owner}.backend must be one of {list(BACKENDS)}, got {backend!r}")
    return precision


def resolve(run: RunOptions | None, backend: str | None, precision: Precision | str | None, where: str) -> RunOptions:
    """The `RunOptions` of a public entry point that takes either ``run=`` or the older ``backend=`` /
    ``precision=`` keywords (None: not given). TypeError when both kinds are given, or when ``run`` is not a
    `RunOptions`; ValueError for a bad backend or precision."""
    if run is None:
        return RunOptions.of(precision, backend)
    if backend is not None or precision is not None:
        given = [name for name, value in (("backend", backend), ("precision", precision)) if value is not None]
        raise TypeError(
            f"{where}: pass either run= or {' / '.join(f'{n}=' for n in given)}, not both (run= already holds the "
            f"backend and the precision: RunOptions.of(precision, backend))"
        )
    if not isinstance(run, RunOptions):
        raise TypeError(f"{where}: run must be a jaxkv.run_options.RunOptions, got {type(run).__name__}")
    return run
