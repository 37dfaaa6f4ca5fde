"""Wrap-time filling: one home per tier the blocks use, every block's parameters moved into
them streaming (one block's values in RAM at a time; a model on meta made real just before),
the gradient sink, and the model's buffers moved to the device. Transactional: on any error
the model is put back exactly as it was."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ...policy import OffloadPolicy
from ...tiers import ByteBudget, HostPool, SwapStore, Tier
from ..core.block import Block
from ..core.flat import FlatParam
from ..core.stats import Stats
from ..grads.sink import GradientSink
from ..homes.home import DeviceHome, Home, HostHome, NvmeHome, TieredHome
from ..homes.quantized import QuantFlat, QuantizedHome
from ..homes.sources import (
    InitSource,
    ParamSource,
    materialize_meta_buffers,
    param_owners,
    replace_param,
)
from ..step.outside import bind_outside
from .sizes import Sizing


@dataclass
class Filled:
    """What filling made: the homes (one per tier; ``home`` routes each flat to its tier's),
    the swap store and staging pool when some tier is NVMe, and the gradient sink."""

    homes: Dict[Tier, Home]
    home: Home
    store: Optional[SwapStore]
    pool: Optional[HostPool]
    grads: GradientSink


class HomeFiller:
    """Builds the homes of planned blocks and fills them from the model (or its source)."""

    def __init__(
        self,
        model: nn.Module,
        policy: OffloadPolicy,
        source: Optional[ParamSource],
        device: torch.device,
        sizing: Sizing,
        device_budget: ByteBudget,
        stats: Stats,
        swap_tag: str,
    ) -> None:
        self.model = model
        self.policy = policy
        self.source = source
        self.device = device
        self.sizing = sizing
        self.blocks = sizing.blocks
        self.partitioner = sizing.partitioner
        self.host_budget = sizing.host_budget
        self.device_budget = device_budget
        self.stats = stats
        self.swap_tag = swap_tag
        self.store: Optional[SwapStore] = None
        self.pool: Optional[HostPool] = None
        self.homes: Dict[Tier, Home] = {}
        self.home: Optional[Home] = None

    def _make_home(self, tier: Tier) -> Home:
        if tier is Tier.DEVICE:
            return DeviceHome(self.device_budget, self.device)
        if tier is Tier.HOST:
            home: Home = HostHome(self.host_budget)
        else:
            home = NvmeHome(self.store, self.pool, self.stats)
        return self.partitioner.wrap_home(home) if self.partitioner else home

    def _make_homes(self) -> Home:
        """One home per tier the blocks use; with more than one, a TieredHome routes each
        flat to the home of its block's tier."""
        for tier in Tier:
            if any(b.home is tier for b in self.blocks):
                self.homes[tier] = self._make_home(tier)
        routed = dict(self.homes)
        for tier, home in self.homes.items():  # frozen_format: quantized flats of this tier
            if any(
                isinstance(f, QuantFlat) for b in self.blocks if b.home is tier for f in b.flats
            ):
                routed[tier] = QuantizedHome(
                    home, tier, self.host_budget, self.store, self.pool, self.stats
                )
        if len(routed) == 1:
            return next(iter(routed.values()))
        return TieredHome(routed, {f.key: b.home for b in self.blocks for f in b.flats})

    def fill(self) -> Filled:
        """Moves every block's parameters to their home tier. On any error, the model is put
        back exactly as it was (nothing half-wrapped)."""
        originals = [
            (s, s.param, s.param.data if s.param.is_meta else None)
            for b in self.blocks
            for f in b.flats
            for s in f.slots
        ]
        filled: List[FlatParam] = []
        try:
            if any(b.home is Tier.NVME for b in self.blocks) or self.sizing.grad_tier is Tier.NVME:
                self.store = SwapStore(
                    self.policy.nvme_path,
                    require_direct=self.policy.require_direct_io,
                    verify=self.policy.verify_checksums,
                    tag=self.swap_tag,
                )
            plan = self.sizing.pool_plan()
            if plan.staging_bytes:
                # chunk-sized buffers: every flat streams through them chunk by chunk. CPU
                # device with pooled compute buffers: fetches read straight into those, so one
                # staging buffer serves the rest (wrap, partial writes, rehash)
                self.pool = HostPool(plan.staging_count, plan.staging_bytes, self.host_budget)
            self.home = self._make_homes()
            total = sum(b.home_nbytes for b in self.blocks)
            with tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc="infinity: offloading",
                disable=total < (1 << 30),
                leave=False,
            ) as bar:

                def fill(block: Block) -> None:
                    for flat in block.flats:
                        self.home.fill(flat)
                        if self.partitioner is not None:
                            self.partitioner.after_fill(flat)
                        filled.append(flat)
                        self._bind_initial(block, flat)
                        bar.update(flat.home_nbytes)

                self._fill_blocks(fill)
            grads = GradientSink(
                self.sizing.grad_tier,
                self.device,
                self.stats,
                self.host_budget,
                self.store,
                self.sizing.sink_flats(),
                plan.grad_count,
                chunk_bytes=plan.chunk_bytes,
            )
        except BaseException as failure:
            self._unfill(originals, filled, failure)
            for home in self.homes.values():
                home.close()
            if self.home is not None:
                self.home.close()  # a quantized home's budget (closing twice is harmless)
            if self.pool is not None:
                self.pool.close()
            if self.store is not None:
                self.store.close()
            raise
        self._move_buffers()
        return Filled(self.homes, self.home, self.store, self.pool, grads)

    def _fill_blocks(self, fill: Callable[[Block], None]) -> None:
        """Fills every block's home, streaming: one block's values exist in RAM at a time
        (for a model built on meta, the source makes them real just before)."""
        source = self.source
        if source is None:
            for block in self.blocks:
                fill(block)
            return
        materialize_meta_buffers(self.model, source)
        owners, names = param_owners(self.model)
        slot_of = {id(s.param): s for b in self.blocks for f in b.flats for s in f.slots}
        block_of = {id(s.param): b for b in self.blocks for f in b.flats for s in f.slots}
        remaining = {
            b.index: sum(1 for f in b.flats for s in f.slots if s.param.is_meta)
            for b in self.blocks
        }
        done: set = set()
        # Each flat's meta parameters become views of one arena of the flat's size: a single
        # large allocation (mmap'ed, so really returned to the OS once the block is filled and
        # the parameters point at their home), not many small ones that fragment the heap.
        arenas: Dict[int, torch.Tensor] = {}
        flat_of = {id(s.param): f for b in self.blocks for f in b.flats for s in f.slots}

        def place(param: nn.Parameter) -> torch.Tensor:
            slot = slot_of[id(param)]
            flat = flat_of[id(param)]
            arena = arenas.get(id(flat))
            if arena is None:
                arena = arenas[id(flat)] = torch.empty(flat.numel, dtype=flat.home_dtype)
            return arena[slot.offset : slot.offset + slot.numel].view(slot.shape)

        def real(param: nn.Parameter, value: torch.Tensor) -> None:
            slot = slot_of.pop(id(param))
            flat = flat_of.pop(id(param))
            block = block_of.pop(id(param))
            slot.param = replace_param(owners, param, value)
            slot_of[id(slot.param)] = slot
            flat_of[id(slot.param)] = flat
            block_of[id(slot.param)] = block
            remaining[block.index] -= 1

        def fill_ready() -> None:
            for block in self.blocks:
                if block.index not in done and remaining[block.index] == 0:
                    done.add(block.index)
                    fill(block)
                    for flat in block.flats:
                        arenas.pop(id(flat), None)

        if isinstance(source, InitSource):
            fill_ready()  # blocks without meta parameters
            for _, module in self.model.named_modules():
                metas = [p for p in module._parameters.values() if p is not None and p.is_meta]
                for p in metas:
                    real(p, place(p))
                if metas:
                    source.init_module(module)
                    fill_ready()
        else:
            for block in self.blocks:
                for flat in block.flats:
                    for slot in list(flat.slots):
                        p = slot.param
                        if p.is_meta:
                            value = place(p)
                            source.read_into(names.get(id(p), [slot.qualname]), value)
                            real(p, value)
                fill_ready()
        fill_ready()
        source.finish()

    def _unfill(self, originals, filled: List[FlatParam], failure: BaseException) -> None:
        """Wrap failed: puts every parameter back as it was (values read back from the homes
        already filled; meta parameters back on meta)."""
        filled_ids = {id(f) for f in filled}
        by_slot = {id(o[0]): o for o in originals}
        owners, _ = param_owners(self.model)
        for block in self.blocks:
            for flat in block.flats:
                values = None
                if id(flat) in filled_ids:
                    try:
                        values = self.home.snapshot(flat)
                    except BaseException as exc:  # noqa: BLE001
                        failure.add_note(
                            f"infinity.wrap: could not read back {flat.key} to "
                            f"undo the wrap ({exc}); its parameters are lost"
                        )
                for s in flat.slots:
                    original = by_slot[id(s)]
                    if original[2] is not None:  # was on meta: the original Parameter returns
                        if s.param is not original[1]:
                            for module, attr in owners.get(id(s.param), []):
                                module._parameters[attr] = original[1]
                            s.param = original[1]
                    elif values is not None:
                        s.param.data = values[s.offset : s.offset + s.numel].view(s.shape).clone()

    def _bind_initial(self, block: Block, flat: FlatParam) -> None:
        """After fill: resident blocks compute on their home; the others get an (unallocated)
        compute buffer; outside forward every parameter views its home where it can."""
        if block.resident:
            if flat.compute is None:  # host home used in place
                flat.compute = flat.home
        else:
            flat.compute = torch.empty(flat.numel, dtype=flat.compute_dtype, device=self.device)
            flat.free_storage()
        bind_outside(flat, self.home, self.partitioner)

    def _move_buffers(self) -> None:
        if self.device.type == "cpu":
            return
        for module in self.model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != self.device:
                    module._buffers[name] = buf.to(self.device)
