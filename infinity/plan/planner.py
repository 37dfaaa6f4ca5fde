"""The planner: ``infinity.wrap(model, placement="auto")`` picks where parameters, gradients and
optimizer states live, the prefetch window and the buffer counts, from the budgets and rates.

Design notes: docs/modules.md, plan/planner.py."""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from typing import Any, Dict, List, Optional, Tuple, Union

import psutil
from torch import nn

from ..policy import OffloadPolicy, check_nvme_path
from ..tiers.chunk_size import resolve_chunk_bytes
from .estimate import compute_dtype, compute_overlap, estimate_one, model_flops
from .placements import PLACEMENTS, Candidate
from .probe import ProbeResult
from .probe import probe as run_probe
from .results import Estimate, Plan
from .shape import ModelShape, describe
from .units import fmt_bytes, fmt_s

logger = logging.getLogger(__name__)

RAM_SHARE = 0.7  # of the available RAM, when no host_budget is given
DEVICE_SHARE = 0.9  # of a GPU's memory, when no device_budget is given
DISK_MARGIN = 0.95  # of the free disk space the swap files may take
MAX_WINDOW = 4
DEFAULT_BATCH = (4, 128)  # batch x seq of the speed prediction when plan() is not told
_DEFAULT_WINDOW = OffloadPolicy().prefetch_window


WHO = "infinity planner"  # how the planner names itself when it has to probe


class PlanError(ValueError):
    """No placement fits the budgets (the message names what is short, by how many bytes).
    ``disk``: True when what is short is the free space at nvme_path."""

    def __init__(self, message: str, disk: bool = False) -> None:
        super().__init__(message)
        self.disk = disk


def budgets(
    policy: OffloadPolicy, pr: ProbeResult, ram_share: float = RAM_SHARE
) -> Dict[str, Optional[int]]:
    host = policy.host_budget
    if host is None:
        host = int(ram_share * psutil.virtual_memory().available)
    if pr.device == "cuda":
        device = policy.device_budget or int(DEVICE_SHARE * (pr.device_memory_bytes or 0))
    else:
        device = policy.device_budget or host  # the device tier is the same RAM
    disk = shutil.disk_usage(policy.nvme_path).free if policy.nvme_path else None
    return {"device": device, "host": host, "disk": disk}


def _window(shape: ModelShape, pr: ProbeResult, pl: Candidate, batch: int, seq: int) -> int:
    """Enough blocks in flight that a block's read from NVMe hides behind the compute of the
    blocks before it (at least 1, at most MAX_WINDOW)."""
    if pl.param_tier != "nvme" or pr.disk is None:
        return _DEFAULT_WINDOW
    per_block_compute = (
        model_flops(shape, batch * seq, seq)
        / pr.flops_at(shape.d_model, compute_dtype(shape.bytes_per_param))
        / max(1, len(shape.block_bytes))
    )
    per_block_read = shape.layer_block_bytes / pr.disk.read_bps
    return max(1, min(MAX_WINDOW, math.ceil(per_block_read / max(per_block_compute, 1e-9)) + 1))


def _fits(e: Estimate, pl: Candidate, b: Dict[str, Optional[int]], cuda: bool) -> str:
    """'' when it fits, else why not."""
    if cuda:
        if e.device_bytes > b["device"]:
            return f"device needs {fmt_bytes(e.device_bytes)} > {fmt_bytes(b['device'])}"
        if e.host_bytes > b["host"]:
            return f"host needs {fmt_bytes(e.host_bytes)} > {fmt_bytes(b['host'])}"
    elif e.device_bytes + e.host_bytes > b["host"]:
        return f"RAM needs {fmt_bytes(e.device_bytes + e.host_bytes)} > {fmt_bytes(b['host'])}"
    elif e.device_bytes > b["device"]:  # a device_budget given on a CPU-only machine
        return f"device needs {fmt_bytes(e.device_bytes)} > {fmt_bytes(b['device'])}"
    if pl.uses_nvme:
        if b["disk"] is None:
            return "no nvme_path"
        if e.nvme_bytes > DISK_MARGIN * b["disk"]:
            return (
                f"disk needs {fmt_bytes(e.nvme_bytes)} > {fmt_bytes(DISK_MARGIN * b['disk'])}"
                f" ({DISK_MARGIN:.0%} of the free space)"
            )
    return ""


def _host_part(e: Estimate, cuda: bool) -> int:
    """What a placement takes from the host budget (on a CPU the device tier is RAM too)."""
    return e.host_bytes if cuda else e.host_bytes + e.device_bytes


def _split(
    shape: ModelShape,
    pr: ProbeResult,
    nvme_pl: Candidate,
    e_nvme: Estimate,
    w: int,
    b: Dict[str, Optional[int]],
    cuda: bool,
    batch: int,
    seq: int,
    k_given: Optional[int] = None,
    **layout: Any,
) -> Optional[Tuple[Candidate, Estimate, int]]:
    """ "The first K blocks' parameters on host, the rest on NVMe" (gradients and states as in
    ``nvme_pl``), K as large as the host budget holds after what the NVMe placement needs; None
    when not even one block fits (or all do: then a host placement is the one to compare).
    Estimated as the engine runs it (``estimate_one(host_blocks=K)``): the host blocks' fetches
    and working copies skip the disk, their gradients and states do not.
    ``k_given``: the user's host_blocks (estimated as given, fitting or not)."""
    if k_given is not None:
        k = min(k_given, len(shape.block_bytes))
        held = sum(shape.block_bytes[:k])
    else:
        room = b["host"] - _host_part(e_nvme, cuda)
        if cuda and b["device"] is not None and e_nvme.device_bytes > b["device"]:
            return None
        k, held = 0, 0
        for nbytes in shape.block_bytes[:-1]:  # engine order: layers, outer blocks, the root
            if held + nbytes > room:
                break
            k, held = k + 1, held + nbytes
        if k >= len(shape.block_bytes):
            return None
    if k == 0:
        return None
    n = len(shape.block_bytes)
    name = f"{nvme_pl.name}+host{k}"
    pl = dataclasses.replace(
        nvme_pl,
        name=name,
        what=(
            f"parameters of the first {k} of {n} blocks on host, the rest on NVMe; gradients on "
            f"{nvme_pl.grad_tier}, optimizer states on {nvme_pl.optimizer_tier}"
        ),
    )
    e = estimate_one(
        shape, pl, pr, batch=batch, seq=seq, prefetch_window=w, host_blocks=k, **layout
    )
    return pl, e, k


def plan(
    model: Union[nn.Module, ModelShape, int, float],
    policy: Optional[OffloadPolicy] = None,
    *,
    probe: Optional[ProbeResult] = None,
    states: str = "fp32",
    batch: Optional[int] = None,
    seq: Optional[int] = None,
    ram_share: float = RAM_SHARE,
    **settings: Any,
) -> Plan:
    """The placement ``wrap(model, placement="auto", ...)`` would use, with its reasons.
    ``states``: the optimizer's moment format you will use ("fp32", "bf16", "8bit");
    ``batch``/``seq``: the step the predictions are for. Given both, the activations and
    logits of that step are counted in the RAM a placement needs; left out (None, as
    ``wrap`` plans: it does not know the batch), the speed is predicted for 4 x 128 tokens
    and only the working set that does not grow with the batch is counted."""
    batch_known = batch is not None and seq is not None
    batch = DEFAULT_BATCH[0] if batch is None else batch
    seq = DEFAULT_BATCH[1] if seq is None else seq
    if policy is None:
        policy = OffloadPolicy(**settings)
    elif settings:
        raise TypeError("pass either policy= or keyword settings, not both")
    shape = describe(
        model,
        block_rule=policy.block_rule,
        param_persistence_threshold=policy.param_persistence_threshold,
    )
    if policy.frozen_format is not None:  # homes in the stored format, the adapters trained
        from .frozen import frozen_shape

        shape = frozen_shape(
            shape,
            policy.frozen_format,
            model,
            None,
            policy.block_rule,
            policy.param_persistence_threshold,
        )
    # no cached probe: a quick one, announced with its accuracy (a warning)
    pr = probe if probe is not None else run_probe(policy.nvme_path, quick=True, announce=WHO)
    if policy.nvme_path is not None and pr.disk is None:
        pr = run_probe(policy.nvme_path, quick=True, announce=WHO)
    cuda = pr.device == "cuda"
    b = budgets(policy, pr, ram_share)
    explicit = {
        k: getattr(policy, k)
        for k in ("param_tier", "grad_tier", "optimizer_tier")
        if getattr(policy, k) != "auto"
    }
    given_k = policy.host_blocks or None
    if given_k:  # the user's split: parameters on NVMe but for the first blocks
        explicit.setdefault("param_tier", "nvme")
    pool: List[Candidate] = []
    for pl in PLACEMENTS:
        if pl.plain or pl.states != "fp32":
            continue
        if not cuda and pl.param_tier == "device":
            continue  # on a CPU the device tier is the host RAM: "host" is the same, in place
        if policy.frozen_format is not None and pl.param_tier == "device":
            continue  # a quantized base lives on host or NVMe
        pl = dataclasses.replace(pl, states=states)
        if any(getattr(pl, k) != v for k, v in explicit.items()):
            continue
        pool.append(pl)
    if not pool:  # an explicit combination none of the named placements has: honour it
        t = {k: explicit.get(k, "host") for k in ("param_tier", "grad_tier", "optimizer_tier")}
        pool.append(
            Candidate(
                "custom", t["param_tier"], t["grad_tier"], t["optimizer_tier"], states, "as set"
            )
        )
    # how the engine lays out the step: the chunk its pools use (the one wrap derives from the
    # same chunk_bytes and host_budget), the head and embedding reads
    chunk = resolve_chunk_bytes(policy.chunk_bytes, policy.host_budget, "infinity.plan")
    layout = dict(
        chunk_bytes=chunk,
        tiled_head=policy.tiled_head,
        embedding_rows=policy.embedding_rows,
        batch_known=batch_known,
    )
    rows = []
    splits = {}  # placement name -> host_blocks
    for pl in pool:
        w = (
            policy.prefetch_window
            if policy.prefetch_window != _DEFAULT_WINDOW
            else _window(shape, pr, pl, batch, seq)
        )
        if pl.uses_nvme and pr.disk is None:
            rows.append((pl, None, w, "no nvme_path"))
            continue
        e = estimate_one(shape, pl, pr, batch=batch, seq=seq, prefetch_window=w, **layout)
        while True:
            why = _fits(e, pl, b, cuda)
            if not why or w <= 1 or pl.param_tier != "nvme":
                break
            w -= 1  # a smaller window may fit where a deeper one does not
            e = estimate_one(shape, pl, pr, batch=batch, seq=seq, prefetch_window=w, **layout)
        rows.append((pl, e, w, why))
        if (
            pl.param_tier == "nvme"
            and e is not None
            and (
                given_k or ("param_tier" not in explicit and policy.host_blocks is None and not why)
            )
        ):
            split = _split(shape, pr, pl, e, w, b, cuda, batch, seq, given_k, **layout)
            if split is not None:
                spl, se, k = split
                splits[spl.name] = k
                if given_k:  # only the split the user asked for
                    rows.pop()
                rows.append((spl, se, w, _fits(se, spl, b, cuda)))
    fitting = [(pl, e, w) for pl, e, w, why in rows if not why]
    candidates = tuple(
        (pl.name, e.step_s if e else float("nan"), not why, why) for pl, e, w, why in rows
    )
    if not fitting:
        raise PlanError(*_no_fit_message(shape, policy, b, rows, cuda))
    pl, e, w = min(fitting, key=lambda r: r[1].step_s)
    host_blocks = splits.get(pl.name, 0)
    reasons = [
        f"{pl.name} ({pl.what}) has the shortest predicted step, {fmt_s(e.step_s)}, "
        "of the placements that fit"
    ]
    if host_blocks and not given_k:
        held = sum(shape.block_bytes[:host_blocks])
        reasons.append(
            f"host_blocks={host_blocks}: the first {host_blocks} blocks' parameters "
            f"({fmt_bytes(held)}) fit in the host budget ({fmt_bytes(b['host'])}) next to what "
            "NVMe offload needs, one more does not; their fetches and working-copy writes "
            "skip the disk"
        )
    if not batch_known:
        reasons.append(
            "the activations and logits of a step are not counted in the RAM "
            "needed (the batch is not known): pass batch= and seq= to plan() to "
            "count them"
        )
    if explicit:
        reasons.append("kept as you set: " + ", ".join(f"{k}={v}" for k, v in explicit.items()))
    if given_k:
        reasons[-1] += f", host_blocks={given_k}"
    for name, step, ok, why in candidates:
        if name == pl.name:
            continue
        reasons.append(
            f"{name}: " + (f"fits, predicted {fmt_s(step)}" if ok else f"does not fit: {why}")
        )
    if pl.param_tier == "nvme":
        overlap = compute_overlap(pr)
        measured = pr.disk.compute_overlap is not None
        reasons.append(
            f"prefetch window {w}: a block's read "
            f"({fmt_s(shape.layer_block_bytes / pr.disk.read_bps)}) is issued while "
            f"the {w} blocks before it compute; {overlap:.0%} of the shorter of "
            "compute and disk time is counted as hidden "
            + (
                "(the probe's measurement)"
                if measured
                else "(not measured by the probe: none on a CPU, all on a GPU)"
            )
        )
    return Plan(
        pl.name,
        pl.param_tier,
        pl.grad_tier,
        pl.optimizer_tier,
        w,
        max(1, min(2, w)),
        w + 2,
        b,
        e,
        tuple(reasons),
        candidates,
        host_blocks,
        len(shape.block_bytes),
        chunk,
    )


def _no_fit_message(
    shape: ModelShape, policy: OffloadPolicy, b: Dict[str, Optional[int]], rows, cuda: bool
) -> Tuple[str, bool]:
    block = shape.largest_block_bytes
    if b["device"] is not None and block > b["device"]:
        return (
            f"infinity: the device budget ({b['device']:,} bytes) cannot hold the largest "
            f"block ({block:,} bytes); raise device_budget or split blocks with "
            "block_rule"
        ), False
    if block > b["host"]:
        return (
            f"infinity: the host budget ({b['host']:,} bytes) cannot hold the largest "
            f"block ({block:,} bytes); raise host_budget or split blocks with "
            "block_rule"
        ), False
    nvme_rows = [(pl, e) for pl, e, w, why in rows if pl.uses_nvme and e is not None]
    ram_ok = [(pl, e) for pl, e in nvme_rows if not _fits(e, pl, {**b, "disk": float("inf")}, cuda)]
    if ram_ok and b["disk"] is not None:
        pl, e = min(ram_ok, key=lambda r: r[1].nvme_bytes)
        return (
            f"infinity: nvme_path {policy.nvme_path!r} is too small: placement {pl.name!r} "
            f"needs {e.nvme_bytes:,} bytes of swap files, {b['disk']:,} bytes are free "
            f"({DISK_MARGIN:.0%} usable); free space there, point nvme_path at a larger "
            "disk, or use compact optimizer states (states='8bit')"
        ), True
    if policy.nvme_path is None:
        return (
            f"infinity: the model ({shape.param_bytes:,} bytes of parameters) does not fit "
            f"in the host budget ({b['host']:,} bytes) with its gradients and optimizer "
            "states; pass nvme_path=<a directory on a fast disk> to offload to NVMe"
        ), False
    why = "; ".join(f"{pl.name}: {w}" for pl, e, _, w in rows)
    return (
        f"infinity: no placement fits the budgets (device {b['device']:,}, host "
        f"{b['host']:,}, disk {b['disk']:,} bytes): {why}. Raise host_budget, or split "
        "blocks with block_rule so the staging buffers shrink"
    ), False


_TIERS = ("param_tier", "grad_tier", "optimizer_tier")


def _sharded(policy: OffloadPolicy, process_group: Any) -> int:
    """The ranks a wrap would shard over (0: none), decided from what every rank sees alike
    (the world size), never from rank-local budgets."""
    if policy.shard == "none":
        return 0
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    world = dist.get_world_size()
    return world if world > 1 else 0


def skip_reason(model: Any, policy: OffloadPolicy, process_group: Any = None) -> Optional[str]:
    """Why ``wrap`` does not run the planner for this policy (None: it does)."""
    if policy.placement != "auto":
        return "it was wrapped with placement=None: its tiers follow the rules"
    if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
        return "there is nothing to plan"
    if all(getattr(policy, k) != "auto" for k in _TIERS):
        return (
            "param_tier, grad_tier and optimizer_tier were all set explicitly: there was "
            "nothing to place"
        )
    ranks = _sharded(policy, process_group)
    if ranks:
        return (
            f"it is sharded over {ranks} ranks: every rank must take the same placement "
            "(a rank-dependent one would hang the collectives), so its tiers follow the "
            "rules, which see the same inputs on every rank"
        )
    return None


def apply_plan(
    model: nn.Module, policy: OffloadPolicy, process_group: Any = None
) -> Tuple[OffloadPolicy, Optional[Plan], Optional[str]]:
    """The policy ``wrap`` uses: with ``placement="auto"`` (the default) the planner's tiers
    for those left "auto", its window and its per-block split; unchanged when the planner is
    skipped (returns the reason instead of a plan)."""
    why = skip_reason(model, policy, process_group)
    if why is not None:
        return policy, None, why
    check_nvme_path(policy.nvme_path, must_exist=True)  # a file or a missing directory
    try:
        p = plan(model, policy)
    except PlanError as exc:
        if exc.disk or policy.param_tier == "auto":
            raise
        # the parameters' tier was set by hand: the engine checks its own budgets exactly
        # (the planner's estimates also count the optimizer's states and buffers)
        logger.warning(
            "infinity: the planner found no placement that fits (%s); keeping "
            "param_tier=%r and resolving the rest by the rules",
            exc,
            policy.param_tier,
        )
        return (
            policy,
            None,
            (
                f"the planner found no placement that fits ({exc}), so the "
                "tiers left 'auto' follow the rules"
            ),
        )
    return dataclasses.replace(policy, **p.policy_changes()), p, None
