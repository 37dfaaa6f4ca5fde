"""The NVMe optimizer step in chunks: host bytes of its buffer sets, and step time against the
whole-shard step.

1. Buffer-set bytes for Llama-3.2-3B's root shard (tied embedding 128256 x 3072 + final norm,
   8-bit states), computed from the optimizer's own geometry (no model is built): before (3
   sets of states + working copy + gradients of the whole shard) and with the chunk derived
   from a host budget.
2. Step time of a small GPT (parameters, gradients and states on NVMe) with a chunk larger
   than every shard against smaller chunks, the runs interleaved step by step in one process
   (median over the steps after the first).

    python benchmarks/bench_nvme_chunked_step.py --nvme-path /tmp/swap [--quick] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Dict, List

import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.ops.adam_compact import num_blocks
from infinity.optim.step.layout import StateLayout
from infinity.optim.step import chunks
from infinity.tiers.chunk_size import resolve_chunk_bytes


def set_bytes_3b() -> List[Dict[str, int]]:
    emb, norm = 128256 * 3072, 3072
    slots = [(0, emb), (emb, norm)]
    n = emb + norm
    layout = StateLayout("8bit", n, True, (0, num_blocks(emb)),
                         num_blocks(emb) + num_blocks(norm))
    grads, home = 4 * n, 4 * n  # fp32 gradients and working copy on NVMe
    rows = [{"case": "before (3 whole-shard sets)", "sets": 3 * (layout.nbytes + grads + home)}]
    for budget in (18 << 30, 4 << 30):
        chunk = resolve_chunk_bytes(None, budget)
        plan = chunks.plan_chunks(layout, slots, chunk)
        unit = plan.buffer_nbytes
        rows.append({"case": f"host_budget {budget >> 30} GiB", "chunk": chunk,
                     "units": len(plan.units), "sets": 3 * unit,
                     "shard_slot": grads + home, "total_min": 3 * unit + grads + home})
    return rows


def step_times(nvme_path: str, quick: bool) -> List[Dict[str, object]]:
    cfg = (GPTConfig(vocab_size=4096, d_model=128, n_layers=2, n_heads=2, max_seq=32) if quick
           else GPTConfig(vocab_size=16384, d_model=256, n_layers=4, n_heads=4, max_seq=32))
    steps = 4 if quick else 16
    rows: List[Dict[str, object]] = []
    gen = torch.Generator().manual_seed(1)
    for fmt in ("fp32", "8bit"):
        runs = {}
        for chunk in (1 << 30, 4 << 20, 1 << 20):
            torch.manual_seed(0)
            model = TinyGPT(cfg)
            infinity.wrap(model, nvme_path=tempfile.mkdtemp(dir=nvme_path), param_tier="nvme",
                          grad_tier="nvme", optimizer_tier="nvme")
            opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=chunk,
                                       states=fmt, overlap=False)
            runs[chunk] = (model, opt, [])
        for it in range(steps):
            x, y = synthetic_batch(cfg, 2, 16, gen)
            for model, opt, times in runs.values():
                lm_loss(model(x), y).backward()
                t0 = time.perf_counter()
                opt.step()
                if it:
                    times.append(time.perf_counter() - t0)
                opt.zero_grad()
        base = statistics.median(runs[1 << 30][2])
        for chunk, (model, opt, times) in runs.items():
            sets = next(iter(opt.core.wrapped.sets()))
            store = next(iter(opt.core.wrapped.stores()))
            units = sum(len(store.plan(s).units) for s in opt.shards())
            rows.append({"states": fmt, "chunk": chunk, "units": units,
                         "step_ms": 1e3 * statistics.median(times),
                         "ratio": statistics.median(times) / base, "sets": sets.count,
                         "set_bytes": sets.set_nbytes,
                         "beside_bytes": sets.grad_nbytes + sets.staging_nbytes})
            opt.close()
            infinity.unwrap(model)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"set_bytes_3b": set_bytes_3b(), "step": step_times(args.nvme_path, args.quick)}
    for r in out["set_bytes_3b"]:
        print(r)
    for r in out["step"]:
        print(f"{r['states']:5s} chunk {r['chunk'] >> 10:8d} KiB  {r['units']:4d} units  "
              f"step {r['step_ms']:7.1f} ms  {r['ratio']:.2f}x whole  sets {r['sets']} x "
              f"{r['set_bytes']:,} B ({r['beside_bytes']:,} of gradients and working copy)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
