"""The NVMe tier's side of a step and of the operations that read or rewrite a shard stepped in
units (:class:`.nvme_states.NvmeStates` calls these): first use of a shard, rewriting the
working copy from the committed masters, masters following parameters the user wrote, and the
step itself (the pipeline of :mod:`.swapper`, with what a failure leaves recorded).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from ... import io as inf_io
from ..step.chunks import Unit, gather_unit, home_write_range, piece_window, unit_views
from ..step.shard import Shard, init_states
from .swapper import BufferSets, home_piece, run_pipeline, write_units

if TYPE_CHECKING:  # pragma: no cover
    from ..step.work import StepWork
    from .store import StateStore as NvmeStates  # the NVMe tier's store (.nvme_states)

logger = logging.getLogger(__name__)


def write_whole(store: NvmeStates, shard: Shard, buf: torch.Tensor, doing: str) -> None:
    """Writes one shard's states (its whole layout in ``buf``) and commits them at once
    (first use, load_state_dict, parameters written by the user); on failure nothing is
    committed and the error names the shard and the disk."""
    plan = store.plan(shard)
    tmp = buf if not plan.chunked else inf_io.aligned_empty(plan.buffer_nbytes)

    def prepare(unit: Unit) -> torch.Tensor:
        if plan.chunked:
            gather_unit(unit, buf, tmp)
        return tmp

    store.write_units_and_commit(shard, prepare, doing)
    store.extents.finish(shard)


def init_shard(store: NvmeStates, sets: BufferSets, shard: Shard) -> None:
    """First use of a shard: states from the home copy, written and committed at once, so
    every later step has a committed state to fall back to. A shard stepped in units: the
    master of each unit from the home copy (NVMe homes: the whole pieces covering the unit,
    read into set 0's working-copy buffer; else the working buffer), zero moments, written
    unit by unit."""
    if not store.plan(shard).chunked:
        buf = sets.state_view(0, store, shard)
        init_states(
            shard,
            store.views(shard, buf),
            sets.staging[0]
            if sets.staging[0] is not None and sets.staging_nbytes >= shard.flat.home_nbytes
            else inf_io.aligned_empty(shard.flat.home_nbytes),
        )
        write_whole(store, shard, buf, "initializing")
        shard.initialized = True
        return
    port, flat = shard.port, shard.flat
    h = home_piece(shard)
    home = None if h is not None else port.working.buffer(flat)
    layout = store.layout(shard)
    slots = [(x.offset, x.numel) for x in flat.slots]

    def fill(un: Unit, buf: torch.Tensor) -> None:
        views = unit_views(layout, slots, un, buf)
        if home is not None:
            views.master.copy_(home[un.start : un.end])  # moments: zero (buffer zeroed)
            return
        base, end = piece_window(un.start, un.end, flat.numel, h)
        part = sets.home_view(0, flat, end - base)
        port.working.read_range(flat, base, part)
        views.master.copy_(part[un.start - base : un.end - base])

    write_units(store, shard, sets, fill, "initializing")
    shard.initialized = True


def restore_units(store: NvmeStates, shard: Shard) -> None:
    """Rewrites the working copy of a shard stepped in units from its committed masters,
    through buffer set 0: each unit's committed extent is read and checked, and its masters
    written to the working copy (whole pieces of an NVMe home, the partial one at a unit's end
    finished by the next)."""
    port, flat = shard.port, shard.flat
    sets = store.reserve()
    plan, layout = store.plan(shard), store.layout(shard)
    slots = [(x.offset, x.numel) for x in flat.slots]
    buf = sets.states[0]

    def read(un: Unit) -> None:
        future = store.extents.read_unit(shard, un, buf)
        try:
            future.wait()
        except inf_io.InfinityIOError as exc:
            raise store.extents.wrap_error(exc, shard, "reading") from exc
        store.extents.check_unit(shard, un, future)

    h = home_piece(shard)
    home = None if h is not None else port.working.buffer(flat)
    if h is None and home is None:
        raise RuntimeError(
            f"infinity.optim: {flat.key} is stepped in units but has no "
            "working buffer (a bug in the unit plan)"
        )
    carry: Optional[torch.Tensor] = None  # the start of the piece the next unit finishes
    for un in plan.units:
        read(un)
        master = unit_views(layout, slots, un, buf).master
        if home is not None:
            home[un.start : un.end].copy_(master)
            continue
        base = un.start // h * h
        out = sets.home_view(0, flat, un.end - base)
        if un.start > base:
            out[: un.start - base].copy_(carry)
        out[un.start - base :].copy_(master)
        a, b = home_write_range(un.start, un.end, flat.numel, h)
        if b > a:
            port.working.write_range(flat, a, out[a - base : b - base]).wait()
        carry = out[b - base :].clone() if b < un.end else None


def sync_units(store: NvmeStates, shard: Shard, written: Any) -> None:
    """Masters following the parameters the user wrote, for a shard stepped in units: each
    unit's states are read into buffer set 0 and checked, the masters of the written slots in
    it follow the home's values (read as the whole home pieces covering the unit, or from the
    working buffer), and the new extents are written unit by unit and committed together."""
    port, flat = shard.port, shard.flat
    sets = store.reserve()
    layout = store.layout(shard)
    slots = [(x.offset, x.numel) for x in flat.slots]
    h = home_piece(shard)
    working = None if h is not None else port.working.buffer(flat)
    ranges = [
        (flat.slots[i].offset, flat.slots[i].offset + flat.slots[i].numel) for i in sorted(written)
    ]

    def fill(un: Unit, buf: torch.Tensor) -> None:
        mine = [
            (max(lo, un.start), min(hi, un.end))
            for lo, hi in ranges
            if max(lo, un.start) < min(hi, un.end)
        ]
        if not mine:
            return
        if working is not None:
            home, base = working, 0
        else:
            base, end = piece_window(un.start, un.end, flat.numel, h)
            home = sets.home_view(0, flat, end - base)
            port.working.read_range(flat, base, home)
        master = unit_views(layout, slots, un, buf).master
        for lo, hi in mine:
            new = home[lo - base : hi - base]
            value = master[lo - un.start : hi - un.start]
            changed = new != value.to(flat.home_dtype)
            value.copy_(torch.where(changed, new.float(), value))

    write_units(store, shard, sets, fill, "updating the master weights of", read=True)


def step(store: NvmeStates, shards: List[Shard], work: StepWork) -> None:
    """The step of ``shards`` through the pipeline. After a failure every unit holds its
    states from before or after the step: the shards every unit of which took it are done,
    the others finish it at the next ``opt.step()``; shards whose working copy may have been
    written are rewritten from the committed masters (now, or by the next step)."""
    stats = work.stats
    sets = store.reserve()
    for shard in shards:
        if not shard.initialized:
            init_shard(store, sets, shard)
    computed: List[Shard] = []
    try:
        run_pipeline(
            shards, store, sets, work.apply_unit, store.port.working.staged, stats, computed
        )
    except BaseException as failure:
        for shard in computed:
            work.dirty(shard)
        whole = [s for s in shards if store.extents.fully_stepped(s, len(store.plan(s).units))]
        for shard in whole:  # every unit took the step: done, the retry skips it
            store.finish(shard)
            work.took(shard)
        partial = store.partial
        failure.add_note(
            f"infinity.optim: {len(whole)} of {len(shards)} shards on NVMe took this step "
            f"before it failed, {len(partial)} part way (units committed one by one); the "
            "others kept their states. Call opt.step() again once the cause is fixed: it "
            "finishes this same step (the gradients are kept) for the units that did not "
            "take it, so training continues as if nothing had failed."
        )
        try:
            work.restore()
        except Exception as exc:  # noqa: BLE001 - e.g. the disk is still full
            logger.warning(
                "infinity.optim: could not restore the parameters of %d shards "
                "from their committed states yet (%s); retried at the next "
                "step()",
                work.dirty_count(),
                exc,
            )
            failure.add_note(
                f"The parameters of {work.dirty_count()} shard(s) on NVMe could "
                "not be rewritten from the committed states yet; the next "
                "step() (or restore_parameters()) does it: call it before "
                "reading or running the model."
            )
        raise
    for shard in shards:
        store.finish(shard)
        work.took(shard)
    stats.shards += len(shards)
    stats.params += sum(r.end - r.start for s in shards for r in work.runs_of(s))
