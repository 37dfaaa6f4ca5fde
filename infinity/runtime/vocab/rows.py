"""Embedding row fetch: an ``nn.Embedding`` whose block lives on the host or NVMe tier reads
only the rows its batch looks up, and its lookup gradient is row-sparse.

Design notes: docs/modules.md, runtime/vocab/rows.py."""

from __future__ import annotations

import logging
import types
from typing import Callable, Dict, Optional, Protocol, Tuple

import torch
from torch import nn

from ...tiers import Tier
from ..core.block import Block
from ..core.flat import FlatParam
from ..core.registry import locate
from ..core.residency import Residency
from ..process.compile_guard import eager_only


class RowReader(Protocol):
    """What the row reads need (runtime/step/row_hooks.py): the homes, the swap store, the stats,
    the device, the chunk, and where gradient rows and tile reads go."""

    homes: Dict[Tier, object]
    store: object
    stats: object
    device: torch.device
    chunk_bytes: int

    def add_row_grads(self, block: Block, rows: torch.Tensor, values: torch.Tensor) -> None: ...

    def read_head_tile(
        self, block: Block, weight: torch.Tensor, r0: int, r1: int
    ) -> torch.Tensor: ...


logger = logging.getLogger(__name__)


def _plain_embedding(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and module.max_norm is None
    )


def eligible(
    block: Block, sharded: bool, head: Optional[nn.Module] = None, embeddings: bool = True
) -> bool:
    """Whether ``block`` is read by rows (see the module docstring): each of its modules is a
    plain embedding, or ``head`` (the LM head tiled over its vocabulary, tiled_head.py)."""
    if block.is_root or block.kind != "outer" or block.home is Tier.DEVICE or sharded:
        return False
    if len(block.flats) != 1 or len(block.flats[0].slots) != 1:
        return False
    if type(block.flats[0]) is not FlatParam:  # stored in another format (a quantized home)
        return False
    if block.flats[0].slots[0].attr != "weight" or block.flats[0].slots[0].param.dim() != 2:
        return False
    return all(
        (embeddings and _plain_embedding(m)) or (head is not None and m is head)
        for m in block.modules
    )


# ---- reading rows ----------------------------------------------------------------------------
def _read_rows_nvme(
    engine: RowReader, flat: FlatParam, rows: torch.Tensor, width: int
) -> torch.Tensor:
    """Rows ``rows`` (sorted, distinct) of the flat's only slot, read from its swap file piece
    by piece: only the pieces that hold a part of one of them."""
    home = engine.homes[Tier.NVME]
    base = flat.slots[0].offset
    piece = home.range_elems(flat)
    out = torch.empty(rows.numel(), width, dtype=flat.home_dtype)
    starts = base + rows * width  # first element of each row in the flat
    first = torch.div(starts, piece, rounding_mode="floor").tolist()
    last = torch.div(starts + width - 1, piece, rounding_mode="floor").tolist()
    pieces = sorted({k for a, b in zip(first, last) for k in range(a, b + 1)})
    itemsize = flat.home_itemsize
    buf = home.pool.acquire()
    nread = 0
    try:
        starts_l = starts.tolist()
        j0 = 0  # first row that may still overlap the current piece (rows are sorted)
        for k in pieces:
            ps, pe = k * piece, min(flat.numel, (k + 1) * piece)
            staging = buf[: (pe - ps) * itemsize].view(flat.home_dtype)
            engine.store.read_at_sync(flat.key, ps * itemsize, staging, urgent=True)
            nread += (pe - ps) * itemsize
            while j0 < len(starts_l) and starts_l[j0] + width <= ps:
                j0 += 1
            j = j0
            while j < len(starts_l) and starts_l[j] < pe:
                s = starts_l[j]
                a, b = max(ps, s), min(pe, s + width)
                out[j, a - s : b - s].copy_(staging[a - ps : b - ps])
                j += 1
    finally:
        home.pool.release(buf)
    engine.stats.add_moved("nvme_to_host", nread)
    engine.stats.rows_read_bytes += nread
    return out


def _read_span_nvme(engine: RowReader, flat: FlatParam, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of the flat, read from its swap file: the pieces holding them."""
    home = engine.homes[Tier.NVME]
    piece = home.range_elems(flat)
    itemsize = flat.home_itemsize
    out = torch.empty(end - start, dtype=flat.home_dtype)
    buf = home.pool.acquire()
    nread = 0
    try:
        for k in range(start // piece, (end - 1) // piece + 1):
            ps, pe = k * piece, min(flat.numel, (k + 1) * piece)
            staging = buf[: (pe - ps) * itemsize].view(flat.home_dtype)
            engine.store.read_at_sync(flat.key, ps * itemsize, staging, urgent=True)
            nread += (pe - ps) * itemsize
            a, b = max(ps, start), min(pe, end)
            out[a - start : b - start].copy_(staging[a - ps : b - ps])
    finally:
        home.pool.release(buf)
    engine.stats.add_moved("nvme_to_host", nread)
    engine.stats.rows_read_bytes += nread
    return out


def read_row_span(
    engine: RowReader, block: Block, weight: torch.Tensor, r0: int, r1: int
) -> torch.Tensor:
    """Rows [r0, r1) of the block's table (a tile of an LM head), in the compute dtype on the
    engine's device."""
    flat = block.flats[0]
    width = weight.shape[1]
    if block.state in (Residency.RESIDENT, Residency.ON_DEVICE):
        return weight.detach()[r0:r1].to(engine.device, flat.compute_dtype)
    if block.home is Tier.HOST:
        values = flat.home_view(0)[r0:r1]
        engine.stats.rows_read_bytes += values.numel() * values.element_size()
    else:
        base = flat.slots[0].offset
        values = _read_span_nvme(engine, flat, base + r0 * width, base + r1 * width).view(
            r1 - r0, width
        )
    return values.to(engine.device, flat.compute_dtype)


def read_rows(
    engine: RowReader, block: Block, weight: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Rows ``rows`` (sorted, distinct, on the CPU) of the block's table, in the compute dtype
    on the engine's device."""
    flat = block.flats[0]
    width = weight.shape[1]
    if block.state in (Residency.RESIDENT, Residency.ON_DEVICE):
        values = weight.detach().index_select(0, rows.to(weight.device))
    elif block.home is Tier.HOST:
        values = flat.home_view(0).index_select(0, rows)
        engine.stats.rows_read_bytes += values.numel() * values.element_size()
    else:
        values = _read_rows_nvme(engine, flat, rows, width)
    return values.to(engine.device, flat.compute_dtype)


# ---- the lookup ------------------------------------------------------------------------------
class RowLookup(torch.autograd.Function):
    """``embedding(indices, weight)`` from the looked-up rows only, with a row-sparse gradient
    for ``weight`` (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        weight: torch.Tensor,
        rows: torch.Tensor,
        values: torch.Tensor,
        inverse: torch.Tensor,
        padding_idx: Optional[int],
        scale_grad_by_freq: bool,
        deliver: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, inverse)
        ctx.weight_meta = (weight.shape, weight.dtype)
        ctx.deliver = deliver
        ctx.padding_idx = padding_idx
        ctx.scale_grad_by_freq = scale_grad_by_freq
        return torch.nn.functional.embedding(inverse, values)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        rows, inverse = ctx.saved_tensors
        shape, dtype = ctx.weight_meta
        padding = -1
        if ctx.padding_idx is not None:
            hit = (rows == ctx.padding_idx).nonzero()
            padding = int(hit[0, 0]) if hit.numel() else -1
        values = torch.ops.aten.embedding_dense_backward(
            grad_out, inverse, rows.numel(), padding, ctx.scale_grad_by_freq
        )
        # straight to the gradient tier, in the dtype computed (a bf16 home computing in fp32
        # keeps fp32 gradients, as when the table is fetched whole); autograd gets no rows
        if ctx.needs_input_grad[0]:
            ctx.deliver(rows, values)
        return empty_grad(shape, dtype), None, None, None, None, None, None


def empty_grad(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A parameter's gradient as autograd sees it when its rows went to the gradient tier
    directly (runtime/vocab/rows.py, tiled_head.py): no rows. Its arrival (summed with the other
    uses' of a tied parameter) tells the engine that the parameter's backward is over."""
    return torch.sparse_coo_tensor(
        torch.zeros(1, 0, dtype=torch.int64),
        torch.zeros(0, shape[1], dtype=dtype),
        shape,
        is_coalesced=True,
        check_invariants=False,
    )


@eager_only  # a compiled model runs it eagerly between its graphs (compile_guard.py)
def forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    """The row-fetching forward of a wrapped embedding (bound to the module as its
    ``forward``); a module not (or no longer) wrapped runs the plain lookup."""
    loc = locate(self.weight)
    if loc is None or not getattr(loc.block, "row_lookup", False):
        return nn.Embedding.forward(self, input)
    return loc.engine.rows.lookup_rows(loc.block, self, input)


def lookup(
    engine: RowReader, block: Block, module: nn.Embedding, input: torch.Tensor
) -> torch.Tensor:
    """The lookup itself (the engine holds its lock around it)."""
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"infinity: embedding {block.name!r} takes integer indices, got {input.dtype}"
        )
    flat = block.flats[0]
    weight = flat.slots[0].param
    num = weight.shape[0]
    indices = input.detach().reshape(-1).to("cpu", torch.int64)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num):
        raise IndexError(
            f"infinity: embedding {block.name!r}: index out of range "
            f"[0, {num}) (min {int(indices.min())}, max {int(indices.max())})"
        )
    rows, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    values = read_rows(engine, block, weight, rows)
    engine.stats.rows_lookups += 1
    inverse = inverse.to(values.device).view(input.shape)
    return RowLookup.apply(
        weight,
        rows,
        values,
        inverse,
        module.padding_idx,
        module.scale_grad_by_freq,
        lambda r, v: engine.add_row_grads(block, r, v),
    )


class RowForward:
    """The handle of an installed row-fetching forward: ``remove()`` restores the class's."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        module.forward = types.MethodType(forward, module)

    def remove(self) -> None:
        if "forward" in self.module.__dict__:
            del self.module.__dict__["forward"]
