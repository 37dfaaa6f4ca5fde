"""The optimizer step hidden behind backward: speculate per block, verify at ``opt.step()``.

Design notes: docs/modules.md, optim/overlap.py."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import torch

from ..runtime.port import OptimizerPort
from .core import AdamCore
from .states.nvme import NvmeStates
from .states.swapper import ShardFeed, run_pipeline
from .step.chunks import Unit
from .step.kernels import Window
from .step.shard import Run as _Run
from .step.shard import Shard
from .step.stats import StepStats

logger = logging.getLogger(__name__)

OVERLAP_MODES = ("auto", True, False)
AUTO_AFTER = 2  # consecutive steps with exactly one backward each before "auto" arms
SKIP_AFTER = 1  # armed steps that needed no gradient after backward before writes are skipped
KEEP_GRADS_MODES = (True, "auto")


def check_keep_grads(value: object) -> Union[str, bool]:
    if not any(value is m or (isinstance(m, str) and value == m) for m in KEEP_GRADS_MODES):
        raise ValueError(
            f"infinity.optim: keep_grads must be True (default: with the step "
            f"overlapping backward, gradients are written to NVMe too) or 'auto' "
            f"(written only while the loop may need them after backward); got "
            f"{value!r}"
        )
    return value  # type: ignore[return-value]


def check_overlap(value: object) -> Union[str, bool]:
    if not any(value is m or (isinstance(m, str) and value == m) for m in OVERLAP_MODES):
        raise ValueError(
            f"infinity.optim: overlap must be 'auto' (default: overlap the step "
            f"with backward once the loop steps after every backward), True "
            f"(always) or False (never); got {value!r}"
        )
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class _Spec:
    """What one speculative update computed from: compared with the step's view at step()."""

    shard: Shard
    runs: Tuple[_Run, ...]
    hypers: Tuple[Tuple[Tuple[str, Any], ...], ...]
    norms: Any  # the gradient sink's per-slot norm list the update saw (compared by identity)
    multiplier: float = 1.0  # the grad multiplier it applied (a step in backward: the clip's)


class _Worker:
    """One model's speculative pipeline: a thread running run_pipeline over a feed that
    backward fills."""

    def __init__(
        self, core: AdamCore, port: OptimizerPort, store: NvmeStates, commit: bool = False
    ) -> None:
        self.port = port
        self.commit = commit  # a step in backward: each unit committed in place as written
        self.store = store
        self.feed = ShardFeed()
        self.specs: Dict[str, _Spec] = {}
        self.computed: List[Shard] = []
        self.stats = StepStats()
        self.error: Optional[BaseException] = None
        self.poisoned: Optional[str] = None
        # shards whose gradients the engine keeps in RAM for this worker (key -> shard),
        # handed back to the engine's sink once stepped (or when the worker ends)
        self.held: Dict[str, Shard] = {}
        self.done = False
        self._lock = threading.Lock()
        sets = store.reserve()

        def compute(
            shard: Shard,
            unit: Unit,
            buf: torch.Tensor,
            out: Optional[Window],
            grad: Optional[Window],
        ) -> None:
            spec = self.specs[shard.key]
            core.apply_unit(
                shard,
                list(spec.runs),
                unit,
                buf,
                spec.multiplier,
                out,
                grad,
                hypers=[dict(h) for h in spec.hypers],
            )
            if unit.last:
                self._release(shard)
                if commit:  # stepped and committed: its gradient file's disk can go back
                    port.grads.held.consumed(shard.flat)

        def run() -> None:
            try:
                run_pipeline(
                    self.feed,
                    store,
                    sets,
                    compute,
                    port.working.staged,
                    self.stats,
                    self.computed,
                    commit=commit,
                )
            except BaseException as exc:  # noqa: BLE001 - reported at step(), then rolled back
                self.error = exc
            finally:
                with self._lock:
                    self.done = True
                    for shard in list(self.held.values()):  # never stepped: the buffers go back
                        self._release(shard)

        self.thread = threading.Thread(target=run, name="infinity-optim-overlap", daemon=True)
        self.thread.start()

    def put(self, spec: _Spec, held: bool) -> None:
        with self._lock:
            self.specs[spec.shard.key] = spec
            if held:
                self.held[spec.shard.key] = spec.shard
            if self.done:  # the worker ended (an error): it will not step this one
                self._release(spec.shard)
                return
            self.feed.put(spec.shard)

    def _release(self, shard: Shard) -> None:
        if self.held.pop(shard.key, None) is not None:
            self.port.grads.held.release_held(shard.flat)

    @property
    def alive(self) -> bool:
        return not self.done and self.error is None

    def join(self) -> None:
        self.feed.close()
        self.thread.join()


class _ModelState:
    __slots__ = (
        "backwards",
        "good_steps",
        "armed",
        "mismatch",
        "kept",
        "backoff",
        "wait",
        "write",
        "quiet",
        "marks",
        "phase",
    )

    def __init__(self) -> None:
        self.write = True  # this backward's gradients are written to NVMe too
        self.quiet = 0  # consecutive armed steps that needed no gradient after backward
        self.marks = (0, 0)  # the sink's (accumulations, p.grad changes) at the last step
        self.backwards = 0  # forwards with grad enabled since the last step
        self.good_steps = 0  # consecutive steps that had exactly one
        self.armed = False
        self.mismatch = False  # this step rolled back speculative updates that differed
        self.kept = False  # this step kept speculative updates (and rolled back none)
        self.backoff = 0  # "auto": steps to sit out after the next mismatch / 2
        self.wait = 0  # "auto": steps left to sit out
        # a step in backward (infinity.accumulate with an optimizer, .in_backward): None, or
        # "measure" (gradients measured in RAM, then dropped) or "step" (stepped from RAM,
        # committed in place)
        self.phase: Optional[str] = None


class BackwardOverlap:
    """Part of OffloadedAdam: the engine's backward listener (``grads_complete``,
    ``forward_started``) and the verification at step()."""

    def __init__(
        self, core: AdamCore, mode: Union[str, bool], keep_grads: Union[str, bool] = True
    ) -> None:
        # the core holds its optimizer weakly: the engine holds this listener, and an
        # optimizer dropped without close() must still be freed by reference counting
        self.core = core
        self.mode = check_overlap(mode)
        self.keep_grads = check_keep_grads(keep_grads)
        self.scaled = False  # clip_grad_norm_ or a grad multiplier since the last step
        self.unwritten_total = 0  # blocks whose gradients were stepped from RAM, never written
        self._models: Dict[OptimizerPort, _ModelState] = {}
        self._workers: Dict[OptimizerPort, _Worker] = {}
        self.kept_total = 0
        self.rolled_back_total = 0

    def _state(self, port: OptimizerPort) -> _ModelState:
        return self._models.setdefault(port, _ModelState())

    def set_phase(self, port: OptimizerPort, phase: Optional[str]) -> None:
        """A step in backward (:mod:`.in_backward`): the model's next backward "measure"s its
        gradients or "step"s them in place; None: plain backwards again."""
        if phase not in (None, "measure", "step"):
            raise ValueError(f"infinity.optim: no step-in-backward phase {phase!r} (bug)")
        self._state(port).phase = phase

    def phase(self, port: OptimizerPort) -> Optional[str]:
        return self._state(port).phase

    # ---- engine callbacks, through the port (under the engine's lock) ----------------------
    def forward_started(self, port: OptimizerPort) -> None:
        st = self._state(port)
        if port in self._workers:
            # another forward before opt.step(): gradient accumulation (or evaluation) --
            # nothing of this backward may reach the parameters the next forward reads
            self.rollback_model(port, "a forward ran before opt.step()")
            st.good_steps = 0
            st.quiet = 0
        if st.phase is not None:  # armed by .in_backward, which checked the model can be
            st.armed, st.write = True, False
            return
        if not torch.is_grad_enabled():
            st.armed = False
            return
        st.backwards += 1
        st.armed = self._may_arm(port, st)
        # p.grad changed since (a clip through p.grad, a replaced gradient): not quiet
        marks = (port.grads.accumulations, port.grads.user_grad_changes)
        if marks[1] != st.marks[1]:
            st.quiet = 0
        st.marks = marks
        st.write = not (
            st.armed and self.keep_grads == "auto" and st.quiet >= SKIP_AFTER and not self.scaled
        )

    def takes_in_ram(self, port: OptimizerPort, flat: Any) -> bool:
        """Just before a block's gradients are closed: True when this backward's update of
        that block will take them from RAM (the sink keeps them for the worker then, and
        writes them to NVMe too unless this backward skips the writes)."""
        st = self._models.get(port)
        if st is None or not st.armed:
            return False
        shard = self.core.wrapped.shards.get(id(flat))
        worker = self._workers.get(port)
        if shard is None or (
            worker is not None and (not worker.alive or shard.key in worker.specs)
        ):
            return False
        if not shard.runs():
            return False
        if st.phase is None and port.grads.accumulations != st.marks[0]:
            # this backward adds to gradients kept from before (no zero_grad since the
            # last step): the loop accumulates, so its gradients are written from now on
            st.write, st.quiet = True, 0
        return True

    def writes(self, port: OptimizerPort) -> bool:
        """Whether this backward's gradients taken from RAM are written to NVMe too."""
        st = self._models.get(port)
        return st is None or st.write

    def in_place(self, port: OptimizerPort) -> bool:
        """Whether this backward steps the blocks it takes in place (a step in backward):
        their gradients, norms included, are not needed after."""
        st = self._models.get(port)
        return st is not None and st.phase == "step"

    def _may_arm(self, port: OptimizerPort, st: _ModelState) -> bool:
        core = self.core
        if self.mode is False or not core.clean:
            return False  # a failed step to finish, or a multiplier set before backward
        if self.mode == "auto" and (st.good_steps < AUTO_AFTER or st.backwards != 1 or st.wait > 0):
            return False
        if self.mode is True and st.backwards != 1:
            return False
        if port.sharded:
            return False  # ZeRO: the norm and inf/nan check are all-reduced at step() (not built)
        store = core.wrapped.side(port).store
        if store is None or not store.speculates():
            return False
        shards = core.wrapped.shards_of(port)
        # parameters written since the last step (load_state_dict, an EMA copied back): the
        # step first takes them into the master weights, which a speculative update cannot
        return all(s.initialized and not s.flat.user_written for s in shards)

    def grads_complete(self, port: OptimizerPort, flat: Any) -> None:
        st = self._models.get(port)
        if st is None or not st.armed:
            return
        core = self.core
        shard = core.wrapped.shards.get(id(flat))
        if shard is None:
            return
        worker = self._workers.get(port)
        if worker is not None and shard.key in worker.specs:
            # the block's backward completed twice in one pass (a block run twice): the first
            # update saw part of its gradients
            worker.poisoned = f"{shard.key} completed its backward twice"
            return
        runs = shard.runs()
        norms = port.grads.slot_norms(flat)
        held = port.grads.held.holds(flat)
        if st.phase == "measure":  # measured when closed: the buffers go back, unwritten
            if held:
                port.grads.held.release_held(flat)
            return
        in_place = st.phase == "step"
        # a speculative update is verified against the norms (unknown: the step reads them);
        # one in place needs none (its multiplier was fixed before this backward)
        if not runs or (norms is None and not in_place):
            if held:  # (not reached: takes_in_ram asked for the same runs)
                port.grads.held.release_held(flat)
            return
        if worker is None:
            # a store that speculates (_may_arm) is the NVMe tier's
            store = cast(NvmeStates, core.wrapped.store(port))
            worker = _Worker(core, port, store, commit=in_place)
            self._workers[port] = worker
        if held and not port.grads.held.written(flat):
            self.unwritten_total += 1
        # in place: with the step's own multiplier (the clip measured before); else 1
        m = core.multiplier if in_place else 1.0
        hypers = tuple(_freeze(core.hyper(r, m)) for r in runs)
        worker.put(_Spec(shard, tuple(runs), hypers, norms, m), held)

    # ---- step side ---------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return bool(self._workers)

    def join(self) -> None:
        """Waits for every speculative update in flight (before anything else touches the
        states, the homes or the buffer sets)."""
        for worker in self._workers.values():
            worker.join()

    def rollback_model(self, port: OptimizerPort, why: str) -> None:
        worker = self._workers.pop(port, None)
        if worker is None:
            return
        worker.join()
        if worker.commit:  # committed as written: nothing to roll back
            error = self._settle_in_place(worker, self.core.multiplier, {}, failed=why)
            if error is not None:
                logger.warning("%s", error)
        else:
            self._rollback(worker, list(worker.computed), why)
        self._state(port).armed = False

    def rollback_all(self, why: str) -> None:
        for worker in list(self._workers.values()):
            self.rollback_model(worker.port, why)

    def _rollback(
        self, worker: _Worker, shards: List[Shard], why: str, keep_home: Tuple[Shard, ...] = ()
    ) -> None:
        """Forgets the shards' pending state writes and rewrites their parameters from the
        committed masters -- except ``keep_home``: shards the step redoes at once, over the
        same slots, whose parameters the user wrote after backward (the step takes those
        writes in first, then rewrites every stepped slot)."""
        if not shards:
            return
        logger.debug(
            "infinity.optim: rolling back %d speculative shard update(s): %s", len(shards), why
        )
        for shard in shards:
            worker.store.abort_shard(shard)
            if shard not in keep_home:
                self.core.mark_dirty(shard)
            # a gradient stepped from RAM and never written is gone with the update
            worker.port.grads.mark_lost(shard.flat, f"its update was undone ({why})")
        self.rolled_back_total += len(shards)
        self.core.restore_dirty()

    def settle(self, multiplier: float) -> Tuple[Dict[str, Shard], StepStats]:
        """At step() (workers joined, engines quiesced): commits the speculative updates that
        match this step exactly (their steps counted), rolls back the others; returns the kept
        shards and what the workers did. When an update must be redone but its gradients were
        stepped from RAM and never written, nothing is committed: every update is rolled back
        and a RuntimeError names the blocks and the remedy."""
        kept: Dict[str, Shard] = {}
        stats = StepStats()
        core = self.core
        # (worker, kept updates, updates to redo, why they differ)
        decided: List[Tuple[_Worker, List[Shard], List[Shard], str]] = []
        gone: List[Shard] = []  # updates to redo whose gradients are not on NVMe
        for key in list(self._workers):
            worker = self._workers.pop(key)
            worker.join()
            stats.merge(worker.stats)
            if worker.commit:
                self._settle_in_place(worker, multiplier, kept)
                continue
            grads = worker.port.grads
            if worker.error is not None or worker.poisoned is not None:
                why = worker.poisoned or f"the update failed ({worker.error})"
                redo = [spec.shard for spec in worker.specs.values()]
                decided.append((worker, [], list(worker.computed), why))
            else:
                good: List[Shard] = []
                bad: List[Shard] = []
                for shard in worker.computed:
                    spec = worker.specs[shard.key]
                    runs = shard.runs()
                    same = (
                        multiplier == 1.0
                        and tuple(runs) == spec.runs
                        and tuple(_freeze(core.hyper(r, 1.0)) for r in runs) == spec.hypers
                        and grads.slot_norms(shard.flat) is spec.norms
                        and not shard.flat.user_written
                    )
                    (good if same else bad).append(shard)
                why = (
                    "the step differs from what backward computed (clipping, loss scale, lr, "
                    "gradients or parameters changed)"
                )
                if multiplier != 1.0:
                    why = (
                        f"the step multiplies the gradients by {multiplier!r} (clip_grad_norm_ "
                        "that clipped, or a loss scale), which backward could not know"
                    )
                redo = bad
                decided.append((worker, good, bad, why))
            gone.extend(s for s in redo if not grads.held.written(s.flat) and s.runs())
        if gone:
            reason = decided[0][3] if len(decided) == 1 else "the step differs from backward's"
            for worker, _good, _bad, why in decided:
                self._rollback(worker, list(worker.computed), why)
                for spec in worker.specs.values():
                    worker.port.grads.mark_lost(spec.shard.flat, f"the step was undone ({why})")
                st = self._state(worker.port)
                st.mismatch, st.quiet = True, 0
            names = ", ".join(s.key for s in gone[:3]) + (" ..." if len(gone) > 3 else "")
            raise RuntimeError(
                f"infinity.optim: this step was not applied: {reason}, so the update computed "
                f"while backward ran must be redone, but the gradients of {len(gone)} block(s) "
                f"({names}) were stepped from RAM and not written to NVMe (keep_grads='auto' "
                "skips those writes once the loop's steps needed no gradient after backward). "
                "Call zero_grad(), run this batch's forward and backward again and step; use "
                "keep_grads=True (the default) for loops that clip, scale or change the step "
                "only sometimes"
            )
        for worker, good, bad, why in decided:
            if worker.error is not None or worker.poisoned is not None:
                self._rollback(worker, list(worker.computed), why)
                self._state(worker.port).mismatch = True
                continue
            if bad:
                self._state(worker.port).mismatch = True
            elif good:
                self._state(worker.port).kept = True
            written = tuple(
                s
                for s in bad
                if s.flat.user_written and tuple(s.runs()) == worker.specs[s.key].runs
            )
            self._rollback(worker, bad, why, keep_home=written)
            worker.store.commit_shards(good)
            for shard in good:
                shard.commit_steps()
                kept[shard.key] = shard
            self.kept_total += len(good)
        return kept, stats

    def _settle_in_place(
        self,
        worker: _Worker,
        multiplier: float,
        kept: Dict[str, Shard],
        failed: Optional[str] = None,
    ) -> Optional[RuntimeError]:
        """A step in backward (its units committed as written): the shards every unit of which
        took it are done (their steps counted). Nothing can be undone, so a worker that failed
        or an update that differs from this step raises, naming what took the step;
        ``failed``: the step is abandoned (why), and the error is returned instead."""
        store = worker.store
        took: List[Shard] = []
        missed: List[Shard] = []
        differ: List[Shard] = []
        for spec in worker.specs.values():
            shard = spec.shard
            if not store.extents.fully_stepped(shard, len(store.plan(shard).units)):
                missed.append(shard)
                continue
            runs = shard.runs()
            same = (
                multiplier == spec.multiplier
                and tuple(runs) == spec.runs
                and tuple(_freeze(self.core.hyper(r, multiplier)) for r in runs) == spec.hypers
                and not shard.flat.user_written
            )
            if not same:
                differ.append(shard)
            store.finish(shard)
            shard.commit_steps()
            kept[shard.key] = shard
            took.append(shard)
        self.kept_total += len(took)
        why = worker.poisoned or (f"{worker.error}" if worker.error is not None else None)
        why = failed or why
        if why is None and not missed and not differ:
            return None
        for shard in took:  # a failed step's record: a retry (or zero_grad) skips them
            self.core.done[shard.key] = shard
        for shard in missed:
            worker.port.grads.mark_lost(shard.flat, "their step in backward failed part way")
        names = ", ".join(s.key for s in (missed or differ)[:3])
        error = RuntimeError(
            f"infinity.optim: the step applied in backward (infinity.accumulate with an "
            f"optimizer) {'failed: ' + why if why else 'differs from opt.step()'}; "
            f"{len(took)} block(s) took it, {len(missed)} did not ({names}), and their "
            "gradients, stepped from RAM, were not kept. Committed states cannot be undone: "
            "load the last checkpoint (model and optimizer) and train on from there"
        )
        if failed is None:
            raise error
        return error

    def abandon_in_place(self, port: OptimizerPort, why: str) -> Optional[str]:
        """A step in backward that will not reach ``opt.step()`` (its backward raised): what
        took it is counted; returns what happened (None when nothing had started)."""
        worker = self._workers.pop(port, None)
        if worker is None:
            return None
        worker.join()
        self._state(port).armed = False
        if not worker.commit:
            self._rollback(worker, list(worker.computed), why)
            return None
        error = self._settle_in_place(worker, self.core.multiplier, {}, failed=why)
        return None if error is None else str(error)

    def grads_scaled(self) -> None:
        """clip_grad_norm_ or a grad multiplier was applied for the next step: gradients may
        be needed after backward, so "auto" keeps writing them for a while."""
        self.scaled = True

    def step_finished(self) -> None:
        """After a step: counts backwards per step for "auto", and backs off exponentially
        (1, 2, 4 .. 64 steps) after steps whose speculative updates had to be redone (a loss
        scaler's multiplier, clipping that keeps triggering), so such loops do not pay a
        rollback every step. Counts the armed steps that needed no gradient after backward
        (``keep_grads="auto"`` skips the writes after :data:`SKIP_AFTER` of them)."""
        for st in self._models.values():
            st.good_steps = st.good_steps + 1 if st.backwards == 1 else 0
            quiet = st.kept and not st.mismatch and not self.scaled and st.backwards == 1
            st.quiet = st.quiet + 1 if quiet else 0
            st.backwards = 0
            st.armed = False
            st.wait = max(0, st.wait - 1)
            if st.mismatch:
                st.backoff = min(64, max(1, 2 * st.backoff))
                st.wait = st.backoff
                st.mismatch = False
            elif st.kept:
                st.backoff = 0
            st.kept = False
        self.scaled = False

    def homes_needed(self, port: OptimizerPort) -> None:
        """The engine reads or replaces its parameter homes outside forward (materialized, a
        checkpoint, ``quiesce``): the speculative updates in flight finish writing first, so
        the homes hold whole updated blocks (kept or rolled back at ``opt.step()``)."""
        worker = self._workers.get(port)
        if worker is not None:
            worker.join()

    def engine_closing(self, port: OptimizerPort) -> None:
        """unwrap() between backward and step: the parameters go back without that step."""
        self.rollback_model(port, "the model is being unwrapped")

    def close(self) -> None:
        self.rollback_all("the optimizer is closing")


def _freeze(hyper: Dict[str, Any]) -> Tuple[Tuple[str, Any], ...]:
    return tuple(sorted(hyper.items()))
