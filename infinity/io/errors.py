"""The one exception type of infinity.io: an OSError carrying errno, path and file offset."""

from __future__ import annotations

import errno as _errno
import os
from typing import Optional

__all__ = ["InfinityIOError", "io_error"]

# What the user can do about each errno; keyed by errno value.
_HINTS = {
    _errno.ENOSPC: "the disk under nvme_path is full: free space or choose another nvme_path",
    _errno.EDQUOT: "the disk quota under nvme_path is exhausted: free space or choose another "
    "nvme_path",
    _errno.EFBIG: "the file size limit was reached (ulimit -f / RLIMIT_FSIZE, or the "
    "filesystem's maximum file size): raise the limit or choose another nvme_path",
    _errno.ENODATA: "the file is shorter than expected (truncated or never completely written): "
    "rewrite it, or read only the bytes it holds",
    _errno.EIO: "the device reported an I/O error: check the disk (dmesg, smartctl)",
    _errno.EBADF: "the file handle is closed: open a new FileHandle",
    _errno.ENOENT: "the file or its directory does not exist: create the directory first",
    _errno.EACCES: "permission denied: choose a writable nvme_path or fix its permissions",
    _errno.EPERM: "operation not permitted: choose a writable nvme_path or fix its permissions",
    _errno.EROFS: "the filesystem is read-only: choose a writable nvme_path",
    _errno.EISDIR: "the path is a directory: give a file path",
    _errno.EINVAL: "invalid argument (O_DIRECT needs a filesystem that supports it)",
}


class InfinityIOError(OSError):
    """An I/O failure of infinity.io, with ``errno``, ``filename`` and ``offset`` (file offset of
    the failure, or None when it is not about a position in the file)."""

    def __init__(
        self, err: int, message: str, filename: Optional[str] = None, offset: Optional[int] = None
    ) -> None:
        super().__init__(err, message, filename)
        self.offset = offset

    def __reduce__(self):  # keep offset across pickling (multiprocessing, subprocess tests)
        return (self.__class__, (self.errno, self.strerror, self.filename, self.offset))


def io_error(
    err: int, path: Optional[str], *, op: str, offset: Optional[int] = None, detail: str = ""
) -> InfinityIOError:
    """Builds an InfinityIOError whose message names the errno, the path, the offset and what
    to do about it."""
    name = _errno.errorcode.get(err, f"errno {err}")
    parts = [f"{name} ({os.strerror(err)}) during {op}"]
    if path is not None:
        parts.append(f"of {path}")
    if offset is not None:
        parts.append(f"at offset {offset}")
    message = " ".join(parts)
    if detail:
        message += f": {detail}"
    hint = _HINTS.get(err)
    if hint:
        message += f". {hint}"
    return InfinityIOError(err, message, path, offset)
