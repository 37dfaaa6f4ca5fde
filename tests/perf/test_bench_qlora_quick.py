"""benchmarks/bench_qlora.py --quick runs (the real 128k vocabulary at a tiny width, NF4 base
against a bf16 base) and its figures hold together: the frozen layer bytes per step are whole
fetches of the stored flats, fewer for NF4 than for bf16, and peak RSS stays within its bound."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_qlora_quick(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_qlora.py"),
                           "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    nf4, bf16 = result["formats"]["nf4"], result["formats"]["bfloat16"]
    for r in (nf4, bf16):
        check = r["layer_bytes_check"]
        assert check["remainder"] == 0 and check["all_layers_same_size"]
        assert check["layer_fetches"] >= 2  # every layer read at least once per step
        assert r["within_bound"], r
    assert nf4["layer_bytes_check"]["category"] == "frozen.layer.nf4"
    assert bf16["layer_bytes_check"]["category"] == "frozen.layer.bfloat16"
    assert nf4["layer_bytes_check"]["layer_fetches"] == bf16["layer_bytes_check"]["layer_fetches"]
    per_nf4 = nf4["layer_bytes_check"]["stored_bytes_per_layer"]
    per_bf16 = bf16["layer_bytes_check"]["stored_bytes_per_layer"]
    assert per_nf4 < 0.3 * per_bf16 + 4096  # 0.5625 vs 2 bytes per element, page padding
    # embeddings and head stay bf16 in both runs: the same bytes
    assert nf4["frozen_bytes_per_step"]["frozen.outer.bfloat16"] == \
        bf16["frozen_bytes_per_step"]["frozen.outer.bfloat16"]
