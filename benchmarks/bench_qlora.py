"""LoRA on a frozen base stored in NF4 (``wrap(frozen_format="nf4")``) against the same base in
bf16, in one benchmark run: step time, frozen bytes fetched per step by category, peak RSS.

    python benchmarks/bench_qlora.py --model llama-3.1-8b --layers 2 --steps 3
    python benchmarks/bench_qlora.py --model llama-3.1-8b                # all 32 layers
    python benchmarks/bench_qlora.py --quick                             # CI: tiny width

The model is transformers' ``LlamaForCausalLM`` at its published size (``--layers`` keeps the
first N layers; default all), built on meta in bf16, PEFT's LoRA (``--lora`` rank, alpha 2r) on
every linear layer of the decoder, then wrapped with the parameters on ``--tier`` (nvme by
default: the base is read from the disk at every fetch), gradients and optimizer states of the
adapters on host, ``host_budget`` and ``compute_dtype``; the base is filled by ``init``
(normal, std 0.02; norms 1). Each format runs in a fresh subprocess: ``nf4`` (the layers'
frozen matrices in NF4, embeddings, head and norms in bf16) and ``bfloat16`` (the whole base in
bf16). The kernel's peak RSS counter (VmHWM) is reset just before wrap and compared with
``RSS before wrap + budget + 0.5 GiB``. Frozen bytes per step come from ``infinity.stats()``
(``fetched``, by category) and are checked against the arithmetic of the stored sizes.
Results: benchmarks/results/bench_qlora*.json.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import textwrap
from typing import Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _common  # noqa: E402
from bench_real_models import CONFIGS, parse_size  # noqa: E402

GIB = 1 << 30
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

_CHILD = textwrap.dedent(r"""
    import json, os, sys, time
    sys.path.insert(0, ROOT)
    import torch
    import transformers
    import infinity
    from peft import LoraConfig, get_peft_model

    args = json.loads(sys.argv[1])
""") + _common.CHILD_RSS_HELPERS + _common.CHILD_TIMED_STEP + _common.CHILD_INIT + textwrap.dedent(r"""
    cfg_args = dict(args["config"])
    cfg_args.pop("arch")
    config = transformers.LlamaConfig(**cfg_args, max_position_embeddings=4096, use_cache=False)
    torch.manual_seed(0)
    with infinity.empty_init():
        base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    lora = LoraConfig(r=args["lora"], lora_alpha=2 * args["lora"], lora_dropout=0.0,
                      target_modules=args["targets"])
    model = get_peft_model(base, lora)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids = torch.randint(0, config.vocab_size, (args["batch"], args["seq"]),
                        generator=torch.Generator().manual_seed(1))

    fmt = None if args["format"] == "bfloat16" else args["format"]
    base_rss = status("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    infinity.wrap(model, nvme_path=args["nvme"], init=init, host_budget=args["budget"],
                  compute_dtype=getattr(torch, args["compute"]), param_tier=args["tier"],
                  grad_tier="host", optimizer_tier="host", placement=None,
                  frozen_format=fmt)
    wrap_s = time.perf_counter() - t0
    from infinity.runtime.engine import engine_of
    flats = {}
    for block in engine_of(model).blocks:
        for f in block.flats:
            flats.setdefault(f.category, []).append(f.home_nbytes)
    opt = infinity.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    steps = []
    infinity.stats(model, reset=True)
    for i in range(args["steps"]):
        loss, fb_s, step_s, s = timed_step(model, opt,
                                           lambda: model(input_ids=ids, labels=ids).loss)
        steps.append({"loss": loss.item(), "forward_backward_s": fb_s, "step_s": step_s,
                      "fetched": s["fetched"], "moved": s["moved"], "fetches": s["fetches"],
                      "stall_s": s["stall_seconds"], "VmHWM": status("VmHWM"),
                      "host": s["tiers"]["host"]})
        print(json.dumps({"format": args["format"], "progress": i, "loss": loss.item(),
                          "fwd_bwd_s": fb_s, "opt_s": step_s, "VmHWM": status("VmHWM")}),
              file=sys.stderr, flush=True)
    print(json.dumps({"params": n_params, "trainable": n_train, "base": base_rss,
                      "peak": status("VmHWM"), "wrap_s": wrap_s, "flats": flats,
                      "steps": steps}))
    opt.close()
""")


def summarize(run: Dict, budget: int) -> Dict:
    """Per-step figures after the first step (which records the schedule) and the arithmetic
    check of the frozen layer bytes: each fetch of a layer moves its stored flats whole."""
    steps = run["steps"][1:] or run["steps"]
    fb = sorted(s["forward_backward_s"] for s in steps)[len(steps) // 2]
    total = sorted(s["forward_backward_s"] + s["step_s"] for s in steps)[len(steps) // 2]
    fetched = steps[-1]["fetched"]
    frozen = {k: v for k, v in fetched.items() if k.startswith("frozen.")}
    layers = [k for k in fetched if k.startswith("frozen.layer.")]  # the base's matrices
    layer_cat = max(layers, key=fetched.__getitem__) if layers else None
    check = None
    if layer_cat is not None:
        sizes = run["flats"][layer_cat]
        per_layer = sizes[0]
        count, rest = divmod(fetched[layer_cat], per_layer)
        check = {"category": layer_cat, "stored_bytes_per_layer": per_layer,
                 "layer_fetches": count, "remainder": rest,
                 "all_layers_same_size": len(set(sizes)) == 1}
    bound = run["base"] + budget + GIB // 2
    return {"median_forward_backward_s": fb, "median_step_total_s": total,
            "frozen_bytes_per_step": frozen, "fetched_per_step": fetched,
            "layer_bytes_check": check, "peak_rss": run["peak"], "rss_before_wrap": run["base"],
            "bound": bound, "within_bound": run["peak"] <= bound,
            "median_fetch_wait_s": sorted(s["stall_s"] for s in steps)[len(steps) // 2],
            "losses": [s["loss"] for s in run["steps"]], "steps": run["steps"]}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(CONFIGS))
    p.add_argument("--quick", action="store_true", help="tiny width, real vocabulary (CI)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers "
                   "(default: all)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lora", type=int, default=16, help="LoRA rank on every linear layer")
    p.add_argument("--budget", default="4GiB", help="host_budget")
    p.add_argument("--tier", default="nvme", choices=("nvme", "host"))
    p.add_argument("--compute", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--formats", default="nf4,bfloat16",
                   help="comma-separated: nf4, int8, bfloat16 (the base's stored format)")
    p.add_argument("--nvme-path", default=None, help="swap directory (default: temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    name = "quick" if args.quick else args.model
    config = dict(CONFIGS[name])
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    steps = 2 if args.quick else args.steps
    seq = 32 if args.quick else args.seq
    budget = parse_size("256MiB" if args.quick and args.budget == "4GiB" else args.budget)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    results = {}
    for fmt in formats:
        swap = args.nvme_path or tempfile.mkdtemp(prefix="bench-qlora-",
                                                  dir=tempfile.gettempdir())
        swap_dir = os.path.join(swap, f"swap-{fmt}")
        os.makedirs(swap_dir, exist_ok=True)
        payload = {"config": config, "batch": args.batch, "seq": seq, "budget": budget,
                   "steps": steps, "nvme": swap_dir, "compute": args.compute, "tier": args.tier,
                   "lora": args.lora, "targets": LINEARS, "format": fmt}
        try:
            run = _common.run_child("bench_qlora", _CHILD, payload,
                                    timeout=900 if args.quick else 6 * 3600)
        finally:
            shutil.rmtree(swap_dir if args.nvme_path else swap, ignore_errors=True)
        results[fmt] = {"params": run["params"], "trainable": run["trainable"],
                        "wrap_s": run["wrap_s"], "flats": run["flats"],
                        **summarize(run, budget)}
    result = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": _common.machine_info(),
        "model": name, "config": config, "batch": args.batch, "seq": seq, "lora_rank": args.lora,
        "tier": args.tier, "compute_dtype": args.compute, "host_budget": budget,
        "formats": results,
    }
    for fmt, r in results.items():
        frozen = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in
                           sorted(r["frozen_bytes_per_step"].items()))
        print(f"{name} ({config['num_hidden_layers']} layers) base {fmt}: "
              f"fwd+bwd {r['median_forward_backward_s']:.2f} s, step {r['median_step_total_s']:.2f}"
              f" s; frozen bytes/step: {frozen}; peak RSS {r['peak_rss'] / GIB:.2f} GiB "
              f"(bound {r['bound'] / GIB:.2f}: {'within' if r['within_bound'] else 'OVER'})")
    out = args.out or os.path.join(
        HERE, "results", "bench_qlora_quick.json" if args.quick else
        f"bench_qlora_{name}_{config['num_hidden_layers']}l_{args.tier}.json")
    _common.write_json(out, result)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
