"""The package's boundaries, read from its source: no object of infinity reads a private
attribute of an object owned by another of its packages (torch's own, like ``_parameters``,
are exempt), nothing is silenced with ``# noqa: SLF001``, and no module imports, through
others, itself (import circles, over the whole package)."""
import ast
import os
from collections import defaultdict
from typing import Dict, FrozenSet, Iterator, List, Set, Tuple

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


# ---- import circles -----------------------------------------------------------------------
# The module graph counts every import statement of infinity/ (module level, inside functions,
# under ``if TYPE_CHECKING:``), relative ones resolved; ``from pkg import name`` imports the
# submodule ``pkg.name`` when there is one, else ``pkg`` (its __init__, a module of its own).
# Importing ``a.b.c`` counts as importing ``a.b.c`` only (not its parent packages: every
# submodule import runs them, which would make the top level a part of every circle).
#
# The circles that still exist. The test fails on any circle not listed here and on any
# listed circle that is gone, so this list can only shrink (it is empty: no circle is left).
KNOWN_CIRCLES: Set[FrozenSet[str]] = set()


def _module_names() -> Dict[str, str]:
    """Dotted module name -> source path; a package's ``__init__`` is the package itself."""
    root = os.path.dirname(PACKAGE)
    out = {}
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                parts = os.path.relpath(path, root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = path
    return out


def _imports(module: str, is_package: bool, tree: ast.AST,
             modules: Set[str]) -> Iterator[Tuple[str, int, str]]:
    """(imported module, line, statement) for every import in ``tree`` -- module level, inside
    functions, under ``if TYPE_CHECKING:`` -- that names a module of ``modules``. Relative
    imports are resolved; ``from pkg import name`` where ``pkg.name`` is a module imports that
    module, otherwise it imports ``pkg``."""
    def known(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = known(alias.name)
                if target:
                    yield target, node.lineno, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                if node.level > 1:
                    base = base[:len(base) - (node.level - 1)]
                pkg = ".".join(base + ([node.module] if node.module else []))
            else:
                pkg = node.module or ""
            for alias in node.names:
                sub = f"{pkg}.{alias.name}"
                target = sub if sub in modules else known(pkg)
                if target:
                    yield target, node.lineno, ast.unparse(node)


def _import_graph() -> Tuple[Dict[str, Set[str]], Dict[Tuple[str, str], List[str]]]:
    """The package's module graph (module -> modules it imports) and, per edge, where the
    import is written (``path:line: statement``)."""
    names = _module_names()
    modules = set(names)
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    where: Dict[Tuple[str, str], List[str]] = defaultdict(list)
    for module, path in names.items():
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        for target, line, text in _imports(module, is_package, tree, modules):
            if target == module:
                continue
            graph[module].add(target)
            at = f"{os.path.relpath(path, os.path.dirname(PACKAGE))}:{line}: {text}"
            if at not in where[(module, target)]:
                where[(module, target)].append(at)
    return graph, where


def strongly_connected(graph: Dict[str, Set[str]]) -> List[FrozenSet[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan's
    algorithm, iterative so that deep graphs do not hit the recursion limit)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    found: List[FrozenSet[str]] = []
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
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    members.add(top)
                    if top == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found


def _describe(circle: FrozenSet[str], graph: Dict[str, Set[str]],
              where: Dict[Tuple[str, str], List[str]]) -> str:
    lines = [", ".join(sorted(circle)) + ":"]
    for a in sorted(circle):
        for b in sorted(graph[a] & circle):
            for w in where[(a, b)]:
                lines.append(f"    {w}   ({a} -> {b})")
    return "\n".join(lines)


def test_cycle_finder_on_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"},
             "g": set(), "h": {"h"}}
    assert sorted(sorted(c) for c in strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"x": {"y"}, "y": set()}) == []
    # a long chain closed at its end is one circle, found without recursion
    chain = {str(i): {str(i + 1)} for i in range(5000)}
    chain["5000"] = {"0"}
    assert strongly_connected(chain) == [frozenset(chain)]


def test_import_resolution_on_a_synthetic_module():
    modules = {"p", "p.a", "p.b", "p.sub", "p.sub.c", "p.sub.d"}
    source = ("import os.path\n"                  # outside the package: ignored
              "from typing import TYPE_CHECKING\n"
              "from .. import a\n"                # a submodule: p.a
              "from . import c, helper\n"         # p.sub.c, and a name of p.sub: p.sub
              "if TYPE_CHECKING:\n"
              "    from ...outside import x\n"    # above the package: ignored
              "def f():\n"
              "    import p.b\n")
    found = sorted((t, line) for t, line, _ in _imports("p.sub.d", False, ast.parse(source),
                                                       modules))
    assert found == [("p.a", 3), ("p.b", 8), ("p.sub", 4), ("p.sub.c", 4)]
    # in a package's __init__, "." is the package itself
    init = [t for t, _, _ in _imports("p.sub", True, ast.parse("from .d import y\n"), modules)]
    assert init == ["p.sub.d"]


def test_import_circles_are_only_the_known_ones():
    graph, where = _import_graph()
    circles = strongly_connected(graph)
    new = [c for c in circles if c not in KNOWN_CIRCLES]
    gone = [c for c in KNOWN_CIRCLES if c not in circles]
    message = []
    if new:
        message.append("import circles in infinity/ (cut them, or -- only for a circle that "
                       "already existed -- list it in KNOWN_CIRCLES):\n"
                       + "\n".join(_describe(c, graph, where) for c in new))
    if gone:
        message.append("circles in KNOWN_CIRCLES that no longer exist (remove them from the "
                       "list):\n" + "\n".join(", ".join(sorted(c)) for c in gone))
    if message:
        raise AssertionError("\n".join(message))


# ---- folders, package layers, module __getattr__ ------------------------------------------
MAX_MODULES_PER_FOLDER = 12  # __init__.py not counted

# The layer order of each package's children, lowest first: a child (a module, or a
# sub-package with everything below it) imports only children listed before it. "__init__" is
# the package's own face. A child missing from its package's list fails the test too.
LAYERS: Dict[str, List[str]] = {
    "infinity": ["_native", "version", "sizes", "trace_events", "models", "io", "ops", "tiers",
                 "policy", "runtime", "optim", "plan", "checkpoint", "sharding", "api",
                 "accumulation", "__init__", "integrations", "demo", "bench", "cli", "__main__", "dist"],
    "infinity.runtime": ["core", "experts", "process", "homes", "zero", "grads", "vocab", "activations",
                         "step", "build", "engine", "port", "layered", "__init__"],
    "infinity.optim": ["step", "states", "loss_scale", "clip", "params", "update", "wrapped",
                       "core", "checks", "overlap", "in_backward", "state_dicts", "zero_states", "adam",
                       "__init__"],
    "infinity.checkpoint": ["disk", "names", "matching", "bnb4", "per_rank", "ranks", "load",
                            "sharded", "save", "consolidate", "dcp_write", "dcp", "inspect",
                            "__init__"],
}


def _packages() -> Set[str]:
    return {m for m, p in _module_names().items() if os.path.basename(p) == "__init__.py"}


def _child(package: str, module: str) -> str:
    """The child of ``package`` that ``module`` lies in ("__init__" for the package itself),
    or "" when it lies outside."""
    if module == package:
        return "__init__"
    if not module.startswith(package + "."):
        return ""
    return module[len(package) + 1:].split(".")[0]


def package_edges(graph: Dict[str, Set[str]], package: str) -> Dict[str, Set[str]]:
    """The import graph between the children of ``package`` (imports inside one child are
    not edges)."""
    edges: Dict[str, Set[str]] = defaultdict(set)
    for a, targets in graph.items():
        ca = _child(package, a)
        if not ca:
            continue
        edges.setdefault(ca, set())
        for b in targets:
            cb = _child(package, b)
            if cb and cb != ca:
                edges[ca].add(cb)
    return edges


def upward_imports(edges: Dict[str, Set[str]], order: List[str]) -> List[str]:
    """``a -> b`` edges where ``b`` stands above ``a`` in ``order`` (or either is unlisted)."""
    rank = {name: i for i, name in enumerate(order)}
    bad = []
    for a in sorted(edges):
        for b in sorted(edges[a]):
            if a not in rank or b not in rank or rank[b] > rank[a]:
                bad.append(f"{a} -> {b}")
    return bad


def test_no_folder_holds_more_than_12_modules():
    crowded = {}
    for d, _, files in os.walk(PACKAGE):
        n = sum(f.endswith(".py") and f != "__init__.py" for f in files)
        if n > MAX_MODULES_PER_FOLDER:
            crowded[os.path.relpath(d, os.path.dirname(PACKAGE))] = n
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"


def test_package_layer_check_on_a_synthetic_graph():
    graph = {"p": {"p.b"}, "p.a": set(), "p.b": {"p.a"}, "p.c.x": {"p.b", "p.c.y"},
             "p.c.y": {"p.a"}}
    edges = package_edges(graph, "p")
    assert edges == {"__init__": {"b"}, "a": set(), "b": {"a"}, "c": {"b", "a"}}
    assert upward_imports(edges, ["a", "b", "c", "__init__"]) == []
    assert upward_imports(edges, ["b", "a", "c", "__init__"]) == ["b -> a"]
    assert upward_imports(edges, ["a", "b", "__init__"]) == ["c -> a", "c -> b"]  # c unlisted
    assert strongly_connected({"a": {"b"}, "b": {"a"}}) == [frozenset("ab")]


def test_packages_import_only_down_their_layers_and_form_no_circle():
    graph, where = _import_graph()
    problems = []
    for package in sorted(_packages()):
        edges = package_edges(graph, package)
        for circle in strongly_connected(edges):
            problems.append(f"{package}: package-level circle {sorted(circle)}")
        if package in LAYERS:
            children = set(edges)
            missing = sorted(children - set(LAYERS[package]))
            if missing:
                problems.append(f"{package}: children missing from LAYERS: {missing}")
            for edge in upward_imports(edges, LAYERS[package]):
                a, b = edge.split(" -> ")
                at = [w for (m, t), ws in where.items() for w in ws
                      if _child(package, m) == a and _child(package, t) == b]
                problems.append(f"{package}: upward import {edge}: {at[:3]}")
    assert not problems, "\n".join(problems)


def test_no_module_level_getattr_but_the_lazy_optim():
    allowed = {os.path.join(PACKAGE, "__init__.py")}
    found = []
    for path, tree in _sources().items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" \
                    and path not in allowed:
                found.append(os.path.relpath(path, os.path.dirname(PACKAGE)))
    assert not found, f"module-level __getattr__ (a shim): {found}"
