"""`infinity bench --quick` (the CI smoke run of the end-to-end benchmark) and
`infinity estimate`."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pq = pytest.importorskip("pyarrow.parquet")


def test_bench_quick_writes_json_parquet_png_and_report(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ)  # the suite's probe cache (tests/conftest.py): no probe runs here
    proc = subprocess.run([sys.executable, "-m", "infinity", "bench", "--quick", "--report",
                           "--out", str(out), "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    rows = {r["placement"]: r for r in data["rows"]}
    assert data["config"]["warmup"] == 2 and data["config"]["repeats"] == 1
    for name in ("device", "host", "nvme", "planner"):
        r = rows[name]
        assert r["ok"], r
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["pred_step_s"] > 0
        # every measured step is kept; the figure is their median (warm-up steps apart)
        assert [len(ts) for ts in r["step_times_s"]] == [2]
        assert [len(ts) for ts in r["warmup_times_s"]] == [2]
        assert min(r["step_times_s"][0]) <= r["step_s"] <= max(r["step_times_s"][0])
        assert all(x is not None and x >= 0 for pair in r["loadavg"] for x in pair)
        assert r["peak_rss_bytes"] > r["rss_start_bytes"] > 0
        assert r["loss_last"] == r["loss_last"]  # not nan
    assert rows["nvme"]["nvme_bytes_per_step"] > 0 and rows["host"]["nvme_bytes_per_step"] == 0
    # the measured NVMe bytes per step are what the estimate predicted (4 KiB padding aside)
    assert rows["nvme"]["nvme_bytes_per_step"] == pytest.approx(
        rows["nvme"]["pred_nvme_bytes_per_step"], rel=0.25)
    assert rows["planner"]["planned"] in ("host", "optim_nvme", "nvme")
    assert "compute_s" in rows["nvme"] and "optimizer_s" in rows["nvme"]
    assert "DeepSpeed is not installed" in rows["deepspeed"]["skipped"] or \
        "not built" in rows["deepspeed"]["skipped"]
    # each run was appended to runs.jsonl as it finished (a ladder cut short keeps them)
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted(r["spec"]["placement"] for r in runs) == sorted(
        r["placement"] for r in data["rows"] if "step_s" in r)
    assert all(r["result"].get("ok") for r in runs)
    table = pq.read_table(out / "bench.parquet")
    assert table.num_rows == len(data["rows"])
    assert (out / "bench.png").stat().st_size > 1000
    assert "| size | placement | tokens/s |" in proc.stdout and "planner" in proc.stdout
    assert "Predicted within 30% of measured:" in proc.stdout and "Load average" in proc.stdout
    assert rows["nvme"]["states"] == "fp32" and rows["device"]["states"] == "torch"
    assert rows["nvme"]["pred_engine_s"] > 0 and rows["device"]["pred_engine_s"] == 0
    # --load reports on saved results without running anything
    again = subprocess.run([sys.executable, "-m", "infinity", "bench", "--load",
                            str(out / "bench.json")], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env=env)
    assert again.returncode == 0 and "| tiny | nvme |" in again.stdout


def test_estimate_cli(tmp_path, monkeypatch, capsys):
    from infinity.cli import main
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["estimate", "125M", "--quick-probe", "--nvme-path", str(tmp_path),
                 "--ranks", "2", "--plan", "--ram-budget", "3GiB"]) == 0
    out = capsys.readouterr().out
    assert "nvme_8bit" in out and "infinity plan:" in out and "why:" in out
    assert main(["estimate", "many", "--quick-probe"]) == 1
    assert "not a parameter count" in capsys.readouterr().err
    assert main(["estimate", "2B", "--quick-probe", "--nvme-path", str(tmp_path),
                 "--plan", "--ram-budget", "1MiB"]) == 1
    assert "cannot hold the largest block" in capsys.readouterr().err


def test_bench_states_apply_to_every_infinity_placement(tmp_path, monkeypatch):
    from infinity.bench import BenchConfig, run_bench
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    cfg = BenchConfig(sizes=["tiny"], placements=["nvme", "nvme_bf16"], planner=False,
                      batch=2, seq=16, steps=1, warmup=1, repeats=1, nvme_path=str(tmp_path),
                      quick_probe=True, states="8bit", calibrate=False)
    result = run_bench(cfg)
    rows = {r["placement"]: r for r in result["rows"]}
    nvme = rows["nvme"]
    assert nvme["ok"], nvme
    assert nvme["states"] == "8bit" and result["config"]["states"] == "8bit"
    # measured with 8-bit moments: the bytes written per step are the 8-bit placement's
    assert nvme["nvme_bytes_per_step"] == pytest.approx(nvme["pred_nvme_bytes_per_step"],
                                                        rel=0.25)
    assert "not run twice" in rows["nvme_bf16"]["skipped"]
    with pytest.raises(ValueError, match="--states must be"):
        run_bench(BenchConfig(sizes=["tiny"], states="fp8", nvme_path=str(tmp_path)))
