"""ZeRO-3 across ranks on this machine (gloo, CPU): tokens/s, bytes per rank per tier, and the
time spent in all-gathers and reduce-scatters, for 1, 2 and 4 ranks in one run.

Each configuration launches its ranks as subprocesses of this file (one CPU thread each);
1 rank runs without torch.distributed (the single-process engine). A "token" is one row of a
[batch, seq, width] input through a stack of MLP blocks (a transformer's FFN shape).

    python benchmarks/bench_zero3.py            # 1, 2, 4 ranks, 24 MiB model, 6 steps
    python benchmarks/bench_zero3.py --quick    # 1, 2 ranks, tiny model (CI)

With ``--micro K`` each step is ``infinity.accumulate`` over K micro-batches, run twice per
rank count: "after" (then ``clip_grad_norm_`` and ``opt.step()``) and "inside" (the step in
backward, ``accumulate(..., optimizer=opt, max_grad_norm=...)``), with the NVMe bytes each
rank moves per step by category.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args) -> None:
    import resource

    import torch
    from torch import nn

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world)
    import infinity
    from infinity.runtime.engine import engine_of

    class Block(nn.Module):
        def __init__(self, w: int) -> None:
            super().__init__()
            self.up = nn.Linear(w, 4 * w)
            self.down = nn.Linear(4 * w, w)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block(args.width) for _ in range(args.layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Net()
    settings = {"param_tier": args.tier, "optimizer_tier": args.tier}
    if args.tier == "nvme":
        settings.update(nvme_path=args.nvme_path, grad_tier="nvme")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    infinity.wrap(model, **settings)
    engine = engine_of(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-4)
    per = args.batch // world
    x = torch.randn(per, args.seq, args.width)
    times = []
    moved = []  # NVMe bytes per step by category (this rank)
    for step in range(args.steps):
        t0 = time.perf_counter()
        if args.micro:
            loss = lambda out, xm: out.pow(2).mean()  # noqa: E731
            inside = args.variant == "inside"
            infinity.accumulate(model, list(x.chunk(args.micro)), loss,
                                optimizer=opt if inside else None,
                                max_grad_norm=(args.clip or None) if inside else None)
            if not inside:
                if args.clip:
                    opt.clip_grad_norm_(args.clip)
                opt.step()
                opt.zero_grad()
        else:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
        moved.append(infinity.stats(model)["nvme_per_step"]["bytes"])
        if step == 0 and engine.partitioner is not None:
            engine.partitioner.coll.reset_counters()  # the first step sets things up
    timed = times[1:]
    part = engine.partitioner.stats() if engine.partitioner is not None else None
    result = {
        "rank": rank, "world": world,
        "step_s": timed,
        "tokens_per_s_rank": per * args.seq / statistics.median(timed),
        "tiers": engine.tier_bytes(), "optimizer_states": opt.state_bytes,
        "collectives": part,
        "rss_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024,
        "nvme_per_step": moved[-1],
        "params_here": sum(s.numel for f in engine.home_flats for s in f.slots),
    }
    Path(args.out_rank).write_text(json.dumps(result))
    if world > 1:
        import torch.distributed as dist
        dist.barrier()
    os._exit(0)


def run_config(args, world: int, tmp: str) -> dict:
    port = _free_port()
    procs = []
    outs = []
    for rank in range(world):
        out = os.path.join(tmp, f"w{world}-r{rank}.json")
        outs.append(out)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", INFINITY_DEVICE="cpu",
                   PYTHONPATH=str(ROOT))
        cmd = [sys.executable, __file__, "--worker", "--out-rank", out, "--width",
               str(args.width), "--layers", str(args.layers), "--seq", str(args.seq),
               "--batch", str(args.batch), "--steps", str(args.steps), "--tier", args.tier,
               "--nvme-path", args.nvme_path or tmp, "--micro", str(args.micro),
               "--variant", args.variant, "--clip", str(args.clip)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    ranks = []
    for rank, out in enumerate(outs):
        if not os.path.exists(out):
            raise RuntimeError(f"{world} ranks: rank {rank} failed:\n{logs[rank][-3000:]}")
        ranks.append(json.loads(Path(out).read_text()))
    step = max(statistics.median(r["step_s"]) for r in ranks)
    coll = [r["collectives"] for r in ranks if r["collectives"]]
    steps_timed = args.steps - 1
    row = {
        "world": world,
        "variant": args.variant if args.micro else "plain",
        "nvme_per_step_per_rank": [r["nvme_per_step"] for r in ranks],
        "params_per_rank": [r["params_here"] for r in ranks],
        "step_s_median": step,
        "tokens_per_s": args.batch * args.seq / step,
        "host_bytes_per_rank": [r["tiers"]["host"]["now"] for r in ranks],
        "device_peak_bytes_per_rank": [r["tiers"]["device"]["peak"] for r in ranks],
        "nvme_bytes_per_rank": [r["tiers"]["nvme"]["now"] for r in ranks],
        "optimizer_state_bytes_per_rank": [r["optimizer_states"] for r in ranks],
        "rss_growth_bytes_per_rank": [r["rss_growth_bytes"] for r in ranks],
    }
    if coll:
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            row[f"{name}_s_per_step"] = statistics.median(
                c["seconds"][name] / steps_timed for c in coll)
            row[f"{name}_bytes_per_step"] = coll[0]["bytes"][name] // steps_timed
    return row


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = data["results"]
    labels = [str(r["world"]) + ("" if r["variant"] == "plain" else f"\n{r['variant']}")
              for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(labels, [r["tokens_per_s"] for r in rows])
    axes[0].set(title="tokens/s (all ranks)", xlabel="ranks")
    axes[1].bar(labels,
                [max(r["host_bytes_per_rank"]) / 2**20 for r in rows], label="host tier")
    axes[1].bar(labels,
                [max(sum(s.values()) for s in r["optimizer_state_bytes_per_rank"]) / 2**20
                 for r in rows], bottom=[max(r["host_bytes_per_rank"]) / 2**20 for r in rows],
                label="optimizer states")
    axes[1].set(title="MiB per rank", xlabel="ranks")
    axes[1].legend()
    ag = [r.get("all_gather_s_per_step", 0) * 1e3 for r in rows]
    rs = [r.get("reduce_scatter_s_per_step", 0) * 1e3 for r in rows]
    axes[2].bar(labels, ag, label="all-gather")
    axes[2].bar(labels, rs, bottom=ag, label="reduce-scatter")
    axes[2].set(title="collective ms per step (per rank)", xlabel="ranks")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-rank", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", default=None, help="comma-separated rank counts (1,2,4)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tier", choices=("host", "nvme"), default="host")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--micro", type=int, default=0,
                    help="micro-batches per step through infinity.accumulate (0: one backward)")
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm with --micro (0: no clip)")
    ap.add_argument("--variant", default="after", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_zero3.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.width, args.layers, args.seq, args.batch, args.steps = 32, 3, 8, 4, 3
    worlds = [int(w) for w in (args.worlds or ("1,2" if args.quick else "1,2,4")).split(",")]
    from _common import machine_info, write_json
    with tempfile.TemporaryDirectory(prefix="bench_zero3_", dir=args.nvme_path) as tmp:
        rows = []
        variants = ("after", "inside") if args.micro else ("after",)
        for world, variant in [(w, v) for w in worlds for v in variants]:
            args.variant = variant
            row = run_config(args, world, tmp)
            rows.append(row)
            written = max(b["grads_written"] for b in row["nvme_per_step_per_rank"])
            print(f"{world} rank(s) {row['variant']}: gradients written/rank {written:,} B, "
                  f"step {row['step_s_median'] * 1e3:.1f} ms")
            print(f"{world} rank(s): {row['tokens_per_s']:.0f} tokens/s, step "
                  f"{row['step_s_median'] * 1e3:.1f} ms, host/rank "
                  f"{max(row['host_bytes_per_rank']) / 2**20:.1f} MiB, all-gather "
                  f"{row.get('all_gather_s_per_step', 0) * 1e3:.1f} ms/step, reduce-scatter "
                  f"{row.get('reduce_scatter_s_per_step', 0) * 1e3:.1f} ms/step")
    params = args.layers * (8 * args.width * args.width + 5 * args.width)
    data = {"machine": machine_info(), "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "model": {"params": params, "width": args.width, "layers": args.layers,
                      "seq": args.seq, "global_batch": args.batch, "tier": args.tier,
                      "micro_batches": args.micro, "clip": args.clip if args.micro else None},
            "results": rows}
    write_json(args.out, data)
    plot(data, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
