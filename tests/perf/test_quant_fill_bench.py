"""benchmarks/bench_quant_fill.py --quick runs (a narrow Llama layer wrapped with NF4 and int8
homes, this tree only) and its figures hold together."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_quant_fill_quick(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_quant_fill.py"),
                           "--quick", "--out", str(out), "--nvme-path", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert sorted(r["format"] for r in rows) == ["int8", "nf4"]
    for r in rows:
        assert r["tree"] == "this"
        # q, o: 256 x 256; k, v: 256 x 64 (8 of 32 heads); gate, up, down: 256 x 512
        assert r["frozen_elems"] == 2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 512
        assert 0 < r["fill_s"] < r["wrap_s"]
        assert r["kernel_s"] > 0 and r["kernel_elems"] == 256 * 512
