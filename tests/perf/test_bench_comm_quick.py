"""bench_comm_compression --quick runs (2 ranks, full width and int8 weights + int4
gradients with error feedback), so it never rots."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_comm_compression_quick(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                     "bench_comm_compression.py"),
                        "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    conv = {row["comm"]: row for row in data["convergence"]}
    assert set(conv) == {"none", "int4+ef"}
    assert len(conv["none"]["losses"]) == 6
    assert conv["int4+ef"]["drift_vs_none"]["max_abs"] > 0
    ratios = {row["comm"]: row["ratio"] for row in data["bytes"]}
    assert ratios["none"]["all_gather"] == 1.0
    assert ratios["int4+ef"]["all_gather"] <= 0.27
    assert ratios["int4+ef"]["reduce_scatter"] <= 0.14
    assert (tmp_path / "bench.png").exists()
