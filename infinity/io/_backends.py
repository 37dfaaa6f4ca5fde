"""The two engines behind FileHandle, with one small interface:

Design notes: docs/modules.md, io/_backends.py."""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno as _errno
import logging
import os
import threading
from typing import Optional, Set, Tuple

from infinity.io import faults
from infinity.io.config import IOConfig, _on_change, get_config
from infinity.io.crc import crc32c

_log = logging.getLogger(__name__)

READ, WRITE = 0, 1
Result = Tuple[int, int, int, str]  # bytes, errno (0 ok), error offset, message

MODES = {"r": 0, "r+": 1, "w+": 2, "c+": 3}
_OS_FLAGS = {
    0: os.O_RDONLY,
    1: os.O_RDWR,
    2: os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    3: os.O_RDWR | os.O_CREAT,
}


class BackendOpenError(Exception):
    def __init__(self, err: int) -> None:
        super().__init__(err)
        self.errno = err


class NativeBackend:
    def __init__(self, lib: ctypes.CDLL, path: str, mode: int, want_direct: bool) -> None:
        self._lib = lib
        direct = ctypes.c_int(0)
        handle = lib.inf_aio_open(
            os.fsencode(path), mode, 1 if want_direct else 0, ctypes.byref(direct)
        )
        if handle < 0:
            raise BackendOpenError(-handle)
        self._handle = handle
        self.direct = bool(direct.value)

    def submit(
        self,
        op: int,
        ptr: int,
        nbytes: int,
        offset: int,
        fsync: bool,
        crc: bool = False,
        urgent: bool = False,
    ) -> int:
        flags = (1 if fsync else 0) | (2 if crc else 0) | (4 if urgent else 0)
        req = self._lib.inf_aio_submit_ex(self._handle, op, ptr, nbytes, offset, flags)
        if req < 0:
            raise BackendOpenError(-req)
        return req

    def poll(self, token: int) -> bool:
        return self._lib.inf_aio_poll(token) != 0  # unknown (-1) counts as done

    def wait(self, token: int, timeout_s: float) -> bool:
        return self._lib.inf_aio_wait(token, max(0, int(timeout_s * 1000))) != 0

    def result(self, token: int) -> Result:
        nbytes, err, err_off = ctypes.c_int64(0), ctypes.c_int(0), ctypes.c_int64(0)
        msg = ctypes.create_string_buffer(512)
        rc = self._lib.inf_aio_result(
            token, ctypes.byref(nbytes), ctypes.byref(err), ctypes.byref(err_off), msg, len(msg)
        )
        if rc < 0:
            return 0, _errno.EINVAL, 0, "unknown request (already released)"
        return nbytes.value, err.value, err_off.value, msg.value.decode(errors="replace")

    def crc(self, token: int) -> Optional[int]:
        """CRC32C of a completed request submitted with crc=True (computed by the workers)."""
        value = ctypes.c_uint32(0)
        if self._lib.inf_aio_crc(token, ctypes.byref(value)) != 0:
            return None
        return int(value.value)

    def timing(self, token: int) -> Optional[Tuple[float, float, float, float]]:
        """(submitted, first chunk started, completed, worker CRC seconds) of a completed
        request, the first three on the clock of time.perf_counter (CLOCK_MONOTONIC); None
        when the library cannot tell."""
        fn = getattr(self._lib, "inf_aio_timing", None)
        if fn is None:
            return None
        out = (ctypes.c_int64 * 4)()
        if fn(token, out) != 0:
            return None
        return out[0] * 1e-9, out[1] * 1e-9, out[2] * 1e-9, out[3] * 1e-9

    def release(self, token: int) -> None:
        self._lib.inf_aio_release(token)

    def _check(self, rc: int) -> int:
        if rc < 0:
            raise BackendOpenError(-rc)
        return rc

    def size(self) -> int:
        return self._check(self._lib.inf_aio_size(self._handle))

    def fsync(self) -> None:
        self._check(self._lib.inf_aio_fsync(self._handle))

    def truncate(self, nbytes: int) -> None:
        self._check(self._lib.inf_aio_truncate(self._handle, nbytes))

    def allocate(self, nbytes: int) -> None:
        self._check(self._lib.inf_aio_allocate(self._handle, nbytes))

    def inflight(self) -> int:
        return max(0, self._lib.inf_aio_inflight(self._handle))

    def close(self) -> None:
        self._check(self._lib.inf_aio_close(self._handle))


# ------------------------------------------------------------------------------------------------
# Pure-Python fallback
# ------------------------------------------------------------------------------------------------
_pool_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _reset_pool(config: IOConfig) -> None:
    global _pool
    with _pool_lock:
        old, _pool = _pool, None
    if old is not None:
        old.shutdown(wait=False)  # queued work still runs


_on_change(_reset_pool)


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=get_config().num_threads, thread_name_prefix="infinity-io"
            )
        return _pool


class FallbackBackend:
    direct = False

    def __init__(self, path: str, mode: int) -> None:
        try:
            self._fd = os.open(path, _OS_FLAGS[mode] | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BackendOpenError(exc.errno or _errno.EIO) from None
        if os.path.isdir(path):
            os.close(self._fd)
            raise BackendOpenError(_errno.EISDIR)
        self._lock = threading.Lock()
        self._pending: Set[concurrent.futures.Future] = set()
        self._closed = False

    def _transfer(
        self, op: int, ptr: int, nbytes: int, offset: int, fsync: bool, crc: bool = False
    ) -> Tuple[int, int, int, str, Optional[int]]:
        view = memoryview((ctypes.c_char * max(nbytes, 1)).from_address(ptr)).cast("B")
        checksum = crc32c(view[:nbytes]) if crc and op == WRITE else None
        done, err, err_off, msg = self._move(op, view, nbytes, offset, fsync)
        if crc and op == READ and not err:
            checksum = crc32c(view[:nbytes])
        return done, err, err_off, msg, checksum

    def _move(self, op: int, view: memoryview, nbytes: int, offset: int, fsync: bool) -> Result:
        chunk = get_config().chunk_bytes
        done = 0
        while done < nbytes:
            want = min(chunk, nbytes - done)
            err, want = faults.fallback_check(op, want)
            try:
                if err:
                    raise OSError(err, os.strerror(err))
                if op == READ:
                    got = os.preadv(self._fd, [view[done : done + want]], offset + done)
                else:
                    got = os.pwrite(self._fd, view[done : done + want], offset + done)
            except InterruptedError:
                continue
            except OSError as exc:
                code = exc.errno or _errno.EIO
                return (
                    done,
                    code,
                    offset + done,
                    (
                        f"{'read' if op == READ else 'write'} failed at offset {offset + done} after "
                        f"{done} of {nbytes} bytes: {os.strerror(code)}"
                    ),
                )
            if got == 0:
                if op == READ:
                    return (
                        done,
                        _errno.ENODATA,
                        offset + done,
                        (
                            f"short read: got {done} of {nbytes} bytes at offset {offset} "
                            f"(end of file at offset {offset + done})"
                        ),
                    )
                return done, _errno.EIO, offset + done, "write returned 0"
            done += got
        if fsync and op == WRITE:
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                code = exc.errno or _errno.EIO
                return done, code, offset, f"fdatasync failed: {os.strerror(code)}"
        return done, 0, 0, ""

    def submit(
        self,
        op: int,
        ptr: int,
        nbytes: int,
        offset: int,
        fsync: bool,
        crc: bool = False,
        urgent: bool = False,
    ) -> concurrent.futures.Future:
        # urgent: the fallback's executor has no priorities (a FIFO of whole requests)
        with self._lock:
            if self._closed:
                raise BackendOpenError(_errno.EBADF)
            fut = _executor().submit(self._transfer, op, ptr, nbytes, offset, fsync, crc)
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def poll(self, token: concurrent.futures.Future) -> bool:
        return token.done()

    def wait(self, token: concurrent.futures.Future, timeout_s: float) -> bool:
        concurrent.futures.wait([token], timeout=timeout_s)
        return token.done()

    def result(self, token: concurrent.futures.Future) -> Result:
        return token.result()[:4]

    def crc(self, token: concurrent.futures.Future) -> Optional[int]:
        return token.result()[4]

    def timing(self, token: concurrent.futures.Future) -> None:
        return None

    def release(self, token: concurrent.futures.Future) -> None:
        pass

    def _fd_call(self, fn, *args) -> None:
        if self._closed:
            raise BackendOpenError(_errno.EBADF)
        try:
            fn(self._fd, *args)
        except OSError as exc:
            raise BackendOpenError(exc.errno or _errno.EIO) from None

    def size(self) -> int:
        if self._closed:
            raise BackendOpenError(_errno.EBADF)
        return os.fstat(self._fd).st_size

    def fsync(self) -> None:
        self._fd_call(os.fsync)

    def truncate(self, nbytes: int) -> None:
        self._fd_call(os.ftruncate, nbytes)

    def allocate(self, nbytes: int) -> None:
        if nbytes > 0:
            self._fd_call(os.posix_fallocate, 0, nbytes)
        self._fd_call(os.ftruncate, nbytes)

    def inflight(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        os.close(self._fd)


# What backend="auto" picks where io_uring works: the thread pool. io_uring (four ring threads)
# matched it on bench_io.py and took a median 0.82x its NVMe optimizer step time in 14 pairs
# measured under heavy load (load average 3-16), but on the quiet machine the step was no faster
# (0.90-1.09 s against 0.84-0.93 s, two pairs) and forward + backward with parameters on NVMe
# was 1.12-1.16x the in-memory step against 1.10x with the threads (the configurations with no
# I/O at all slowed too, 1.12-1.18x against 1.05x; not explained). So io_uring is opt-in
# (backend="io_uring"). Measured 2026-11-29/30 (benchmarks/RESULTS.md) with
# `INFINITY_IO_BACKEND=threads|io_uring OMP_NUM_THREADS=2 python benchmarks/bench_nvme_step.py
# --rounds 2 --formats fp32`, `python benchmarks/bench_io.py --size 2G --methods infinity
# --backend threads,io_uring --crc both` and `python benchmarks/bench_offload_forward.py --steps 5`.
AUTO_BACKEND = "threads"
_reported: Set[str] = set()


def _uring_unavailable_reason(lib: ctypes.CDLL) -> Optional[str]:
    """Why the native engine cannot use io_uring (None: it can; the backend is then set)."""
    if os.environ.get("INFINITY_IO_URING", "").strip() == "0":
        return "disabled by INFINITY_IO_URING=0"
    if not hasattr(lib, "inf_aio_set_backend"):
        return "the native library predates the io_uring backend (rebuild it)"
    rc = lib.inf_aio_set_backend(1)
    if rc == 0:
        return None
    return f"io_uring_setup failed: {os.strerror(-rc)}"


def _select_backend(lib: ctypes.CDLL, backend: str) -> None:
    want_uring = backend == "io_uring" or (backend == "auto" and AUTO_BACKEND == "io_uring")
    if want_uring:
        reason = _uring_unavailable_reason(lib)
        if reason is None:
            return
        if backend == "io_uring":
            raise RuntimeError(
                f"infinity.io: backend='io_uring' was requested but io_uring is not usable here "
                f"({reason}; causes: kernel < 5.1, sysctl kernel.io_uring_disabled, a seccomp "
                "filter in containers). Use backend='threads' (or 'auto')."
            )
        if reason not in _reported:  # once per cause, not on every configure()
            _reported.add(reason)
            _log.info(
                "infinity.io: io_uring unavailable (%s); using the thread-pool backend", reason
            )
    if hasattr(lib, "inf_aio_set_backend"):
        rc = lib.inf_aio_set_backend(0)
        if rc != 0:
            raise ValueError(
                f"the native I/O engine refused backend 'threads' ({os.strerror(-rc)})"
            )


def backend_name() -> str:
    """The engine serving aligned O_DIRECT requests now: "io_uring", "threads" (the native
    worker pool) or "python" (the pure-Python fallback: native library absent or forced off)."""
    from infinity.io._lib import native

    lib = native()
    if lib is None:
        return "python"
    if not hasattr(lib, "inf_aio_get_backend"):
        return "threads"
    err = ctypes.c_int(0)
    return "io_uring" if lib.inf_aio_get_backend(ctypes.byref(err)) == 1 else "threads"


def _configure_native(config: IOConfig) -> None:
    from infinity.io._lib import native

    lib = native(ignore_forced=True)
    if lib is not None:
        _select_backend(lib, config.backend)  # first: a refused backend changes nothing else
        rc = lib.inf_aio_configure(config.num_threads, config.chunk_bytes, config.queue_depth)
        if rc == 0 and hasattr(lib, "inf_aio_set_crc_threads"):
            rc = lib.inf_aio_set_crc_threads(config.crc_threads)
        if rc != 0:
            raise ValueError(f"the native I/O engine refused {config} ({os.strerror(-rc)})")


_on_change(_configure_native)
