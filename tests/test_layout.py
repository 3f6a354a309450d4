"""Package layout: no import circles among mtpipe's modules, and no module over MAX_LINES lines.

The checked files are every .py under coordinator/, node/, models/ and proto/ (without the generated
`*_pb2*.py` stubs) and the top-level __init__.py. Imports are read with `ast`, not by importing:
relative imports (`from ..x import y`, `from . import module`) and absolute `mtpipe.` imports are
resolved to module names; imports under `if TYPE_CHECKING:` are ignored (they never run), imports
inside functions count (they are part of the dependency structure even when they run late).

An edge goes to the module an import names: `from pkg import mod` -> pkg.mod when that is a module,
otherwise -> pkg (a name defined in pkg/__init__.py). The parent packages Python also initialises on
the way are not edges (as in import-linter and pydeps); every module would otherwise sit in a circle
with any package __init__ that imports it.

The helpers take the package root and name, so the tests below also run them on packages of their
own in tmp_path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package `mtpipe`
PACKAGE = "mtpipe"
SUBPACKAGES = ("coordinator", "node", "models", "proto")
MAX_LINES = 450


def is_generated(path: Path) -> bool:
    return "_pb2" in path.stem


def module_files(
    root: Path = ROOT, package: str = PACKAGE, subpackages: tuple[str, ...] = SUBPACKAGES, *, generated: bool = False
) -> dict[str, Path]:
    """{module name: file} for root/__init__.py and every .py under root/<subpackage>/ that is not a
    generated stub (generated=True: the generated stubs only)."""
    files: dict[str, Path] = {}
    if (root / "__init__.py").exists() and not generated:
        files[package] = root / "__init__.py"
    for sub in subpackages:
        for path in sorted((root / sub).rglob("*.py")):
            if is_generated(path) != generated or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, anywhere in the tree, except inside `if TYPE_CHECKING:` bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _longest_known(name: str, modules: set[str]) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: set[str], package: str = PACKAGE) -> set[str]:
    """The modules of `modules` that `module` (source at `path`) imports."""
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]  # the package relative imports start from
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    targets: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    target = _longest_known(alias.name, modules)
                    if target:
                        targets.add(target)
            continue
        if node.level:
            if node.level - 1 > len(base) - 1:
                raise ValueError(f"{path}: relative import beyond the top-level package (line {node.lineno})")
            origin = base[: len(base) - (node.level - 1)]
            source = ".".join(origin + (node.module.split(".") if node.module else []))
        else:
            source = node.module or ""
            if not (source == package or source.startswith(package + ".")):
                continue  # a third-party or standard-library import
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            if submodule in modules:  # from pkg import module
                targets.add(submodule)
            else:  # from module import name (or from pkg import a name its __init__ defines)
                target = _longest_known(source, modules)
                if target:
                    targets.add(target)
    targets.discard(module)
    return targets


def import_graph(files: dict[str, Path], package: str = PACKAGE, unparsed: set[str] = frozenset()) -> dict[str, set[str]]:
    """Edges between the modules of `files`. Imports of the `unparsed` modules (the generated stubs)
    resolve to them and are then dropped: `from ..proto import mtpipe_pb2` is no edge to mtpipe.proto."""
    checked = set(files)
    return {m: imports_of(m, p, checked | set(unparsed), package) & checked for m, p in files.items()}


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components and their members sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of the import graph with more than one module."""
    return [c for c in strongly_connected_components(graph) if len(c) > 1]


def describe_cycle(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"  {m} -> {t}" for m in component for t in sorted(graph[m] & members)]
    return f"{len(component)} modules: {', '.join(component)}\n" + "\n".join(edges)


def oversized(files: dict[str, Path], limit: int = MAX_LINES) -> dict[str, int]:
    """{module: line count} for the modules longer than `limit` lines."""
    counts = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in files.items()}
    return {m: n for m, n in sorted(counts.items()) if n > limit}


# -- the package itself ----------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    files = module_files()
    assert len(files) > 20 and PACKAGE in files and f"{PACKAGE}.node.stage" in files  # the walk found the package
    graph = import_graph(files, unparsed=set(module_files(generated=True)))
    assert sum(map(len, graph.values())) > 50  # and resolved the imports
    cycles = import_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(describe_cycle(c, graph) for c in cycles)


def test_no_module_over_the_line_limit() -> None:
    files = module_files()
    too_long = oversized(files)
    assert not too_long, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{files[m].relative_to(ROOT)} ({n})" for m, n in too_long.items()
    )


# -- the checks themselves, on packages made for them ----------------------------------------------


def write_package(root: Path, sources: dict[str, str]) -> Path:
    """Files at root/<relative path> with the given sources; returns root."""
    for rel, text in sources.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cycle_detection_on_a_circular_package(tmp_path: Path) -> None:
    root = write_package(tmp_path / "pkg", {
        "__init__.py": "VERSION = 1\n",
        "core/__init__.py": "",
        # A three-module circle through each kind of import: `from . import module`, `from ..x.y import
        # name` and an absolute import of the package, the last inside a function.
        "core/a.py": "from . import b\n",
        "core/b.py": "from ..util.c import helper\n",
        "util/__init__.py": "",
        "util/c.py": "def helper():\n    import pkg.core.a\n    return pkg.core.a\n",
        # d and e import each other only for type checking: no circle.
        "core/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import E\nclass D: ...\n",
        "core/e.py": "from .d import D\nclass E(D): ...\n",
        # f and g: a circle through the else branch of a TYPE_CHECKING test and a package __init__ name.
        "other/__init__.py": "from .g import G\n",
        "other/f.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from ..other import G\n",
        "other/g.py": "from .f import *\nclass G: ...\n",
        # A generated stub importing everything is not looked at; imports of it are no edges to its
        # package. The top-level __init__ is looked at.
        "util/x_pb2.py": "from ..core import a, b\n",
        "util/h.py": "from .. import VERSION\nfrom . import x_pb2\nimport json\nfrom os import path\n",
    })
    subs = ("core", "util", "other")
    files = module_files(root, "pkg", subs)
    assert "pkg" in files and "pkg.util.x_pb2" not in files
    assert module_files(root, "pkg", subs, generated=True) == {"pkg.util.x_pb2": root / "util/x_pb2.py"}
    graph = import_graph(files, "pkg", unparsed={"pkg.util.x_pb2"})
    assert graph["pkg.core.a"] == {"pkg.core.b"}
    assert graph["pkg.core.b"] == {"pkg.util.c"}
    assert graph["pkg.util.c"] == {"pkg.core.a"}
    assert graph["pkg.core.d"] == set() and graph["pkg.core.e"] == {"pkg.core.d"}
    assert graph["pkg.other.f"] == {"pkg.other"} and graph["pkg.other"] == {"pkg.other.g"}
    assert graph["pkg.util.h"] == {"pkg"}
    assert import_cycles(graph) == [
        ["pkg.core.a", "pkg.core.b", "pkg.util.c"],
        ["pkg.other", "pkg.other.f", "pkg.other.g"],
    ]
    assert "pkg.core.a -> pkg.core.b" in describe_cycle(import_cycles(graph)[0], graph)
    # Break both circles: nothing is reported.
    (root / "util/c.py").write_text("def helper():\n    return 1\n")
    (root / "other/f.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from ..other import G\n")
    assert import_cycles(import_graph(module_files(root, "pkg", subs), "pkg")) == []


def test_relative_import_beyond_the_package_is_an_error(tmp_path: Path) -> None:
    root = write_package(tmp_path / "pkg", {"__init__.py": "", "core/__init__.py": "", "core/a.py": "from ... import x\n"})
    with pytest.raises(ValueError, match="beyond the top-level package"):
        import_graph(module_files(root, "pkg", ("core",)), "pkg")


def test_strongly_connected_components() -> None:
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert strongly_connected_components(graph) == [["a", "b", "c"], ["d", "e"], ["f"], ["g"]]
    chain = {str(i): {str(i + 1)} for i in range(5000)}  # deep graphs do not hit the recursion limit
    chain["5000"] = {"0"}
    assert len(strongly_connected_components(chain)[0]) == 5001


def test_line_limit_check(tmp_path: Path) -> None:
    root = write_package(tmp_path / "pkg", {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/short.py": "x = 1\n" * MAX_LINES,
        "core/long.py": "x = 1\n" * (MAX_LINES + 1),
        "core/big_pb2.py": "x = 1\n" * 5000,  # generated: not counted
    })
    assert oversized(module_files(root, "pkg", ("core",))) == {"pkg.core.long": MAX_LINES + 1}
