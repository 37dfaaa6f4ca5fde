"""OffloadedAdam: a torch.optim.Optimizer whose fp32 master weights and moments live in host RAM
or on NVMe, stepped by the native CPU Adam (``infinity.ops.cpu_adam_step``).

Parameters of a model wrapped by ``infinity.wrap`` are stepped shard by shard (one shard = one
block's FlatParam): their gradients come from the engine's gradient source (in RAM, or read
from its swap files; the optimizer sees only ``engine.grads``' narrow interface;
``p.grad`` stays None), the states come from :mod:`.state_store`, and the updated working copy
(the parameter's home dtype: fp32, bf16 or fp16) is written in the same kernel pass into the
parameter's home (host), into a staging buffer written to the parameter swap file (NVMe), or
into the resident buffer (device). Parameters that are not wrapped are stepped one by one with
the same kernel and per-parameter state, like torch.

Opt-in compact states (``states="bf16"`` or ``"8bit"``) shrink the two moments to 4 or ~2.03
bytes per parameter; opt-in bf16 master weights (``master="bf16_sr"`` stochastic rounding,
2 bytes, or ``"bf16_kahan"``, 2 + 2 bytes) shrink the fp32 master too; see
:class:`OffloadedAdam`, :mod:`infinity.ops.bf16_master` and :class:`.state_store.StateLayout`.

Semantics follow torch.optim.AdamW / Adam: per-parameter step counts (a parameter without a
gradient in a step is left alone and its step does not advance), hyper-parameters read from each
param group at every step (LR schedulers work), ``state_dict`` in torch's format plus an fp32
``master`` entry per parameter.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .. import trace_events
from ..ops.bf16_master import check_master
from ..runtime.engine import Engine, locate
from .choices import FormatChoices
from .formats import MIN_8BIT_SIZE, FormatSpec, States as StatesArg, format_summary
from .param_states import ParamStates
from .state_store import (OptimizerStateIOError, Run as _Run, Shard, StateStore as States,
                          choose_tier, engine_bytes_later, new_store, state_nbytes)
from ._common import ShardState, _check_hyper, _float  # noqa: F401 (ShardState re-exported)
from .grad_checks import GradientChecks
from .overlap import BackwardOverlap
from .state_dicts import StateDicts
from .chunks import Unit
from .shard_update import update_shard, update_unit
from .step_work import StepWork
from .swapper import BufferSets, StepStats
from ..sizes import Size, parse_size
from ..tiers.chunk_size import check_chunk_bytes, resolve_chunk_bytes

logger = logging.getLogger(__name__)

# the live infinity optimizers (for infinity.stats: which formats a wrapped model's states use)
_LIVE: "weakref.WeakSet[OffloadedAdam]" = weakref.WeakSet()


def state_formats_of(engine: Engine) -> Dict[str, Dict[str, int]]:
    """``{format: {"params", "numel", "moment_bytes"}}`` of the wrapped model's parameters
    that live infinity optimizers step (each parameter once; {} when none does)."""
    seen: Dict[int, Tuple[int, str]] = {}
    numel = {id(s.param): s.numel for f in engine.flats for s in f.slots}  # whole params
    for opt in list(_LIVE):
        for p in opt._param_index():
            if id(p) in numel and id(p) not in seen:
                seen[id(p)] = (numel[id(p)], opt._formats.format_of(p))
    return format_summary(seen.values())


def swap_bytes_of(engine: Engine) -> Dict[str, int]:
    """The NVMe optimizer-state bytes of the live infinity optimizers stepping ``engine``'s
    model, by category (see :meth:`.nvme_states.NvmeStates.swap_bytes`; {} when none)."""
    out: Dict[str, int] = {}
    for opt in list(_LIVE):
        store = opt._stores.get(id(engine))
        for k, v in (store.swap_bytes() if store is not None else {}).items():
            out[k] = out.get(k, 0) + v
    return out


class OffloadedAdam(GradientChecks, StateDicts, torch.optim.Optimizer):
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
            moments with a dynamic map, as bitsandbytes' 8-bit Adam: 256-element blocks per
            parameter, one fp32 absmax each; ~6.03 B/param). The update itself is the fp32
            kernel's, from the widened moments (``infinity.ops.adam_compact``). Applies to
            wrapped shards (host and NVMe; NVMe extents and transfers shrink with it) and to
            unwrapped parameters. Per parameter: a dict ``{nn.Parameter | nn.Module |
            "default": format}`` or a callable ``f(param) -> format or None`` (see
            :mod:`infinity.optim.formats`; one shard may then hold several formats, each in
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

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, adamw: bool = True,
                 amsgrad: bool = False, maximize: bool = False,
                 check_finite: Union[bool, str] = "auto", states: StatesArg = "fp32",
                 overlap: Union[bool, str] = "auto", master: str = "fp32",
                 sr_seed: int = 0, min_8bit_size: int = MIN_8BIT_SIZE,
                 chunk_bytes: Optional[Size] = None,
                 keep_grads: Union[bool, str] = True) -> None:
        self._chunk_arg = check_chunk_bytes(parse_size(chunk_bytes, "chunk_bytes")
                                            if isinstance(chunk_bytes, str) else chunk_bytes,
                                            "infinity.optim")
        self._format_spec = FormatSpec(states, min_8bit_size)
        self.states_format = self._format_spec.default  # the default format's name
        self.min_8bit_size = self._format_spec.min_8bit_size
        self._formats = FormatChoices(self._format_spec)  # each parameter's moment format
        self.master_format = check_master(master)
        if isinstance(sr_seed, bool) or not isinstance(sr_seed, int) \
                or not 0 <= sr_seed < 1 << 64:
            raise ValueError(f"infinity.optim: sr_seed must be an int in [0, 2**64), got "
                             f"{sr_seed!r}")
        self.sr_seed = sr_seed
        self._element_bases: Optional[Dict[int, int]] = None
        self._overlap = BackwardOverlap(self, overlap, keep_grads)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        _check_hyper(defaults)
        self._adamw = bool(adamw)
        self._params = ParamStates(self.master_format, sr_seed, self._adamw)  # unwrapped ones
        if check_finite not in (True, False, "auto"):
            raise ValueError(f"check_finite must be True, False or 'auto', got {check_finite!r}")
        self.check_finite = check_finite
        self._shards: Dict[int, Shard] = {}       # id(flat) -> shard, in registration order
        self._sharded_engines: Dict[int, Engine] = {}  # ZeRO: engines, with or without shards
        self._elsewhere: set = set()  # ZeRO: ids of parameters other ranks step
        self._wrapped: Dict[int, Tuple[Shard, int]] = {}  # id(param) -> (shard, slot)
        self._stores: Dict[int, States] = {}      # id(engine) -> its state store
        self._dirty: Dict[str, Shard] = {}        # homes that may not match committed masters
        self._done: Dict[str, Shard] = {}         # shards a failed step already applied
        self._multiplier = 1.0
        self._finite: Optional[bool] = None
        self.skipped_steps = 0
        self.last_step_stats: Optional[StepStats] = None
        super().__init__(params, defaults)
        _LIVE.add(self)
        self._reserve_buffers()

    # =====================================================================================
    # param groups and shards
    # =====================================================================================
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyper(group)
        index = len(self.param_groups) - 1
        self._element_bases = None
        for p in group["params"]:
            loc = locate(p)
            if loc is not None and loc.engine.partitioner is not None \
                    and self.master_format != "fp32":
                raise ValueError(
                    f"infinity.optim: master={self.master_format!r} is not supported with "
                    "ZeRO-sharded models (their state and checkpoint code reads fp32 masters); "
                    "use master='fp32' (compact moments, states='bf16'/'8bit', still work)")
            self._formats.choose(p, loc)
            if loc is not None and loc.engine.partitioner is not None:
                loc.engine.attach_optimizer()  # stepped even where this rank holds no part
                self._sharded_engines.setdefault(id(loc.engine), loc.engine)
                loc = loc.engine.partitioner.location(loc)  # this rank's part (or none)
                if loc is None:  # another rank steps it: never an unwrapped parameter here
                    self._elsewhere.add(id(p))
            if loc is None:
                continue
            shard = self._shards.get(id(loc.flat))
            if shard is None:
                shard = Shard(loc.engine, loc.flat, [None] * len(loc.flat.slots),
                              formats=self._formats.slot_formats(loc.engine, loc.flat))
                self._shards[id(loc.flat)] = shard
            shard.groups[loc.slot] = index
            self._wrapped[id(p)] = (shard, loc.slot)
            loc.engine.attach_optimizer()  # the engine prefetches after our step
            if self._overlap not in loc.engine.backward_listeners:
                loc.engine.backward_listeners.append(self._overlap)

    def state_formats(self, by: str = "name") -> Dict[Union[str, int], str]:
        """The moment format of each parameter: ``{key: "fp32" | "bf16" | "8bit"}``, keys
        the parameter's qualified name in its wrapped model (``by="name"``; unwrapped
        parameters, and a name that two wrapped models share, by their index in the param
        groups' order, as in ``state_dict()``) or that index for all (``by="index"``)."""
        if by not in ("name", "index"):
            raise ValueError(f"infinity.optim: state_formats(by=) is 'name' or 'index', got "
                             f"{by!r}")
        out: Dict[Union[str, int], str] = {}
        names: Dict[int, str] = {}  # id(param) -> its qualified name in its wrapped model
        for engine in (self._engines() if by == "name" else ()):
            for flat in engine.flats:
                for s in flat.slots:
                    names.setdefault(id(s.param), s.qualname)
        for i, p in enumerate(self._param_index()):
            key = names.get(id(p), i)
            out[key if key not in out else i] = self._formats.format_of(p)
        return out

    def _is_wrapped(self, p: torch.Tensor) -> bool:
        if id(p) in self._elsewhere:
            return True
        return id(p) in self._wrapped and self._wrapped[id(p)][0].flat.slots[
            self._wrapped[id(p)][1]].param is p

    def _engines(self) -> List[Engine]:
        seen: Dict[int, Engine] = dict(self._sharded_engines)
        for shard in self._shards.values():
            seen.setdefault(id(shard.engine), shard.engine)
        return list(seen.values())

    def _store(self, engine: Engine, later: int = 0) -> States:
        """The engine's state store, created on first use (``later``: host bytes the engine
        still takes from its budget, set aside when the tier is chosen before the first
        backward)."""
        store = self._stores.get(id(engine))
        if store is None:
            shards = [s for s in self._shards.values() if s.engine is engine
                      and any(g is not None for g in s.groups)]
            flats, fmts = [s.flat for s in shards], [s.formats for s in shards]
            master = self.master_format
            tier = choose_tier(engine, flats, fmts, master, later)
            store = new_store(tier, engine, master, self._chunk_for(engine), self._shards)
            present = sorted({f for ff in fmts for f in ff})
            logger.info("infinity.optim: %s bytes of %s optimizer states (%s master) on %s",
                        f"{sum(state_nbytes(f, ff, master) for f, ff in zip(flats, fmts)):,}",
                        "+".join(present) or self.states_format, master, tier)
            self._stores[id(engine)] = store
        return store

    def _chunk_for(self, engine: Engine) -> int:
        """The chunk of this engine's NVMe step: ``chunk_bytes=`` given here, else the engine's
        policy, else derived from its host budget."""
        if self._chunk_arg is not None:
            return self._chunk_arg
        return resolve_chunk_bytes(getattr(engine.policy, "chunk_bytes", None),
                                   engine.host_budget.limit, "infinity.optim")

    def _reserve_buffers(self) -> None:
        """With a host budget: the state tier is chosen and, on NVMe, the buffer sets are
        counted in the budget now, so a budget below their minimum is refused here rather
        than at the first step (after a whole forward and backward)."""
        for engine in self._engines():
            if engine.host_budget.limit is None:
                continue
            shards = [s for s in self._shards.values() if s.engine is engine]
            if not shards:
                continue
            try:
                later = engine_bytes_later(engine)  # before the first backward: its gradients
                self._store(engine, later).reserve(later)
            except BaseException:
                self.close()
                raise

    @property
    def state_bytes(self) -> Dict[str, int]:
        """Bytes of optimizer states held per tier ("host"; "nvme": the live extents of the
        state file, committed states plus writes not yet committed)."""
        out = {"host": 0, "nvme": 0}
        for store in self._stores.values():
            out[store.tier] += store.nbytes
        return out

    @property
    def state_tiers(self) -> Dict[str, str]:
        """Where each wrapped shard's states live ("host"/"nvme"), once chosen."""
        return {s.key: self._stores[id(s.engine)].tier for s in self._shards.values()
                if id(s.engine) in self._stores}

    # =====================================================================================
    # gradients: finiteness, clipping, multipliers
    # =====================================================================================








    # =====================================================================================
    # step
    # =====================================================================================
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Optional[Any]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        multiplier, finite = self._multiplier, self._finite
        self.discard_pending_step()
        stats = StepStats()
        self.last_step_stats = stats
        overlap = self._overlap
        overlap.join()  # updates started during backward: done before anything else runs
        try:
            for group in self.param_groups:
                _check_hyper(group)
            for engine in self._engines():
                engine.quiesce()
            self._check_lost_gradients()
            if finite is None and self.check_finite is True:
                finite = self.grads_finite()
            elif finite is None and self.check_finite == "auto":
                finite = self._known_finite()
            finite = self._agree_finite(finite)  # sharded: every rank skips, or none
        except BaseException:
            overlap.rollback_all("the step raised before applying them")
            raise
        if finite is False:
            overlap.rollback_all("the gradients hold inf/nan")
            overlap.step_finished()
            self.skipped_steps += 1
            stats.skipped = True
            logger.warning("infinity.optim: gradients contain inf/nan; step skipped "
                           "(%d skipped so far)", self.skipped_steps)
            return loss
        try:
            if overlap.pending:
                kept, done_early = overlap.settle(multiplier)
                stats.merge(done_early)
                stats.overlapped_shards = len(kept)
                stats.overlap_s = done_early.compute_s + done_early.io_wait_s
                for shard in kept.values():
                    self._done[shard.key] = shard
                    stats.shards += 1
                    stats.params += sum(s.numel for s in shard.flat.slots)
            self._restore_dirty()
            for shard in self._shards.values():
                self._sync_user_writes(shard)
            work = self._work(multiplier, stats)
            for engine in self._engines():
                mine = [s for s in self._shards.values() if work.steps(s)
                        and s.engine is engine]
                if mine:
                    self._store(engine).step(mine, work)
            stats.params += self._params.step(self.param_groups, self.state, self._is_wrapped,
                                              self._formats.format_of, self._element_base,
                                              multiplier)
        except BaseException:
            # re-armed: calling step() again retries this same step (clipping included)
            self._multiplier, self._finite = multiplier, finite
            raise
        self._done.clear()
        overlap.step_finished()
        for engine in self._engines():
            engine.resume()
        stats.step_s = time.perf_counter() - t0
        trace_events.span("optimizer_step", "step", stats.bytes_written, t0)
        for engine in self._engines():
            engine.record_optimizer_step(stats)
        return loss


    def _sync_user_writes(self, shard: Shard) -> None:
        """Parameters written outside forward (load_state_dict, an EMA copied back, a user's
        in-place change): their fp32 master weights follow, except where the written value is
        just the master's rounding (then the master keeps its precision)."""
        engine = shard.engine
        written = engine.take_user_writes(shard.flat)
        if not written or not shard.initialized:
            return
        store = self._store(engine)
        if not store.layout(shard).with_master:
            return  # host states of an fp32 host home: the home is the master
        store.sync_masters(shard, written)

    def _work(self, multiplier: float, stats: StepStats) -> StepWork:
        """This step's work for the stores: the runs of every shard not done yet, the
        kernels, and the record of shards that took the step or need their working copy
        rewritten."""
        runs = {id(s.flat): r for s in self._shards.values() if s.key not in self._done
                for r in [s.runs()] if r}

        def took(shard: Shard) -> None:
            shard.commit_steps()
            self._done[shard.key] = shard

        return StepWork(
            runs, stats,
            apply=lambda s, buf, staging, grad: self._apply(s, runs[id(s.flat)], buf, staging,
                                                            multiplier, grad),
            apply_unit=lambda s, un, buf, out, g: self._apply_unit(s, runs[id(s.flat)], un,
                                                                   buf, multiplier, out, g),
            took=took, dirty=lambda s: self._dirty.__setitem__(s.key, s),
            restore=self._restore_dirty, dirty_count=lambda: len(self._dirty),
            done_count=lambda: len(self._done))

    @property
    def _sets(self) -> Dict[int, BufferSets]:
        """id(engine) -> the NVMe step's buffer sets of its store, where it has them."""
        return {k: st.sets for k, st in self._stores.items() if st.sets is not None}

    def _hyper(self, run: _Run, multiplier: float) -> Dict[str, Any]:
        """The kernel's scalars for one run, from its param group now."""
        group = self.param_groups[run.group]
        beta1, beta2 = group["betas"]
        return dict(step=run.step, lr=_float(group["lr"]), beta1=_float(beta1),
                    beta2=_float(beta2), eps=_float(group["eps"]),
                    weight_decay=_float(group["weight_decay"]), adamw=self._adamw,
                    grad_multiplier=multiplier)

    def _apply(self, shard: Shard, runs: List[_Run], buf: torch.Tensor,
               staging: Optional[torch.Tensor], multiplier: float,
               grad: Optional[torch.Tensor] = None,
               hypers: Optional[List[Dict[str, Any]]] = None) -> None:
        """One shard's update in RAM (:func:`.shard_update.update_shard`). ``hypers``: the
        kernel's scalars per run (default: from the param groups now; an update overlapping
        backward passes those it will be checked against)."""
        hypers = hypers if hypers is not None else [self._hyper(r, multiplier) for r in runs]
        update_shard(self._stores[id(shard.engine)], shard, runs, hypers, buf, staging, grad,
                     self.sr_seed, self._element_base)

    def _apply_unit(self, shard: Shard, runs: List[_Run], unit: Unit, buf: torch.Tensor,
                    multiplier: float, out: Optional[Tuple[torch.Tensor, int]] = None,
                    grad: Optional[Tuple[torch.Tensor, int]] = None,
                    hypers: Optional[List[Dict[str, Any]]] = None) -> None:
        """:meth:`_apply` of one unit of an NVMe shard (:func:`.shard_update.update_unit`;
        a whole unit is the whole shard, through :meth:`_apply`)."""
        if unit.whole:
            staging = out[0].view(torch.uint8) if out is not None else None
            self._apply(shard, runs, buf, staging, multiplier,
                        grad[0] if grad is not None else None, hypers)
            return
        hypers = hypers if hypers is not None else [self._hyper(r, multiplier) for r in runs]
        update_unit(self._stores[id(shard.engine)], shard, runs, hypers, unit, buf, out, grad)

    def restore_parameters(self) -> None:
        """After a failed step: rewrites the working copies it had already updated from the
        committed masters (step() does this first anyway)."""
        self._restore_dirty()

    def _restore_dirty(self) -> None:
        """Rewrites the working copy of shards a failed step touched from committed masters."""
        for key, shard in list(self._dirty.items()):
            shard.engine.release_all()
            self._stores[id(shard.engine)].restore_home(shard)
            del self._dirty[key]

    def _element_base(self, p: torch.Tensor) -> int:
        """Global index of parameter p's first element for the stochastic-rounding hash: its
        position among this optimizer's parameters * 2**40 (independent of shard layout)."""
        if self._element_bases is None:
            self._element_bases = {id(q): i << 40 for i, q in enumerate(self._param_index())}
        return self._element_bases[id(p)]

    # =====================================================================================
    # zero_grad
    # =====================================================================================
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients. Wrapped models: ``engine.zero_grad()`` (the whole model's
        accumulated gradients are forgotten; the next backward overwrites them -- with
        ``set_to_none=False`` too, where a parameter without a new gradient is then skipped
        rather than stepped with a zero gradient). Unwrapped parameters: as torch."""
        self._overlap.rollback_all("zero_grad() before opt.step()")
        if self._done:
            logger.warning("infinity.optim: zero_grad() after a failed step that %d shard(s) had "
                           "already taken; the others skip it", len(self._done))
            self._done.clear()
        for store in self._stores.values():
            partial = store.partial
            if partial:
                logger.warning("infinity.optim: zero_grad() after a failed step that shard(s) %s "
                               "had taken part way: their units that took it keep it (their "
                               "step count does not), the others skip it", ", ".join(partial))
                for shard in self._shards.values():
                    if shard.key in partial:
                        store.finish(shard)
        for engine in self._engines():
            engine.zero_grad()
        super().zero_grad(set_to_none=set_to_none)

    # =====================================================================================
    # state_dict
    # =====================================================================================


    # ---- streaming access (checkpoints that never hold the whole model in RAM) -------------







    # =====================================================================================
    # lifetime
    # =====================================================================================
    def close(self) -> None:
        """Releases host buffers and removes the NVMe state files (the optimizer is unusable
        afterwards)."""
        _LIVE.discard(self)
        overlap = self.__dict__.get("_overlap")
        if overlap is not None:
            overlap.close()
            for engine in self._engines():
                if overlap in engine.backward_listeners:
                    engine.backward_listeners.remove(overlap)
        for store in self._stores.values():
            store.close()
        self._stores.clear()
        for shard in self._shards.values():
            shard.initialized = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- public faces of the state above for ZeRO state dicts and checkpoints -------------
    def engines(self) -> List[Engine]:
        """The engines of the wrapped models this optimizer steps (sharded ones where this
        rank holds no part included), in the same order on every rank."""
        return self._engines()

    def shards(self) -> List[Shard]:
        """This rank's wrapped shards (of a sharded model: its part of each flat)."""
        return list(self._shards.values())

    def load_shard(self, shard: Shard, by_param: Dict[int, Dict[str, Any]]) -> None:
        """Loads ``shard``'s states: ``by_param[id(param)] = {"step", "exp_avg", "exp_avg_sq",
        "master" (optional)}``, each the shard's piece of the parameter; the slots not given
        start without state."""
        self._load_shard(shard, by_param)

    def current_states(self, shard: Shard) -> Optional[Tuple[torch.Tensor, ...]]:
        """``shard``'s (master, exp_avg, exp_avg_sq) in fp32 as its next step starts from
        them (masters following parameters written since), views where they are fp32 in RAM;
        None before its first step."""
        self._sync_user_writes(shard)
        buf = self._read_committed(shard)
        if buf is None:
            return None
        views = self._stores[id(shard.engine)].views(shard, buf)
        return (views.master_value(), *views.moments_fp32(shard.flat))

    def unwrapped_states(self) -> Dict[int, Dict[str, Any]]:
        """The states of the parameters outside wrapped models in torch's format, by index in
        the param groups' order (as in :meth:`state_dict`)."""
        return {i: self._param_state_to_torch(p, self.state[p])
                for i, p in enumerate(self._param_index())
                if not self._is_wrapped(p) and self.state.get(p)}

    def checked_entries(self, state_dict: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
        """``state_dict``'s entries by parameter index, checked against the param groups and
        the whole parameters' shapes (ValueError naming the difference); changes nothing."""
        return self._check_loadable(state_dict)

    def load_unwrapped_states(self, entries: Dict[int, Dict[str, Any]]) -> None:
        """The parameters outside wrapped models take their states from ``entries`` (from
        :meth:`checked_entries`); every other state kept in ``self.state`` is dropped."""
        self.state.clear()
        for i, p in enumerate(self._param_index()):
            if not self._is_wrapped(p) and i in entries:
                self.state[p] = self._param_state_from(p, entries[i])


class AdamW(OffloadedAdam):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2) with offloaded states."""

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw=True, **kwargs)


class Adam(OffloadedAdam):
    """torch.optim.Adam (L2 weight decay added to the gradient, default 0) with offloaded
    states."""

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw=False, **kwargs)


__all__ = ["OffloadedAdam", "AdamW", "Adam", "OptimizerStateIOError", "ShardState",
           "state_formats_of"]
