"""NVMe optimizer step against the disk time of its bytes.

    python benchmarks/bench_nvme_step.py                # 100M params, fp32 and 8-bit states
    python benchmarks/bench_nvme_step.py --quick        # ~8M params, a few seconds (CI)

For a model of plain nn.Linear layers wrapped with optimizer states on NVMe (parameters and
gradients in RAM by default; ``--all-nvme`` puts them on NVMe too), each round:

1. measures the disk with ``infinity.io`` in the same directory: writes then reads back (cold:
   O_DIRECT) as many bytes as one step writes/reads, in requests of the largest shard's state
   size, all in flight at once (the best that the I/O engine gets from this disk);
2. times ``opt.step()`` (``--steps`` steps per round) with random gradients in the engine's
   buffers, and takes the bytes read and written from ``opt.last_step_stats``.

The ratio reported per round is ``step time / (bytes read / read bw + bytes written / write
bw)``: 1.0 means the step took exactly the disk time of its bytes. Rounds alternate between the
state formats (``--formats``), so a disk that drifts is seen by all of them; medians over
rounds. Results: benchmarks/results/bench_nvme_step.json.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/, this script's folder)
from bench_optimizer import LinearStack  # noqa: E402
import infinity  # noqa: E402
import infinity.io as inf_io  # noqa: E402
from infinity.optim import swapper  # noqa: E402
from infinity.runtime import engine_of  # noqa: E402

logger = logging.getLogger("bench_nvme_step")
HERE = os.path.dirname(os.path.abspath(__file__))


class DiskProbe:
    """Write and cold-read bandwidth of ``infinity.io`` on one preallocated file."""

    def __init__(self, directory: str, nbytes: int, request: int) -> None:
        self.request = max(inf_io.ALIGNMENT, request // inf_io.ALIGNMENT * inf_io.ALIGNMENT)
        self.nbytes = -(-nbytes // self.request) * self.request
        self.path = os.path.join(directory, "disk-probe.bin")
        self.buf = inf_io.aligned_empty(self.request)
        self.buf.fill_(0x5A)
        with inf_io.FileHandle(self.path, "w+", require_direct=True) as f:
            f.allocate(self.nbytes)
        self.write()  # the step's extents were written before too (no unwritten extents)

    def _run(self, write: bool) -> float:
        with inf_io.FileHandle(self.path, "r+", require_direct=True) as f:
            t0 = time.perf_counter()
            op = f.pwrite if write else f.pread
            futures = [op(self.buf, off, self.request)
                       for off in range(0, self.nbytes, self.request)]
            for fut in futures:
                fut.wait()
            return self.nbytes / (time.perf_counter() - t0)

    def write(self) -> float:
        return self._run(True)

    def read(self) -> float:
        return self._run(False)

    def close(self) -> None:
        os.unlink(self.path)


class Case:
    """One wrapped model + optimizer with NVMe states in one format."""

    def __init__(self, layers: int, width: int, fmt: str, nvme: str, all_nvme: bool,
                 sets: Optional[int] = None) -> None:
        self.fmt = fmt
        self.model = LinearStack(layers, width, torch.float32)
        tiers = "nvme" if all_nvme else "host"
        infinity.wrap(self.model, nvme_path=nvme, optimizer_tier="nvme", param_tier=tiers,
                      grad_tier=tiers)
        self.engine = engine_of(self.model)
        self.opt = infinity.optim.AdamW(self.model.parameters(), lr=1e-4, states=fmt)
        self.all_nvme = all_nvme
        self._fill_grads()
        real = swapper.choose_sets
        if sets is not None:  # a fixed pipeline depth (the buffer sets are made in this step)
            swapper.choose_sets = lambda *_: sets
        try:
            self.opt.step()  # warm-up: creates and writes the state extents
        finally:
            swapper.choose_sets = real
        self.sets = next(iter(self.opt._sets.values())).count
        self._fill_grads()
        self.opt.step()  # and the other extent of each shard

    def _fill_grads(self) -> None:
        gen = torch.Generator().manual_seed(0)
        if not self.all_nvme:
            for flat in self.engine.flats:
                flat.ensure_grad_buffer().uniform_(-1e-3, 1e-3, generator=gen)
                flat.grad_ready = [True] * len(flat.slots)
            return
        x = torch.randn(4, self.model.layers[0].in_features, generator=gen)
        self.opt.zero_grad()
        y = x
        for layer in self.model.layers:
            y = layer(y)
        y.square().mean().backward()

    def step(self) -> Dict[str, float]:
        if self.all_nvme:  # gradients are consumed by nothing, but keep backward's order
            pass
        t0 = time.perf_counter()
        self.opt.step()
        dt = time.perf_counter() - t0
        s = self.opt.last_step_stats
        return {"step_s": dt, "bytes_read": s.bytes_read, "bytes_written": s.bytes_written,
                "compute_s": s.compute_s, "io_wait_s": s.io_wait_s}

    def largest_request(self) -> int:
        store = self.opt._stores[id(self.engine)]
        return max(store.layout(s).nbytes for s in self.opt._shards.values())

    def close(self) -> None:
        self.opt.close()
        infinity.unwrap(self.model)
        del self.opt, self.model
        gc.collect()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--width", type=int, default=4096, help="Linear(width, width) layers: one "
                    "shard each (4096: 201 MB of fp32 states per shard; 1024: 12.6 MB)")
    ap.add_argument("--quick", action="store_true", help="~8M params, 2 rounds (CI)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round and format")
    ap.add_argument("--formats", default="fp32,8bit")
    ap.add_argument("--compare-sets", type=int, default=None, metavar="N",
                    help="also run the first format with a pipeline of N buffer sets (N - 2 "
                         "shards read ahead; the default is 3)")
    ap.add_argument("--all-nvme", action="store_true",
                    help="parameters and gradients on NVMe too (their bytes count as well)")
    ap.add_argument("--nvme-path", default=None, help="directory (default: a temporary one "
                    "under /tmp)")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "bench_nvme_step.json"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    formats = [f for f in args.formats.split(",") if f]
    width = 1024 if args.quick else args.width
    n_target = 8e6 if args.quick else args.params
    layers = max(2, round(n_target / (width * width)))
    rounds = 2 if args.quick else args.rounds
    n_params = layers * width * width
    logger.info("model: %d x Linear(%d, %d) = %s params; states on NVMe%s; formats %s",
                layers, width, width, f"{n_params:,}",
                " (parameters and gradients too)" if args.all_nvme else "", formats)
    per_format: Dict[str, List[Dict[str, float]]] = {f: [] for f in formats}
    with tempfile.TemporaryDirectory(dir=args.nvme_path or "/tmp", prefix="bench-nvme-") as d:
        cases = {f: Case(layers, width, f, d, args.all_nvme) for f in formats}
        if args.compare_sets:
            name = f"{formats[0]}/{args.compare_sets}sets"
            cases[name] = Case(layers, width, formats[0], d, args.all_nvme, args.compare_sets)
            per_format[name] = []
        probe_bytes = max(c.step()["bytes_written"] for c in cases.values())
        probe = DiskProbe(d, probe_bytes, max(c.largest_request() for c in cases.values()))
        try:
            for r in range(rounds):
                wbw, rbw = probe.write(), probe.read()
                for fmt, case in cases.items():
                    for _ in range(args.steps):
                        m = case.step()
                        disk_s = m["bytes_read"] / rbw + m["bytes_written"] / wbw
                        m.update(read_bw=rbw, write_bw=wbw, disk_s=disk_s,
                                 ratio=m["step_s"] / disk_s, round=r)
                        per_format[fmt].append(m)
                        logger.info("round %d %-5s step %.3f s, disk time %.3f s (read %.2f "
                                    "GB/s, write %.2f GB/s): %.2fx", r, fmt, m["step_s"],
                                    disk_s, rbw / 1e9, wbw / 1e9, m["ratio"])
        finally:
            probe.close()
            cases_sets = {f: c.sets for f, c in cases.items()}
            for case in cases.values():
                case.close()
    rows = []
    for fmt, ms in per_format.items():
        med = lambda k: statistics.median(m[k] for m in ms)  # noqa: E731
        rows.append({"states": fmt, "sets": cases_sets[fmt], "step_s": med("step_s"), "disk_s": med("disk_s"),
                     "ratio": med("ratio"), "compute_s": med("compute_s"),
                     "io_wait_s": med("io_wait_s"), "bytes_read": ms[-1]["bytes_read"],
                     "bytes_written": ms[-1]["bytes_written"], "read_bw": med("read_bw"),
                     "write_bw": med("write_bw"), "samples": ms})
    base = rows[0]
    print(f"{'states':<12} {'sets':>4} {'step s':>8} {'disk s':>8} {'step/disk':>10} {'MB/step':>9} "
          f"{'bytes vs ' + base['states']:>14} {'time vs ' + base['states']:>13}")
    for r in rows:
        moved = r["bytes_read"] + r["bytes_written"]
        print(f"{r['states']:<12} {r['sets']:>4} {r['step_s']:>8.3f} {r['disk_s']:>8.3f} {r['ratio']:>9.2f}x "
              f"{moved / 1e6:>9.0f} "
              f"{moved / (base['bytes_read'] + base['bytes_written']):>13.2f}x "
              f"{r['step_s'] / base['step_s']:>12.2f}x")
    result = {"date": time.strftime("%Y-%m-%d"), "params": n_params, "layers": layers,
              "width": width, "all_nvme": args.all_nvme, "rounds": rounds,
              "steps": args.steps, "machine": _common.cores(),
              "io_config": inf_io.get_config().__dict__,
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
              "rows": rows}
    _common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
