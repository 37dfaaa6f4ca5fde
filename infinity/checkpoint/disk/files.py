"""Checkpoint data files in the safetensors format, written tensor by tensor and read verified.

Design notes: docs/modules.md, checkpoint/disk/files.py."""

from __future__ import annotations

import errno as errno_mod
import json
import math
import os
import struct
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import io as inf_io
from .manifest import CorruptCheckpointError

_ST_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _st in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _ST_NAMES[getattr(torch, _name)] = _st
_ST_DTYPES = {v: k for k, v in _ST_NAMES.items()}

WRITE_CHUNK = 64 << 20  # bytes per write call (and per progress update)
CRC_CHUNK = 64 << 20  # the manifest records a CRC32C per this many bytes of each file it
#                         writes, so a range is verified by reading only the chunks around it

Spec = Tuple[str, torch.dtype, Tuple[int, ...]]


def _write_bytes(fd: int, data: memoryview) -> None:
    """Writes all of ``data`` to ``fd``: the one place checkpoint bytes reach the disk."""
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * _itemsize(dtype)


def _raw(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def aligned_order(specs: Sequence[Spec]) -> List[Spec]:
    """``specs`` with wider dtypes first (stable), so every tensor starts at a multiple of its
    item size in the file (safetensors allows no padding between tensors)."""
    return sorted(specs, key=lambda s: -_itemsize(s[1]))


class TensorFileWriter:
    """One safetensors file, written in the order of ``specs``. ``progress``: a tqdm bar (or
    None) updated with the bytes written."""

    def __init__(
        self,
        path: str,
        specs: Sequence[Spec],
        metadata: Optional[Dict[str, str]] = None,
        progress: Any = None,
    ) -> None:
        header: Dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._pending: List[Tuple[str, torch.dtype, Tuple[int, ...], int]] = []
        for name, dtype, shape in specs:
            if dtype not in _ST_NAMES:
                raise TypeError(
                    f"tensor {name!r} has dtype {dtype}, which safetensors cannot store"
                )
            if name in header:
                raise ValueError(f"tensor name {name!r} appears twice in {path}")
            n = nbytes_of(dtype, shape)
            header[name] = {
                "dtype": _ST_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            self._pending.append((name, dtype, tuple(shape), n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * ((-(8 + len(raw))) % 8)  # data starts 8-byte aligned
        self.path = path
        self.size = 8 + len(raw) + offset
        self.crc = 0
        self.chunk_crcs: List[int] = []  # CRC32C of bytes [k*CRC_CHUNK, (k+1)*CRC_CHUNK)
        self._chunk_crc = 0
        self._pos = 0
        self._progress = progress
        self._next = 0
        self._fd: Optional[int] = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644
        )
        try:
            self._emit(np.frombuffer(struct.pack("<Q", len(raw)) + raw, dtype=np.uint8))
        except BaseException:
            self.abort()
            raise

    def _emit(self, data: np.ndarray) -> None:
        for start in range(0, data.size, WRITE_CHUNK):
            chunk = data[start : start + WRITE_CHUNK]
            _write_bytes(self._fd, memoryview(chunk))
            self.crc = inf_io.crc32c(chunk, self.crc)
            self._chunk_crc_update(chunk)
            if self._progress is not None:
                self._progress.update(chunk.size)

    def _chunk_crc_update(self, data: np.ndarray) -> None:
        while data.size:
            take = min(data.size, CRC_CHUNK - self._pos % CRC_CHUNK)
            self._chunk_crc = inf_io.crc32c(data[:take], self._chunk_crc)
            self._pos += take
            data = data[take:]
            if self._pos % CRC_CHUNK == 0:
                self.chunk_crcs.append(self._chunk_crc)
                self._chunk_crc = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._pending):
            raise ValueError(f"{self.path}: tensor {name!r} was not announced")
        want, dtype, shape, n = self._pending[self._next]
        if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.path}: expected tensor {want!r} {dtype} {shape}, got "
                f"{name!r} {tensor.dtype} {tuple(tensor.shape)}"
            )
        self._emit(_raw(tensor))
        self._next += 1

    def close(self) -> Tuple[int, int]:
        """Fsyncs and closes the file; returns (size, crc32c)."""
        if self._next != len(self._pending):
            missing = [p[0] for p in self._pending[self._next :]]
            raise ValueError(f"{self.path}: tensors {missing[:5]} were announced but not written")
        if self._pos % CRC_CHUNK:
            self.chunk_crcs.append(self._chunk_crc)
            self._chunk_crc = 0
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return self.size, self.crc

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def write_tensor_file(
    path: str,
    items: Iterable[Tuple[str, torch.Tensor]],
    metadata: Optional[Dict[str, str]] = None,
    progress: Any = None,
    chunk_crcs: Optional[List[int]] = None,
) -> Tuple[int, int]:
    """Writes ``items`` (name, tensor) as one safetensors file; returns (size, crc32c) and
    fills ``chunk_crcs`` (when given) with the CRC32C of each CRC_CHUNK of the file."""
    tensors = dict(items)
    specs = aligned_order([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    writer = TensorFileWriter(path, specs, metadata, progress)
    try:
        for name, _, _ in specs:
            writer.write(name, tensors[name])
        done = writer.close()
        if chunk_crcs is not None:
            chunk_crcs.extend(writer.chunk_crcs)
        return done
    except BaseException:
        writer.abort()
        raise


EXTENT_DATA_OFFSET = 4096  # data section of a reused-extent file: page aligned
PAD_PREFIX = "__pad__."  # tensors covering gaps in a reused-extent file; readers skip them
_COPY_FALLBACK = {
    errno_mod.EXDEV,
    errno_mod.ENOSYS,
    errno_mod.EOPNOTSUPP,
    errno_mod.EINVAL,
    errno_mod.EBADF,
}


def _kernel_copy(
    src: int, dst: int, nbytes: int, dst_offset: int, progress: Any, src_offset: int = 0
) -> None:
    """Copies ``nbytes`` from ``src_offset`` of ``src`` to ``dst_offset`` of ``dst`` inside
    the kernel: copy_file_range (a reflink on XFS/btrfs), else sendfile; never through
    Python."""
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < nbytes:
        step = min(nbytes - done, 1 << 30)
        n = 0
        if use_cfr:
            try:
                n = os.copy_file_range(src, dst, step, src_offset + done, dst_offset + done)
            except OSError as exc:
                if exc.errno not in _COPY_FALLBACK:
                    raise
                use_cfr = False
        if not use_cfr:
            os.lseek(dst, dst_offset + done, os.SEEK_SET)
            n = os.sendfile(dst, src, src_offset + done, step)
        if n <= 0:
            raise OSError(errno_mod.EIO, f"the state file ended after {done} of {nbytes} bytes")
        done += n
        if progress is not None:
            progress.update(n)


def write_extent_file(
    path: str,
    src_path: str,
    nbytes: int,
    tensors: Sequence[Tuple[str, torch.dtype, Tuple[int, ...], int]],
    metadata: Optional[Dict[str, str]] = None,
    progress: Any = None,
    src_offset: int = 0,
) -> Tuple[int, int]:
    """A safetensors file whose data section is the ``nbytes`` of ``src_path`` from
    ``src_offset``, copied by the
    kernel: ``tensors`` (name, dtype, shape, byte offset in the data) describe it, gaps and the
    tail are covered by ``__pad__.N`` U8 tensors, the JSON header is padded with spaces so the
    data starts at byte 4096. Returns (file size, CRC32C of the first 4096*k header bytes)."""
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos, pads = 0, 0
    for name, dtype, shape, offset in sorted(tensors, key=lambda t: t[3]):
        if offset < pos or offset % _itemsize(dtype):
            raise ValueError(f"{path}: tensor {name!r} overlaps or is misaligned at {offset}")
        if offset > pos:
            header[f"{PAD_PREFIX}{pads}"] = {
                "dtype": "U8",
                "shape": [offset - pos],
                "data_offsets": [pos, offset],
            }
            pads += 1
        end = offset + nbytes_of(dtype, shape)
        header[name] = {
            "dtype": _ST_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        pos = end
    if pos > nbytes:
        raise ValueError(f"{path}: tensors end at {pos}, past the {nbytes} bytes of the data")
    if pos < nbytes:
        header[f"{PAD_PREFIX}{pads}"] = {
            "dtype": "U8",
            "shape": [nbytes - pos],
            "data_offsets": [pos, nbytes],
        }
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    start = -(-(8 + len(raw)) // EXTENT_DATA_OFFSET) * EXTENT_DATA_OFFSET
    raw += b" " * (start - 8 - len(raw))
    head = np.frombuffer(struct.pack("<Q", len(raw)) + raw, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_bytes(fd, memoryview(head))
        src = os.open(src_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            _kernel_copy(src, fd, nbytes, start, progress, src_offset)
        finally:
            os.close(src)
        os.fsync(fd)
    finally:
        os.close(fd)
    return start + nbytes, inf_io.crc32c(head)


class TensorFile:
    """A verified safetensors file held in memory: ``get(name)`` gives a tensor over its bytes."""

    def __init__(
        self, path: str, label: str, buf: np.ndarray, header: Dict[str, Any], data_start: int
    ) -> None:
        self.path = path
        self.label = label
        self._buf = buf
        self._header = header
        self._start = data_start

    def names(self) -> List[str]:
        return [k for k in self._header if k != "__metadata__"]

    def __contains__(self, name: str) -> bool:
        return name != "__metadata__" and name in self._header

    def get(self, name: str) -> torch.Tensor:
        info = self._header[name]
        dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = info["shape"]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_numpy(self._buf[self._start + begin : self._start + end])
        if (self._start + begin) % _itemsize(dtype):
            raw = raw.clone()  # not aligned for a view
        return raw.view(dtype).view(shape)


def read_tensor_file(
    path: str,
    label: str,
    size: Optional[int] = None,
    crc: Optional[int] = None,
    parts: Sequence[Tuple[int, int, int]] = (),
) -> TensorFile:
    """Reads ``path`` and checks it against the manifest's ``size`` and ``crc`` (of the whole
    file) or ``parts`` ((start, end, crc32c) of byte ranges covering it) before parsing;
    errors name ``label`` (the file's name in the checkpoint) and the path."""
    try:
        actual = os.path.getsize(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint file {label} is missing ({path})") from None
    if size is not None and actual != size:
        raise CorruptCheckpointError(
            f"checkpoint file {label} has {actual:,} bytes but the "
            f"manifest recorded {size:,} ({path}): it is truncated or "
            "was replaced"
        )
    buf = np.empty(actual, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        done = 0
        while done < actual:
            n = f.readinto(view[done:])
            if not n:
                raise CorruptCheckpointError(f"checkpoint file {label} ended early ({path})")
            done += n
    covered = 0
    for start, end, part_crc in parts:
        if start != covered or end > actual or inf_io.crc32c(buf[start:end]) != part_crc:
            crc = -1  # reported below
            break
        covered = end
    else:
        if parts and covered != actual:
            crc = -1
    if crc is not None and (crc < 0 or (not parts and inf_io.crc32c(buf) != crc)):
        raise CorruptCheckpointError(
            f"checkpoint file {label} is corrupted: its CRC32C does "
            f"not match the manifest ({path}). Restore it from a copy "
            "or use another checkpoint"
        )
    try:
        (hlen,) = struct.unpack("<Q", buf[:8].tobytes())
        header = json.loads(buf[8 : 8 + hlen].tobytes().decode("utf-8"))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"checkpoint file {label} is not a valid safetensors file ({path}): {exc}"
        ) from None
    start = 8 + hlen
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if info["dtype"] not in _ST_DTYPES or not 0 <= begin <= end <= actual - start:
            raise CorruptCheckpointError(
                f"checkpoint file {label}: entry {name!r} is invalid ({path})"
            )
    return TensorFile(path, label, buf, header, start)


class RangedFile:
    """Element ranges of the tensors of one checkpoint file, read chunk by chunk: only the
    CRC_CHUNK-sized chunks around a range are read (``os.pread``), each checked against the
    CRC32C the manifest recorded for it before its bytes are used; the last chunk is kept for
    the next range. The header is parsed from the chunks that hold it."""

    def __init__(
        self, path: str, label: str, size: int, chunk_bytes: int, chunk_crcs: Sequence[int]
    ) -> None:
        self.path, self.label, self.size = path, label, size
        self.chunk_bytes, self.chunk_crcs = chunk_bytes, list(chunk_crcs)
        try:
            actual = os.path.getsize(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint file {label} is missing ({path})") from None
        if actual != size:
            raise CorruptCheckpointError(
                f"checkpoint file {label} has {actual:,} bytes but the "
                f"manifest recorded {size:,} ({path}): it is truncated "
                "or was replaced"
            )
        if len(self.chunk_crcs) != -(-size // chunk_bytes):
            raise CorruptCheckpointError(
                f"checkpoint file {label}: the manifest's chunk checksums do not cover the file"
            )
        self._last: Optional[Tuple[int, np.ndarray]] = None
        (hlen,) = struct.unpack("<Q", self._bytes(0, 8).tobytes())
        if not 0 < hlen <= size - 8:
            raise CorruptCheckpointError(
                f"checkpoint file {label} is not a valid safetensors file ({path})"
            )
        self._header = json.loads(self._bytes(8, 8 + hlen).tobytes().decode("utf-8"))
        self._start = 8 + hlen

    def _chunk(self, k: int) -> np.ndarray:
        if self._last is not None and self._last[0] == k:
            return self._last[1]
        lo = k * self.chunk_bytes
        n = min(self.chunk_bytes, self.size - lo)
        buf = np.empty(n, dtype=np.uint8)
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            done = 0
            while done < n:
                got = os.preadv(fd, [memoryview(buf)[done:]], lo + done)
                if got <= 0:
                    raise CorruptCheckpointError(
                        f"checkpoint file {self.label} ended early ({self.path})"
                    )
                done += got
        finally:
            os.close(fd)
        if inf_io.crc32c(buf) != self.chunk_crcs[k]:
            raise CorruptCheckpointError(
                f"checkpoint file {self.label} is corrupted: the CRC32C of its bytes "
                f"[{lo:,}, {lo + n:,}) does not match the manifest ({self.path}). Restore it "
                "from a copy or use another checkpoint"
            )
        self._last = (k, buf)
        return buf

    def _bytes(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty(hi - lo, dtype=np.uint8)
        pos = lo
        while pos < hi:
            k = pos // self.chunk_bytes
            chunk = self._chunk(k)
            base = k * self.chunk_bytes
            take = min(hi, base + chunk.size) - pos
            out[pos - lo : pos - lo + take] = chunk[pos - base : pos - base + take]
            pos += take
        return out

    def __contains__(self, name: str) -> bool:
        return name != "__metadata__" and name in self._header

    def elements(self, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of tensor ``name`` (flattened)."""
        info = self._header.get(name)
        if info is None or name == "__metadata__" or info.get("dtype") not in _ST_DTYPES:
            raise CorruptCheckpointError(
                f"checkpoint file {self.label} has no tensor {name!r} ({self.path})"
            )
        dtype = _ST_DTYPES[info["dtype"]]
        size = _itemsize(dtype)
        begin, end = info["data_offsets"]
        if not (0 <= a <= b and begin + b * size <= end):
            raise CorruptCheckpointError(
                f"checkpoint file {self.label}: {name!r} holds no elements [{a}, {b}) ({self.path})"
            )
        if b == a:
            return torch.empty(0, dtype=dtype)
        raw = self._bytes(self._start + begin + a * size, self._start + begin + b * size)
        return torch.from_numpy(raw).view(dtype)
