"""Optimizer step time: infinity.optim.AdamW with states in host RAM and on NVMe vs torch's fused
AdamW in memory, for a model of plain nn.Linear layers (default ~500M parameters).

    python benchmarks/bench_optimizer.py                 # ~500M params, fp32
    python benchmarks/bench_optimizer.py --quick         # ~20M params, a few seconds
    python benchmarks/bench_optimizer.py --threads 1,2,4,8,16   # thread sweep (see below)

Gradients are random values written straight into the engine's gradient buffers (no backward),
so only the optimizer step is timed. Each configuration runs ``--steps`` steps after one warm-up
step (for NVMe the warm-up also creates the state files); torch's baseline runs before and
after ours and its median is over both; the table shows medians. Results go to
benchmarks/results/bench_optimizer.json (and a PNG when matplotlib imports).

``--threads 1,2,4,8,16`` sweeps thread counts: for each count it sets both torch's
(``torch.set_num_threads``) and infinity's (``infinity.ops.set_num_threads``; infinity does not
follow torch's setting or OMP_NUM_THREADS, its default is the CPUs of the affinity mask) and
steps torch fused, infinity on plain parameters, infinity with host states, and each side's
bare kernel called per tensor over the same tensors (``infinity_kernel``: the native kernel
without infinity.optim's Python work; ``torch_kernel``: ``aten::_fused_adamw_`` without
torch.optim's) in interleaved rounds, the order rotating each round so no configuration always
follows the same one (libgomp's threads spin for a while after torch's step; ours for 2 ms).
Reported per thread count: medians, ``vs_torch`` = torch step / this step (its throughput over
torch fused's; below 1: slower), the median of the per-round ratios, and
``kernel_vs_torch_kernel`` (kernel against kernel: thread pool and SIMD code, no Python), with
per-call median / p90 / max of the kernel rows (a long tail: threads that started late). No
NVMe row. ``--gap-ms`` sleeps before each step (spinning threads go idle first) as a control.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/, this script's folder)

import infinity  # noqa: E402
from infinity import ops  # noqa: E402
from infinity.runtime import engine_of  # noqa: E402

logger = logging.getLogger("bench_optimizer")
HERE = os.path.dirname(os.path.abspath(__file__))


class LinearStack(nn.Module):
    """``layers`` bias-free square Linear layers in an nn.ModuleList (one block each)."""

    def __init__(self, layers: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.utils.skip_init(nn.Linear, width, width, bias=False, dtype=dtype)
            for _ in range(layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.uniform_(-0.02, 0.02)


def shape_for(n_params: float, quick: bool) -> tuple:
    width = 1024 if quick else 4096
    layers = max(1, round(n_params / (width * width)))
    return layers, width


def timed_steps(step: Callable[[], None], steps: int) -> List[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def bench_torch(layers: int, width: int, dtype: torch.dtype, steps: int) -> Dict:
    model = LinearStack(layers, width, dtype)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    opt.step()  # warm-up: allocates the states
    times = timed_steps(opt.step, steps)
    del opt, model
    gc.collect()
    return {"name": "torch_fused_adamw", "times": times}


def bench_plain(layers: int, width: int, dtype: torch.dtype, steps: int) -> Dict:
    """infinity.optim.AdamW on an unwrapped model's plain parameters (per-parameter state)."""
    model = LinearStack(layers, width, dtype)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3, generator=gen)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()  # warm-up: allocates the states
    times = timed_steps(opt.step, steps)
    del opt, model
    gc.collect()
    return {"name": "infinity_plain", "times": times}


def bench_infinity(layers: int, width: int, dtype: torch.dtype, steps: int, tier: str,
                   nvme_path: Optional[str]) -> Dict:
    model = LinearStack(layers, width, dtype)
    kw = dict(optimizer_tier=tier, param_tier="host", grad_tier="host")
    if tier == "nvme":
        kw["nvme_path"] = nvme_path
    infinity.wrap(model, **kw)
    engine = engine_of(model)
    gen = torch.Generator().manual_seed(0)
    for flat in engine.flats:   # gradients as the engine leaves them after backward
        grad = flat.ensure_grad_buffer()
        grad.uniform_(-1e-3, 1e-3, generator=gen)
        flat.grad_ready = [True] * len(flat.slots)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()  # warm-up: creates (and for NVMe writes) the states
    stats = []

    def step() -> None:
        opt.step()
        stats.append(opt.last_step_stats)

    times = timed_steps(step, steps)
    hidden = [s.hidden_fraction for s in stats if s.hidden_fraction is not None]
    row = {"name": f"infinity_{tier}", "times": times,
           "compute_s_median": statistics.median(s.compute_s for s in stats),
           "io_wait_s_median": statistics.median(s.io_wait_s for s in stats),
           "hidden_fraction_median": statistics.median(hidden) if hidden else None,
           "bytes_moved_per_step": stats[-1].bytes_read + stats[-1].bytes_written}
    opt.close()
    infinity.unwrap(model)
    del opt, model
    gc.collect()
    return row


def _interleaved_setup(layers: int, width: int, dtype: torch.dtype) -> tuple:
    """Three models (torch fused, infinity plain, infinity host states) with gradients set,
    their optimizers, and the names of the rows."""
    gen = torch.Generator().manual_seed(0)
    models = [LinearStack(layers, width, dtype) for _ in range(3)]
    for model in models[:2]:
        for p in model.parameters():
            p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3, generator=gen)
    infinity.wrap(models[2], optimizer_tier="host", param_tier="host", grad_tier="host")
    for flat in engine_of(models[2]).flats:
        flat.ensure_grad_buffer().uniform_(-1e-3, 1e-3, generator=gen)
        flat.grad_ready = [True] * len(flat.slots)
    opts = [torch.optim.AdamW(models[0].parameters(), lr=1e-4, fused=True),
            infinity.optim.AdamW(models[1].parameters(), lr=1e-4),
            infinity.optim.AdamW(models[2].parameters(), lr=1e-4)]
    return models, opts, ["torch_fused_adamw", "infinity_plain", "infinity_host"]


def _interleaved_teardown(models: List[nn.Module], opts: list) -> None:
    opts[2].close()
    infinity.unwrap(models[2])
    del opts[:], models[:]
    gc.collect()


def interleaved(layers: int, width: int, dtype: torch.dtype, steps: int) -> List[Dict]:
    """torch fused, infinity on plain parameters and with host states, set up side by side
    and stepped in turns (torch, plain, host, torch, ...): a slow phase of this shared machine
    hits all three alike. Needs the three models' memory at once."""
    models, opts, names = _interleaved_setup(layers, width, dtype)
    rows = [{"name": n, "times": []} for n in names]
    for opt in opts:
        opt.step()  # warm-up: allocates the states
    for _ in range(steps):
        for row, opt in zip(rows, opts):
            t0 = time.perf_counter()
            opt.step()
            row["times"].append(time.perf_counter() - t0)
    # the ratio of each round's steps, robust to slow phases
    for row in rows:
        row["ratio_per_round_median"] = statistics.median(
            a / b for a, b in zip(rows[0]["times"], row["times"]))
    _interleaved_teardown(models, opts)
    return rows


def _kernel_step(opt: torch.optim.Optimizer, model: nn.Module,
                 calls: List[float]) -> Callable[[], None]:
    """The plain row's work without the optimizer: one native kernel call per parameter over
    the same tensors (its own step count; the values only drift). Appends each call's time to
    ``calls``."""
    tensors = []
    for p in model.parameters():
        state = opt.state[p]
        tensors.append((p.data.view(-1), p.grad.view(-1), state["exp_avg"].view(-1),
                        state["exp_avg_sq"].view(-1)))
    group = opt.param_groups[0]  # the plain row's hyper-parameters
    hyper = dict(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                 beta2=float(group["betas"][1]), eps=float(group["eps"]),
                 weight_decay=float(group["weight_decay"]))
    count = [0]

    def step() -> None:
        count[0] += 1
        for p, g, m, v in tensors:
            t0 = time.perf_counter()
            ops.cpu_adam_step(p, g, m, v, step=count[0], **hyper)
            calls.append(time.perf_counter() - t0)
    return step


def _torch_kernel_step(opt: torch.optim.Optimizer, model: nn.Module,
                       calls: List[float]) -> Optional[Callable[[], None]]:
    """torch's fused CPU kernel called per tensor (``aten::_fused_adamw_`` on one tensor, as
    the fused optimizer's kernel loops over them) on the torch row's tensors, without
    torch.optim's Python work; None where this torch has no such op."""
    fused = getattr(torch, "_fused_adamw_", None)
    if fused is None:
        return None
    group = opt.param_groups[0]
    hyper = dict(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                 beta2=float(group["betas"][1]), weight_decay=float(group["weight_decay"]),
                 eps=float(group["eps"]), amsgrad=False, maximize=False)
    tensors = [(p.data, p.grad, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
               for p in model.parameters()]
    step_t = torch.zeros((), dtype=torch.float32)

    def step() -> None:
        step_t.add_(1)
        for p, g, m, v in tensors:
            t0 = time.perf_counter()
            fused([p], [g], [m], [v], [], [step_t], **hyper)
            calls.append(time.perf_counter() - t0)
    return step


def parse_threads(text: str) -> List[int]:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes counts like 1,2,4,8,16, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--threads: counts must be >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def thread_environment() -> Dict:
    """What decides how each side runs its threads, recorded with the results."""
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                      "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY",
                                      "KMP_AFFINITY", "INFINITY_CPU_CAPABILITY")
           if k in os.environ}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        torch_cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        torch_cap = None
    try:  # NUMA nodes and SMT: where 16 "cores" may be 8 cores x 2 or span two nodes
        numa = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")])
    except OSError:
        numa = None
    try:
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as fh:
            siblings = fh.read().strip()
    except OSError:
        siblings = None
    return {"affinity_cpus": cpus, "cpu_count": os.cpu_count(), "cpu": _common.cpu_model(),
            "numa_nodes": numa, "cpu0_thread_siblings": siblings,
            "torch_version": torch.__version__, "torch_cpu_capability": torch_cap,
            "infinity_cpu_capability": ops.cpu_capability(),
            "torch_parallel_info": torch.__config__.parallel_info().splitlines()[:8],
            "env": env}


def thread_sweep(layers: int, width: int, dtype: torch.dtype, steps: int,
                 threads_list: List[int], gap_s: float, n_params: int) -> List[Dict]:
    """Per thread count: torch fused, infinity plain, infinity host and the bare kernel, set
    up once, stepped in interleaved rounds whose order rotates; medians and per-round ratios."""
    models, opts, names = _interleaved_setup(layers, width, dtype)
    for opt in opts:
        opt.step()  # allocates the states (the kernel rows use the torch and plain rows')
    calls: Dict[str, List[float]] = {"infinity_kernel": [], "torch_kernel": []}
    steps_fns = [opt.step for opt in opts] + [_kernel_step(opts[1], models[1],
                                                           calls["infinity_kernel"])]
    names = names + ["infinity_kernel"]
    torch_kernel = _torch_kernel_step(opts[0], models[0], calls["torch_kernel"])
    if torch_kernel is not None:
        steps_fns.append(torch_kernel)
        names.append("torch_kernel")
    saved = (torch.get_num_threads(), ops.get_num_threads())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    sweep = []
    try:
        for threads in threads_list:
            torch.set_num_threads(threads)
            ops.set_num_threads(threads)
            for fn in steps_fns:  # warm-up: worker threads for this count, both pools
                fn()
            for c in calls.values():
                c.clear()
            times: Dict[str, List[float]] = {n: [] for n in names}
            for r in range(steps):
                k = r % len(names)
                for name, fn in list(zip(names, steps_fns))[k:] + list(zip(names, steps_fns))[:k]:
                    if gap_s:
                        time.sleep(gap_s)
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            ref = times["torch_fused_adamw"]
            rows = []
            for name in names:
                med = statistics.median(times[name])
                row = {"name": name, "threads": threads, "times": times[name],
                       "step_s_median": med, "params_per_s": n_params / med,
                       "ratio_per_round_median": statistics.median(
                           a / b for a, b in zip(ref, times[name]))}
                if calls.get(name):  # per kernel call: a long tail means late threads
                    c = sorted(calls[name])
                    row.update({"call_s_median": statistics.median(c),
                                "call_s_p90": c[int(0.9 * (len(c) - 1))], "call_s_max": c[-1],
                                "calls": len(c)})
                rows.append(row)
            entry = {"threads": threads, "torch_threads": torch.get_num_threads(),
                     "infinity_threads": ops.get_num_threads(),
                     "oversubscribed": threads > cpus, "rows": rows,
                     "vs_torch": {r["name"]: r["ratio_per_round_median"]
                                  for r in rows[1:]},
                     "vs_torch_of_medians": {r["name"]: statistics.median(ref) /
                                             r["step_s_median"] for r in rows[1:]}}
            if "torch_kernel" in times:  # kernel against kernel, both without Python work
                entry["kernel_vs_torch_kernel"] = statistics.median(
                    a / b for a, b in zip(times["torch_kernel"], times["infinity_kernel"]))
            sweep.append(entry)
            logger.info("threads %d: %s", threads, ", ".join(
                f"{n} {v:.3f}x" for n, v in entry["vs_torch"].items()))
    finally:
        torch.set_num_threads(saved[0])
        ops.set_num_threads(saved[1])
        _interleaved_teardown(models, opts)
    return sweep


def print_sweep(sweep: List[Dict]) -> None:
    names = [r["name"] for r in sweep[0]["rows"]]
    short = [n.replace("infinity_", "").replace("torch_fused_adamw", "torch") for n in names]
    head = f"{'threads':>7} " + " ".join(f"{n + ' s':>13}" for n in short)
    head += " " + " ".join(f"{n + '/torch':>13}" for n in short[1:])
    has_kernels = "kernel_vs_torch_kernel" in sweep[0]
    if has_kernels:
        head += f" {'kernel/kernel':>13}"
    lines = [head]
    for e in sweep:
        line = f"{e['threads']:>7} " + " ".join(f"{r['step_s_median']:>13.4f}" for r in e["rows"])
        line += " " + " ".join(f"{e['vs_torch'][n]:>12.3f}x" for n in names[1:])
        if has_kernels:
            line += f" {e['kernel_vs_torch_kernel']:>12.3f}x"
        lines.append(line + ("  (oversubscribed)" if e["oversubscribed"] else ""))
    print("\n".join(lines))  # the table is the program's output
    print("x/torch: median over rounds of (torch fused optimizer step / this step); < 1: slower;"
          " kernel/kernel: torch_kernel / infinity_kernel")


def plot_sweep(sweep: List[Dict], path: str) -> None:
    plt = _common.pyplot(logger)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    threads = [e["threads"] for e in sweep]
    for name in sweep[0]["vs_torch"]:
        ax.plot(threads, [e["vs_torch"][name] for e in sweep], marker="o", label=name)
    if "kernel_vs_torch_kernel" in sweep[0]:
        ax.plot(threads, [e["kernel_vs_torch_kernel"] for e in sweep], marker="s", ls="--",
                label="infinity_kernel vs torch_kernel")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(threads, [str(t) for t in threads])
    ax.set_xlabel("threads (torch and infinity)")
    ax.set_ylabel("torch fused step / ours")
    ax.legend(fontsize=7)
    _common.save_figure(fig, path)


def summarize(row: Dict, n_params: int) -> Dict:
    med = statistics.median(row["times"])
    row["step_s_median"] = med
    row["params_per_s"] = n_params / med
    return row


def print_table(rows: List[Dict], ref: float) -> None:
    lines = [f"{'configuration':<20} {'step s (median)':>16} {'M params/s':>11} "
             f"{'vs torch':>9} {'NVMe hidden':>12}"]
    for r in rows:
        hidden = r.get("hidden_fraction_median")
        lines.append(f"{r['name']:<20} {r['step_s_median']:>16.3f} "
                     f"{r['params_per_s'] / 1e6:>11.0f} {ref / r['step_s_median']:>8.2f}x "
                     f"{'' if hidden is None else f'{hidden:.0%}':>12}")
    print("\n".join(lines))  # the table is the program's output


def plot(rows: List[Dict], path: str) -> None:
    plt = _common.pyplot(logger)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r["name"] for r in rows], [r["params_per_s"] / 1e6 for r in rows])
    ax.set_xlabel("M params / s (optimizer step)")
    _common.save_figure(fig, path)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=500e6)
    ap.add_argument("--quick", action="store_true", help="~20M params, a few seconds")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--nvme-path", default=None, help="directory for the state files "
                    "(default: a temporary directory under /tmp)")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "bench_optimizer.json"))
    ap.add_argument("--no-nvme", action="store_true", help="skip the NVMe-states row")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--interleave", action="store_true",
                    help="torch, plain and host set up together and stepped in turns (needs "
                         "their memory at once; no NVMe row)")
    ap.add_argument("--threads", type=parse_threads, default=None, metavar="N[,N...]",
                    help="thread counts to sweep, e.g. 1,2,4,8,16: sets torch's and infinity's "
                         "threads to each, steps torch fused / plain / host and both bare "
                         "kernels in rotating interleaved rounds and reports infinity/torch per "
                         "count (no NVMe row)")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="with --threads: sleep this long before each timed step (a control: "
                         "the previous step's spinning threads go idle first)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.steps < 3:
        ap.error("--steps must be >= 3 (medians of at least 3 steps)")
    n_target = 20e6 if args.quick else args.params
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    layers, width = shape_for(n_target, args.quick)
    n_params = layers * width * width
    logger.info("model: %d x Linear(%d, %d), %s params, %s, torch %d threads", layers, width,
                width, f"{n_params:,}", args.dtype, torch.get_num_threads())
    result = {"date": time.strftime("%Y-%m-%d"), "params": n_params, "layers": layers,
              "width": width, "dtype": args.dtype, "steps": args.steps,
              "interleaved": args.interleave or args.threads is not None,
              "machine": _common.cores(),
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:]))}
    if args.threads is not None:
        environment = thread_environment()  # before the sweep changes the thread counts
        sweep = thread_sweep(layers, width, dtype, args.steps, args.threads,
                             args.gap_ms / 1e3, n_params)
        print_sweep(sweep)
        result.update({"threads": args.threads, "gap_ms": args.gap_ms,
                       "thread_environment": environment, "threads_sweep": sweep,
                       "rows": [r for e in sweep for r in e["rows"]]})
        _common.write_json(args.json, result)
        if not args.no_plot:
            plot_sweep(sweep, os.path.splitext(args.json)[0] + ".png")
        return 0
    if args.interleave:
        rows = [summarize(r, n_params) for r in interleaved(layers, width, dtype, args.steps)]
        print_table(rows, rows[0]["step_s_median"])
        print("per-round ratio (torch step / this step), median: " + ", ".join(
            f"{r['name']} {r['ratio_per_round_median']:.3f}x" for r in rows))
    else:
        rows = sequential(args, layers, width, dtype)
        rows = [summarize(r, n_params) for r in rows]
        print_table(rows, rows[0]["step_s_median"])
    result["rows"] = rows
    _common.write_json(args.json, result)
    if not args.no_plot:
        plot(rows, os.path.splitext(args.json)[0] + ".png")
    return 0


def sequential(args, layers: int, width: int, dtype: torch.dtype) -> List[Dict]:
    with tempfile.TemporaryDirectory(dir=args.nvme_path or "/tmp",
                                     prefix="bench-optim-") as nvme:
        # torch's baseline runs before and after ours (this shared machine drifts): its
        # median is over both runs
        before = bench_torch(layers, width, dtype, args.steps)
        plain = bench_plain(layers, width, dtype, args.steps)
        host = bench_infinity(layers, width, dtype, args.steps, "host", None)
        rows = [before, plain, host]
        if not args.no_nvme:
            rows.append(bench_infinity(layers, width, dtype, args.steps, "nvme", nvme))
        after = bench_torch(layers, width, dtype, args.steps)
        before["times"] = before["times"] + after["times"]
    return rows


if __name__ == "__main__":
    sys.exit(main())
