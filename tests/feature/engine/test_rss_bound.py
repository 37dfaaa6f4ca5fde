"""The host budget's promise, checked (runtime/process/rss_bound.py): with a ``host_budget`` on
a CPU device, after the first backward the peak RSS (VmHWM) is compared once with RSS at wrap
+ host_budget + 0.5 GiB; over it, one warning names the figures and the remedies, and
``infinity.stats(model)["rss_check"]`` holds them.

The model: 12 layers ``x * w`` (w of 1024 features), so what autograd saves is one
rows x 1024 fp32 tensor per layer and the compute is small; each case runs in a fresh
interpreter (its own VmHWM)."""
from __future__ import annotations

import logging

import pytest
import torch
from rss_helpers import run_rss_child
from torch import nn

import infinity
from infinity.runtime.process import rss_bound
from infinity.runtime.process.rss_bound import SLACK, ProcessMemory, RssBound

MIB = 1 << 20
BUDGET = 64 * MIB
LARGE_ROWS = 14000  # 12 x 14000 x 1024 x 4 = 688 MB saved in forward: peak ~0.85 GiB over wrap
SMALL_ROWS = 256  # 12.6 MB saved

_CHILD = r"""
import json, logging, sys, torch, infinity
from torch import nn

records = []


class Catch(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))


logging.getLogger("infinity.runtime.process.rss_bound").addHandler(Catch())
D, N = 1024, 12


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x * self.w


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Scale() for _ in range(N))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


model = Net()
infinity.wrap(model, host_budget=int(sys.argv[2]), device="cpu")
x = torch.randn(int(sys.argv[1]), D)
model(x).sum().backward()
hwm = status("VmHWM")  # right after the first backward, as the check read it
after_first = list(records)
model.zero_grad()
model(x).sum().backward()  # training goes on; the check is not repeated
explain = infinity.explain(model, show=False)
print(json.dumps({"hwm": hwm, "after_first": after_first, "records": records,
                  "check": infinity.stats(model)["rss_check"],
                  "explain": explain.reasons[-1]}))
"""


@pytest.fixture(scope="module")
def large():
    return run_rss_child(_CHILD, str(LARGE_ROWS), str(BUDGET), timeout=300)


def test_activations_over_the_bound_warn_once_naming_the_figures_and_remedies(large):
    """Large batch: the peak is over RSS at wrap + budget + 0.5 GiB; exactly one warning
    (after the first backward, none after the second) naming the measured peak, the bound,
    the activations' estimate and the remedies; stats say over=True."""
    check = large["check"]
    assert check["over"] is True, check
    assert check["peak"] > check["bound"] == check["rss_at_wrap"] + BUDGET + SLACK, check
    saved = 12 * LARGE_ROWS * 1024 * 4
    assert 0.8 * saved < check["forward_growth"] < 1.3 * saved, check
    assert large["after_first"] == large["records"], large["records"]  # step 2: nothing new
    assert len(large["records"]) == 1, large["records"]
    level, message = large["records"][0]
    assert level == "WARNING"
    assert message.startswith("infinity: peak RSS ")
    for figure in (check["peak"], check["bound"], check["rss_at_wrap"], BUDGET,
                   check["forward_growth"]):
        assert f"{figure:,} bytes" in message, (figure, message)
    for remedy in ('activation_tier="nvme"', '"host"', "docs/activation_offload.md",
                   "smaller micro-batches", "infinity.accumulate"):
        assert remedy in message, (remedy, message)
    assert large["explain"].startswith("peak RSS ") and " over the host budget" in large["explain"]


def test_reported_peak_is_the_kernels_vmhwm(large):
    """The figures are real: the peak reported equals the VmHWM the child read right after
    its first backward, within 4 MiB."""
    assert abs(large["check"]["peak"] - large["hwm"]) <= 4 * MIB, large


def test_small_batch_stays_within_the_bound_without_warning():
    got = run_rss_child(_CHILD, str(SMALL_ROWS), str(BUDGET), timeout=300)
    check = got["check"]
    assert check["over"] is False and check["peak"] <= check["bound"], check
    assert got["records"] == [], got["records"]
    assert " within the host budget" in got["explain"], got["explain"]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_no_check_without_a_host_budget():
    model = infinity.wrap(_Net(), param_tier="host", grad_tier="host", optimizer_tier="host",
                          device="cpu")
    try:
        model(torch.randn(4, 8)).sum().backward()
        assert "rss_check" not in infinity.stats(model)
    finally:
        infinity.unwrap(model)


def test_a_peak_reached_before_wrap_is_not_the_engines(monkeypatch, caplog):
    """VmHWM is the process's: a peak from before wrap (VmHWM not grown since) is over the
    bound but not counted, and not warned about. A CUDA device or no /proc: no check."""
    gib = 1 << 30
    assert RssBound.watch(BUDGET, "cuda", ProcessMemory(gib, gib)) is None
    assert RssBound.watch(None, "cpu", ProcessMemory(gib, gib)) is None
    assert RssBound.watch(BUDGET, "cpu", None) is None
    check = RssBound.watch(BUDGET, "cpu", ProcessMemory(gib, 9 * gib))
    assert check is not None
    monkeypatch.setattr(rss_bound, "read_memory", lambda: ProcessMemory(gib, 9 * gib))
    with caplog.at_level(logging.WARNING, logger=rss_bound.__name__):
        check.backward_done()
    assert check.result is not None and check.result["over"] is False, check.result
    assert caplog.records == []
    assert "reached before wrap" in (check.describe() or "")
