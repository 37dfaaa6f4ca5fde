"""Step time (forward + backward) of a ~300M-parameter GPT with its parameters offloaded to host
RAM and to NVMe, against the same model fully in memory, in one run.

    python benchmarks/bench_offload_forward.py            # ~300M params, 3 measured steps each
    python benchmarks/bench_offload_forward.py --quick    # tiny model, smoke test (CI)

For each configuration: median step time over the measured steps (after one warm-up step that
records the schedule; the configurations take turns step by step), the ratio to the in-memory model, the overlap (seconds stalled waiting for
parameters over the step time: 0 means every transfer was hidden behind compute), the prefetch
hit rate, and bytes moved per step. On a CPU-only machine the "device" is the CPU itself, so the
host tier runs in place and the NVMe tier streams every block from disk into RAM each pass.
Results: benchmarks/results/bench_offload_forward.json (+ .png when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import _common  # noqa: E402  (benchmarks/, this script's folder)
import infinity  # noqa: E402
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch  # noqa: E402


def config(quick: bool) -> GPTConfig:
    if quick:
        return GPTConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq=64)
    return GPTConfig(vocab_size=8192, d_model=1024, n_layers=24, n_heads=16, max_seq=256)


CONFIGS = ("in_memory", "host", "nvme")


def build(name: str, cfg: GPTConfig, args, swap_dir: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    if name != "in_memory":
        infinity.wrap(model, nvme_path=swap_dir, param_tier=name, prefetch_window=args.window,
                      verify_checksums=not args.no_verify)
    return model


def thread_cpu() -> Dict[int, float]:
    """CPU seconds (user + system) of each thread of this process (Linux; else empty)."""
    out: Dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


# threads that existed before any model was wrapped: the main thread and torch's intra-op
# (OpenMP) workers; every other thread is the engine's (I/O workers, transfer threads,
# gradient writer), so their CPU is what the offload's background work took from the cores
COMPUTE_THREADS: set = set()


def one_step(name: str, model: torch.nn.Module, x, y) -> Dict:
    # zero_grad is timed apart: the in-memory model frees its gradients there (munmap), the
    # engine already inside backward (each block's gradients once offloaded)
    z0 = time.perf_counter()
    if name == "in_memory":
        model.zero_grad(set_to_none=True)
    else:
        model._infinity_engine.zero_grad()
    zero_grad_s = time.perf_counter() - z0
    if name != "in_memory":
        infinity.stats(model, reset=True)
    before = thread_cpu()
    t0, c0 = time.perf_counter(), time.process_time()
    lm_loss(model(x), y).backward()
    row = {"step_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
           "zero_grad_s": zero_grad_s}
    after = thread_cpu()
    delta = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    row["cpu_split"] = {
        "main": delta.get(os.getpid(), 0.0),
        "intra_op": sum(d for t, d in delta.items() if t in COMPUTE_THREADS and t != os.getpid()),
        "engine_threads": sum(d for t, d in delta.items() if t not in COMPUTE_THREADS)}
    if name != "in_memory":
        s = infinity.stats(model)
        t = s["time"]
        row.update(stall_s=s["stall_seconds"], moved=sum(s["moved"].values()),
                   nvme_read=s["moved"]["nvme_to_host"], nvme_written=s["moved"]["host_to_nvme"],
                   hit_rate=s["prefetch_hit_rate"],
                   time={k: t[k] for k in ATTRIBUTION if k in t})
    return row


# where a forward+backward's time went (infinity.stats(model)["time"]); transfer_cpu is the
# background CPU time of the transfer threads, not part of the wall-time sum
ATTRIBUTION = ("compute", "fetch_wait", "grad_offload", "engine", "transfer_cpu")


def summarize(name: str, n_params: int, rows: List[Dict]) -> Dict:
    times = [r["step_s"] for r in rows]
    result = {"config": name, "params": n_params, "step_s_median": statistics.median(times),
              "step_s_min": min(times), "step_s_all": times,
              "cpu_s_median": statistics.median(r["cpu_s"] for r in rows),
              "zero_grad_s_median": statistics.median(r["zero_grad_s"] for r in rows),
              "step_with_zero_grad_s_median": statistics.median(
                  r["step_s"] + r["zero_grad_s"] for r in rows)}
    result["cpu_split_median"] = {k: statistics.median(r["cpu_split"][k] for r in rows)
                                  for k in rows[0]["cpu_split"]}
    if "nvme_read" in rows[0]:
        result["nvme_read_per_step"] = statistics.median(r["nvme_read"] for r in rows)
        result["nvme_written_per_step"] = statistics.median(r["nvme_written"] for r in rows)
    if "time" in rows[0]:
        result["time_median"] = {k: statistics.median(r["time"][k] for r in rows)
                                 for k in rows[0]["time"]}
    if "stall_s" in rows[0]:
        result.update({
            "stall_s_median": statistics.median(r["stall_s"] for r in rows),
            "stall_fraction": statistics.median(r["stall_s"] / r["step_s"] for r in rows),
            "bytes_moved_per_step": statistics.median(r["moved"] for r in rows),
            "prefetch_hit_rate": statistics.median(r["hit_rate"] for r in rows),
        })
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="measured steps per configuration")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--window", type=int, default=2, help="prefetch window (blocks)")
    p.add_argument("--nvme-path", default=None, help="swap directory (default: temp dir)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="configurations to run, comma-separated (in_memory always runs)")
    p.add_argument("--no-verify", action="store_true",
                   help="verify_checksums=False (sizes the CRC32C's share)")
    p.add_argument("--io-threads", type=int, default=None,
                   help="infinity.io.configure(num_threads=...) (default: the library's)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "bench_offload_forward.json"))
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 5)
    args.batch = args.batch or (2 if args.quick else 4)
    args.seq = args.seq or (32 if args.quick else 128)
    cfg = config(args.quick)
    configs = ["in_memory"] + [c for c in args.configs.split(",") if c and c != "in_memory"]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown --configs {sorted(unknown)}; choose from {CONFIGS}")
    if args.io_threads is not None:
        infinity.io.configure(num_threads=args.io_threads)
    x, y = synthetic_batch(cfg, args.batch, args.seq, torch.Generator().manual_seed(1))
    swap_dir = args.nvme_path or tempfile.mkdtemp(prefix="bench-offload-", dir=tempfile.gettempdir())
    # All three models live at once and the measured steps go round-robin over them, so a
    # noisy phase of this shared machine hits every configuration alike.
    models = {"in_memory": build("in_memory", cfg, args, swap_dir)}
    one_step("in_memory", models["in_memory"], x, y)  # starts torch's intra-op threads
    COMPUTE_THREADS.update(thread_cpu())
    models.update({name: build(name, cfg, args, swap_dir) for name in configs[1:]})
    n_params = sum(p.numel() for p in models["in_memory"].parameters())
    per_config: Dict[str, List[Dict]] = {name: [] for name in configs}
    try:
        for step in range(args.steps + 1):  # step 0 is the warm-up (records the schedule)
            for name, model in models.items():
                row = one_step(name, model, x, y)
                if step:
                    per_config[name].append(row)
            print(f"step {step}: " + "  ".join(
                f"{n} {per_config[n][-1]['step_s']:.3f}s" for n in configs if step), flush=True)
        rows = [summarize(name, n_params, per_config[name]) for name in configs]
        for name in configs[1:]:
            infinity.unwrap(models[name])
    finally:
        if args.nvme_path is None:
            shutil.rmtree(swap_dir, ignore_errors=True)
    base = rows[0]["step_s_median"]
    for r in rows:
        r["ratio_vs_in_memory"] = r["step_s_median"] / base
        r["ratio_min_vs_in_memory"] = r["step_s_min"] / rows[0]["step_s_min"]
        r["cpu_ratio_vs_in_memory"] = r["cpu_s_median"] / rows[0]["cpu_s_median"]
        r["ratio_with_zero_grad_vs_in_memory"] = (r["step_with_zero_grad_s_median"]
                                                  / rows[0]["step_with_zero_grad_s_median"])
        # per round (the configurations run back to back): the ratio of each round's steps,
        # robust to slow phases of a shared machine
        r["ratio_per_round_median"] = statistics.median(
            a["step_s"] / b["step_s"] for a, b in zip(per_config[r["config"]],
                                                      per_config["in_memory"]))
    print("\nconfig      step (s)  x in-memory  x per round  x best  x cpu  stalled  "
          "prefetch hits")
    for r in rows:
        print(f"{r['config']:<10} {r['step_s_median']:9.3f}  {r['ratio_vs_in_memory']:10.2f}x"
              f"  {r['ratio_per_round_median']:10.2f}x {r['ratio_min_vs_in_memory']:6.2f}x"
              f" {r['cpu_ratio_vs_in_memory']:5.2f}x"
              f"  {100 * r.get('stall_fraction', 0):6.1f}%  "
              f"{100 * r.get('prefetch_hit_rate', 1):6.0f}%")
    print("\ntime attribution per step (median s): " + ", ".join(ATTRIBUTION))
    for r in rows:
        if "time_median" in r:
            print(f"{r['config']:<10} " + "  ".join(
                f"{k} {r['time_median'][k]:.3f}" for k in ATTRIBUTION if k in r["time_median"]))
    print("\nzero_grad before the step (median s; not in the step time above), and the ratio "
          "with it counted")
    for r in rows:
        print(f"{r['config']:<10} zero_grad {r['zero_grad_s_median']:.3f}  step+zero_grad "
              f"{r['step_with_zero_grad_s_median']:.3f}  "
              f"x in-memory {r['ratio_with_zero_grad_vs_in_memory']:.2f}x")
    print("\nCPU seconds per step (median): main thread, torch intra-op threads, engine threads "
          "(I/O workers, transfers, gradient writer); NVMe GB read / written per step")
    for r in rows:
        c = r["cpu_split_median"]
        io = (f"  read {r['nvme_read_per_step'] / 1e9:.2f} GB  written "
              f"{r['nvme_written_per_step'] / 1e9:.2f} GB" if "nvme_read_per_step" in r else "")
        print(f"{r['config']:<10} main {c['main']:.3f}  intra_op {c['intra_op']:.3f}  "
              f"engine_threads {c['engine_threads']:.3f}{io}")
    out = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "vocab": cfg.vocab_size,
                  "batch": args.batch, "seq": args.seq},
        "quick": args.quick, "verify_checksums": not args.no_verify,
        "io_threads": infinity.io.get_config().num_threads, "results": rows,
    }
    _common.write_json(args.out, out)
    plt = _common.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [r["config"] for r in rows]
        stalled = [r["step_s_median"] * r.get("stall_fraction", 0) for r in rows]
        compute = [r["step_s_median"] - s for r, s in zip(rows, stalled)]
        ax.bar(names, compute, label="compute (incl. hidden transfers)")
        ax.bar(names, stalled, bottom=compute, label="stalled on data")
        ax.set_ylabel("forward+backward step (s)")
        ax.set_title(f"{rows[0]['params'] / 1e6:.0f}M-param GPT, parameters offloaded")
        ax.legend()
        _common.save_figure(fig, os.path.splitext(args.out)[0] + ".png", dpi=110)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
