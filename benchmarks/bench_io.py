"""Sequential read/write throughput of infinity.io against the usual ways of doing file I/O.

    python benchmarks/bench_io.py                 # 2 GiB file, 3 runs per method
    python benchmarks/bench_io.py --quick         # 64 MiB, 1 run (smoke test)
    python benchmarks/bench_io.py --methods infinity --backend threads,io_uring --crc both
                                                  # the two native backends, alternating

Methods (each writes its own file, then reads it back cold):
  infinity        FileHandle.pwrite/pread, O_DIRECT, aligned buffer, worker pool
  buffered        Python open() write / readinto (page cache)
  odirect_preadv  O_DIRECT os.pwritev/os.preadv, aligned buffer, one thread, large chunks
  aiofiles        aiofiles write / read (if importable)
  fio             fio --direct=1, io_uring (libaio if unavailable), iodepth 32 (if on PATH)
  deepspeed_aio   DeepSpeed's aio handle (if importable)
Cold reads: the file is fsync'ed and dropped from the page cache (POSIX_FADV_DONTNEED) before
each read; page-cache growth comes from `Cached:` in /proc/meminfo; CPU s/GiB is this process's
user + sys time (getrusage) per GiB moved. Writes include the final
fsync. Figures are medians; ratios are against the best of fio and DeepSpeed's aio (plain O_DIRECT
preadv/pwritev when neither is installed), same direction.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _common  # noqa: E402  (benchmarks/, this script's folder)
import torch  # noqa: E402

import infinity.io as io  # noqa: E402

MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("ib").rstrip("b") if text[-1:].lower() == "b" else text
    if text and text[-1].lower() in units:
        return int(float(text[:-1]) * units[text[-1].lower()])
    return int(text)


def cached_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


# ------------------------------------------------------------------------------------------------
# Methods: each returns {"write": fn(path, size), "read": fn(path, size)}
# ------------------------------------------------------------------------------------------------
class Infinity:
    name = "infinity"

    def __init__(self, block: int, backend: Optional[str] = None, crc: bool = False) -> None:
        self.buf = io.aligned_empty(block)
        self.buf.fill_(0x5A)
        self.backend = backend  # None: leave IOConfig.backend as it is
        self.crc = crc
        if backend is not None:
            self.name = f"infinity[{backend}]" + ("+crc" if crc else "")

    def _select(self) -> None:
        if self.backend is not None and io.get_config().backend != self.backend:
            io.configure(backend=self.backend)

    def write(self, path: str, size: int) -> None:
        self._select()
        with io.FileHandle(path, "w+", require_direct=True) as f:
            # preallocate, as the swap store does (and as fio does by default): one contiguous
            # extent instead of the fragments that 32 parallel writers would otherwise leave
            f.allocate(size)
            n = self.buf.numel()
            futs = [f.pwrite(self.buf, off, min(n, size - off), crc=self.crc)
                    for off in range(0, size, n)]
            for fut in futs:
                fut.wait()
            f.fsync()

    def read(self, path: str, size: int) -> None:
        self._select()
        with io.FileHandle(path, "r", require_direct=True) as f:
            n = self.buf.numel()
            futs = [f.pread(self.buf, off, min(n, size - off), crc=self.crc)
                    for off in range(0, size, n)]
            for fut in futs:
                fut.wait()


class Buffered:
    name = "buffered"

    def __init__(self, block: int) -> None:
        self.buf = bytearray(b"\x5a" * block)

    def write(self, path: str, size: int) -> None:
        view = memoryview(self.buf)
        with open(path, "wb") as fh:
            for off in range(0, size, len(view)):
                fh.write(view[:min(len(view), size - off)])
            fh.flush()
            os.fsync(fh.fileno())

    def read(self, path: str, size: int) -> None:
        view = memoryview(self.buf)
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass


class ODirectPreadv:
    name = "odirect_preadv"

    def __init__(self, block: int) -> None:
        self.buf = io.aligned_empty(block)
        self.buf.fill_(0x5A)
        self.view = memoryview(self.buf.numpy())

    def write(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            for off in range(0, size, len(self.view)):
                os.pwritev(fd, [self.view[:min(len(self.view), size - off)]], off)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for off in range(0, size, len(self.view)):
                os.preadv(fd, [self.view[:min(len(self.view), size - off)]], off)
        finally:
            os.close(fd)


class AioFiles:
    name = "aiofiles"

    def __init__(self, block: int) -> None:
        import aiofiles  # noqa: F401
        self.block = block
        self.data = b"\x5a" * block

    def write(self, path: str, size: int) -> None:
        import aiofiles
        import aiofiles.os

        async def run() -> None:
            async with aiofiles.open(path, "wb") as fh:
                for off in range(0, size, self.block):
                    await fh.write(self.data[:min(self.block, size - off)])
                await fh.flush()
                await aiofiles.os.wrap(os.fsync)(fh.fileno())
        asyncio.run(run())

    def read(self, path: str, size: int) -> None:
        import aiofiles

        async def run() -> None:
            async with aiofiles.open(path, "rb") as fh:
                while await fh.read(self.block):
                    pass
        asyncio.run(run())


class Fio:
    name = "fio"

    def __init__(self, block: int) -> None:
        if shutil.which("fio") is None:
            raise ImportError("fio not on PATH")
        self.engine = "io_uring"
        if not self._probe("io_uring"):
            self.engine = "libaio"
        self.last_gbps: Optional[float] = None

    def _probe(self, engine: str) -> bool:
        with tempfile.TemporaryDirectory() as d:
            proc = subprocess.run(["fio", "--name=probe", f"--filename={d}/p", "--rw=write",
                                   "--bs=4k", "--size=64k", f"--ioengine={engine}",
                                   "--direct=1", "--output-format=json"],
                                  capture_output=True, text=True)
            return proc.returncode == 0

    def _run(self, path: str, size: int, rw: str) -> None:
        cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", "--bs=1M",
               "--iodepth=32", f"--ioengine={self.engine}", "--direct=1", f"--size={size}",
               "--numjobs=1", "--output-format=json", "--invalidate=1"]
        if rw == "write":
            cmd += ["--end_fsync=1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
        side = job["read" if rw == "read" else "write"]
        # fio's own clock (excludes process start); includes end_fsync for writes
        seconds = job["job_runtime"] / 1000.0 if job.get("job_runtime") else side["runtime"] / 1e3
        self.last_gbps = side["io_bytes"] / seconds / 1e9

    def write(self, path: str, size: int) -> None:
        self._run(path, size, "write")

    def read(self, path: str, size: int) -> None:
        self._run(path, size, "read")


class DeepSpeedAio:
    """DeepSpeed's aio handle (DeepNVMe, libaio) with its own page-locked buffer: the setup
    its authors recommend (1 MiB blocks, queue depth 128, overlapped events, one intra-op
    thread per core)."""

    name = "deepspeed_aio"

    def __init__(self, block: int) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise ImportError("DeepSpeed's async_io op cannot build here (libaio-dev missing?)")
        module = builder.load(verbose=False)
        self.handle = module.aio_handle(block_size=1 << 20, queue_depth=128, single_submit=False,
                                        overlap_events=True,
                                        intra_op_parallelism=os.cpu_count() or 1)
        self.buf = self.handle.new_cpu_locked_tensor(block, torch.empty(0, dtype=torch.uint8))
        self.buf.fill_(0x5A)

    def _each(self, path: str, size: int, op) -> None:
        n = self.buf.numel()
        for off in range(0, size, n):
            op(self.buf[:min(n, size - off)], path, off)

    def write(self, path: str, size: int) -> None:
        if not os.path.exists(path):
            open(path, "wb").close()
        self._each(path, size, self.handle.sync_pwrite)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: str, size: int) -> None:
        self._each(path, size, self.handle.sync_pread)


# ------------------------------------------------------------------------------------------------
def measure(method, direction: str, path: str, size: int) -> Dict[str, float]:
    if direction == "read":
        evict(path)
    before = cached_bytes()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    getattr(method, direction)(path, size)
    seconds = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    growth = cached_bytes() - before
    gbps = size / seconds / 1e9
    if isinstance(method, Fio) and method.last_gbps:
        gbps = method.last_gbps
    # this process's CPU time (user + sys, every thread: workers, ring, CRC threads, io_uring
    # kernel workers); child processes (fio) are not counted
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"gbps": gbps, "cache_growth_mib": growth / MiB, "cpu_s_per_gib": cpu / (size / (1 << 30))}


def machine_info(directory: str) -> Dict[str, str]:
    cpu = _common.cpu_model()
    if cpu is None:
        cpu = platform.processor()
    fs = ""
    try:
        fs = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", directory],
                            capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return {"cpu": cpu, "cores": str(os.cpu_count()), "kernel": platform.release(),
            "filesystem": fs, "python": platform.python_version(), "torch": torch.__version__}


def plot(result: dict, path: str) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return None
    rows = result["results"]
    methods = sorted({r["method"] for r in rows}, key=[r["method"] for r in rows].index)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.4
    for k, direction in enumerate(("write", "read")):
        vals = [next((r["gbps"] for r in rows if r["method"] == m and r["direction"] == direction),
                     0) for m in methods]
        ax.bar([i + (k - 0.5) * width for i in range(len(methods))], vals, width, label=direction)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods, rotation=15)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"Sequential I/O, {result['size_bytes'] / (1 << 30):.2f} GiB file, cold reads")
    ax.legend()
    png = os.path.splitext(path)[0] + ".png"
    _common.save_figure(fig, png, dpi=100)
    return png


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="2G", help="file size (bytes, or with K/M/G), default 2G")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="64 MiB, 1 run")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory for the test files")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_io.json"))
    p.add_argument("--block", default="64M", help="buffer per request/call, default 64M")
    p.add_argument("--threads", type=int, default=None, help="infinity.io num_threads")
    p.add_argument("--chunk", default=None, help="infinity.io chunk_bytes")
    p.add_argument("--methods", default=None, help="comma-separated subset")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--backend", default=None,
                   help="comma-separated IOConfig.backend values (threads,io_uring): the "
                        "'infinity' method runs once per backend, alternating within each rep")
    p.add_argument("--crc", choices=("off", "on", "both"), default="off",
                   help="with --backend: requests with crc=True (CRC32C on the CRC threads)")
    args = p.parse_args(argv)

    size = 64 * MiB if args.quick else parse_size(args.size)
    reps = 1 if args.quick else args.reps
    block = min(parse_size(args.block), size)
    changes = {}
    if args.threads:
        changes["num_threads"] = args.threads
    if args.chunk:
        changes["chunk_bytes"] = parse_size(args.chunk)
    if changes:
        io.configure(**changes)
    if not io.supports_direct_io(args.dir):
        print(f"{args.dir} does not support O_DIRECT; choose another --dir", file=sys.stderr)
        return 2

    classes: List[Callable] = [Infinity, Buffered, ODirectPreadv, AioFiles, Fio, DeepSpeedAio]
    if args.no_fio:
        classes.remove(Fio)
    wanted = set(args.methods.split(",")) if args.methods else None
    methods, skipped = [], {}
    for cls in classes:
        if wanted and cls.name not in wanted:
            continue
        if cls is Infinity and args.backend:
            crcs = {"off": [False], "on": [True], "both": [False, True]}[args.crc]
            for backend in args.backend.split(","):
                if backend not in io.config.BACKENDS:
                    print(f"unknown --backend {backend!r}", file=sys.stderr)
                    return 2
                methods.extend(Infinity(block, backend, crc) for crc in crcs)
            continue
        try:
            methods.append(cls(block))
        except ImportError as exc:
            skipped[cls.name] = str(exc)

    load_before = os.getloadavg()
    work = tempfile.mkdtemp(prefix="bench_io-", dir=args.dir)
    runs: Dict[tuple, List[Dict[str, float]]] = {}
    try:
        for _ in range(reps):
            for m in methods:
                path = os.path.join(work, f"{m.name}.bin")
                for direction in ("write", "read"):
                    runs.setdefault((m.name, direction), []).append(
                        measure(m, direction, path, size))
                remove(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for (name, direction), rs in runs.items():
        rows.append({"method": name, "direction": direction,
                     "gbps": statistics.median(r["gbps"] for r in rs),
                     "runs_gbps": [round(r["gbps"], 3) for r in rs],
                     "cache_growth_mib": statistics.median(r["cache_growth_mib"] for r in rs),
                     "cpu_s_per_gib": statistics.median(r["cpu_s_per_gib"] for r in rs),
                     "runs_cpu_s_per_gib": [round(r["cpu_s_per_gib"], 3) for r in rs]})
    ratios = {}
    for direction in ("write", "read"):
        get = {r["method"]: r["gbps"] for r in rows if r["direction"] == direction}
        # the bar: the best of fio (deep queue) and DeepSpeed's aio handle; plain O_DIRECT
        # preadv/pwritev only when neither is installed
        refs = [get[k] for k in ("fio", "deepspeed_aio") if k in get] or \
            [get[k] for k in ("odirect_preadv",) if k in get]
        if "infinity" in get and refs:
            ratios[f"{direction}_vs_best_odirect"] = get["infinity"] / max(refs)
        if "infinity" in get and "aiofiles" in get:
            ratios[f"{direction}_vs_aiofiles"] = get["infinity"] / get["aiofiles"]
        for suffix in ("", "+crc"):
            a, b = get.get(f"infinity[io_uring]{suffix}"), get.get(f"infinity[threads]{suffix}")
            if a and b:
                ratios[f"{direction}{suffix}_io_uring_vs_threads"] = a / b
                # per rep (the two ran back to back): less sensitive to load changing in a run
                pa = runs[(f"infinity[io_uring]{suffix}", direction)]
                pb = runs[(f"infinity[threads]{suffix}", direction)]
                ratios[f"{direction}{suffix}_io_uring_vs_threads_paired"] = statistics.median(
                    x["gbps"] / y["gbps"] for x, y in zip(pa, pb))
                ratios[f"{direction}{suffix}_io_uring_vs_threads_cpu_paired"] = statistics.median(
                    x["cpu_s_per_gib"] / max(y["cpu_s_per_gib"], 1e-9) for x, y in zip(pa, pb))
    cfg = io.get_config()
    result = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "size_bytes": size, "reps": reps, "block_bytes": block,
        "config": {"num_threads": cfg.num_threads, "chunk_bytes": cfg.chunk_bytes,
                   "queue_depth": cfg.queue_depth, "crc_threads": cfg.crc_threads,
                   "backend": cfg.backend},
        "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
        "fio_engine": next((m.engine for m in methods if isinstance(m, Fio)), None),
        "machine": machine_info(args.dir),
        "results": rows, "ratios": ratios, "skipped": skipped,
    }
    print(f"{'method':24s} {'dir':6s} {'GB/s':>7s} {'runs':28s} {'page cache +MiB':>16s} "
          f"{'CPU s/GiB':>9s}")
    for r in rows:
        print(f"{r['method']:24s} {r['direction']:6s} {r['gbps']:7.2f} "
              f"{str(r['runs_gbps']):28s} {r['cache_growth_mib']:16.0f} "
              f"{r['cpu_s_per_gib']:9.3f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    for k, v in skipped.items():
        print(f"skipped {k}: {v}")
    _common.write_json(args.out, result)
    if not args.no_plot:
        png = plot(result, args.out)
        if png:
            print(f"plot: {png}")
    print(f"json: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
