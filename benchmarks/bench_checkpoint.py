"""Cost of ``infinity.save_checkpoint`` / ``load_checkpoint`` against one training step, with
parameters, gradients and optimizer states in host RAM and on NVMe.

    python benchmarks/bench_checkpoint.py            # ~210M params fp32, 5 measured rounds
    python benchmarks/bench_checkpoint.py --quick    # ~3.7M params, a few seconds
    python benchmarks/bench_checkpoint.py --ranks 2  # ZeRO-3 over 2 gloo ranks (one thread
                                                     # each): each rank saves / loads its part

Model: TinyGPT (tied head), fp32, batch 4 x 128 tokens (--quick: 2 x 32); optimizer
``infinity.optim.AdamW``. Configurations: ``host`` (param/grad/optimizer tiers all "host") and
``nvme`` (all three "nvme", swap files under --nvme-path). Both models live at once; each round
runs, for each configuration in turn, one training step (forward + backward + ``opt.step()`` +
``opt.zero_grad()``), ``save_checkpoint(path, model, opt)`` into a fresh directory (it fsyncs;
timed to its return), then ``load_checkpoint(path, model, opt)`` after the checkpoint's pages
were dropped from the page cache (``POSIX_FADV_DONTNEED``: a cold read, as after a restart).
Round 0 is a warm-up (creates the optimizer states and state files) and is not counted; the
table shows medians over the measured rounds, the ratios save/step and load/step, the bytes in
the checkpoint directory and MB/s. Results: benchmarks/results/bench_checkpoint.json (+ .png).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import _common  # noqa: E402  (benchmarks/, this script's folder)
import torch  # noqa: E402

import infinity  # noqa: E402
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch  # noqa: E402

logger = logging.getLogger("bench_checkpoint")

CONFIGS = ("host", "nvme")


def model_config(quick: bool) -> GPTConfig:
    if quick:   # ~3.7M parameters
        return GPTConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, max_seq=64)
    return GPTConfig(vocab_size=8192, d_model=1024, n_layers=16, n_heads=16, max_seq=128)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _barrier() -> None:
    if _world() > 1:
        import torch.distributed as dist
        dist.barrier()


def spawn_ranks(ranks: int, argv: List[str]) -> int:
    """Runs this script on ``ranks`` gloo ranks (subprocesses); rank 0 reports."""
    import socket
    import subprocess
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for r in range(ranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv,
                                      env=env, stdout=None if r == 0 else subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    return max(codes)


def build(tier: str, cfg: GPTConfig, swap: str):
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    if tier == "nvme":
        os.makedirs(swap, exist_ok=True)
    infinity.wrap(model, nvme_path=swap if tier == "nvme" else None, param_tier=tier,
                  grad_tier=tier, optimizer_tier=tier)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return model, opt


def train_step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def drop_cache(path: str) -> None:
    """Drops the (clean, fsynced) pages of every file under ``path`` from the page cache."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_round(model, opt, x, y, ckpt: str) -> Dict:
    """Step, save, cold load (every rank; times from this rank, after a barrier each)."""
    per = x.shape[0] // _world()
    lo = _rank() * per
    _barrier()
    row = {"step_s": train_step(model, opt, x[lo:lo + per], y[lo:lo + per])}
    _barrier()
    t0 = time.perf_counter()
    infinity.save_checkpoint(ckpt, model, opt)
    row["save_s"] = time.perf_counter() - t0
    row["bytes"] = dir_bytes(ckpt)
    if _rank() == 0:
        drop_cache(ckpt)
    _barrier()
    t0 = time.perf_counter()
    infinity.load_checkpoint(ckpt, model, opt)
    row["load_s"] = time.perf_counter() - t0
    _barrier()
    if _rank() == 0:
        shutil.rmtree(ckpt)
    return row


def summarize(name: str, rows: List[Dict], n_params: int) -> Dict:
    med = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "save_s", "load_s",
                                                              "bytes")}
    return {"config": name, "params": n_params, "rounds": rows,
            "step_s_median": med["step_s"], "save_s_median": med["save_s"],
            "load_s_median": med["load_s"], "checkpoint_bytes": int(med["bytes"]),
            "save_over_step": med["save_s"] / med["step_s"],
            "load_over_step": med["load_s"] / med["step_s"],
            "save_MBps": med["bytes"] / med["save_s"] / 1e6,
            "load_MBps": med["bytes"] / med["load_s"] / 1e6,
            "bytes_per_param": med["bytes"] / n_params}


def print_table(rows: List[Dict]) -> None:
    print(f"{'config':<7} {'step s':>7} {'save s':>7} {'load s':>7} {'save/step':>9} "
          f"{'load/step':>9} {'GB':>6} {'save MB/s':>9} {'load MB/s':>9}")
    for r in rows:
        print(f"{r['config']:<7} {r['step_s_median']:>7.2f} {r['save_s_median']:>7.2f} "
              f"{r['load_s_median']:>7.2f} {r['save_over_step']:>8.2f}x "
              f"{r['load_over_step']:>8.2f}x {r['checkpoint_bytes'] / 1e9:>6.2f} "
              f"{r['save_MBps']:>9.0f} {r['load_MBps']:>9.0f}")


def plot(rows: List[Dict], path: str) -> None:
    plt = _common.pyplot(logger)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    w = 0.27
    for i, (key, label) in enumerate((("step_s_median", "training step"),
                                      ("save_s_median", "save_checkpoint"),
                                      ("load_s_median", "load_checkpoint (cold)"))):
        ax.bar([j + (i - 1) * w for j in range(len(rows))], [r[key] for r in rows], w,
               label=label)
    ax.set_xticks(range(len(rows)), [f"{r['config']} tiers" for r in rows])
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"{rows[0]['params'] / 1e6:.0f}M params fp32, checkpoint "
                 f"{rows[0]['checkpoint_bytes'] / 1e9:.2f} GB", fontsize=9)
    ax.legend(fontsize=8)
    _common.save_figure(fig, path)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~3.7M params, a few seconds")
    ap.add_argument("--rounds", type=int, default=None,
                    help="measured rounds (default 5, --quick 3), after one warm-up round")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--nvme-path", default=None, help="directory for swap files and "
                    "checkpoints (default: a temporary directory under /tmp)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_checkpoint.json"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--ranks", type=int, default=1,
                    help="ZeRO-3 over this many gloo ranks on this machine (default 1)")
    args = ap.parse_args(argv)
    if args.ranks > 1 and "RANK" not in os.environ:
        return spawn_ranks(args.ranks, argv)
    if args.ranks > 1:
        import datetime as _dt

        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=_dt.timedelta(seconds=1800))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rounds = args.rounds or (3 if args.quick else 5)
    if rounds < 1:
        ap.error("--rounds must be >= 1")
    batch = args.batch or (2 if args.quick else 4)
    if batch % args.ranks:
        ap.error("--batch must divide by --ranks")
    seq = args.seq or (32 if args.quick else 128)
    cfg = model_config(args.quick)
    x, y = synthetic_batch(cfg, batch, seq, torch.Generator().manual_seed(1))
    work = os.path.join(args.nvme_path or "/tmp", f"bench-ckpt-{os.getppid()}") \
        if args.ranks > 1 else tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.nvme_path or "/tmp")
    os.makedirs(work, exist_ok=True)
    per: Dict[str, List[Dict]] = {c: [] for c in CONFIGS}
    try:
        built = {c: build(c, cfg, os.path.join(work, f"swap-{c}")) for c in CONFIGS}
        n_params = sum(p.numel() for p in built["host"][0].parameters())
        logger.info("model: %s params fp32 (d_model %d, %d layers, vocab %d), batch %d x %d, "
                    "torch %d threads", f"{n_params:,}", cfg.d_model, cfg.n_layers,
                    cfg.vocab_size, batch, seq, torch.get_num_threads())
        for r in range(rounds + 1):  # round 0: warm-up
            for c in CONFIGS:
                model, opt = built[c]
                row = one_round(model, opt, x, y, os.path.join(work, f"ckpt-{c}-{r}"))
                if _rank():
                    continue
                gc.collect()
                logger.info("round %d %-5s step %.2fs save %.2fs load %.2fs (%.2f GB)%s", r, c,
                            row["step_s"], row["save_s"], row["load_s"], row["bytes"] / 1e9,
                            " warm-up" if r == 0 else "")
                if r:
                    per[c].append(row)
        for model, opt in built.values():
            opt.close()
            infinity.unwrap(model)
    finally:
        _barrier()
        if _rank() == 0:
            shutil.rmtree(work, ignore_errors=True)
    if _rank():
        return 0
    rows = [summarize(c, per[c], n_params) for c in CONFIGS]
    print_table(rows)
    result = {"date": datetime.date.today().isoformat(),
              "command": " ".join(["python", "benchmarks/bench_checkpoint.py"] + argv),
              "params": n_params, "config": {"vocab_size": cfg.vocab_size,
                                             "d_model": cfg.d_model, "n_layers": cfg.n_layers,
                                             "n_heads": cfg.n_heads},
              "batch": batch, "seq": seq, "rounds": rounds, "ranks": args.ranks,
              **_common.machine_info({"torch": torch.__version__,
                                      "torch_threads": torch.get_num_threads()}),
              "rows": rows}
    _common.write_json(args.out, result)
    if not args.no_plot:
        plot(rows, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
