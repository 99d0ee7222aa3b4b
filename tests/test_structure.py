"""The package's modules import each other in one direction only: no module is re-entered on the way down."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_extract"


def _imports() -> dict[str, set[str]]:
    """module -> the package modules it imports (at the top or inside functions)."""
    names = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {}
    for path in PACKAGE.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:  # `from .x import y`, `from . import x, y`
                found |= (
                    {node.module} if node.module else {a.name if a.name in names else "__init__" for a in node.names}
                )
        graph[path.stem] = found - {path.stem}
    return graph


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
    assert graph["cli"] >= {"api"} and "cli" not in set().union(*(graph[m] for m in graph if m != "__main__"))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
