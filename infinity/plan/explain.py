"""Tables a person reads in ten seconds: estimates and plans as text."""
from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from .estimate import EstimateTable
    from .planner import Plan


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def fmt_count(n: float) -> str:
    """``3.21B``, ``124.4M``, ``50.3K``."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}" if unit in "TB" else f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def format_estimates(t: "EstimateTable") -> str:
    sh = t.shape
    lines = [f"{sh.name}: {sh.params:,} parameters ({fmt_count(sh.params)}, "
             f"{fmt_bytes(sh.param_bytes)}), "
             f"{sh.n_layers} layers, d_model {sh.d_model}, {len(sh.block_bytes)} blocks "
             f"(largest {fmt_bytes(sh.largest_block_bytes)}); batch {t.batch} x seq {t.seq} "
             f"on {t.device}"]
    head = (f"{'placement':<11} {'ranks':>5} {'device':>10} {'host':>10} {'nvme':>10} "
            f"{'step':>9} {'tokens/s':>9} {'compute':>9} {'fetch':>8} {'grads':>8} "
            f"{'optim':>8} {'nvme w/step':>11}")
    lines += [head, "-" * len(head)]
    for r in t.rows:
        lines.append(
            f"{r.placement:<11} {r.ranks:>5} {fmt_bytes(r.device_bytes):>10} "
            f"{fmt_bytes(r.host_bytes):>10} {fmt_bytes(r.nvme_bytes):>10} {fmt_s(r.step_s):>9} "
            f"{r.tokens_per_s:>9,.0f} {fmt_s(r.compute_s):>9} {fmt_s(r.fetch_s):>8} "
            f"{fmt_s(r.grad_offload_s):>8} {fmt_s(r.optimizer_s):>8} "
            f"{fmt_bytes(r.nvme_written_per_step):>11}")
    for r in t.rows:
        if r.nvme_by_category:
            n = max(1, sh.params // r.ranks)
            parts = ", ".join(f"{k} {v / n:.2f}" for k, v in r.nvme_by_category.items())
            lines.append(f"swap bytes/param ({r.placement}, {r.ranks} rank{'s' if r.ranks > 1 else ''}): "
                         f"{parts}; SSD wear {r.tb_written_per_1000_steps:.2f} TB per 1,000 steps"
                         + (f"; +{r.nvme_overlap_bytes / n:.2f} while the step overlaps backward"
                            if r.nvme_overlap_bytes else ""))
    if t.rows and t.rows[0].working_set:
        ws = t.rows[-1].working_set
        parts = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in ws.items()
                          if k != "peak")
        lines.append(f"autograd's working set outside the engine ({t.rows[-1].placement}, in "
                     f"device): {parts}; peak {fmt_bytes(ws['peak'])}")
    lines += [f"note: {n}" for n in t.notes]
    return "\n".join(lines) + "\n"


def format_plan(plan: "Plan") -> str:
    params = f"parameters on {plan.param_tier}"
    if plan.host_blocks:
        params = (f"parameters of the first {plan.host_blocks} of {plan.n_blocks} blocks on "
                  f"host, the rest on {plan.param_tier}")
    lines: List[str] = [
        f"infinity plan: {plan.placement} -- {params}, gradients on "
        f"{plan.grad_tier}, optimizer states on {plan.optimizer_tier}; prefetch window "
        f"{plan.prefetch_window} (host staging buffers {plan.staging_buffers}, gradient "
        f"buffers {plan.grad_buffers})",
        f"  budgets: device {fmt_bytes(plan.budgets['device'])}, host "
        f"{fmt_bytes(plan.budgets['host'])}, disk "
        + (fmt_bytes(plan.budgets['disk']) if plan.budgets.get('disk') is not None else "-"),
        f"  predicted step {fmt_s(plan.estimate.step_s)} "
        f"({plan.estimate.tokens_per_s:,.0f} tokens/s); needs device "
        f"{fmt_bytes(plan.estimate.device_bytes)}, host {fmt_bytes(plan.estimate.host_bytes)}, "
        f"NVMe {fmt_bytes(plan.estimate.nvme_bytes)}"
        + (f" (device includes autograd's working set, "
           f"{fmt_bytes(plan.estimate.working_set['peak'])})"
           if plan.estimate.working_set.get("peak") else ""),
        "  why:",
    ]
    lines += [f"    - {r}" for r in plan.reasons]
    return "\n".join(lines) + "\n"
