"""The one port between engine and optimizer (infinity/runtime/port.py), read from the source
and exercised on a small wrapped model: infinity/optim imports nothing from the runtime but the
port and the flat-parameter type, has no import circle (module-level, function-local and
type-checking imports all counted), keeps its classes small, and its step overlap and the
sharding code reach the optimizer through public methods only; one port per engine, through
which the backward listeners hear the model."""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.runtime import engine_of
from infinity.runtime.port import OptimizerPort

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "infinity")
OPTIM = os.path.join(PACKAGE, "optim")
ALLOWED_RUNTIME = {"infinity.runtime.port", "infinity.runtime.core.flat"}
MAX_METHODS = 25
# a class that must be larger names its limit here (none now: OffloadedAdam's work lives in
# AdamCore, GradientChecks and StateDicts; the streamed and ZeRO state access is opt.state_dicts)
FACES: Dict[str, int] = {}


def _tree(path: str) -> ast.AST:
    with open(path) as fh:
        return ast.parse(fh.read(), path)


def _module(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str) -> Set[str]:
    """Every infinity module ``path`` imports, wherever the import stands."""
    mod, is_pkg = _module(path), path.endswith("__init__.py")
    out: Set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")[:None if is_pkg else -1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target + "." + a.name for a in node.names]
            out.update(names if not node.module and node.level else [target])
            if node.module:
                out.update(n for n in names if _is_module(n))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("infinity")}


def _is_module(name: str) -> bool:
    rel = os.path.join(os.path.dirname(PACKAGE), *name.split("."))
    return os.path.isfile(rel + ".py") or os.path.isfile(os.path.join(rel, "__init__.py"))


def _optim_files() -> List[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(OPTIM) for f in files
                  if f.endswith(".py"))


def test_optim_imports_only_the_port_and_the_flat_from_the_runtime():
    found = {}
    for path in _optim_files():
        bad = sorted(m for m in _imports(path)
                     if m.startswith("infinity.runtime") and m not in ALLOWED_RUNTIME)
        if bad:
            found[os.path.basename(path)] = bad
    assert not found, found


def test_optim_has_no_import_circle():
    graph: Dict[str, Set[str]] = {}
    for path in _optim_files():
        graph[_module(path)] = {m for m in _imports(path) if m.startswith("infinity.optim.")}
    state: Dict[str, int] = {}  # 1: on the path, 2: done
    circles: List[List[str]] = []

    def visit(m: str, path: List[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                circles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n in graph and n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def _methods(cls: ast.ClassDef) -> Set[str]:
    return {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_no_class_in_optim_or_the_port_has_more_than_about_25_methods():
    classes: Dict[str, ast.ClassDef] = {}
    for path in _optim_files() + [os.path.join(PACKAGE, "runtime", "port.py")]:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
    big = {}
    for name, cls in classes.items():
        names = set(_methods(cls))
        for base in cls.bases:  # what it inherits from infinity's own classes
            if isinstance(base, ast.Name) and base.id in classes:
                names |= _methods(classes[base.id])
        if len(names) > FACES.get(name, MAX_METHODS):
            big[name] = len(names)
    assert not big, big


def _private_reads(path: str) -> List[str]:
    """``x._name`` on anything but self/cls (torch's ``_parameters`` & co. aside)."""
    out = []
    for node in ast.walk(_tree(path)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.append(f"{os.path.basename(path)}:{node.lineno}: {node.attr}")
    return out


def test_overlap_and_sharding_state_read_no_private_member():
    paths = [os.path.join(OPTIM, "overlap.py"), os.path.join(OPTIM, "zero_states.py"),
             os.path.join(PACKAGE, "runtime", "zero", "state.py")]
    reads = [r for p in paths for r in _private_reads(p)]
    assert not reads, reads


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class Recorder:
    def __init__(self) -> None:
        self.calls: List[tuple] = []

    def forward_started(self, port) -> None:
        self.calls.append(("forward_started", port))

    def takes_in_ram(self, port, flat) -> bool:
        self.calls.append(("takes_in_ram", port))
        return False

    def writes(self, port) -> bool:
        return True

    def grads_complete(self, port, flat) -> None:
        self.calls.append(("grads_complete", port))

    def homes_needed(self, port) -> None:
        self.calls.append(("homes_needed", port))

    def engine_closing(self, port) -> None:
        self.calls.append(("engine_closing", port))


def test_one_port_per_engine_and_listeners_hear_the_model_through_it(tmp_path):
    torch.manual_seed(0)
    model = infinity.wrap(Net(), nvme_path=str(tmp_path), param_tier="nvme", grad_tier="nvme",
                          optimizer_tier="nvme")
    engine = engine_of(model)
    port = OptimizerPort.of(engine)
    assert OptimizerPort.of(engine) is port
    loc = OptimizerPort.locate(model.layers[1].weight)
    assert loc is not None and loc.port is port and loc.part == (loc.flat, loc.slot)
    assert loc.flat.slots[loc.slot].param is model.layers[1].weight
    assert OptimizerPort.locate(nn.Parameter(torch.ones(2))) is None
    assert port.facts.optimizer_tier == "nvme" and port.facts.nvme_path == str(tmp_path)
    rec = Recorder()
    port.add_listener(rec)
    port.add_listener(rec)  # once only
    model(torch.randn(4, 16)).square().mean().backward()
    kinds = [k for k, _ in rec.calls]
    assert kinds.count("forward_started") == 1
    assert kinds.count("grads_complete") == len(engine.flats)
    assert all(p is port for _, p in rec.calls)
    port.remove_listener(rec)
    rec.calls.clear()
    model(torch.randn(4, 16)).square().mean().backward()
    assert rec.calls == []
    infinity.unwrap(model)


def test_optimizer_keys_its_model_state_by_port_and_steps_like_before(tmp_path):
    """The optimizer's per-model state (store, listener) is reached through the port of the
    model's engine; a few steps match torch.optim.AdamW(fused=True) bitwise (fp32, host states;
    the CPU kernel follows the fused implementation's order of operations)."""
    torch.manual_seed(0)
    plain = Net()
    ref = Net()
    ref.load_state_dict(plain.state_dict())
    model = infinity.wrap(plain, nvme_path=str(tmp_path), param_tier="host", grad_tier="host",
                          optimizer_tier="host")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)  # the kernel's order
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 16, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            F.mse_loss(m(x), x).backward()
            o.step()
            o.zero_grad()
    assert opt.engines() == [engine_of(model)]
    assert set(opt.state_tiers.values()) == {"host"}
    with infinity.materialized(model):
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a.detach(), b.detach()), n
    opt.close()
    infinity.unwrap(model)
