"""The engine as a facade: one resolver of "auto" tiers, hooks reaching the step machine
through weak references, and no runtime module below the engine importing it."""
from __future__ import annotations

import ast
import copy
import gc
import pathlib
import pickle

import pytest
import torch
from torch import nn

import infinity
from infinity.policy import OffloadPolicy
from infinity.runtime.build.placement import resolve_placement
from infinity.tiers.tier import resolve_optimizer_tier
from infinity.runtime.core.registry import engine_of
from infinity.runtime.step.hooks import WeakHook
from infinity.tiers import Tier

RUNTIME = pathlib.Path(infinity.__file__).parent / "runtime"
CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_auto_tiers_resolve_in_one_place(tmp_path):
    policy = OffloadPolicy(nvme_path=str(tmp_path), host_budget=1 << 20, placement=None)
    small = resolve_placement(policy, CPU, 1 << 10, 3, sharded=False)
    assert (small.param, small.grad, small.blocks) == (Tier.HOST, Tier.HOST, (Tier.HOST,) * 3)
    big = resolve_placement(policy, CPU, 1 << 30, 3, sharded=False)
    assert (big.param, big.grad, big.blocks) == (Tier.NVME, Tier.NVME, (Tier.NVME,) * 3)
    split = resolve_placement(OffloadPolicy(nvme_path=str(tmp_path), param_tier="nvme",
                                            host_blocks=2, placement=None),
                              CPU, 1 << 10, 3, sharded=False)
    assert split.blocks == (Tier.HOST, Tier.HOST, Tier.NVME)
    on_device = resolve_placement(OffloadPolicy(device_budget=1 << 20, placement=None), CUDA,
                                  1 << 10, 1, sharded=False)
    assert on_device.param is Tier.DEVICE and on_device.grad is Tier.HOST


def test_placement_refusals_name_the_remedy(tmp_path):
    policy = OffloadPolicy(nvme_path=str(tmp_path), param_tier="nvme", host_blocks=4,
                           placement=None)
    with pytest.raises(ValueError, match="at most 3"):
        resolve_placement(policy, CPU, 1 << 10, 3, sharded=False)
    with pytest.raises(ValueError, match="shard=zero1/2/3 is not built"):
        resolve_placement(policy, CPU, 1 << 10, 8, sharded=True)


def test_optimizer_tier_resolver(tmp_path):
    path = str(tmp_path)
    assert resolve_optimizer_tier("auto", None, False, False) is Tier.HOST
    assert resolve_optimizer_tier(None, path, True, True) is Tier.HOST
    assert resolve_optimizer_tier(None, path, True, False) is Tier.NVME
    assert resolve_optimizer_tier("auto", path, False, True) is Tier.NVME  # no budget set
    assert resolve_optimizer_tier("host", path, False, False) is Tier.HOST
    assert resolve_optimizer_tier("nvme", None, True, True) is Tier.NVME


class _Handlers:
    def __init__(self) -> None:
        self.blocks = []
        self.calls = []

    def on_model_pre_forward(self, module, args) -> str:
        self.calls.append(args)
        return "called"


def test_weak_hook_calls_a_bound_method_and_lets_its_owner_go():
    handlers = _Handlers()
    hook = WeakHook(handlers.on_model_pre_forward)
    assert hook(None, (1,)) == "called" and handlers.calls == [(1,)]
    assert copy.deepcopy(hook)(None, (2,)) is None  # a copy is a no-op
    assert pickle.loads(pickle.dumps(hook))(None, (3,)) is None
    assert handlers.calls == [(1,)]
    del handlers
    gc.collect()
    assert hook(None, (4,)) is None


def test_a_wrapped_model_deepcopies_unwrapped_and_refuses_pickling():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    infinity.wrap(model, placement=None, param_tier="host")
    try:
        clone = copy.deepcopy(model)
        assert engine_of(clone) is None
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(model)
    finally:
        infinity.unwrap(model)


def test_no_runtime_module_imports_the_engine():
    importers = []
    for path in RUNTIME.rglob("*.py"):
        depth = len(path.relative_to(RUNTIME).parts)  # 1: runtime/x.py, 2: runtime/sub/x.py
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == depth \
                    and (node.module == "engine"
                         or (node.module is None and any(a.name == "engine"
                                                         for a in node.names))):
                importers.append(path.name)
    # the package's face, and the optimizer's port, which sits above the engine it wraps
    assert sorted(importers) == ["__init__.py", "port.py"]


def _methods(cls_name: str, path: pathlib.Path) -> int:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
    raise AssertionError(cls_name)


def test_the_engine_and_its_objects_stay_small():
    assert len((RUNTIME / "engine.py").read_text().splitlines()) <= 330
    assert _methods("Engine", RUNTIME / "engine.py") <= 25
    for cls, file in [("BlockGroup", "step/group.py"), ("StepHooks", "step/machine.py"),
                      ("OutsideWrites", "step/outside.py"), ("RowHooks", "step/row_hooks.py"),
                      ("Sizing", "build/sizes.py"), ("HomeFiller", "build/fill.py")]:
        assert _methods(cls, RUNTIME / file) <= 25, cls
