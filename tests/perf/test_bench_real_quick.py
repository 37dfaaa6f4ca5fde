"""The --quick modes of the real-model benchmarks (outer blocks against the root layout,
chunk-bounded pools against one buffer per flat) run, so none of them rots."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(name: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_bench_outer_blocks_quick(tmp_path):
    out = tmp_path / "outer.json"
    _bench("bench_outer_blocks.py", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    by = {(r["tied"], r["layout"]): r for r in rows}
    assert len(by) == 4
    for tied in (True, False):
        outer, root = by[(tied, "outer")], by[(tied, "root")]
        assert outer["root_bytes"] < root["root_bytes"]  # the embedding left the root
        assert outer["largest_block_bytes"] >= 128256 * 32 * 4  # the embedding is a block
        assert outer["device_peak_bytes"] > 0 and outer["step_s_median"] > 0


def test_bench_chunked_pools_quick(tmp_path):
    out = tmp_path / "pools.json"
    _bench("bench_chunked_pools.py", "--quick", "--out", str(out))
    runs = json.loads(out.read_text())["runs"]
    chunked, whole = runs["chunked"], runs["one_buffer_per_flat"]
    assert chunked["chunk"] == 16 << 10
    assert chunked["staging_bytes"] + chunked["grad_buffer_bytes"] < \
        whole["staging_bytes"] + whole["grad_buffer_bytes"]
