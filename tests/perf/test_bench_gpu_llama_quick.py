"""benchmarks/bench_gpu_llama.py --quick (a tiny Llama config on this machine's device) runs both
sides in their own processes and writes their figures, so the GPU stage cannot rot."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_bench_gpu_llama_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_llama.py"),
                           str(tmp_path), "--quick"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "llama.json").read_text())
    for side in ("infinity", "resident"):
        assert data[side]["tokens_per_s"] > 0, data[side]
        assert math.isfinite(data[side]["loss"]), data[side]
    assert data["infinity"]["optimizer_states"]["8bit"]["params"] > 0
    assert data["tokens_per_s_ratio"] > 0
