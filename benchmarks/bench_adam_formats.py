"""CPU Adam kernels by state format: fp32, bf16 and 8-bit moments against torch's fused AdamW, and
the machine's memory-bandwidth limit measured in the same run.

    python benchmarks/bench_adam_formats.py                  # 50M params, 2 threads, 9 reps
    python benchmarks/bench_adam_formats.py --quick          # seconds (run by the tests)
    python benchmarks/bench_adam_formats.py --threads 1 2    # a thread sweep
    python benchmarks/bench_adam_formats.py --caps avx512 avx2 --grads fresh constant
    python benchmarks/bench_adam_formats.py --threads 1 --timer cpu   # robust to a busy machine

Each rep runs every kernel once, in a rotating order (drift of this shared machine hits all
alike); medians are reported, and each kernel's speed against fp32 is the median over reps of
the same rep's ratio. One step over ``n`` fp32 parameters with fp32 gradients; DRAM traffic per
parameter (each array read once and written once, nothing cached between steps at 50M):

- ``torch_fused``: ``torch._fused_adamw_`` on one tensor (what torch.optim.AdamW(fused=True)
  runs): 28 B/param (param, exp_avg, exp_avg_sq read and written, grad read);
- ``fp32``: ``infinity.ops.cpu_adam_step``: 28 B/param;
- ``bf16``: ``cpu_adam_step_bf16_moments``: 20 B/param (4 + 4 param, 4 grad, 2 + 2 per moment);
- ``8bit``: ``cpu_adam_step_8bit``: 16 + 16/256 B/param (4 + 4 param, 4 grad, 1 + 1 per
  moment's codes, a 4-byte absmax per 256 per moment read and written);
- bandwidth references: ``rmw`` = ``a.add_(b)`` (12 B/param: a read and written, b read: the
  kernels' own pattern) and ``copy`` = ``dst.copy_(src)`` (12 B/param counting the read for
  ownership of dst). A kernel's memory limit is its bytes per parameter over the larger of the
  two bandwidths.

Gradients (``--grads``): ``fresh`` alternates two independent random gradients (the moments
move as in training); ``constant`` feeds the same gradient every step, which puts every element
exactly on Adam's bound |m| = K sqrt(v): the 8-bit step's moment guard then fires at random, its
worst case (a square root per element more).

Results: benchmarks/results/bench_adam_formats.json (+ .png unless --no-plot).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from infinity import ops

BYTES = {"torch_fused": 28.0, "fp32": 28.0, "bf16": 20.0, "8bit": 16.0 + 16.0 / 256,
         "rmw": 12.0, "copy": 12.0}
BANDWIDTH_REFS = ("rmw", "copy")
KERNELS = ("torch_fused", "fp32", "bf16", "8bit")


def _kernels(n: int, grads: str) -> Dict[str, Callable[[int], None]]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g_pair = [torch.randn(n, generator=gen) * 1e-2]
    g_pair.append(torch.randn(n, generator=gen) * 1e-2 if grads == "fresh" else g_pair[0])
    tp = p.clone()
    tm, tv = torch.zeros(n), torch.zeros(n)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    mb, vb = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    q8 = ops.new_8bit_state(n)
    src, dst = torch.randn(n, generator=gen), torch.empty(n)
    steps = torch.zeros(1)

    def fused(step: int) -> None:
        steps.fill_(step)
        torch._fused_adamw_([tp], [g_pair[step % 2]], [tm], [tv], [], [steps], lr=1e-3,
                            beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                            amsgrad=False, maximize=False)

    return {
        "torch_fused": fused,
        "fp32": lambda s: ops.cpu_adam_step(p, g_pair[s % 2], m32, v32, step=s, lr=1e-3,
                                            weight_decay=0.01),
        "bf16": lambda s: ops.cpu_adam_step_bf16_moments(p, g_pair[s % 2], mb, vb, step=s,
                                                         lr=1e-3, weight_decay=0.01),
        "8bit": lambda s: ops.cpu_adam_step_8bit(p, g_pair[s % 2], *q8.values(), step=s,
                                                 lr=1e-3, weight_decay=0.01),
        "rmw": lambda s: dst.add_(src),
        "copy": lambda s: dst.copy_(src),
    }


def _loadavg() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run(n: int, threads: int, reps: int, cap: str, grads: str, timer: str = "wall") -> Dict:
    torch.set_num_threads(threads)
    ops.set_num_threads(threads)
    clock = time.perf_counter if timer == "wall" else time.thread_time
    load_before = _loadavg()
    with ops.cpu_capability_override(cap):
        kernels = _kernels(n, grads)
        names = list(kernels)
        times: Dict[str, List[float]] = {k: [] for k in names}
        for name in names:  # warm-up: first touch of every buffer, and one step of state
            kernels[name](1)
        for rep in range(reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                t0 = clock()
                kernels[name](rep + 2)
                times[name].append(clock() - t0)
        del kernels
    med = {k: statistics.median(v) for k, v in times.items()}
    bandwidth = {k: BYTES[k] * n / med[k] for k in BANDWIDTH_REFS}
    best_bw = max(bandwidth.values())
    rows = {}
    for k in names:
        ratios = [a / b for a, b in zip(times["fp32"], times[k])]  # same rep
        rows[k] = {"median_s": med[k], "mparams_per_s": n / med[k] / 1e6,
                   "times_s": times[k], "bytes_per_param": BYTES[k],
                   "memory_limit_s": BYTES[k] * n / best_bw,
                   "fraction_of_memory_limit": BYTES[k] * n / best_bw / med[k],
                   "speed_vs_fp32_same_rep_median": statistics.median(ratios),
                   "speed_vs_fp32_of_medians": med["fp32"] / med[k]}
    return {"params": n, "threads": threads, "reps": reps, "capability": cap, "grads": grads,
            "timer": timer,
            "bandwidth_gbs": {k: v / 1e9 for k, v in bandwidth.items()},
            "loadavg_before": load_before, "loadavg_after": _loadavg(), "kernels": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 reps (CI smoke)")
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--caps", nargs="+", default=None,
                    help="CPU paths to run (default: the one chosen for this machine)")
    ap.add_argument("--grads", nargs="+", default=["fresh", "constant"],
                    choices=["fresh", "constant"])
    ap.add_argument("--timer", choices=["wall", "cpu"], default="wall",
                    help="cpu: the calling thread's CPU time (time.thread_time), which a busy "
                         "shared machine's preemption does not inflate; with --threads 1 only "
                         "(the kernels then run on the calling thread)")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "bench_adam_formats.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    n = 300_000 if args.quick else int(args.params)
    reps = 3 if args.quick else args.reps
    caps = args.caps or [ops.cpu_capability()]
    unknown = [c for c in caps if c not in ops.available_cpu_capabilities() + ["torch"]]
    if unknown:
        raise SystemExit(f"bench_adam_formats: capabilities {unknown} are not available here "
                         f"(available: {ops.available_cpu_capabilities()})")
    if args.timer == "cpu" and args.threads != [1]:
        raise SystemExit("bench_adam_formats: --timer cpu measures the calling thread only; "
                         "use it with --threads 1")
    results = [run(n, t, reps, cap, g, args.timer) for cap in caps for g in args.grads
               for t in args.threads]
    for r in results:
        bw = ", ".join(f"{k} {v:.1f}" for k, v in r["bandwidth_gbs"].items())
        print(f"{r['params'] / 1e6:.1f}M params, {r['threads']} threads, {r['capability']}, "
              f"{r['grads']} gradients, {r['timer']} time, bandwidth GB/s: {bw}; "
              f"load {r['loadavg_before']}")
        for k, row in r["kernels"].items():
            print(f"  {k:12s} {row['median_s'] * 1e3:8.2f} ms  {row['mparams_per_s']:7.0f} Mp/s"
                  f"  {row['bytes_per_param']:6.2f} B/param  memory limit "
                  f"{row['memory_limit_s'] * 1e3:7.2f} ms ({row['fraction_of_memory_limit']:.2f})"
                  f"  vs fp32 {row['speed_vs_fp32_same_rep_median']:.2f}x")
    cmd = "python benchmarks/bench_adam_formats.py" + (" --quick" if args.quick else "")
    out = {"date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "command": cmd,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    if not args.no_plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.5),
                                 squeeze=False)
        for ax, r in zip(axes[0], results):
            names = list(KERNELS)
            ax.bar(names, [r["kernels"][k]["median_s"] * 1e3 for k in names], label="measured")
            ax.scatter(names, [r["kernels"][k]["memory_limit_s"] * 1e3 for k in names],
                       color="k", marker="_", s=400, label="memory-bandwidth limit")
            ax.set_ylabel("ms per step")
            ax.set_title(f"{r['params'] / 1e6:.0f}M, {r['threads']} thr, {r['capability']}, "
                         f"{r['grads']} grads", fontsize=9)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
