"""infinity.probe: measures, caches per machine, re-probes a cache from another machine."""
import json
import os
import time

import pytest

import infinity
from infinity.plan.probe import ProbeError, format_probe, probe


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    cache = str(d / "probe.json")
    first = probe(str(d), quick=True, cache=cache)
    return d, cache, first


def test_probe_measures_this_machine(cached):
    d, cache, r = cached
    assert not r.from_cache
    assert r.mem_bps > 1e8 and r.adam_params_per_s > 1e5 and r.adam8_params_per_s > 1e5
    assert r.flops and all(v > 1e6 for v in r.flops.values())
    assert set(r.flops_bf16) == set(r.flops) and all(v > 1e6 for v in r.flops_bf16.values())
    assert r.disk is not None and r.disk.read_bps > 1e6 and r.disk.write_bps > 1e6
    assert r.disk.free_bytes > 0 and r.disk.identity["dev"]
    assert not [f for f in os.listdir(d) if f.startswith(".infinity-probe")]  # test file gone
    text = format_probe(r)
    for row in ("memory bandwidth", "CPU Adam", "swap read / write", "swap free space"):
        assert row in text
    if r.identity["gpu"] is None:
        assert r.h2d_pinned_bps is None


def test_probe_uses_its_cache_on_the_same_machine(cached):
    d, cache, first = cached
    t0 = time.perf_counter()
    again = probe(str(d), quick=True, cache=cache)
    assert time.perf_counter() - t0 < 1.0
    assert again.from_cache and again.mem_bps == first.mem_bps
    assert again.disk.read_bps == first.disk.read_bps


def test_cache_from_another_machine_is_measured_again(cached, tmp_path):
    d, cache, first = cached
    with open(cache) as fh:
        data = json.load(fh)
    data["identity"]["cpu"] = "Some Other CPU 9000"
    data["identity_key"] = "0" * 16
    data["machine"]["mem_bps"] = 1.0  # a figure no real machine has
    other = str(tmp_path / "copied.json")
    with open(other, "w") as fh:
        json.dump(data, fh)
    r = probe(quick=True, cache=other)
    assert not r.from_cache and r.mem_bps > 1e8
    assert any("another machine" in n and "cpu" in n for n in r.notes)
    with open(other) as fh:  # the cache now describes this machine
        assert json.load(fh)["identity"] == r.identity


def test_missing_nvme_path_is_a_clear_error(tmp_path):
    with pytest.raises(ProbeError, match="not an existing directory"):
        probe(str(tmp_path / "nope"), quick=True, cache="")


def test_probe_cli(tmp_path, monkeypatch, capsys):
    from infinity.cli import main
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "c"))
    assert main(["probe", "--quick", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "swap read / write" in out and "(measured, quick)" in out
    assert main(["probe", "--quick", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_cache"] is True
    assert os.path.exists(tmp_path / "c" / "probe.json")
    assert infinity.probe is probe


def test_quick_probe_times_a_small_request_and_leaves_the_engine_out(cached):
    d, cache, r = cached
    assert r.disk.latency_s is not None and 0 < r.disk.latency_s < 1.0
    assert r.torch_adam_params_per_s > 1e5
    assert r.overhead == {} and r.disk.overhead == {}  # measured by the full probe only
    assert r.engine_overhead("nvme") == {"block_s": 0.0, "step_s": 0.0}
    again = type(r).from_json(json.loads(json.dumps(r.to_json())))
    assert again.disk.latency_s == r.disk.latency_s and again.overhead == r.overhead


def test_engine_overhead_is_measured_per_layout(tmp_path):
    from infinity.plan.probe import measure_engine_overhead
    out = measure_engine_overhead(["nvme"], nvme_path=str(tmp_path), quick=True, depths=(1, 2))
    assert set(out) == {"nvme"}
    for v in out.values():
        assert set(v) == {"block_s", "step_s"}
        assert all(0.0 <= x < 5.0 for x in v.values())
    assert os.listdir(tmp_path) == []  # its scratch folder is gone


def test_flops_at_takes_the_rate_of_the_compute_dtype(cached):
    import dataclasses

    import torch
    _, _, r = cached
    r = dataclasses.replace(r, flops={"128": 1e9, "512": 4e9},
                            flops_bf16={"128": 3e9, "512": 12e9})
    assert r.flops_at(128) == 1e9 and r.flops_at(128, torch.bfloat16) == 3e9
    assert r.flops_at(4096, torch.float16) == 12e9
    old = dataclasses.replace(r, flops_bf16={})  # a probe from before bf16 was measured
    assert old.flops_at(512, torch.bfloat16) == 4e9


def test_a_cache_without_the_bf16_rate_measures_it_once(tmp_path, cached):
    _, cache, _ = cached
    data = json.load(open(cache))
    data["machine"].pop("flops_bf16")
    stale = str(tmp_path / "old.json")
    json.dump(data, open(stale, "w"))
    r = probe(None, quick=True, cache=stale)
    assert r.from_cache and r.flops_bf16 and set(r.flops_bf16) == set(r.flops)
    assert "flops_bf16" in json.load(open(stale))["machine"]


def test_a_cache_or_result_from_a_newer_version_still_reads(tmp_path, cached):
    from infinity.plan.probe import ProbeResult
    _, cache, first = cached
    data = json.load(open(cache))
    data["machine"]["a_later_field"] = 1.0
    newer = str(tmp_path / "newer.json")
    json.dump(data, open(newer, "w"))
    r = probe(None, quick=True, cache=newer)
    assert r.from_cache and r.mem_bps == first.mem_bps
    saved = {**first.to_json(), "a_later_field": 2}
    saved["disk"] = {**saved["disk"], "another": 3}
    back = ProbeResult.from_json(saved)
    assert back.mem_bps == first.mem_bps and back.disk.read_bps == first.disk.read_bps


def test_compute_overlap_is_measured_by_a_full_disk_probe_and_read_back(tmp_path):
    """measure_disk times a disk transfer and a computation alone and together: the share
    hidden is a fraction; a quick probe leaves it out; an old cache without it reads as None,
    and the estimates then take none on a CPU, all on a GPU."""
    import dataclasses

    from infinity.plan.estimate import compute_overlap, side_by_side
    from infinity.plan.probe import measure_disk
    d = measure_disk(str(tmp_path), 8 << 20, reps=1)
    assert d.compute_overlap is not None and 0.0 <= d.compute_overlap <= 1.0
    assert measure_disk(str(tmp_path), 1 << 20, reps=1, overlap=False).compute_overlap is None
    r = probe(str(tmp_path), quick=True, cache=str(tmp_path / "probe.json"))
    assert r.disk.compute_overlap is None  # quick
    cpu = dataclasses.replace(r, device="cpu")
    assert compute_overlap(cpu) == 0.0
    assert compute_overlap(dataclasses.replace(r, device="cuda")) == 1.0
    measured = dataclasses.replace(cpu, disk=dataclasses.replace(r.disk, compute_overlap=0.25))
    assert compute_overlap(measured) == 0.25
    assert side_by_side(3.0, 1.0, 1.0) == 3.0 and side_by_side(3.0, 1.0, 0.0) == 4.0
    assert side_by_side(1.0, 3.0, 0.5) == 3.5
