"""A step taken inside backward: each block's update applied from RAM, committed in place, as
soon as its gradients are complete (``infinity.accumulate`` with an optimizer drives it).

Design notes: docs/modules.md, optim/in_backward.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..runtime.port import OptimizerPort
from .states import nvme_step
from .states.nvme import NvmeStates

if TYPE_CHECKING:  # pragma: no cover
    from .core import AdamCore
    from .overlap import BackwardOverlap


def find_port(core: AdamCore, engine: Any) -> Optional[OptimizerPort]:
    """The optimizer's port of ``engine``'s model, or None when it does not step that model."""
    return next((p for p in core.wrapped.ports() if p.engine is engine), None)


class StepInBackward:
    """One model's step in backward, for one optimizer step: ``measure()`` (optional), then
    ``apply()``, then ``opt.step()``; ``close()`` always."""

    def __init__(self, core: AdamCore, overlap: BackwardOverlap, port: OptimizerPort) -> None:
        self.core = core
        self.overlap = overlap
        self.port = port

    @staticmethod
    def why_not(core: AdamCore, port: OptimizerPort) -> Optional[str]:
        """Why this model's step cannot be taken in backward (None: it can)."""
        if not port.grads.on_nvme:
            return "its gradients are not on NVMe (opt.step() reads no disk for them)"
        if not core.clean:
            return "a grad multiplier or a failed step is pending"
        store = core.wrapped.store(port)
        if not isinstance(store, NvmeStates):
            return "its optimizer states are not on NVMe"
        if any(s.flat.user_written for s in core.wrapped.shards_of(port)):
            return "parameters were written since the last step (the step takes them in first)"
        return None

    def prepare(self) -> None:
        """States for the shards never stepped yet (zero moments, masters from the homes),
        written now so that each block's update has committed states to start from."""
        store = self.core.wrapped.store(self.port)
        if not isinstance(store, NvmeStates):
            raise RuntimeError("infinity.optim: a step in backward needs NVMe states (bug)")
        fresh = [s for s in self.core.wrapped.shards_of(self.port) if not s.initialized]
        if fresh:
            sets = store.reserve()
            for shard in fresh:
                nvme_step.init_shard(store, sets, shard)

    def measure(self) -> None:
        """The next backward only measures the gradients (dropped unwritten when closed)."""
        self.overlap.set_phase(self.port, "measure")

    def apply(self) -> None:
        """The next backward steps each block as its gradients close, with the multiplier set
        now (the clip's); the gradients measured before are forgotten first."""
        if self.overlap.phase(self.port) == "measure":
            self.port.engine.zero_grad()
            for group in self.core.groups:  # parameters outside the model: as zero_grad()
                for p in group["params"]:
                    if not self.core.wrapped.is_wrapped(p):
                        p.grad = None
        self.overlap.set_phase(self.port, "step")

    def close(self, failure: Optional[BaseException] = None) -> None:
        """The model's next backwards are plain ones again. ``failure``: the backward raised
        before ``opt.step()``; what the blocks stepped so far did is added to its notes."""
        self.overlap.set_phase(self.port, None)
        if failure is None:
            return
        self.core.discard_pending()  # the clip's multiplier was meant for this step
        what = self.overlap.abandon_in_place(self.port, f"the backward raised ({failure})")
        if what is not None:
            failure.add_note(what)
