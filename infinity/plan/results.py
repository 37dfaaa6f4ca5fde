"""What ``infinity.estimate`` and the planner return, and how each reads as text: a table a
person takes in at a glance (``print(infinity.estimate(...))``, ``print(plan)``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .comm import CommEstimate
from .shape import ModelShape
from .units import fmt_bytes, fmt_count, fmt_s


@dataclass(frozen=True)
class Estimate:
    placement: str
    ranks: int
    device_bytes: int
    host_bytes: int
    nvme_bytes: int
    step_s: float
    compute_s: float
    fetch_s: float
    grad_offload_s: float
    optimizer_s: float
    nvme_written_per_step: int
    tokens_per_step: int
    what: str = ""
    engine_s: float = 0.0  # the engine's fixed cost per block and step (in step_s)
    # swap bytes by category: parameters, gradients, master, moments, spare (the extents of
    # the optimizer's units in flight: each is written before the one it replaces is freed)
    nvme_by_category: Dict[str, int] = field(default_factory=dict)
    # more swap while the step overlapping backward is armed (gradients and states on NVMe):
    # the previous states of every unit it stepped, kept until opt.step() confirms them
    nvme_overlap_bytes: int = 0
    # the working set autograd allocates outside the engine's pools (in device_bytes), by term
    # (autograd_working_set); "peak" is what device_bytes counts
    working_set: Dict[str, int] = field(default_factory=dict)
    # the bytes a step moves through the swap disk, by category (params_read, params_written,
    # grads_read, grads_written, states_read, states_written, and activations_read /
    # activations_written with layer-major boundaries on NVMe: stats()["nvme_per_step"]'s)
    nvme_per_step: Dict[str, int] = field(default_factory=dict)

    @property
    def tb_written_per_1000_steps(self) -> float:
        """SSD wear: terabytes written to the swap disk per 1,000 steps."""
        return self.nvme_written_per_step * 1000 / 1e12

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class EstimateTable:
    shape: ModelShape
    rows: List[Estimate]
    batch: int
    seq: int
    device: str
    notes: List[str] = field(default_factory=list)
    comm: List[CommEstimate] = field(default_factory=list)  # with estimate(link_gbps=...)

    def row(self, placement: str, ranks: int = 1) -> Estimate:
        for r in self.rows:
            if r.placement == placement and r.ranks == ranks:
                return r
        raise KeyError((placement, ranks))

    def __str__(self) -> str:
        return format_estimates(self)


@dataclass(frozen=True)
class Plan:
    placement: str
    param_tier: str
    grad_tier: str
    optimizer_tier: str
    prefetch_window: int
    staging_buffers: int
    grad_buffers: int
    budgets: Dict[str, Optional[int]]
    estimate: Estimate
    reasons: Tuple[str, ...]
    candidates: Tuple[Tuple[str, float, bool, str], ...]  # name, predicted step, fits, why not
    host_blocks: int = 0  # with param_tier "nvme": the first blocks' parameters on host
    n_blocks: int = 0
    # the size of the host buffers I/O and the optimizer pass through, as wrap derives it
    # (infinity.tiers.chunk_size.resolve_chunk_bytes); the estimate counts its pools at it
    chunk_bytes: int = 0

    def policy_changes(self) -> Dict[str, Any]:
        changes: Dict[str, Any] = {
            "param_tier": self.param_tier,
            "grad_tier": self.grad_tier,
            "optimizer_tier": self.optimizer_tier,
            "prefetch_window": self.prefetch_window,
        }
        if self.host_blocks:
            changes["host_blocks"] = self.host_blocks
        return changes

    def __str__(self) -> str:
        return format_plan(self)


def format_estimates(t: EstimateTable) -> str:
    sh = t.shape
    lines = [
        f"{sh.name}: {sh.params:,} parameters ({fmt_count(sh.params)}, "
        f"{fmt_bytes(sh.param_bytes)}), "
        f"{sh.n_layers} layers, d_model {sh.d_model}, {len(sh.block_bytes)} blocks "
        f"(largest {fmt_bytes(sh.largest_block_bytes)}); batch {t.batch} x seq {t.seq} "
        f"on {t.device}"
    ]
    head = (
        f"{'placement':<11} {'ranks':>5} {'device':>10} {'host':>10} {'nvme':>10} "
        f"{'step':>9} {'tokens/s':>9} {'compute':>9} {'fetch':>8} {'grads':>8} "
        f"{'optim':>8} {'nvme w/step':>11}"
    )
    lines += [head, "-" * len(head)]
    for r in t.rows:
        lines.append(
            f"{r.placement:<11} {r.ranks:>5} {fmt_bytes(r.device_bytes):>10} "
            f"{fmt_bytes(r.host_bytes):>10} {fmt_bytes(r.nvme_bytes):>10} {fmt_s(r.step_s):>9} "
            f"{r.tokens_per_s:>9,.0f} {fmt_s(r.compute_s):>9} {fmt_s(r.fetch_s):>8} "
            f"{fmt_s(r.grad_offload_s):>8} {fmt_s(r.optimizer_s):>8} "
            f"{fmt_bytes(r.nvme_written_per_step):>11}"
        )
    for r in t.rows:
        if r.nvme_by_category:
            n = max(1, sh.params // r.ranks)
            parts = ", ".join(f"{k} {v / n:.2f}" for k, v in r.nvme_by_category.items())
            lines.append(
                f"swap bytes/param ({r.placement}, {r.ranks} rank{'s' if r.ranks > 1 else ''}): "
                f"{parts}; SSD wear {r.tb_written_per_1000_steps:.2f} TB per 1,000 steps"
                + (
                    f"; +{r.nvme_overlap_bytes / n:.2f} while the step overlaps backward"
                    if r.nvme_overlap_bytes
                    else ""
                )
            )
        if r.nvme_per_step:
            n = max(1, sh.params // r.ranks)
            moved = ", ".join(
                f"{k.replace('_', ' ')} {v / n:.2f}" for k, v in r.nvme_per_step.items() if v
            )
            lines.append(f"NVMe per step, bytes/param ({r.placement}): {moved}")
    if t.rows and t.rows[0].working_set:
        ws = t.rows[-1].working_set
        parts = ", ".join(
            f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in ws.items() if k != "peak"
        )
        lines.append(
            f"autograd's working set outside the engine ({t.rows[-1].placement}, in "
            f"device): {parts}; peak {fmt_bytes(ws['peak'])}"
        )
    lines += [f"note: {n}" for n in t.notes]
    return "\n".join(lines) + "\n"


def format_plan(plan: Plan) -> str:
    params = f"parameters on {plan.param_tier}"
    if plan.host_blocks:
        params = (
            f"parameters of the first {plan.host_blocks} of {plan.n_blocks} blocks on "
            f"host, the rest on {plan.param_tier}"
        )
    lines: List[str] = [
        f"infinity plan: {plan.placement} -- {params}, gradients on "
        f"{plan.grad_tier}, optimizer states on {plan.optimizer_tier}; prefetch window "
        f"{plan.prefetch_window} (host staging buffers {plan.staging_buffers}, gradient "
        f"buffers {plan.grad_buffers}, chunk {fmt_bytes(plan.chunk_bytes)})",
        f"  budgets: device {fmt_bytes(plan.budgets['device'])}, host "
        f"{fmt_bytes(plan.budgets['host'])}, disk "
        + (fmt_bytes(plan.budgets["disk"]) if plan.budgets.get("disk") is not None else "-"),
        f"  predicted step {fmt_s(plan.estimate.step_s)} "
        f"({plan.estimate.tokens_per_s:,.0f} tokens/s); needs device "
        f"{fmt_bytes(plan.estimate.device_bytes)}, host {fmt_bytes(plan.estimate.host_bytes)}, "
        f"NVMe {fmt_bytes(plan.estimate.nvme_bytes)}"
        + (
            f" (device includes autograd's working set, "
            f"{fmt_bytes(plan.estimate.working_set['peak'])})"
            if plan.estimate.working_set.get("peak")
            else ""
        ),
        "  why:",
    ]
    lines += [f"    - {r}" for r in plan.reasons]
    return "\n".join(lines) + "\n"
