"""Layer-major accumulation against the plain micro-batch loop: NVMe bytes per step and time.

    python benchmarks/bench_layer_major.py            # Llama config: vocab 32000, hidden 512,
                                                      # ffn 1536, 8 layers (58M, fp32), k = 1, 4, 16
    python benchmarks/bench_layer_major.py --quick    # tiny, one measured step each (CI)

Everything on NVMe (parameters, gradients, optimizer states), ``infinity.optim.AdamW`` with
default settings (and, as a second layer-major run, ``keep_grads="auto"``; as a third, the step
taken in backward: ``accumulate(..., optimizer=opt)``; ``--clip X`` clips every variant's
step at X), micro-batches of
1 x 128 tokens. For each k, one model per variant: the plain loop (``(loss / k).backward()``
per micro-batch) and ``infinity.accumulate``. Each is warmed up (states created, the step's
overlap armed), then their measured steps alternate (``--repeats`` each); per step the NVMe
bytes by category per parameter (``stats()["nvme_per_step"]``), tokens, bytes per token, the
wall time of forward+backward and of ``opt.step()``, and the time spent waiting on the disk
(parameter fetch stalls, gradient offload -- accumulating in RAM and handing gradients to
the disk --, the optimizer's NVMe waits; each kept apart too). Medians are reported.
At the end the variants' weights are compared (bit for bit). Results:
benchmarks/results/bench_layer_major.json and .png.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/, this script's folder)

import infinity  # noqa: E402
import infinity.optim  # noqa: E402
from infinity.runtime.core.registry import engine_of  # noqa: E402

logger = logging.getLogger("bench_layer_major")
HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 3  # states created (1); the overlapping step arms after two one-backward steps
NVME = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")


def build(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        cfg = dict(
            vocab_size=4000,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    else:
        cfg = dict(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
        )
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=False, use_cache=False))


def micro_batches(k: int, vocab: int, tokens: int, seed: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ids = torch.randint(0, vocab, (1, tokens), generator=g)
        out.append(dict(input_ids=ids, labels=ids.clone()))
    return out


class Run:
    """One wrapped model and its optimizer, stepped with one variant."""

    def __init__(self, base, variant: str, swap: str, clip: Optional[float] = None) -> None:
        self.variant = variant
        self.clip = clip
        self.model = infinity.wrap(copy.deepcopy(base), nvme_path=swap, **NVME)
        keep = "auto" if variant == "layer_major_keep_auto" else True
        self.opt = infinity.optim.AdamW(self.model.parameters(), lr=1e-4, keep_grads=keep)

    def step(self, mbs) -> Dict[str, Any]:
        k = len(mbs)
        t0 = time.perf_counter()
        in_backward = self.variant == "step_in_backward"
        if self.variant == "plain":
            for mb in mbs:
                (self.model(**mb).loss / k).backward()
        elif in_backward:  # the whole step: each block stepped from RAM in backward
            infinity.accumulate(self.model, mbs, optimizer=self.opt, max_grad_norm=self.clip)
        else:
            infinity.accumulate(self.model, mbs)
        t1 = time.perf_counter()
        if not in_backward:
            if self.clip is not None:
                self.opt.clip_grad_norm_(self.clip)
            self.opt.step()
            self.opt.zero_grad()
        t2 = time.perf_counter()
        s = infinity.stats(self.model, reset=True)
        per = s["nvme_per_step"]
        tm = s["time"]
        disk_wait = tm["fetch_wait"] + tm["grad_offload"] + tm["optimizer"]["nvme_wait"]
        tokens = sum(mb["input_ids"].numel() for mb in mbs)
        moved = sum(v for c, v in per["bytes"].items() if not c.startswith("activations"))
        return {
            "fwd_bwd_s": t1 - t0,
            "step_s": t2 - t1,
            "total_s": t2 - t0,
            "disk_wait_s": disk_wait,
            "fetch_wait_s": tm["fetch_wait"],
            "grad_offload_s": tm["grad_offload"],
            "optimizer_nvme_wait_s": tm["optimizer"]["nvme_wait"],
            "bytes_per_param": per["bytes_per_param"],
            "written_bytes": per["written"],
            "tokens": tokens,
            "bytes_per_token": moved / tokens,
        }


def median_row(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key in (
        "fwd_bwd_s",
        "step_s",
        "total_s",
        "disk_wait_s",
        "fetch_wait_s",
        "grad_offload_s",
        "optimizer_nvme_wait_s",
        "bytes_per_token",
    ):
        out[key] = statistics.median(r[key] for r in rows)
    out["bytes_per_param"] = {
        c: statistics.median(r["bytes_per_param"][c] for r in rows)
        for c in rows[0]["bytes_per_param"]
    }
    out["tokens"] = rows[0]["tokens"]
    out["disk_wait_share"] = out["disk_wait_s"] / out["total_s"]
    return out


def plot(results: List[Dict[str, Any]], path: str) -> None:
    plt = _common.pyplot(logger)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for variant in sorted({r["variant"] for r in results}):
        rows = [r for r in results if r["variant"] == variant]
        ks = [r["k"] for r in rows]
        axes[0].plot(ks, [sum(r["bytes_per_param"].values()) for r in rows], "o-", label=variant)
        axes[1].plot(ks, [r["total_s"] for r in rows], "o-", label=variant)
    axes[0].set(
        xlabel="micro-batches per step",
        ylabel="NVMe bytes per parameter per step",
        xscale="log",
        title="disk traffic",
    )
    axes[1].set(
        xlabel="micro-batches per step",
        ylabel="seconds per step (median)",
        xscale="log",
        title="step time",
    )
    for ax in axes:
        ax.legend()
    _common.save_figure(fig, path)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny model, one measured step per variant (CI)"
    )
    ap.add_argument("--ks", default=None, help="micro-batches per step, comma-separated")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="measured steps per variant")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--clip", type=float, default=None, help="max_grad_norm for every variant")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "bench_layer_major.json"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ks = [int(x) for x in (args.ks or ("1,4,8" if args.quick else "1,4,16")).split(",")]
    tokens = 16 if args.quick else args.tokens
    repeats = 1 if args.quick else args.repeats
    base = build(args.quick)
    vocab = base.config.vocab_size
    params = sum(p.numel() for p in base.parameters())
    # the bytes per parameter of what the prefetch at the end of opt.step() reads (the root
    # block and the first prefetch-window layers): it may land in either step's count (stats
    # are cut at the step), so single steps differ by up to this
    prefetched_bpp = 0.0
    variants = ["plain", "layer_major", "layer_major_keep_auto", "step_in_backward"]
    results: List[Dict[str, Any]] = []
    same_weights: Dict[int, bool] = {}
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as swap:
        for k in ks:
            runs = {}
            for v in variants:
                os.makedirs(os.path.join(swap, f"{v}{k}"))
                runs[v] = Run(base, v, os.path.join(swap, f"{v}{k}"), args.clip)
                engine = engine_of(runs[v].model)
                ahead = [b for b in engine.blocks if b.is_root]
                ahead += [b for b in engine.blocks if b.kind == "layer"][: engine.schedule.window]
                prefetched_bpp = max(prefetched_bpp, sum(b.home_nbytes for b in ahead) / params)
            seed = 0
            for _ in range(WARMUP):
                for run in runs.values():
                    run.step(micro_batches(k, vocab, tokens, seed))
                seed += 1
            measured: Dict[str, List[Dict[str, Any]]] = {v: [] for v in variants}
            for _ in range(repeats):  # alternated: the machine's noise hits every variant
                for v, run in runs.items():
                    measured[v].append(run.step(micro_batches(k, vocab, tokens, seed)))
                seed += 1
            for v in variants:
                row = {"variant": v, "k": k, **median_row(measured[v])}
                results.append(row)
                logger.info(
                    "k=%2d %-22s %6.2f s/step (fwd+bwd %.2f, step %.2f) disk wait "
                    "%4.1f%%  B/param: %s",
                    k,
                    v,
                    row["total_s"],
                    row["fwd_bwd_s"],
                    row["step_s"],
                    100 * row["disk_wait_share"],
                    {c: round(b, 2) for c, b in row["bytes_per_param"].items() if b},
                )
            weights = {v: r.model.state_dict() for v, r in runs.items()}
            same_weights[k] = all(
                torch.equal(weights["plain"][n], weights[v][n])
                for v in variants[1:]
                for n in weights["plain"]
            )
            for run in runs.values():
                run.opt.close()
                infinity.unwrap(run.model)
    out = {
        "machine": _common.machine_info(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([os.path.basename(__file__)] + (argv or sys.argv[1:])),
        "clip": args.clip,
        "params": params,
        "tokens_per_micro_batch": tokens,
        "results": results,
        "prefetched_bytes_per_param": prefetched_bpp,
        "same_weights_as_plain": same_weights,
    }
    _common.write_json(args.json, out)
    plot(results, os.path.splitext(args.json)[0] + ".png")
    logger.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
