"""Quantized homes: frozen parameters of layer blocks stored in a frozen format (NF4, int8)
on their tier, dequantized into the compute buffer at each fetch.

Design notes: docs/modules.md, runtime/homes/quantized.py."""

from __future__ import annotations

import logging
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import io as inf_io
from ...tiers import ByteBudget, HostPool, SwapStore, Tier
from ..core.flat import Binding, FlatParam
from ..core.stats import Stats
from .home import Home
from .quant_format import FrozenFormat

logger = logging.getLogger(__name__)


class QuantFlat(FlatParam):
    """Frozen parameters of one block and dtype, stored in ``fmt``. Each parameter starts on a
    quantization block boundary (its blocks are those bitsandbytes makes of it alone)."""

    def __init__(
        self,
        key: str,
        params: List[tuple],
        home_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: torch.device,
        fmt: FrozenFormat,
    ) -> None:
        super().__init__(key, params, home_dtype, compute_dtype, device, align=fmt.blocksize)
        self.fmt = fmt

    @property
    def home_nbytes(self) -> int:
        return self.fmt.stored_nbytes(self.numel)

    def bind_outside(self, home_bytes: np.ndarray) -> None:
        for s in self.slots:
            s.param.data = torch.full((1,), float("nan"), dtype=self.home_dtype).expand(s.shape)
        self.binding = Binding.OUTSIDE
        self.record_versions()

    def check_frozen(self) -> None:
        for s in self.slots:
            if s.param.requires_grad:
                raise RuntimeError(
                    f"infinity: parameter {s.qualname!r} is stored in {self.fmt.name} (it was "
                    f"frozen at wrap, frozen_format={self.fmt.name!r}) but now requires grad; a "
                    "quantized parameter cannot be trained. Set requires_grad=False on it, or "
                    "unwrap and wrap again with it trainable (or frozen_format=None)"
                )


class QuantizedHome(Home):
    """The home of one tier for a model with quantized frozen parameters (see module doc)."""

    def __init__(
        self,
        inner: Home,
        tier: Tier,
        budget: ByteBudget,
        store: Optional[SwapStore],
        pool: Optional[HostPool],
        stats: Stats,
    ) -> None:
        if tier not in (Tier.HOST, Tier.NVME):
            raise ValueError(
                f"infinity: frozen_format keeps frozen parameters quantized on host "
                f"or NVMe, not on {tier.value!r}; pass param_tier='host' or "
                "'nvme' (or frozen_format=None)"
            )
        self.inner = inner
        self.tier = tier
        self.budget = budget
        self.store = store
        self.pool = pool
        self.stats = stats
        self._held: Dict[str, int] = {}

    # ---- segments ----------------------------------------------------------------------------
    @staticmethod
    def _pieces(flat: QuantFlat, start: int, count: int) -> List[Tuple[torch.Tensor, int]]:
        """Elements [start, start + count) of the flat's parameters as quantizer pieces (see
        ``infinity.ops.quant_pieces``): each parameter's part read in place, in its own dtype,
        followed by the zeros of the gap up to the next parameter (or the end). Parameters start
        on block boundaries, so only the last piece may end mid-block."""
        end = start + count
        parts = []
        for s in flat.slots:
            a, b = max(start, s.offset), min(end, s.offset + s.numel)
            if a < b:
                # a slot of a ZeRO shard's flat is the part of its parameter from param_start
                first = getattr(s, "param_start", 0) + a - s.offset
                parts.append((a, s.param.detach().reshape(-1)[first : first + b - a]))
        parts.sort(key=lambda part: part[0])
        pieces: List[Tuple[torch.Tensor, int]] = []
        if not parts or parts[0][0] > start:  # zeros before the first parameter
            first_at = parts[0][0] if parts else end
            pieces.append((torch.empty(0, dtype=torch.float32), first_at - start))
        for k, (a, values) in enumerate(parts):
            upto = parts[k + 1][0] if k + 1 < len(parts) else end
            pieces.append((values, upto - a))
        return pieces

    def _runs(self, flat: QuantFlat) -> Iterator[List[Tuple[int, int, int, int]]]:
        """Consecutive segments that fit one staging buffer together."""
        per = max(1, self.pool.nbytes // flat.fmt.segment_nbytes)
        run: List[Tuple[int, int, int, int]] = []
        for seg in flat.fmt.segments(flat.numel):
            run.append(seg)
            if len(run) == per:
                yield run
                run = []
        if run:
            yield run

    def _run_span(self, flat: QuantFlat, run) -> Tuple[int, int]:
        first = run[0][3]
        last = run[-1]
        end = last[3] + flat.fmt.segment_nbytes
        return first, min(end, flat.home_nbytes)

    @staticmethod
    def _raw(
        flat: QuantFlat, seg: Tuple[int, int, int, int], buf: torch.Tensor, first: int
    ) -> torch.Tensor:
        """The stored bytes of segment ``seg`` in ``buf``, which holds the home's bytes from
        byte ``first`` on."""
        _, _, count, offset = seg
        return buf[offset - first : offset - first + flat.fmt.raw_nbytes(count)]

    def _write_segments(self, flat: QuantFlat, produce) -> None:
        """Writes every segment's stored bytes, ``produce(seg, out)`` filling ``out`` (uint8,
        raw bytes of the segment)."""
        if self.tier is Tier.HOST:
            for seg in flat.fmt.segments(flat.numel):
                produce(seg, self._raw(flat, seg, flat.home, 0))
            return
        buf = self.pool.acquire()
        try:
            for run in self._runs(flat):
                first, end = self._run_span(flat, run)
                staging = buf[: end - first]
                staging.zero_()
                for seg in run:
                    produce(seg, self._raw(flat, seg, staging, first))
                self.store.write_at(flat.key, first, staging).wait()
                self.stats.add_moved("host_to_nvme", end - first)
        finally:
            self.pool.release(buf)

    def _read_segments(self, flat: QuantFlat, consume) -> None:
        """Calls ``consume(seg, raw)`` for every segment with its stored bytes (verified
        against the swap file's checksums on NVMe)."""
        if self.tier is Tier.HOST:
            for seg in flat.fmt.segments(flat.numel):
                consume(seg, self._raw(flat, seg, flat.home, 0))
            return
        buf = self.pool.acquire()
        try:
            for run in self._runs(flat):
                first, end = self._run_span(flat, run)
                staging = buf[: end - first]
                self.store.read_at_sync(flat.key, first, staging, urgent=True)
                self.stats.add_moved("nvme_to_host", end - first)
                for seg in run:
                    consume(seg, self._raw(flat, seg, staging, first))
        finally:
            self.pool.release(buf)

    # ---- the Home interface -------------------------------------------------------------------
    def fill(self, flat: FlatParam) -> None:
        if not isinstance(flat, QuantFlat):
            self.inner.fill(flat)
            return
        for s in flat.slots:
            if s.trainable:
                raise ValueError(
                    f"infinity: parameter {s.qualname!r} requires grad; only "
                    "frozen parameters are stored quantized (engine bug)"
                )
        nbytes = flat.home_nbytes
        if self.tier is Tier.HOST:
            self.budget.acquire(nbytes, what=f"host copy of {flat.key} ({flat.fmt.name})")
            self._held[flat.key] = nbytes
            flat.home = inf_io.aligned_empty(nbytes, torch.uint8)
            flat.home.zero_()
        else:
            self.store.create(flat.key, nbytes)
            if nbytes > flat.fmt.segment_nbytes:
                self.store.use_pieces(flat.key, flat.fmt.segment_nbytes)

        def produce(seg, out: torch.Tensor) -> None:
            _, start, count, _ = seg
            flat.fmt.quantize_pieces(self._pieces(flat, start, count), out)

        self._write_segments(flat, produce)

    def read_into(self, flat: FlatParam, dst: torch.Tensor) -> None:
        if not isinstance(flat, QuantFlat):
            self.inner.read_into(flat, dst)
            return
        out = dst.view(-1)

        def consume(seg, raw: torch.Tensor) -> None:
            _, start, count, _ = seg
            flat.fmt.dequantize_segment(raw, count, out[start : start + count])

        self._read_segments(flat, consume)

    def _requantize(
        self, flat: QuantFlat, src: torch.Tensor, ranges: Optional[List[Tuple[int, int]]]
    ) -> None:
        """Elements of ``src`` (all, or only ``ranges``) become the stored values again."""
        values = src.reshape(-1)
        if ranges is None:

            def produce(seg, out):
                _, start, count, _ = seg
                flat.fmt.quantize_segment(values[start : start + count], out)

            self._write_segments(flat, produce)
            return
        current = torch.empty(flat.numel, dtype=torch.float32)
        self.read_into(flat, current)
        for a, b in ranges:
            current[a:b].copy_(values[a:b])
        self._requantize(flat, current, None)

    def write_from(self, flat: FlatParam, src: torch.Tensor) -> None:
        if not isinstance(flat, QuantFlat):
            self.inner.write_from(flat, src)
            return
        self._requantize(flat, src, None)

    def write_slots(self, flat: FlatParam, src: torch.Tensor, slots: Sequence[int]) -> None:
        if not isinstance(flat, QuantFlat):
            self.inner.write_slots(flat, src, slots)
            return
        self._requantize(
            flat,
            src,
            [(flat.slots[i].offset, flat.slots[i].offset + flat.slots[i].numel) for i in slots],
        )

    def write_range_async(self, flat: FlatParam, start: int, src: torch.Tensor):
        if isinstance(flat, QuantFlat):
            raise RuntimeError(
                f"infinity: {flat.key} holds frozen parameters stored in "
                f"{flat.fmt.name}; an optimizer never writes it"
            )
        return self.inner.write_range_async(flat, start, src)

    def write_async(self, flat: FlatParam, src: torch.Tensor):
        if isinstance(flat, QuantFlat):
            raise RuntimeError(
                f"infinity: {flat.key} holds frozen parameters stored in "
                f"{flat.fmt.name}; an optimizer never writes it"
            )
        return self.inner.write_async(flat, src)  # type: ignore[attr-defined]

    def working_buffer(self, flat: FlatParam) -> Optional[torch.Tensor]:
        return None if isinstance(flat, QuantFlat) else self.inner.working_buffer(flat)

    def outside_bytes(self, flat: FlatParam) -> Optional[np.ndarray]:
        if isinstance(flat, QuantFlat):
            return np.empty(0, dtype=np.uint8)  # QuantFlat.bind_outside: placeholders
        return self.inner.outside_bytes(flat)

    def after_outside_write(self, flat: FlatParam) -> None:
        if not isinstance(flat, QuantFlat):  # a rebinding is re-quantized by write_slots
            self.inner.after_outside_write(flat)

    def fetch_into(self, flat: FlatParam, dst: torch.Tensor, non_blocking: bool) -> None:
        if not isinstance(flat, QuantFlat):
            self.inner.fetch_into(flat, dst, non_blocking)
            return
        flat.check_frozen()
        out = dst.view(-1)

        def consume(seg, raw: torch.Tensor) -> None:
            _, start, count, _ = seg
            if out.device.type != "cpu":  # uploaded, decoded on the device
                raw = raw.to(out.device, non_blocking=False)
            flat.fmt.dequantize_segment(raw, count, out[start : start + count])

        self._read_segments(flat, consume)
        if self.tier is Tier.NVME:
            self.stats.add_moved("host_to_device", flat.home_nbytes)

    def snapshot(self, flat: FlatParam) -> torch.Tensor:
        if not isinstance(flat, QuantFlat):
            return self.inner.snapshot(flat)
        return super().snapshot(flat)  # read_into a fresh tensor

    def staged(self, flat: FlatParam) -> bool:
        return self.inner.staged(flat)

    def close(self) -> None:
        for nbytes in self._held.values():
            self.budget.release(nbytes)
        self._held.clear()
        self.inner.close()


__all__ = ["QuantFlat", "QuantizedHome"]
