"""Real Hugging Face configs trained with everything on NVMe under a fixed host budget: peak
RSS against the budget, swap bytes per parameter by category, NVMe bytes per step.

    python benchmarks/bench_real_models.py --model llama-3.2-3b --budget 4GiB --steps 3
    python benchmarks/bench_real_models.py --model llama-3.1-8b --layers 4 --budget 6GiB
    python benchmarks/bench_real_models.py --model llama-3.2-3b --layers 2 --vocab 32000
    python benchmarks/bench_real_models.py --quick        # full 128k vocabulary, tiny width (CI)
    python benchmarks/bench_real_models.py --micro-batches 8 --layer-major --compute float32
    python benchmarks/bench_real_models.py --model llama-3.2-1b --overlap off --attribute

The model is transformers' ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) at its published
sizes (``--layers`` keeps the first N layers, ``--vocab`` changes the vocabulary only), built
under ``infinity.empty_init()`` in bf16 as the models are published (``--weights float32`` for
fp32 homes), filled by ``init`` (normal, std 0.02; norms 1), and wrapped with parameters,
gradients and optimizer states on NVMe, ``host_budget`` and ``compute_dtype`` (bfloat16 by
default, as the weights: on this AMX CPU a Llama layer's forward + backward ran 3.7x faster in
bf16 than in fp32; ``--compute float32`` computes in fp32 from the bf16 homes). Each run is one fresh
subprocess; the kernel's peak RSS counter (VmHWM) is reset just before wrap and compared with
``RSS before wrap + budget + 0.5 GiB`` (the target bound). The swap directory is walked after
every step: its files' sizes by category (parameters, gradients, optimizer states) and per
parameter. Results: benchmarks/results/bench_real_models*.json.

``--attribute``: where each ``opt.step()`` went, from the optimizer's per-request timeline
(``bench_nvme_step.attribute``: blocked on reads / on writes, CPU Adam, time with reads, writes,
both or nothing in flight), and the disk measured in the same run after the steps
(``bench_nvme_step.DiskProbe`` in the swap directory: read, write and mixed rates in 64 MiB
requests): the step against the disk time of its own bytes at those rates. This VM's disk read
between 0.89 and 1.42 GB/s within one hour, so a rate from an earlier probe is no reference.
With the update overlapping backward part of a step's I/O runs during backward: use
``--overlap off`` for a clean attribution.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import textwrap
from typing import Any, Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _common  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20

# Published configs (the fields that set the parameter count and the compute).
CONFIGS: Dict[str, Dict[str, Any]] = {
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
                         rms_norm_eps=1e-5),
    "llama-3.2-3b": dict(arch="llama", vocab_size=128256, hidden_size=3072,
                         intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
                         rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0,
                         rms_norm_eps=1e-5),
    "qwen2.5-3b": dict(arch="qwen2", vocab_size=151936, hidden_size=2048,
                       intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
                       rms_norm_eps=1e-6),
    # CI: the real vocabulary, a tiny width
    "quick": dict(arch="llama", vocab_size=128256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5),
}

_CHILD = textwrap.dedent(r"""
    import json, os, sys, threading, time
    sys.path.insert(0, ROOT)
    import torch
    import transformers
    import infinity

    args = json.loads(sys.argv[1])
""") + _common.CHILD_RSS_HELPERS + _common.CHILD_TIMED_STEP + _common.CHILD_INIT + textwrap.dedent(r"""

    class Sampler:  # the kernel keeps no peak of RssAnon / RssFile: sample them
        def __init__(self):
            self.anon = self.file = 0
            threading.Thread(target=self.run, daemon=True).start()
        def run(self):
            while True:
                self.anon = max(self.anon, status("RssAnon"))
                self.file = max(self.file, status("RssFile"))
                time.sleep(0.005)

    def category(name):
        if name.endswith(".grad.swp"):
            return "gradients"
        if ".opt" in name or ".state" in name or name.startswith("optimizer-states"):
            return "optimizer states"
        if name.endswith(".swp"):
            return "parameters"
        return "other"

    def swap_bytes(path):
        out = {}
        for root, _dirs, files in os.walk(path):
            for f in files:
                st = os.stat(os.path.join(root, f))
                c = category(f)
                out[c] = out.get(c, 0) + st.st_blocks * 512  # allocated, not apparent
        return out

    cfg_args = dict(args["config"])
    arch = cfg_args.pop("arch")
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = cls_cfg(**cfg_args, max_position_embeddings=4096, use_cache=False)
    dtype = getattr(torch, args["weights"])
    torch.manual_seed(0)
    with infinity.empty_init():
        model = cls_model(config).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (args["batch"], args["seq"]),
                        generator=torch.Generator().manual_seed(1))
    micro = args.get("micro_batches", 1)
    batches = [dict(input_ids=m, labels=m) for m in
               torch.randint(0, config.vocab_size, (micro, args["batch"], args["seq"]),
                             generator=torch.Generator().manual_seed(2))]

    def accumulated_step():
        # micro-batches: the plain loop, or infinity.accumulate (layer-major)
        t0 = time.perf_counter()
        if args.get("step_in_backward"):  # the step too, each block stepped in backward
            losses = infinity.accumulate(model, batches, optimizer=opt,
                                         max_grad_norm=args.get("clip"))
        elif args.get("layer_major"):
            losses = infinity.accumulate(model, batches)
        else:
            losses = []
            for b in batches:
                loss = model(**b).loss
                losses.append(loss.detach())
                (loss / micro).backward()
        t1 = time.perf_counter()
        if not args.get("step_in_backward"):
            if args.get("clip"):
                opt.clip_grad_norm_(args["clip"])
            opt.step()
            opt.zero_grad()
        t2 = time.perf_counter()
        return sum(losses) / micro, t1 - t0, t2 - t1, infinity.stats(model, reset=True)

    planned = None
    if args["tiers"] == "plan":  # the planner's placement for this budget and these states
        from infinity.plan.planner import plan
        p = plan(model, nvme_path=args["nvme"], host_budget=args["budget"],
                 states=args["states"].replace("-all", ""), batch=args["batch"], seq=args["seq"])
        tiers = dict(p.policy_changes())
        planned = {"placement": p.placement, "predicted_step_s": p.estimate.step_s,
                   "host_bytes": p.estimate.host_bytes, "device_bytes": p.estimate.device_bytes,
                   "nvme_bytes": p.estimate.nvme_bytes,
                   "settings": {k: str(v) for k, v in tiers.items()}}
        print(json.dumps({"plan": planned}), file=sys.stderr, flush=True)
    else:
        tiers = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
    base = status("VmRSS")
    reset_peak()
    sampler = Sampler()
    t0 = time.perf_counter()
    infinity.wrap(model, nvme_path=args["nvme"], init=init, host_budget=args["budget"],
                  compute_dtype=getattr(torch, args["compute"]), placement=None, **tiers,
                  **({"chunk_bytes": args["chunk"]} if args["chunk"] else {}),
                  **({"tiled_head": True} if args.get("tiled_head") else {}),
                  **({"embedding_rows": False} if args.get("whole_embedding") else {}))
    wrap_s = time.perf_counter() - t0
    after_wrap = {"VmHWM": status("VmHWM"), "VmRSS": status("VmRSS")}
    t0 = time.perf_counter()
    states = args["states"]
    if states == "8bit-all":  # 8-bit moments for the embedding and head too (named)
        states = {"default": "8bit", model.get_input_embeddings(): "8bit",
                  model.get_output_embeddings(): "8bit"}
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-5, states=states,
                               overlap=args["overlap"], keep_grads=args["keep_grads"],
                               master=args.get("master", "fp32"),
                               **({"chunk_bytes": args["opt_chunk"]} if args.get("opt_chunk")
                                  else {}))
    opt_s = time.perf_counter() - t0
    steps = []
    infinity.stats(model, reset=True)
    if args.get("attribute"):
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from bench_nvme_step import DiskProbe, attribute
        from infinity.optim.states import swapper
        swapper.record_requests(True)
    for i in range(args["steps"]):
        if micro > 1 or args.get("layer_major") or args.get("step_in_backward"):
            loss, fb_s, step_s, s = accumulated_step()
        else:
            loss, fb_s, step_s, s = timed_step(model, opt,
                                               lambda: model(input_ids=ids, labels=ids).loss)
        if args.get("attribute"):
            st = opt.last_step_stats
            where = {"bytes_read": st.bytes_read, "bytes_written": st.bytes_written,
                     "compute_s": st.compute_s}
            where.update(attribute(st, 0.0, step_s))
            print(json.dumps({"progress": i, "attribution": where}), file=sys.stderr,
                  flush=True)
        steps.append({"loss": loss.item(), "forward_backward_s": fb_s, "step_s": step_s,
                      "moved": s.get("moved"), "nvme_written": s["nvme_bytes_written"]["last_step"],
                      "nvme_per_step": s["nvme_per_step"],
                      "host": s["tiers"]["host"], "device": s["tiers"]["device"],
                      "stall_s": s["stall_seconds"], "VmHWM": status("VmHWM"),
                      "peak_rss_anon_sampled": sampler.anon,
                      "peak_rss_file_sampled": sampler.file,
                      "VmRSS": status("VmRSS"), "swap": swap_bytes(args["nvme"]),
                      "swap_categories": s.get("swap"),
                      "accumulate": s.get("accumulate"),
                      **({"attribution": where} if args.get("attribute") else {})})
        print(json.dumps({"progress": i, "loss": loss.item(), "fwd_bwd_s": fb_s,
                          "step_s": step_s, "VmHWM": status("VmHWM"),
                          "anon_peak": sampler.anon, "file_peak": sampler.file,
                          "engine_host_peak": s["tiers"]["host"]["peak"]}), file=sys.stderr,
              flush=True)
    disk = None
    if args.get("attribute"):
        swapper.record_requests(False)
        probe = DiskProbe(args["nvme"], min(4 << 30, max(st.bytes_read, 64 << 20)), 64 << 20)
        disk = {"read_bps": probe.read(), "write_bps": probe.write()}
        disk["mixed_s"] = probe.mixed()
        disk["mixed_bytes"] = 2 * probe.nbytes
        for path in probe.paths:
            os.remove(path)
    model.eval()
    with torch.no_grad():
        eval_loss = model(input_ids=ids, labels=ids).loss.item()
    print(json.dumps({"params": n_params, "base": base, "peak": status("VmHWM"),
                      "after_wrap": after_wrap, "wrap_s": wrap_s, "optimizer_init_s": opt_s,
                      "steps": steps, "eval_loss": eval_loss, "plan": planned,
                      "state_formats": infinity.stats(model).get("optimizer_states"),
                      "swap": swap_bytes(args["nvme"]), "disk": disk}))
    opt.close()
""")


def parse_size(text: str) -> int:
    sys.path.insert(0, ROOT)
    from infinity.sizes import parse_size as parse
    return parse(text, "--budget", minimum=1)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-3.2-3b", choices=sorted(CONFIGS))
    p.add_argument("--quick", action="store_true", help="the 'quick' config, 2 steps (CI)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--vocab", type=int, default=None, help="change the vocabulary size")
    p.add_argument("--steps", type=int, default=None, help="steps (default 3; 2 with --quick)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--budget", default="4GiB", help="host_budget (e.g. 4GiB)")
    p.add_argument("--chunk", default=None, help="chunk_bytes (default: from the budget)")
    p.add_argument("--opt-chunk", default=None,
                   help="the optimizer's chunk_bytes (default: the model's)")
    p.add_argument("--states", default="8bit", choices=("fp32", "bf16", "8bit", "8bit-all"),
                   help="optimizer states; 8bit keeps fp32 moments for embeddings (the "
                   "optimizer's safeguard), 8bit-all names them 8-bit too")
    p.add_argument("--weights", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--compute", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--tiers", default="nvme", choices=("nvme", "plan"),
                   help="everything on NVMe, or the planner's placement for the budget")
    p.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                   help="the optimizer's update overlapping backward")
    p.add_argument("--keep-grads", default="true", choices=("true", "auto"),
                   help="the optimizer's keep_grads (auto: gradient writes skipped where the "
                   "step overlapping backward takes them from RAM and nothing needs them)")
    p.add_argument("--nvme-path", default=None, help="swap directory (default: temp dir)")
    p.add_argument("--tiled-head", action="store_true",
                   help="wrap with tiled_head=True (the LM head and loss in vocabulary tiles)")
    p.add_argument("--whole-embedding", action="store_true",
                   help="wrap with embedding_rows=False (an untied embedding fetched whole)")
    p.add_argument("--attribute", action="store_true",
                   help="where each opt.step() went (per-request timeline) and the disk's "
                   "read / write / mixed rates measured in the same run")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches of --batch x --seq per optimizer step (the plain loop)")
    p.add_argument("--layer-major", action="store_true",
                   help="run the micro-batches with infinity.accumulate (layer-major)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="infinity.accumulate(..., optimizer=opt): layer-major, each block "
                        "stepped from RAM in backward (no gradient written)")
    p.add_argument("--clip", type=float, default=None, help="max_grad_norm (default: none)")
    p.add_argument("--master", default="fp32", choices=("fp32", "bf16_sr", "bf16_kahan"),
                   help="the optimizer's master weights")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    name = "quick" if args.quick else args.model
    config = dict(CONFIGS[name])
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    if args.vocab is not None:
        config["vocab_size"] = args.vocab
    steps = args.steps if args.steps is not None else (2 if args.quick else 3)
    seq = 32 if args.quick else args.seq
    budget = parse_size("256MiB" if args.quick and args.budget == "4GiB" else args.budget)
    chunk = parse_size(args.chunk) if args.chunk else None
    swap = args.nvme_path or tempfile.mkdtemp(prefix="bench-real-", dir=tempfile.gettempdir())
    swap_dir = os.path.join(swap, "swap")
    os.makedirs(swap_dir, exist_ok=True)
    payload = {"config": config, "batch": args.batch, "seq": seq, "budget": budget,
               "chunk": chunk, "states": args.states, "steps": steps, "nvme": swap_dir,
               "opt_chunk": parse_size(args.opt_chunk) if args.opt_chunk else None,
               "weights": args.weights, "compute": args.compute,
               "overlap": {"auto": "auto", "on": True, "off": False}[args.overlap],
               "keep_grads": True if args.keep_grads == "true" else "auto",
               "tiers": args.tiers, "tiled_head": args.tiled_head,
               "whole_embedding": args.whole_embedding, "attribute": args.attribute,
               "micro_batches": args.micro_batches, "layer_major": args.layer_major,
               "step_in_backward": args.step_in_backward, "clip": args.clip,
               "master": args.master}
    try:
        run = _common.run_child("bench_real_models", _CHILD, payload,
                                timeout=900 if args.quick else 4 * 3600)
    finally:
        if args.nvme_path is None:
            shutil.rmtree(swap, ignore_errors=True)
        else:
            shutil.rmtree(swap_dir, ignore_errors=True)
    bound = run["base"] + budget + GIB // 2
    n = run["params"]
    swap_total = sum(run["swap"].values())
    result = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": _common.machine_info(),
        "model": name, "config": config, "params": n, "batch": args.batch, "seq": seq,
        "states": args.states, "weights": args.weights, "compute_dtype": args.compute,
        "host_budget": budget, "chunk_bytes": chunk, "overlap": args.overlap,
        "tiled_head": args.tiled_head, "embedding_rows": not args.whole_embedding,
        "keep_grads": args.keep_grads, "micro_batches": args.micro_batches,
        "layer_major": args.layer_major, "step_in_backward": args.step_in_backward,
        "clip": args.clip, "master": args.master,
        "rss_before_wrap": run["base"], "peak_rss": run["peak"], "bound": bound,
        "within_bound": run["peak"] <= bound, "peak_over_base": run["peak"] - run["base"],
        "swap_bytes": run["swap"], "swap_bytes_total": swap_total,
        "swap_bytes_per_param": {k: v / n for k, v in run["swap"].items()},
        "wrap_s": run["wrap_s"], "optimizer_init_s": run["optimizer_init_s"],
        "eval_loss": run["eval_loss"], "state_formats": run["state_formats"],
        "tiers": args.tiers, "plan": run["plan"],
        "steps": run["steps"], "disk": run.get("disk"),
    }
    print(f"{name}: {n / 1e9:.3f}B params ({config['num_hidden_layers']} layers, vocab "
          f"{config['vocab_size']}), weights {args.weights}, compute {args.compute}, states "
          f"{args.states}, host_budget {budget / GIB:.2f} GiB")
    print(f"peak RSS {run['peak'] / GIB:.2f} GiB vs bound (RSS before wrap "
          f"{run['base'] / GIB:.2f} + budget + 0.5 GiB) {bound / GIB:.2f} GiB: "
          f"{'within' if result['within_bound'] else 'OVER'}")
    print("swap: " + ", ".join(f"{k} {v / GIB:.2f} GiB ({v / n:.2f} B/param)"
                               for k, v in sorted(run["swap"].items()))
          + f"; total {swap_total / GIB:.2f} GiB ({swap_total / n:.2f} B/param)")
    for i, s in enumerate(run["steps"]):
        print(f"step {i}: loss {s['loss']:.4f}  fwd+bwd {s['forward_backward_s']:.1f} s  "
              f"opt {s['step_s']:.1f} s  NVMe written {s['nvme_written'] / GIB:.2f} GiB  "
              f"VmHWM {s['VmHWM'] / GIB:.2f} GiB")
        per = s["nvme_per_step"]["bytes_per_param"]
        print("  NVMe B/param: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items() if v)
              + f"; SSD wear {s['nvme_per_step']['tb_written_per_1000_steps']:.3f} TB per "
              "1,000 steps")
        sc = s.get("swap_categories")
        if sc:
            print("  swap B/param: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                  sc["per_param"].items()))
    disk = run.get("disk")
    if disk:
        print(f"disk, same run: read {disk['read_bps'] / 1e9:.2f} GB/s, write "
              f"{disk['write_bps'] / 1e9:.2f} GB/s, mixed "
              f"{disk['mixed_bytes'] / disk['mixed_s'] / 1e9:.2f} GB/s")
        for i, s in enumerate(run["steps"]):
            a = s["attribution"]
            disk_s = a["bytes_read"] / disk["read_bps"] + a["bytes_written"] / disk["write_bps"]
            a["disk_s_same_run"] = disk_s
            a["step_over_disk"] = s["step_s"] / disk_s if disk_s > 0 else None
            print(f"step {i}: opt.step {s['step_s']:.1f} s = {a['step_over_disk'] or 0:.2f}x the "
                  f"disk time of its bytes ({disk_s:.1f} s); blocked on reads "
                  f"{a['read_wait_s']:.1f} s, on writes {a['write_wait_s']:.1f} s, CPU Adam "
                  f"{a['compute_s']:.1f} s; disk idle {a['disk_idle_s']:.2f} s")
    print(f"eval loss after training: {run['eval_loss']:.4f}")
    out = args.out or os.path.join(
        HERE, "results", "bench_real_models_quick.json" if args.quick else
        f"bench_real_models_{name}_{config['num_hidden_layers']}l_v{config['vocab_size']}.json")
    _common.write_json(out, result)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
