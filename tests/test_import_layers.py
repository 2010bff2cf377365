"""The engine's folders are layers: walking every import statement (function-level ones included) finds no
cycle between `sluice.engine` subpackages, and no Python file imports the pre-namespace top-level names."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINE = REPO / "engine"
PYTHON_ROOTS = ("engine", "service", "kernels", "benchmarks", "clients/python", "scripts", "tests", "deploy")


def imported_modules(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def subpackage_edges() -> dict[str, dict[str, str]]:
    """subpackage -> {imported subpackage: one importing file}, for imports between engine subpackages."""
    subpackages = {p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists()}
    edges: dict[str, dict[str, str]] = {name: {} for name in subpackages}
    for path in ENGINE.rglob("*.py"):
        source = path.relative_to(ENGINE).parts[0]
        if source not in subpackages:
            continue  # a leaf module at the engine's root
        for module in imported_modules(path):
            parts = module.split(".")
            target = parts[2] if parts[:2] == ["sluice", "engine"] and len(parts) > 2 else None
            if target in subpackages and target != source:
                edges[source].setdefault(target, str(path.relative_to(REPO)))
    return edges


def find_cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with an explicit path)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(edges[node]):
            if cycle := visit(nxt, [*path, node]):
                return cycle
        done.add(node)
        return None

    for start in sorted(edges):
        if cycle := visit(start, []):
            return cycle
    return None


def test_engine_subpackages_import_each_other_without_a_cycle() -> None:
    edges = subpackage_edges()
    cycle = find_cycle(edges)
    where = [] if cycle is None else [edges[a][b] for a, b in zip(cycle, cycle[1:], strict=False)]
    assert cycle is None, f"import cycle {' -> '.join(cycle)} via {where}"
    # The layers a reader can rely on: the scheduler and the KV cache never reach the model or torch's side.
    assert set(edges["kv_cache"]) == set()
    assert set(edges["scheduler"]) == {"kv_cache"}
    assert "core" not in edges["worker"] and "worker" not in edges["loading"]


def test_the_cycle_finder_finds_one() -> None:
    edges = {"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}, "d": {}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": "x"}, "b": {}}) is None


def test_no_file_imports_the_old_top_level_packages() -> None:
    offenders = []
    for root in PYTHON_ROOTS:
        for path in (REPO / root).rglob("*.py"):
            for module in imported_modules(path):
                if module.split(".")[0] in ("engine", "service", "kernels", "benchmarks"):
                    offenders.append(f"{path.relative_to(REPO)}: {module}")
    assert offenders == []
