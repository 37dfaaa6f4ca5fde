"""The GPU projection of layer-major accumulation (--quick) runs, and shows what the cost model
says: with parameters on NVMe the plain loop's GPU-busy share stays low as the micro-batches
grow while layer-major's rises; with parameters on host layer-major only adds recomputation."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_project_layer_major_gpu_quick(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                     "project_layer_major_gpu.py"),
                        "--quick", "--json", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {(x["machine"], x["placement"], x["k"], x["schedule"]): x
            for x in json.loads(out.read_text())["rows"]}
    for m in ("h200", "pcie4_24gb"):
        plain, lm = rows[(m, "nvme_8bit", 8, "plain")], rows[(m, "nvme_8bit", 8, "layer_major")]
        assert lm["useful_busy_share"] > plain["busy_share"]
        assert lm["nvme_gb_per_step"] < plain["nvme_gb_per_step"] / 3
        assert lm["nvme_gb_per_step"] == rows[(m, "nvme_8bit", 1, "layer_major")][
            "nvme_gb_per_step"]
        host_plain, host_lm = rows[(m, "host", 8, "plain")], rows[(m, "host", 8, "layer_major")]
        assert host_lm["compute_s"] > host_plain["compute_s"]
