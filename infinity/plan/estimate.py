"""``infinity.estimate``: for each placement and rank count, the bytes per tier, the predicted
step time (from the probe's measurements and the model's shape) and the NVMe bytes per step.

Design notes: docs/modules.md, plan/estimate.py."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..optim.states.swapper import SETS  # the optimizer's buffer sets: its units in flight
from ..policy import CommPolicy
from ..tiers.chunk_size import DEFAULT_CHUNK_BYTES
from ..tiers.pool_plan import MAX_PIECE_BYTES
from .comm import comm_per_step
from .placements import MASTER_BYTES, PLACEMENTS, Candidate, state_bytes_per_param
from .placements import placement as get_placement
from .probe import ProbeResult
from .probe import probe as run_probe
from .results import Estimate, EstimateTable
from .shape import EMBEDDING, HEAD, TIED, ModelShape, describe

# Per block and step when the probe did not measure the engine's fixed costs (an old result).
BLOCK_OVERHEAD_S = 2e-4


def compute_dtype(bytes_per_param: float) -> torch.dtype:
    """The dtype a model whose parameters take this many bytes computes in: its own (2-byte
    homes compute in bf16 or fp16, whose rate the probe measures as bf16)."""
    return torch.bfloat16 if bytes_per_param <= 2 else torch.float32


def model_flops(shape: ModelShape, tokens: int, seq: int) -> float:
    return 6.0 * shape.params * tokens + 12.0 * shape.n_layers * tokens * seq * shape.d_model


def calibrated_compute(shape: ModelShape, batch: int, seq: int, reps: int = 3) -> float:
    """Seconds of forward + backward measured at this model's exact shape: one GPT layer and
    the embeddings + head, timed separately (``layers * layer + head``)."""
    from .probe import measure_gpt_parts

    parts = measure_gpt_parts(
        shape.d_model,
        shape.n_heads or max(1, shape.d_model // 64),
        shape.vocab_size or 50304,
        batch,
        seq,
        reps=reps,
    )
    return shape.n_layers * parts["layer_s"] + parts["head_s"]


def read_by_rows(shape: ModelShape, role: str, tiled_head: bool, embedding_rows: bool) -> bool:
    """Whether the engine reads the outer block of this role in rows (runtime/vocab/rows.py) or
    tiles (runtime/vocab/tiled_head.py) instead of fetching it whole."""
    if role == EMBEDDING:
        return embedding_rows
    if role == HEAD:
        return tiled_head
    return role == TIED and tiled_head and embedding_rows


def fetched_outer_bytes(
    shape: ModelShape, tiled_head: bool = False, embedding_rows: bool = True
) -> int:
    """The largest outer block fetched whole (read neither by rows nor in tiles)."""
    roles = shape.block_roles or ("",) * len(shape.block_bytes)
    return max(
        (
            b
            for b, k, r in zip(shape.block_bytes, shape.kinds, roles)
            if k == "outer" and not read_by_rows(shape, r, tiled_head, embedding_rows)
        ),
        default=0,
    )


def autograd_working_set(
    shape: ModelShape,
    tokens: Optional[int],
    compute_bytes: float,
    *,
    tiled_head: bool = False,
    embedding_rows: bool = True,
    chunk_bytes: Optional[float] = None,
) -> Dict[str, float]:
    """The bytes autograd allocates outside the engine's pools in a training step, by term,
    and their peak (the formula in the module docstring). ``tokens`` None: the batch is not
    known, and the terms that grow with it (activations, logits) are left out."""
    c, d, v = compute_bytes, shape.d_model, shape.vocab_size or 0
    per_batch = tokens is not None
    tokens = tokens or 0
    ffn = shape.ffn or 4 * d
    kv = shape.kv_dim or d
    terms: Dict[str, float] = (
        {}
        if not per_batch
        else {
            "activations": shape.n_layers * tokens * (c * (6 * d + 2 * kv + 4 * ffn) + 8 * d)
            + tokens * d * (4 + 2 * c)
        }
    )
    roles = set(shape.block_roles)
    trained = shape.trainable_params is None  # a frozen base: no embedding or head gradient
    # the head streams in tiles only when its block is read by rows (a tied block: with the
    # embedding read by rows too; otherwise both are fetched whole and the head is plain)
    head_role = HEAD if HEAD in roles else TIED if TIED in roles else ""
    head_tiled = bool(head_role) and read_by_rows(shape, head_role, tiled_head, embedding_rows)
    if v and not head_tiled:
        if per_batch:
            terms["logits"] = 12.0 * v * tokens
        if trained and not shape.tied:
            terms["head_grad"] = float(v * d * c)
    elif v:
        chunk = float(chunk_bytes or DEFAULT_CHUNK_BYTES)
        head_bytes = shape.role_bytes(HEAD) or shape.role_bytes(TIED)
        tile = min(chunk, float(head_bytes) * c / shape.bytes_per_param)
        rows = max(1.0, min(v, chunk // (d * shape.bytes_per_param)))
        terms["head_tile"] = 2 * tile + 12.0 * tokens * rows
    emb_role = TIED if shape.tied else EMBEDDING
    if (
        v
        and trained
        and shape.tied is not None
        and not (emb_role in roles and read_by_rows(shape, emb_role, tiled_head, embedding_rows))
    ):
        terms["embedding_grad"] = float(v * d * c)
    start = (
        terms.get("activations", 0.0)
        + terms.get("logits", 0.0)
        + terms.get("head_grad", 0.0)
        + terms.get("head_tile", 0.0)
        + (terms.get("embedding_grad", 0.0) if shape.tied else 0.0)
    )
    end = terms.get("embedding_grad", 0.0) * (3 if shape.tied else 1)
    terms["peak"] = max(start, end)
    return terms


def _layout(pl: Candidate) -> str:
    if pl.param_tier == "nvme":
        return "nvme"
    return "optim_nvme" if pl.optimizer_tier == "nvme" else "host"


LAYOUT_ORDER = ("host", "optim_nvme", "nvme")  # each does the work of the one before, and more
# NVMe requests per block and step where the probe did not time the engine (a quick probe):
# states read + written; with parameters there also two reads, a gradient and a working copy
REQUESTS_PER_BLOCK = {"host": 0, "optim_nvme": 2, "nvme": 6}


def engine_overhead_s(pl: Candidate, pr: ProbeResult, blocks: int) -> float:
    """The engine's fixed seconds per step for ``blocks`` blocks in this placement's tier
    layout, as the probe measured them (:data:`BLOCK_OVERHEAD_S` per block where it did not:
    a quick probe). A layout costs at least what a layout with less on NVMe measured (noise
    in the tiny timings must not make NVMe look cheaper than RAM)."""
    if pl.plain:
        return 0.0
    layout = _layout(pl)
    latency = (pr.disk.latency_s or 0.0) if pr.disk is not None else 0.0
    best = blocks * (BLOCK_OVERHEAD_S + REQUESTS_PER_BLOCK[layout] * latency)
    found = False
    for name in LAYOUT_ORDER[: LAYOUT_ORDER.index(layout) + 1]:
        if name in pr.overhead or (pr.disk is not None and name in pr.disk.overhead):
            o = pr.engine_overhead(name)
            cost = blocks * o["block_s"] + o["step_s"]
            best = cost if not found else max(best, cost)
            found = True
    return best


def _state_bpp(shape: ModelShape, pl: Candidate, with_master: bool = True) -> float:
    """Optimizer-state bytes per parameter of this placement's format; with "8bit" states the
    safeguards' share (embeddings and tensors under min_8bit_size keep fp32 moments,
    ``shape.full_moment_params``) is counted at the fp32 size."""
    s = state_bytes_per_param(pl.states, with_master, pl.master)
    if pl.states == "8bit" and shape.full_moment_params:
        full = min(1.0, shape.full_moment_params / max(1, shape.params))
        s += full * (state_bytes_per_param("fp32", with_master, pl.master) - s)
    return s


def estimate_one(
    shape: ModelShape,
    pl: Candidate,
    pr: ProbeResult,
    *,
    batch: int,
    seq: int,
    ranks: int = 1,
    prefetch_window: int = 2,
    compute_bytes_per_param: Optional[float] = None,
    compute_s: Optional[float] = None,
    states: Optional[str] = None,
    master: Optional[str] = None,
    chunk_bytes: Optional[int] = None,
    tiled_head: bool = False,
    embedding_rows: bool = True,
    batch_known: bool = True,
    host_blocks: int = 0,
    micro_batches: int = 1,
    layer_major: bool = False,
    activation_tier: str = "host",
) -> Estimate:
    """One placement's bytes per tier and predicted step. ``compute_s``: forward + backward
    seconds timed at this shape (else from the probe's FLOP rate); ``states`` / ``master``:
    the optimizer's moment / master-weight format, overriding the placement's own;
    ``chunk_bytes``: the size of the host buffers swap-file I/O and the optimizer pass
    through (None: the default, 256 MiB): staging, gradient buffers and the optimizer's
    buffer sets are bounded by it, never by the largest block. ``tiled_head`` /
    ``embedding_rows``: as ``wrap()``'s, the LM head streamed in tiles / an untied embedding read
    by rows (neither fetched whole; their gradients never dense): they set the compute buffers
    and the working set autograd allocates outside the engine (``Estimate.working_set``);
    ``batch_known`` False: ``batch``/``seq`` are a guess (``wrap(placement="auto")``), and the
    working set leaves out the terms that grow with the batch. ``host_blocks``: with parameters
    on NVMe, the first blocks (engine order) whose parameters stay on host (``wrap(host_blocks=)``):
    neither read nor written back through the disk; gradients and states keep their tiers.
    ``micro_batches``: k micro-batches of ``batch`` x ``seq`` per optimizer step, run as the
    plain loop (every block read k times in forward and backward, NVMe gradients written k
    times and read back k - 1 times) or, ``layer_major``, as ``infinity.accumulate`` (each block
    read as for one micro-batch, gradients written once; the layers' forward computed again in
    backward; the layer inputs of all k kept in host RAM). ``activation_tier="nvme"`` (as
    ``wrap()``'s): those layer inputs are written to the swap disk as they are made and read
    back in backward; host RAM holds two layers' worth of them."""
    if activation_tier not in ("host", "nvme"):
        raise ValueError(
            f"infinity.estimate: activation_tier must be 'host' or 'nvme', got {activation_tier!r}"
        )
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(
            f"infinity.estimate: micro_batches must be an int >= 1, got {micro_batches!r}"
        )
    if master is not None and master != pl.master:
        if pl.plain:
            raise ValueError(
                "infinity.estimate: the device placement (plain PyTorch) has no "
                "choice of master weights; leave master unset"
            )
        if master not in MASTER_BYTES:
            raise ValueError(
                f"infinity.estimate: master must be one of "
                f"{', '.join(MASTER_BYTES)}, got {master!r}"
            )
        pl = dataclasses.replace(pl, master=master)
    if states is not None and states != pl.states:
        if pl.plain:
            raise ValueError(
                "infinity.estimate: the device placement (plain PyTorch) has no "
                "choice of optimizer states format; leave states unset"
            )
        if states not in ("fp32", "bf16", "8bit"):
            raise ValueError(
                f"infinity.estimate: states must be 'fp32', 'bf16' or '8bit', got {states!r}"
            )
        pl = dataclasses.replace(pl, states=states)
    # parameters this rank steps (grads, states): all of them, or a frozen base's adapters
    n = (shape.params if shape.trainable_params is None else shape.trainable_params) / ranks
    stored = shape.param_bytes if shape.stored_bytes is None else shape.stored_bytes
    pbytes = stored / ranks  # home bytes (a frozen base in its stored format)
    bpp = shape.bytes_per_param
    wbytes = n * bpp  # working copies the optimizer writes back
    cbpp = compute_bytes_per_param or bpp
    k_mb = micro_batches
    tokens = batch * seq
    cuda = pr.device == "cuda"
    mem = pr.mem_bps
    largest = shape.largest_block_params
    layer_bytes = shape.layer_block_bytes * cbpp / bpp
    root_bytes = shape.root_bytes * cbpp / bpp
    # materialized at once: the root block (the whole step), the running block (a layer or
    # an outer block: the embedding, the head) and the layers prefetched or kept around it
    outer_bytes = fetched_outer_bytes(shape, tiled_head, embedding_rows) * cbpp / bpp
    streamed_bytes = max(layer_bytes, outer_bytes)
    window_bytes = root_bytes + streamed_bytes + prefetch_window * layer_bytes
    # read before the first compute: the root and the first block (the embedding's, if any)
    first_bytes = root_bytes + (outer_bytes or layer_bytes)
    compute = (
        compute_s
        if compute_s is not None
        else model_flops(shape, tokens, seq) / pr.flops_at(shape.d_model, compute_dtype(cbpp))
    ) * k_mb
    # layer-major: the layer inputs of every micro-batch (hidden x the compute element size a
    # token), in host RAM, or on the swap disk with two layers' worth in RAM
    boundary = boundaries_on_disk = boundaries_read = 0.0
    if layer_major and not pl.plain:
        # recomputation: the layers' forward once more, a third of their forward + backward
        layers = sum(b for b, kd in zip(shape.block_bytes, shape.kinds) if kd == "layer")
        compute += compute * (layers / max(1, shape.param_bytes)) / 3.0
        one_layer = tokens * k_mb * shape.d_model * float(cbpp)
        boundary = (shape.n_layers + 1) * one_layer
        if activation_tier == "nvme":  # the last one is read by the tail while in RAM
            boundaries_on_disk, boundary = boundary, 2.0 * one_layer
            boundaries_read = shape.n_layers * one_layer
    # boundaries on the swap disk: written in forward, read once in backward
    acts = (
        dict(activations_written=boundaries_on_disk, activations_read=boundaries_read)
        if boundaries_on_disk
        else {}
    )
    if acts and pr.disk is None:
        raise ValueError(
            "infinity.estimate: activation_tier='nvme' needs the disk's figures: pass "
            "nvme_path (probed) or a probe result with a disk"
        )
    blocks = len(shape.block_bytes)
    overhead = engine_overhead_s(pl, pr, blocks)
    adam_rate = pr.adam8_params_per_s if pl.states == "8bit" else pr.adam_params_per_s
    s = _state_bpp(shape, pl)
    fetch = grad = opt = 0.0
    written = overlap_bytes = 0.0
    chunk = float(chunk_bytes or DEFAULT_CHUNK_BYTES)
    work = autograd_working_set(
        shape,
        tokens if batch_known else None,
        cbpp,
        tiled_head=tiled_head,
        embedding_rows=embedding_rows,
        chunk_bytes=chunk,
    )
    categories: Dict[str, float] = {}
    moved: Dict[str, float] = {}
    overlap = compute_overlap(pr)
    if pl.plain:
        device = shape.param_bytes * 2 + 8 * shape.params
        host = nvme = 0.0
        rate = pr.torch_adam_params_per_s or pr.adam_params_per_s
        opt = (
            (28.0 * shape.params / pr.device_mem_bps)
            if cuda and pr.device_mem_bps
            else shape.params / rate
        )
        step = compute + opt
    else:
        if cuda:
            grad = 4.0 * n / (pr.d2h_pinned_bps or mem) * k_mb
        else:
            grad = 12.0 * n / mem * k_mb
        passes = 1 if layer_major else k_mb  # times a step reads each block
        if pl.param_tier == "device":
            device = shape.param_bytes + 4.0 * largest
            host = 4.0 * n + s * n
            nvme = 0.0
            opt = n / adam_rate + ((pbytes / pr.h2d_pinned_bps) if cuda else 2 * pbytes / mem)
        elif pl.param_tier == "host":
            master_in_home = bpp == 4 and pl.optimizer_tier == "host" and pl.master == "fp32"
            device = window_bytes if cuda else 0.0
            host = pbytes + 4.0 * n + boundary
            if cuda:
                fetch = max(0.0, 2 * stored * passes / pr.h2d_pinned_bps - compute)
            copy_back = 0.0 if master_in_home else 2 * wbytes / mem
            if pl.optimizer_tier == "host":
                host += _state_bpp(shape, pl, not master_in_home) * n
                nvme = 0.0
                opt = n / adam_rate + copy_back
            else:
                # elements a buffer set steps at once (each rank steps its part of a block)
                unit = min(largest / ranks, chunk / s)
                host += SETS * unit * s
                categories = _state_categories(pl, s, n, unit)
                nvme = sum(categories.values())
                disk = pr.disk
                moved = dict(states_read=s * n, states_written=s * n)
                io = disk_seconds(moved, disk)
                edge = s * unit / disk.read_bps + s * unit / disk.write_bps
                opt = side_by_side(n / adam_rate + copy_back, io, overlap) + edge
                written = s * n
        else:  # nvme
            # the first host_blocks blocks' parameters stay on host (engine order: layers, outer
            # blocks, the root); the rest live on NVMe
            k = max(0, min(host_blocks, len(shape.block_bytes)))
            scale = pbytes / max(1, shape.param_bytes)  # stored (frozen) or own format
            held = sum(shape.block_bytes[:k]) * scale
            on_disk = pbytes - held
            device = window_bytes
            # the engine's pools and the optimizer's buffer sets, each buffer one chunk (or
            # the largest block when that is smaller): staging (one on a CPU device, where
            # fetches read straight into the compute buffers), window + 2 gradient buffers,
            # 3 sets of one unit's states, gradients and working copy
            staging = (1 if not cuda else min(2, max(1, prefetch_window))) * min(
                chunk, shape.largest_block_bytes / ranks
            )
            grad_bufs = (prefetch_window + 2) * min(chunk, 4.0 * largest)
            unit, set_bytes = nvme_step_set(chunk, largest / ranks, s, bpp)
            host = staging + grad_bufs + SETS * set_bytes + held + boundary
            categories = dict(
                parameters=on_disk, gradients=4.0 * n, **_state_categories(pl, s, n, unit)
            )
            nvme = sum(categories.values())
            overlap_bytes = s * n - categories["spare"]
            disk = pr.disk
            reads = param_reads(shape, k, prefetch_window, tiled_head, embedding_rows)
            moved = nvme_bytes_per_step(
                pl,
                n,
                s,
                reads * scale / ranks * passes,
                wbytes * on_disk / pbytes if pbytes else 0.0,
            )
            if pl.grad_tier == "nvme" and passes > 1:  # each micro-batch's round trip
                moved["grads_written"] *= passes
                moved["grads_read"] *= passes
            moved.update(acts)
            # forward + backward: the reads of the blocks on NVMe and the gradients' writes
            # against compute and the gradients' hand-off (the prefetch window pipelines
            # them); the first block's read comes before any compute
            io_fb = disk_seconds({c: moved.get(c, 0.0) for c in FB_CATEGORIES}, disk)
            first = first_bytes / disk.read_bps if on_disk > 0 else 0.0
            fb = side_by_side(compute + grad, io_fb, overlap)
            fetch = fb - compute - grad + first
            # the optimizer's pipeline, read(i+1) | compute(i) | write(i-1): CPU Adam (and the
            # working copies staged for the file, or copied into the host homes) against the
            # disk, plus the first unit's read and the last one's write. Its updates may also
            # start during backward (gradients and states both on NVMe); that is not
            # credited: on a CPU-only machine the same cores compute, and the fetches use the
            # same disk
            adam = n / adam_rate + 2 * wbytes / mem
            io_opt = disk_seconds({c: moved[c] for c in OPT_CATEGORIES}, disk)
            edge = (s + 4.0) * unit / disk.read_bps + (s + bpp) * unit / disk.write_bps
            opt = side_by_side(adam, io_opt, overlap) + edge
            written = sum(v for c, v in moved.items() if c.endswith("_written"))
        if acts and pl.param_tier != "nvme":  # against forward + backward's compute
            moved.update(acts)
            fetch += side_by_side(compute, disk_seconds(acts, pr.disk), overlap) - compute
            written += boundaries_on_disk
        if acts:
            categories["activations"] = boundaries_on_disk
            nvme += boundaries_on_disk
        step = compute + fetch + grad + opt + overhead
    # autograd's working set outside the engine (plain PyTorch: its gradients are counted)
    if pl.plain:
        work = {k: v for k, v in work.items() if k in ("activations", "logits", "head_tile")}
        work["peak"] = sum(work.values())
    device += work["peak"]
    return Estimate(
        pl.name,
        ranks,
        int(device),
        int(host),
        int(nvme),
        step,
        compute,
        fetch,
        grad,
        opt,
        int(written),
        tokens * k_mb,
        pl.what,
        overhead,
        {k: int(v) for k, v in categories.items()},
        int(overlap_bytes),
        {k: int(v) for k, v in work.items()},
        {k: int(v) for k, v in moved.items()},
    )


# what each phase of a step moves through the disk (the categories of stats()["nvme_per_step"])
FB_CATEGORIES = ("params_read", "grads_written", "activations_read", "activations_written")
OPT_CATEGORIES = ("grads_read", "states_read", "states_written", "params_written")


def param_reads(
    shape: ModelShape, host_blocks: int, window: int, tiled_head: bool, embedding_rows: bool
) -> float:
    """Block bytes a step reads from the parameters' NVMe homes, as the engine fetches them:
    the root once (materialized for the whole step); in forward every block each time it runs
    (a tied embedding and head twice: first and last), but an embedding read by rows; in
    backward the head and the layers again, but the last ``window`` blocks of forward (kept
    for backward, at least one) and the embedding (its backward needs only the indices); a
    head streamed in tiles reads its tiles in both. The first ``host_blocks`` blocks (engine
    order) are on host and read nothing."""
    kinds = shape.kinds
    roles = shape.block_roles or ("",) * len(kinds)
    on_disk = [i >= host_blocks for i in range(len(kinds))]
    layers = [i for i, kd in enumerate(kinds) if kd == "layer"]
    emb = [i for i, r in enumerate(roles) if r in (EMBEDDING, TIED)]
    head = [i for i, r in enumerate(roles) if r in (HEAD, TIED)]
    forward = [(i, EMBEDDING) for i in emb] + [(i, "") for i in layers] + [(i, HEAD) for i in head]
    kept = {i for i, _ in forward[-max(1, window) :]}
    total = 0.0
    for i, use in forward:
        rows = use == EMBEDDING and read_by_rows(shape, roles[i], tiled_head, embedding_rows)
        if on_disk[i] and not rows:
            total += shape.block_bytes[i]
    for i, use in [(i, HEAD) for i in head] + [(i, "") for i in reversed(layers)]:
        tiles = use == HEAD and read_by_rows(shape, roles[i], tiled_head, embedding_rows)
        if on_disk[i] and (tiles or i not in kept):
            total += shape.block_bytes[i]
    root = sum(b for b, k, d in zip(shape.block_bytes, kinds, on_disk) if k == "root" and d)
    return total + root


def nvme_bytes_per_step(
    pl: Candidate, n: float, s: float, reads: float, copies: float
) -> Dict[str, float]:
    """The bytes a step moves through the swap disk, by category, as the engine moves them
    with parameters on NVMe (gradients and states where ``pl`` puts them): the parameter
    reads (:func:`param_reads`), the working copies the optimizer writes back to the blocks
    on NVMe (``copies``), the fp32 gradients written in backward and read by the optimizer,
    the states read and written."""
    moved = {"params_read": reads, "params_written": copies}
    grads = 4.0 * n if pl.grad_tier == "nvme" else 0.0
    moved.update(grads_read=grads, grads_written=grads)
    states = s * n if pl.optimizer_tier == "nvme" else 0.0
    moved.update(states_read=states, states_written=states)
    return moved


def disk_seconds(moved: Dict[str, float], disk: Any) -> float:
    """The disk's time for these bytes: reads and writes share one disk, one after the other
    (a mixed load measured no faster than the two apart: benchmarks/RESULTS.md, bench_nvme_step
    "mixed")."""
    reads = sum(v for c, v in moved.items() if c.endswith("_read"))
    writes = sum(v for c, v in moved.items() if c.endswith("_written"))
    return reads / disk.read_bps + writes / disk.write_bps


def compute_overlap(pr: ProbeResult) -> float:
    """How much of the shorter of a phase's compute and its disk time hides behind the other:
    the probe's measurement (``DiskProbe.compute_overlap``); not measured: none on a CPU
    device, whose cores run both the model and the I/O (its checksums, its page pinning, a
    virtual disk's emulation), full on a GPU."""
    measured = pr.disk.compute_overlap if pr.disk is not None else None
    if measured is not None:
        return float(measured)
    return 1.0 if pr.device == "cuda" else 0.0


def side_by_side(compute_s: float, disk_s: float, overlap: float) -> float:
    """Seconds of a phase that computes ``compute_s`` and moves ``disk_s`` through the disk,
    pipelined: the longer of the two, plus the share of the shorter that does not overlap."""
    return max(compute_s, disk_s) + (1.0 - overlap) * min(compute_s, disk_s)


def nvme_step_set(chunk: float, largest: float, s: float, bpp: float) -> Tuple[float, float]:
    """(elements per unit, bytes per buffer set) of the NVMe step with gradients read from
    NVMe and working copies written there, as the optimizer cuts a shard (optim/step/chunks.py,
    ``NvmeStates.beside``): a unit's states, gradients and working copy fill about a chunk,
    less two whole file pieces (at most 4 MiB, or the chunk) of each on either edge when those
    fit in half of it; the gradient and working-copy windows are the pieces covering the unit,
    never more than the largest block's."""
    grad_piece = min(chunk, MAX_PIECE_BYTES, 4.0 * largest)
    home_piece = min(chunk, MAX_PIECE_BYTES, bpp * largest)
    fixed = 2 * (grad_piece + home_piece)
    usable = chunk - fixed if fixed <= chunk / 2 else chunk
    unit = min(largest, usable / (s + bpp + 4.0))
    if unit >= largest:  # a whole block: no windows beyond it
        return unit, unit * (s + bpp + 4.0)
    return unit, (
        unit * s
        + min(4.0 * largest, 4.0 * unit + 2 * grad_piece)
        + min(bpp * largest, bpp * unit + 2 * home_piece)
    )


def _state_categories(pl: Candidate, s: float, n: float, unit: float) -> Dict[str, float]:
    """The optimizer's swap bytes by category: its master weights, its moments, and the spare:
    the extents of the units in flight (one per buffer set, ``unit`` elements each), written
    before the extents they replace are freed (each unit commits on its own)."""
    master = MASTER_BYTES[pl.master]
    return {"master": master * n, "moments": (s - master) * n, "spare": min(s * n, SETS * unit * s)}


def estimate(
    model_or_count: Union[nn.Module, int, float, str, ModelShape, Any] = None,
    *,
    batch: int = 4,
    seq: int = 128,
    ranks: Union[int, Sequence[int]] = 1,
    placements: Optional[Sequence[str]] = None,
    nvme_path: Optional[str] = None,
    probe: Optional[ProbeResult] = None,
    prefetch_window: int = 2,
    n_layers: Optional[int] = None,
    d_model: Optional[int] = None,
    quick_probe: bool = False,
    calibrate: bool = False,
    master: str = "fp32",
    vocab_size: Optional[int] = None,
    ffn: Optional[int] = None,
    n_heads: Optional[int] = None,
    n_kv_heads: Optional[int] = None,
    tied: Optional[bool] = None,
    head_dim: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    tiled_head: bool = False,
    embedding_rows: bool = True,
    dtype: Optional[torch.dtype] = None,
    frozen_format: Optional[str] = None,
    trainable_params: Optional[int] = None,
    micro_batches: int = 1,
    layer_major: bool = False,
    activation_tier: str = "host",
    link_gbps: Optional[float] = None,
    comm: Union[None, str, CommPolicy] = "int8",
) -> EstimateTable:
    """Predicts, before anything is allocated, what each placement needs and how fast a step
    runs. ``model_or_count``: an nn.Module (built on the meta device is fine); a Hugging Face
    config of a Llama-style decoder (the path of a ``config.json`` or of the model folder, a
    dict or a transformers config: hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, vocab_size, tie_word_embeddings, head_dim), which
    ``d_model``, ``ffn``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``vocab_size``, ``tied``,
    ``head_dim`` override; None with those keywords alone; or a parameter count (``2e9`` or
    ``"2B"``; a GPT shape is assumed, ``n_layers``/``d_model``/``vocab_size`` refine it).
    Configs and counts are in ``dtype`` (default fp32, 4 bytes a parameter, as the model
    built from them; ``torch.bfloat16`` as the weights are published), and a model computes in
    its own dtype at the probe's rate for it.
    ``ranks``: an int N (rows for 1..N ranks) or a list of rank counts. NVMe placements need
    the disk figures: pass ``nvme_path`` (probed) or a ``probe`` result with a disk.
    ``calibrate``: time forward + backward of one layer and of the head at this exact shape
    (seconds for large models) instead of using the probe's FLOP rate. ``master``: the
    optimizer's master-weight format (``AdamW(master=...)``) for every infinity placement.
    ``chunk_bytes``: the engine's chunk (``wrap(chunk_bytes=)``; None: 256 MiB), which bounds
    the host buffers of the NVMe placements. ``tiled_head``, ``embedding_rows``: as ``wrap()``'s
    (see :func:`estimate_one`). ``frozen_format`` ("nf4", "int8"): the base is
    frozen and its layer matrices stored in that format (``wrap(frozen_format=)``): homes and
    fetches count the stored bytes (0.5625 B/param for NF4), gradients and optimizer states
    only ``trainable_params`` (None: a module's ``requires_grad`` parameters; 0 for a config or
    a count: give the adapters' count); the device placements are left out.
    ``micro_batches``, ``layer_major``: k micro-batches of ``batch`` x ``seq`` per optimizer step,
    as the plain loop or as ``infinity.accumulate`` (see :func:`estimate_one`), its layer
    inputs kept on ``activation_tier`` ("host" or "nvme", as ``wrap()``'s).
    ``link_gbps``: the link between ranks in Gb/s; with rank counts above 1, the table's
    ``comm`` lists ZeRO-3's bytes on the wire per rank per step and their time, full width and
    compressed as ``comm`` says (``wrap(comm=...)``; see :mod:`infinity.plan.comm`)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"infinity.estimate: dtype must be a torch.dtype, got {dtype!r}")
    if dtype is not None and isinstance(model_or_count, (nn.Module, ModelShape)):
        raise ValueError(
            "infinity.estimate: dtype describes a config or a parameter count; "
            "a model has its own dtypes (leave dtype out, or cast the model)"
        )
    shape = describe(
        model_or_count,
        n_layers=n_layers,
        d_model=d_model,
        vocab_size=vocab_size,
        ffn=ffn,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        tied=tied,
        head_dim=head_dim,
        bytes_per_param=None if dtype is None else dtype.itemsize,
    )
    if frozen_format is not None:
        from .frozen import frozen_shape

        shape = frozen_shape(shape, frozen_format, model_or_count, trainable_params)
    if (
        isinstance(batch, bool)
        or not isinstance(batch, int)
        or batch <= 0
        or not isinstance(seq, int)
        or seq <= 0
    ):
        raise ValueError(
            f"infinity.estimate: batch and seq must be positive ints, got {batch!r}, {seq!r}"
        )
    pr = (
        probe
        if probe is not None
        else run_probe(nvme_path, quick=quick_probe, announce="infinity.estimate")
    )
    rank_list = list(range(1, ranks + 1)) if isinstance(ranks, int) else list(ranks)
    if not rank_list or any((not isinstance(r, int)) or r < 1 for r in rank_list):
        raise ValueError(f"infinity.estimate: ranks must be >= 1, got {ranks!r}")
    chosen = [get_placement(p) for p in placements] if placements else list(PLACEMENTS)
    notes = []
    caveat = (
        None if calibrate else pr.rate_caveat(shape.d_model, compute_dtype(shape.bytes_per_param))
    )
    if caveat:  # the probe cut this dtype's layer timing short
        notes.append(caveat)
    if frozen_format is not None:
        chosen = [p for p in chosen if not p.plain and p.param_tier != "device"]
        notes.append(
            f"frozen_format={frozen_format!r}: base homes {shape.stored_bytes:,} "
            f"bytes; {shape.trainable_params:,} trainable parameters"
        )
    if pr.disk is None and any(p.uses_nvme for p in chosen):
        notes.append("no nvme_path given: NVMe placements left out (pass nvme_path=...)")
        chosen = [p for p in chosen if not p.uses_nvme]
    if max(rank_list) > 1:
        notes.append(
            "ranks > 1: ZeRO-3 partitioning of homes, gradients and states; "
            "collectives not in the step time (pass link_gbps= for their bytes and time)"
        )
    if shape.full_moment_params and any(p.states == "8bit" for p in chosen):
        notes.append(
            f"8-bit states: {shape.full_moment_params:,} parameters (embeddings, "
            "tensors under 4096 elements) keep fp32 moments (+"
            f"{shape.full_moment_params * 5.97 / 2**30:.2f} GiB over all-8-bit)"
        )
    compute_s = calibrated_compute(shape, batch, seq) if calibrate else None
    if calibrate:
        notes.append("compute timed at this shape (one layer + head)")
    rows = [
        estimate_one(
            shape,
            p,
            pr,
            batch=batch,
            seq=seq,
            ranks=r,
            prefetch_window=prefetch_window,
            compute_s=compute_s,
            master=None if p.plain else master,
            chunk_bytes=chunk_bytes,
            tiled_head=tiled_head,
            embedding_rows=embedding_rows,
            micro_batches=micro_batches,
            layer_major=layer_major,
            activation_tier=activation_tier,
        )
        for r in rank_list
        for p in chosen
        if not (p.plain and r > 1)
    ]
    traffic = []
    if link_gbps is not None and max(rank_list) > 1:
        policy = CommPolicy.parse(comm)
        width = 2 if shape.bytes_per_param <= 2 else 4
        for r in rank_list:
            if r > 1:
                traffic.append(
                    comm_per_step(shape, r, link_gbps, policy, width, micro_batches, layer_major)
                )
                notes.append(str(traffic[-1]))
    return EstimateTable(shape, rows, batch, seq, pr.device, notes, traffic)
