"""The import graph of `hpcrl/` and `trainer/` has no cycle, and no function imports one of the
project's own modules: each module names what it uses at its top, and a shared piece lives in the
module that owns it. Function-local imports remain only for heavy optional dependencies (torch,
ray, vllm, transformers, matplotlib, submitit, spython, pyarrow, ...), which keep `hpcrl` light.

The graph is read from the source with `ast` (nothing is imported): module-level and
function-level imports, relative imports resolved, `if TYPE_CHECKING:` blocks left out (they never
run). Importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`: those packages count as
imported too, except the importer's own enclosing packages (already being imported).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("hpcrl", "trainer")


@dataclass(frozen=True)
class Edge:
    target: str
    file: str
    line: int
    local: bool
    """The import statement is inside a function (or lambda)."""


def modules_of(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` file under `root/<package>`."""
    out: dict[str, Path] = {}
    for package in packages:
        for file in sorted((root / package).rglob("*.py")):
            parts = list(file.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = file
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: dict[str, Path]) -> list[str]:
    """The own modules `node` imports (a `from p import name` names the submodule `p.name` when
    there is one, else `p`)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                 for a in node.names]
    out = []
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:  # `import a.b.obj` names module a.b
            parts.pop()
        if parts:
            out.append(".".join(parts))
    return out


def _imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that can run, with whether it is inside a function."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, local = stack.pop()
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            inside = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, inside))
            stack.append((child, inside))
    return sorted(out, key=lambda item: item[0].lineno)


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, list[Edge]]:
    """module -> the own modules it imports, with where and whether inside a function."""
    modules = modules_of(root, packages)
    graph: dict[str, list[Edge]] = {m: [] for m in modules}
    for module, file in modules.items():
        is_package = file.name == "__init__.py"
        enclosing = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        rel = file.relative_to(root).as_posix()
        for node, local in _imports(ast.parse(file.read_text(), filename=str(file))):
            for target in _targets(node, module, is_package, modules):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    name = ".".join(parts[:i])
                    if name != module and name not in enclosing and name in modules:
                        graph[module].append(Edge(name, rel, node.lineno, local))
    return graph


def local_imports(graph: dict[str, list[Edge]]) -> list[str]:
    """`file:line imports module` for every function-local import of an own module."""
    return sorted({f"{e.file}:{e.line} imports {e.target}"
                   for edges in graph.values() for e in edges if e.local})


def find_cycle(graph: dict[str, list[Edge]]) -> list[str] | None:
    """One import cycle as `[a, b, ..., a]` with each step's file:line, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[tuple[str, Edge | None]] = []

    def dfs(module: str, via: Edge | None) -> list[str] | None:
        state[module] = 1
        path.append((module, via))
        for edge in sorted(graph.get(module, []), key=lambda e: (e.target, e.line)):
            if state.get(edge.target) == 1:
                start = next(i for i, (m, _) in enumerate(path) if m == edge.target)
                steps = path[start:] + [(edge.target, edge)]
                return [steps[0][0]] + [f"-> {m} ({e.file}:{e.line}{', in a function' if e.local else ''})"
                                        for m, e in steps[1:] if e is not None]
            if edge.target not in state:
                found = dfs(edge.target, edge)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = dfs(module, None)
            if found:
                return found
    return None


# ----------------------------------------------------------------------------- the project


def test_no_function_imports_an_own_module() -> None:
    found = local_imports(import_graph(REPO))
    assert not found, ("import these at the module's top (a cycle means the shared piece belongs "
                       "in another module):\n  " + "\n  ".join(found))


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(REPO))
    assert cycle is None, "import cycle: " + " ".join(cycle or [])


def test_the_graph_sees_the_project() -> None:
    graph = import_graph(REPO)
    assert {"hpcrl.cli", "hpcrl.agent.core", "trainer.driver", "trainer.algos.registry"} <= set(graph)
    assert "trainer.algos.registry" in {e.target for e in graph["trainer.algos.advantages"]}
    assert "hpcrl.rundir" in {e.target for e in graph["hpcrl.progress"]}


# ----------------------------------------------------------------------------- the checker itself


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_a_function_import_is_named(tmp_path: Path) -> None:
    root = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import os\nfrom pkg import b\n",
        "pkg/b.py": "def f():\n    from pkg.a import thing\n    import torch\n    return thing\n",
        "pkg/c.py": "from . import a\n",
    })
    graph = import_graph(root, ("pkg",))
    assert local_imports(graph) == ["pkg/b.py:2 imports pkg.a"]  # torch is not an own module
    assert find_cycle(graph) == ["pkg.a", "-> pkg.b (pkg/a.py:2)", "-> pkg.a (pkg/b.py:2, in a function)"]


def test_relative_and_package_imports_and_type_checking(tmp_path: Path) -> None:
    root = write(tmp_path, {
        "pkg/__init__.py": "from pkg.sub import leaf\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n"
                           "from .. import other\n",
        "pkg/other.py": "import pkg.top\n",
        "pkg/top.py": "x = lambda: __import__('os')\n",
    })
    graph = import_graph(root, ("pkg",))
    targets = {m: sorted({e.target for e in edges}) for m, edges in graph.items()}
    assert targets == {"pkg": ["pkg.sub", "pkg.sub.leaf"], "pkg.sub": [], "pkg.sub.leaf": ["pkg.other"],
                       "pkg.other": ["pkg.top"], "pkg.top": []}
    assert find_cycle(graph) is None and local_imports(graph) == []
    # `top` importing `leaf` closes a cycle leaf -> other -> top -> leaf
    write(root, {"pkg/top.py": "from pkg.sub import leaf\n"})
    assert find_cycle(import_graph(root, ("pkg",))) == [
        "pkg.sub.leaf", "-> pkg.other (pkg/sub/leaf.py:4)", "-> pkg.top (pkg/other.py:1)",
        "-> pkg.sub.leaf (pkg/top.py:1)"]


@pytest.mark.parametrize("second", ["import pkg.a\n", "def g():\n    import pkg.a.x\n"])
def test_two_modules_importing_each_other(tmp_path: Path, second: str) -> None:
    root = write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": second})
    cycle = find_cycle(import_graph(root, ("pkg",)))
    assert cycle is not None and cycle[0] == "pkg.a" and cycle[-1].startswith("-> pkg.a ")
