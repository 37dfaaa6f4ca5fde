"""Snapshots of a model's weights and an optimizer's states, compared exactly (the chunked
NVMe step's tests)."""
from __future__ import annotations

from typing import Any, Dict

import torch


def weights(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def states(opt) -> Dict[Any, Dict[str, torch.Tensor]]:
    sd = opt.state_dict()
    return {i: {k: t.clone() for k, t in e.items() if isinstance(t, torch.Tensor)}
            for i, e in sd["state"].items()}


def assert_equal(a: Dict, b: Dict) -> None:
    """Nested dicts of tensors, bitwise."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_equal(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k
