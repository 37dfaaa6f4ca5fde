"""Helpers the benchmark scripts share: the machine description, JSON output, matplotlib.

Kept free of torch and infinity imports: bench_wrap's parent process uses it without either.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from typing import Any, Dict, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cores() -> str:
    """``"<arch> <n> cores"``, the short machine line of the JSON results."""
    return f"{platform.machine()} {os.cpu_count()} cores"


def cpu_model() -> Optional[str]:
    """The ``model name`` line of /proc/cpuinfo, or None where there is none."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        return None


def machine_info(extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Machine, load and code version (commit, dirty tree) of a run; ``extra`` keys follow
    ``python`` in the result."""
    info: Dict[str, Any] = {"machine": cores(), "python": platform.python_version()}
    info.update(extra or {})
    info["kernel"] = platform.release()
    info["loadavg_1_5_15"] = os.getloadavg()  # this machine is shared: how busy it was
    try:  # the code measured: HEAD, and whether the tree had uncommitted changes
        git = ["git", "-C", ROOT]
        info["commit"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip()
        info["tree_dirty"] = bool(subprocess.run(git + ["status", "--porcelain", "-uno"],
                                                 capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            info["mem_total_gib"] = round(int(fh.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    cpu = cpu_model()
    if cpu is not None:
        info["cpu"] = cpu
    return info


# Source text for benchmark child processes: ``status(key)`` reads a /proc/self/status field
# in bytes (VmRSS, VmHWM, RssAnon...), ``reset_peak()`` resets the kernel's VmHWM to VmRSS.
CHILD_RSS_HELPERS = """
def status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
"""


# Source text for benchmark child processes that import time and infinity: one timed
# training step.
CHILD_TIMED_STEP = """
def timed_step(model, opt, loss_of):
    # forward + backward of loss_of(), then opt.step() and opt.zero_grad(): returns the loss,
    # the seconds of each half and infinity.stats(model) since the last step (reset)
    t0 = time.perf_counter()
    loss = loss_of()
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t2 = time.perf_counter()
    return loss, t1 - t0, t2 - t1, infinity.stats(model, reset=True)
"""

# Source text for benchmark child processes that import torch: ``init`` for infinity.wrap,
# normal (std 0.02) but 1-D weights (norms) 1 and biases 0.
CHILD_INIT = """
def init(module):
    for name, p in module.named_parameters(recurse=False):
        with torch.no_grad():
            if name == "weight" and p.dim() == 1:
                p.fill_(1.0)
            elif name == "bias":
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
"""


def run_child(name: str, code: str, payload: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Runs child source ``code`` (``ROOT`` defined first) with ``payload`` as JSON in argv[1],
    its stderr passed through; returns the JSON of its last stdout line."""
    out = subprocess.run([sys.executable, "-c", f"ROOT = {ROOT!r}\n" + code,
                          json.dumps(payload)],
                         stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{name} child failed (exit {out.returncode}); its stderr is above")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_json(path: os.PathLike[str] | str, data: Any, indent: int = 2) -> None:
    """Write ``data`` to ``path``, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(data, fh, indent=indent)


def pyplot(logger: Optional[logging.Logger] = None, hint: str = ""):
    """matplotlib.pyplot on the Agg backend, or None (logged to ``logger``) without it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if logger is not None:
            logger.info("matplotlib not installed: no plot%s", hint)
        return None
    return plt


def save_figure(fig, path: os.PathLike[str] | str, dpi: Optional[int] = None) -> None:
    """tight_layout, save to ``path`` and close ``fig``."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    if dpi is None:
        fig.savefig(path)
    else:
        fig.savefig(path, dpi=dpi)
    plt.close(fig)
