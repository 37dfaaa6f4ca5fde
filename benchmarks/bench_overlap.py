"""The optimizer step hidden behind backward: parameters, gradients and Adam states on NVMe.

    python benchmarks/bench_overlap.py              # 8 x Linear(2048, 2048) MLP, 33.6M params
    python benchmarks/bench_overlap.py --quick      # small, a few seconds (CI)
    python benchmarks/bench_overlap.py --give-back-every 2   # opt.give_back_disk() between steps

Two copies of one model are trained on the same batches, step after step, interleaved:
``overlap=False`` (backward, then the whole step) and the default ``overlap="auto"`` (each
block's update starts on a worker as soon as its gradients are complete; ``opt.step()`` only
finishes what is left and checks that every kept update is exactly the step's). Per step the
benchmark times backward alone and the step alone (the first model) and backward + step (the
second); after the warm-up steps (auto arms from the third step) medians over ``--steps``.
Target: backward + step <= 1.15 x max(backward alone, step alone). At the end the states and
weights of both models are compared bit for bit. Per step the NVMe bytes of each run are
recorded by category (``infinity.stats(model)["nvme_per_step"]``); ``--keep-grads auto`` lets
the overlapped run skip its gradient writes. Results: benchmarks/results/bench_overlap.json.
"""
from __future__ import annotations

import argparse
import copy
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

logger = logging.getLogger("bench_overlap")
HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 3  # steps before timing: states created (1), auto armed after two single-backward steps


class MLP(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def snapshot(opt, model) -> Dict[str, torch.Tensor]:
    out = {f"state/{s.key}": torch.cat([s.master, s.exp_avg, s.exp_avg_sq]).clone()
           for s in opt.state_dicts.shard_states()}
    out.update({f"weight/{k}": v.detach().clone() for k, v in model.state_dict().items()})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64, help="rows per batch (sets backward time; "
                    "64: backward about as long as the step here, the hardest case to hide)")
    ap.add_argument("--steps", type=int, default=7, help="timed steps after the warm-up")
    ap.add_argument("--quick", action="store_true", help="4 x Linear(512, 512), 3 timed steps")
    ap.add_argument("--keep-grads", choices=("true", "auto"), default="true",
                    help="the overlapped optimizer's keep_grads: true (default: gradients "
                    "written to NVMe too) or auto (writes skipped once the loop needs none "
                    "after backward)")
    ap.add_argument("--clip", type=float, default=None,
                    help="both runs call opt.clip_grad_norm_(CLIP) before each step (a small "
                    "value clips every step, a large one never does)")
    ap.add_argument("--give-back-every", type=int, default=0, metavar="N",
                    help="after every N-th step both runs call opt.give_back_disk() (as a "
                         "checkpoint save does); its time and the next step's are reported apart")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "bench_overlap.json"))
    args = ap.parse_args(argv)
    if args.give_back_every < 0:
        ap.error("--give-back-every must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.quick:
        args.layers, args.width, args.batch, args.steps = 4, 512, 256, 3
    torch.manual_seed(0)
    base = MLP(args.layers, args.width)
    n_params = sum(p.numel() for p in base.parameters())
    logger.info("model: %d x Linear(%d, %d) + ReLU, %s params, batch %d; params, gradients and "
                "fp32 Adam states on NVMe", args.layers, args.width, args.width,
                f"{n_params:,}", args.batch)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(args.batch, args.width, generator=gen)
               for _ in range(WARMUP + args.steps)]
    rows: List[Dict[str, float]] = []
    with tempfile.TemporaryDirectory(dir=args.nvme_path or "/tmp", prefix="bench-ovl-") as d:
        runs = {}
        keep = True if args.keep_grads == "true" else "auto"
        for name, mode in (("serial", False), ("overlap", "auto")):
            path = os.path.join(d, name)
            os.mkdir(path)
            model = copy.deepcopy(base)
            infinity.wrap(model, nvme_path=path, param_tier="nvme", grad_tier="nvme",
                          optimizer_tier="nvme")
            runs[name] = (model, infinity.optim.AdamW(model.parameters(), lr=1e-4,
                                                      overlap=mode, keep_grads=keep))
        for i, x in enumerate(batches):
            row: Dict[str, float] = {}
            for name, (model, opt) in runs.items():
                loss = model(x).square().mean()
                t0 = time.perf_counter()
                loss.backward()
                t1 = time.perf_counter()
                if args.clip is not None:
                    row[f"{name}_clip_coef"] = min(1.0, args.clip / (float(
                        opt.clip_grad_norm_(args.clip)) + 1e-6))
                opt.step()
                t2 = time.perf_counter()
                opt.zero_grad()
                if args.give_back_every and (i + 1) % args.give_back_every == 0:
                    t3 = time.perf_counter()
                    row[f"{name}_given_back"] = opt.give_back_disk()
                    row[f"{name}_give_back_s"] = time.perf_counter() - t3
                row[f"{name}_backward_s"] = t1 - t0
                row[f"{name}_step_s"] = t2 - t1
                row[f"{name}_loss"] = loss.item()
                row[f"{name}_kept"] = opt.last_step_stats.overlapped_shards
                nvme = infinity.stats(model)["nvme_per_step"]
                for k, v in nvme["bytes"].items():
                    row[f"{name}_nvme_{k}"] = v
            row["backward_s"] = row["serial_backward_s"]
            row["step_s"] = row["serial_step_s"]
            row["overlapped_s"] = row["overlap_backward_s"] + row["overlap_step_s"]
            row["ratio"] = row["overlapped_s"] / max(row["backward_s"], row["step_s"])
            logger.info("step %d: backward %.3f s, step %.3f s | overlapped: backward %.3f s + "
                        "step %.3f s = %.3f s (%d shards kept) -> %.2fx max", i,
                        row["backward_s"], row["step_s"], row["overlap_backward_s"],
                        row["overlap_step_s"], row["overlapped_s"], row["overlap_kept"],
                        row["ratio"])
            row["after_give_back"] = bool(args.give_back_every) and i % args.give_back_every == 0
            if i >= WARMUP:
                rows.append(row)
        snaps = {name: snapshot(opt, model) for name, (model, opt) in runs.items()}
        equal = (snaps["serial"].keys() == snaps["overlap"].keys()
                 and all(torch.equal(v, snaps["overlap"][k]) for k, v in snaps["serial"].items())
                 and all(r["serial_loss"] == r["overlap_loss"] for r in rows))
        for model, opt in runs.values():
            opt.close()
            infinity.unwrap(model)
        del runs
        gc.collect()
    med = lambda k, rs=rows: statistics.median(r[k] for r in rs)  # noqa: E731
    result = {"date": time.strftime("%Y-%m-%d"), "params": n_params, "layers": args.layers,
              "width": args.width, "batch": args.batch, "steps": args.steps,
              "machine": _common.cores(),
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
              "backward_s": med("backward_s"), "step_s": med("step_s"),
              "overlapped_s": med("overlapped_s"),
              "overlapped_backward_s": med("overlap_backward_s"),
              "overlapped_step_s": med("overlap_step_s"),
              "serial_sum_s": med("backward_s") + med("step_s"),
              "ratio_vs_max": med("ratio"),
              "kept_shards_per_step": med("overlap_kept"),
              "shards": args.layers, "bitwise_equal": bool(equal), "keep_grads": keep,
              "clip": args.clip,
              "clipped_steps": sum(1 for r in rows if r.get("serial_clip_coef", 1.0) < 1.0),
              "nvme_per_step": {name: {k[len(name) + 6:]: med(k) for k in rows[0]
                                       if k.startswith(f"{name}_nvme_")}
                                for name in ("serial", "overlap")},
              "give_back": _give_back_summary(rows, args.give_back_every, med),
              "rows": rows}
    for name, cats in result["nvme_per_step"].items():
        written = sum(v for k, v in cats.items() if k.endswith("_written"))
        cats["bytes_per_param"] = {k: v / n_params for k, v in list(cats.items())}
        cats["tb_written_per_1000_steps"] = written * 1000 / 1e12
    print(f"backward alone {result['backward_s']:.3f} s, step alone {result['step_s']:.3f} s, "
          f"serial sum {result['serial_sum_s']:.3f} s")
    print(f"overlapped: backward {result['overlapped_backward_s']:.3f} s + step "
          f"{result['overlapped_step_s']:.3f} s = {result['overlapped_s']:.3f} s -> "
          f"{result['ratio_vs_max']:.2f}x max(backward, step) (target <= 1.15x); "
          f"{result['kept_shards_per_step']:.0f} of {args.layers} block updates kept per step; "
          f"bitwise equal: {equal}")
    for name, cats in result["nvme_per_step"].items():
        per = cats["bytes_per_param"]
        print(f"NVMe bytes per parameter and step, {name}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in per.items() if v) +
            f"; SSD wear {cats['tb_written_per_1000_steps']:.3f} TB per 1,000 steps")
    gb = result["give_back"]
    if gb:
        print(f"opt.give_back_disk() every {gb['every']} steps: overlapped run "
              f"{gb['overlap_given_back_bytes'] / n_params:.2f} B/param given back in "
              f"{gb['overlap_give_back_s']:.3f} s; backward + step after it "
              f"{gb['overlapped_s_after']:.3f} s, other steps {gb['overlapped_s_other']:.3f} s")
    _common.write_json(args.json, result)
    return 0 if equal else 1


def _give_back_summary(rows: List[Dict[str, float]], every: int, med) -> Dict[str, float]:
    """Medians of the give-backs and of the overlapped steps right after one against the
    others (empty without --give-back-every or where the timed steps hold no both kinds)."""
    given = [r for r in rows if "overlap_give_back_s" in r]
    after = [r for r in rows if r["after_give_back"]]
    other = [r for r in rows if not r["after_give_back"]]
    if not every or not given or not after or not other:
        return {}
    return {"every": every,
            "serial_given_back_bytes": med("serial_given_back", given),
            "overlap_given_back_bytes": med("overlap_given_back", given),
            "serial_give_back_s": med("serial_give_back_s", given),
            "overlap_give_back_s": med("overlap_give_back_s", given),
            "overlapped_s_after": med("overlapped_s", after),
            "overlapped_s_other": med("overlapped_s", other),
            "step_s_after": med("step_s", after), "step_s_other": med("step_s", other)}


if __name__ == "__main__":
    sys.exit(main())
