"""Optimizer states in host RAM: one buffer per shard, counted in the engine's host budget.

A step updates each shard's buffer in place (the states are committed as soon as the kernel
ran), writing the working copy in the same pass: into the home (host), into one staging
buffer then the parameter swap file (NVMe homes), or copied afterwards (device homes). When
the swap-file write fails, the states have taken the step already; the shard is recorded as
dirty and its working copy is rewritten from the masters by the next step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch

from ... import io as inf_io
from ... import trace_events
from ...runtime.port import OptimizerPort
from ..step.common import _read_grads
from ..step.layout import StateViews
from ..step.shard import Shard, init_states, master_in_home
from .store import StateStore

if TYPE_CHECKING:  # pragma: no cover
    from ..step.work import StepWork


class HostStates(StateStore):
    """Shard states in host RAM, allocated at a shard's first step."""

    tier = "host"

    def __init__(
        self,
        port: OptimizerPort,
        master: str = "fp32",
        shards: Optional[Dict[int, Shard]] = None,
        chunk_bytes: Optional[int] = None,
    ) -> None:  # (states move whole)
        super().__init__(port, master, shards)
        self._bufs: Dict[str, torch.Tensor] = {}
        self._held = 0
        self._staging: Optional[torch.Tensor] = None

    def _with_master(self, shard: Shard) -> bool:
        return self.master != "fp32" or not master_in_home(shard)  # bf16 masters: always held

    def buffer(self, shard: Shard) -> torch.Tensor:
        """The shard's state buffer (uint8, :meth:`views` types it), created (and budgeted)
        on first use."""
        buf = self._bufs.get(shard.key)
        if buf is None:
            nbytes = self.layout(shard).nbytes
            self.port.host_budget.acquire(nbytes, what=f"optimizer states of {shard.key}")
            self._held += nbytes
            buf = self.empty(shard)
            self._bufs[shard.key] = buf
        return buf

    def read_committed(self, shard: Shard) -> torch.Tensor:
        return self.buffer(shard)

    def rewrite(
        self, shard: Shard, fill: Callable[[StateViews], None], doing: str, read: bool = True
    ) -> None:
        fill(self.views(shard, self.buffer(shard)))  # in place: committed as written

    def staging(self) -> torch.Tensor:
        """With parameters homed on NVMe: one aligned buffer (the largest working copy) that
        each updated working copy passes through on its way to the swap file."""
        if self._staging is None:
            nbytes = max(s.flat.home_nbytes for s in self.shards())
            self.port.host_budget.acquire(nbytes, what="optimizer working-copy staging buffer")
            self._staging = inf_io.aligned_empty(nbytes)
        return self._staging

    def step(self, shards: List[Shard], work: StepWork) -> None:
        stats, port = work.stats, self.port
        for shard in shards:
            runs = work.runs_of(shard)
            buf = self.buffer(shard)
            staging = self.staging() if port.working.stages(shard.flat) else None
            if not shard.initialized:
                init_states(shard, self.views(shard, buf), staging)
                shard.initialized = True
            grad = None
            if port.grads.in_ram(shard.flat) is None:
                grad = _read_grads(shard)
                stats.bytes_read += shard.numel * 4
            t0 = time.perf_counter()
            work.apply(shard, buf, staging, grad)
            stats.compute_s += time.perf_counter() - t0
            trace_events.span("optimizer_compute", shard.key, shard.numel, t0)
            work.took(shard)
            if staging is not None:  # the updated working copy goes to the parameter swap file
                home = staging[: shard.flat.home_nbytes].view(shard.flat.home_dtype)
                try:
                    port.working.write(shard.flat, home).wait()
                except BaseException as exc:
                    # the states (in RAM) have taken this step; the swap file is rewritten
                    # from them by the next step() (or restore_parameters()), which also
                    # finishes the shards this step did not reach
                    work.dirty(shard)
                    exc.add_note(
                        f"infinity.optim: {work.done_count()} of {len(shards)} shards took "
                        "this step before writing the parameters of "
                        f"{shard.key!r} failed. Call opt.step() again once the disk is fixed: "
                        "it rewrites them and finishes this same step (the gradients are "
                        "kept), so training continues as if nothing had failed."
                    )
                    raise
                stats.bytes_written += shard.flat.home_nbytes
            stats.shards += 1
            stats.params += sum(r.end - r.start for r in runs)

    @property
    def nbytes(self) -> int:
        return self._held

    def close(self) -> None:
        self._bufs.clear()
        if self._held:
            self.port.host_budget.release(self._held)
            self._held = 0
        if self._staging is not None:
            self.port.host_budget.release(self._staging.numel())
            self._staging = None
