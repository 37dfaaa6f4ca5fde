"""A slow-link projection from infinity's communication model (infinity.plan.comm, the figures
``infinity.estimate(..., link_gbps=...)`` lists): the step time of Llama-3.1-8B under ZeRO-3 on
2 nodes x 1 GPU at 10 and 100 Gb/s, full width against compressed collectives.

Assumptions (stated in the JSON too): bf16 weights and compute, fp32 gradients; a GPU doing
``--tflops`` of useful bf16 work (default 400: an H100's 989 dense at 40% MFU); 6 x params
FLOPs per token; ``--tokens`` per rank per micro-batch; the collectives either fully overlap
compute (the step is the longer of the two) or not at all (the sum); link latency, the
offload tiers (PCIe, NVMe) and the small all-reduces are left out. Nothing here is measured.

    python benchmarks/project_comm.py            # k = 1 and 8 micro-batches, plain and layer-major
    python benchmarks/project_comm.py --quick    # the same, printed and saved (it is instant)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LLAMA_31_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="(the projection is instant)")
    ap.add_argument("--tflops", type=float, default=400.0)
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--links", default="10,100", help="Gb/s")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "project_comm.json"))
    args = ap.parse_args()
    import torch

    from _common import write_json
    from infinity.plan.comm import comm_per_step
    from infinity.plan.shape import describe
    from infinity.policy import CommPolicy

    shape = describe(LLAMA_31_8B, bytes_per_param=torch.bfloat16.itemsize)
    comms = {
        "none": CommPolicy(),
        "int8": CommPolicy("int8", "int8"),
        "int8 weights, int4 grads": CommPolicy("int8", "int4", error_feedback=True),
    }
    rows = []
    for link in [float(x) for x in args.links.split(",")]:
        for k, layer_major in ((1, False), (8, False), (8, True)):
            compute = 6 * shape.params * args.tokens * k / (args.tflops * 1e12)
            for name, comm in comms.items():
                est = comm_per_step(shape, 2, link, comm, 2, k, layer_major)
                rows.append(
                    {
                        "link_gbps": link,
                        "micro_batches": k,
                        "layer_major": layer_major,
                        "comm": name,
                        "wire_gib_per_rank": (est.gather_bytes + est.reduce_bytes) / 2**30,
                        "wire_s": est.seconds,
                        "compute_s": compute,
                        "step_s_overlapped": est.step_s(compute, overlap=True),
                        "step_s_serial": est.step_s(compute, overlap=False),
                        "error_feedback_gib": est.error_feedback_bytes / 2**30,
                    }
                )
                r = rows[-1]
                print(
                    f"{link:>5g} Gb/s  k={k}{' layer-major' if layer_major else '':12s} "
                    f"{name:26s} {r['wire_gib_per_rank']:7.2f} GiB  wire {r['wire_s']:7.2f} s  "
                    f"compute {compute:6.2f} s  step {r['step_s_overlapped']:7.2f} s "
                    f"(serial {r['step_s_serial']:7.2f} s)"
                )
    data = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": {"name": "Llama-3.1-8B (published config)", "params": shape.params},
        "assumptions": {
            "ranks": "2 nodes x 1 GPU, ZeRO-3",
            "dtypes": "bf16 weights and compute, fp32 gradients",
            "gpu_tflops_useful": args.tflops,
            "tokens_per_rank_per_micro_batch": args.tokens,
            "flops_per_token": "6 x params",
            "not_modelled": "link latency, PCIe/NVMe offload traffic, small all-reduces",
        },
        "rows": rows,
    }
    write_json(args.out, data)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
