"""Step time (forward + backward) of a ~300M-parameter GPT with its parameters offloaded to host
RAM and to NVMe, against the same model fully in memory, in one run.

    python benchmarks/bench_offload_forward.py            # ~300M params, 3 measured steps each
    python benchmarks/bench_offload_forward.py --quick    # tiny model, smoke test (CI)

Each configuration runs in its own process (``--worker``), so the in-memory model is plain
PyTorch in a process infinity never touched (the engine sets glibc's allocator thresholds for its
whole process: see infinity/runtime/process/host_memory.py). The processes take turns step by step, so a
noisy phase of this shared machine hits every configuration alike.

For each configuration: median step time over the measured steps (after one warm-up step that
records the schedule), the ratio to the in-memory model, the overlap (seconds stalled waiting
for parameters over the step time: 0 means every transfer was hidden behind compute), the
prefetch hit rate, bytes moved per step, and the page faults and kernel time per step. On a CPU-only machine the "device" is the CPU itself, so the
host tier runs in place and the NVMe tier streams every block from disk into RAM each pass.
Results: benchmarks/results/bench_offload_forward.json (+ .png when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _common  # noqa: E402  (benchmarks/, this script's folder)
import torch  # noqa: E402

import infinity  # noqa: E402
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch  # noqa: E402


def config(quick: bool) -> GPTConfig:
    if quick:
        return GPTConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq=64)
    return GPTConfig(vocab_size=8192, d_model=1024, n_layers=24, n_heads=16, max_seq=256)


# in_memory: plain PyTorch as most loops run it, zero_grad() freeing the gradients (torch's
# default set_to_none=True), so each backward allocates them afresh; in_memory_keep: plain
# PyTorch keeping them (zero_grad(set_to_none=False): a memset, then accumulation in place)
PLAIN = ("in_memory", "in_memory_keep")
CONFIGS = PLAIN + ("host", "nvme")


def default_device() -> str:
    """CUDA when there is one (and INFINITY_DEVICE does not say otherwise), else the CPU."""
    env = os.environ.get("INFINITY_DEVICE")
    return env or ("cuda" if torch.cuda.is_available() else "cpu")


def build(name: str, cfg: GPTConfig, args, swap_dir: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    if name in PLAIN:
        return model.to(args.device)
    infinity.wrap(model, nvme_path=swap_dir, param_tier=name, prefetch_window=args.window,
                  verify_checksums=not args.no_verify, host_budget=args.host_budget,
                  device=args.device)
    return model


def now(device: str) -> float:
    """perf_counter after the device's queued work is done."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


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


def one_step(name: str, model: torch.nn.Module, x, y, device: str = "cpu") -> Dict:
    # zero_grad is timed apart: the in-memory model frees its gradients there (munmap), the
    # engine already inside backward (each block's gradients once offloaded)
    z0 = now(device)
    if name in PLAIN:
        model.zero_grad(set_to_none=name == "in_memory")
    else:
        model._infinity_engine.zero_grad()
    zero_grad_s = now(device) - z0
    if name not in PLAIN:
        infinity.stats(model, reset=True)
    before = thread_cpu()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0, c0 = now(device), time.process_time()
    lm_loss(model(x), y).backward()
    row = {"step_s": now(device) - t0, "cpu_s": time.process_time() - c0,
           "zero_grad_s": zero_grad_s}
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    row["page_faults"] = r1.ru_minflt - r0.ru_minflt
    row["kernel_s"] = r1.ru_stime - r0.ru_stime
    after = thread_cpu()
    delta = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    row["cpu_split"] = {
        "main": delta.get(os.getpid(), 0.0),
        "intra_op": sum(d for t, d in delta.items() if t in COMPUTE_THREADS and t != os.getpid()),
        "engine_threads": sum(d for t, d in delta.items() if t not in COMPUTE_THREADS)}
    if name not in PLAIN:
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
              "page_faults_median": statistics.median(r["page_faults"] for r in rows),
              "kernel_s_median": statistics.median(r["kernel_s"] for r in rows),
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


def _spawn(name: str, args, swap_dir: str) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--swap", swap_dir,
           "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
           "--window", str(args.window)]
    cmd += ["--device", args.device] + ["--quick"] * args.quick + ["--no-verify"] * args.no_verify
    if args.io_threads is not None:
        cmd += ["--io-threads", str(args.io_threads)]
    if args.host_budget is not None:
        cmd += ["--host-budget", str(args.host_budget / 2**30)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _reply(name: str, w: subprocess.Popen) -> Dict:
    """The worker's next JSON line (its other output goes to stderr)."""
    line = w.stdout.readline()
    if not line:
        raise RuntimeError(f"the {name} worker ended (exit code {w.wait()}); see its output "
                           "above")
    return json.loads(line)


def worker(name: str, cfg: GPTConfig, args) -> int:
    """One configuration in its own process: builds it, then runs a step per "step" line on
    stdin and answers each with a JSON line on stdout."""
    if args.io_threads is not None:
        infinity.io.configure(num_threads=args.io_threads)
    x, y = (t.to(args.device) for t in synthetic_batch(cfg, args.batch, args.seq,
                                                       torch.Generator().manual_seed(1)))
    # torch's intra-op threads start with a first parallel computation; any thread started
    # later is the engine's
    torch.ones(1024, 1024) @ torch.ones(1024, 1024)
    COMPUTE_THREADS.update(thread_cpu())
    model = build(name, cfg, args, args.swap)
    out = sys.stdout
    sys.stdout = sys.stderr  # only the JSON answers go to the parent
    out.write(json.dumps({"params": sum(p.numel() for p in model.parameters())}) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip() == "end":
            break
        out.write(json.dumps(one_step(name, model, x, y, args.device)) + "\n")
        out.flush()
    if name not in PLAIN:
        infinity.unwrap(model)
    out.write("{}\n")
    out.flush()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="measured steps per configuration")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--window", type=int, default=2, help="prefetch window (blocks)")
    p.add_argument("--nvme-path", default=None, help="swap directory (default: temp dir)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="configurations to run, comma-separated (in_memory always runs; "
                        "in_memory_keep: the plain model keeping its gradients)")
    p.add_argument("--no-verify", action="store_true",
                   help="verify_checksums=False (sizes the CRC32C's share)")
    p.add_argument("--io-threads", type=int, default=None,
                   help="infinity.io.configure(num_threads=...) (default: the library's)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "bench_offload_forward.json"))
    p.add_argument("--host-budget", type=float, default=None,
                   help="host_budget in GiB for the offloaded configurations (with one, their "
                        "processes keep glibc's 128 KiB mmap threshold: RAM over speed)")
    p.add_argument("--device", default=None,
                   help="where the models compute (default: CUDA when there is one, else CPU)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--swap", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or default_device()
    if args.host_budget is not None:
        args.host_budget = int(args.host_budget * 2**30)
    args.steps = args.steps or (2 if args.quick else 5)
    args.batch = args.batch or (2 if args.quick else 4)
    args.seq = args.seq or (32 if args.quick else 128)
    cfg = config(args.quick)
    configs = ["in_memory"] + [c for c in args.configs.split(",") if c and c != "in_memory"]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown --configs {sorted(unknown)}; choose from {CONFIGS}")
    if args.worker:
        return worker(args.worker, cfg, args)
    swap_dir = args.nvme_path or tempfile.mkdtemp(prefix="bench-offload-", dir=tempfile.gettempdir())
    # One process per configuration; the measured steps go round-robin over them.
    workers = {name: _spawn(name, args, swap_dir) for name in configs}
    per_config: Dict[str, List[Dict]] = {name: [] for name in configs}
    n_params = 0
    try:
        for name, w in workers.items():
            n_params = _reply(name, w)["params"]  # built (and wrapped)
        for step in range(args.steps + 1):  # step 0 is the warm-up (records the schedule)
            for name, w in workers.items():
                w.stdin.write("step\n")
                w.stdin.flush()
                row = _reply(name, w)
                if step:
                    per_config[name].append(row)
            print(f"step {step}: " + "  ".join(
                f"{n} {per_config[n][-1]['step_s']:.3f}s" for n in configs if step), flush=True)
        for name, w in workers.items():
            w.stdin.write("end\n")
            w.stdin.flush()
            _reply(name, w)
        rows = [summarize(name, n_params, per_config[name]) for name in configs]
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.kill()
            w.wait()
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
    # against the faster way of running the plain model (its zero_grad counted: keeping the
    # gradients costs a memset there, freeing them costs page faults in backward)
    plain = [r for r in rows if r["config"] in PLAIN]
    best = min(plain, key=lambda r: r["step_with_zero_grad_s_median"])
    for r in rows:
        r["ratio_vs_best_plain"] = (r["step_with_zero_grad_s_median"]
                                    / best["step_with_zero_grad_s_median"])
    print("\nconfig      step (s)  x in-memory  x per round  x best  x cpu  stalled  "
          "prefetch hits")
    for r in rows:
        print(f"{r['config']:<14} {r['step_s_median']:9.3f}  {r['ratio_vs_in_memory']:10.2f}x"
              f"  {r['ratio_per_round_median']:10.2f}x {r['ratio_min_vs_in_memory']:6.2f}x"
              f" {r['cpu_ratio_vs_in_memory']:5.2f}x"
              f"  {100 * r.get('stall_fraction', 0):6.1f}%  "
              f"{100 * r.get('prefetch_hit_rate', 1):6.0f}%")
    print("\ntime attribution per step (median s): " + ", ".join(ATTRIBUTION))
    for r in rows:
        if "time_median" in r:
            print(f"{r['config']:<14} " + "  ".join(
                f"{k} {r['time_median'][k]:.3f}" for k in ATTRIBUTION if k in r["time_median"]))
    print("\nzero_grad before the step (median s; not in the step time above), and the ratio "
          "with it counted")
    for r in rows:
        print(f"{r['config']:<14} zero_grad {r['zero_grad_s_median']:.3f}  step+zero_grad "
              f"{r['step_with_zero_grad_s_median']:.3f}  "
              f"x in-memory {r['ratio_with_zero_grad_vs_in_memory']:.2f}x")
    print(f"\nstep + zero_grad against the faster plain model ({best['config']})")
    for r in rows:
        print(f"{r['config']:<14} {r['ratio_vs_best_plain']:.3f}x")
    print("\npage faults and kernel seconds per step (median)")
    for r in rows:
        print(f"{r['config']:<14} faults {r['page_faults_median']:>9,.0f}  kernel "
              f"{r['kernel_s_median']:.3f} s")
    print("\nCPU seconds per step (median): main thread, torch intra-op threads, engine threads "
          "(I/O workers, transfers, gradient writer); NVMe GB read / written per step")
    for r in rows:
        c = r["cpu_split_median"]
        io = (f"  read {r['nvme_read_per_step'] / 1e9:.2f} GB  written "
              f"{r['nvme_written_per_step'] / 1e9:.2f} GB" if "nvme_read_per_step" in r else "")
        print(f"{r['config']:<14} main {c['main']:.3f}  intra_op {c['intra_op']:.3f}  "
              f"engine_threads {c['engine_threads']:.3f}{io}")
    out = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "device": args.device,
        "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "vocab": cfg.vocab_size,
                  "batch": args.batch, "seq": args.seq},
        "quick": args.quick, "verify_checksums": not args.no_verify,
        "host_budget": args.host_budget,
        "io_threads": args.io_threads or infinity.io.get_config().num_threads, "results": rows,
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
