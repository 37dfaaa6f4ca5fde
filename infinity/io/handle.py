"""FileHandle: asynchronous pread/pwrite of CPU tensors, returning IOFutures."""

from __future__ import annotations

import errno as _errno
import logging
import mmap
import os
import tempfile
import threading
import time
import warnings
from typing import Optional, Tuple, Union

import torch

from infinity.io import _backends
from infinity.io._lib import native
from infinity.io.errors import InfinityIOError, io_error

__all__ = ["FileHandle", "IOFuture", "supports_direct_io"]

logger = logging.getLogger(__name__)

_warn_lock = threading.Lock()
_warned_no_direct = False
_WAIT_SLICE_S = 0.2  # waits return to Python this often so Ctrl-C works


def _warn_no_direct(path: str) -> None:
    global _warned_no_direct
    with _warn_lock:
        first, _warned_no_direct = not _warned_no_direct, True
    if first:
        warnings.warn(
            f"infinity.io: the filesystem of {path} does not support O_DIRECT "
            "(e.g. tmpfs); using buffered I/O through the page cache there. "
            "Pass require_direct=True to make this an error.",
            RuntimeWarning,
            stacklevel=4,
        )
    else:
        logger.debug("infinity.io: O_DIRECT unavailable for %s; buffered I/O", path)


class IOFuture:
    """One pending pread/pwrite. ``wait()`` returns the bytes transferred or raises
    InfinityIOError; the tensor is kept alive until the request completed."""

    def __init__(
        self,
        backend,
        token,
        tensor: torch.Tensor,
        path: str,
        op: str,
        offset: int,
        nbytes: int,
        want_crc: bool = False,
    ) -> None:
        self._backend = backend
        self._token = token
        self._tensor: Optional[torch.Tensor] = tensor
        self._path = path
        self._op = op
        self._offset = offset
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._finished = False
        self._bytes = 0
        self._error: Optional[InfinityIOError] = None
        self._want_crc = want_crc
        self._crc: Optional[int] = None
        self._timing: Optional[Tuple[float, float, float, float]] = None

    def _finish(self) -> None:
        """Collects the result of a completed request (idempotent)."""
        with self._lock:
            if self._finished:
                return
            nbytes, err, err_off, msg = self._backend.result(self._token)
            if self._want_crc and not err:
                self._crc = self._backend.crc(self._token)
            self._timing = self._backend.timing(self._token)
            self._backend.release(self._token)
            self._bytes = nbytes
            if err:
                self._error = io_error(err, self._path, op=self._op, offset=err_off, detail=msg)
            self._tensor = None
            self._finished = True

    def done(self) -> bool:
        if self._finished:
            return True
        if self._backend.poll(self._token):
            self._finish()
            return True
        return False

    def wait(self, timeout: Optional[float] = None) -> int:
        """Blocks until complete (or ``timeout`` seconds: TimeoutError) and returns the number
        of bytes transferred; raises InfinityIOError if the request failed."""
        if not self._finished:
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                slice_s = _WAIT_SLICE_S
                if deadline is not None:
                    slice_s = min(slice_s, max(0.0, deadline - time.monotonic()))
                if self._backend.wait(self._token, slice_s):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"infinity.io: {self._op} of {self._path} at offset "
                        f"{self._offset} not complete after {timeout} s"
                    )
            self._finish()
        if self._error is not None:
            raise self._error
        return self._bytes

    result = wait

    def crc32c(self) -> int:
        """CRC32C (seed 0) of the bytes this request moved, computed by the I/O workers while
        they moved them (pread/pwrite with ``crc=True``). Waits for completion."""
        self.wait()
        if not self._want_crc or self._crc is None:
            raise RuntimeError("this request was not submitted with crc=True")
        return self._crc

    def timing(self) -> Optional[Tuple[float, float, float, float]]:
        """(submitted, first chunk started by a worker, completed, worker seconds spent on
        CRC32C) of a completed request, times on the clock of ``time.perf_counter``; None
        while pending or when the backend does not measure (the Python fallback)."""
        return self._timing if self._finished else None

    @property
    def op(self) -> str:
        return self._op

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __repr__(self) -> str:
        state = "done" if self._finished else "pending"
        return (
            f"IOFuture({self._op} {self._nbytes} bytes of {self._path} at {self._offset}, {state})"
        )

    def __del__(self) -> None:
        # Never let the buffer die under a running transfer.
        if not getattr(self, "_finished", True):
            try:
                while not self._backend.wait(self._token, _WAIT_SLICE_S):
                    pass
                self._finish()
                if self._error is not None:
                    logger.warning(
                        "infinity.io: unobserved error of a dropped IOFuture: %s", self._error
                    )
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def _validate_tensor(tensor: torch.Tensor, offset: int, nbytes: Optional[int], op: str) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{op}: the tensor is on {tensor.device}; file I/O works on host "
            "memory: copy to a pinned host buffer first "
            "(infinity.io.aligned_empty)"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{op}: the tensor is not contiguous; call .contiguous() or use a flat buffer"
        )
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"{op}: offset must be a non-negative int, got {offset!r}")
    total = tensor.numel() * tensor.element_size()
    if nbytes is None:
        return total
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= total:
        raise ValueError(
            f"{op}: nbytes must be an int in [0, {total}] (the tensor's size), got {nbytes!r}"
        )
    return nbytes


class FileHandle:
    """A file for asynchronous reads and writes of CPU tensors, O_DIRECT where possible.

    Modes: "r" read only; "r+" read/write, the file must exist; "w+" read/write, created or
    truncated; "c+" read/write, created if missing, contents kept (in-place updates).

    direct: use O_DIRECT (aligned data never touches the page cache); on a filesystem that
    refuses it (tmpfs) the handle falls back to buffered I/O with one warning per process, and
    ``.direct`` is False. require_direct: raise InfinityIOError instead of falling back.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        mode: str = "r",
        *,
        direct: bool = True,
        require_direct: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.mode = mode
        self._backend = None
        if mode not in _backends.MODES:
            raise ValueError(f"mode must be one of {sorted(_backends.MODES)}, got {mode!r}")
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise io_error(
                _errno.ENOENT, self.path, op="open", detail=f"directory {parent} does not exist"
            )
        code = _backends.MODES[mode]
        lib = native()
        try:
            if lib is not None:
                backend = _backends.NativeBackend(lib, self.path, code, direct or require_direct)
            else:
                backend = _backends.FallbackBackend(self.path, code)
        except _backends.BackendOpenError as exc:
            raise io_error(exc.errno, self.path, op=f"open (mode {mode!r})") from None
        if (direct or require_direct) and not backend.direct:
            if require_direct:
                backend.close()
                why = (
                    "the filesystem does not support O_DIRECT (e.g. tmpfs)"
                    if lib is not None
                    else "the native I/O engine is unavailable"
                )
                raise io_error(
                    _errno.EINVAL,
                    self.path,
                    op="open with O_DIRECT",
                    detail=f"{why}; put the file on a disk-backed filesystem or "
                    "pass require_direct=False",
                )
            if lib is not None:
                _warn_no_direct(self.path)
        self._backend = backend
        self.direct: bool = backend.direct

    # -- I/O -------------------------------------------------------------------------------
    def _submit(
        self,
        op: int,
        tensor: torch.Tensor,
        offset: int,
        nbytes: Optional[int],
        fsync: bool,
        crc: bool = False,
        urgent: bool = False,
    ) -> IOFuture:
        name = "read" if op == _backends.READ else "write"
        n = _validate_tensor(tensor, offset, nbytes, f"FileHandle.p{name}")
        backend = self._require_open(name)
        try:
            token = backend.submit(op, tensor.data_ptr(), n, offset, fsync, crc, urgent)
        except _backends.BackendOpenError as exc:
            raise io_error(exc.errno, self.path, op=name, offset=offset) from None
        return IOFuture(backend, token, tensor, self.path, name, offset, n, crc)

    def pread(
        self,
        tensor: torch.Tensor,
        offset: int = 0,
        nbytes: Optional[int] = None,
        *,
        crc: bool = False,
        urgent: bool = False,
    ) -> IOFuture:
        """Reads ``nbytes`` (default: all of the tensor's bytes) at file ``offset`` into the
        tensor. Reading past the end of the file fails with ENODATA ("short read").
        crc: the workers checksum what they read (``future.crc32c()``), off the caller.
        urgent: queued ahead of the requests that are not (the native backends; a request
        already being transferred finishes the chunks it has started)."""
        return self._submit(_backends.READ, tensor, offset, nbytes, False, crc, urgent)

    def pwrite(
        self,
        tensor: torch.Tensor,
        offset: int = 0,
        nbytes: Optional[int] = None,
        fsync: bool = False,
        *,
        crc: bool = False,
    ) -> IOFuture:
        """Writes the tensor's first ``nbytes`` bytes at file ``offset``. fsync: make the data
        durable (fdatasync) before the future completes. crc: the workers checksum what they
        write (``future.crc32c()``)."""
        return self._submit(_backends.WRITE, tensor, offset, nbytes, fsync, crc)

    def read(self, tensor: torch.Tensor, offset: int = 0, nbytes: Optional[int] = None) -> int:
        """Blocking pread."""
        return self.pread(tensor, offset, nbytes).wait()

    def write(
        self,
        tensor: torch.Tensor,
        offset: int = 0,
        nbytes: Optional[int] = None,
        fsync: bool = False,
    ) -> int:
        """Blocking pwrite."""
        return self.pwrite(tensor, offset, nbytes, fsync).wait()

    # -- file ------------------------------------------------------------------------------
    def _require_open(self, op: str):
        if self._backend is None:
            raise io_error(_errno.EBADF, self.path, op=op)
        return self._backend

    def _call(self, op: str, fn_name: str, *args):
        backend = self._require_open(op)
        try:
            return getattr(backend, fn_name)(*args)
        except _backends.BackendOpenError as exc:
            raise io_error(exc.errno, self.path, op=op) from None

    def size(self) -> int:
        return self._call("size", "size")

    def fsync(self) -> None:
        """fsync(2) of the file (data and metadata); waits for nothing in flight."""
        self._call("fsync", "fsync")

    def truncate(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"truncate: nbytes must be a non-negative int, got {nbytes!r}")
        self._call("truncate", "truncate", nbytes)

    def allocate(self, nbytes: int) -> None:
        """Reserves ``nbytes`` of disk now (posix_fallocate: ENOSPC here, not in a later
        in-place write) and sets the file size to exactly ``nbytes``."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"allocate: nbytes must be a non-negative int, got {nbytes!r}")
        self._call("allocate", "allocate", nbytes)

    def inflight(self) -> int:
        """Requests submitted on this handle and not yet complete."""
        return 0 if self._backend is None else self._backend.inflight()

    @property
    def closed(self) -> bool:
        return self._backend is None

    def close(self) -> None:
        """Waits for the requests in flight, then closes the file. A second close is a no-op;
        futures of this handle stay valid."""
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.close()
            except _backends.BackendOpenError as exc:
                raise io_error(exc.errno, self.path, op="close") from None

    def __enter__(self) -> FileHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - destructor
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("direct" if self.direct else "buffered")
        return f"FileHandle({self.path!r}, mode={self.mode!r}, {state})"


def supports_direct_io(directory: Union[str, os.PathLike]) -> bool:
    """True when files in ``directory`` accept O_DIRECT reads and writes (probed with a
    temporary file, removed afterwards)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise io_error(
            _errno.ENOENT, directory, op="O_DIRECT probe", detail="not an existing directory"
        )
    if not hasattr(os, "O_DIRECT"):
        return False
    fd_tmp, path = tempfile.mkstemp(prefix=".infinity-odirect-", dir=directory)
    os.close(fd_tmp)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == _errno.EINVAL:
                return False
            raise
        try:
            block = mmap.mmap(-1, 4096)  # page-aligned
            block.write(b"\x5a" * 4096)
            try:
                return os.pwrite(fd, block, 0) == 4096 and os.preadv(fd, [block], 0) == 4096
            except OSError as exc:
                if exc.errno == _errno.EINVAL:
                    return False
                raise
            finally:
                block.close()
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
