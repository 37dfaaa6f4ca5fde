"""The package's boundaries, read from its source: no object of infinity reads a private
attribute of an object owned by another of its packages (torch's own, like ``_parameters``,
are exempt), and nothing is silenced with ``# noqa: SLF001``."""
import ast
import os
from collections import defaultdict
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "infinity")
# torch's and the standard library's private names that infinity reads on their objects
# (they are also defined by some infinity class, which makes them look like a crossing)
TORCH_OWN = {"_buffers", "_parameters", "_modules"}


def _package(path: str) -> str:
    parts = os.path.relpath(path, PACKAGE).split(os.sep)
    return parts[0] if len(parts) > 1 else "(root)"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources() -> Dict[str, ast.AST]:
    out = {}
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    out[path] = ast.parse(fh.read(), path)
    return out


def _defined(trees: Dict[str, ast.AST]) -> Dict[str, Set[str]]:
    """Private name -> the packages that define it (a def, a class, a module or class
    variable, an attribute assigned on self/cls)."""
    owners: Dict[str, Set[str]] = defaultdict(set)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names: List[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Name):
                            names.append(sub.id)
                        elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                              and sub.value.id in ("self", "cls")):
                            names.append(sub.attr)
            for n in names:
                if _private(n):
                    owners[n].add(_package(path))
    return owners


def _reads(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, private name) read on an object other than self/cls/super()."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            yield node.lineno, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            first = node.args[0]
            if not (isinstance(first, ast.Name) and first.id in ("self", "cls")):
                yield node.lineno, node.args[1].value


def test_no_private_attribute_is_read_across_packages():
    trees = _sources()
    owners = _defined(trees)
    crossing = []
    for path, tree in sorted(trees.items()):
        pkg = _package(path)
        for line, name in _reads(tree):
            where = owners.get(name, set())
            if where and pkg not in where and name not in TORCH_OWN:
                crossing.append(f"{os.path.relpath(path, PACKAGE)}:{line}: {name} "
                                f"(defined in {', '.join(sorted(where))})")
    assert not crossing, "private attributes read across packages:\n" + "\n".join(crossing)


def test_nothing_silences_private_access():
    marked = []
    for path in _sources():
        with open(path) as fh:
            for i, line in enumerate(fh, 1):
                if "noqa: SLF001" in line:
                    marked.append(f"{os.path.relpath(path, PACKAGE)}:{i}")
    assert not marked, marked
