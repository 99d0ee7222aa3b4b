"""The package's folders are layers that import downward only, its modules never re-enter each other (no
import cycle), and the README's "How it works" names every module and the same layer order."""

from __future__ import annotations

import ast
import re
from importlib.util import resolve_name
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eagle_extract"
# Highest first: a module imports from its own layer or one below it.  "" is the shared base, the modules at the
# top of the package; the package itself (`__init__`, its exports) and `__main__` are its doors, above every layer.
LAYERS = ("faces", "job", "worker", "files", "data", "")
DOORS = ("eagle_extract", "eagle_extract.__main__")


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of `package` (a package by its own name)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at the top or inside functions: `from .x import y`,
    `from ..pkg.x import y`, `from ..pkg import x`, `from . import x` and absolute `eagle_extract.x`."""
    modules = _modules(package)
    graph = {}
    for name, path in modules.items():
        here = name if path.stem == "__init__" else name.rpartition(".")[0]  # the package relative imports start at
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = resolve_name("." * node.level + (node.module or ""), here) if node.level else node.module
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = (found & modules.keys()) - {name}
    return graph


def _layer(module: str) -> int:
    """Rank of the module's layer, 0 the highest; the doors are above them all."""
    if module in DOORS:
        return -1
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 2 or parts[-1] in LAYERS else "")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes to a higher layer than its importer's."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) < _layer(a))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_no_import_cycle():
    graph = _imports()
    # every form is seen: a function's import (cli's serve), `from ..pkg import x`, `from . import x`, ..x
    assert graph["eagle_extract.faces.cli"] >= {"eagle_extract.faces.api", "eagle_extract.faces.serve"}
    assert graph["eagle_extract.job.run"] >= {"eagle_extract.files.shards", "eagle_extract.job.stream"}
    assert "eagle_extract.errors" in graph["eagle_extract.job.run"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_every_import_goes_to_the_same_layer_or_a_lower_one():
    graph = _imports()
    assert {m.split(".")[1] for m in graph if m.count(".") > 1} == set(LAYERS) - {""}  # every folder is a layer
    assert not _upward(graph)


def test_the_checks_find_an_upward_import_and_a_cycle(tmp_path):
    package = tmp_path / "eagle_extract"
    for folder, name, text in [
        ("files", "rowfile", "def read():\n    from ..job import run\n"),  # inside a function, up two layers
        ("job", "run", "from ..files.rowfile import read\nfrom . import plan\n"),
        ("job", "plan", "from .run import go\n"),
        ("data", "store", "def f():\n    from .. import faces\n"),  # a whole higher folder, by name
        ("faces", "__init__", ""),
    ]:
        (package / folder).mkdir(parents=True, exist_ok=True)
        (package / folder / f"{name}.py").write_text(text)
    graph = _imports(package)
    assert _upward(graph) == [
        "eagle_extract.data.store -> eagle_extract.faces",
        "eagle_extract.files.rowfile -> eagle_extract.job.run",
    ]
    assert _cycle(graph) == ["eagle_extract.files.rowfile", "eagle_extract.job.run", "eagle_extract.files.rowfile"]
    assert not _upward({"eagle_extract.faces.cli": {"eagle_extract.job.run", "eagle_extract.config"}})
    assert _upward({"eagle_extract.config": {"eagle_extract.data.formats"}})
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_readme_gives_the_layer_order_and_lists_every_module_by_folder():
    text = (ROOT / "README.md").read_text()
    order = re.search(r"Imports go down only: ([^.]*)", " ".join(text.split()))
    assert order and tuple(re.findall(r"`(\w+)/`", order.group(1))) == LAYERS[:-1]
    rows = re.findall(r"^\| `(eagle_extract/[\w/]+\.py)` \|", text, re.M)
    files = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")}
    assert sorted(rows) == sorted(files)
    folders = [p.split("/")[1] if p.count("/") > 1 else "" for p in rows]
    assert [f for k, f in enumerate(folders) if k == 0 or f != folders[k - 1]] == list(LAYERS)  # grouped, in order
