"""infinity.io: asynchronous O_DIRECT file I/O of CPU tensors, aligned host buffers, CRC32C.

    from infinity.io import FileHandle, aligned_empty
    buf = aligned_empty(1 << 20)
    with FileHandle(path, "w+") as f:
        f.pwrite(buf).wait()          # IOFuture.wait() -> bytes, or raises InfinityIOError

The native engine (csrc/aio.cpp) serves requests in chunks on a worker pool, O_DIRECT for the
aligned body and the page cache only for unaligned tails; without the native library (or inside
``infinity._native.force_fallback()``) a pure-Python engine gives the same results.
Settings: :func:`configure` / :func:`get_config` (``backend``: worker threads or io_uring,
:func:`backend_name` tells which is active).
"""

from infinity.io._backends import backend_name
from infinity.io.buffers import ALIGNMENT, aligned_empty, is_aligned
from infinity.io.config import IOConfig, configure, get_config
from infinity.io.crc import crc32c, crc32c_combine
from infinity.io.errors import InfinityIOError
from infinity.io.faults import clear_faults, inject_fault
from infinity.io.handle import FileHandle, IOFuture, supports_direct_io

__all__ = [
    "ALIGNMENT",
    "FileHandle",
    "backend_name",
    "IOConfig",
    "IOFuture",
    "InfinityIOError",
    "aligned_empty",
    "clear_faults",
    "configure",
    "crc32c",
    "crc32c_combine",
    "get_config",
    "inject_fault",
    "is_aligned",
    "supports_direct_io",
]
