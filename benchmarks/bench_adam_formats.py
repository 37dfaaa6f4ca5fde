"""CPU Adam kernels by state format: fp32, bf16 and 8-bit moments against torch's fused AdamW, and
the machine's memory-bandwidth limit measured in the same run.

    python benchmarks/bench_adam_formats.py                  # 50M params, 2 threads, 7 reps
    python benchmarks/bench_adam_formats.py --quick          # seconds (run by the tests)
    python benchmarks/bench_adam_formats.py --threads 1 2    # a thread sweep

Each rep runs every kernel once, in a rotating order (drift of this shared machine hits all
alike); medians are reported. One step over ``n`` fp32 parameters with fp32 gradients:

- ``torch_fused``: ``torch._fused_adamw_`` on one tensor (what torch.optim.AdamW(fused=True)
  runs), 28 B/param of DRAM traffic;
- ``fp32``: ``infinity.ops.cpu_adam_step`` (28 B/param);
- ``bf16``: ``cpu_adam_step_bf16_moments`` (20 B/param);
- ``8bit``: ``cpu_adam_step_8bit`` (16 B/param + scales);
- ``copy``: ``dst.copy_(src)`` of 4 B/param (12 B/param of traffic: read, read for ownership,
  write): the bandwidth limit; a
  kernel's limit is its bytes per parameter / this bandwidth.

Results: benchmarks/results/bench_adam_formats.json (+ .png unless --no-plot).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from infinity import ops

BYTES = {"torch_fused": 28, "fp32": 28, "bf16": 20, "8bit": 16 + 8 / 256, "copy": 12}


def _kernels(n: int) -> Dict[str, Callable[[int], None]]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    tp, tg = p.clone(), g.clone()
    tm, tv = torch.zeros(n), torch.zeros(n)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    mb, vb = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    q8 = ops.new_8bit_state(n)
    src, dst = torch.randn(n, generator=gen), torch.empty(n)
    steps = torch.zeros(1)

    def fused(step: int) -> None:
        steps.fill_(step)
        torch._fused_adamw_([tp], [tg], [tm], [tv], [], [steps], lr=1e-3, beta1=0.9,
                            beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                            maximize=False)

    return {
        "torch_fused": fused,
        "fp32": lambda s: ops.cpu_adam_step(p, g, m32, v32, step=s, lr=1e-3, weight_decay=0.01),
        "bf16": lambda s: ops.cpu_adam_step_bf16_moments(p, g, mb, vb, step=s, lr=1e-3,
                                                         weight_decay=0.01),
        "8bit": lambda s: ops.cpu_adam_step_8bit(p, g, *q8.values(), step=s, lr=1e-3,
                                                 weight_decay=0.01),
        "copy": lambda s: dst.copy_(src),
    }


def run(n: int, threads: int, reps: int) -> Dict:
    torch.set_num_threads(threads)
    ops.set_num_threads(threads)
    kernels = _kernels(n)
    names = list(kernels)
    times: Dict[str, List[float]] = {k: [] for k in names}
    for name in names:  # warm-up: first touch of every buffer
        kernels[name](1)
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            t0 = time.perf_counter()
            kernels[name](rep + 2)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    bandwidth = BYTES["copy"] * n / med["copy"]
    rows = {}
    for k in names:
        rows[k] = {"median_s": med[k], "mparams_per_s": n / med[k] / 1e6,
                   "bytes_per_param": BYTES[k],
                   "memory_limit_s": BYTES[k] * n / bandwidth,
                   "vs_fp32": med["fp32"] / med[k]}
    return {"params": n, "threads": threads, "reps": reps, "copy_bandwidth_gbs": bandwidth / 1e9,
            "kernels": rows, "capability": ops.cpu_capability()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 reps (CI smoke)")
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "bench_adam_formats.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    n = 300_000 if args.quick else int(args.params)
    reps = 3 if args.quick else args.reps
    results = [run(n, t, reps) for t in args.threads]
    for r in results:
        print(f"{r['params'] / 1e6:.0f}M params, {r['threads']} threads, "
              f"{r['capability']}, copy bandwidth {r['copy_bandwidth_gbs']:.1f} GB/s")
        for k, row in r["kernels"].items():
            print(f"  {k:12s} {row['median_s'] * 1e3:8.2f} ms  {row['mparams_per_s']:7.0f} Mp/s"
                  f"  memory limit {row['memory_limit_s'] * 1e3:7.2f} ms  "
                  f"vs fp32 {row['vs_fp32']:.2f}x")
    out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
           "command": "python benchmarks/bench_adam_formats.py" + (" --quick" if args.quick else ""),
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    if not args.no_plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        r = results[-1]
        names = [k for k in r["kernels"] if k != "copy"]
        ax.bar(names, [r["kernels"][k]["median_s"] * 1e3 for k in names], label="measured")
        ax.scatter(names, [r["kernels"][k]["memory_limit_s"] * 1e3 for k in names], color="k",
                   marker="_", s=400, label="memory-bandwidth limit")
        ax.set_ylabel("ms per step")
        ax.set_title(f"Adam step, {r['params'] / 1e6:.0f}M params, {r['threads']} threads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
