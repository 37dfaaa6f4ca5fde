"""infinity/plan imports one way: no module of the package reaches, directly or through
others, back to itself. Every import counts: module level, inside functions, and under
``if TYPE_CHECKING``."""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import infinity.plan

PLAN_DIR = os.path.dirname(infinity.plan.__file__)
PACKAGE = "infinity.plan"


def _imports(path: str, module: str) -> Set[str]:
    """The infinity.plan modules ``module`` imports, anywhere in its source."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    base = module.rsplit(".", 1)[0] if not path.endswith("__init__.py") else module
    found: Set[str] = set()
    for node in ast.walk(tree):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                origin = f"{parent}.{node.module}" if node.module else parent
            else:
                origin = node.module or ""
            names = [origin] + [f"{origin}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith(PACKAGE + ".") and name.count(".") == PACKAGE.count(".") + 1:
                found.add(name)
    found.discard(module)
    return found


def _graph() -> Dict[str, Set[str]]:
    graph = {}
    for fname in sorted(os.listdir(PLAN_DIR)):
        if not fname.endswith(".py") or fname == "__init__.py":
            continue
        module = f"{PACKAGE}.{fname[:-3]}"
        graph[module] = _imports(os.path.join(PLAN_DIR, fname), module)
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    found: List[List[str]] = []
    state: Dict[str, int] = {}

    def visit(node: str, path: List[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_checker_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_local_and_type_checking_imports():
    graph = _graph()
    # estimate.py imports probe inside calibrated_compute and frozen inside estimate()
    assert f"{PACKAGE}.probe" in graph[f"{PACKAGE}.estimate"]
    assert f"{PACKAGE}.frozen" in graph[f"{PACKAGE}.estimate"]
    assert f"{PACKAGE}.results" in graph[f"{PACKAGE}.planner"]


def test_no_import_circle_in_plan():
    cycles = _cycles(_graph())
    assert cycles == [], f"import circles in infinity/plan: {cycles}"


def test_estimate_and_planner_do_not_import_the_text_of_their_results_upward():
    graph = _graph()
    for module in ("estimate", "planner", "results", "units"):
        assert f"{PACKAGE}.explain" not in graph[f"{PACKAGE}.{module}"]
    assert graph[f"{PACKAGE}.units"] == set()
