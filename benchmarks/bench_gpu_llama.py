"""A real Llama on one GPU: parameters on host, 8-bit optimizer states, a device budget that
models a 24 GB card, against the same model resident on the GPU with torch's fused AdamW.

    python benchmarks/bench_gpu_llama.py OUT_DIR                 # Llama-3.1-8B config, 8 x 2048
    python benchmarks/bench_gpu_llama.py OUT_DIR --quick         # tiny config, CPU (run by tests)

The model is built on the meta device from transformers' LlamaConfig at its published sizes and
initialised by transformers' ``_init_weights`` block by block (no download), weights in bf16.
infinity: ``param_tier="host"``, ``optimizer_tier`` as ``--optimizer-tier`` (default host:
the CPU step runs on the machine's cores while the GPU computes), ``states="8bit"``,
``device_budget`` = ``--card-gib`` minus the activations' share (``--activation-gib``).
Measured per step (medians of ``--steps`` after ``--warmup``): step time, tokens/s, the GPU's
utilisation sampled every 50 ms by ``torch.cuda.utilization()`` (NVML: the share of time a
kernel ran), ``torch.cuda.max_memory_allocated()``, prefetch hits from ``infinity.stats``.
The resident baseline runs in a second process (the same config, bf16 parameters, torch
``AdamW(fused=True)``); if it does not fit (an OOM) that is recorded and the ratio is n/a.
Each result is written to OUT_DIR/llama.json as soon as it exists (a stage cut short keeps
what it measured).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import torch

LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                   tie_word_embeddings=False, max_position_embeddings=8192)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            max_position_embeddings=256)


class Utilisation:
    """Samples torch.cuda.utilization() in a thread (no-op without CUDA/NVML)."""

    def __init__(self, device: str) -> None:
        self.samples: List[float] = []
        self._stop = threading.Event()
        self._thread = None
        if device == "cuda":
            try:
                torch.cuda.utilization()
            except Exception:
                return
            self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(float(torch.cuda.utilization()))

    def __enter__(self) -> Utilisation:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self):
        return statistics.mean(self.samples) if self.samples else None


def _save(out: Path, result: Dict) -> None:
    path = out / "llama.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(result)
    path.write_text(json.dumps(data, indent=2))


def _batch(cfg, batch: int, seq: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)


def _train(model, opt, tokens, steps: int, warmup: int, device: str) -> Dict:
    times = []
    with Utilisation(device) as util:
        for i in range(warmup + steps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            if i == warmup - 1:
                util.samples.clear()
    step = statistics.median(times)
    tokens_per_step = tokens.shape[0] * (tokens.shape[1] - 1)
    return {"step_s": step, "steps_s": times, "tokens_per_s": tokens_per_step / step,
            "gpu_util_pct": util.mean, "loss": out.loss.item(),
            "max_memory_allocated": (torch.cuda.max_memory_allocated() if device == "cuda"
                                     else None)}


def run_infinity(args, cfg_kw: Dict, device: str) -> Dict:
    import transformers

    import infinity
    cfg = transformers.LlamaConfig(**cfg_kw)
    with infinity.empty_init():
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16) if device == "cuda" else model
    gib = 1 << 30
    budget = None if args.quick else int((args.card_gib - args.activation_gib) * gib)
    # transformers' own initialisation, module by module (RMSNorm has no reset_parameters)
    kw = dict(param_tier="host", optimizer_tier=args.optimizer_tier, init=model._init_weights)
    if budget is not None:
        kw["device_budget"] = budget
    if args.optimizer_tier == "nvme" or args.nvme_path:
        kw["nvme_path"] = args.nvme_path
    t0 = time.perf_counter()
    infinity.wrap(model, **kw)
    wrap_s = time.perf_counter() - t0
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-5, states="8bit")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    res = _train(model, opt, _batch(cfg, args.batch, args.seq, device), args.steps, args.warmup,
                 device)
    stats = infinity.stats(model)
    res.update(wrap_s=wrap_s, device_budget=budget, params=sum(p.numel() for p in
                                                                 model.parameters()),
               prefetch_hit_rate=stats.get("prefetch_hit_rate"),
               prefetch_hits=stats.get("prefetch_hits"),
               prefetch_misses=stats.get("prefetch_misses"), optimizer_states=stats.get("optimizer_states"),
               card_bytes=int(args.card_gib * gib))
    return res


def run_resident(args, cfg_kw: Dict, device: str) -> Dict:
    import transformers
    cfg = transformers.LlamaConfig(**cfg_kw)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    if device == "cuda":
        model = model.to(torch.bfloat16)
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return _train(model, opt, _batch(cfg, args.batch, args.seq, device), args.steps, args.warmup,
                  device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help="tiny config on this machine's device")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--card-gib", type=float, default=24.0)
    ap.add_argument("--activation-gib", type=float, default=12.0,
                    help="the modelled card's share left to activations and workspace")
    ap.add_argument("--optimizer-tier", choices=("host", "nvme"), default="host")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--only", choices=("infinity", "resident"), default=None,
                    help="run one side in this process (the driver runs each in its own)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg_kw = TINY if args.quick else LLAMA_31_8B
    if args.quick:
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 2, 1
    if args.only is not None:
        fn = run_infinity if args.only == "infinity" else run_resident
        try:
            result = fn(args, cfg_kw, device)
        except torch.cuda.OutOfMemoryError as exc:
            result = {"error": f"out of memory: {exc}"[:500]}
        _save(args.out, {args.only: result, "device": device, "config": cfg_kw,
                         "batch": args.batch, "seq": args.seq})
        return
    for side in ("infinity", "resident"):
        cmd = [sys.executable, __file__, str(args.out), "--only", side, "--batch",
               str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--card-gib", str(args.card_gib), "--activation-gib",
               str(args.activation_gib), "--optimizer-tier", args.optimizer_tier]
        if args.quick:
            cmd.append("--quick")
        if args.nvme_path:
            cmd += ["--nvme-path", args.nvme_path]
        proc = subprocess.run(cmd, env=dict(os.environ))
        if proc.returncode != 0:
            _save(args.out, {side: {"error": f"exit code {proc.returncode}"}})
    data = json.loads((args.out / "llama.json").read_text())
    inf, res = data.get("infinity", {}), data.get("resident", {})
    ratio = (inf["tokens_per_s"] / res["tokens_per_s"]
             if "tokens_per_s" in inf and "tokens_per_s" in res else None)
    _save(args.out, {"tokens_per_s_ratio": ratio})
    print(json.dumps({"infinity_tokens_per_s": inf.get("tokens_per_s"),
                      "resident_tokens_per_s": res.get("tokens_per_s"), "ratio": ratio,
                      "gpu_util_pct": inf.get("gpu_util_pct"),
                      "max_memory_allocated": inf.get("max_memory_allocated")}))


if __name__ == "__main__":
    main()
