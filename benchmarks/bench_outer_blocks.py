"""The compute working set with outer blocks against the root-block layout.

A transformers Llama with Llama-3's vocabulary (128256), a narrow hidden size and 2 layers,
everything on NVMe (parameters, gradients, fp32 Adam states), trained a few steps in both
layouts, their steps alternated:

* ``outer`` (the default): the embedding and the head are blocks of their own, fetched when
  they run and released after; the root block keeps only the final norm;
* ``root``: ``param_persistence_threshold`` above the embedding, i.e. the layout before outer
  blocks (embedding, head and final norm in one root block materialized for the whole step).

Reports per layout: the root block and the largest other block, the peak of the compute buffers
(``stats()["tiers"]["device"]["peak"]``: device memory on a GPU, RAM on a CPU-only machine) and
the median step time (steps of the two layouts alternated; single runs on a shared machine are
noisy). Usage: ``python benchmarks/bench_outer_blocks.py [--hidden 256] [--steps 4]``;
``--quick`` (hidden 32, 3 steps) runs in the tests. Results: benchmarks/results/
bench_outer_blocks.json (or ``--out``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import infinity

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

from infinity.runtime.core.registry import engine_of  # noqa: E402


def _model(hidden: int, tied: bool, seed: int = 0):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=hidden,
                                   intermediate_size=2 * hidden, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).float()


class _Case:
    """One wrapped model (a layout) and its optimizer; steps are timed one at a time."""

    def __init__(self, layout: str, hidden: int, tied: bool, swap: str,
                 overlap: object = "auto") -> None:
        self.layout, self.tied, self.hidden = layout, tied, hidden
        self.model = _model(hidden, tied)
        extra = {} if layout == "outer" else {"param_persistence_threshold": 10**12}
        infinity.wrap(self.model, nvme_path=swap, param_tier="nvme", grad_tier="nvme",
                      optimizer_tier="nvme", **extra)
        self.opt = infinity.optim.AdamW(self.model.parameters(), lr=1e-4, overlap=overlap)
        self.times: list = []

    def step(self, ids: torch.Tensor, first: bool) -> None:
        if first:
            infinity.stats(self.model, reset=True)  # peaks from here on
        t0 = time.perf_counter()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.times.append(time.perf_counter() - t0)

    def report(self) -> dict:
        s = infinity.stats(self.model)
        blocks = [(b.name, b.kind, b.compute_nbytes)
                  for b in engine_of(self.model).blocks]
        out = {"layout": self.layout, "tied": self.tied, "hidden": self.hidden,
               "device_peak_bytes": s["tiers"]["device"]["peak"],
               "root_bytes": sum(n for _, k, n in blocks if k == "root"),
               "largest_block_bytes": max(n for _, k, n in blocks if k != "root"),
               "step_s_median": statistics.median(self.times[1:]), "blocks": len(blocks)}
        self.opt.close()
        infinity.unwrap(self.model)
        return out


def run(hidden: int, tied: bool, steps: int, seq: int, overlap: object = "auto") -> list:
    """Both layouts of one model, their steps alternated (same data, same machine load)."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        cases = [_Case("root", hidden, tied, a, overlap), _Case("outer", hidden, tied, b, overlap)]
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            ids = torch.randint(0, 128256, (1, seq), generator=g)
            for case in (cases if step % 2 else cases[::-1]):
                case.step(ids, first=step == 1)
        return [c.report() for c in cases]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-overlap", action="store_true",
                    help="the optimizer steps after backward only (AdamW(overlap=False))")
    ap.add_argument("--quick", action="store_true", help="hidden 32, 3 steps, seq 16 (CI)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_outer_blocks.json"))
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.steps, args.seq = 32, 3, 16
    rows = []
    for tied in (True, False):
        for row in run(args.hidden, tied, args.steps, args.seq,
                       False if args.no_overlap else "auto"):
            rows.append(row)
            print(json.dumps(row))
    print(f"{'model':8} {'layout':6} {'root':>13} {'largest':>13} {'device peak':>13} "
          f"{'step s':>7}")
    for r in rows:
        print(f"{'tied' if r['tied'] else 'untied':8} {r['layout']:6} {r['root_bytes']:>13,} "
              f"{r['largest_block_bytes']:>13,} {r['device_peak_bytes']:>13,} "
              f"{r['step_s_median']:>7.2f}")
    _common.write_json(args.out, {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": _common.machine_info(), "hidden": args.hidden, "steps": args.steps,
        "seq": args.seq, "rows": rows})


if __name__ == "__main__":
    main()
