"""The main job: train a small GPT with parameters, gradients and optimizer states offloaded to a
swap directory, and report what moved where. Run with ``infinity demo`` or
``python -m infinity demo``."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from typing import Callable, List, Optional

import torch

from . import api
from .models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

Write = Callable[[str], None]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nvme-path",
        default=None,
        help="directory for swap files (default: a new folder in the system temp dir)",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--param-tier", default="nvme", choices=["host", "nvme"])
    p.add_argument("--optimizer-tier", default="nvme", choices=["host", "nvme"])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="compute dtype (auto: bf16 on a CUDA GPU that supports it, else fp32)",
    )
    p.add_argument("--seed", type=int, default=0)


def _compute_dtype(choice: str) -> Optional[torch.dtype]:
    if choice == "fp32":
        return None
    if choice == "bf16":
        return torch.bfloat16
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def run(args: argparse.Namespace, write: Write) -> List[float]:
    from . import ops
    from .optim import AdamW

    own_dir = args.nvme_path is None
    path = tempfile.mkdtemp(prefix="infinity-demo-") if own_dir else args.nvme_path
    try:
        torch.manual_seed(args.seed)
        cfg = GPTConfig(
            vocab_size=128,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=max(1, args.d_model // 64),
            max_seq=args.seq,
        )
        model = TinyGPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        device = "cuda" if torch.cuda.is_available() else "cpu (the CPU is the device tier)"
        write(
            f"infinity demo: GPT with {n_params / 1e6:.1f}M parameters "
            f"({cfg.n_layers} layers, d_model {cfg.d_model}) on {device}\n"
        )
        write(f"  swap directory: {path}   CPU Adam path: {ops.cpu_capability()}\n")
        dtype = _compute_dtype(args.dtype)
        # the demo shows offload to NVMe, so its tiers are explicit: the planner (the default)
        # would rightly keep a model this small in RAM
        api.wrap(
            model,
            nvme_path=path,
            param_tier=args.param_tier,
            grad_tier="nvme" if args.param_tier == "nvme" else "host",
            optimizer_tier=args.optimizer_tier,
            compute_dtype=dtype,
        )
        opt = AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        gen = torch.Generator().manual_seed(args.seed + 1)
        losses: List[float] = []
        tokens = args.batch * args.seq
        api.stats(model, reset=True)
        t_start = time.perf_counter()
        window_t, window_tokens = time.perf_counter(), 0
        for step in range(1, args.steps + 1):
            x, y = synthetic_batch(cfg, args.batch, args.seq, gen)
            if torch.cuda.is_available():
                x, y = x.cuda(), y.cuda()
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
            window_tokens += tokens
            if step == 1 or step % 5 == 0 or step == args.steps:
                now = time.perf_counter()
                write(
                    f"  step {step:4d}  loss {losses[-1]:.4f}  "
                    f"{window_tokens / (now - window_t):,.0f} tokens/s\n"
                )
                window_t, window_tokens = now, 0
        elapsed = time.perf_counter() - t_start
        s = api.stats(model)
        write(
            f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps, "
            f"{args.steps * tokens / elapsed:,.0f} tokens/s overall\n"
        )
        write("\nwhat each tier held (now / peak):\n")
        for tier, d in s["tiers"].items():
            extra = ", ".join(
                f"{k.replace('_buffers', ' buffers')} {v}"
                if k.endswith("_buffers")
                else f"{k} {_fmt_bytes(v)}"
                for k, v in d.items()
                if k not in ("now", "peak", "limit") and v
            )
            write(
                f"  {tier:<7} {_fmt_bytes(d['now']):>12} / {_fmt_bytes(d['peak']):>12}"
                f"{'   (' + extra + ')' if extra else ''}\n"
            )
        held = ", ".join(f"{_fmt_bytes(n)} on {t}" for t, n in opt.state_bytes.items() if n)
        write(
            f"  optimizer states (fp32 master + 2 moments; on NVMe once, plus the units in flight): {held}\n"
        )
        write("what moved where (whole run, optimizer traffic included):\n")
        for direction, n in s["moved"].items():
            write(f"  {direction.replace('_', ' '):<16} {_fmt_bytes(n):>12}\n")
        write(
            f"prefetch: {s['prefetch_hits']} hits, {s['prefetch_misses']} misses "
            f"({100 * s['prefetch_hit_rate']:.0f}% hits), {s['stall_seconds']:.2f} s "
            f"stalled of {elapsed:.2f} s\n"
        )
        tiers = sorted(set(opt.state_tiers.values()))
        last = opt.last_step_stats
        write(
            f"optimizer: fp32 master + Adam moments on {', '.join(tiers)}; last step "
            f"{last.step_s * 1e3:.0f} ms ({last.compute_s * 1e3:.0f} ms CPU Adam, "
            f"{last.io_wait_s * 1e3:.0f} ms waiting for NVMe, "
            f"{_fmt_bytes(last.bytes_read)} read, {_fmt_bytes(last.bytes_written)} written)\n"
        )
        api.unwrap(model)
        return losses
    finally:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="infinity demo", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    losses = run(args, sys.stdout.write)
    return 0 if losses[-1] < losses[0] else 1
