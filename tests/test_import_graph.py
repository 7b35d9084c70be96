"""jaxkv's modules import each other without a cycle, counting lazy imports (inside functions) too: the layering
runs one way (cache < models < rollout < session < stream < drivers < generate < cli), read from the source's ast."""

from __future__ import annotations

import ast
import pathlib

JAXKV = pathlib.Path(__file__).resolve().parent.parent / "jaxkv"


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = JAXKV) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, over every ``.py`` under ``root`` (a package directory). Every
    ``import`` / ``from ... import`` counts wherever it stands (module level, inside functions, under
    TYPE_CHECKING). ``from pkg import name`` points at the module ``pkg.name`` when there is one, else at ``pkg``;
    the parent packages Python runs first are not counted (a package importing its own modules is no cycle)."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    edges.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_jaxkv_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "jaxkv.stream" in graph  # the walk saw the package
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_walk_sees_lazy_and_relative_imports(tmp_path):
    # jaxkv's own lazy import: `jaxkv.Pipeline` imports jaxkv.pipeline inside a module __getattr__
    assert "jaxkv.pipeline" in import_graph()["jaxkv"]
    assert "jaxkv.session" in import_graph()["jaxkv.stream"] and "jaxkv.session" not in import_graph()["jaxkv.rollout"]
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")  # lazy and relative
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    (pkg / "sub" / "b.py").write_text("import pkg.sub\n")  # a module importing its own package: no edge to itself
    assert find_cycle(import_graph(pkg)) is None
