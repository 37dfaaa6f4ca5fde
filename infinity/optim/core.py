"""The state one OffloadedAdam steps through, as one object it owns (:class:`AdamCore`): the
wrapped models and their stores, the unwrapped parameters' states, the kernels' scalars per
run, the record of shards a failed step touched, and the grad multiplier of the next step.
The step overlapping backward (:mod:`.overlap`), the gradient checks (:mod:`.grad_checks`)
and the state dicts (:mod:`.state_dicts`) work on it, never on the optimizer's privates."""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from .params import ParamStates
from .step.choices import FormatChoices
from .step.chunks import Unit
from .step.common import _float
from .step.shard import Run, Shard
from .step.stats import StepStats
from .step.work import StepWork
from .update import update_shard, update_unit
from .wrapped import WrappedModels


class AdamCore:
    """See the module docstring. ``opt``: the optimizer (held weakly: the engines hold this
    core through their backward listener, and an optimizer dropped without ``close()`` must
    still be freed by reference counting); its public ``param_groups`` and ``state`` are read
    through it."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        formats: FormatChoices,
        master: str,
        sr_seed: int,
        adamw: bool,
        chunk_bytes: Optional[int],
    ) -> None:
        self._opt = weakref.ref(opt)
        self.formats = formats
        self.master = master
        self.sr_seed = sr_seed
        self.adamw = adamw
        self.wrapped = WrappedModels(formats, master, chunk_bytes)
        self.params = ParamStates(master, sr_seed, adamw)  # the unwrapped parameters' states
        self.dirty: Dict[str, Shard] = {}  # working copies that may not match committed masters
        self.done: Dict[str, Shard] = {}  # shards a failed step already applied
        self.multiplier = 1.0  # the next step's grad multiplier (clipping, scaling)
        self.finite: Optional[bool] = None  # the next step's gradients checked finite (or not)
        self._element_bases: Optional[Dict[int, int]] = None

    # ---- the optimizer's public state ---------------------------------------------------------
    def _owner(self) -> torch.optim.Optimizer:
        opt = self._opt()
        if opt is None:
            raise RuntimeError("infinity.optim: the optimizer of this state is gone")
        return opt

    @property
    def groups(self) -> List[Dict[str, Any]]:
        return self._owner().param_groups

    @property
    def state(self) -> Dict[Any, Dict[str, Any]]:
        """torch's per-parameter state (the unwrapped parameters')."""
        return self._owner().state

    def param_index(self) -> List[torch.Tensor]:
        """The parameters in param-group order (their state-dict indices)."""
        return [p for g in self.groups for p in g["params"]]

    def params_changed(self) -> None:
        """A param group was added: the element bases are recomputed."""
        self._element_bases = None

    def element_base(self, p: torch.Tensor) -> int:
        """Global index of parameter p's first element for the stochastic-rounding hash: its
        position among this optimizer's parameters * 2**40 (independent of shard layout)."""
        if self._element_bases is None:
            self._element_bases = {id(q): i << 40 for i, q in enumerate(self.param_index())}
        return self._element_bases[id(p)]

    # ---- the kernels ------------------------------------------------------------------------
    def hyper(self, run: Run, multiplier: float) -> Dict[str, Any]:
        """The kernel's scalars for one run, from its param group now."""
        group = self.groups[run.group]
        beta1, beta2 = group["betas"]
        return dict(
            step=run.step,
            lr=_float(group["lr"]),
            beta1=_float(beta1),
            beta2=_float(beta2),
            eps=_float(group["eps"]),
            weight_decay=_float(group["weight_decay"]),
            adamw=self.adamw,
            grad_multiplier=multiplier,
        )

    def apply(
        self,
        shard: Shard,
        runs: List[Run],
        buf: torch.Tensor,
        staging: Optional[torch.Tensor],
        multiplier: float,
        grad: Optional[torch.Tensor] = None,
        hypers: Optional[List[Dict[str, Any]]] = None,
    ) -> None:
        """One shard's update in RAM (:func:`.shard_update.update_shard`). ``hypers``: the
        kernel's scalars per run (default: from the param groups now; an update overlapping
        backward passes those it will be checked against)."""
        hypers = hypers if hypers is not None else [self.hyper(r, multiplier) for r in runs]
        update_shard(
            self.wrapped.store_of(shard),
            shard,
            runs,
            hypers,
            buf,
            staging,
            grad,
            self.sr_seed,
            self.element_base,
        )

    def apply_unit(
        self,
        shard: Shard,
        runs: List[Run],
        unit: Unit,
        buf: torch.Tensor,
        multiplier: float,
        out: Optional[Tuple[torch.Tensor, int]] = None,
        grad: Optional[Tuple[torch.Tensor, int]] = None,
        hypers: Optional[List[Dict[str, Any]]] = None,
    ) -> None:
        """:meth:`apply` of one unit of an NVMe shard (:func:`.shard_update.update_unit`;
        a whole unit is the whole shard, through :meth:`apply`)."""
        if unit.whole:
            staging = out[0].view(torch.uint8) if out is not None else None
            self.apply(
                shard, runs, buf, staging, multiplier, grad[0] if grad is not None else None, hypers
            )
            return
        hypers = hypers if hypers is not None else [self.hyper(r, multiplier) for r in runs]
        update_unit(self.wrapped.store_of(shard), shard, runs, hypers, unit, buf, out, grad)

    def work(self, multiplier: float, stats: StepStats) -> StepWork:
        """This step's work for the stores: the runs of every shard not done yet, the
        kernels, and the record of shards that took the step or need their working copy
        rewritten."""
        runs = {
            id(s.flat): r
            for s in self.wrapped.shards.values()
            if s.key not in self.done
            for r in [s.runs()]
            if r
        }

        def took(shard: Shard) -> None:
            shard.commit_steps()
            self.done[shard.key] = shard

        return StepWork(
            runs,
            stats,
            apply=lambda s, buf, staging, grad: self.apply(
                s, runs[id(s.flat)], buf, staging, multiplier, grad
            ),
            apply_unit=lambda s, un, buf, out, g: self.apply_unit(
                s, runs[id(s.flat)], un, buf, multiplier, out, g
            ),
            took=took,
            dirty=self.mark_dirty,
            restore=self.restore_dirty,
            dirty_count=lambda: len(self.dirty),
            done_count=lambda: len(self.done),
        )

    # ---- what a failed step left, and what the next step starts from --------------------------
    def mark_dirty(self, shard: Shard) -> None:
        """``shard``'s working copy may not match its committed masters."""
        self.dirty[shard.key] = shard

    def restore_dirty(self) -> None:
        """Rewrites the working copy of shards a failed step touched from committed masters."""
        for key, shard in list(self.dirty.items()):
            shard.port.engine.release_all()
            self.wrapped.store_of(shard).restore_home(shard)
            del self.dirty[key]

    @property
    def clean(self) -> bool:
        """No failed step to finish and no multiplier or check set for the next step: an
        update computed during backward may be what the next step computes."""
        return not self.dirty and not self.done and self.multiplier == 1.0 and self.finite is None

    def discard_pending(self) -> None:
        """Forgets multipliers and checks meant for a step that will not happen."""
        self.multiplier = 1.0
        self.finite = None

    def sync_user_writes(self, shard: Shard) -> None:
        """Parameters written outside forward (load_state_dict, an EMA copied back, a user's
        in-place change): their fp32 master weights follow, except where the written value is
        just the master's rounding (then the master keeps its precision)."""
        written = shard.port.working.take_user_writes(shard.flat)
        if not written or not shard.initialized:
            return
        store = self.wrapped.store_of(shard)
        if not store.layout(shard).with_master:
            return  # host states of an fp32 host home: the home is the master
        store.sync_masters(shard, written)

    def read_committed(self, shard: Shard) -> Optional[torch.Tensor]:
        """The shard's committed state buffer (a copy for NVMe), or None without states."""
        if not shard.initialized:
            return None
        return self.wrapped.store_of(shard).read_committed(shard)


__all__ = ["AdamCore"]
