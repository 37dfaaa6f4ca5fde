"""A bf16 model's training step with compute_dtype="auto" (the default) against
compute_dtype=torch.bfloat16, in one run.

Two copies of one bf16 TinyGPT are wrapped with infinity's defaults (the planner places them)
and trained with ``infinity.optim.AdamW``, one with the default compute dtype and one with
bf16 pinned; after a warm-up step each, their steps (forward + backward + ``opt.step()`` +
``zero_grad``) alternate, ``--reps`` each, and the median of each is reported with what "auto"
chose and why (``infinity.stats(model)["compute_dtype"]``).

    OMP_NUM_THREADS=2 python benchmarks/bench_compute_dtype.py --d-model 256 --layers 4 \\
        --reps 3 --out benchmarks/results/bench_compute_dtype_<date>.json
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import infinity  # noqa: E402
from benchmarks._common import machine_info, write_json  # noqa: E402
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    cfg = GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                    n_heads=max(1, args.d_model // 64), max_seq=args.seq)
    torch.manual_seed(0)
    base = TinyGPT(cfg).to(torch.bfloat16)
    runs = {}
    for name, kw in (("auto", {}), ("bfloat16", {"compute_dtype": torch.bfloat16})):
        model = infinity.wrap(copy.deepcopy(base), **kw)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
        runs[name] = {"model": model, "opt": opt, "times": [], "losses": [],
                      "gen": torch.Generator().manual_seed(1)}

    def step(run) -> float:
        x, y = synthetic_batch(cfg, args.batch, args.seq, run["gen"])
        t0 = time.perf_counter()
        loss = lm_loss(run["model"](x).float(), y)
        loss.backward()
        run["opt"].step()
        run["opt"].zero_grad()
        dt = time.perf_counter() - t0
        run["losses"].append(loss.item())
        return dt

    for run in runs.values():
        step(run)  # warm-up: first fetches, the optimizer's states created
    for _ in range(args.reps):
        for run in runs.values():
            run["times"].append(step(run))
    out = {"config": vars(args), "params": sum(p.numel() for p in base.parameters()),
           "machine": machine_info({"torch": torch.__version__,
                                    "threads": torch.get_num_threads()})}
    for name, run in runs.items():
        s = infinity.stats(run["model"])
        out[name] = {"compute_dtype": s["compute_dtype"], "placement": s["param_tier"],
                     "step_s": run["times"], "median_s": statistics.median(run["times"]),
                     "losses": run["losses"]}
        run["opt"].close()
        infinity.unwrap(run["model"])
        print(f"{name:>9}: computes in {s['compute_dtype']['chosen']}, steps "
              + ", ".join(f"{t:.3f}" for t in run["times"])
              + f" s, median {out[name]['median_s']:.3f} s")
    out["speedup_auto_vs_bf16"] = out["bfloat16"]["median_s"] / out["auto"]["median_s"]
    print(f"why: {out['auto']['compute_dtype']['why']}")
    print(f"auto is {out['speedup_auto_vs_bf16']:.1f}x faster than bf16 compute per step")
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
