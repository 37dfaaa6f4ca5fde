"""OffloadedAdam: a torch.optim.Optimizer whose fp32 master weights and moments live in host RAM
or on NVMe, stepped by the native CPU Adam (``infinity.ops.cpu_adam_step``).

Design notes: docs/modules.md, optim/adam.py."""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union, overload

import torch

from .. import trace_events
from ..ops.bf16_master import check_master
from ..runtime.port import OptimizerPort
from ..sizes import Size, parse_size
from ..tiers.chunk_size import check_chunk_bytes
from .checks import GradientChecks
from .core import AdamCore
from .in_backward import StepInBackward, find_port
from .overlap import BackwardOverlap
from .state_dicts import StateDicts
from .states.store import OptimizerStateIOError
from .step.choices import FormatChoices
from .step.common import ShardState, _check_hyper  # noqa: F401 (ShardState re-exported)
from .step.formats import MIN_8BIT_SIZE, FormatSpec, format_summary
from .step.formats import States as StatesArg
from .step.shard import Shard
from .step.stats import StepStats

logger = logging.getLogger(__name__)

# the state of the live infinity optimizers (for infinity.stats: which formats a wrapped
# model's states use, and their NVMe bytes)
_LIVE: weakref.WeakSet[AdamCore] = weakref.WeakSet()


def state_formats_of(engine: Any) -> Dict[str, Dict[str, int]]:
    """``{format: {"params", "numel", "moment_bytes"}}`` of the wrapped model's parameters
    that live infinity optimizers step (each parameter once; {} when none does)."""
    seen: Dict[int, Tuple[int, str]] = {}
    flats = OptimizerPort.of(engine).flats
    numel = {id(s.param): s.numel for f in flats for s in f.slots}  # whole params
    for core in list(_LIVE):
        for p in core.param_index():
            if id(p) in numel and id(p) not in seen:
                seen[id(p)] = (numel[id(p)], core.formats.format_of(p))
    return format_summary(seen.values())


def swap_bytes_of(engine: Any) -> Dict[str, int]:
    """The NVMe optimizer-state bytes of the live infinity optimizers stepping ``engine``'s
    model, by category (see :meth:`.nvme_states.NvmeStates.swap_bytes`; {} when none)."""
    out: Dict[str, int] = {}
    port = OptimizerPort.of(engine)
    for core in list(_LIVE):
        store = core.wrapped.side(port).store if port in core.wrapped.ports() else None
        for k, v in (store.swap_bytes() if store is not None else {}).items():
            out[k] = out.get(k, 0) + v
    return out


class OffloadedAdam(torch.optim.Optimizer):
    """Adam / AdamW with states in HOST or NVMe; see the module docstring.

    Args:
        params: parameters or param groups, as for torch.optim.
        lr, betas, eps, weight_decay: as torch.optim.AdamW / Adam.
        adamw: True: decoupled weight decay (AdamW); False: L2 added to the gradient (Adam).
        check_finite: whether a step first checks its gradients for inf/nan. "auto" (the
            default) checks only where it costs no pass over the gradients: gradients on NVMe
            (the engine measured them while they were in RAM), after ``clip_grad_norm_`` (a
            non-finite norm), and with a :class:`LossScaler` (which checks, as fp16 needs).
            True: always (one extra read pass over gradients in RAM); False: never, like
            torch.optim. A step found to have inf/nan gradients is not applied: it is
            skipped, logged and counted in ``skipped_steps``.
        states: the format of the moments (master weights stay fp32 in every format):
            "fp32" (default; 12 bytes per parameter with the master), "bf16" (bf16 moments,
            rounded to nearest even after each step; 8 B/param) or "8bit" (block-wise 8-bit
            moments: 256-element blocks per parameter, one byte per element -- a small float
            relative to the block's power-of-two unit -- and one fp32 scale each; ~6.03
            B/param; :mod:`infinity.ops.q8_format`). The update itself is the fp32
            kernel's, from the widened moments (``infinity.ops.adam_compact``). Applies to
            wrapped shards (host and NVMe; NVMe extents and transfers shrink with it) and to
            unwrapped parameters. Per parameter: a dict ``{nn.Parameter | nn.Module |
            "default": format}`` or a callable ``f(param) -> format or None`` (see
            :mod:`infinity.optim.step.formats`; one shard may then hold several formats, each in
            its own region). Where a parameter's format would be "8bit", bitsandbytes'
            safeguards are the defaults: fewer than ``min_8bit_size`` elements keep fp32
            moments, and so do the weights of ``nn.Embedding`` modules of a wrapped model
            (a weight tied to a head too) unless named explicitly
            (``states={"default": "8bit", model.embed: "8bit"}``); :meth:`state_formats`
            tells each parameter's. ``state_dict`` always holds fp32 moments (plus top-level
            ``"states"``: the default format, and ``"state_formats"``: per parameter index);
            loading re-quantizes them into each parameter's format, bitwise for moments that
            came from the same format.
        min_8bit_size: parameters with fewer elements keep fp32 moments where their format
            would be "8bit" (bitsandbytes' name and default: 4096; 0: none).
        master: the format of the master weights: "fp32" (default, 4 B/param), "bf16_sr"
            (bf16, each step's fp32 result stochastically rounded: 2 B/param) or
            "bf16_kahan" (bf16 plus a bf16 compensation term: 4 B/param, deterministic,
            ~16 significant bits); any moment format (``infinity.ops.bf16_master``). With a
            bf16 master every parameter has its master in the optimizer state (fp32 params
            too) and the working copy is written from it, so the model runs on the master's
            value. ``state_dict`` holds the master's value in fp32 (plus a top-level
            ``"master"`` entry) and loads into any master format: bf16_sr rounds to nearest
            even (exact for values saved from a bf16 master), fp32 takes it as is. Not with
            ZeRO-sharded models (DDP/ZeRO state code reads fp32 masters).
        sr_seed: seed of the stochastic rounding (bf16_sr): the random bits of an element are
            a hash of (sr_seed, its step count, its index), reproducible and independent of
            threads and shard layout. An int in [0, 2**64).
        overlap: whether a block's update may start during backward, as soon as its gradients
            are complete (:mod:`infinity.optim.overlap`): "auto" (default) once the loop has
            stepped after every backward for two steps, True for every backward, False never.
            Only models whose gradients and states are on NVMe. Exact in every case: an update
            that differs from what ``step()`` computes (clipping that triggers, loss scaling,
            an lr change, gradient accumulation) is rolled back and redone. The update takes
            each block's gradients from RAM (never read back from NVMe).
        keep_grads: with the step overlapping backward, whether the gradients are also
            written to NVMe (:mod:`infinity.optim.overlap`). True (default): always, so a
            step that must be redone, ``p.grad`` and accumulation decided late work in every
            case. "auto": written while the loop may need them after backward (clipping, a
            loss scale, ``p.grad`` changed, accumulation), skipped once an armed step showed
            it does not: 4 bytes per parameter and step less to write. Where a skipped
            gradient is needed after all (the loop changed: clipping that clips, an lr or a
            parameter changed between backward and step, a failed speculative update, a
            second micro-batch), nothing is guessed: the step is not applied and raises,
            naming the remedy, and ``p.grad`` of fp32 parameters raises when used.
        chunk_bytes: with states on NVMe, a shard whose states are larger than this is read,
            stepped and written in element ranges (units) of about this many bytes, so the
            step's buffer sets are bounded by it, not by the largest shard (the result is bit
            for bit the same). Where the engine keeps gradients and/or parameters on NVMe, a
            unit's gradients are read and its updated working copy written in whole pieces
            of their swap files through the same set, and the chunk covers those too (plus
            up to three pieces when a piece is not small against the chunk). A positive
            multiple of 4096 (an int or a size string such as "64MiB"); None (default): the
            wrapped model's ``chunk_bytes`` policy, else derived from its ``host_budget``
            (:func:`infinity.tiers.chunk_size.resolve_chunk_bytes`). With a ``host_budget``,
            the buffer sets are counted in it when the optimizer is constructed: below the
            minimum (3 sets) the constructor raises, naming the bytes needed; above it, the
            number of sets adapts to what is left.

    The tier of the states of each wrapped model is chosen by ``choose_tier`` (from the
    model's ``optimizer_tier`` policy) when the optimizer is constructed if the model has a
    ``host_budget``, else at the first step. After each step,
    ``last_step_stats`` (a :class:`StepStats`) holds time, bytes moved and the share of NVMe
    traffic hidden behind compute.
    """

    # read by the engine's guard on torch optimizers: this one reads the engine's gradients
    infinity_reads_engine_gradients = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        check_finite: Union[bool, str] = "auto",
        states: StatesArg = "fp32",
        overlap: Union[bool, str] = "auto",
        master: str = "fp32",
        sr_seed: int = 0,
        min_8bit_size: int = MIN_8BIT_SIZE,
        chunk_bytes: Optional[Size] = None,
        keep_grads: Union[bool, str] = True,
    ) -> None:
        chunk = check_chunk_bytes(
            parse_size(chunk_bytes, "chunk_bytes") if isinstance(chunk_bytes, str) else chunk_bytes,
            "infinity.optim",
        )
        spec = FormatSpec(states, min_8bit_size)
        self.states_format = spec.default  # the default format's name
        self.min_8bit_size = spec.min_8bit_size
        self.master_format = check_master(master)
        if isinstance(sr_seed, bool) or not isinstance(sr_seed, int) or not 0 <= sr_seed < 1 << 64:
            raise ValueError(
                f"infinity.optim: sr_seed must be an int in [0, 2**64), got {sr_seed!r}"
            )
        self.sr_seed = sr_seed
        if check_finite not in (True, False, "auto"):
            raise ValueError(f"check_finite must be True, False or 'auto', got {check_finite!r}")
        self.check_finite = check_finite
        # what the step works on, owned here (the overlap, checks and state dicts share it;
        # public: tests and tools read its stores and shards through it)
        self.core = AdamCore(
            self, FormatChoices(spec), self.master_format, sr_seed, bool(adamw), chunk
        )
        self._overlap = BackwardOverlap(self.core, overlap, keep_grads)
        self._checks = GradientChecks(self.core, self._overlap.grads_scaled)
        # the state dicts and the streamed per-shard state access that ZeRO state dicts and
        # checkpoints use (shard_states, load_shard, current_states, committed_extent, ...)
        self.state_dicts = StateDicts(self.core, self._overlap.rollback_all)
        self._skip_next = False  # skip_next_step()
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        _check_hyper(defaults)
        self.skipped_steps = 0
        self.last_step_stats: Optional[StepStats] = None
        super().__init__(params, defaults)
        _LIVE.add(self.core)
        try:
            self.core.wrapped.reserve()
        except BaseException:
            self.close()
            raise

    # ---- param groups, where states live -----------------------------------------------------
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyper(group)
        index = len(self.param_groups) - 1
        core = self.core
        core.params_changed()
        for p in group["params"]:
            loc = OptimizerPort.locate(p)
            if loc is not None and loc.port.sharded and self.master_format != "fp32":
                raise ValueError(
                    f"infinity.optim: master={self.master_format!r} is not supported with "
                    "ZeRO-sharded models (their state and checkpoint code reads fp32 masters); "
                    "use master='fp32' (compact moments, states='bf16'/'8bit', still work)"
                )
            core.wrapped.add(p, loc, index, self._overlap)

    def state_formats(self, by: str = "name") -> Dict[Union[str, int], str]:
        """The moment format of each parameter: ``{key: "fp32" | "bf16" | "8bit"}``, keys
        the parameter's qualified name in its wrapped model (``by="name"``; unwrapped
        parameters, and a name that two wrapped models share, by their index in the param
        groups' order, as in ``state_dict()``) or that index for all (``by="index"``)."""
        if by not in ("name", "index"):
            raise ValueError(f"infinity.optim: state_formats(by=) is 'name' or 'index', got {by!r}")
        core = self.core
        out: Dict[Union[str, int], str] = {}
        names: Dict[int, str] = {}  # id(param) -> its qualified name in its wrapped model
        for port in core.wrapped.ports() if by == "name" else ():
            for flat in port.flats:
                for s in flat.slots:
                    names.setdefault(id(s.param), s.qualname)
        for i, p in enumerate(core.param_index()):
            key = names.get(id(p), i)
            out[key if key not in out else i] = core.formats.format_of(p)
        return out

    @property
    def state_bytes(self) -> Dict[str, int]:
        """Bytes of optimizer states held per tier ("host"; "nvme": the live extents of the
        state file, committed states plus writes not yet committed)."""
        out = {"host": 0, "nvme": 0}
        for store in self.core.wrapped.stores():
            out[store.tier] += store.nbytes
        return out

    @property
    def state_tiers(self) -> Dict[str, str]:
        """Where each wrapped shard's states live ("host"/"nvme"), once chosen."""
        wrapped = self.core.wrapped
        tiers = {side.port: side.store.tier for side in wrapped.sides() if side.store is not None}
        return {s.key: tiers[s.port] for s in wrapped.shards.values() if s.port in tiers}

    # ---- gradients: finiteness, clipping, multipliers ----------------------------------------
    def grads_finite(self) -> bool:
        """True when no gradient this optimizer would apply holds an inf or nan. Gradients on
        NVMe were checked by the engine while they were in RAM, so they are not read back."""
        return self._checks.grads_finite()

    def set_grad_multiplier(
        self, factor: float, *, finite: Optional[bool] = None, source: str = ""
    ) -> None:
        """Multiplies every gradient by ``factor`` in the next step (inside the kernel; the
        stored gradients are not changed). ``finite``: the caller already checked them."""
        self._checks.set_grad_multiplier(factor, finite=finite, source=source)

    def step_in_backward(self, engine: Any) -> Optional[StepInBackward]:
        """The step of ``engine``'s model taken inside its next backward, block by block from
        RAM (:mod:`infinity.optim.in_backward`; ``infinity.accumulate`` with an optimizer
        drives it), or None where it cannot be (logged: ``opt.step()`` then steps after
        backward as usual)."""
        port = find_port(self.core, engine)
        if port is None:
            return None
        why = StepInBackward.why_not(self.core, port)
        if port.sharded and port.all_reduce(0.0 if why is None else 1.0, "max") > 0.0:
            # every rank steps in backward, or none: the ranks' steps must be the same
            why = why or "another rank's step cannot be taken in backward"
        if why is not None:
            logger.info("infinity.optim: the step is taken after backward: %s", why)
            return None
        return StepInBackward(self.core, self._overlap, port)

    def skip_next_step(self) -> None:
        """The next ``step()`` does nothing: the step it stands for was taken already (by
        ``infinity.accumulate(..., optimizer=self)``, for a trainer whose loop calls
        ``step()`` after the accumulation; ``integrations.hf_trainer``). It raises instead if
        gradients are waiting then (they would be lost)."""
        self._skip_next = True

    def discard_pending_step(self) -> None:
        """Forgets multipliers and checks meant for a step that will not happen."""
        self.core.discard_pending()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of the next step by their global norm; returns that norm.

        Computed over every gradient this optimizer will apply: the ready slots of the wrapped
        models' offloaded gradients (``flat.grad``) and ``p.grad`` of unwrapped parameters,
        like ``torch.nn.utils.clip_grad_norm_`` (norm of per-tensor norms, coefficient
        ``min(1, max_norm / (norm + 1e-6))``). The coefficient is applied inside the next
        ``step()`` through the kernel's grad multiplier, so no extra pass rewrites the
        gradients (they read unclipped until then). Note: ``torch.nn.utils.clip_grad_norm_(
        model.parameters())`` does not work on a wrapped model: its parameters have
        ``p.grad = None`` (the gradients live only in the engine's buffers). A non-finite
        norm marks the next step to be skipped. After ``LossScaler.unscale_`` the norm is
        that of the unscaled gradients.
        """
        return self._checks.clip(max_norm, norm_type)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Alias of :meth:`clip_grad_norm_`, the name trainers (HF Trainer, accelerate) look
        for on an optimizer that clips its own gradients."""
        return self._checks.clip(max_norm, norm_type)

    # ---- step ---------------------------------------------------------------------------------
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._skip_next:
            self._skip_next = False
            self._checks.check_nothing_waiting()
            return loss
        t0 = time.perf_counter()
        core, checks, overlap = self.core, self._checks, self._overlap
        multiplier, finite = core.multiplier, core.finite
        core.discard_pending()
        stats = StepStats()
        self.last_step_stats = stats
        overlap.join()  # updates started during backward: done before anything else runs
        ports = core.wrapped.ports()
        try:
            for group in self.param_groups:
                _check_hyper(group)
            for port in ports:
                port.engine.quiesce()
            checks.check_lost()
            if finite is None and self.check_finite is True:
                finite = checks.grads_finite()
            elif finite is None and self.check_finite == "auto":
                finite = checks.known_finite()
            finite = checks.agree_finite(finite)  # sharded: every rank skips, or none
        except BaseException:
            overlap.rollback_all("the step raised before applying them")
            raise
        if finite is False:
            overlap.rollback_all("the gradients hold inf/nan")
            overlap.step_finished()
            self.skipped_steps += 1
            stats.skipped = True
            logger.warning(
                "infinity.optim: gradients contain inf/nan; step skipped (%d skipped so far)",
                self.skipped_steps,
            )
            return loss
        try:
            if overlap.pending:
                kept, done_early = overlap.settle(multiplier)
                stats.merge(done_early)
                stats.overlapped_shards = len(kept)
                stats.overlap_s = done_early.compute_s + done_early.io_wait_s
                for shard in kept.values():
                    core.done[shard.key] = shard
                    stats.shards += 1
                    stats.params += sum(s.numel for s in shard.flat.slots)
            core.restore_dirty()
            for shard in core.wrapped.shards.values():
                core.sync_user_writes(shard)
            work = core.work(multiplier, stats)
            for port in ports:
                mine = [s for s in core.wrapped.shards_of(port) if work.steps(s)]
                if mine:
                    core.wrapped.store(port).step(mine, work)
            stats.params += core.params.step(
                self.param_groups,
                self.state,
                core.wrapped.is_wrapped,
                core.formats.format_of,
                core.element_base,
                multiplier,
            )
        except BaseException as exc:
            # re-armed: calling step() again retries this same step (clipping included)
            core.multiplier, core.finite = multiplier, finite
            if isinstance(exc, Exception):  # not an interrupt: the other ranks raise too
                checks.agree_step(exc)
            raise
        checks.agree_step(None)
        core.done.clear()
        overlap.step_finished()
        stats.step_s = time.perf_counter() - t0
        trace_events.span("optimizer_step", "step", stats.bytes_written, t0)
        # the step's NVMe period closes before the next forward's prefetch starts (resume), so
        # that prefetch counts in the next step's bytes whatever the timing
        for port in ports:
            port.engine.record_optimizer_step(stats)
        for port in ports:
            port.engine.resume()
        return loss

    def restore_parameters(self) -> None:
        """After a failed step: rewrites the working copies it had already updated from the
        committed masters (step() does this first anyway)."""
        self.core.restore_dirty()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients. Wrapped models: ``engine.zero_grad()`` (the whole model's
        accumulated gradients are forgotten; the next backward overwrites them -- with
        ``set_to_none=False`` too, where a parameter without a new gradient is then skipped
        rather than stepped with a zero gradient). Unwrapped parameters: as torch."""
        core = self.core
        self._overlap.rollback_all("zero_grad() before opt.step()")
        if core.done:
            logger.warning(
                "infinity.optim: zero_grad() after a failed step that %d shard(s) had "
                "already taken; the others skip it",
                len(core.done),
            )
            core.done.clear()
        for port in core.wrapped.ports():
            store = core.wrapped.side(port).store
            partial = store.partial if store is not None else []
            if store is not None and partial:
                logger.warning(
                    "infinity.optim: zero_grad() after a failed step that shard(s) %s "
                    "had taken part way: their units that took it keep it (their "
                    "step count does not), the others skip it",
                    ", ".join(partial),
                )
                for shard in core.wrapped.shards_of(port):
                    if shard.key in partial:
                        store.finish(shard)
        for port in core.wrapped.ports():
            port.engine.zero_grad()
        super().zero_grad(set_to_none=set_to_none)

    # ---- state dicts (torch's format) and streamed per-shard access ---------------------------
    def state_dict(self, *, wrapped: bool = True) -> Dict[str, Any]:
        """torch's format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq", "master"}},
        "param_groups": [...], "states": "fp32" | "bf16" | "8bit" (the default format),
        "state_formats": {index: format}, "master": "fp32" | "bf16_sr" | "bf16_kahan"}``;
        ``master`` is the fp32 value of the master weight (for unwrapped fp32 CPU parameters
        the parameter itself is the master and no entry is stored); the moments are fp32 in
        every state format (compact ones dequantized: exactly the values the next step starts
        from). ``wrapped=False`` leaves out the wrapped models' shards (see
        ``state_dicts.shard_states()``)."""
        return self.state_dicts.state_dict(wrapped=wrapped)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state from :meth:`state_dict` (or torch.optim.Adam/AdamW's: without a
        ``master`` the current parameter value is the master). The fp32 moments are stored in
        each parameter's state format in this optimizer, whatever the saved ``"states"`` /
        ``"state_formats"`` were (bf16: rounded; 8bit: quantized; moments saved from the same
        format come back bitwise). A state of another model (other number of groups/parameters
        or shapes) raises ValueError and changes nothing."""
        self.state_dicts.load_state_dict(state_dict)

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Releases host buffers and removes the NVMe state files (the optimizer is unusable
        afterwards)."""
        core = self.__dict__.get("core")
        if core is None:
            return
        _LIVE.discard(core)
        overlap = self.__dict__.get("_overlap")
        if overlap is not None:
            overlap.close()
        core.wrapped.close(overlap)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- public faces of the state above for ZeRO state dicts and checkpoints -------------
    def engines(self) -> List[Any]:
        """The engines of the wrapped models this optimizer steps (sharded ones where this
        rank holds no part included), in the same order on every rank."""
        return [port.engine for port in self.core.wrapped.ports()]

    def shards(self) -> List[Shard]:
        """This rank's wrapped shards (of a sharded model: its part of each flat)."""
        return list(self.core.wrapped.shards.values())

    def give_back_disk(self) -> int:
        """Gives back to the filesystem the free blocks the NVMe state files keep between
        steps for the next step's new states (a step that overlaps backward keeps up to its
        stepped set's states: 12 B per stepped parameter with fp32 states), for example before
        writing something else to the same disk; ``infinity.save_checkpoint`` does this first.
        The next step allocates them again. Returns the bytes given back."""
        return sum(store.give_back_disk() for store in self.core.wrapped.stores())


class AdamW(OffloadedAdam):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2) with offloaded states."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=True, **kwargs
        )


class Adam(OffloadedAdam):
    """torch.optim.Adam (L2 weight decay added to the gradient, default 0) with offloaded
    states."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=False, **kwargs
        )


__all__ = [
    "OffloadedAdam",
    "AdamW",
    "Adam",
    "OptimizerStateIOError",
    "ShardState",
    "state_formats_of",
]
