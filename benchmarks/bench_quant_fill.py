"""Quantization of a frozen base at wrap (``frozen_format="nf4"`` / ``"int8"``): seconds per
Llama-3.1-8B decoder layer and input GB/s, against an older checkout in the same run.

    python benchmarks/bench_quant_fill.py --old-tree /tmp/oldinf
    python benchmarks/bench_quant_fill.py --quick          # CI: a narrow layer, this tree only

Each case runs in a fresh subprocess: one decoder layer of the Llama-3.1-8B config (hidden 4096,
intermediate 14336, 32/8 heads: 218,103,808 frozen matrix elements; vocabulary cut to 256 so
the layer dominates), built on meta in bf16 with PEFT LoRA r=16 on the 7 linears, wrapped with
``init`` (normal 0.02) and the parameters on ``--tier``. Timed: wrap, and inside it the
quantized homes' ``fill`` (quantize + store; ``init`` excluded). Then the kernel alone:
``quantize_nf4`` / ``quantize_int8`` of a bf16 4096 x 14336 matrix (best of 3). GB/s counts
the bf16 input bytes. Results: benchmarks/results/bench_quant_fill.json.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _common  # noqa: E402

_CHILD = textwrap.dedent(r"""
    import json, sys, time
    sys.path.insert(0, ROOT)
    import torch, transformers, infinity
    from peft import LoraConfig, get_peft_model
    from infinity.runtime.homes import quantized as quant_home
    from infinity.ops import int8_block, nf4
    args = json.loads(sys.argv[1])
""") + _common.CHILD_INIT + textwrap.dedent(r"""
    fill_s = [0.0]
    inner = quant_home.QuantizedHome.fill
    def timed_fill(self, flat):
        t = time.perf_counter()
        inner(self, flat)
        if isinstance(flat, quant_home.QuantFlat):
            fill_s[0] += time.perf_counter() - t
    quant_home.QuantizedHome.fill = timed_fill
    h, f = args["hidden"], args["ffn"]
    cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=f, num_hidden_layers=1,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=256,
                                   max_position_embeddings=4096, use_cache=False)
    with infinity.empty_init():
        base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    frozen = sum(p.numel() for n, p in model.named_parameters()
                 if not p.requires_grad and p.dim() == 2 and "layers." in n)
    t0 = time.perf_counter()
    infinity.wrap(model, nvme_path=args["nvme"], init=init, host_budget=4 << 30,
                  compute_dtype=torch.bfloat16, param_tier=args["tier"], grad_tier="host",
                  optimizer_tier="host", placement=None, frozen_format=args["format"])
    wrap_s = time.perf_counter() - t0
    x = (torch.randn(h * f) * 0.02).bfloat16()
    quant = nf4.quantize_nf4 if args["format"] == "nf4" else int8_block.quantize_int8
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        quant(x)
        best = min(best, time.perf_counter() - t)
    print(json.dumps({"wrap_s": wrap_s, "fill_s": fill_s[0], "frozen_elems": frozen,
                      "kernel_s": best, "kernel_elems": x.numel()}))
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-tree", default=None, help="an older checkout (built) to compare")
    ap.add_argument("--formats", default="nf4,int8")
    ap.add_argument("--tier", default="nvme", choices=["host", "nvme"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_quant_fill.json"))
    a = ap.parse_args()
    hidden, ffn = (256, 512) if a.quick else (4096, 14336)
    trees = [("this", ROOT)] + ([("old", os.path.abspath(a.old_tree))] if a.old_tree else [])
    rows = []
    for fmt in a.formats.split(","):
        for rep in range(1 if a.quick else a.reps):
            for name, tree in trees:  # alternate the trees: the same load for both
                nvme = tempfile.mkdtemp(prefix="bench_quant_fill_", dir=a.nvme_path)
                try:
                    code = _CHILD.replace("sys.path.insert(0, ROOT)",
                                          f"sys.path.insert(0, {tree!r})")
                    r = _common.run_child(f"{name} {fmt}", code,
                                          {"format": fmt, "tier": a.tier, "nvme": nvme,
                                           "hidden": hidden, "ffn": ffn}, timeout=3600)
                finally:
                    shutil.rmtree(nvme, ignore_errors=True)
                gb = 2 * r["frozen_elems"] / 1e9
                r.update(tree=name, format=fmt, rep=rep, fill_gbps=gb / r["fill_s"],
                         kernel_gbps=2 * r["kernel_elems"] / 1e9 / r["kernel_s"])
                rows.append(r)
                print(f"{name:4s} {fmt:4s} rep {rep}: wrap {r['wrap_s']:.2f} s, fill "
                      f"{r['fill_s']:.2f} s ({r['fill_gbps']:.2f} GB/s bf16 in), kernel "
                      f"{r['kernel_s']:.3f} s per {hidden}x{ffn} ({r['kernel_gbps']:.2f} GB/s)",
                      flush=True)
    _common.write_json(a.out, {"date": datetime.date.today().isoformat(),
                               "command": "python " + " ".join(sys.argv),
                               "machine": _common.machine_info({"load_avg_end": os.getloadavg()}),
                               "rows": rows})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
