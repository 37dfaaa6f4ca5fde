"""The host budget's promise, checked once per engine: after the first backward on a CPU
device, the process's peak RSS against RSS at wrap + host_budget + 0.5 GiB.

Design notes: docs/modules.md, runtime/process/rss_bound.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)

SLACK = 1 << 29  # 0.5 GiB: the promise's allowance for the interpreter, torch and the rest
_STATUS = "/proc/self/status"
_GIB = float(1 << 30)


@dataclass(frozen=True)
class ProcessMemory:
    """The process's resident bytes now (``rss``, VmRSS) and at their peak (``hwm``, VmHWM)."""

    rss: int
    hwm: int


def read_memory() -> Optional[ProcessMemory]:
    """VmRSS and VmHWM from /proc/self/status, in bytes; None where there is none (not Linux)."""
    try:
        with open(_STATUS) as fh:
            text = fh.read()
    except OSError:
        return None
    found: Dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            parts = value.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * 1024  # the kernel writes kB (KiB)
    if len(found) < 2:
        return None
    return ProcessMemory(found["VmRSS"], found["VmHWM"])


def _gib(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({nbytes / _GIB:.2f} GiB)"


class RssBound:
    """One engine's check of the host budget's promise. The engine bounds its own buffers; what
    autograd saves in forward (the user's activations) it does not, so this measures: RSS
    across the forwards before the first backward (an estimate of what they saved) and the
    peak RSS at the end of that backward. Over the bound, it logs one warning naming the
    figures and the remedies; it never raises (training goes on)."""

    def __init__(self, host_budget: int, at_wrap: ProcessMemory) -> None:
        self.host_budget = host_budget
        self.at_wrap = at_wrap
        self.bound = at_wrap.rss + host_budget + SLACK
        self.pending = True  # the check has not run yet
        self.result: Optional[Dict[str, Any]] = None
        self._forward_start: Optional[int] = None
        self._forward_growth: Optional[int] = None

    @classmethod
    def watch(
        cls, host_budget: Optional[int], device_type: str, at_wrap: Optional[ProcessMemory]
    ) -> Optional[RssBound]:
        """The check for an engine, or None when there is nothing to check: no host_budget,
        a CUDA device (activations live there, not in host RAM) or no /proc (not Linux)."""
        if host_budget is None or device_type != "cpu" or at_wrap is None:
            return None
        return cls(host_budget, at_wrap)

    def headroom(self, engine_growth: int, window: int) -> int:
        """Bytes of saved activations that a forward starting now may keep in RAM within the
        bound: the bound less RSS now, less what the engine may still take of its budget
        (``engine_growth``) and the activations fetched back ahead of backward (``window``),
        halved for what backward allocates beside them (activation_tier="auto")."""
        now = read_memory()
        if now is None:
            return 0
        return max(0, (self.bound - now.rss - engine_growth - window) // 2)

    # ---- called by the step machine (runtime/step/machine.py) -----------------------------
    def forward_started(self) -> None:
        """A model forward starts (outside backward): the first one's RSS is the base (the
        forwards of several micro-batches before one backward all count)."""
        if self.pending and self._forward_start is None:
            now = read_memory()
            self._forward_start = None if now is None else now.rss

    def forward_done(self) -> None:
        """A model forward ended with outputs that a backward will use."""
        if self.pending and self._forward_start is not None:
            now = read_memory()
            if now is not None:
                self._forward_growth = max(0, now.rss - self._forward_start)

    def backward_done(self) -> None:
        """The end of a backward: the first one checks the peak RSS (once per engine)."""
        if not self.pending:
            return
        self.pending = False
        now = read_memory()
        if now is None:
            return
        # VmHWM is the process's peak since it started (or since someone reset it): a peak
        # it reached before wrap is not this engine's, and the peak since wrap is unknown then
        after_wrap = now.hwm > self.at_wrap.hwm
        over = after_wrap and now.hwm > self.bound
        self.result = {
            "peak": now.hwm,
            "bound": self.bound,
            "over": over,
            "rss_at_wrap": self.at_wrap.rss,
            "host_budget": self.host_budget,
            "slack": SLACK,
            "peak_before_wrap": self.at_wrap.hwm,
            "forward_growth": self._forward_growth,
        }
        if over:
            logger.warning("%s", self.message())

    # ---- what it found ------------------------------------------------------------------
    def message(self) -> str:
        """The warning: the measured peak, the bound and its parts, the remedies."""
        r = self.result or {}
        growth = r.get("forward_growth")
        saved = (
            f"RSS grew by {_gib(growth)} across the forward before it, about what autograd "
            "saved for backward (the activations)"
            if growth is not None
            else "the rest is what autograd saved for backward (the activations)"
        )
        return (
            f"infinity: peak RSS {_gib(r.get('peak', 0))} at the end of the first backward is "
            f"over the host budget's bound of {_gib(r.get('bound', 0))} (RSS at wrap "
            f"{_gib(r.get('rss_at_wrap', 0))} + host_budget {_gib(r.get('host_budget', 0))} + "
            f"0.5 GiB). The engine keeps its own buffers within host_budget, not the model's "
            f"activations, which grow with batch x sequence x width x layers: {saved}. "
            'Remedies: activation_tier="nvme" (saved activations go to disk), "auto" (only '
            'what does not fit this bound goes to disk) or "host" (counted in host_budget), see '
            "docs/activation_offload.md; smaller micro-batches "
            "or shorter sequences, keeping the batch per optimizer step by accumulating "
            "gradients: infinity.accumulate(model, micro_batches) runs many micro-batches "
            "layer by layer, keeping only each layer's inputs. Training goes on; this is "
            "checked once"
        )

    def describe(self) -> Optional[str]:
        """One line for ``infinity.explain``: the measured peak against the bound (None before
        the first backward)."""
        r = self.result
        if r is None:
            return None
        verdict = "over" if r["over"] else "within"
        line = (
            f"peak RSS {r['peak'] / _GIB:.2f} GiB at the end of the first backward, {verdict} "
            f"the host budget's bound of {r['bound'] / _GIB:.2f} GiB (RSS at wrap "
            f"{r['rss_at_wrap'] / _GIB:.2f} + host_budget {r['host_budget'] / _GIB:.2f} + 0.5)"
        )
        if r["forward_growth"] is not None:
            line += f"; RSS grew {r['forward_growth'] / _GIB:.2f} GiB across its forward"
        if r["peak"] <= r["peak_before_wrap"]:
            line += "; the peak was reached before wrap"
        return line
