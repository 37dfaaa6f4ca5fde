"""NF4 dequantization on the CPU (infinity.ops.nf4) against a plain copy of the dequantized
bytes, in the same run (``--format int8``: the block-wise int8 of infinity.ops.int8_block,
vectorised PyTorch, reads 1.0156 B/element).

    python benchmarks/bench_nf4.py            # 64M elements, 2 threads, 7 reps
    python benchmarks/bench_nf4.py --quick    # seconds (run by the tests)
    python benchmarks/bench_nf4.py --format int8

Each rep times, in a rotating order: ``dequantize_nf4`` into fp32 and into bf16 (reads 0.5625
B/element, writes 4 or 2), and ``dst.copy_(src)`` of the same fp32 / bf16 output (reads and
writes the output's bytes): the memory-bandwidth reference. Reported: medians and
``vs_copy`` = copy time / dequantization time (1.0: dequantization runs at the speed the
memory moves the bytes it produces). Results: benchmarks/results/bench_nf4.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from infinity import ops
from infinity.ops import int8_block, nf4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--numel", type=float, default=64 * 2 ** 20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--format", default="nf4", choices=("nf4", "int8"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.out is None:
        args.out = Path(__file__).parent / "results" / (
            "bench_nf4.json" if args.format == "nf4" else "bench_int8_block.json")
    n = 1 << 20 if args.quick else int(args.numel)
    reps = 3 if args.quick else args.reps
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    if args.format == "nf4":
        codes, absmax = nf4.quantize_nf4(torch.randn(n))
        decode = nf4.dequantize_nf4
    else:
        codes, absmax = int8_block.quantize_int8(torch.randn(n))
        decode = int8_block.dequantize_int8
    outs = {dt: torch.empty(n, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    srcs = {dt: torch.randn(n).to(dt) for dt in outs}
    jobs = {}
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        jobs[f"dequantize_{name}"] = (lambda dt=dt: decode(codes, absmax, n, out=outs[dt]))
        jobs[f"copy_{name}"] = (lambda dt=dt: outs[dt].copy_(srcs[dt]))
    names = list(jobs)
    times = {k: [] for k in names}
    for k in names:
        jobs[k]()
    for rep in range(reps):
        for k in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            jobs[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = {}
    for name, size in (("fp32", 4), ("bf16", 2)):
        d, c = med[f"dequantize_{name}"], med[f"copy_{name}"]
        rows[name] = {"dequantize_s": d, "copy_s": c, "vs_copy": c / d,
                      "dequantize_out_gbs": n * size / d / 1e9, "copy_gbs": 2 * n * size / c / 1e9}
        print(f"{name}: dequantize {d * 1e3:.2f} ms ({n * size / d / 1e9:.1f} GB/s written), "
              f"copy {c * 1e3:.2f} ms -> {c / d:.2f}x the copy")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor(),
              "capability": ops.cpu_capability(), "format": args.format, "numel": n, "threads": args.threads,
              "reps": reps, "command": "python benchmarks/bench_nf4.py" +
              (" --quick" if args.quick else "") +
              (f" --format {args.format}" if args.format != "nf4" else ""), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
