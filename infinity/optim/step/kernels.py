"""The one place the CPU Adam kernel is chosen over master and moment formats, and the walk of
a shard's runs (or of one unit of it) that calls it.

:func:`adam_kernel` picks the kernel of one call: bf16 masters (``bf16_sr``/``bf16_kahan``:
:func:`~infinity.ops.bf16_master.cpu_adam_step_bf16_master`, any moment format), else by the
moment format (fp32 :func:`~infinity.ops.cpu_adam_step`, bf16
:func:`~infinity.ops.cpu_adam_step_bf16_moments`, 8-bit :func:`~infinity.ops.cpu_adam_step_8bit`).
:func:`step_runs` cuts a shard's runs into those calls: fp32 and bf16 moments are element-wise,
one call per run of adjacent slots of one format (the padding between them included); 8-bit
moments are quantized in 256-element blocks that start at each slot's first element, and bf16
masters hash each slot's rounding from its own element base, so those go slot by slot: every
block re-quantized belongs to a slot that takes the step.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...ops import cpu_adam_step, cpu_adam_step_8bit, cpu_adam_step_bf16_moments
from ...ops.adam_compact import BLOCK_SIZE, num_blocks
from ...ops.bf16_master import cpu_adam_step_bf16_master

# one format's moments: (exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax); the absmax
# scales only for 8-bit codes
Region = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]
Window = Tuple[torch.Tensor, int]  # (tensor, the shard element its first element is)


def adam_kernel(
    fmt: str,
    master: torch.Tensor,
    grad: torch.Tensor,
    moments: Region,
    out: Optional[torch.Tensor],
    comp: Optional[torch.Tensor] = None,
    seed: int = 0,
    index: int = 0,
    **hyper: Any,
) -> None:
    """One kernel call over 1-D views: ``master`` (fp32, or bf16 with ``comp`` for Kahan
    pairs), ``grad`` (fp32), the moments in format ``fmt`` and ``out`` (the working copy
    written in the same pass, or None). ``seed``/``index``: the stochastic rounding's hash
    of bf16 masters (ignored otherwise)."""
    m, v, m_abs, v_abs = moments
    if master.dtype != torch.float32:  # bf16 masters: their own kernel, any moment format
        absmax = dict(exp_avg_absmax=m_abs, exp_avg_sq_absmax=v_abs) if fmt == "8bit" else {}
        cpu_adam_step_bf16_master(
            master, comp, grad, m, v, states=fmt, **absmax, seed=seed, index=index, out=out, **hyper
        )
    elif fmt == "fp32":
        cpu_adam_step(master, grad, m, v, out=out, **hyper)
    elif fmt == "bf16":
        cpu_adam_step_bf16_moments(master, grad, m, v, out=out, **hyper)
    elif fmt == "8bit":
        cpu_adam_step_8bit(master, grad, m, m_abs, v, v_abs, out=out, **hyper)
    else:
        raise ValueError(f"infinity.optim: unknown state format {fmt!r}")


def step_runs(
    layout: Any,
    slots: Sequence[Any],
    runs: Sequence[Any],
    hypers: Sequence[Dict[str, Any]],
    window: Tuple[int, int],
    master: torch.Tensor,
    grad: Window,
    out: Optional[Window],
    regions: Dict[str, Region],
    base: Dict[str, int],
    block0: int = 0,
    comp: Optional[torch.Tensor] = None,
    seed: int = 0,
    element_base: Optional[Callable[[int], int]] = None,
) -> List[Tuple[int, int]]:
    """Steps the elements of ``runs`` inside ``window`` = [a, b) (the whole shard, or one
    unit); returns the ranges written, in order.

    ``master`` (and ``comp``) start at element a; ``grad``/``out``: (tensor, its first
    element); ``regions[fmt]``: that format's moments starting at region element
    ``base[fmt]``, their 8-bit scales at block ``block0``; ``slots``: the flat's slots
    (``offset``, ``numel``); ``hypers[j]``: the kernel's scalars of run j;
    ``element_base(i)``: slot i's stochastic-rounding index (bf16 masters)."""
    a, b = window
    g, gb = grad
    o, ob = out if out is not None else (None, 0)
    per_slot_master = master.dtype != torch.float32
    written: List[Tuple[int, int]] = []

    def pos(i: int) -> int:  # slot i's first element in its format's region
        return layout.slot_pos[i] if layout.mixed else slots[i].offset

    def call(
        fmt: str,
        lo: int,
        hi: int,
        p: int,
        scales: Tuple[Optional[torch.Tensor], ...],
        hyper: Dict[str, Any],
        index: int,
    ) -> None:
        m, v = regions[fmt][0], regions[fmt][1]
        adam_kernel(
            fmt,
            master[lo - a : hi - a],
            g[lo - gb : hi - gb],
            (m[p : p + hi - lo], v[p : p + hi - lo]) + scales,
            o[lo - ob : hi - ob] if o is not None else None,
            comp[lo - a : hi - a] if comp is not None else None,
            seed=seed,
            index=index,
            **hyper,
        )
        written.append((lo, hi))

    for j, r in enumerate(runs):
        if min(r.end, b) <= max(r.start, a):
            continue
        hyper = hypers[j]
        for fmt, first, last in layout.split(r.first, r.last):
            if per_slot_master or fmt == "8bit":
                for i in range(first, last + 1):
                    s = slots[i]
                    lo, hi = max(s.offset, a), min(s.offset + s.numel, b)
                    if lo >= hi:
                        continue
                    scales: Tuple[Optional[torch.Tensor], ...] = (None, None)
                    if fmt == "8bit":
                        b0 = layout.block_start[i] + (lo - s.offset) // BLOCK_SIZE - block0
                        nb = num_blocks(hi - lo)
                        m_abs, v_abs = regions[fmt][2], regions[fmt][3]
                        scales = (m_abs[b0 : b0 + nb], v_abs[b0 : b0 + nb])
                    index = element_base(i) if per_slot_master and element_base else 0
                    call(fmt, lo, hi, pos(i) + (lo - s.offset) - base[fmt], scales, hyper, index)
                continue
            # one call over the sub-run, the padding between its slots included
            start = slots[first].offset
            lo = max(start, a)
            hi = min(slots[last].offset + slots[last].numel, b)
            if lo < hi:
                call(fmt, lo, hi, pos(first) + (lo - start) - base[fmt], (None, None), hyper, 0)
    return written
