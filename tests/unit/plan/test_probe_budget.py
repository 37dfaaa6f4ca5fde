"""The probe in about a minute: each dtype's layer timing stops at its time budget and says
what it left out; a thorough probe times everything; estimate and the planner announce a
probe they start instead of measuring silently. The layer timing is faked (a dtype ~100x
slower than fp32), so these tests take seconds."""
import dataclasses
import importlib
import logging
import time

import pytest
import torch

from infinity.plan.probe import (
    FULL,
    FULL_SHAPES,
    format_probe,
    layer_flops,
    measure_compute_budgeted,
    probe,
)

probe_mod = importlib.import_module("infinity.plan.probe")  # infinity.plan.probe: the function
FP32_RATE, BF16_RATE = 40e9, 0.4e9  # FLOP/s: bf16 100x slower, as on an AVX2 CPU


def fake_time_layer(d_model, batch, seq, device, dtype, *args):
    rate = BF16_RATE if dtype == torch.bfloat16 else FP32_RATE
    return layer_flops(d_model, batch * seq, seq) / rate


@pytest.fixture
def fake_layers(monkeypatch):
    calls = []

    def timed(d_model, batch, seq, device, dtype, *args):
        calls.append((d_model, dtype))
        return fake_time_layer(d_model, batch, seq, device, dtype)

    monkeypatch.setattr(probe_mod, "time_layer", timed)
    return calls


@pytest.fixture
def small_full(monkeypatch):
    """The full probe's settings and budgets with small buffers and no engine timing: the
    budget logic of a full probe in a second or two."""
    small = dataclasses.replace(
        FULL, mem_bytes=1 << 20, adam_numel=1 << 14, torch_adam_numel=1 << 14, overhead=False
    )
    monkeypatch.setattr(probe_mod, "FULL", small)
    monkeypatch.setattr(probe_mod, "THOROUGH", dataclasses.replace(
        small, fp32_budget_s=None, bf16_budget_s=None, long_call_s=float("inf")))
    return small


def test_a_slow_dtype_stops_at_its_budget_and_says_so(fake_layers):
    got = measure_compute_budgeted(
        FULL_SHAPES, torch.device("cpu"), dtype=torch.bfloat16, budget_s=15.0,
        reference={"128": FP32_RATE, "256": FP32_RATE},
    )
    # d=128 (0.33 GFLOP: 1 s at 0.4 GFLOP/s) and d=256 (2.6 GFLOP x 3 calls: 20 s) -> d=256
    # would run past 15 s: only d=128 is timed, the widths after it are named
    assert list(got.rates) == ["128"]
    assert fake_layers == [(128, torch.bfloat16)]
    assert got.rates["128"] == pytest.approx(BF16_RATE)  # what it reports is measured
    assert got.cut_short is not None
    assert "256, 512, 1024, 2048 not timed" in got.cut_short
    assert "15 s budget" in got.cut_short and "1% of fp32's rate" in got.cut_short


def test_a_fast_dtype_is_timed_at_every_width(fake_layers):
    got = measure_compute_budgeted(FULL_SHAPES, torch.device("cpu"), budget_s=15.0)
    assert got.cut_short is None
    assert sorted(map(int, got.rates)) == [d for d, _, _ in FULL_SHAPES]
    assert all(r == pytest.approx(FP32_RATE) for r in got.rates.values())


def test_the_budget_counts_the_time_spent(monkeypatch):
    """Widths whose timing took longer than their FLOPs say (a loaded machine) stop the dtype
    when the seconds spent reach the budget."""
    def slow(d_model, batch, seq, device, dtype, *args):
        time.sleep(0.3)
        return 1e-3  # a rate so high that the projection alone never stops it

    monkeypatch.setattr(probe_mod, "time_layer", slow)
    t0 = time.perf_counter()
    got = measure_compute_budgeted(FULL_SHAPES, torch.device("cpu"), budget_s=0.5)
    assert time.perf_counter() - t0 < 1.5
    assert list(got.rates) == ["128", "256"]
    assert "512, 1024, 2048 not timed" in got.cut_short


def test_long_calls_are_timed_once_short_ones_more_often(monkeypatch):
    calls = []

    def median(fn, reps, warmup=1):
        calls.append(reps)
        return 1.0

    monkeypatch.setattr(probe_mod, "_median_time", median)
    # a real, tiny layer: its warm-up call is short, and long only when long_call_s is 0
    probe_mod.time_layer(32, 1, 8, torch.device("cpu"), torch.float32, reps=3)
    probe_mod.time_layer(32, 1, 8, torch.device("cpu"), torch.float32, reps=3, long_call_s=0.0)
    # and a short one as often as fills short_call_s, at most 8 times
    probe_mod.time_layer(32, 1, 8, torch.device("cpu"), torch.float32, reps=3, short_call_s=60)
    assert calls == [3, 1, 8]


def test_the_disk_layouts_reuse_the_plain_models_timed_for_the_machine(monkeypatch):
    timed = []

    def step_s(n_layers, layout, nvme_path, warmup, steps):
        timed.append((n_layers, layout))
        return 0.01 * n_layers + (0.002 * (n_layers + 1) if layout else 0.0)

    monkeypatch.setattr(probe_mod, "_tiny_step_s", step_s)
    plain = {}
    host = probe_mod.measure_engine_overhead(["host"], plain=plain)
    assert timed == [(2, None), (10, None), (2, "host"), (10, "host")]
    assert plain == {2: 0.02, 10: 0.1}
    timed.clear()
    disk = probe_mod.measure_engine_overhead(["nvme"], plain=plain)
    assert timed == [(2, "nvme"), (10, "nvme")]  # the plain models are not timed again
    for got in (host["host"], disk["nvme"]):
        assert got["block_s"] == pytest.approx(0.002) and got["step_s"] == pytest.approx(0.0)


def test_a_full_probe_marks_the_cut_figure(fake_layers, small_full, tmp_path):
    r = probe(None, cache=str(tmp_path / "probe.json"), progress=False)
    assert not r.quick and not r.from_cache
    assert sorted(map(int, r.flops)) == [d for d, _, _ in FULL_SHAPES]  # fp32 is all there
    # d=256 would be timed once after its warm-up (a call of 6.6 s: "long"), 13 s, and x 1.6
    # (a wider layer may run slower) past the 20 s budget
    assert list(r.flops_bf16) == ["128"]
    assert set(r.cut_short) == {"flops_bf16"} and "not timed" in r.cut_short["flops_bf16"]
    assert r.flops_at(4096, torch.bfloat16) == pytest.approx(BF16_RATE)  # the widest timed
    assert "cut short: bfloat16 layers of d_model 256, 512, 1024, 2048 not timed" in format_probe(r)
    again = probe(None, cache=str(tmp_path / "probe.json"), progress=False)
    assert again.from_cache and again.cut_short == r.cut_short  # the mark is cached too


def test_an_estimate_at_a_width_the_probe_cut_says_so(fake_layers, small_full, tmp_path):
    from infinity.plan import estimate
    r = probe(None, cache="", progress=False)
    assert r.rate_caveat(128, torch.bfloat16) is None  # measured
    assert r.rate_caveat(4096) is None  # fp32 was timed at every width
    caveat = r.rate_caveat(4096, torch.bfloat16)
    assert caveat is not None and "bf16 rate for d_model 128" in caveat
    bf16 = estimate("1B", d_model=4096, probe=r, dtype=torch.bfloat16)
    assert caveat in bf16.notes
    assert not any("widest it timed" in n for n in estimate("1B", d_model=4096, probe=r).notes)


def test_a_thorough_probe_times_every_width(fake_layers, small_full, tmp_path):
    cache = str(tmp_path / "probe.json")
    probe(None, cache=cache, progress=False)  # a budgeted full probe in the cache ...
    r = probe(None, cache=cache, progress=False, thorough=True)  # ... is not thorough
    assert not r.from_cache and r.cut_short == {}
    assert sorted(map(int, r.flops_bf16)) == [d for d, _, _ in FULL_SHAPES]
    with pytest.raises(ValueError, match="quick and thorough"):
        probe(None, cache="", quick=True, thorough=True)


def test_each_stage_shows_a_progress_bar_on_stderr(fake_layers, small_full, capsys):
    probe(None, cache="", progress=True)
    err = capsys.readouterr().err
    for stage in ("memory and optimizers", "GPT layer fp32", "GPT layer bf16"):
        assert f"infinity probe: {stage}" in err
    probe(None, cache="", progress=False)
    assert "infinity probe:" not in capsys.readouterr().err


# ---- estimate and the planner announce a probe ----------------------------------------------
@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "probe.json"


@pytest.fixture
def canned_machine(monkeypatch, caplog):
    """_measure_machine answers at once with fixed figures, and records whether the
    announcement was logged before it started."""
    seen = []

    def measured(settings, show=False, plain=None):
        seen.append((settings.quick, [r.getMessage() for r in caplog.records]))
        return {"quick": settings.quick, "measured_at": time.time(), "mem_bps": 1e10,
                "adam_params_per_s": 1e9, "adam8_params_per_s": 2e8, "device": "cpu",
                "flops": {"128": 2e10}, "flops_bf16": {"128": 4e8},
                "cut_short": {"flops_bf16": "bfloat16 layers of d_model 256 not timed"},
                "torch_adam_params_per_s": 1e8, "overhead": {}}

    monkeypatch.setattr(probe_mod, "_measure_machine", measured)
    return seen


def test_estimate_announces_the_full_probe_it_starts(empty_cache, canned_machine, caplog):
    from infinity.plan import estimate
    with caplog.at_level(logging.WARNING, logger="infinity"):
        estimate("125M")
    assert len(canned_machine) == 1
    quick, before = canned_machine[0]
    assert not quick
    said = [m for m in before if m.startswith("infinity.estimate: no probe of this machine")]
    assert said, "estimate started a probe without saying so"
    assert "full probe (about half a minute" in said[0] and str(empty_cache) in said[0]
    assert "`infinity probe` measures it ahead" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infinity"):
        estimate("125M")  # cached now: nothing measured, nothing said
    assert len(canned_machine) == 1 and not caplog.records


def test_the_planner_announces_its_quick_probe_and_how_rough_it_is(empty_cache,
                                                                   canned_machine, caplog):
    from infinity.plan import plan
    with caplog.at_level(logging.WARNING, logger="infinity"):
        plan(int(1e6))
    (quick, before), = canned_machine
    assert quick
    said = [m for m in before if m.startswith("infinity planner: no probe of this machine")]
    assert said, "the planner started a probe without saying so"
    assert "quick probe (a few seconds)" in said[0]
    assert "narrow layers" in said[0] and "too slow" in said[0]  # its accuracy


def test_estimate_cli_announces_the_probe_before_its_answer(empty_cache, canned_machine, caplog,
                                                    capsys):
    from infinity.cli import main
    with caplog.at_level(logging.WARNING, logger="infinity"):
        assert main(["estimate", "125M"]) == 0
    assert any(m.startswith("infinity estimate: no probe of this machine")
               for m in canned_machine[0][1])
    assert "step" in capsys.readouterr().out  # and then its answer


def test_the_probe_command_does_not_warn_about_itself(empty_cache, canned_machine, caplog):
    from infinity.cli import main
    with caplog.at_level(logging.WARNING, logger="infinity"):
        assert main(["probe", "--no-progress"]) == 0
    assert len(canned_machine) == 1 and not caplog.records
