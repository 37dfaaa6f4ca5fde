"""Tests of infinity.io: native engine and pure-Python fallback."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import infinity.io as io
from infinity import _native
from infinity.io import handle as handle_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3, 3 * (1 << 20) + 5000]

needs_native = pytest.mark.skipif(not _native.available(), reason="native library not built")


def _uring_usable() -> bool:
    if not _native.available():
        return False
    old = io.get_config().backend
    try:
        io.configure(backend="io_uring")
    except RuntimeError:
        return False
    finally:
        io.configure(backend=old)
    return True


@pytest.fixture(params=["native", "io_uring", "fallback"])
def engine(request):
    if request.param == "native":
        if not _native.available():
            pytest.skip("native library not built")
        old = io.get_config().backend
        io.configure(backend="threads")
        try:
            yield "native"
        finally:
            io.configure(backend=old)
    elif request.param == "io_uring":
        if not _uring_usable():
            pytest.skip("io_uring not usable here")
        old = io.get_config().backend
        io.configure(backend="io_uring")
        try:
            if io.backend_name() != "io_uring":
                raise AssertionError(f"backend is {io.backend_name()}, expected io_uring")
            yield "io_uring"
        finally:
            io.configure(backend=old)
    else:
        with _native.force_fallback():
            yield "fallback"


@pytest.fixture(autouse=True)
def _no_faults():
    yield
    io.clear_faults()


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _aligned_copy(src: torch.Tensor) -> torch.Tensor:
    buf = io.aligned_empty(src.numel(), src.dtype)
    buf.copy_(src)
    return buf


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("aligned", [True, False])
def test_round_trip(engine, tmp_path, size, aligned):
    data = _random_bytes(size, seed=size)
    src = _aligned_copy(data) if aligned else torch.empty(size + 1, dtype=torch.uint8)[1:]
    if not aligned:
        src.copy_(data)
    path = tmp_path / "f.bin"
    with io.FileHandle(path, "w+") as f:
        assert f.pwrite(src).wait() == size
        assert f.size() == size
        dst = io.aligned_empty(size) if aligned else torch.zeros(size + 3, dtype=torch.uint8)[3:]
        assert f.pread(dst).wait() == size
    assert torch.equal(dst, data)
    assert path.read_bytes() == data.numpy().tobytes()


@pytest.mark.parametrize("buf_shift", [0, 8])
def test_round_trip_many_chunks(engine, tmp_path, buf_shift):
    """Requests split into many chunks (direct body, bounce buffer, plain tail)."""
    old = io.get_config().chunk_bytes
    io.configure(chunk_bytes=64 << 10)
    try:
        size = (1 << 20) + 4097
        data = _random_bytes(size, seed=11)
        src = io.aligned_empty(size + buf_shift)[buf_shift:]
        src.copy_(data)
        with io.FileHandle(tmp_path / "f.bin", "w+") as f:
            assert f.pwrite(src, 8192).wait() == size
            dst = io.aligned_empty(size + buf_shift)[buf_shift:]
            assert f.pread(dst, 8192).wait() == size
        assert torch.equal(dst, data)
    finally:
        io.configure(chunk_bytes=old)


@pytest.mark.parametrize("offset", [4096, 1, 12345, (1 << 20) + 4096])
def test_nonzero_offsets(engine, tmp_path, offset):
    data = _random_bytes(70000, seed=offset)
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        f.write(_aligned_copy(data), offset)
        assert f.size() == offset + data.numel()
        out = io.aligned_empty(data.numel())
        f.read(out, offset)
        assert torch.equal(out, data)
        part = torch.zeros(1000, dtype=torch.uint8)
        f.read(part, offset + 7)
        assert torch.equal(part, data[7:1007])


def test_native_and_fallback_same_bytes(tmp_path):
    if not _native.available():
        pytest.skip("native library not built")
    data = _random_bytes((1 << 20) + 3, seed=7)
    with io.FileHandle(tmp_path / "a.bin", "w+") as f:
        f.write(_aligned_copy(data), 5)
    with _native.force_fallback():
        with io.FileHandle(tmp_path / "b.bin", "w+") as f:
            assert not f.direct
            f.write(data, 5)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_many_concurrent_requests(engine, tmp_path):
    n, size = 64, 40000
    blobs = [_random_bytes(size, seed=i) for i in range(n)]
    stride = 40960
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        futures = [f.pwrite(_aligned_copy(b), i * stride) for i, b in enumerate(blobs)]
        assert [fut.wait() for fut in futures] == [size] * n
        outs = [io.aligned_empty(size) for _ in range(n)]
        futures = [f.pread(o, i * stride) for i, o in enumerate(outs)]
        assert all(fut.wait(timeout=30) == size for fut in futures)
        assert all(fut.done() for fut in futures)
    for b, o in zip(blobs, outs):
        assert torch.equal(b, o)


def test_dtypes_and_nbytes(engine, tmp_path):
    x = torch.randn(1000, dtype=torch.float32)
    y = torch.randn(333, dtype=torch.bfloat16)
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        f.write(x, 0)
        f.write(y, 8192)
        f.write(x, 20000, nbytes=12)
        x2, y2, z = torch.empty_like(x), torch.empty_like(y), torch.zeros(3)
        f.read(x2, 0)
        f.read(y2, 8192)
        f.read(z, 20000)
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(z, x[:3])


@needs_native
def test_direct_on_real_disk(tmp_path):
    assert io.supports_direct_io(tmp_path)
    with io.FileHandle(tmp_path / "f.bin", "w+", require_direct=True) as f:
        assert f.direct


def _check_buffered_fallback(path: str) -> None:
    data = _random_bytes(10000)
    handle_mod._warned_no_direct = False
    with pytest.warns(RuntimeWarning, match="O_DIRECT") as record:
        f = io.FileHandle(path, "w+")
    assert path in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second handle does not warn again
        io.FileHandle(path, "r").close()
    assert not f.direct
    f.write(_aligned_copy(data))
    out = io.aligned_empty(10000)
    f.read(out)
    f.close()
    assert torch.equal(out, data)
    with pytest.raises(io.InfinityIOError, match="O_DIRECT") as info:
        io.FileHandle(path, "r", require_direct=True)
    assert info.value.errno == errno.EINVAL


@needs_native
def test_tmpfs_dev_shm():
    """/dev/shm: tmpfs refuses O_DIRECT before Linux 6.6 (fallback with one warning); newer
    kernels accept it. Data must be right either way."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/infinity-test-{os.getpid()}.bin"
    try:
        if io.supports_direct_io("/dev/shm"):
            data = _random_bytes(10000)
            with io.FileHandle(path, "w+") as f:
                assert f.direct
                f.write(data)
                out = torch.empty(10000, dtype=torch.uint8)
                f.read(out)
            assert torch.equal(out, data)
        else:
            _check_buffered_fallback(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


@needs_native
def test_filesystem_without_o_direct_falls_back(tmp_path):
    io.inject_fault("open", errno.EINVAL)  # as a filesystem refusing O_DIRECT
    _check_buffered_fallback(str(tmp_path / "f.bin"))
    io.inject_fault("open", errno.EACCES)
    with pytest.raises(io.InfinityIOError) as info:
        io.FileHandle(tmp_path / "f.bin", "r")
    assert info.value.errno == errno.EACCES


def test_read_past_end(engine, tmp_path):
    data = _random_bytes(5000)
    path = tmp_path / "f.bin"
    with io.FileHandle(path, "w+") as f:
        f.write(data)
        out = io.aligned_empty(8192)
        with pytest.raises(io.InfinityIOError) as info:
            f.read(out)
        err = info.value
        assert err.errno == errno.ENODATA
        assert err.filename == str(path)
        assert err.offset == 5000
        assert "short read" in str(err) and "5000" in str(err)
        assert torch.equal(out[:5000], data)  # what was there was read
        ok = torch.zeros(100, dtype=torch.uint8)
        f.read(ok, 4900)
        assert torch.equal(ok, data[4900:])


def test_injected_enospc_keeps_earlier_data(engine, tmp_path):
    first = _random_bytes(1 << 20, seed=1)
    path = tmp_path / "f.bin"
    with io.FileHandle(path, "w+") as f:
        f.write(_aligned_copy(first))
        io.inject_fault("write", errno.ENOSPC, after_bytes=1 << 20)
        second = _aligned_copy(_random_bytes(3 << 20, seed=2))
        with pytest.raises(io.InfinityIOError) as info:
            f.write(second, 1 << 20)
        assert info.value.errno == errno.ENOSPC
        assert "nvme_path is full" in str(info.value)
        assert info.value.offset is not None and info.value.offset >= 1 << 20
        io.clear_faults()
        out = io.aligned_empty(1 << 20)
        f.read(out)
        assert torch.equal(out, first)
        io.inject_fault("read", errno.EIO, after_bytes=0)
        with pytest.raises(io.InfinityIOError) as info:
            f.read(out)
        assert info.value.errno == errno.EIO


def test_injected_fault_after_an_unaligned_byte_count_is_the_injected_errno(engine, tmp_path):
    """With O_DIRECT the injector rounds a partial transfer down to 4 KiB: the failure is the
    injected ENOSPC, never an EINVAL from an unaligned length."""
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        io.inject_fault("write", errno.ENOSPC, after_bytes=100_000)
        try:
            with pytest.raises(io.InfinityIOError) as info:
                f.write(_aligned_copy(_random_bytes(1 << 20, seed=3)))
        finally:
            io.clear_faults()
        assert info.value.errno == errno.ENOSPC


@pytest.mark.parametrize("backend", ["threads", "io_uring", "python"])
def test_rlimit_fsize_efbig(tmp_path, backend):
    """A real kernel error (RLIMIT_FSIZE -> EFBIG) mid-write, on each backend: the error has
    the offset, earlier data survives, the process does not die of SIGXFSZ."""
    if backend == "io_uring" and not _uring_usable():
        pytest.skip("io_uring is not usable here")
    script = textwrap.dedent(f"""
        import errno, resource, sys, torch
        import infinity.io as io
        from infinity import _native
        ctx = _native.force_fallback({backend == "python"})
        ctx.__enter__()
        if {backend != "python"}:
            io.configure(backend={backend!r}, chunk_bytes=256 << 10)
            assert io.backend_name() == {backend!r}
        path = sys.argv[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        first = torch.full((1 << 19,), 7, dtype=torch.uint8)
        with io.FileHandle(path, "w+") as f:
            f.write(io.aligned_empty(1 << 19).copy_(first))
            try:
                f.write(io.aligned_empty(2 << 20).fill_(9), 1 << 19)
            except io.InfinityIOError as exc:
                assert exc.errno == errno.EFBIG, exc
                print("EFBIG", exc.offset)
            out = io.aligned_empty(1 << 19)
            f.read(out)
            assert torch.equal(out, first)
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "f.bin")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "EFBIG 1048576" in proc.stdout and "OK" in proc.stdout


def test_close_with_requests_in_flight(engine, tmp_path):
    io.configure(chunk_bytes=64 << 10)
    try:
        bufs = [_aligned_copy(_random_bytes(1 << 20, seed=i)) for i in range(16)]
        f = io.FileHandle(tmp_path / "f.bin", "w+")
        futures = [f.pwrite(b, i << 20) for i, b in enumerate(bufs)]
        f.close()  # waits for them
        f.close()  # no-op
        assert f.closed
        assert all(fut.done() for fut in futures)
        assert [fut.wait() for fut in futures] == [1 << 20] * 16
        with pytest.raises(io.InfinityIOError) as info:
            f.pwrite(bufs[0])
        assert info.value.errno == errno.EBADF
        assert (tmp_path / "f.bin").stat().st_size == 16 << 20
    finally:
        io.configure(chunk_bytes=io.IOConfig().chunk_bytes)


def test_dropped_future_and_handle_do_not_crash(engine, tmp_path):
    f = io.FileHandle(tmp_path / "f.bin", "w+")
    f.pwrite(_aligned_copy(_random_bytes(2 << 20)))  # future dropped at once
    del f
    assert (tmp_path / "f.bin").stat().st_size == 2 << 20


def test_fsync_allocate_truncate(engine, tmp_path):
    data = _random_bytes(10000)
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        f.allocate(1 << 20)
        assert f.size() == 1 << 20
        assert f.pwrite(_aligned_copy(data), 4096, fsync=True).wait() == 10000
        f.fsync()
        f.truncate(4096 + 10000)
        assert f.size() == 14096
        out = torch.empty(10000, dtype=torch.uint8)
        f.read(out, 4096)
    assert torch.equal(out, data)


def test_mode_c_plus_keeps_contents(engine, tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)
    with io.FileHandle(path, "c+") as f:
        assert f.size() == 100
    with io.FileHandle(tmp_path / "new.bin", "c+") as f:
        assert f.size() == 0


def test_crc32c_known_values(engine):
    assert io.crc32c(b"123456789") == 0xE3069283
    assert io.crc32c(b"") == 0
    assert io.crc32c(bytes(32)) == 0x8A9136AA
    data = _random_bytes(10007, seed=3)
    whole = io.crc32c(data)
    assert io.crc32c(data[5000:], seed=io.crc32c(data[:5000])) == whole
    assert io.crc32c(data.numpy().tobytes()) == whole


@needs_native
def test_crc32c_native_equals_fallback():
    data = _random_bytes(100003, seed=4)
    for start in range(0, 9):
        native_value = io.crc32c(data[start:])
        with _native.force_fallback():
            assert io.crc32c(data[start:]) == native_value
    from infinity.io._lib import native
    lib = native()
    ptr = data.data_ptr()
    assert lib.inf_crc_crc32c_impl(ptr, data.numel(), 0, 0) == lib.inf_crc_crc32c_impl(
        ptr, data.numel(), 0, 1)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_aligned_empty(engine, dtype):
    for numel in (1, 1000, 1 << 20):
        t = io.aligned_empty(numel, dtype)
        assert io.is_aligned(t) and t.numel() == numel and t.dtype == dtype
        assert t.device.type == "cpu" and t.is_contiguous()
        t.fill_(1)
    assert io.aligned_empty(0).numel() == 0
    with pytest.raises(ValueError):
        io.aligned_empty(-1)


@needs_native
def test_aligned_empty_frees_memory():
    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    chunk = 256 << 20
    base = rss()
    for _ in range(8):  # 2 GiB allocated and freed in all
        t = io.aligned_empty(chunk)
        t.fill_(1)
        v = t.view(torch.float32)[10:]
        del t
        assert rss() - base > chunk // 2
        del v
    assert rss() - base < chunk // 2


def test_bad_inputs(engine, tmp_path):
    with io.FileHandle(tmp_path / "f.bin", "w+") as f:
        with pytest.raises(ValueError, match="contiguous"):
            f.pwrite(torch.zeros(10, 10).t())
        with pytest.raises(ValueError, match="pinned host buffer"):
            f.pwrite(torch.zeros(10, device="meta"))
        with pytest.raises(ValueError, match="offset"):
            f.pwrite(torch.zeros(10), -1)
        with pytest.raises(ValueError, match="nbytes"):
            f.pwrite(torch.zeros(10), 0, nbytes=41)
        with pytest.raises(TypeError):
            f.pwrite(b"abc")
    with pytest.raises(ValueError, match="mode"):
        io.FileHandle(tmp_path / "f.bin", "rw")
    with pytest.raises(io.InfinityIOError) as info:
        io.FileHandle(tmp_path / "missing" / "f.bin", "w+")
    assert info.value.errno == errno.ENOENT and "does not exist" in str(info.value)
    with pytest.raises(io.InfinityIOError) as info:
        io.FileHandle(tmp_path / "absent.bin", "r")
    assert info.value.errno == errno.ENOENT
    with pytest.raises(io.InfinityIOError) as info:
        io.FileHandle(tmp_path, "r")
    assert info.value.errno == errno.EISDIR
    if os.path.isdir("/sys"):  # sysfs refuses new files, even to root
        with pytest.raises(io.InfinityIOError) as info:
            io.FileHandle("/sys/infinity-test.bin", "w+")
        assert info.value.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
        assert "writable" in str(info.value)
    with pytest.raises(io.InfinityIOError):
        io.supports_direct_io(tmp_path / "missing")


def test_config(engine):
    old = io.get_config()
    try:
        new = io.configure(num_threads=3, chunk_bytes=256 << 10)
        assert io.get_config() == new and new.num_threads == 3 and new.queue_depth == old.queue_depth
        with pytest.raises(ValueError):
            io.configure(chunk_bytes=1000)
        with pytest.raises(ValueError):
            io.configure(num_threads=0)
        with pytest.raises(Exception):
            new.num_threads = 5  # frozen
    finally:
        io.configure(**{k: getattr(old, k) for k in ("num_threads", "chunk_bytes", "queue_depth")})


def test_inject_fault_validation():
    with pytest.raises(ValueError):
        io.inject_fault("seek", errno.EIO, 0)
    with pytest.raises(ValueError):
        io.inject_fault("write", -1, 0)


def test_bench_quick(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_io.py"),
                           "--quick", "--out", str(out), "--dir", str(tmp_path), "--no-fio",
                           "--no-plot"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    names = {row["method"] for row in result["results"]}
    assert "infinity" in names and "buffered" in names
    for row in result["results"]:
        assert row["gbps"] > 0


def test_crc32c_folding_path_matches_table():
    """The VPCLMULQDQ folding path (AVX-512; chosen automatically where the CPU has it):
    lengths around its 256-byte loop and 512-byte minimum, offsets, seeds, and a buffer of
    many MiB give the table's value; INFINITY_CRC32C_IMPL=sse42|table selects the others."""
    from infinity.io._lib import native

    lib = native()
    if lib is None:
        pytest.skip("native core not built")
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8, generator=g)
    sizes = [0, 1, 15, 16, 255, 256, 257, 511, 512, 513, 767, 768, 1023, 1024, 4096 + 17,
             65536 + 255, (9 << 20) - 8]
    for n in sizes:
        for off in (0, 1, 7):
            arr = data[off:off + n].numpy()
            for seed in (0, 0xDEADBEEF):
                table = lib.inf_crc_crc32c_impl(arr.ctypes.data, n, seed, 0)
                assert lib.inf_crc_crc32c_impl(arr.ctypes.data, n, seed, 2) == table, (n, off)
                assert lib.inf_crc_crc32c_impl(arr.ctypes.data, n, seed, 1) == table, (n, off)
    code = ("from infinity.io._lib import native; print(native().inf_crc_impl())")
    for env, allowed in (("table", {0}), ("sse42", {0, 1}), ("", {0, 1, 2})):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, INFINITY_CRC32C_IMPL=env), timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout.strip()) in allowed, (env, out.stdout)


def test_crc32c_striped_sse42_path_matches_table():
    """Buffers of >= 48 KiB take the three-stripe SSE4.2 path; lengths and offsets around the
    stripe boundaries must give the table's value."""
    from infinity.io._lib import native

    lib = native()
    if lib is None:
        pytest.skip("native core not built")
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 * 16384 * 3 + 64,), dtype=torch.uint8, generator=g)
    for n in (3 * 16384 - 1, 3 * 16384, 3 * 16384 + 1, 2 * 3 * 16384 + 13, data.numel() - 8):
        for off in (0, 1, 5):
            arr = data[off:off + n].numpy()
            sse = lib.inf_crc_crc32c_impl(arr.ctypes.data, n, 0xDEADBEEF, 1)
            table = lib.inf_crc_crc32c_impl(arr.ctypes.data, n, 0xDEADBEEF, 0)
            assert sse == table, (n, off)


@pytest.mark.parametrize("fallback", [False, True])
def test_worker_computed_crc_matches_crc32c(tmp_path, fallback):
    """pread/pwrite(crc=True): the workers checksum each chunk while moving it and combine the
    chunks in order; the result equals crc32c of the whole buffer, for sizes that span many
    chunks and end in an unaligned tail."""
    import infinity._native as native

    with native.force_fallback(fallback):
        g = torch.Generator().manual_seed(7)
        for size in (1, 4096, 3 * 4096 + 5, (9 << 20) + 4099):
            data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
            with io.FileHandle(str(tmp_path / f"c{size}"), "w+") as fh:
                w = fh.pwrite(data, 0, crc=True)
                w.wait()
                back = torch.empty_like(data)
                r = fh.pread(back, 0, crc=True)
                assert w.crc32c() == io.crc32c(data) == r.crc32c()
                plain = fh.pread(back, 0)
                with pytest.raises(RuntimeError, match="crc=True"):
                    plain.crc32c()
