"""Step time with the staging and NVMe gradient pools bounded by a small chunk, against the same
model whose every flat fits one buffer, in one run.

    python benchmarks/bench_chunked_pools.py                 # ~30M params, 1 MiB chunks
    python benchmarks/bench_chunked_pools.py --quick         # tiny model, 16 KiB chunks

Both engines wrap the same GPT (parameters and gradients on NVMe, 2 micro-batches per step,
AdamW with its states in host RAM) in this process and take turns step by step, so a noisy
phase of this shared machine hits both alike. For each: median step time (forward + 2
backwards + step) after one warm-up step, and the host bytes of its staging and gradient
buffers (``tier_bytes``). The ratio chunked / one buffer per flat is what to read.
Results: benchmarks/results/bench_chunked_pools.json.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _common  # noqa: E402
import torch  # noqa: E402

import infinity  # noqa: E402
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch  # noqa: E402
from infinity.runtime.core.registry import engine_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=1 << 20, help="the small chunk (bytes)")
    ap.add_argument("--nvme", default=None, help="swap directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/, "
                    "none with --quick)")
    args = ap.parse_args()
    cfg = (GPTConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, max_seq=64)
           if args.quick else
           GPTConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, max_seq=128))
    steps = 2 if args.quick else args.steps
    base = args.nvme or tempfile.mkdtemp(prefix="bench-chunked-")
    chunks = {"one_buffer_per_flat": 256 << 20,
              "chunked": (16 << 10) if args.quick else args.chunk}
    runs = {}
    for name, chunk in chunks.items():
        path = os.path.join(base, name)
        os.makedirs(path, exist_ok=True)
        torch.manual_seed(0)
        model = infinity.wrap(TinyGPT(cfg), nvme_path=path, param_tier="nvme",
                              grad_tier="nvme", chunk_bytes=chunk)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-4)
        runs[name] = (model, opt, [])
    gen = torch.Generator().manual_seed(0)
    data = [synthetic_batch(cfg, 2, 64 if not args.quick else 16, gen)
            for _ in range(2 * (steps + 1))]
    for step in range(steps + 1):
        for name, (model, opt, times) in runs.items():
            t0 = time.perf_counter()
            for x, y in data[2 * step:2 * step + 2]:
                lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step:  # the first step records the schedule
                times.append(time.perf_counter() - t0)
    out: Dict[str, Dict] = {}
    for name, (model, opt, times) in runs.items():
        host = engine_of(model).tier_bytes()["host"]
        largest = max(f.numel * 4 for f in engine_of(model).flats)
        out[name] = {"chunk": host["chunk"], "median_step_s": statistics.median(times),
                     "steps_s": times, "staging_bytes": host["staging"],
                     "grad_buffer_bytes": host["grads"], "largest_flat_bytes": largest}
        opt.close()
        infinity.unwrap(model)
    if args.nvme is None:
        shutil.rmtree(base, ignore_errors=True)
    ratio = out["chunked"]["median_step_s"] / out["one_buffer_per_flat"]["median_step_s"]
    result = {"date": datetime.date.today().isoformat(),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "machine": _common.machine_info(), "config": vars(cfg), "runs": out,
              "ratio_chunked": ratio}
    for name, r in out.items():
        print(f"{name:22s} chunk {r['chunk']:>11,}  step {r['median_step_s']:.3f} s  staging "
              f"{r['staging_bytes']:>11,}  grad buffers {r['grad_buffer_bytes']:>11,}")
    print(f"chunked / one buffer per flat: {ratio:.3f}x")
    out_path = args.out or (None if args.quick else os.path.join(
        ROOT, "benchmarks", "results", "bench_chunked_pools.json"))
    if out_path:
        _common.write_json(out_path, result)


if __name__ == "__main__":
    main()
