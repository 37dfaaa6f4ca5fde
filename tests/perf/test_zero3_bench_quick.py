"""bench_zero3 --quick runs (1 and 2 ranks), so it never rots."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_zero3_quick(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_zero3.py"),
                        "--quick", "--out", str(out), "--nvme-path", str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {row["world"]: row for row in data["results"]}
    assert set(rows) == {1, 2}
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    assert rows[2]["all_gather_s_per_step"] > 0 and rows[2]["reduce_scatter_bytes_per_step"] > 0
    assert max(rows[2]["host_bytes_per_rank"]) < rows[1]["host_bytes_per_rank"][0]
    assert (tmp_path / "bench.png").exists()


def test_bench_zero3_step_in_backward_quick(tmp_path):
    """--micro: accumulate then step ("after") against the step in backward ("inside"), on NVMe:
    each rank writes gradients only in the first."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_zero3.py"),
                        "--quick", "--worlds", "2", "--micro", "2", "--tier", "nvme",
                        "--out", str(out), "--nvme-path", str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"after", "inside"}
    for rank in range(2):
        assert rows["after"]["nvme_per_step_per_rank"][rank]["grads_written"] > 0
        assert rows["inside"]["nvme_per_step_per_rank"][rank]["grads_written"] == 0
        assert rows["inside"]["nvme_per_step_per_rank"][rank]["states_written"] > 0
