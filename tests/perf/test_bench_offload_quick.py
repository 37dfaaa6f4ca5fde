"""The offload forward benchmark's --quick mode runs, so it never rots."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_offload_forward_quick(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_offload_forward.py"),
                        "--quick", "--out", str(out), "--nvme-path", str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    configs = {row["config"]: row for row in data["results"]}
    assert set(configs) == {"in_memory", "in_memory_keep", "host", "nvme"}
    assert all(row["ratio_vs_best_plain"] > 0 for row in data["results"])
    assert configs["nvme"]["page_faults_median"] >= 0
    assert configs["nvme"]["bytes_moved_per_step"] > 0
    assert all(row["step_s_median"] > 0 for row in data["results"])
