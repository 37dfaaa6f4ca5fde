"""Optimizer step time: infinity.optim.AdamW with states in host RAM and on NVMe vs torch's fused
AdamW in memory, for a model of plain nn.Linear layers (default ~500M parameters).

    python benchmarks/bench_optimizer.py                 # ~500M params, fp32
    python benchmarks/bench_optimizer.py --quick         # ~20M params, a few seconds

Gradients are random values written straight into the engine's gradient buffers (no backward),
so only the optimizer step is timed. Each configuration runs ``--steps`` steps after one warm-up
step (for NVMe the warm-up also creates the state files); torch's baseline runs before and
after ours and its median is over both; the table shows medians. Results go to
benchmarks/results/bench_optimizer.json (and a PNG when matplotlib imports).
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


def interleaved(layers: int, width: int, dtype: torch.dtype, steps: int) -> List[Dict]:
    """torch fused, infinity on plain parameters and with host states, set up side by side
    and stepped in turns (torch, plain, host, torch, ...): a slow phase of this shared machine
    hits all three alike. Needs the three models' memory at once."""
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
    rows = [{"name": n, "times": []} for n in ("torch_fused_adamw", "infinity_plain",
                                                 "infinity_host")]
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
    opts[2].close()
    infinity.unwrap(models[2])
    return rows


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
    if args.interleave:
        rows = [summarize(r, n_params) for r in interleaved(layers, width, dtype, args.steps)]
        print_table(rows, rows[0]["step_s_median"])
        print("per-round ratio (torch step / this step), median: " + ", ".join(
            f"{r['name']} {r['ratio_per_round_median']:.3f}x" for r in rows))
    else:
        rows = sequential(args, layers, width, dtype)
        rows = [summarize(r, n_params) for r in rows]
        print_table(rows, rows[0]["step_s_median"])
    result = {"date": time.strftime("%Y-%m-%d"), "params": n_params, "layers": layers,
              "width": width, "dtype": args.dtype, "steps": args.steps,
              "interleaved": args.interleave, "machine": _common.cores(),
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
              "rows": rows}
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
