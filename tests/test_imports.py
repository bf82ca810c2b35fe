"""The package's internal import graph: floors, no cycle (between modules, and between the
package's folders), the command line on top of everything.

``python tests/test_imports.py`` prints the graph (each module's fastweights-internal imports,
``*`` marking those made inside a function), its cycles and its arrows up a floor.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import fastweights

ROOT = Path(fastweights.__file__).parent

# The floors of the package, bottom to top (docs/design.md, "Floors"): a module imports
# modules of its own floor and of the floors below, never one above, at module level or inside
# a function alike. The root's modules (fastweights itself, _checks, _commands, _files, _names,
# state_tree, testing) are the ground floor.
FLOORS = (
    ("ops",),
    ("layers",),
    ("models",),
    ("parallel",),
    ("hf",),
    ("fla",),
    ("tasks",),
    ("train",),
    ("bench", "reproduce"),
    ("cli",),
    ("__main__",),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str:
    """The top-level part of the package that ``module`` belongs to: its folder, or the root
    module itself ("" for the package's own ``__init__``)."""
    return module.split(".")[1] if "." in module else ""


def floor(module: str) -> int:
    """The floor of ``module`` (0 for the root's own modules)."""
    part_ = part(module)
    for i, names in enumerate(FLOORS, start=1):
        if part_ in names:
            return i
    return 0


def _is_main_block(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``, a script's entry point."""
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "__name__ == '__main__'", '__name__ == "__main__"')


def _imports(path: Path, modules: set[str]) -> dict[str, bool]:
    """fastweights-internal modules that ``path`` imports -> whether only inside a function
    (imports under ``if TYPE_CHECKING`` and in an ``if __name__ == "__main__"`` block count
    like any other: a circle a type checker follows is a circle)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, bool] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
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


def arrows_up(graph: dict[str, dict[str, bool]]) -> list[str]:
    """Every import of a module on a higher floor, as ``a -> b``."""
    return [f"{m} -> {t}{'*' if late else ''}" for m, imps in graph.items()
            for t, late in sorted(imps.items()) if floor(t) > floor(m)]


def folder_graph(graph: dict[str, dict[str, bool]]) -> dict[str, set[str]]:
    """The import graph between the package's top-level parts (``part``): a part imports
    another when one of its modules does."""
    folders: dict[str, set[str]] = {part(m): set() for m in graph}
    for m, imps in graph.items():
        folders[part(m)].update(part(t) for t in imps if part(t) != part(m))
    return folders


def package_graph(graph: dict[str, dict[str, bool]]) -> dict[str, set[str]]:
    """The import graph with every sub-package of a folder (``fastweights.ops.linear_attn``,
    ``fastweights.ops.ttt``, ...) as one node, its modules merged; other modules stay nodes."""
    def node(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:3]) if len(parts) > 3 or (
            len(parts) == 3 and (ROOT / parts[1] / parts[2]).is_dir()) else module

    merged: dict[str, set[str]] = {}
    for m, imps in graph.items():
        merged.setdefault(node(m), set()).update(node(t) for t in imps if node(t) != node(m))
    return merged


def test_no_cycle_with_function_level_imports_included():
    graph = import_graph()
    assert cycles({m: set(imps) for m, imps in graph.items()}) == []


def test_no_cycle_between_sub_packages():
    """No loop between the sub-packages of a folder either, as whole packages (ops/linear_attn
    and ops/delta_rule formed one: the delta rule's kernels run linear attention, and the delta
    rule took linear attention's state)."""
    packages = package_graph(import_graph())
    assert {"fastweights.ops.linear_attn", "fastweights.ops.delta_rule"} <= set(packages)
    assert cycles(packages) == []


def test_no_arrow_up_a_floor_with_function_level_imports_included():
    assert arrows_up(import_graph()) == []


def test_no_cycle_between_folders():
    """No loop at folder level either (models/, fla/ and hf/ formed one through the re-export
    shims of 0.1.0's old import paths, models/fla.py and hf_fla.py)."""
    folders = folder_graph(import_graph())
    assert {"models", "fla", "hf", "layers", "ops"} <= set(folders)
    assert cycles(folders) == []


def test_every_top_level_part_has_a_floor():
    parts = {p.stem for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    ground = {"__init__", "_checks", "_commands", "_files", "_names", "state_tree", "testing"}
    assert parts - ground == {name for names in FLOORS for name in names}


def test_the_command_is_the_only_entry_point():
    """One door: ``fastweights`` (``python -m fastweights``, fastweights/__main__.py). No module
    is also a script (an ``if __name__ == "__main__"`` block importing the command line back
    made a file-level circle the graph did not see)."""
    blocks = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
              if any(_is_main_block(n) for n in ast.walk(ast.parse(p.read_text())))]
    assert blocks == []
    assert (ROOT / "__main__.py").is_file()


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
    print("arrows up a floor:", arrows_up(graph) or "none", file=sys.stderr)
    print("cycles between folders:", cycles(folder_graph(graph)) or "none", file=sys.stderr)
    print("cycles between sub-packages:", cycles(package_graph(graph)) or "none",
          file=sys.stderr)
