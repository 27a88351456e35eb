"""No import cycles: between modules, and between the subpackages named in issue 16.

Every ``import`` in src/trainmem counts, at module level or inside a function (a lazy import is
still a dependency), except those under ``if TYPE_CHECKING:``. Importing ``a.b.c`` also runs
``a.b``'s ``__init__``, so it depends on that package too (not on ``trainmem`` itself, whose
``__init__`` is the facade, nor on the importer's own packages, which are loaded already).
"""

from __future__ import annotations

import ast
from pathlib import Path

import trainmem

SRC = Path(trainmem.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST):
    """Import nodes, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def module_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                dep = resolve(target) if target.startswith("trainmem.") else None
                if dep is None or dep == mod:
                    continue
                graph[mod].add(dep)
                parts = dep.split(".")
                for i in range(2, len(parts)):  # the packages between trainmem and dep run first
                    pkg = ".".join(parts[:i])
                    if not (mod + ".").startswith(pkg + "."):
                        graph[mod].add(pkg)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_of(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2])


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_imports():
    g = module_graph()
    # estimate's _repr_html_ imports the notebook renderer inside the method
    assert "trainmem.report.notebook" in g["trainmem.estimate"]
    # a submodule import depends on its package's __init__ too
    assert "trainmem.estimate" in g["trainmem.plan.shard"]


def test_no_module_imports_itself_back():
    assert cycles(module_graph()) == []


def test_renderers_never_import_the_estimator_or_the_tracer():
    """estimate and trace may render themselves (``_repr_html_``, ``trace/html.py``); report
    takes their results and never imports them back."""
    g = module_graph()
    report = {m: deps for m, deps in g.items() if _package_of(m) == "trainmem.report"}
    back = sorted((m, d) for m, deps in report.items() for d in deps
                  if _package_of(d) in ("trainmem.estimate", "trainmem.trace"))
    assert back == []
