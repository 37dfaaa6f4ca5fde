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
