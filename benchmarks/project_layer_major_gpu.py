"""Projected GPU-busy share of Llama-3.1-8B training, plain micro-batch loop against layer-major
accumulation (``infinity.accumulate``), from ``infinity.estimate``'s cost model.

    python benchmarks/project_layer_major_gpu.py          # k = 1, 8, 32
    python benchmarks/project_layer_major_gpu.py --quick  # k = 1, 8 (CI)

No GPU runs here: the rates are those of two machines, put into the estimate as a probe result.

- ``h200``: measured on the lent H200 machine (benchmarks/results/gpu_h200/gpu_figures.json and
  bench_optimizer.json, 2026-11-30): host to device and back 55.3 GB/s pinned, NVMe reads
  1.98 GB/s and writes 1.95 GB/s, CPU Adam 3.87e9 parameters/s (fp32 states, 16 cores), and the
  compute rate of the plain model there: 1.15B parameters, 8 x 512 tokens, 0.648 s a step,
  46 TFLOP/s by the estimate's FLOP count (fp32 weights).
- ``pcie4_24gb``: a stated 24 GB PCIe-4 card: 25 GB/s each way, 35 TFLOP/s sustained (about
  half the dense bf16 peak of an RTX 3090 / A10-class card), the same disk and CPU.

Model: the published Llama-3.1-8B config (bf16 weights, untied), micro-batches of 8 x 2048
tokens, k = 1, 8, 32 per optimizer step. Placements: parameters, gradients and 8-bit states on
host (``host``) and everything on NVMe with 8-bit states (``nvme_8bit``). The busy share is
compute / step: compute is forward + backward of every micro-batch (layer-major: plus the
layers' forward once more; ``useful_busy_share`` leaves that recomputation out), the step adds what the estimate does not hide behind compute (the
parameter and gradient transfers, the optimizer step, which runs after backward here: the
optimizer overlapping the next forward is not built). Results:
benchmarks/results/project_layer_major_gpu.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/, this script's folder)

import torch  # noqa: E402

from infinity.plan.estimate import estimate_one, model_flops  # noqa: E402
from infinity.plan.placements import placement  # noqa: E402
from infinity.plan.probe import DiskProbe, ProbeResult  # noqa: E402
from infinity.plan.shape import describe  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                   tie_word_embeddings=False, head_dim=128)


def h200_flops() -> float:
    """The plain model's rate on the H200 machine, by the estimate's FLOP count."""
    shape = describe(1146633216, n_layers=40, d_model=1536, vocab_size=8192)
    return model_flops(shape, 8 * 512, 512) / 0.648


def machine(name: str, h2d: float, flops: float) -> ProbeResult:
    disk = DiskProbe(path="/nvme", identity={}, direct=True, read_bps=1.98e9, write_bps=1.95e9,
                     free_bytes=1 << 40, test_bytes=1 << 30)
    return ProbeResult(identity={"name": name}, quick=False, measured_at=0.0, mem_bps=20e9,
                       adam_params_per_s=3.87e9, adam8_params_per_s=3.87e9, device="cuda",
                       flops={"4096": flops}, flops_bf16={"4096": flops},
                       h2d_pinned_bps=h2d, d2h_pinned_bps=h2d, disk=disk)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="k = 1, 8 (CI)")
    ap.add_argument("--json", default=os.path.join(HERE, "results",
                                                   "project_layer_major_gpu.json"))
    args = ap.parse_args(argv)
    shape = describe(LLAMA_31_8B, bytes_per_param=torch.bfloat16.itemsize)
    machines = {"h200": machine("h200", 55.3e9, h200_flops()),
                "pcie4_24gb": machine("pcie4_24gb", 25e9, 35e12)}
    ks = [1, 8] if args.quick else [1, 8, 32]
    rows: List[Dict[str, Any]] = []
    for mname, pr in machines.items():
        for pname in ("host", "nvme_8bit"):
            pl = placement(pname)
            for k in ks:
                useful = 0.0  # the plain loop's compute: the work either schedule must do
                for layer_major in (False, True):
                    e = estimate_one(shape, pl, pr, batch=8, seq=2048, micro_batches=k,
                                     layer_major=layer_major, states="8bit")
                    useful = useful or e.compute_s
                    rows.append({
                        "machine": mname, "placement": pname, "k": k,
                        "schedule": "layer_major" if layer_major else "plain",
                        "compute_s": e.compute_s, "step_s": e.step_s,
                        "busy_share": e.compute_s / e.step_s,
                        # without the recomputation layer-major adds
                        "useful_busy_share": useful / e.step_s,
                        "fetch_s": e.fetch_s, "optimizer_s": e.optimizer_s,
                        "nvme_gb_per_step": sum(e.nvme_per_step.values()) / 1e9,
                        "tokens_per_s": e.tokens_per_s,
                    })
    out = {"date": time.strftime("%Y-%m-%d"), "machine": _common.machine_info(),
           "command": " ".join([os.path.basename(__file__)] + (argv or sys.argv[1:])),
           "model": "Llama-3.1-8B (bf16 weights), micro-batches of 8 x 2048 tokens",
           "params": shape.params, "rows": rows}
    _common.write_json(args.json, out)
    for r in rows:
        print(f"{r['machine']:11s} {r['placement']:9s} k={r['k']:2d} {r['schedule']:11s} "
              f"busy {100 * r['busy_share']:5.1f}% (useful {100 * r['useful_busy_share']:5.1f}%)  step {r['step_s']:8.1f} s  "
              f"compute {r['compute_s']:7.1f} s  NVMe {r['nvme_gb_per_step']:7.1f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
