"""The NVMe tier: one swap file per key under a private directory of the user's nvme_path."""
from __future__ import annotations

import errno as errno_mod
import logging
import os
import shutil
import tempfile
import threading
import uuid
import warnings
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .. import io as inf_io

logger = logging.getLogger(__name__)

_DIR_PREFIX = "infinity-swap-"


class SwapCorruptionError(RuntimeError):
    """A swap file's content does not match the checksum recorded when it was written."""


@dataclass
class _Entry:
    handle: "inf_io.FileHandle"
    nbytes: int
    crc: Optional[int] = None
    pending_write: Optional["inf_io.IOFuture"] = None  # its CRC becomes ``crc`` once done
    last_read: Optional[tuple] = None  # (buffer address, future) of the latest read


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def validate_nvme_path(path: str) -> str:
    """Checks that ``path`` is an existing, writable directory; returns its absolute form."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"nvme_path must be a path string, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"nvme_path {path!r} does not exist; create the directory "
                                "(on a local NVMe/SSD filesystem) or pass another path")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"nvme_path {path!r} is not writable by this process; "
                              "fix its permissions or choose another directory")
    return path


class SwapStore:
    """Deterministic file per key (``<nvme_path>/infinity-swap-<pid>-<id>/<key>.swp``).

    Every write records a CRC32C of the bytes; every read verifies it (``verify=True``), so a
    corrupted or truncated swap file raises SwapCorruptionError instead of feeding garbage to
    training. The checksums are computed by the I/O workers chunk by chunk while they move the
    data, so they overlap the transfer instead of costing the caller a pass. The private directory is removed on close; directories left by dead processes
    (killed mid-run) are removed when the next store opens under the same nvme_path.
    """

    def __init__(self, nvme_path: str, *, require_direct: bool = False, verify: bool = True):
        base = validate_nvme_path(nvme_path)
        self._cleanup_stale(base)
        self.directory = os.path.join(base, f"{_DIR_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.directory)
        self.verify = verify
        self._require_direct = require_direct
        self._entries: Dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.direct = self._probe_direct(require_direct)

    # ---- setup -------------------------------------------------------------------------
    @staticmethod
    def _cleanup_stale(base: str) -> None:
        for name in os.listdir(base):
            if not name.startswith(_DIR_PREFIX):
                continue
            try:
                pid = int(name[len(_DIR_PREFIX):].split("-")[0])
            except ValueError:
                continue
            if pid != os.getpid() and not _pid_alive(pid):
                logger.info("removing stale swap directory %s left by dead process %d", name, pid)
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)

    def _probe_direct(self, require_direct: bool) -> bool:
        direct = inf_io.supports_direct_io(self.directory)
        if not direct and require_direct:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise OSError(errno_mod.EINVAL,
                          f"the filesystem under {self.directory!r} does not support O_DIRECT "
                          "(tmpfs?); put nvme_path on a real disk, or pass "
                          "require_direct_io=False to accept buffered I/O through the page cache")
        if not direct:
            warnings.warn(f"infinity: the filesystem under {self.directory!r} does not support "
                          "O_DIRECT; swap I/O goes through the page cache (slower, and it takes "
                          "RAM). Put nvme_path on a real disk for full speed.", RuntimeWarning,
                          stacklevel=4)
        return direct

    # ---- keys ----------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key)
        return os.path.join(self.directory, f"{safe}.swp")

    def create(self, key: str, nbytes: int) -> None:
        """Creates the key's file with ``nbytes`` preallocated (ENOSPC is raised here, up front)."""
        if self._closed:
            raise RuntimeError("SwapStore is closed")
        if key in self._entries:
            raise KeyError(f"swap key {key!r} already exists")
        if nbytes % inf_io.ALIGNMENT:
            raise ValueError(f"swap extent for {key!r} must be a multiple of "
                             f"{inf_io.ALIGNMENT} bytes, got {nbytes}")
        handle = inf_io.FileHandle(self._path(key), "w+", require_direct=self._require_direct)
        try:
            handle.allocate(nbytes)
        except BaseException:
            handle.close()
            raise
        self._entries[key] = _Entry(handle=handle, nbytes=nbytes)

    def nbytes(self, key: str) -> int:
        return self._entry(key).nbytes

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no swap file for key {key!r}") from None

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    # ---- I/O -----------------------------------------------------------------------------
    def _check_buffer(self, key: str, buf: torch.Tensor, entry: _Entry) -> None:
        nbytes = buf.numel() * buf.element_size()
        if nbytes != entry.nbytes:
            raise ValueError(f"swap buffer for {key!r} has {nbytes} bytes, the file holds "
                             f"{entry.nbytes}")

    def write(self, key: str, buf: torch.Tensor) -> "inf_io.IOFuture":
        """Starts writing ``buf`` (all of it) to the key's file; its CRC (computed by the I/O
        workers) is recorded when the write completes."""
        entry = self._entry(key)
        self._check_buffer(key, buf, entry)
        future = entry.handle.pwrite(buf, 0, crc=self.verify)
        entry.crc = None
        entry.pending_write = future if self.verify else None
        return future

    @staticmethod
    def _settle(entry: _Entry) -> None:
        """Takes the checksum of the entry's last write (waits for it; a failed write leaves
        no valid checksum, so a later read of that content is refused)."""
        future, entry.pending_write = entry.pending_write, None
        if future is not None:
            try:
                entry.crc = future.crc32c()
            except (OSError, RuntimeError):
                entry.crc = None

    def write_sync(self, key: str, buf: torch.Tensor) -> None:
        self.write(key, buf).wait()

    def read(self, key: str, buf: torch.Tensor) -> "inf_io.IOFuture":
        entry = self._entry(key)
        self._check_buffer(key, buf, entry)
        self._settle(entry)
        future = entry.handle.pread(buf, 0, crc=self.verify)
        entry.last_read = (buf.data_ptr(), future) if self.verify else None
        return future

    def verify_read(self, key: str, buf: torch.Tensor) -> None:
        """Checks a completed read of ``key`` into ``buf`` against the recorded checksum."""
        entry = self._entry(key)
        if not self.verify:
            return
        self._settle(entry)
        if entry.crc is None:
            raise SwapCorruptionError(f"swap file {self._path(key)!r} holds no completed write "
                                      "(never written, or its last write failed)")
        last, entry.last_read = entry.last_read, None
        if last is not None and last[0] == buf.data_ptr():
            crc = last[1].crc32c()  # computed by the I/O workers during the read
        else:
            crc = inf_io.crc32c(buf)
        if crc != entry.crc:
            raise SwapCorruptionError(
                f"swap file {self._path(key)!r} is corrupted: CRC32C {crc:#010x} does not match "
                f"{entry.crc:#010x} recorded when it was written; the disk or another process "
                "changed it. Training cannot continue from it; restart from a checkpoint")

    def read_sync(self, key: str, buf: torch.Tensor) -> None:
        self.read(key, buf).wait()
        self.verify_read(key, buf)

    def path(self, key: str) -> str:
        self._entry(key)
        return self._path(key)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for entry in self._entries.values():
            entry.handle.close()
        self._entries.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __del__(self) -> None:  # best effort; Engine.close() is the real owner
        try:
            self.close()
        except Exception:
            pass


def default_swap_root() -> str:
    return tempfile.gettempdir()
