"""The README's first command, `infinity demo`, trains with its states offloaded to a swap
directory and prints what moved where."""
from __future__ import annotations

import re
import subprocess
import sys


def test_demo_trains_and_reports_what_moved_where():
    r = subprocess.run([sys.executable, "-m", "infinity", "demo", "--steps", "4"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 4 steps", out).groups())
    assert last < first
    assert "what each tier held" in out and "what moved where" in out
    assert re.search(r"nvme to host\s+[\d.]+ [KMG]iB", out), out
    assert re.search(r"staging buffers \d+, grad buffers \d+", out), out
