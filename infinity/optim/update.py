"""One shard's (or one unit's) update: the kernels over its runs (:mod:`.kernels`), the working
copy written in the same pass where it can be (the home's working buffer, or the staging
buffer of an NVMe home), else copied from the masters afterwards (a device home), and the
elements no kernel wrote filled so a staged working copy is whole."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .states.store import StateStore
from .step.chunks import Unit, unit_views
from .step.kernels import Window, step_runs
from .step.shard import Run, Shard


def working_out(shard: Shard, staging: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Where the kernel writes the updated working copy (None: copied afterwards)."""
    flat = shard.flat
    if shard.port.working.stages(flat):
        return staging[: flat.home_nbytes].view(flat.home_dtype)
    return shard.port.working.buffer(flat)


def keep_unstepped(
    shard: Shard, written: List[Tuple[int, int]], value: torch.Tensor
) -> torch.Tensor:
    """``value`` (fp32, the whole shard) with the current working copy outside ``written``."""
    keep = torch.ones(shard.flat.numel, dtype=torch.bool)
    for a, b in written:
        keep[a:b] = False
    if not bool(keep.any()):
        return value
    home = torch.empty(shard.flat.numel, dtype=shard.flat.home_dtype)
    shard.port.working.read(shard.flat, home)
    return torch.where(keep, home.float(), value)


def update_shard(
    store: StateStore,
    shard: Shard,
    runs: List[Run],
    hypers: List[Dict[str, Any]],
    buf: torch.Tensor,
    staging: Optional[torch.Tensor],
    grad: Optional[torch.Tensor],
    sr_seed: int,
    element_base: Callable[[torch.Tensor], int],
) -> None:
    """One shard: the kernel of the state format over each run, working copy written in the
    same pass. ``grad``: the shard's gradients when they were read from NVMe (else those in
    RAM); ``hypers[j]``: the kernel's scalars of run j; ``element_base(param)``: the
    stochastic-rounding index of a parameter's first element (bf16 masters).

    fp32 and bf16 moments are element-wise: one kernel call per run of adjacent slots of that
    format (a shard of mixed formats splits a run where the format changes; each format's
    moments sit in its own region, see ``StateLayout``). 8-bit moments are quantized in
    256-element blocks that start at each slot's first element, so the 8-bit kernel runs slot
    by slot over the run's slots: every block it re-quantizes belongs to a slot that takes
    this step, and a slot that does not (no gradient, frozen, not ours) keeps its codes,
    scales and step untouched."""
    flat = shard.flat
    grad = shard.port.grads.in_ram(flat) if grad is None else grad
    views = store.views(shard, buf)
    master, layout = views.master, views.layout
    out = working_out(shard, staging)
    in_place = not layout.with_master  # fp32 home is the master: updated in place
    if in_place:
        out = None
    written = step_runs(
        layout,
        flat.slots,
        runs,
        hypers,
        (0, flat.numel),
        master,
        (grad, 0),
        (out, 0) if out is not None else None,
        {
            f: (m.exp_avg, m.exp_avg_sq, m.exp_avg_absmax, m.exp_avg_sq_absmax)
            for f, m in views.regions.items()
        },
        {f: 0 for f in views.regions},
        0,
        views.master_comp,
        sr_seed,
        lambda i: element_base(flat.slots[i].param),
    )
    # bf16 masters: a slot that did not take this step (frozen, no gradient) keeps its
    # working copy, which need not be its master's value (it was never rounded)
    bf16 = master.dtype != torch.float32
    if out is None and not in_place:  # a device home on CUDA: copied over afterwards
        value = views.master_value()
        if bf16:
            value = keep_unstepped(shard, written, value)
        shard.port.working.write_all(flat, value)
    if shard.port.working.stages(flat):
        # the whole working copy goes to the swap file: fill what the kernels did not
        # write from the masters (home == round(master) holds for every slot; bf16
        # masters: from the home copy where a slot lies in the gap)
        gaps, pos = [], 0
        for start, end in written + [(flat.numel, flat.numel)]:
            if start > pos:
                gaps.append((pos, start))
            pos = end
        home = None
        if bf16 and any(
            s.offset < b and s.offset + s.numel > a for a, b in gaps for s in flat.slots
        ):
            home = torch.empty(flat.numel, dtype=flat.home_dtype)
            shard.port.working.read(flat, home)
        for a, b in gaps:
            out[a:b].copy_(home[a:b] if home is not None else views.master_value(slice(a, b)))


def update_unit(
    store: StateStore,
    shard: Shard,
    runs: List[Run],
    hypers: List[Dict[str, Any]],
    unit: Unit,
    buf: torch.Tensor,
    out: Optional[Window],
    grad: Optional[Window],
) -> None:
    """:func:`update_shard` of one (not whole) unit of an NVMe shard: the same kernels over
    the runs' elements inside ``[unit.start, unit.end)``. Unit boundaries are slot edges or
    256-element block boundaries inside a slot, so an 8-bit slot cut by them is quantized in
    exactly the blocks it has whole; fp32 and bf16 moments are element-wise. Layouts with an
    fp32 master are cut (one format or several, each format's moments in its own region).
    ``out``: (working copy in the home dtype, the element it starts at) where the pipeline
    stages it for an NVMe home (None: the home's working buffer); ``grad``: (fp32 gradients,
    the element they start at) read from NVMe (None: those in RAM)."""
    flat, port = shard.flat, shard.port
    layout = store.layout(shard)
    slots = flat.slots
    views = unit_views(layout, [(x.offset, x.numel) for x in slots], unit, buf)
    g, gb = grad if grad is not None else (port.grads.in_ram(flat), 0)
    if out is None:
        if port.working.stages(flat):
            raise RuntimeError(
                f"infinity.optim: {flat.key} is stepped in units but no "
                "working-copy buffer was given (a bug in the pipeline)"
            )
        out = (port.working.buffer(flat), 0)
    o, ob = out
    if o is None or g is None:
        raise RuntimeError(
            f"infinity.optim: {flat.key} is stepped in units but has no "
            "working buffer to write or no gradients (a bug in the unit "
            "plan)"
        )
    a, b = unit.start, unit.end
    master = views.master
    written = step_runs(
        layout,
        slots,
        runs,
        hypers,
        (a, b),
        master,
        (g, gb),
        (o, ob),
        views.regions,
        views.base,
        unit.blocks[0],
    )
    if port.working.stages(flat):
        at = a  # elements the kernels did not write: the working copy from the master
        for lo, hi in written + [(b, b)]:
            if lo > at:
                o[at - ob : lo - ob].copy_(master[at - a : lo - a])
            at = max(at, hi)
