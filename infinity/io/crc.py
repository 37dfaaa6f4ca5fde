"""CRC32C (Castagnoli) of tensors and byte buffers; in the native core AVX-512 VPCLMULQDQ
folding (csrc/crc32c_fold.cpp) or the SSE4.2 crc32 instruction, chosen at run time
(``INFINITY_CRC32C_IMPL=sse42|table`` overrides), a table in Python otherwise. All give the
same value; ``crc32c(b, crc32c(a)) == crc32c(a + b)``."""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

from infinity.io._lib import native

__all__ = ["crc32c", "crc32c_combine"]

BytesLike = Union[torch.Tensor, bytes, bytearray, memoryview, np.ndarray]

_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ (0x82F63B78 if _c & 1 else 0)
    _TABLE.append(_c)
del _i, _c


def _crc32c_python(data: memoryview, seed: int) -> int:
    table = _TABLE
    crc = seed ^ 0xFFFFFFFF
    for byte in data.cast("B") if data.format != "B" else data:
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def _as_uint8(data: BytesLike) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(
                f"crc32c needs a CPU tensor, got one on {data.device}; "
                "copy it to a host buffer first"
            )
        if not data.is_contiguous():
            raise ValueError("crc32c needs a contiguous tensor")
        flat = data.detach().reshape(-1)
        if flat.numel() == 0:
            return np.empty(0, dtype=np.uint8)
        return flat.view(torch.uint8).numpy()
    if isinstance(data, np.ndarray):
        if not data.flags["C_CONTIGUOUS"]:
            raise ValueError("crc32c needs a C-contiguous array")
        return data.reshape(-1).view(np.uint8)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    raise TypeError(f"crc32c takes a tensor or bytes-like object, got {type(data).__name__}")


def crc32c(data: BytesLike, seed: int = 0) -> int:
    """CRC32C of the bytes of ``data``, continuing from ``seed`` (a previous crc32c value)."""
    if not isinstance(seed, int) or not 0 <= seed <= 0xFFFFFFFF:
        raise ValueError(f"seed must be a 32-bit unsigned int, got {seed!r}")
    arr = _as_uint8(data)
    if arr.size == 0:
        return seed
    lib = native()
    if lib is not None:
        return int(lib.inf_crc_crc32c(arr.ctypes.data, arr.size, seed))
    return _crc32c_python(memoryview(arr), seed)


# ---- CRC32C of A + B from the CRCs of A and B ---------------------------------------------
# crc(A + B) = x^(8|B|) * crc(A) ^ crc(B) over GF(2) modulo the (reflected) Castagnoli
# polynomial: zlib's crc32_combine method. Lets a store that reads and writes an extent in
# pieces (each checksummed by the I/O workers) give the CRC of the whole extent.
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) mod P
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x2nmodp(n: int, k: int) -> int:
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of the bytes A + B from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    return _multmodp(_x2nmodp(len_b, 3), crc_a) ^ crc_b
