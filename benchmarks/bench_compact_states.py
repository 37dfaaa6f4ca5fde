"""Compact optimizer states (``infinity.optim.AdamW(..., states="fp32"|"bf16"|"8bit")``): NVMe
optimizer step time and bytes per step, and convergence against fp32 states.

    python benchmarks/bench_compact_states.py            # ~100M params, 300 training steps
    python benchmarks/bench_compact_states.py --quick    # seconds (run by the tests)
    python benchmarks/bench_compact_states.py --masters  # bf16 master weights (master=...)

``--masters`` compares bf16 master weights (``master="bf16_sr"`` stochastic rounding,
``"bf16_kahan"`` with a compensation term) against fp32 states: the configurations are
fp32, bf16 (moments), bf16+bf16_sr, bf16+bf16_kahan and 8bit+bf16_sr ("<states>+<master>"),
results in bench_compact_states_master.json (+ .png). With a bf16 master every parameter's
master is in the optimizer state (the fp32 model's parameters then hold bf16 values).

(1) NVMe step: bias-free square Linear layers (one block each, ~100M params), parameters and
    gradients in host RAM, states on NVMe. Gradients are random values written
    into the engine's gradient buffers (no backward), so only ``opt.step()`` is timed. Each
    format runs one warm-up step (creates the extents), then ``--steps`` timed steps; the
    formats run round-robin (``--rounds`` rounds) so drift of this shared machine hits all
    alike -- or, when all formats' models would not fit in half the free RAM (or with
    ``--sequential``), one format at a time, each model freed before the next is built. Medians of step time, CPU Adam time, I/O wait; bytes per step from StepStats.
(2) Convergence: the demo task (infinity/demo.py's TinyGPT and synthetic data at 4 layers x
    d_model 128, seq 32, batch 8; its optimizer settings: AdamW lr 5e-4, wd 0.01, 5-step
    warm-up) and a tiny Llama (transformers LlamaForCausalLM from a LlamaConfig, hidden 128, 4
    layers, no download; lr 1e-3) trained ``--train-steps`` steps with each state format,
    parameters and states wrapped on the host tier (the tier changes no bit of the result, see
    tests/feature/optim/test_optim_compact.py); the same batches for every format. "Final loss" =
    mean of
    the last 20 steps' losses (one batch's loss is noisy); the target is within 2% of fp32's.
    Loss curves go to a PNG.

Results: benchmarks/results/bench_compact_states.json (+ .png).
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
from typing import Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/, this script's folder)

import infinity  # noqa: E402
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch  # noqa: E402
from infinity.runtime import engine_of  # noqa: E402

logger = logging.getLogger("bench_compact_states")
HERE = os.path.dirname(os.path.abspath(__file__))
FORMATS = ("fp32", "bf16", "8bit")
MASTER_CONFIGS = ("fp32", "bf16", "bf16+bf16_sr", "bf16+bf16_kahan", "8bit+bf16_sr")


def split(config: str) -> tuple:
    """"<states>[+<master>]" -> (states, master)."""
    states, _, master = config.partition("+")
    return states, master or "fp32"
TAIL = 20  # steps averaged for the "final loss"


# ---- (1) NVMe optimizer step -------------------------------------------------------------
class LinearStack(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.utils.skip_init(nn.Linear, width, width, bias=False)
                                    for _ in range(layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.uniform_(-0.02, 0.02)


class StepCase:
    """One state format: a wrapped LinearStack with random gradients and its optimizer."""

    def __init__(self, fmt: str, layers: int, width: int, nvme: str) -> None:
        self.fmt = fmt
        self.model = LinearStack(layers, width)
        path = os.path.join(nvme, fmt.replace("+", "_"))
        os.makedirs(path, exist_ok=True)
        infinity.wrap(self.model, nvme_path=path, param_tier="host", grad_tier="host",
                      optimizer_tier="nvme")
        gen = torch.Generator().manual_seed(0)
        for flat in engine_of(self.model).flats:
            flat.ensure_grad_buffer().uniform_(-1e-3, 1e-3, generator=gen)
            flat.grad_ready = [True] * len(flat.slots)
        states, master = split(fmt)
        self.opt = infinity.optim.AdamW(self.model.parameters(), lr=1e-4, states=states,
                                        master=master)
        self.opt.step()  # warm-up: creates and writes the state extents
        self.times: List[float] = []
        self.stats: List = []

    def step(self) -> None:
        t0 = time.perf_counter()
        self.opt.step()
        self.times.append(time.perf_counter() - t0)
        self.stats.append(self.opt.last_step_stats)

    def row(self, n_params: int) -> Dict:
        st = self.stats[-1]
        hidden = [s.hidden_fraction for s in self.stats if s.hidden_fraction is not None]
        return {"states": self.fmt, "times": self.times,
                "step_s_median": statistics.median(self.times),
                "compute_s_median": statistics.median(s.compute_s for s in self.stats),
                "io_wait_s_median": statistics.median(s.io_wait_s for s in self.stats),
                "hidden_fraction_median": statistics.median(hidden) if hidden else None,
                "bytes_read": st.bytes_read, "bytes_written": st.bytes_written,
                "bytes_per_step": st.bytes_read + st.bytes_written,
                "bytes_per_param_each_way": st.bytes_read / n_params,
                "nvme_bytes_held": self.opt.state_bytes["nvme"]}

    def close(self) -> None:
        self.opt.close()
        infinity.unwrap(self.model)
        del self.opt, self.model
        gc.collect()


# Host bytes per parameter a live StepCase holds (fp32 parameter and gradient, the engine's
# buffers and the optimizer's staging); a rough bound used to decide whether every format's
# case fits in RAM at once.
HOST_BYTES_PER_PARAM = 16


def _available_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def bench_nvme_step(n_target: float, width: int, steps: int, rounds: int, nvme: str,
                    formats: tuple = FORMATS, sequential: Optional[bool] = None) -> tuple:
    """Round-robin over the formats when every format's case fits in half the available RAM
    (drift of the shared machine then hits all alike); otherwise (or with sequential=True) one
    format at a time, each case closed and freed before the next is built."""
    layers = max(1, round(n_target / (width * width)))
    n_params = layers * width * width
    if sequential is None:
        avail = _available_bytes()
        need = len(formats) * n_params * HOST_BYTES_PER_PARAM
        sequential = avail is not None and need > avail // 2
    logger.info("(1) NVMe step: %d x Linear(%d, %d) = %s params, %d rounds x %d steps, %s",
                layers, width, width, f"{n_params:,}", rounds, steps,
                "one format at a time" if sequential else "formats round-robin")
    rows = []
    if sequential:
        for fmt in formats:
            case = StepCase(fmt, layers, width, nvme)
            try:
                for _ in range(rounds * steps):
                    case.step()
                rows.append(case.row(n_params))
            finally:
                case.close()
                del case
                gc.collect()
    else:
        cases = {}
        try:
            for fmt in formats:  # all live at once: their states on disk, buffers in RAM
                cases[fmt] = StepCase(fmt, layers, width, nvme)
            for _ in range(rounds):
                for fmt in formats:
                    for _ in range(steps):
                        cases[fmt].step()
            rows = [cases[fmt].row(n_params) for fmt in formats]
        finally:
            for case in cases.values():
                case.close()
            cases.clear()
            gc.collect()
    for r in rows:
        r["schedule"] = "sequential" if sequential else "round-robin"
    ref = rows[0]
    for r in rows:
        r["time_vs_fp32"] = r["step_s_median"] / ref["step_s_median"]
        r["bytes_vs_fp32"] = r["bytes_per_step"] / ref["bytes_per_step"]
    return n_params, rows


# ---- (2) convergence ---------------------------------------------------------------------
def _demo_model(quick: bool):
    # demo.py's model family and data (its default 8 x 256 is ~1.5 s a step on 2 shared
    # cores: 1,800 steps would not fit the ~10 minutes this benchmark gets)
    layers, d_model, seq = (1, 32, 16) if quick else (4, 128, 32)
    cfg = GPTConfig(vocab_size=128, d_model=d_model, n_layers=layers,
                    n_heads=max(1, d_model // 64), max_seq=seq)
    torch.manual_seed(0)
    return TinyGPT(cfg), cfg, seq, dict(lr=5e-4, weight_decay=0.01)


def _llama_model(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers = (32, 1) if quick else (128, 4)
    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    cfg = GPTConfig(vocab_size=128, max_seq=64)  # the data: synthetic_batch over 128 tokens
    return model, cfg, 16 if quick else 32, dict(lr=1e-3, weight_decay=0.01)


def train(task: str, fmt: str, steps: int, batch: int, quick: bool) -> Dict:
    model, cfg, seq, hyper = (_demo_model if task == "demo" else _llama_model)(quick)
    # host tiers: the states' tier does not change a single bit of the result
    # (tests/feature/optim/test_optim_compact.py), and NVMe latency on this shared disk would double
    # the time
    infinity.wrap(model, param_tier="host", optimizer_tier="host")
    states, master = split(fmt)
    opt = infinity.optim.AdamW(model.parameters(), states=states, master=master, **hyper)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    gen = torch.Generator().manual_seed(1)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = synthetic_batch(cfg, batch, seq, gen)
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        loss = lm_loss(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    held = opt.state_bytes["host"]
    opt.close()
    infinity.unwrap(model)
    return {"losses": losses, "s_per_step": elapsed / steps, "params": n_params,
            "state_bytes_held": held}


def bench_convergence(task: str, steps: int, batch: int, quick: bool,
                      formats: tuple = FORMATS) -> Dict:
    runs = {fmt: train(task, fmt, steps, batch, quick) for fmt in formats}
    tail = min(TAIL, steps)
    final = {fmt: statistics.fmean(r["losses"][-tail:]) for fmt, r in runs.items()}
    out = {"task": task, "steps": steps, "batch": batch, "params": runs["fp32"]["params"],
           "final_loss": final,
           "last_loss": {fmt: r["losses"][-1] for fmt, r in runs.items()},
           "first_loss": runs["fp32"]["losses"][0],
           "rel_diff_vs_fp32": {fmt: final[fmt] / final["fp32"] - 1.0 for fmt in formats},
           "s_per_step": {fmt: r["s_per_step"] for fmt, r in runs.items()},
           "state_bytes_held": {fmt: r["state_bytes_held"] for fmt, r in runs.items()},
           "losses": {fmt: r["losses"] for fmt, r in runs.items()}}
    out["within_2pct"] = all(abs(d) <= 0.02 for d in out["rel_diff_vs_fp32"].values())
    logger.info("(2) %s (%s params, %d steps): final loss %s", task, f"{out['params']:,}",
                steps, ", ".join(f"{f} {v:.4f} ({out['rel_diff_vs_fp32'][f]:+.2%})"
                                 for f, v in final.items()))
    return out


# ---- output ------------------------------------------------------------------------------
def print_tables(n_params: int, rows: List[Dict], conv: List[Dict],
                 formats: tuple = FORMATS) -> None:
    lines = [f"(1) NVMe optimizer step, {n_params / 1e6:.0f}M params (params/grads in RAM, "
             "states on NVMe); medians",
             f"{'states':<15} {'step s':>8} {'vs fp32':>8} {'Adam s':>8} {'I/O wait s':>11} "
             f"{'MB read':>9} {'MB written':>11} {'B/param/way':>12} {'bytes vs fp32':>14}"]
    for r in rows:
        lines.append(f"{r['states']:<15} {r['step_s_median']:>8.3f} {r['time_vs_fp32']:>7.2f}x "
                     f"{r['compute_s_median']:>8.3f} {r['io_wait_s_median']:>11.3f} "
                     f"{r['bytes_read'] / 1e6:>9.0f} {r['bytes_written'] / 1e6:>11.0f} "
                     f"{r['bytes_per_param_each_way']:>12.2f} {r['bytes_vs_fp32']:>13.2f}x")
    lines.append("")
    lines.append(f"(2) convergence: mean loss of the last {TAIL} steps")
    lines.append(f"{'task':<6} {'params':>9} {'steps':>6} " + " ".join(
        f"{f:>18}" for f in formats) + "  within 2%")
    for c in conv:
        cells = " ".join(f"{c['final_loss'][f]:>10.4f} ({c['rel_diff_vs_fp32'][f]:+.2%})"
                         for f in formats)
        lines.append(f"{c['task']:<6} {c['params']:>9,} {c['steps']:>6} {cells}  "
                     f"{c['within_2pct']}")
    print("\n".join(lines))


def plot(conv: List[Dict], path: str, formats: tuple = FORMATS) -> None:
    plt = _common.pyplot(logger)
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(conv), figsize=(5 * len(conv), 3.5))
    for ax, c in zip(axes if len(conv) > 1 else [axes], conv):
        for fmt in formats:
            losses = torch.tensor(c["losses"][fmt])
            k = min(10, len(losses))
            smooth = torch.nn.functional.avg_pool1d(losses[None, None], k, 1)[0, 0]
            ax.plot(range(k, len(losses) + 1), smooth.tolist(),
                    label=f"{fmt} (final {c['final_loss'][fmt]:.3f})")
        ax.set_title(f"{c['task']} ({c['params'] / 1e6:.1f}M params)")
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss ({min(10, c['steps'])}-step mean)")
        ax.set_yscale("log")
        ax.legend()
    _common.save_figure(fig, path, dpi=100)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    ap.add_argument("--steps", type=int, default=2, help="timed NVMe steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sequential", action="store_true",
                    help="NVMe step: one format at a time, each freed before the next (chosen "
                         "automatically when all formats would not fit in half the free RAM)")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nvme-path", default=None, help="directory for the state files "
                    "(default: a temporary directory under /tmp)")
    ap.add_argument("--json", default=None, help="results file (default: results/"
                    "bench_compact_states.json, or bench_compact_states_master.json)")
    ap.add_argument("--masters", action="store_true",
                    help="compare bf16 master weights (fp32, bf16, bf16+bf16_sr, "
                         "bf16+bf16_kahan, 8bit+bf16_sr) instead of the moment formats")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    formats = MASTER_CONFIGS if args.masters else FORMATS
    if args.json is None:
        args.json = os.path.join(HERE, "results", "bench_compact_states_master.json"
                                 if args.masters else "bench_compact_states.json")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.quick:
        args.params, args.train_steps, args.rounds, args.batch = 1e6, 10, 1, 2
    width = 512 if args.quick else 4096
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.nvme_path or "/tmp",
                                     prefix="bench-compact-") as nvme:
        n_params, rows = bench_nvme_step(args.params, width, args.steps, args.rounds, nvme,
                                         formats, sequential=True if args.sequential else None)
    conv = [bench_convergence(task, args.train_steps, args.batch, args.quick, formats)
            for task in ("demo", "llama")]
    print_tables(n_params, rows, conv, formats)
    result = {"date": time.strftime("%Y-%m-%d"), "params": n_params,
              "machine": _common.cores(),
              "torch_threads": torch.get_num_threads(),
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
              "total_s": time.perf_counter() - t0, "nvme_step": rows, "convergence": conv}
    _common.write_json(args.json, result, indent=1)
    if not args.no_plot:
        plot(conv, os.path.splitext(args.json)[0] + ".png", formats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
