"""CPU Adam benchmark: infinity's native kernel (each ISA) vs torch AdamW fused / foreach.

Measured in one run, per size and thread count (medians of --reps repetitions):
- fp32 gradients: ours on every ISA this CPU has, torch AdamW(fused=True), AdamW(foreach=True),
  DeepSpeed's CPU Adam when importable (otherwise a note);
- mixed precision: bf16 gradient in, fp32 master/moments, bf16 working copy out in ONE pass,
  vs the torch equivalent: grad.float() (or a copy into a preallocated fp32 grad), fused AdamW
  step, copy of the param into the bf16 working copy;
- the memory bandwidth of a plain in-place streaming update (torch ``a.add_(b)``).

Prints a table, writes JSON (benchmarks/results/bench_adam.json; --out to override) and a PNG
next to it when matplotlib is importable.

    python benchmarks/bench_adam.py            # 25M and 100M params, 1 and 2 threads
    python benchmarks/bench_adam.py --quick    # tiny sizes, 2 reps (~10 s), for CI
"""
from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402  (benchmarks/, this script's folder)

from infinity import ops  # noqa: E402

logger = logging.getLogger("bench_adam")

FP32_BYTES_PER_PARAM = 28   # read p g m v (16), write p m v (12)
MIXED_BYTES_PER_PARAM = 28  # read p m v (12) + bf16 g (2), write p m v (12) + bf16 out (2)
ADD_BYTES_PER_ELEM = 12     # read a b, write a
LR, WD = 1e-3, 0.01


def interleaved_medians(cases: List[Tuple[str, Callable[[], None]]], reps: int,
                        warmup: int = 1) -> Dict[str, Dict[str, float]]:
    """Times every case once per round, round after round, so a noisy phase of the shared
    machine hits all cases alike; returns each case's median (and min) over the rounds."""
    for _ in range(warmup):
        for _, fn in cases:
            fn()
    times: Dict[str, List[float]] = {name: [] for name, _ in cases}
    for _ in range(reps):
        for name, fn in cases:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "reps": reps}
            for name, t in times.items()}


def deepspeed_cpu_adam() -> Optional[type]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore
    except Exception as exc:  # not installed, or its extension cannot build here
        logger.info("DeepSpeed CPU Adam not importable (%s): skipped", type(exc).__name__)
        return None
    return DeepSpeedCPUAdam


def bench_size(n: int, threads: int, reps: int, caps: List[str]) -> List[dict]:
    torch.set_num_threads(threads)
    ops.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    cases: List[Tuple[str, Callable[[], None]]] = []
    meta: Dict[str, Tuple[str, int]] = {}

    def add(case: str, kind: str, bytes_per: int, fn: Callable[[], None]) -> None:
        cases.append((case, fn))
        meta[case] = (kind, bytes_per)

    # ---- fp32 gradients -------------------------------------------------------------------------
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    for cap in caps:
        step = [0]

        def ours(cap: str = cap, step: List[int] = step) -> None:
            step[0] += 1
            with ops.cpu_capability_override(cap):
                ops.cpu_adam_step(p, g, m, v, step=step[0], lr=LR, weight_decay=WD)

        add(f"ours_{cap}", "fp32", FP32_BYTES_PER_PARAM, ours)

    for flavour in ("fused", "foreach"):
        tp = torch.nn.Parameter(p.clone())
        tp.grad = g.clone()
        opt = torch.optim.AdamW([tp], lr=LR, weight_decay=WD, **{flavour: True})
        add(f"torch_{flavour}", "fp32", FP32_BYTES_PER_PARAM, opt.step)

    ds_cls = deepspeed_cpu_adam()
    if ds_cls is not None:
        dp = torch.nn.Parameter(p.clone())
        dp.grad = g.clone()
        ds_opt = ds_cls([dp], lr=LR, weight_decay=WD, adamw_mode=True)
        add("deepspeed_cpu_adam", "fp32", FP32_BYTES_PER_PARAM, ds_opt.step)

    # ---- mixed precision: bf16 grad in, bf16 working copy out ----------------------------------
    gb = g.to(torch.bfloat16)
    work = torch.empty(n, dtype=torch.bfloat16)
    best = caps[0]
    pm, mm, vm = p.clone(), torch.zeros(n), torch.zeros(n)
    mixed_step = [0]

    def ours_mixed() -> None:
        mixed_step[0] += 1
        with ops.cpu_capability_override(best):
            ops.cpu_adam_step(pm, gb, mm, vm, step=mixed_step[0], lr=LR, weight_decay=WD,
                              out=work)

    add(f"ours_{best}_mixed_bf16", "mixed", MIXED_BYTES_PER_PARAM, ours_mixed)

    mp = torch.nn.Parameter(p.clone())
    mp.grad = torch.empty(n)
    mixed_opt = torch.optim.AdamW([mp], lr=LR, weight_decay=WD, fused=True)
    work_t = torch.empty(n, dtype=torch.bfloat16)

    def torch_mixed_alloc() -> None:
        mp.grad = gb.float()
        mixed_opt.step()
        work_t.copy_(mp.detach())

    def torch_mixed_prealloc() -> None:
        mp.grad.copy_(gb)
        mixed_opt.step()
        work_t.copy_(mp.detach())

    add("torch_fused_mixed_prealloc", "mixed", MIXED_BYTES_PER_PARAM, torch_mixed_prealloc)
    add("torch_fused_mixed_alloc", "mixed", MIXED_BYTES_PER_PARAM, torch_mixed_alloc)
    # (g stays alive: the fp32 cases use it)

    # ---- bandwidth of a plain in-place streaming pass ----------------------------------------
    a = torch.randn(n, generator=gen)
    b = torch.randn(n, generator=gen)
    add("torch_add_inplace", "bandwidth", ADD_BYTES_PER_ELEM, lambda: a.add_(b))

    timings = interleaved_medians(cases, reps)
    results: List[dict] = []
    for case, _ in cases:
        kind, bytes_per = meta[case]
        med = timings[case]["median_s"]
        results.append({"case": case, "kind": kind, "n": n, "threads": threads, **timings[case],
                        "params_per_s": n / med, "gb_per_s": n * bytes_per / med / 1e9})
    del cases
    gc.collect()
    return results


def add_ratios(results: List[dict]) -> None:
    for r in results:
        same = [x for x in results if x["n"] == r["n"] and x["threads"] == r["threads"]]
        fused = next(x for x in same if x["case"] == "torch_fused")
        r["vs_torch_fused"] = r["params_per_s"] / fused["params_per_s"]
        if r["kind"] == "mixed":
            torch_mixed = max((x for x in same if x["case"].startswith("torch_fused_mixed")),
                              key=lambda x: x["params_per_s"])
            r["vs_torch_mixed_best"] = r["params_per_s"] / torch_mixed["params_per_s"]


def check_targets(results: List[dict], caps: List[str]) -> List[dict]:
    """The acceptance targets, at the largest size and thread count measured."""
    n = max(r["n"] for r in results)
    threads = max(r["threads"] for r in results)
    at = {r["case"]: r for r in results if r["n"] == n and r["threads"] == threads}
    targets = []

    def target(name: str, value: float, minimum: float) -> None:
        targets.append({"target": name, "n": n, "threads": threads, "value": value,
                        "minimum": minimum, "ok": value >= minimum})

    best = caps[0]
    target(f"ours_{best} fp32 vs torch fused (params/s)",
           at[f"ours_{best}"]["vs_torch_fused"], 1.0)
    target(f"ours_{best} mixed bf16 one pass vs best torch equivalent",
           at[f"ours_{best}_mixed_bf16"]["vs_torch_mixed_best"], 1.3)
    if "avx2" in caps and "avx512" in caps:
        target("avx2 vs avx512 (fp32)",
               at["ours_avx2"]["params_per_s"] / at["ours_avx512"]["params_per_s"], 0.8)
    return targets


def print_table(results: List[dict], targets: List[dict]) -> None:
    header = (f"{'case':30s} {'kind':9s} {'params':>11s} {'thr':>3s} {'median ms':>10s} "
              f"{'Gparam/s':>9s} {'GB/s':>7s} {'vs fused':>8s}")
    print(header)
    print("-" * len(header))
    for r in results:
        extra = (f"  (vs best torch mixed {r['vs_torch_mixed_best']:.2f}x)"
                 if "vs_torch_mixed_best" in r else "")
        print(f"{r['case']:30s} {r['kind']:9s} {r['n']:11,d} {r['threads']:3d} "
              f"{r['median_s'] * 1e3:10.2f} {r['params_per_s'] / 1e9:9.3f} "
              f"{r['gb_per_s']:7.2f} {r['vs_torch_fused']:7.2f}x{extra}")
    print()
    for t in targets:
        print(f"target {t['target']} at n={t['n']:,} threads={t['threads']}: "
              f"{t['value']:.2f}x (need >= {t['minimum']}) {'OK' if t['ok'] else 'MISSED'}")


def plot(results: List[dict], path: Path) -> Optional[str]:
    plt = _common.pyplot(logger, " (pip install matplotlib)")
    if plt is None:
        return None
    configs = sorted({(r["n"], r["threads"]) for r in results})
    cases = list(dict.fromkeys(r["case"] for r in results))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(cases)), 5))
    width = 0.8 / len(configs)
    for j, (n, threads) in enumerate(configs):
        values = []
        for case in cases:
            hit = [r for r in results if r["case"] == case and r["n"] == n
                   and r["threads"] == threads]
            values.append(hit[0]["params_per_s"] / 1e9 if hit else 0.0)
        ax.bar([i + j * width for i in range(len(cases))], values, width,
               label=f"{n / 1e6:g}M params, {threads} thr")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("G params/s (elements/s for add)")
    ax.set_title("CPU Adam: medians")
    ax.legend(fontsize=8)
    _common.save_figure(fig, path, dpi=110)
    return str(path)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 reps (CI smoke)")
    parser.add_argument("--sizes", type=int, nargs="+", help="parameter counts")
    parser.add_argument("--threads", type=int, nargs="+", help="thread counts")
    parser.add_argument("--reps", type=int, help="repetitions per case (median reported)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "bench_adam.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    cpus = len(os.sched_getaffinity(0))
    sizes = args.sizes or ([1 << 18, 1 << 20] if args.quick else [25_000_000, 100_000_000])
    threads_list = args.threads or sorted({1, min(2, cpus)})
    reps = args.reps or (2 if args.quick else 7)
    caps = ops.available_cpu_capabilities()
    if not caps:
        logger.error("native library not built: nothing to compare (pip install -e .)")
        return 1
    notes = []
    if deepspeed_cpu_adam() is None:
        notes.append("DeepSpeed CPU Adam not importable: skipped")

    results: List[dict] = []
    torch_threads = torch.get_num_threads()
    our_threads = ops.get_num_threads()
    try:
        for n in sizes:
            for threads in threads_list:
                logger.info("n=%d threads=%d ...", n, threads)
                results.extend(bench_size(n, threads, reps, caps))
    finally:
        torch.set_num_threads(torch_threads)
        ops.set_num_threads(our_threads)
    add_ratios(results)
    targets = check_targets(results, caps)
    print_table(results, targets)
    for note in notes:
        print(f"note: {note}")

    data = {
        "config": {"quick": args.quick, "sizes": sizes, "threads": threads_list, "reps": reps,
                   "capabilities": caps, "lr": LR, "weight_decay": WD},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": cpus, "torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "results": results,
        "targets": targets,
        "notes": notes,
    }
    _common.write_json(args.out, data)
    print(f"wrote {args.out}")
    if not args.no_plot:
        png = plot(results, args.out.with_suffix(".png"))
        if png:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
