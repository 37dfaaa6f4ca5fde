"""compute_dtype="auto" (runtime/build/dtypes.py): the choice per stored dtype from faked rates
(a CPU with fast bf16 keeps it, a CPU with slow bf16 computes in fp32, CUDA keeps the stored
dtype), explicit settings obeyed, the ranks' agreement, the quick check, and the probe-cache
reader (a full probe of this machine is read, a quick one or another machine's is not)."""
import json

import pytest
import torch

from infinity.api import probe_cache_rates
from infinity.plan.machine import key_of, machine_identity
from infinity.plan.probe import CACHE_VERSION
from infinity.policy import OffloadPolicy
from infinity.runtime.build import dtypes
from infinity.runtime.build.dtypes import CpuRates, Rates, agree, choose, quick_rates, summary

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # choose() only reads the device's type: no GPU needed
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def fake(fp32: float, narrow: float):
    asked = []

    def rates(dtype):
        asked.append(dtype)
        return Rates(fp32, narrow, "faked")

    rates.asked = asked
    return rates


def test_slow_bf16_cpu_computes_in_fp32():
    rates = fake(60e9, 1.5e9)  # an AVX2 CPU: no bf16 arithmetic
    got = choose("auto", CPU, [BF16, FP32], rates)
    assert got[BF16].compute == FP32 and got[FP32].compute == FP32
    assert "1.50 GFLOP/s" in got[BF16].reason and "60.00" in got[BF16].reason
    assert "compute_dtype=torch.bfloat16" in got[BF16].reason  # how to keep bf16
    assert rates.asked == [BF16]  # fp32 homes need no measurement


def test_fast_bf16_cpu_keeps_bf16():
    rates = fake(1.0e12, 6.0e12)  # AMX: several times faster than fp32
    got = choose("auto", CPU, [BF16], rates)
    assert got[BF16].compute == BF16
    assert "compute_dtype=torch.float32" in got[BF16].reason


def test_a_tie_keeps_the_stored_dtype_and_a_clear_loss_does_not():
    """Within the noise margin (FP32_WHEN_BELOW) the stored dtype stays: half the memory."""
    at = dtypes.FP32_WHEN_BELOW
    assert choose("auto", CPU, [FP16], fake(100.0, 100.0 * at * 1.01))[FP16].compute == FP16
    assert choose("auto", CPU, [FP16], fake(100.0, 100.0 * at * 0.99))[FP16].compute == FP32


def test_cuda_keeps_the_stored_dtype_without_measuring():
    rates = fake(1.0, 1e-3)  # would say fp32 if it were asked
    got = choose("auto", CUDA, [BF16, FP16, FP32], rates)
    assert {d: c.compute for d, c in got.items()} == {BF16: BF16, FP16: FP16, FP32: FP32}
    assert rates.asked == []
    assert "CUDA" in got[BF16].reason


@pytest.mark.parametrize("setting", [FP32, BF16, FP16])
def test_an_explicit_dtype_is_obeyed_everywhere(setting):
    rates = fake(1.0, 1e6)
    for device in (CPU, CUDA):
        got = choose(setting, device, [BF16, FP32, FP16], rates)
        assert all(c.compute == setting for c in got.values())
    assert rates.asked == []


def test_none_computes_each_dtype_as_stored():
    got = choose(None, CPU, [BF16, FP32], fake(1e12, 1.0))
    assert {d: c.compute for d, c in got.items()} == {BF16: BF16, FP32: FP32}


def test_summary_names_the_setting_the_choice_and_why():
    got = choose("auto", CPU, [BF16, FP32], fake(60e9, 1e9))
    s = summary("auto", got)
    assert s["setting"] == "auto"
    assert s["chosen"] == {"bfloat16": "float32", "float32": "float32"}
    assert "GFLOP/s" in s["why"]["bfloat16"]
    assert summary(BF16, choose(BF16, CPU, [BF16]))["setting"] == "bfloat16"


def test_policy_default_is_auto_and_bad_values_are_refused():
    assert OffloadPolicy().compute_dtype == "auto"
    for ok in ("auto", None, FP32, BF16, FP16):
        OffloadPolicy(compute_dtype=ok)
    for bad in ("bf16", "float32", torch.int8, torch.float64, 16):
        with pytest.raises(ValueError, match="infinity: compute_dtype"):
            OffloadPolicy(compute_dtype=bad)


def test_ranks_agree_on_fp32_when_any_rank_measured_slow():
    mine = choose("auto", CPU, [BF16, FP32], fake(1e12, 6e12))  # this rank: bf16 fast
    assert mine[BF16].compute == BF16
    seen = []

    def other_rank_says_fp32(v):
        seen.append(v)
        return 1.0

    got = agree(mine, "auto", CPU, other_rank_says_fp32)
    assert got[BF16].compute == FP32 and "another rank" in got[BF16].reason
    assert got[FP32] is mine[FP32] and seen == [0.0]  # one reduction: the narrow dtype
    assert agree(mine, "auto", CPU, lambda v: v)[BF16].compute == BF16  # all alike: kept
    calls = []
    assert agree(mine, BF16, CPU, calls.append) is mine and calls == []  # explicit: no call
    assert agree(mine, "auto", CUDA, calls.append) is mine and calls == []


def test_quick_check_measures_both_dtypes_and_restores_the_threads():
    threads = torch.get_num_threads()
    r = quick_rates(BF16, n=64)
    assert r.fp32 > 0 and r.narrow > 0 and "quick check" in r.source
    assert torch.get_num_threads() == threads


def test_rates_ask_readers_first_then_check_once_per_dtype(monkeypatch):
    checks = []

    def counted(dtype):
        checks.append(dtype)
        return Rates(2.0, 1.0, "checked")

    monkeypatch.setattr(dtypes, "quick_rates", counted)
    src = CpuRates()
    assert src(BF16).source == "checked" and src(BF16).source == "checked"
    assert checks == [BF16]  # kept for the process
    src.add_reader(lambda d: Rates(1.0, 5.0, "cache") if d == BF16 else None)
    assert src(BF16).source == "cache"
    assert src(FP16).source == "checked" and checks == [BF16, FP16]

    def broken(dtype):
        raise KeyError("a cache of another format")

    src2 = CpuRates()
    src2.add_reader(broken)
    assert src2(BF16).source == "checked"  # a failing reader: the quick check decides


def _cache(tmp_path, monkeypatch, *, quick: bool, device: str = "cpu", identity=None):
    ident = machine_identity() if identity is None else identity
    machine = {"quick": quick, "measured_at": 0.0, "mem_bps": 1e10, "adam_params_per_s": 1e9,
               "adam8_params_per_s": 1e9, "device": device,
               "flops": {"128": 5e10, "2048": 8e10}, "flops_bf16": {"128": 4e9, "2048": 2e9}}
    data = {"version": CACHE_VERSION, "identity": ident, "identity_key": key_of(ident),
            "disks": {}, "machine": machine}
    (tmp_path / "probe.json").write_text(json.dumps(data))
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path))


def test_probe_cache_reader_takes_a_full_probe_of_this_cpu(tmp_path, monkeypatch):
    _cache(tmp_path, monkeypatch, quick=False)
    r = probe_cache_rates(BF16)
    assert r is not None and (r.fp32, r.narrow) == (8e10, 2e9)  # the widest width: 2048
    assert "probe cache" in r.source and "2048" in r.source
    assert probe_cache_rates(FP16) is None  # the probe measures no fp16 rate


@pytest.mark.parametrize("case", ["quick", "cuda", "other machine", "missing"])
def test_probe_cache_reader_leaves_other_caches_to_the_quick_check(tmp_path, monkeypatch, case):
    if case == "missing":
        monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path))
    else:
        other = dict(machine_identity(), cpu="another CPU") if case == "other machine" else None
        _cache(tmp_path, monkeypatch, quick=case == "quick",
               device="cuda" if case == "cuda" else "cpu", identity=other)
    assert probe_cache_rates(BF16) is None
