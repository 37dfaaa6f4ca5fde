"""Peak-RSS measurements in a fresh interpreter: the child gets the benchmarks' /proc helpers
(``status(key)`` in bytes, ``reset_peak()``) ahead of its own source."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child_rss_helpers() -> str:
    spec = importlib.util.spec_from_file_location(
        "bench_common", os.path.join(ROOT, "benchmarks", "_common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CHILD_RSS_HELPERS


CHILD_RSS_HELPERS = _child_rss_helpers()


def run_rss_child(code: str, *argv: str, timeout: float = 600) -> Dict[str, Any]:
    """Runs ``code`` after the /proc helpers with ``argv``; returns the JSON of its last stdout
    line (a failed child fails the test with its stderr)."""
    out = subprocess.run([sys.executable, "-c", CHILD_RSS_HELPERS + code, *argv],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
