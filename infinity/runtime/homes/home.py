"""Homes: where a flat buffer's parameters live between uses, one class per tier.

Design notes: docs/modules.md, runtime/homes/home.py."""

from __future__ import annotations

import logging
from typing import Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import io as inf_io
from ...tiers import ByteBudget, HostPool, SwapStore, Tier
from ...tiers.pool_plan import piece_bytes
from ...tiers.swap_store import IOResult
from ..core.flat import FlatParam
from ..core.stats import Stats

logger = logging.getLogger(__name__)


class Home:
    tier: Tier

    def fill(self, flat: FlatParam) -> None:
        raise NotImplementedError

    def read_into(self, flat: FlatParam, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def write_from(self, flat: FlatParam, src: torch.Tensor) -> None:
        raise NotImplementedError

    def write_slots(self, flat: FlatParam, src: torch.Tensor, slots: Sequence[int]) -> None:
        raise NotImplementedError

    def write_async(self, flat: FlatParam, src: torch.Tensor) -> IOResult:
        """Starts writing a whole updated working copy to a home on NVMe (see
        :meth:`NvmeHome.write_async`)."""
        raise RuntimeError(f"{flat.key}: write_async is only for parameters homed on NVMe")

    def write_range_async(self, flat: FlatParam, start: int, src: torch.Tensor) -> IOResult:
        """Starts writing elements [start, start + len(src)) of an updated working copy to a
        home on NVMe (see :meth:`NvmeHome.write_range_async`)."""
        raise RuntimeError(f"{flat.key}: ranged home writes are only for parameters homed on NVMe")

    def working_buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        return None

    def outside_bytes(self, flat: FlatParam) -> Optional[np.ndarray]:
        return None

    def after_outside_write(self, flat: FlatParam) -> None:
        pass

    def fetch_into(self, flat: FlatParam, dst: torch.Tensor, non_blocking: bool) -> None:
        raise NotImplementedError

    def snapshot(self, flat: FlatParam) -> torch.Tensor:
        out = torch.empty(flat.numel, dtype=flat.home_dtype)
        self.read_into(flat, out)
        return out

    def tier_of(self, flat: FlatParam) -> Tier:
        return self.tier

    def staged(self, flat: FlatParam) -> bool:
        return self.tier_of(flat) is Tier.NVME

    def close(self) -> None:
        pass


def _copy_slots(
    dst: torch.Tensor, src: torch.Tensor, flat: FlatParam, slots: Sequence[int]
) -> None:
    for i in slots:
        s = flat.slots[i]
        dst[s.offset : s.offset + s.numel].copy_(src[s.offset : s.offset + s.numel])


class HostHome(Home):
    """The home is an aligned host buffer (``flat.home``), counted in the host budget. Outside
    forward the parameters view it directly: reads and writes need no transfer."""

    tier = Tier.HOST

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self._held: Dict[str, int] = {}

    def fill(self, flat: FlatParam) -> None:
        self.budget.acquire(flat.home_nbytes, what=f"host copy of {flat.key}")
        self._held[flat.key] = flat.home_nbytes
        flat.home = inf_io.aligned_empty(flat.numel, flat.home_dtype)
        flat.gather_into(flat.home)

    def read_into(self, flat: FlatParam, dst: torch.Tensor) -> None:
        if dst.data_ptr() != flat.home.data_ptr():
            dst.copy_(flat.home)

    def write_from(self, flat: FlatParam, src: torch.Tensor) -> None:
        if src.data_ptr() != flat.home.data_ptr():
            flat.home.copy_(src)

    def write_slots(self, flat: FlatParam, src: torch.Tensor, slots: Sequence[int]) -> None:
        _copy_slots(flat.home, src, flat, slots)

    def working_buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        return flat.home

    def outside_bytes(self, flat: FlatParam) -> Optional[np.ndarray]:
        return flat.home.view(torch.uint8).numpy()

    def fetch_into(self, flat: FlatParam, dst: torch.Tensor, non_blocking: bool) -> None:
        from ...tiers.pinned import (
            upload,  # on CUDA: a DMA from the pinned home, any cast on the GPU
        )

        upload(dst, flat.home, non_blocking)

    def snapshot(self, flat: FlatParam) -> torch.Tensor:
        return flat.home.clone()

    def close(self) -> None:
        for nbytes in self._held.values():
            self.budget.release(nbytes)
        self._held.clear()


def _gather_range(flat: FlatParam, out: torch.Tensor, start: int, end: int) -> None:
    """Elements [start, end) of the flat (its parameters' current values, zeros in the gaps
    and the padding) into ``out`` (home dtype, ``end - start`` elements)."""
    if start == 0 and end == flat.numel:
        flat.gather_into(out)
        return
    out.zero_()
    with torch.no_grad():
        for s in flat.slots:
            a, b = max(start, s.offset), min(end, s.offset + s.numel)
            if a < b:
                # a slot of a ZeRO shard's flat is the part of its parameter from param_start
                first = getattr(s, "param_start", 0) + a - s.offset
                out[a - start : b - start].copy_(
                    s.param.detach().reshape(-1)[first : first + b - a]
                )


class NvmeHome(Home):
    """The home is a swap file of the engine's SwapStore. Outside forward the parameters view a
    shared memory map of that file: a read pages in what it touches (the OS's page cache, not
    the engine's budget), a write reaches the file and is detected by the engine, which then
    re-checksums the file (:meth:`after_outside_write`).

    Every copy that needs host memory passes through the staging pool chunk by chunk: a pool
    buffer is one chunk (``pool.nbytes``), whatever the size of the flat, and each swap file is
    checksummed per piece (a chunk, at most 4 MiB), so a range of whole pieces is read,
    verified and written on its own. A fetch into an aligned CPU buffer of the home's dtype and size (the
    compute buffer on a CPU device) reads straight into it, with no staging."""

    tier = Tier.NVME

    def __init__(self, store: SwapStore, pool: HostPool, stats: Stats) -> None:
        self.store = store
        self.pool = pool
        self.stats = stats
        self.chunk_bytes = pool.nbytes
        self._maps: Dict[str, np.memmap] = {}

    # ---- chunks --------------------------------------------------------------------------
    def chunk_elems(self, flat: FlatParam) -> int:
        """Elements of the home per chunk (per staging buffer)."""
        return self.chunk_bytes // flat.home_itemsize

    def range_elems(self, flat: FlatParam) -> int:
        """The unit of :meth:`write_range_async` in elements (the swap file's checksum piece:
        a chunk, at most 4 MiB; the whole flat when smaller)."""
        return self.store.piece_bytes(flat.key) // flat.home_itemsize

    def _chunks(self, flat: FlatParam) -> Iterator[Tuple[int, int]]:
        per = self.chunk_elems(flat)
        for start in range(0, flat.numel, per):
            yield start, min(flat.numel, start + per)

    @staticmethod
    def _staging(buf: torch.Tensor, flat: FlatParam, numel: int) -> torch.Tensor:
        return buf[: numel * flat.home_itemsize].view(flat.home_dtype)

    def _read_chunk(self, flat: FlatParam, start: int, staging: torch.Tensor) -> None:
        # a fetch (forward, backward or a prefetch for them) or a read for one: ahead of bulk
        # I/O such as the optimizer's states, which an update overlapping backward moves
        self.store.read_at_sync(flat.key, start * flat.home_itemsize, staging, urgent=True)

    # ---- the Home interface ----------------------------------------------------------------
    def fill(self, flat: FlatParam) -> None:
        self.store.create(flat.key, flat.home_nbytes)
        self.store.use_pieces(flat.key, piece_bytes(self.chunk_bytes))
        buf = self.pool.acquire()
        try:
            for start, end in self._chunks(flat):
                staging = self._staging(buf, flat, end - start)
                _gather_range(flat, staging, start, end)
                self.store.write_at(flat.key, start * flat.home_itemsize, staging).wait()
            self.stats.add_moved("host_to_nvme", flat.home_nbytes)
        finally:
            self.pool.release(buf)

    def _read(self, flat: FlatParam, dst: torch.Tensor) -> None:
        """The whole swap file straight into ``dst`` (aligned, home dtype and size)."""
        self.store.read_sync(flat.key, dst, urgent=True)
        self.stats.add_moved("nvme_to_host", flat.home_nbytes)

    @staticmethod
    def _direct(flat: FlatParam, dst: torch.Tensor) -> bool:
        """Whether the swap file can be read straight into ``dst`` (O_DIRECT needs an
        aligned CPU buffer of the home's dtype and size)."""
        return (
            dst.device.type == "cpu"
            and dst.dtype == flat.home_dtype
            and dst.is_contiguous()
            and dst.numel() == flat.numel
            and inf_io.is_aligned(dst)
        )

    def read_into(self, flat: FlatParam, dst: torch.Tensor) -> None:
        if self._direct(flat, dst):
            self._read(flat, dst)
            return
        out = dst.view(-1)
        buf = self.pool.acquire()
        try:
            for start, end in self._chunks(flat):
                staging = self._staging(buf, flat, end - start)
                self._read_chunk(flat, start, staging)
                out[start:end].copy_(staging)
            self.stats.add_moved("nvme_to_host", flat.home_nbytes)
        finally:
            self.pool.release(buf)

    def write_async(self, flat: FlatParam, src: torch.Tensor) -> IOResult:
        """Starts writing a full working copy (home dtype, aligned) to the swap file."""
        future = self.store.write(flat.key, src)
        self.stats.add_moved("host_to_nvme", flat.home_nbytes)
        return future

    def write_range_async(self, flat: FlatParam, start: int, src: torch.Tensor) -> IOResult:
        """Starts writing ``src`` (home dtype, aligned, contiguous) over elements
        [start, start + len(src)) of the home. ``start`` is a multiple of
        :meth:`range_elems`, and the range ends at one or at the end of the flat."""
        if src.dtype != flat.home_dtype:
            raise TypeError(
                f"infinity: {flat.key}: a ranged home write takes the home dtype "
                f"{flat.home_dtype}, got {src.dtype}"
            )
        future = self.store.write_at(flat.key, start * flat.home_itemsize, src)
        self.stats.add_moved("host_to_nvme", src.numel() * flat.home_itemsize)
        return future

    def read_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None:
        """Reads elements [start, start + len(dst)) of the home into ``dst`` (home dtype,
        aligned; whole pieces, as :meth:`write_range_async` writes them), checked against
        their checksums."""
        if dst.dtype != flat.home_dtype:
            raise TypeError(
                f"infinity: {flat.key}: a ranged home read takes the home dtype "
                f"{flat.home_dtype}, got {dst.dtype}"
            )
        self.store.read_at_sync(flat.key, start * flat.home_itemsize, dst)
        self.stats.add_moved("nvme_to_host", dst.numel() * flat.home_itemsize)

    def write_from(self, flat: FlatParam, src: torch.Tensor) -> None:
        if (
            inf_io.is_aligned(src)
            and src.dtype == flat.home_dtype
            and src.numel() == flat.numel
            and src.is_contiguous()
        ):
            self.write_async(flat, src).wait()
            return
        values = src.view(-1)
        buf = self.pool.acquire()
        try:
            for start, end in self._chunks(flat):
                staging = self._staging(buf, flat, end - start)
                staging.copy_(values[start:end])
                self.store.write_at(flat.key, start * flat.home_itemsize, staging).wait()
            self.stats.add_moved("host_to_nvme", flat.home_nbytes)
        finally:
            self.pool.release(buf)

    def write_slots(self, flat: FlatParam, src: torch.Tensor, slots: Sequence[int]) -> None:
        """Only the chunks holding the slots are read, changed and written back."""
        values = src.view(-1)
        ranges = [(flat.slots[i].offset, flat.slots[i].offset + flat.slots[i].numel) for i in slots]
        buf = self.pool.acquire()
        try:
            for start, end in self._chunks(flat):
                parts = [
                    (max(a, start), min(b, end)) for a, b in ranges if max(a, start) < min(b, end)
                ]
                if not parts:
                    continue
                staging = self._staging(buf, flat, end - start)
                self._read_chunk(flat, start, staging)
                self.stats.add_moved("nvme_to_host", staging.numel() * flat.home_itemsize)
                for a, b in parts:
                    staging[a - start : b - start].copy_(values[a:b])
                self.store.write_at(flat.key, start * flat.home_itemsize, staging).wait()
                self.stats.add_moved("host_to_nvme", staging.numel() * flat.home_itemsize)
        finally:
            self.pool.release(buf)

    def outside_bytes(self, flat: FlatParam) -> Optional[np.ndarray]:
        mapped = self._maps.get(flat.key)
        if mapped is None:
            mapped = np.memmap(
                self.store.path(flat.key), dtype=np.uint8, mode="r+", shape=(flat.home_nbytes,)
            )
            self._maps[flat.key] = mapped
        return mapped

    def after_outside_write(self, flat: FlatParam) -> None:
        buf = self.pool.acquire()
        try:
            self.store.rehash(flat.key, buf)  # chunk by chunk through the staging buffer
        finally:
            self.pool.release(buf)

    def fetch_into(self, flat: FlatParam, dst: torch.Tensor, non_blocking: bool) -> None:
        """Reads the swap file chunk by chunk into pinned staging buffers and uploads each on
        the current (transfer) stream. A buffer goes back to the pool once an event recorded
        after its upload has completed: nothing here waits on the GPU, and the next chunk's
        read overlaps the previous chunk's upload when the pool has a second buffer free."""
        from ...tiers.pinned import upload

        if self._direct(flat, dst):  # CPU device: straight from the file into the buffer
            self._read(flat, dst)
            self.stats.add_moved("host_to_device", flat.home_nbytes)
            return
        out = dst.view(-1)
        for start, end in self._chunks(flat):
            buf = self.pool.acquire()
            uploading = False
            try:
                staging = self._staging(buf, flat, end - start)
                self._read_chunk(flat, start, staging)
                self.stats.add_moved("nvme_to_host", staging.numel() * flat.home_itemsize)
                uploading = True
                upload(out[start:end], staging, non_blocking)
            finally:
                event = None
                if uploading and non_blocking and dst.device.type == "cuda":
                    event = torch.cuda.current_stream(dst.device).record_event()
                self.pool.release_after(buf, event)
        self.stats.add_moved("host_to_device", flat.home_nbytes)

    def close(self) -> None:
        self._maps.clear()  # the parameters' views keep their own map alive until replaced


class DeviceHome(Home):
    """The home is the compute buffer itself (``param_tier="device"``): always materialized.
    On a CPU device it is ordinary RAM and the parameters view it outside forward like a host
    home; on CUDA they keep viewing it in device memory."""

    tier = Tier.DEVICE

    def __init__(self, budget: ByteBudget, device: torch.device) -> None:
        self.budget = budget
        self.device = device
        self._held: Dict[str, int] = {}

    def fill(self, flat: FlatParam) -> None:
        self.budget.acquire(flat.compute_nbytes, what=f"{flat.key} on the device")
        self._held[flat.key] = flat.compute_nbytes
        compute = torch.empty(flat.numel, dtype=flat.compute_dtype, device=self.device)
        with torch.no_grad():
            tmp = torch.empty(flat.numel, dtype=flat.home_dtype)
            flat.gather_into(tmp)
            compute.copy_(tmp)
        flat.compute = compute

    def read_into(self, flat: FlatParam, dst: torch.Tensor) -> None:
        dst.copy_(flat.compute)

    def write_from(self, flat: FlatParam, src: torch.Tensor) -> None:
        if src.data_ptr() != flat.compute.data_ptr():
            flat.compute.copy_(src)

    def write_slots(self, flat: FlatParam, src: torch.Tensor, slots: Sequence[int]) -> None:
        _copy_slots(flat.compute, src, flat, slots)

    def working_buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        return flat.compute if flat.compute.device.type == "cpu" else None

    def outside_bytes(self, flat: FlatParam) -> Optional[np.ndarray]:
        if flat.compute.device.type != "cpu":
            return None
        return flat.compute.view(torch.uint8).numpy()

    def fetch_into(self, flat: FlatParam, dst: torch.Tensor, non_blocking: bool) -> None:
        raise RuntimeError(f"{flat.key}: a device-tier block is never fetched")

    def snapshot(self, flat: FlatParam) -> torch.Tensor:
        return flat.compute.detach().to("cpu", flat.home_dtype, copy=True)

    def close(self) -> None:
        for nbytes in self._held.values():
            self.budget.release(nbytes)
        self._held.clear()


class TieredHome(Home):
    """The homes of an engine whose blocks live in more than one tier: one home per tier, each
    flat served by the home of its block's tier (``tier_of``: flat key -> tier). Every call is
    routed as is, so the engine, its optimizer and checkpoints see one Home."""

    tier = None  # type: ignore[assignment]  # per flat: tier_of(flat)

    def __init__(self, homes: Dict[Tier, Home], tier_of: Dict[str, Tier]) -> None:
        missing = sorted({t.value for t in tier_of.values()} - {t.value for t in homes})
        if missing:
            raise ValueError(f"infinity: no home for tier(s) {missing}")
        self.homes = homes
        self._tier_of = tier_of

    def _home(self, flat: FlatParam) -> Home:
        return self.homes[self._tier_of[flat.key]]

    def tier_of(self, flat: FlatParam) -> Tier:
        return self._tier_of[flat.key]

    def staged(self, flat: FlatParam) -> bool:
        return self._home(flat).staged(flat)

    def fill(self, flat: FlatParam) -> None:
        self._home(flat).fill(flat)

    def read_into(self, flat: FlatParam, dst: torch.Tensor) -> None:
        self._home(flat).read_into(flat, dst)

    def write_from(self, flat: FlatParam, src: torch.Tensor) -> None:
        self._home(flat).write_from(flat, src)

    def write_async(self, flat: FlatParam, src: torch.Tensor) -> IOResult:
        home = self._home(flat)
        if self._tier_of[flat.key] is not Tier.NVME:
            raise RuntimeError(f"{flat.key}: write_async is only for parameters homed on NVMe")
        return home.write_async(flat, src)

    def write_range_async(self, flat: FlatParam, start: int, src: torch.Tensor) -> IOResult:
        return self._home(flat).write_range_async(flat, start, src)

    def write_slots(self, flat: FlatParam, src: torch.Tensor, slots: Sequence[int]) -> None:
        self._home(flat).write_slots(flat, src, slots)

    def working_buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        return self._home(flat).working_buffer(flat)

    def outside_bytes(self, flat: FlatParam) -> Optional[np.ndarray]:
        return self._home(flat).outside_bytes(flat)

    def after_outside_write(self, flat: FlatParam) -> None:
        self._home(flat).after_outside_write(flat)

    def fetch_into(self, flat: FlatParam, dst: torch.Tensor, non_blocking: bool) -> None:
        self._home(flat).fetch_into(flat, dst, non_blocking)

    def snapshot(self, flat: FlatParam) -> torch.Tensor:
        return self._home(flat).snapshot(flat)

    def close(self) -> None:
        for home in self.homes.values():
            home.close()


def master_is_home(home: Home, flat: FlatParam) -> bool:
    """fp32 parameters homed in host RAM are their own fp32 master weights."""
    return (
        home.tier_of(flat) is Tier.HOST
        and flat.home is not None
        and flat.home_dtype == torch.float32
    )


__all__ = ["Home", "HostHome", "NvmeHome", "DeviceHome", "TieredHome", "master_is_home"]
