"""The io_uring backend of the native I/O engine (IOConfig.backend) against the thread pool:
same bytes, same CRCs, same errors; switching, fallback and process exit."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from test_io import _uring_usable

import infinity.io as io

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BACKENDS = ("threads", "io_uring")

pytestmark = pytest.mark.skipif(not _uring_usable(), reason="native io_uring backend not usable")


def _lib():
    from infinity.io._lib import native
    return native()


def _ring_chunks() -> int:
    return int(_lib().inf_aio_ring_chunks())


@pytest.fixture(autouse=True)
def _restore_config():
    old = io.get_config()
    yield
    io.clear_faults()
    io.configure(**{k: getattr(old, k) for k in
                    ("num_threads", "chunk_bytes", "queue_depth", "crc_threads", "backend")})


def _data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _aligned(src: torch.Tensor, shift: int = 0) -> torch.Tensor:
    buf = io.aligned_empty(src.numel() + shift)[shift:]
    buf.copy_(src)
    return buf


SIZES = [4096, 4097, 3 * 4096 + 5, (1 << 20) + 3, (5 << 20) + 4096 * 3 + 17]


@pytest.mark.parametrize("writer,reader", [("io_uring", "threads"), ("threads", "io_uring"),
                                           ("io_uring", "io_uring")])
@pytest.mark.parametrize("chunk_kib,threads", [(64, 3), (4096, 32)])
def test_cross_backend_bytes_and_crcs(tmp_path, writer, reader, chunk_kib, threads):
    """Each side writes/reads with its backend; bytes and CRC32Cs agree with the data, over
    sizes with unaligned tails, nonzero offsets and more chunks than ring slots."""
    io.configure(chunk_bytes=chunk_kib << 10, num_threads=threads)
    path = tmp_path / "f.bin"
    before = _ring_chunks()
    with io.FileHandle(path, "w+") as f:
        offset = 0
        for i, size in enumerate(SIZES):
            data = _data(size, seed=i)
            io.configure(backend=writer)
            w = f.pwrite(_aligned(data), offset, crc=True)
            assert w.wait() == size
            io.configure(backend=reader)
            out = io.aligned_empty(size)
            r = f.pread(out, offset, crc=True)
            assert r.wait() == size
            assert torch.equal(out, data)
            assert w.crc32c() == r.crc32c() == io.crc32c(data)
            timing = r.timing()
            assert timing is not None and timing[0] <= timing[1] <= timing[2]
            offset += (size + 4095) // 4096 * 4096 + 8192  # aligned offsets, with holes
    assert _ring_chunks() > before


@pytest.mark.parametrize("shift", [0, 8])
@pytest.mark.parametrize("offset", [0, 4096, 100])
def test_alignments_match_thread_backend(tmp_path, shift, offset):
    """Misaligned buffers (bounce) and offsets (page cache) go to the workers; the results are
    the same file bytes as the thread backend's."""
    data = _data((2 << 20) + 123, seed=5)
    files = {}
    for backend in BACKENDS:
        io.configure(backend=backend, chunk_bytes=256 << 10)
        path = tmp_path / f"{backend}.bin"
        with io.FileHandle(path, "w+") as f:
            f.write(_aligned(data, shift), offset)
            out = io.aligned_empty(data.numel() + shift)[shift:]
            f.read(out, offset)
            assert torch.equal(out, data)
        files[backend] = path.read_bytes()
    assert files["threads"] == files["io_uring"]
    assert files["io_uring"][offset:] == data.numpy().tobytes()


def test_uring_backend_is_used_for_direct_requests(tmp_path):
    io.configure(backend="io_uring", chunk_bytes=1 << 20)
    assert io.backend_name() == "io_uring"
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        if not f.direct:
            pytest.skip("no O_DIRECT here")
        before = _ring_chunks()
        f.write(_aligned(_data(8 << 20, seed=1)))
        assert _ring_chunks() - before == 8
    io.configure(backend="threads")
    assert io.backend_name() == "threads"
    with io.FileHandle(tmp_path / "g.bin", "w+") as f:
        before = _ring_chunks()
        f.write(_aligned(_data(8 << 20, seed=1)))
        assert _ring_chunks() == before


def test_short_read_in_a_middle_chunk(tmp_path):
    """EOF inside chunk 2 of 8: the error names the end of file; later chunks are skipped and
    the bytes before EOF are read."""
    io.configure(backend="io_uring", chunk_bytes=64 << 10, num_threads=4)
    data = _data((2 * 64 << 10) + 5000, seed=2)
    path = tmp_path / "f.bin"
    with io.FileHandle(path, "w+") as f:
        f.write(_aligned(data))
        out = io.aligned_empty(8 * 64 << 10)
        with pytest.raises(io.InfinityIOError) as info:
            f.pread(out, crc=True).wait()
        err = info.value
        assert err.errno == errno.ENODATA and err.offset == data.numel()
        assert "short read" in str(err) and str(data.numel()) in str(err)
        assert torch.equal(out[:data.numel()], data)


@pytest.mark.parametrize("op", ["write", "read"])
def test_injected_error_mid_request_reports_offset(tmp_path, op):
    io.configure(backend="io_uring", chunk_bytes=64 << 10, num_threads=4)
    data = _data(1 << 20, seed=3)
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        f.write(_aligned(data))
        errno_ = errno.ENOSPC if op == "write" else errno.EIO
        io.inject_fault(op, errno_, after_bytes=300_000)
        buf = _aligned(data) if op == "write" else io.aligned_empty(1 << 20)
        fut = f.pwrite(buf) if op == "write" else f.pread(buf)
        with pytest.raises(io.InfinityIOError) as info:
            fut.wait()
        io.clear_faults()
        assert info.value.errno == errno_
        assert info.value.offset is not None and 4096 <= info.value.offset <= 1 << 20
        assert ("write" if op == "write" else "read") + " failed at offset" in str(info.value)


def test_concurrent_requests_from_python_threads(tmp_path):
    io.configure(backend="io_uring", chunk_bytes=128 << 10, num_threads=8)
    size = (1 << 20) + 4096
    errors = []
    path = tmp_path / "f.bin"
    with io.FileHandle(path, "w+") as f:
        f.allocate(8 * size)

        def work(k: int) -> None:
            try:
                for rep in range(4):
                    data = _data(size, seed=100 * k + rep)
                    w = f.pwrite(_aligned(data), k * size, crc=True)
                    w.wait()
                    out = io.aligned_empty(size)
                    r = f.pread(out, k * size, crc=True)
                    r.wait()
                    if not torch.equal(out, data) or r.crc32c() != w.crc32c():
                        errors.append((k, rep))
            except Exception as exc:  # collected, reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_switching_backend_and_threads_with_requests_in_flight(tmp_path):
    """configure() waits for queued requests, then restarts the pool with the new backend or
    ring depth; nothing is lost or hangs."""
    io.configure(backend="io_uring", chunk_bytes=64 << 10, num_threads=4)
    bufs = [_aligned(_data(1 << 20, seed=i)) for i in range(12)]
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        futures = []
        for i, b in enumerate(bufs):
            futures.append(f.pwrite(b, i << 20))
            if i == 3:
                io.configure(backend="threads")
            elif i == 6:
                io.configure(backend="io_uring")
            elif i == 9:
                io.configure(num_threads=7, crc_threads=1)
        assert [fut.wait(timeout=60) for fut in futures] == [1 << 20] * 12
        for i, b in enumerate(bufs):
            out = io.aligned_empty(1 << 20)
            f.read(out, i << 20)
            assert torch.equal(out, b)


def test_inline_crc_requests_still_served(tmp_path):
    """crc_threads=0 (inline checksums) sends requests to the workers even on io_uring."""
    io.configure(backend="io_uring", crc_threads=0, chunk_bytes=256 << 10)
    data = _data(3 << 20, seed=9)
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        w = f.pwrite(_aligned(data), crc=True)
        w.wait()
        out = io.aligned_empty(3 << 20)
        r = f.pread(out, crc=True)
        r.wait()
    assert w.crc32c() == r.crc32c() == io.crc32c(data)


def test_bad_backend_name():
    with pytest.raises(ValueError, match="infinity.io: backend must be one of"):
        io.configure(backend="uring")
    with pytest.raises(ValueError):
        io.IOConfig(backend=None)


def _run(code: str, env_extra: dict, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)


def test_fallback_when_io_uring_unavailable(tmp_path):
    """INFINITY_IO_URING=0 plays a kernel without io_uring: "auto" quietly uses the threads,
    an explicit "io_uring" is a clear error and leaves the engine working."""
    proc = _run("""
        import logging, sys, torch
        logging.basicConfig(level=logging.INFO)
        import infinity.io as io
        from infinity.io import _backends
        _backends.AUTO_BACKEND = "io_uring"
        io.configure(backend="auto")
        print("AUTO", io.backend_name())
        try:
            io.configure(backend="io_uring")
        except RuntimeError as exc:
            print("ERR", exc)
        print("AFTER", io.backend_name(), io.get_config().backend)
        buf = io.aligned_empty(1 << 20).fill_(3)
        with io.FileHandle(sys.argv[1] + "/f.bin", "w+") as f:
            f.write(buf)
        print("OK")
    """, {"INFINITY_IO_URING": "0", "INFINITY_IO_BACKEND": ""}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "AUTO threads" in out and "OK" in out
    assert "ERR infinity.io: backend='io_uring' was requested" in out
    assert "INFINITY_IO_URING=0" in out and "backend='threads'" in out
    assert "AFTER threads auto" in out
    assert "io_uring unavailable (disabled by INFINITY_IO_URING=0)" in proc.stderr


def test_env_selects_backend(tmp_path):
    proc = _run("""
        import infinity.io as io
        print(io.get_config().backend, io.backend_name())
    """, {"INFINITY_IO_BACKEND": "io_uring"}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["io_uring", "io_uring"]
    from infinity.io import _backends
    proc = _run("""
        import infinity.io as io
        print(io.get_config().backend, io.backend_name())
    """, {"INFINITY_IO_BACKEND": ""}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["auto", _backends.AUTO_BACKEND]


def test_process_exit_with_ring_requests_in_flight(tmp_path):
    """Futures and handles dropped, many chunks in flight on the ring at interpreter exit, and
    a reconfigure storm before: the process exits cleanly and promptly."""
    proc = _run("""
        import sys, torch
        import infinity.io as io
        io.configure(backend="io_uring", chunk_bytes=64 << 10, num_threads=16)
        bufs = [io.aligned_empty(2 << 20).fill_(i) for i in range(6)]
        f = io.FileHandle(sys.argv[1] + "/f.bin", "w+")
        for k in range(20):
            futs = [f.pwrite(b, i << 21) for i, b in enumerate(bufs)]
            io.configure(backend="threads" if k % 2 else "io_uring", num_threads=4 + k % 5)
        for fut in futs:
            fut.wait()
        io.configure(backend="io_uring")
        keep = [f.pwrite(b, i << 21) for i, b in enumerate(bufs)]  # left in flight
        print("SUBMITTED")
    """, {}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SUBMITTED" in proc.stdout


def test_bench_io_backend_quick(tmp_path):
    """bench_io.py --backend runs both native backends side by side and reports CPU per GiB."""
    import json
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_io.py"),
                           "--quick", "--methods", "infinity", "--backend", "threads,io_uring",
                           "--crc", "both", "--out", str(out), "--dir", str(tmp_path),
                           "--no-fio", "--no-plot"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    names = {row["method"] for row in result["results"]}
    assert names == {"infinity[threads]", "infinity[threads]+crc", "infinity[io_uring]",
                     "infinity[io_uring]+crc"}
    for row in result["results"]:
        assert row["gbps"] > 0 and row["cpu_s_per_gib"] >= 0
    assert "read_io_uring_vs_threads" in result["ratios"]


def test_several_ring_threads_in_subprocess(tmp_path):
    """INFINITY_IO_URING_THREADS=3: three rings share the queue (and the wake-up eventfd);
    bytes and CRCs as before, reconfigure and exit clean."""
    proc = _run("""
        import sys, threading, torch
        import infinity.io as io
        from infinity.io._lib import native
        io.configure(backend="io_uring", chunk_bytes=64 << 10, num_threads=7)
        before = native().inf_aio_ring_chunks()
        bad = []
        with io.FileHandle(sys.argv[1] + "/f.bin", "w+") as f:
            def work(k):
                g = torch.Generator().manual_seed(k)
                for size in (4096, 70000, (1 << 20) + 5, 3 << 20):
                    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
                    src = io.aligned_empty(size).copy_(data)
                    w = f.pwrite(src, k << 22, crc=True); w.wait()
                    out = io.aligned_empty(size)
                    r = f.pread(out, k << 22, crc=True); r.wait()
                    if not (torch.equal(out, data) and w.crc32c() == r.crc32c() == io.crc32c(data)):
                        bad.append((k, size))
            ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
            [t.start() for t in ts]; [t.join() for t in ts]
            io.configure(num_threads=2)
            work(5)
        print("CHUNKS", native().inf_aio_ring_chunks() - before, "BAD", bad)
    """, {"INFINITY_IO_URING_THREADS": "3"}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chunks = int(proc.stdout.split()[1])
    assert chunks > 100 and "BAD []" in proc.stdout, proc.stdout
