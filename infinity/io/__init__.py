"""infinity.io: asynchronous O_DIRECT file I/O of CPU tensors, aligned host buffers, CRC32C.

Design notes: docs/modules.md, io/__init__.py."""

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
