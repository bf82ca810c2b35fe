"""The package's internal import graph: no cycles, and the command line on top of everything.

``python tests/test_imports.py`` prints the graph (each module's fastweights-internal imports,
``*`` marking those made inside a function) and its cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import fastweights

ROOT = Path(fastweights.__file__).parent
# The Hugging Face integration needs transformers (an optional extra): models.fla.from_fla
# imports hf_fla when called, and hf_fla wraps models.fla. Cycles through such a deferred import
# of the integration are the only ones allowed.
OPTIONAL = {"fastweights.hf", "fastweights.hf_fla"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: set[str]) -> dict[str, bool]:
    """fastweights-internal modules that ``path`` imports -> whether only inside a function
    (imports under ``if TYPE_CHECKING`` are left out)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, bool] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets: list[str] = []
            if isinstance(child, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - child.level + 1]
                module = ".".join([*base, child.module] if child.module else base) if child.level \
                    else child.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                           for a in child.names]
            elif isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            for target in targets:
                if target in modules and target != name:
                    found[target] = found.get(target, True) and nested
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return found


def import_graph() -> dict[str, dict[str, bool]]:
    """Every module of the package -> its internal imports (-> whether inside a function)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(paths)) for name, path in sorted(paths.items())}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                component.add(w)
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_module_level_imports_have_no_cycle():
    graph = import_graph()
    assert cycles({m: {t for t, late in imps.items() if not late} for m, imps in graph.items()}) == []


def test_function_level_imports_close_no_cycle_but_through_the_optional_integration():
    graph = import_graph()
    for component in cycles({m: set(imps) for m, imps in graph.items()}):
        assert component & OPTIONAL, f"import cycle {sorted(component)}"
    # without the deferred imports of the integration, none at all
    assert cycles({m: {t for t, late in imps.items() if not (late and t in OPTIONAL)}
                   for m, imps in graph.items()}) == []


def test_only_the_command_line_imports_it():
    """train/, bench/ and the library raise plain exceptions; the `fastweights` command (cli/,
    and __main__ which runs it) is on top of them and nothing imports it back."""
    importers = {m for m, imps in import_graph().items() for t in imps
                 if t == "fastweights.cli" or t.startswith("fastweights.cli.")}
    assert importers, "the graph found no import of the command line at all"
    assert {m for m in importers if not m.startswith("fastweights.cli")} == {"fastweights.__main__"}


if __name__ == "__main__":
    graph = import_graph()
    for module, imps in graph.items():
        print(module, "->", ", ".join(f"{t}{'*' if late else ''}" for t, late in sorted(imps.items())))
    print("cycles:", cycles({m: set(imps) for m, imps in graph.items()}) or "none", file=sys.stderr)
