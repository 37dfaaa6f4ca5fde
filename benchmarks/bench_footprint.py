"""Peak RSS of training with everything on NVMe under a host budget, against the budget plus the
process's own baseline; with the time attribution and the prefetch hits of each step.

    python benchmarks/bench_footprint.py             # ~1.04B-param GPT, host_budget 3 GiB, 3 steps
    python benchmarks/bench_footprint.py --quick     # ~7M params, host_budget 64 MiB (CI)

Each measurement runs in a fresh subprocess:

* ``activations`` (twice: the model's config with 1 and with 2 layers, plain PyTorch, fully in
  RAM): peak RSS growth over the process's first forward+backward of the batch, less the
  gradients' bytes = the activations, autograd temporaries and one-time costs of a first
  backward; the per-layer difference extrapolates them to the full depth.
* ``train``: the model built under ``infinity.empty_init()`` (no parameter bytes in RAM),
  ``infinity.wrap(..., init=<the model's own init, module by module>)`` with parameters, gradients and optimizer
  states on NVMe and ``host_budget``, ``infinity.optim.AdamW(states=...)``, N steps. The kernel's
  peak RSS counter (VmHWM) is reset (``clear_refs`` 5) just before wrap; RssAnon is sampled
  every 2 ms (the kernel keeps no peak of it).

Baseline = VmRSS of the train process just before wrap (torch and infinity imported, the model
skeleton on meta, the batch) + the extrapolated activations. The claim checked:
``peak VmHWM <= host_budget + baseline``. Results: benchmarks/results/bench_footprint.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _common  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20


def model_config(quick: bool) -> Dict:
    if quick:   # ~7M parameters
        return dict(vocab_size=1024, d_model=256, n_layers=8, n_heads=4, max_seq=64,
                    tie_embeddings=True)
    # ~1.04B parameters (4.2 GB fp32): 36 layers of 28.3M (113 MB), tied 8192 x 1536 embedding
    return dict(vocab_size=8192, d_model=1536, n_layers=36, n_heads=16, max_seq=128,
                tie_embeddings=True)


_PRELUDE = textwrap.dedent(r"""
    import json, sys, threading, time
    sys.path.insert(0, ROOT)
    import torch
    import infinity
    from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
""") + _common.CHILD_RSS_HELPERS + _common.CHILD_TIMED_STEP + textwrap.dedent(r"""

    class Sampler:  # the kernel keeps no peak of RssAnon: sample it
        def __init__(self):
            self.peak = status("RssAnon")
            threading.Thread(target=self.run, daemon=True).start()
        def run(self):
            while True:
                self.peak = max(self.peak, status("RssAnon"))
                time.sleep(0.002)
""")

_ACTIVATIONS = _PRELUDE + textwrap.dedent(r"""
    args = json.loads(sys.argv[1])
    torch.manual_seed(0)
    cfg = GPTConfig(**args["cfg"])
    model = TinyGPT(cfg)
    x, y = synthetic_batch(cfg, args["batch"], args["seq"], torch.Generator().manual_seed(1))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    base = status("VmRSS")
    reset_peak()
    # the process's first forward+backward, as in the train process (where it follows the
    # baseline's VmRSS too): one-time costs (autograd threads, lazy kernel state) included
    lm_loss(model(x), y).backward()
    peak = status("VmHWM")
    print(json.dumps({"growth": peak - base, "grads": params,
                      "activations": max(0, peak - base - params)}))
""")

_TRAIN = _PRELUDE + textwrap.dedent(r"""
    args = json.loads(sys.argv[1])
    torch.manual_seed(0)
    cfg = GPTConfig(**args["cfg"])
    with infinity.empty_init():
        model = TinyGPT(cfg)
    x, y = synthetic_batch(cfg, args["batch"], args["seq"], torch.Generator().manual_seed(1))
    base = status("VmRSS")
    reset_peak()
    sampler = Sampler()
    anon0 = status("RssAnon")
    t0 = time.perf_counter()
    def init(module):  # torch's defaults, then the model's own (normal, std 0.02)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        TinyGPT.init_module(module)

    infinity.wrap(model, nvme_path=args["nvme"], init=init, param_tier="nvme",
                  grad_tier="nvme", optimizer_tier="nvme", host_budget=args["budget"],
                  prefetch_window=args["window"])
    wrap_s = time.perf_counter() - t0
    after_wrap = {"VmHWM": status("VmHWM"), "VmRSS": status("VmRSS")}
    n_params = sum(p.numel() for p in model.parameters())
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-4, states=args["states"])
    steps = []
    infinity.stats(model, reset=True)
    for i in range(args["steps"]):
        loss, fb_s, step_s, s = timed_step(model, opt, lambda: lm_loss(model(x), y))
        steps.append({"loss": loss.item(), "forward_backward_s": fb_s, "step_s": step_s,
                      "time": s["time"], "prefetch_hits": s["prefetch_hits"],
                      "prefetch_misses": s["prefetch_misses"],
                      "on_demand_fetches": s["on_demand_fetches"],
                      "stall_s": s["stall_seconds"], "fetches": s["fetches"],
                      "schedule_deviations": s["schedule_deviations"],
                      "host": s["tiers"]["host"], "device": s["tiers"]["device"],
                      "nvme_written": s["nvme_bytes_written"]["last_step"],
                      "RssAnon": status("RssAnon"), "RssFile": status("RssFile"),
                      "VmHWM": status("VmHWM")})
    print(json.dumps({"params": n_params, "base": base, "anon_base": anon0,
                      "peak": status("VmHWM"), "peak_anon": sampler.peak,
                      "after_wrap": after_wrap, "wrap_s": wrap_s, "steps": steps,
                      "nvme_bytes": infinity.stats(model)["tiers"]["nvme"]["now"]}))
    opt.close()
""")


def run_child(script: str, payload: Dict, timeout: float) -> Dict:
    code = f"ROOT = {ROOT!r}\n" + script
    out = subprocess.run([sys.executable, "-c", code, json.dumps(payload)],
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"bench_footprint child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--budget", type=int, default=None, help="host_budget in bytes")
    p.add_argument("--states", default="8bit", choices=("fp32", "bf16", "8bit"))
    p.add_argument("--window", type=int, default=2, help="prefetch window (blocks)")
    p.add_argument("--nvme-path", default=None, help="swap directory (default: temp dir)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_footprint.json"))
    args = p.parse_args(argv)
    cfg = model_config(args.quick)
    batch = args.batch or (2 if args.quick else 1)
    seq = args.seq or (32 if args.quick else 128)
    budget = args.budget or (64 * MIB if args.quick else 3 * GIB)
    timeout = 600 if args.quick else 7200
    swap = args.nvme_path or tempfile.mkdtemp(prefix="bench-footprint-", dir=tempfile.gettempdir())
    swap_dir = os.path.join(swap, "swap")
    os.makedirs(swap_dir, exist_ok=True)
    try:
        acts = {}
        for layers in (1, 2):
            c = dict(cfg, n_layers=layers)
            acts[layers] = run_child(_ACTIVATIONS, {"cfg": c, "batch": batch, "seq": seq},
                                     timeout)
        per_layer = max(0, acts[2]["activations"] - acts[1]["activations"])
        activations = acts[1]["activations"] + (cfg["n_layers"] - 1) * per_layer
        print(f"activations of a batch ({batch} x {seq}): {activations / MIB:.0f} MiB "
              f"(1 layer {acts[1]['activations'] / MIB:.0f} MiB, +{per_layer / MIB:.1f} MiB "
              "per layer)", flush=True)
        train = run_child(_TRAIN, {"cfg": cfg, "batch": batch, "seq": seq, "budget": budget,
                                   "states": args.states, "steps": args.steps,
                                   "window": args.window, "nvme": swap_dir}, timeout)
    finally:
        if args.nvme_path is None:
            shutil.rmtree(swap, ignore_errors=True)
        else:
            shutil.rmtree(swap_dir, ignore_errors=True)
    baseline = train["base"] + activations
    bound = budget + baseline
    after_first = train["steps"][1:]
    hits = sum(s["prefetch_hits"] for s in after_first)
    misses = sum(s["prefetch_misses"] for s in after_first)
    result = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": _common.machine_info(),
        "quick": args.quick, "model": cfg, "params": train["params"],
        "model_bytes_fp32": train["params"] * 4, "batch": batch, "seq": seq,
        "states": args.states, "window": args.window, "host_budget": budget,
        "baseline": {"rss_before_wrap": train["base"], "activations": activations,
                     "activations_1_layer": acts[1], "activations_2_layers": acts[2],
                     "total": baseline},
        "peak_rss": train["peak"], "peak_rss_anon_sampled": train["peak_anon"],
        "bound": bound, "within_bound": train["peak"] <= bound,
        "peak_over_baseline": train["peak"] - baseline,
        "engine_host_peak": max(s["host"]["peak"] for s in train["steps"]),
        "after_wrap": train["after_wrap"], "wrap_s": train["wrap_s"],
        "prefetch_hit_rate_after_first_step": hits / (hits + misses) if hits + misses else None,
        "steps": train["steps"], "nvme_bytes": train["nvme_bytes"],
    }
    print(f"model: {train['params'] / 1e9:.2f}B params ({train['params'] * 4 / GIB:.1f} GiB "
          f"fp32), states {args.states}, host_budget {budget / GIB:.2f} GiB")
    print(f"baseline: RSS before wrap {train['base'] / MIB:.0f} MiB + activations "
          f"{activations / MIB:.0f} MiB = {baseline / MIB:.0f} MiB")
    print(f"peak RSS {train['peak'] / MIB:.0f} MiB vs bound (budget + baseline) "
          f"{bound / MIB:.0f} MiB: {'within' if result['within_bound'] else 'OVER'}; "
          f"engine host accounting peak {result['engine_host_peak'] / MIB:.0f} MiB")
    print("\nstep  fwd+bwd s  opt s  hits  misses  on-demand  stall s  | time attribution (s)")
    for i, s in enumerate(train["steps"]):
        t = s["time"]
        opt = t.get("optimizer", {})
        print(f"{i:4d}  {s['forward_backward_s']:9.2f}  {s['step_s']:5.2f}  "
              f"{s['prefetch_hits']:4d}  {s['prefetch_misses']:6d}  "
              f"{s['on_demand_fetches']:9d}  {s['stall_s']:7.2f}  | "
              + " ".join(f"{k} {v:.2f}" for k, v in t.items() if not isinstance(v, dict))
              + " | optimizer " + " ".join(f"{k} {v:.2f}" for k, v in opt.items()))
    rate = result["prefetch_hit_rate_after_first_step"]
    if rate is not None:
        print(f"prefetch hits after the first step: {100 * rate:.0f}%")
    _common.write_json(args.out, result)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
