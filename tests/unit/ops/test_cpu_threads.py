"""The native CPU Adam runs on the number of threads it is set to, observably.

``infinity.ops.set_num_threads(n)`` sets the threads of the native kernels (the caller's own
thread counts as one; csrc/cpu_adam.cpp ``inf_set_num_threads``). Without a setting they use the
CPUs in the process's affinity mask (``inf_cpu::usable_cpus``, csrc/cpu_adam_threadpool.h),
**not** ``torch.get_num_threads()`` / ``OMP_NUM_THREADS``: that is the documented behaviour
(infinity/ops/cpu.py ``get_num_threads``), checked below so that a change of it is deliberate.

What "runs on N threads" means here, measured rather than read back from the getter: each
case runs in a fresh subprocess (native code; a crash there fails the test instead of killing
pytest) that

- counts the threads the pool creates (workers are created lazily, ``ntasks - 1`` of them, and
  live until exit; only threads that appear during a native call count, torch starts its own
  OpenMP threads lazily too), and
- counts the threads that did the work of a large step: the per-thread CPU time of the calling
  thread and of the pool's threads (``/proc/self/task/<tid>/schedstat``) over a few steps on the
  slow scalar path, where each working thread's share (~1/N of the step) dwarfs what an idle
  worker burns acknowledging a job and spinning for at most 2 ms.

N = 1, 2, 3 and 4 in one process, in an order that grows and shrinks the setting (a pool of 3
workers must run only one of them for N = 2); 3 and 4 oversubscribe a 2-core machine, which is
fine for a correctness check. Every N must give bitwise the same state as N = 1.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinity import ops

ROOT = Path(__file__).resolve().parents[3]
NATIVE = bool(ops.available_cpu_capabilities())
HAS_SCHEDSTAT = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat")

pytestmark = pytest.mark.skipif(not NATIVE, reason="native library not built")

_COMMON = r"""
import json, os, sys, threading
import torch
from infinity import ops
from infinity.ops import _adam_native

MAIN = threading.get_native_id()


def tids():
    return {int(t) for t in os.listdir("/proc/self/task")}


def cpu_ns(ids):
    out = {}
    for tid in ids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                out[tid] = int(fh.read().split()[0])
        except OSError:  # a thread that exited (none of the pool's ever does)
            out[tid] = 0
    return out


def fresh_state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    # one element off 64-byte alignment: exercises the first cache-line boundary of the split
    def shifted(t):
        base = torch.empty(n + 1, dtype=t.dtype)
        base[1:].copy_(t)
        return base[1:]
    return {"p": shifted(torch.randn(n, generator=g)),
            "g": shifted(torch.randn(n, generator=g).to(torch.bfloat16)),
            "m": shifted(torch.randn(n, generator=g).abs_().mul_(0.1)),
            "v": shifted(torch.rand(n, generator=g).mul_(0.01)),
            "out": shifted(torch.zeros(n, dtype=torch.bfloat16))}


POOL = set()  # threads that appeared during a native call: the kernel pool's workers


def step(s, k, cap):
    with ops.cpu_capability_override(cap):
        before = tids()  # torch creates its OpenMP threads lazily: only count what the
        ops.cpu_adam_step(s["p"], s["g"], s["m"], s["v"], out=s["out"], step=k, lr=1e-3,
                          weight_decay=0.01)
        POOL.update(tids() - before)  # native call itself started
"""

_SWEEP = _COMMON + r"""
order = json.loads(sys.argv[1])
n = int(sys.argv[2])
best = ops.available_cpu_capabilities()[0]
refs = {}
rows = []
for threads in order:
    ops.set_num_threads(threads)
    row = {"threads": threads, "get_num_threads": ops.get_num_threads()}
    # bitwise: the same start state, 2 steps, on the best ISA and on scalar
    for cap in dict.fromkeys([best, "scalar"]):
        s = fresh_state(n, seed=1)
        for k in (1, 2):
            step(s, k, cap)
        if cap not in refs:
            refs[cap] = s
        row["equal_" + cap] = all(torch.equal(s[key], refs[cap][key]) for key in s)
    # who does the work: CPU time per thread (caller + pool) over 2 scalar steps
    s = fresh_state(n, seed=2)
    step(s, 1, "scalar")  # creates the workers a larger setting needs
    pool = sorted(POOL)
    watched = [MAIN] + pool
    before = cpu_ns(watched)
    for k in (2, 3):
        step(s, k, "scalar")
    after = cpu_ns(watched)
    row["pool_threads"] = len(pool)
    row["cpu_ms"] = {str(t): (after[t] - before[t]) / 1e6 for t in watched}
    row["main"] = str(MAIN)
    rows.append(row)
print(json.dumps(rows))
"""


def _run(code: str, *args: str, env: dict = None, timeout: int = 180) -> str:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.run([sys.executable, "-c", code, *args], env=full_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"subprocess failed (rc {proc.returncode}):\n"
                                  f"{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not HAS_SCHEDSTAT, reason="needs /proc/<pid>/task/<tid>/schedstat")
def test_kernel_runs_on_the_set_number_of_threads_and_is_bitwise_equal():
    order = [1, 2, 4, 2, 3, 1]
    n = (1 << 22) + 37  # scalar: ~50 ms of CPU per step, far above a worker's 2 ms spin
    rows = json.loads(_run(_SWEEP, json.dumps(order), str(n)))
    assert [r["threads"] for r in rows] == order
    largest = 0
    for row in rows:
        threads = row["threads"]
        largest = max(largest, threads)
        assert row["get_num_threads"] == threads, row
        # the pool grows to the largest setting so far (minus the caller) and never shrinks
        assert row["pool_threads"] == largest - 1, row
        cpu = row["cpu_ms"]
        top = max(cpu.values())
        busy = sorted((t for t, ms in cpu.items() if ms >= 0.4 * top), key=lambda t: -cpu[t])
        assert len(busy) == threads, (f"{threads} threads set, {len(busy)} did the work: "
                                      f"{cpu} (ms of CPU per thread; caller {row['main']})")
        assert row["main"] in busy, row  # the caller runs task 0 itself
        # the working threads did (nearly) all of it: idle workers only acknowledge
        assert sum(cpu[t] for t in busy) >= 0.85 * sum(cpu.values()), row
        for key, value in row.items():
            if key.startswith("equal_"):
                assert value, f"{key[6:]}: {threads} threads differ bitwise from 1 ({row})"


_DEFAULT = _COMMON + r"""
import os
mode = sys.argv[1]
if mode == "one_cpu":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
result = {"affinity": len(os.sched_getaffinity(0)), "torch_default": torch.get_num_threads(),
          "default": ops.get_num_threads()}
torch.set_num_threads(1)
result["after_torch_set_1"] = ops.get_num_threads()
ops.set_num_threads(3)
result["after_set_3"] = ops.get_num_threads()
torch.set_num_threads(2)
result["after_set_3_torch_2"] = ops.get_num_threads()
_adam_native.native().inf_set_num_threads(0)  # n <= 0: back to the default
result["after_reset"] = ops.get_num_threads()
s = fresh_state((1 << 20) + 5)
step(s, 1, ops.available_cpu_capabilities()[0])
result["pool_threads"] = len(POOL)
print(json.dumps(result))
"""


def test_default_is_the_affinity_mask_not_torch_threads():
    """Default: the CPUs this process may run on; torch.set_num_threads and OMP_NUM_THREADS do
    not change it (set both, as benchmarks/bench_optimizer.py --threads does, to compare)."""
    res = json.loads(_run(_DEFAULT, "all", env={"OMP_NUM_THREADS": "1"}))
    assert res["torch_default"] == 1  # OMP_NUM_THREADS reached torch ...
    assert res["default"] == res["affinity"]  # ... and not the native kernels
    assert res["after_torch_set_1"] == res["affinity"]
    assert res["after_set_3"] == 3 and res["after_set_3_torch_2"] == 3
    assert res["after_reset"] == res["affinity"]
    # a 1M-element step runs on the default: affinity - 1 workers besides the caller
    assert res["pool_threads"] == min(res["affinity"], ((1 << 20) + 5) // (1 << 15)) - 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_default_follows_a_restricted_affinity_mask():
    res = json.loads(_run(_DEFAULT, "one_cpu"))
    assert res["affinity"] == 1
    assert res["default"] == 1 and res["after_reset"] == 1
    assert res["pool_threads"] == 0  # one CPU: the caller alone, no worker created


def test_small_steps_stay_on_the_calling_thread():
    """Below 64K elements the kernel runs inline whatever the setting (kSingleThreadBelow):
    no worker is created for them."""
    code = _COMMON + r"""
ops.set_num_threads(4)
s = fresh_state((1 << 16) - 1)
step(s, 1, ops.available_cpu_capabilities()[0])
print(json.dumps(len(POOL)))
"""
    assert json.loads(_run(code)) == 0
