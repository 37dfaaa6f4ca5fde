"""NVMe optimizer step against the disk time of its bytes.

    python benchmarks/bench_nvme_step.py                # 100M params, fp32 and 8-bit states
    python benchmarks/bench_nvme_step.py --quick        # ~8M params, a few seconds (CI)

For a model of plain nn.Linear layers wrapped with optimizer states on NVMe (parameters and
gradients in RAM by default; ``--all-nvme`` puts them on NVMe too), each round, per case (in a
rotating order: round r starts with case r, so none always runs right after a probe):

1. measures the disk with ``infinity.io`` on the case's *own* state extents
   (:class:`ExtentProbe`): writes to the extents the next step overwrites, cold (O_DIRECT)
   reads of the committed ones, then both at once ("mixed"), in requests of one shard's
   size, all in flight (the best the I/O engine gets from those files);
2. times ``opt.step()`` (``--steps`` steps) with random gradients in the engine's buffers, and
   takes the bytes read and written from ``opt.last_step_stats``.

The ratio reported is ``step time / (bytes read / read bw + bytes written / write bw)``: 1.0
means the step took exactly the disk time of its bytes. ``step / mixed`` is what the pipeline
adds over the disk serving the same reads and writes together. A probe of two fresh files in
the same directory (:class:`DiskProbe`, the measurement of earlier versions) is kept as
``disk_file_s``/``ratio_file``: on the test VM the files' placement changed their speed by up
to ~40% within one run, so that reference is not the fair one.

Attribution per step (``swapper.record_requests``): the pipeline thread's time blocked on reads
(``read_wait_s``), on writes before a buffer set is reused (``write_wait_s``), in the CPU Adam
(``compute_s``), checking checksums (``verify_s``) and the rest (``other_s``: Python, buffer
views, submits); the CRC threads' CRC32C time (``crc_s``, off the pipeline thread); and from
the per-request timeline: the time with reads, writes, both or no request in flight
(``read_busy_s``, ``write_busy_s``, ``both_busy_s``, ``disk_idle_s``). ``--ablate`` adds the
first format without checksums and as I/O only (no Adam); ``--compare-crc-inline`` with the
checksums computed by the I/O workers themselves. Medians over rounds. Results:
benchmarks/results/bench_nvme_step.json.
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
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/, this script's folder)
from bench_optimizer import LinearStack  # noqa: E402

import infinity  # noqa: E402
import infinity.io as inf_io  # noqa: E402
from infinity.optim.states import swapper  # noqa: E402
from infinity.runtime import engine_of  # noqa: E402
from infinity.runtime.port import OptimizerPort

logger = logging.getLogger("bench_nvme_step")
ATTRIBUTION = ("read_wait_s", "write_wait_s", "verify_s", "other_s", "crc_s", "read_busy_s",
               "write_busy_s", "both_busy_s", "disk_idle_s")
HERE = os.path.dirname(os.path.abspath(__file__))


class DiskProbe:
    """Write, cold-read and mixed bandwidth of ``infinity.io`` on two preallocated files, in
    requests of one shard's state size, from/to ``SETS`` distinct buffers used in turn (as the
    step's buffer sets), every request in flight at once."""

    SETS = 3

    def __init__(self, directory: str, nbytes: int, request: int) -> None:
        self.request = max(inf_io.ALIGNMENT, request // inf_io.ALIGNMENT * inf_io.ALIGNMENT)
        self.nbytes = -(-nbytes // self.request) * self.request
        self.paths = [os.path.join(directory, f"disk-probe-{i}.bin") for i in range(2)]
        self.bufs = [inf_io.aligned_empty(self.request) for _ in range(self.SETS)]
        for b in self.bufs:
            b.fill_(0x5A)
        for path in self.paths:
            with inf_io.FileHandle(path, "w+", require_direct=True) as f:
                f.allocate(self.nbytes)
        self.write()  # the step's extents were written before too (no unwritten extents)
        self._run(True, 1)

    def _run(self, write: bool, which: int = 0) -> float:
        with inf_io.FileHandle(self.paths[which], "r+", require_direct=True) as f:
            t0 = time.perf_counter()
            op = f.pwrite if write else f.pread
            futures = [op(self.bufs[i % self.SETS], off, self.request)
                       for i, off in enumerate(range(0, self.nbytes, self.request))]
            for fut in futures:
                fut.wait()
            return self.nbytes / (time.perf_counter() - t0)

    def write(self) -> float:
        return self._run(True)

    def read(self) -> float:
        return self._run(False)

    def mixed(self) -> float:
        """Seconds to read one file and write the other with every request in flight,
        reads and writes alternating in the queue (the pipeline's order)."""
        with inf_io.FileHandle(self.paths[0], "r+", require_direct=True) as f, \
                inf_io.FileHandle(self.paths[1], "r+", require_direct=True) as g:
            t0 = time.perf_counter()
            futures = []
            for i, off in enumerate(range(0, self.nbytes, self.request)):
                futures.append(f.pread(self.bufs[i % 2], off, self.request))
                futures.append(g.pwrite(self.bufs[2], off, self.request))
            for fut in futures:
                fut.wait()
            return time.perf_counter() - t0

    def close(self) -> None:
        for path in self.paths:
            os.unlink(path)


class ExtentProbe:
    """The same measurement on one case's *own* state extents and buffers: reads of the
    committed extent of every unit (in the optimizer's state file), writes of as many bytes to
    a file beside it (preallocated, as the free extents a step writes into), every request in
    flight, into/from the case's own pipeline buffer sets (scratch between steps). On the test
    VM one case of a run could be ~40% slower than the others, with the same code and a
    fresh-file probe unchanged, so the step is compared with the disk time of its own files
    and memory."""

    def __init__(self, case: Case) -> None:
        from infinity.optim.states.extents import STATE_FILE
        store = case.opt.core.wrapped.store(OptimizerPort.of(case.engine))
        sets = case.opt.core.wrapped.store(OptimizerPort.of(case.engine)).sets
        self.bufs = [sets.states[0], sets.states[1], sets.states[2]]
        self.path = store.extents.store.path(STATE_FILE)
        self.extents = []  # (offset in the state file, offset in the probe file, nbytes)
        at = 0
        for shard in case.opt.shards():
            for ext in store.extents.committed[shard.key]:
                self.extents.append((ext.offset, at, ext.nbytes))
                at += ext.nbytes
        self.nbytes = at
        self.spare = os.path.join(os.path.dirname(self.path), "probe-writes.swp")
        h = inf_io.FileHandle(self.spare, "w+", require_direct=True)
        h.allocate(max(self.nbytes, inf_io.ALIGNMENT))
        h.close()

    def _run(self, reads: bool, writes: bool) -> float:
        handles = []
        try:
            futures = []
            t0 = time.perf_counter()
            src = inf_io.FileHandle(self.path, "r", require_direct=True) if reads else None
            dst = inf_io.FileHandle(self.spare, "r+", require_direct=True) if writes else None
            handles = [h for h in (src, dst) if h is not None]
            for i, (offset, at, n) in enumerate(self.extents):
                if reads:
                    futures.append(src.pread(self.bufs[i % 2][:n], offset))
                if writes:
                    futures.append(dst.pwrite(self.bufs[2][:n], at))
            for fut in futures:
                fut.wait()
            return time.perf_counter() - t0
        finally:
            for h in handles:
                h.close()

    def measure(self) -> Tuple[float, float, float]:
        """(write bytes/s, read bytes/s, mixed seconds for both)."""
        w = self.nbytes / self._run(False, True)
        r = self.nbytes / self._run(True, False)
        return w, r, self._run(True, True)


def _union(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def attribute(stats: swapper.StepStats, t0: float, t1: float) -> Dict[str, float]:
    """Where one step's wall time ``t1 - t0`` went (see the module docstring)."""
    reqs = stats.requests or []
    reads = [(r[3] or r[2], r[4]) for r in reqs if r[0] == "read"]
    writes = [(r[3] or r[2], r[4]) for r in reqs if r[0] == "write"]
    busy_r, busy_w, busy = _union(reads), _union(writes), _union(reads + writes)
    pipeline = stats.read_wait_s + stats.write_wait_s + stats.compute_s + stats.verify_s
    return {"read_wait_s": stats.read_wait_s, "write_wait_s": stats.write_wait_s,
            "verify_s": stats.verify_s, "other_s": max(0.0, (t1 - t0) - pipeline),
            "crc_s": stats.crc_s, "read_busy_s": busy_r, "write_busy_s": busy_w,
            "both_busy_s": busy_r + busy_w - busy, "disk_idle_s": max(0.0, (t1 - t0) - busy)}


class Case:
    """One wrapped model + optimizer with NVMe states in one format."""

    def __init__(self, layers: int, width: int, fmt: str, nvme: str, all_nvme: bool,
                 sets: Optional[int] = None, verify: bool = True,
                 io_only: bool = False, io: Optional[Dict[str, int]] = None) -> None:
        self.fmt = fmt
        self.io = io or {}  # infinity.io settings for this case's steps
        self.model = LinearStack(layers, width, torch.float32)
        tiers = "nvme" if all_nvme else "host"
        infinity.wrap(self.model, nvme_path=nvme, optimizer_tier="nvme", param_tier=tiers,
                      grad_tier=tiers, verify_checksums=verify)
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
        self.sets = next(iter(self.opt.core.wrapped.sets())).count
        self._fill_grads()
        self.opt.step()  # and the other extent of each shard
        if io_only:  # ablation: the same reads and writes, no update (states stay as they are)
            self.opt.core.apply = lambda *_a, **_k: None

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
        saved = inf_io.get_config()
        if self.io:
            inf_io.configure(**self.io)
        swapper.record_requests(True)
        try:
            t0 = time.perf_counter()
            self.opt.step()
            t1 = time.perf_counter()
        finally:
            swapper.record_requests(False)
            if self.io:
                inf_io.configure(**{k: getattr(saved, k) for k in self.io})
        s = self.opt.last_step_stats
        out = {"step_s": t1 - t0, "bytes_read": s.bytes_read, "bytes_written": s.bytes_written,
               "compute_s": s.compute_s, "io_wait_s": s.io_wait_s}
        out.update(attribute(s, t0, t1))
        return out

    def largest_request(self) -> int:
        store = self.opt.core.wrapped.store(OptimizerPort.of(self.engine))
        return max(store.layout(s).nbytes for s in self.opt.shards())

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
    ap.add_argument("--ablate", action="store_true",
                    help="also run the first format without checksums (verify_checksums=False) "
                         "and as I/O only (no Adam, no checksums): how much of the step the "
                         "CPU work running beside the I/O costs")
    ap.add_argument("--compare-crc-inline", action="store_true",
                    help="also run the first format with the checksums computed inline by the "
                         "I/O workers (infinity.io crc_threads=0; the default computes them on "
                         "separate CRC threads beside the I/O)")
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
        if args.compare_crc_inline:
            name = f"{formats[0]}/crc-inline"
            cases[name] = Case(layers, width, formats[0], d, args.all_nvme,
                               io={"crc_threads": 0})
            per_format[name] = []
        if args.ablate:
            for name, kw in ((f"{formats[0]}/no-crc", {"verify": False}),
                             (f"{formats[0]}/io-only", {"verify": False, "io_only": True})):
                cases[name] = Case(layers, width, formats[0], d, args.all_nvme, **kw)
                per_format[name] = []
        probe_bytes = max(c.step()["bytes_written"] for c in cases.values())
        probe = DiskProbe(d, probe_bytes, max(c.largest_request() for c in cases.values()))
        own = {f: ExtentProbe(c) for f, c in cases.items()}
        try:
            for r in range(rounds):
                f_wbw, f_rbw = probe.write(), probe.read()
                names = list(cases)
                order = names[r % len(names):] + names[:r % len(names)]  # none always first
                for fmt in order:
                    case = cases[fmt]
                    wbw, rbw, mixed_t = own[fmt].measure()
                    mixed_bps = 2 * own[fmt].nbytes / mixed_t  # both directions' bytes per s
                    for _ in range(args.steps):
                        m = case.step()
                        disk_s = m["bytes_read"] / rbw + m["bytes_written"] / wbw
                        mixed_s = (m["bytes_read"] + m["bytes_written"]) / mixed_bps
                        disk_file_s = m["bytes_read"] / f_rbw + m["bytes_written"] / f_wbw
                        m.update(read_bw=rbw, write_bw=wbw, disk_s=disk_s,
                                 ratio=m["step_s"] / disk_s, mixed_s=mixed_s,
                                 vs_mixed=m["step_s"] / mixed_s, round=r,
                                 file_read_bw=f_rbw, file_write_bw=f_wbw,
                                 disk_file_s=disk_file_s,
                                 ratio_file=m["step_s"] / disk_file_s)
                        per_format[fmt].append(m)
                        logger.info("round %d %-5s step %.3f s, disk time %.3f s (read %.2f "
                                    "GB/s, write %.2f GB/s): %.2fx; mixed disk %.3f s: %.2fx | "
                                    "waits read %.3f write %.3f, Adam %.3f, other %.3f; "
                                    "worker CRC %.3f; idle disk %.3f", r, fmt, m["step_s"],
                                    disk_s, rbw / 1e9, wbw / 1e9, m["ratio"], mixed_s,
                                    m["vs_mixed"], m["read_wait_s"], m["write_wait_s"],
                                    m["compute_s"], m["other_s"], m["crc_s"],
                                    m["disk_idle_s"])
        finally:
            probe.close()
            cases_sets = {f: c.sets for f, c in cases.items()}
            for case in cases.values():
                case.close()
    rows = []
    for fmt, ms in per_format.items():
        med = lambda k: statistics.median(m[k] for m in ms)  # noqa: E731
        row = {"states": fmt, "sets": cases_sets[fmt], "step_s": med("step_s"),
               "disk_s": med("disk_s"), "ratio": med("ratio"), "mixed_s": med("mixed_s"),
               "disk_file_s": med("disk_file_s"), "ratio_file": med("ratio_file"),
               "vs_mixed": med("vs_mixed"), "compute_s": med("compute_s"),
               "io_wait_s": med("io_wait_s"), "bytes_read": ms[-1]["bytes_read"],
               "bytes_written": ms[-1]["bytes_written"], "read_bw": med("read_bw"),
               "write_bw": med("write_bw")}
        row.update({k: med(k) for k in ATTRIBUTION})
        row["samples"] = ms
        rows.append(row)
    base = rows[0]
    print(f"{'states':<12} {'sets':>4} {'step s':>8} {'disk s':>8} {'step/disk':>10} "
          f"{'MB/step':>9} {'bytes vs ' + base['states']:>14} {'time vs ' + base['states']:>13} "
          f"{'vs file probe':>13}")
    for r in rows:
        moved = r["bytes_read"] + r["bytes_written"]
        print(f"{r['states']:<12} {r['sets']:>4} {r['step_s']:>8.3f} {r['disk_s']:>8.3f} "
              f"{r['ratio']:>9.2f}x {moved / 1e6:>9.0f} "
              f"{moved / (base['bytes_read'] + base['bytes_written']):>13.2f}x "
              f"{r['step_s'] / base['step_s']:>12.2f}x {r['ratio_file']:>12.2f}x")
    print("\nattribution (medians, s): pipeline thread = read wait + write wait + CPU Adam + "
          "verify + other; I/O timeline: reads / writes / both in flight, disk idle; CRC threads")
    print(f"{'states':<12} {'step':>6} {'mixed':>6} {'x mix':>6} {'r.wait':>7} {'w.wait':>7} "
          f"{'Adam':>6} {'verify':>7} {'other':>6} | {'reads':>6} {'writes':>6} {'both':>6} "
          f"{'idle':>6} | {'CRC':>6}")
    for r in rows:
        print(f"{r['states']:<12} {r['step_s']:>6.3f} {r['mixed_s']:>6.3f} {r['vs_mixed']:>5.2f}x "
              f"{r['read_wait_s']:>7.3f} {r['write_wait_s']:>7.3f} {r['compute_s']:>6.3f} "
              f"{r['verify_s']:>7.3f} {r['other_s']:>6.3f} | {r['read_busy_s']:>6.3f} "
              f"{r['write_busy_s']:>6.3f} {r['both_busy_s']:>6.3f} {r['disk_idle_s']:>6.3f} | "
              f"{r['crc_s']:>6.3f}")
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
