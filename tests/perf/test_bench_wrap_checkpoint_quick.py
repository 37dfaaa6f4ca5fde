"""The wrap-memory and checkpoint benchmarks' --quick modes run, so they never rot."""
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _run(script, tmp_path, *extra):
    out = tmp_path / (script[:-3] + ".json")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick",
                        "--out", str(out), "--nvme-path", str(tmp_path), *extra],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    if HAVE_MPL:
        assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def test_bench_wrap_quick(tmp_path):
    data = _run("bench_wrap.py", tmp_path)
    rows = {row["case"]: row for row in data["rows"]}
    assert set(rows) == {"materialized", "meta"}
    for row in rows.values():
        assert row["native"], "the benchmark ran the pure-PyTorch fallbacks"
        assert row["model_bytes"] >= 4 * 19e6
        assert row["peak_median"] >= row["base_median"] > 0
        assert row["growth_x_median"] >= 0 and row["after_median"] > 0
    assert [p for p in os.listdir(tmp_path) if p.startswith("bench-wrap-")] == []  # cleaned up


def test_bench_checkpoint_quick(tmp_path):
    data = _run("bench_checkpoint.py", tmp_path, "--rounds", "2")
    rows = {row["config"]: row for row in data["rows"]}
    assert set(rows) == {"host", "nvme"}
    for row in rows.values():
        # fp32 parameters (their own master weights) + two Adam moments
        assert row["checkpoint_bytes"] >= 12 * data["params"]
        assert row["step_s_median"] > 0 and row["save_s_median"] > 0 and row["load_s_median"] > 0
        assert len(row["rounds"]) == 2
    assert [p for p in os.listdir(tmp_path) if p.startswith("bench-ckpt-")] == []
