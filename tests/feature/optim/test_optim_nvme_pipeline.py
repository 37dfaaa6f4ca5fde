"""The NVMe state pipeline's depth (buffer sets, read-ahead) changes no bit of a step, respects
the host budget, and its benchmark runs."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from test_optim import _model, _train

import infinity
from infinity.optim.states import swapper

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_choose_sets_depth_and_budget():
    mib = 1 << 20
    assert swapper.choose_sets(200 * mib, None) == 3                  # default: 1 ahead
    assert swapper.choose_sets(200 * mib, None, read_ahead=4) == 6
    assert swapper.choose_sets(1, None, read_ahead=100) == swapper.MAX_SETS
    # with a budget, extra sets take at most half of what is left; never fewer than 3
    assert swapper.choose_sets(10 * mib, 80 * mib, read_ahead=8) == 4
    assert swapper.choose_sets(10 * mib, 0, read_ahead=8) == 3


def _states(opt):
    out = {}
    for s in opt.state_dicts.shard_states():
        out[s.key] = torch.cat([s.master, s.exp_avg, s.exp_avg_sq]).clone()
    return out


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_pipeline_depth_changes_no_bit(tmp_path, monkeypatch, fmt):
    base = _model()
    results = []
    for sets in (3, 7):
        monkeypatch.setattr(swapper, "choose_sets", lambda *_a, n=sets: n)
        model = copy.deepcopy(base)
        (tmp_path / f"s{sets}").mkdir()
        infinity.wrap(model, nvme_path=str(tmp_path / f"s{sets}"), param_tier="nvme",
                      grad_tier="nvme", optimizer_tier="nvme")
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, states=fmt)
        losses = _train(model, opt, 3)
        assert next(iter(opt.core.wrapped.sets())).count == sets
        results.append((losses, _states(opt)))
        opt.close()
        infinity.unwrap(model)
    (l3, s3), (l7, s7) = results
    assert l3 == l7
    assert s3.keys() == s7.keys()
    for key in s3:
        assert torch.equal(s3[key], s7[key]), key


def test_pipeline_sets_fit_the_host_budget(tmp_path):
    model = _model()
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme",
                  host_budget=64 << 20)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    engine = infinity.runtime.engine_of(model)
    sets = next(iter(opt.core.wrapped.sets()))
    assert sets.count >= 3
    assert engine.host_budget.used <= 64 << 20
    opt.close()
    infinity.unwrap(model)


def test_bench_nvme_step_quick(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_nvme_step.py"),
                           "--quick", "--nvme-path", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["states"]: r for r in res["rows"]}
    assert {"fp32", "8bit"} <= rows.keys()
    for r in rows.values():
        assert r["step_s"] > 0 and r["disk_s"] > 0 and r["read_bw"] > 0 and r["write_bw"] > 0
        assert r["mixed_s"] > 0 and r["disk_file_s"] > 0
        for m in r["samples"]:  # the attribution adds up to the step's wall time
            parts = (m["read_wait_s"] + m["write_wait_s"] + m["compute_s"] + m["verify_s"]
                     + m["other_s"])
            assert parts == pytest.approx(m["step_s"], rel=1e-6) or m["other_s"] == 0.0
            assert m["compute_s"] > 0 and m["crc_s"] > 0  # Adam ran; checksums were made
            assert 0 <= m["disk_idle_s"] <= m["step_s"]
            assert m["both_busy_s"] <= min(m["read_busy_s"], m["write_busy_s"]) + 1e-9
    fp32, q8 = rows["fp32"], rows["8bit"]
    # 8-bit moments: at least 40% fewer NVMe bytes per step (a byte count, not a timing)
    moved = lambda r: r["bytes_read"] + r["bytes_written"]  # noqa: E731
    assert moved(q8) <= 0.6 * moved(fp32)
