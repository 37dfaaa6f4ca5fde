"""Compressed ZeRO collectives (``wrap(..., comm=...)``) against full width, in the same run:
convergence of a real config on learnable text, weights' drift, and bytes on the wire per step.

The model is a Llama config with Llama-3's vocabulary (128256) and a small width; the text is
this repository's own documentation and source, cut into 2-byte tokens (ids below 65536), so
the model has structure to fit. Every configuration trains the same steps from the same seed
on the same global batch, split over the ranks (gloo, one CPU thread each, ranks spawned as
subprocesses of this file). Bytes per step come from ``stats()["zero"]``: ``wire_bytes``
(what crossed, scales included) against ``bytes`` (the values at full width).

    python benchmarks/bench_comm_compression.py             # 200 steps, 2 and 3 ranks; bytes on 2 and 4
    python benchmarks/bench_comm_compression.py --quick     # tiny model, a few steps (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

COMMS: Dict[str, Any] = {
    "none": None,
    "int8": {"weights": "int8", "grads": "int8"},
    "int4": {"weights": "int8", "grads": "int4"},
    "int4+ef": {"weights": "int8", "grads": "int4", "error_feedback": True},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def corpus_tokens(limit: int) -> List[int]:
    """The repository's text (docs, README, package source) as 2-byte tokens."""
    files = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    files += sorted((ROOT / "infinity").rglob("*.py"))
    data = b"".join(f.read_bytes() for f in files if f.exists())[: 2 * limit]
    return [data[i] * 256 + data[i + 1] for i in range(0, len(data) - 1, 2)]


def worker(cfg: Dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import LlamaConfig, LlamaForCausalLM

    import infinity

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg["vocab"],
            hidden_size=cfg["hidden"],
            intermediate_size=2 * cfg["hidden"],
            num_hidden_layers=cfg["layers"],
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=cfg["seq"],
            tie_word_embeddings=False,
            use_cache=False,
        )
    )
    comm = COMMS[cfg["comm"]]
    infinity.wrap(
        model,
        param_tier="host",
        optimizer_tier="host",
        compute_dtype=getattr(torch, cfg.get("dtype", "float32")),
        comm=infinity.CommPolicy(**comm) if comm else None,
    )
    opt = infinity.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    tokens = torch.tensor(corpus_tokens(cfg["steps"] * cfg["batch"] * cfg["seq"] * 2))
    tokens = tokens % cfg["vocab"]
    per = cfg["batch"] // world
    window = cfg["batch"] * cfg["seq"]
    losses, times = [], []
    for step in range(cfg["steps"]):
        start = (step * window) % max(1, tokens.numel() - window)
        batch = tokens[start : start + window].view(cfg["batch"], cfg["seq"])
        ids = batch[rank * per : (rank + 1) * per]
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world)
    zero = infinity.stats(model)["zero"]
    infinity.unwrap(model)
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, cfg["params_out"]
        )
    result = {
        "losses": losses,
        "step_s": times,
        "bytes": zero["bytes"],
        "wire_bytes": zero["wire_bytes"],
        "seconds": zero["seconds"],
        "error_feedback_bytes": zero["error_feedback_bytes"],
    }
    Path(cfg["out"]).write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)


def run_config(cfg: Dict[str, Any], world: int, tmp: str, timeout: float) -> Dict[str, Any]:
    port = _free_port()
    procs, outs = [], []
    tag = f"{cfg['comm']}-w{world}-{cfg.get('dtype', 'float32')}-{cfg['steps']}"
    for rank in range(world):
        out = os.path.join(tmp, f"{tag}-r{rank}.json")
        outs.append(out)
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            INFINITY_DEVICE="cpu",
            PYTHONPATH=str(ROOT),
        )
        c = dict(cfg, out=out, params_out=os.path.join(tmp, f"{tag}.pt"))
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(c)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for rank, out in enumerate(outs):
        if not os.path.exists(out):
            raise RuntimeError(f"{tag}: rank {rank} failed:\n{logs[rank][-3000:]}")
    rank0 = json.loads(Path(outs[0]).read_text())
    steps = len(rank0["losses"])
    return {
        "comm": cfg["comm"],
        "world": world,
        "losses": rank0["losses"],
        "step_s_median": sorted(rank0["step_s"])[steps // 2],
        "bytes_per_step": {k: v / steps for k, v in rank0["bytes"].items()},
        "wire_bytes_per_step": {k: v / steps for k, v in rank0["wire_bytes"].items()},
        "error_feedback_bytes": rank0["error_feedback_bytes"],
        "params_file": os.path.join(tmp, f"{tag}.pt"),
    }


def drift(a_file: str, b_file: str) -> Dict[str, float]:
    """How far one run's final weights are from another's: max |a - b| and ||a - b|| / ||b||."""
    import torch

    a, b = torch.load(a_file), torch.load(b_file)
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in b)
    den = sum(float(b[k].float().pow(2).sum()) for k in b)
    mx = max(float((a[k].float() - b[k].float()).abs().max()) for k in b)
    return {"max_abs": mx, "relative_l2": (num / den) ** 0.5}


def tail_mean(losses: List[float], n: int = 10) -> float:
    part = losses[-n:]
    return sum(part) / len(part)


def plot(data: Dict[str, Any], path: str) -> None:
    from _common import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    worlds = sorted({r["world"] for r in data["convergence"]})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        for r in data["convergence"]:
            if r["world"] == world:
                ax.plot(r["losses"], label=r["comm"], linewidth=1)
        ax.set(title=f"{world} ranks", xlabel="step", ylabel="loss (mean over ranks)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=12, help="global batch (sequences)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--worlds", default="2,3", help="rank counts of the convergence runs")
    ap.add_argument("--comms", default="none,int8,int4,int4+ef")
    ap.add_argument("--bytes-worlds", default="2,4", help="rank counts of the bytes runs")
    ap.add_argument("--bytes-dtypes", default="float32,bfloat16", help="compute dtypes")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "bench_comm_compression.json")
    )
    args = ap.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    if args.quick:
        args.steps, args.vocab, args.hidden, args.layers, args.seq = 6, 1000, 32, 1, 16
        args.worlds, args.comms, args.bytes_worlds = "2", "none,int4+ef", "2"
        args.bytes_dtypes = "float32"
    from _common import machine_info, write_json

    cfg = {
        "steps": args.steps,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "layers": args.layers,
        "seq": args.seq,
        "batch": args.batch,
        "lr": args.lr,
    }
    comms = args.comms.split(",")
    convergence, traffic = [], []
    with tempfile.TemporaryDirectory(prefix="bench_comm_") as tmp:
        for world in [int(w) for w in args.worlds.split(",")]:
            base = None
            for comm in comms:
                row = run_config(dict(cfg, comm=comm), world, tmp, args.timeout)
                if comm == "none":
                    base = row
                elif base is not None:
                    row["drift_vs_none"] = drift(row["params_file"], base["params_file"])
                    row["tail_loss_vs_none"] = tail_mean(row["losses"]) / tail_mean(base["losses"])
                convergence.append(row)
                print(
                    f"{world} ranks, comm={comm}: loss {row['losses'][0]:.3f} -> "
                    f"{row['losses'][-1]:.3f} (last 10: {tail_mean(row['losses']):.4f}), "
                    f"step {row['step_s_median']:.2f} s",
                    flush=True,
                )
        for world in [int(w) for w in args.bytes_worlds.split(",")]:
            for dtype in args.bytes_dtypes.split(","):
                for comm in comms:
                    done = next(
                        (
                            r
                            for r in convergence
                            if (r["world"], r["comm"], dtype) == (world, comm, "float32")
                        ),
                        None,
                    )
                    c = dict(cfg, comm=comm, steps=3, dtype=dtype)
                    row = done or run_config(c, world, tmp, args.timeout)
                    traffic.append(
                        {
                            "comm": comm,
                            "world": world,
                            "compute_dtype": dtype,
                            "bytes_per_step": row["bytes_per_step"],
                            "wire_bytes_per_step": row["wire_bytes_per_step"],
                            "error_feedback_bytes": row["error_feedback_bytes"],
                        }
                    )
        for row in convergence:
            row.pop("params_file", None)
    for row in traffic:
        wire, full = row["wire_bytes_per_step"], row["bytes_per_step"]
        row["ratio"] = {k: (wire[k] / full[k] if full[k] else None) for k in full}
        print(
            f"{row['world']} ranks, {row['compute_dtype']}, comm={row['comm']}: "
            f"wire / full {row['ratio']}"
        )
    data = {
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": dict(cfg, kind="LlamaForCausalLM, untied, fp32, everything on host"),
        "convergence": convergence,
        "bytes": traffic,
    }
    write_json(args.out, data)
    plot(data, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
