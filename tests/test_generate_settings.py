"""`jaxkv.generate.settings`: the layers resolve in order (defaults < release settings < saved session < flags
given, a flag given with the default's own value included), the result is frozen, nothing in jaxkv/generate assigns
to it, the dtype policy and backend are parsed once into `RunOptions`, the defaults are one table, and the default
and --random-weights runs resolve to exactly the settings the Namespace-mutating resolution gave (recorded below).
Quick: nothing is loaded or compiled (a saved session is stood in for by its manifest, all that resolution reads)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib

import pytest

from jaxkv import defaults
from jaxkv import session as S
from jaxkv.generate import loop, options, resume, settings
from jaxkv.generate.options import UsageError
from jaxkv.models import wan
from jaxkv.precision import Precision
from jaxkv.rollout import RolloutConfig
from jaxkv.toyworld import model as toy_model

RELEASE = os.path.abspath(toy_model.RELEASE_DIR)
GENERATE_DIR = pathlib.Path(settings.__file__).parent


def _release_settings() -> dict:
    """The shipped release's settings as toyworld.json spells them (read here, not through the code under test)."""
    with open(os.path.join(RELEASE, toy_model.SETTINGS_FILE)) as f:
        return json.load(f)["settings"]


@pytest.fixture
def saved(monkeypatch):
    """``saved(argv)``: a --resume directory name whose session recorded the settings ``argv`` resolves to (its
    manifest stood in for: resolution reads nothing else)."""
    manifests = {}

    def read_manifest(path):
        if path not in manifests:
            raise S.SessionError(f"{path} is not a complete jaxkv session: missing")
        return manifests[path]

    monkeypatch.setattr(resume.CK, "read_manifest", read_manifest)  # what `resume.session_layer` reads

    def save(argv) -> str:
        name = f"session{len(manifests)}"
        recorded = resume.recorded_settings(settings.from_argv(argv))
        manifests[name] = {"metadata": {"generate": json.loads(json.dumps(recorded)), "text_now": None}}
        return name

    return save


def test_each_layer_overrides_the_ones_below(saved):
    release = _release_settings()
    assert release["window_frames"] != defaults.GENERATE["window_frames"]  # else the release layer is invisible
    toy_session = saved(["--window-frames", "12"])  # a toy-world session: its release is a layer below it
    random_session = saved(["--random-weights", "--window-frames", "12"])
    # (argv, window_frames, the layer it came from): every combination of the layers above the defaults
    cases = [
        (["--random-weights"], defaults.GENERATE["window_frames"], "default"),
        ([], release["window_frames"], "release"),
        (["--resume", random_session], 12, "session"),
        (["--resume", toy_session], 12, "session"),
        (["--random-weights", "--window-frames", "3"], 3, "flag"),
        (["--window-frames", "3"], 3, "flag"),
        (["--resume", random_session, "--window-frames", "12"], 12, "flag"),  # the session's value, given
        (["--resume", toy_session, "--window-frames", "12"], 12, "flag"),
    ]
    for argv, want, layer in cases:
        s = settings.from_argv(argv)
        assert (s.window_frames, s.origin["window_frames"]) == (want, layer), argv
    # a flag given with the default's own value is given: it beats the release's value
    s = settings.from_argv(["--window-frames", "9", "--shift", "5.0"])
    assert (s.window_frames, s.shift) == (defaults.GENERATE["window_frames"], defaults.GENERATE["shift"]) == (9, 5.0)
    assert s.origin["window_frames"] == s.origin["shift"] == "flag" and s.origin["sink_frames"] == "release"
    # ... and is refused against a session's other value, naming the flag (nothing silently replaced)
    with pytest.raises(UsageError, match=r"--window-frames 9 \(the session's: 12\); drop these flags"):
        settings.from_argv(["--resume", random_session, "--window-frames", "9"])
    # the session's settings beat the release's, the flags the session's (where the session has no say)
    s = settings.from_argv(["--resume", toy_session, "--num-chunks", "4"])
    assert s.sink_frames == release["sink_frames"] and s.origin["sink_frames"] == "session"
    assert (s.num_chunks, s.origin["num_chunks"]) == (4, "flag") and s.origin["out"] == "default"
    assert s.session_manifest["metadata"]["generate"]["window_frames"] == 12


def test_make_takes_each_value_from_the_highest_layer_holding_it():
    base = settings._parser_defaults()
    values = {"default": 9, "release": 6, "session": 12, "flag": 3}
    for mask in range(8):  # every subset of the three layers above the defaults
        present = [name for i, name in enumerate(settings.LAYERS[1:]) if mask >> i & 1]
        layers = {"default": base, **{name: {"window_frames": values[name]} for name in present}}
        s = settings._make(layers)
        top = present[-1] if present else "default"
        assert (s.window_frames, s.origin["window_frames"]) == (values[top], top)


def test_settings_are_frozen():
    s = settings.from_argv(["--random-weights", "--mesh", "data=1,model=1"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.window_frames = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.run = settings.RunOptions(Precision.named("bfloat16"))
    with pytest.raises(TypeError):
        s.mesh["data"] = 2
    with pytest.raises(TypeError):
        s.origin["window_frames"] = "flag"
    assert isinstance(s.steps, tuple)


def _assigns_to_an_argument(tree: ast.AST) -> list[str]:
    """``x.attr = ...`` / ``x.attr += ...`` / ``setattr(x, ...)`` where x is a function's parameter."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)} - {"self"}
        for node in ast.walk(fn):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and getattr(sub.value, "id", None) in params & {"args"}:
                        found.append(f"{fn.name}:{node.lineno}")
    return found


def test_nothing_in_generate_assigns_to_the_settings():
    assert _assigns_to_an_argument(ast.parse("def f(args):\n    args.x = 1\n    setattr(args, 'y', 2)\n")) == [
        "f:2",
        "f:3",
    ]  # the check finds what it looks for
    for path in sorted(GENERATE_DIR.glob("*.py")):
        assert _assigns_to_an_argument(ast.parse(path.read_text())) == [], path.name


def test_precision_and_backend_are_parsed_once_into_run_options():
    s = settings.from_argv(["--random-weights", "--precision", "bfloat16"])
    assert s.run == settings.RunOptions(Precision.named("bfloat16"), defaults.ROLLOUT["backend"])
    _, rc = loop._settings(s, wan.preset("tiny"))
    assert rc.precision is s.run.precision and rc.backend == "auto"
    s = settings.resolve({"random_weights": True}, backend="xla")
    assert loop._settings(s, wan.preset("tiny"))[1].backend == "xla"


def test_one_table_of_defaults():
    parsed = vars(options.build_parser().parse_args([]))
    for dest, value in defaults.GENERATE.items():
        if dest == "backend":  # no flag: the library's, in RunOptions
            assert settings.from_argv(["--random-weights"]).run.backend == value
        elif dest == "fps":  # no default in the parser (--fps is refused with --no-video): None means this one
            assert parsed[dest] is None and settings.from_argv(["--random-weights"]).fps_or_default == value
        elif dest == "steps":
            assert parsed[dest] == tuple(int(s) for s in value.split(","))
        else:
            assert parsed[dest] == value, dest
    fields = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}
    assert {k: fields[k] for k in defaults.ROLLOUT} == dict(defaults.ROLLOUT)
    # the command differs from the library only where the table says why (its docstring)
    assert {k for k in defaults.ROLLOUT if defaults.GENERATE[k] != defaults.ROLLOUT[k]} == {
        "window_frames",
        "sink_frames",
    }
    assert set(settings.FLAGS) == set(parsed) - set(options.REPLACED_DESTS) | {"switch_sink"}


# What the Namespace-mutating resolution (before `jaxkv.generate.settings`) gave, field by field.
OLD_RANDOM = {
    **dict.fromkeys(
        ("buckets", "checkpoint", "context", "dilation", "embeddings_cache", "fps", "frames", "guidance_scale"), None
    ),
    **dict.fromkeys(("image", "mesh", "negative_context", "negative_prompt", "prompt", "prompt_schedule"), None),
    **dict.fromkeys(("release", "resume", "save_state", "switch_sink", "text_encoder", "vae", "video"), None),
    **dict.fromkeys(("coordinator", "num_processes", "process_id", "heartbeat_timeout"), None),  # multi-process flags
    **dict.fromkeys(("no_progress", "no_video", "offload_text_encoder", "overwrite"), False),
    **dict(batch=1, chunk_frames=3, context_noise=0.0, dilated_every=0, format="npy", height=16, num_chunks=200),
    **dict(out="jaxkv_out", policy="ring", precision="float32", preset="tiny", preview_frames=12, preview_scale=4),
    **dict(random_weights=True, rope="absolute", seed=0, shift=5.0, sink_frames=3, steps=(1000, 750, 500, 250)),
    **dict(weights_seed=0, width=16, window_frames=9),
}
with open(os.path.join(RELEASE, "toyworld.json")) as _f:  # the shipped release's sampler (release 9: ends at 100)
    RELEASE_STEPS = tuple(json.load(_f)["settings"]["steps"])
OLD_DEFAULT = {
    **OLD_RANDOM,
    **dict(random_weights=False, rope="cache-relative", shift=3.0, window_frames=6),
    **dict(prompt="a red circle and a blue square, slow", release=RELEASE, steps=RELEASE_STEPS),
    **dict(checkpoint=os.path.join(RELEASE, "dit"), text_encoder=os.path.join(RELEASE, "text_encoder")),
}


@pytest.mark.parametrize("argv, want", [([], OLD_DEFAULT), (["--random-weights"], OLD_RANDOM)])
def test_the_default_runs_resolve_as_before(argv, want):
    s = settings.from_argv(argv)
    assert {k: getattr(s, k) for k in want} == want
    assert set(want) == {*settings.FLAGS, "release"}
