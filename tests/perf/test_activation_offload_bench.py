"""The activation offload benchmark's --quick mode runs, so it never rots."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_activation_offload_quick(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                     "bench_activation_offload.py"),
                        "--quick", "--out", str(out), "--nvme-path", str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {row["config"]: row for row in data["results"]}
    assert set(rows) == {"none", "host", "nvme"}
    for tier in ("host", "nvme"):
        assert rows[tier]["same_losses_as_none"]
        assert rows[tier]["offloaded_bytes_per_step"] > 0
    assert rows["nvme"]["fetched_bytes_per_step"] == rows["nvme"]["offloaded_bytes_per_step"]
    assert (tmp_path / "bench.png").exists()
