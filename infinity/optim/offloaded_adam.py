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

from .. import io as inf_io
from .. import trace_events
from ..ops import (cpu_adam_step, cpu_adam_step_8bit, cpu_adam_step_bf16_moments,
                   dequantize_8bit, new_8bit_state)
from ..ops.bf16_master import check_master, cpu_adam_step_bf16_master
from ..runtime.engine import Engine, locate
from .formats import (MIN_8BIT_SIZE, Choice, FormatSpec, States as StatesArg,
                      format_summary, param_owners)
from .state_store import (HostStates, NvmeStates, OptimizerStateIOError, Shard,
                          choose_tier, engine_bytes_later, init_states, state_nbytes)
from ._common import ShardState, States, _check_hyper, _float, _read_grads, _Run  # noqa: F401 (ShardState re-exported)
from .grad_checks import GradientChecks
from .overlap import BackwardOverlap
from .state_dicts import StateDicts
from .chunks import Unit, home_write_range, piece_window, unit_views
from .swapper import BufferSets, StepStats, run_pipeline, write_units
from ..ops.adam_compact import BLOCK_SIZE, num_blocks
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
                seen[id(p)] = (numel[id(p)], opt._choose(p).fmt)
    return format_summary(seen.values())


def swap_bytes_of(engine: Engine) -> Dict[str, int]:
    """The NVMe optimizer-state bytes of the live infinity optimizers stepping ``engine``'s
    model, by category (see :meth:`.nvme_states.NvmeStates.swap_bytes`; {} when none)."""
    out: Dict[str, int] = {}
    for opt in list(_LIVE):
        store = opt._stores.get(id(engine))
        if isinstance(store, NvmeStates):
            for k, v in store.swap_bytes().items():
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
    _infinity_reads_engine_gradients = True

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
        self._choices: Dict[int, Choice] = {}      # id(param) -> its moment format and why
        self._owners: Dict[int, Dict[int, List[torch.nn.Module]]] = {}  # id(engine) -> owners
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
        if check_finite not in (True, False, "auto"):
            raise ValueError(f"check_finite must be True, False or 'auto', got {check_finite!r}")
        self.check_finite = check_finite
        self._shards: Dict[int, Shard] = {}       # id(flat) -> shard, in registration order
        self._sharded_engines: Dict[int, Engine] = {}  # ZeRO: engines, with or without shards
        self._elsewhere: set = set()  # ZeRO: ids of parameters other ranks step
        self._wrapped: Dict[int, Tuple[Shard, int]] = {}  # id(param) -> (shard, slot)
        self._stores: Dict[int, States] = {}      # id(engine) -> its state store
        self._sets: Dict[int, BufferSets] = {}    # id(engine) -> NVMe buffer sets
        self._staging: Dict[int, torch.Tensor] = {}  # id(engine) -> host-states staging
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
            self._choose(p, loc)
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
                              formats=self._slot_formats(loc.engine, loc.flat))
                self._shards[id(loc.flat)] = shard
            shard.groups[loc.slot] = index
            self._wrapped[id(p)] = (shard, loc.slot)
            loc.engine.attach_optimizer()  # the engine prefetches after our step
            if self._overlap not in loc.engine.backward_listeners:
                loc.engine.backward_listeners.append(self._overlap)

    # ---- moment formats per parameter (states=, min_8bit_size=; see .formats) --------------
    def _owners_in(self, engine: Engine) -> Dict[int, List[torch.nn.Module]]:
        owners = self._owners.get(id(engine))
        if owners is None:
            owners = param_owners(engine.model)
            self._owners[id(engine)] = owners
        return owners

    def _choose(self, p: torch.Tensor, loc: Any = None) -> Choice:
        """``p``'s moment format, decided once: from its whole size and, for a parameter of a
        wrapped model (``loc``: where the engine keeps it), the modules that hold it."""
        choice = self._choices.get(id(p))
        if choice is None:
            if loc is not None:
                numel = loc.flat.slots[loc.slot].numel  # the whole parameter (full flat)
                choice = self._format_spec.choose(p, numel, self._owners_in(loc.engine)
                                                  .get(id(p), []))
            else:
                choice = self._format_spec.choose(p, p.numel(), None)
            self._choices[id(p)] = choice
        return choice

    def _slot_formats(self, engine: Engine, flat: Any) -> Tuple[str, ...]:
        """The format of every slot of ``flat`` (slots another optimizer steps too: the
        layout has room for them), fixed for the shard's lifetime."""
        owners = self._owners_in(engine)
        out = []
        for s in flat.slots:
            choice = self._choices.get(id(s.param))
            if choice is None:  # decided once (a callable states= is asked once per param)
                whole = (s.full.slots[s.full_index].numel if hasattr(s, "full_index")
                         else s.numel)
                choice = self._format_spec.choose(s.param, whole, owners.get(id(s.param), []))
                self._choices[id(s.param)] = choice
            out.append(choice.fmt)
        return tuple(out)

    def _format_of(self, p: torch.Tensor) -> str:
        """An unwrapped parameter's moment format."""
        return self._choose(p).fmt

    def state_formats(self, by: str = "name") -> Dict[Union[str, int], str]:
        """The moment format of each parameter: ``{key: "fp32" | "bf16" | "8bit"}``, keys
        the parameter's qualified name in its wrapped model (``by="name"``; unwrapped
        parameters, and a name that two wrapped models share, by their index in the param
        groups' order, as in ``state_dict()``) or that index for all (``by="index"``)."""
        if by not in ("name", "index"):
            raise ValueError(f"infinity.optim: state_formats(by=) is 'name' or 'index', got "
                             f"{by!r}")
        out: Dict[Union[str, int], str] = {}
        names = self._param_names() if by == "name" else {}
        for i, p in enumerate(self._param_index()):
            key = names.get(id(p), i)
            out[key if key not in out else i] = self._choose(p).fmt
        return out

    def _param_names(self) -> Dict[int, str]:
        """id(param) -> its qualified name in the wrapped model that holds it."""
        names: Dict[int, str] = {}
        for engine in self._engines():
            for flat in engine.flats:
                for s in flat.slots:
                    names.setdefault(id(s.param), s.qualname)
        return names

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

    def _ready(self, shard: Shard, i: int) -> bool:
        flat = shard.flat
        return (shard.groups[i] is not None and flat.slots[i].param.requires_grad
                and shard.engine.grads.ready(flat, i))

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
            store = (NvmeStates(engine, master, self._chunk_for(engine)) if tier == "nvme"
                     else HostStates(engine, master))
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
                store = self._store(engine, later)
                if isinstance(store, NvmeStates):
                    self._sets_for(engine, shards, later)
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
            plans = [(s, runs) for s in self._shards.values() if s.key not in self._done
                     for runs in [self._runs(s)] if runs]
            for engine in self._engines():
                mine = [(s, r) for s, r in plans if s.engine is engine]
                if not mine:
                    continue
                store = self._store(engine)
                if isinstance(store, NvmeStates):
                    self._step_nvme(engine, store, mine, multiplier, stats)
                else:
                    self._step_host(store, mine, multiplier, stats)
            self._step_unwrapped(multiplier, stats)
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
        flat = shard.flat
        if not store.layout(shard).with_master:
            return  # host states of an fp32 host home: the home is the master
        if isinstance(store, NvmeStates) and store.plan(shard).chunked:
            self._sync_units(store, shard, written)
            return
        if isinstance(store, HostStates):
            buf = store.buffer(shard)
        else:
            buf = self._read_committed(shard)
        views = store.views(shard, buf)
        home = torch.empty(flat.numel, dtype=flat.home_dtype)
        engine.read_home(flat, home)
        for i in written:
            s = flat.slots[i]
            sl = slice(s.offset, s.offset + s.numel)
            new = home[sl]
            value = views.master_value(sl)
            changed = new != value.to(flat.home_dtype)
            views.set_master(torch.where(changed, new.float(), value), sl)
        if isinstance(store, NvmeStates):
            store.write_and_commit(shard, buf, "updating the master weights of")

    def _sync_units(self, store: NvmeStates, shard: Shard, written: Any) -> None:
        """:meth:`_sync_user_writes` of a shard stepped in units: each unit's states are read
        into buffer set 0 and checked, the masters of the written slots in it follow the
        home's values (read as the whole home pieces covering the unit, or from the working
        buffer), and the new extents are written unit by unit and committed together."""
        engine, flat = shard.engine, shard.flat
        sets = self._sets_for(engine, [s for s in self._shards.values() if s.engine is engine])
        layout = store.layout(shard)
        slots = [(x.offset, x.numel) for x in flat.slots]
        h = store.home_piece(shard)
        working = None if h is not None else engine.home.working_buffer(flat)
        ranges = [(flat.slots[i].offset, flat.slots[i].offset + flat.slots[i].numel)
                  for i in sorted(written)]

        def fill(un: Unit, buf: torch.Tensor) -> None:
            mine = [(max(lo, un.start), min(hi, un.end)) for lo, hi in ranges
                    if max(lo, un.start) < min(hi, un.end)]
            if not mine:
                return
            if working is not None:
                home, base = working, 0
            else:
                base, end = piece_window(un.start, un.end, flat.numel, h)
                home = sets.home_view(0, flat, end - base)
                engine.read_home_range(flat, base, home)
            master = unit_views(layout, slots, un, buf).master
            for lo, hi in mine:
                new = home[lo - base:hi - base]
                value = master[lo - un.start:hi - un.start]
                changed = new != value.to(flat.home_dtype)
                value.copy_(torch.where(changed, new.float(), value))

        write_units(store, shard, sets, fill, "updating the master weights of", read=True)

    def _runs(self, shard: Shard) -> List[_Run]:
        runs: List[_Run] = []
        slots = shard.flat.slots
        for i, slot in enumerate(slots):
            if not self._ready(shard, i):
                continue
            group, step = shard.groups[i], shard.steps[i] + 1
            last = runs[-1] if runs else None
            if (last is not None and last.group == group and last.step == step
                    and self._ready(shard, i - 1)):
                runs[-1] = _Run(last.start, slot.offset + slot.numel, group, step,
                                last.first, i)
            else:
                runs.append(_Run(slot.offset, slot.offset + slot.numel, group, step, i, i))
        return runs

    def _commit_steps(self, shard: Shard) -> None:
        for i in range(len(shard.flat.slots)):
            if self._ready(shard, i):
                shard.steps[i] += 1

    def _hyper(self, run: _Run, multiplier: float) -> Dict[str, Any]:
        """The kernel's scalars for one run, from its param group now."""
        group = self.param_groups[run.group]
        beta1, beta2 = group["betas"]
        return dict(step=run.step, lr=_float(group["lr"]), beta1=_float(beta1),
                    beta2=_float(beta2), eps=_float(group["eps"]),
                    weight_decay=_float(group["weight_decay"]), adamw=self._adamw,
                    grad_multiplier=multiplier)

    def _working_out(self, shard: Shard, staging: Optional[torch.Tensor]
                     ) -> Optional[torch.Tensor]:
        """Where the kernel writes the updated working copy (None: copied afterwards)."""
        flat = shard.flat
        if shard.engine.stages_working_copy(flat):
            return staging[:flat.home_nbytes].view(flat.home_dtype)
        return shard.engine.home.working_buffer(flat)

    def _apply(self, shard: Shard, runs: List[_Run], buf: torch.Tensor,
               staging: Optional[torch.Tensor], multiplier: float,
               grad: Optional[torch.Tensor] = None,
               hypers: Optional[List[Dict[str, Any]]] = None) -> None:
        """One shard: the kernel of the state format over each run, working copy written in
        the same pass. ``grad``: the shard's gradients when they were read from NVMe (else
        those in RAM). ``hypers``: the kernel's scalars per run (default: from the param
        groups now; an update overlapping backward passes those it will be checked against).

        fp32 and bf16 moments are element-wise: one kernel call per run of adjacent slots
        of that format (a shard of mixed formats splits a run where the format changes; each
        format's moments sit in its own region, see ``StateLayout``). 8-bit moments are
        quantized in 256-element blocks that start at each slot's first element, so the 8-bit
        kernel runs slot by slot over the run's slots: every block it re-quantizes belongs to
        a slot that takes this step, and a slot that does not (no gradient, frozen, not ours)
        keeps its codes, scales and step untouched."""
        flat = shard.flat
        grad = shard.engine.grads.in_ram(flat) if grad is None else grad
        views = self._stores[id(shard.engine)].views(shard, buf)
        master, layout = views.master, views.layout
        out = self._working_out(shard, staging)
        in_place = not layout.with_master  # fp32 home is the master: updated in place
        if in_place:
            out = None
        written: List[Tuple[int, int]] = []
        bf16_master = views.master_comp is not None or master.dtype != torch.float32
        for j, r in enumerate(runs):
            hyper = hypers[j] if hypers is not None else self._hyper(r, multiplier)
            if bf16_master:
                # bf16 masters: slot by slot (each slot's rounding hash starts at its own
                # element base, and 8-bit blocks at its first element)
                for i in range(r.first, r.last + 1):
                    s = flat.slots[i]
                    sl = slice(s.offset, s.offset + s.numel)
                    fmt, mom = views.slot_state(flat, i)
                    absmax = {}
                    if fmt == "8bit":
                        absmax = dict(exp_avg_absmax=mom.exp_avg_absmax,
                                      exp_avg_sq_absmax=mom.exp_avg_sq_absmax)
                    comp = views.master_comp
                    cpu_adam_step_bf16_master(
                        master[sl], comp[sl] if comp is not None else None, grad[sl],
                        mom.exp_avg, mom.exp_avg_sq, states=fmt, **absmax,
                        seed=self.sr_seed, index=self._element_base(s.param),
                        out=out[sl] if out is not None else None, **hyper)
                    written.append((sl.start, sl.stop))
                continue
            for fmt, first, last in layout.split(r.first, r.last):
                if fmt == "8bit":
                    for i in range(first, last + 1):
                        s = flat.slots[i]
                        sl = slice(s.offset, s.offset + s.numel)
                        _, mom = views.slot_state(flat, i)
                        cpu_adam_step_8bit(master[sl], grad[sl], mom.exp_avg,
                                           mom.exp_avg_absmax, mom.exp_avg_sq,
                                           mom.exp_avg_sq_absmax,
                                           out=out[sl] if out is not None else None, **hyper)
                        written.append((sl.start, sl.stop))
                    continue
                # one call over the sub-run, the padding between its slots included
                start = flat.slots[first].offset
                end = flat.slots[last].offset + flat.slots[last].numel
                _, mom = views.run_state(flat, first, last)
                kernel = cpu_adam_step if fmt == "fp32" else cpu_adam_step_bf16_moments
                sl = slice(start, end)
                kernel(master[sl], grad[sl], mom.exp_avg, mom.exp_avg_sq,
                       out=out[sl] if out is not None else None, **hyper)
                written.append((start, end))
        # bf16 masters: a slot that did not take this step (frozen, no gradient) keeps its
        # working copy, which need not be its master's value (it was never rounded)
        bf16 = master.dtype != torch.float32
        if out is None and not in_place:  # a device home on CUDA: copied over afterwards
            value = views.master_value()
            if bf16:
                value = self._keep_unstepped(shard, written, value)
            shard.engine.home.write_from(flat, value)
        if shard.engine.stages_working_copy(flat):
            # the whole working copy goes to the swap file: fill what the kernels did not
            # write from the masters (home == round(master) holds for every slot; bf16
            # masters: from the home copy where a slot lies in the gap)
            gaps, pos = [], 0
            for start, end in written + [(flat.numel, flat.numel)]:
                if start > pos:
                    gaps.append((pos, start))
                pos = end
            home = None
            if bf16 and any(s.offset < b and s.offset + s.numel > a for a, b in gaps
                            for s in flat.slots):
                home = torch.empty(flat.numel, dtype=flat.home_dtype)
                shard.engine.read_home(flat, home)
            for a, b in gaps:
                out[a:b].copy_(home[a:b] if home is not None
                               else views.master_value(slice(a, b)))

    def _apply_unit(self, shard: Shard, runs: List[_Run], unit: Unit, buf: torch.Tensor,
                    multiplier: float, out: Optional[Tuple[torch.Tensor, int]] = None,
                    grad: Optional[Tuple[torch.Tensor, int]] = None,
                    hypers: Optional[List[Dict[str, Any]]] = None) -> None:
        """:meth:`_apply` of one unit of an NVMe shard (the whole shard for a whole unit):
        the same kernels over the runs' elements inside ``[unit.start, unit.end)``. Unit
        boundaries are slot edges or 256-element block boundaries inside a slot, so an
        8-bit slot cut by them is quantized in exactly the blocks it has whole; fp32 and bf16
        moments are element-wise. Layouts with an fp32 master are cut (one format or several,
        each format's moments in its own region). ``out``: (working copy in the home dtype,
        the element it starts at) where the pipeline stages it for an NVMe home (None: the
        home's working buffer); ``grad``: (fp32 gradients, the element they start at) read
        from NVMe (None: those in RAM)."""
        if unit.whole:
            staging = out[0].view(torch.uint8) if out is not None else None
            self._apply(shard, runs, buf, staging, multiplier,
                        grad[0] if grad is not None else None, hypers)
            return
        flat, engine = shard.flat, shard.engine
        store = self._stores[id(engine)]
        layout = store.layout(shard)
        slots = flat.slots
        views = unit_views(layout, [(x.offset, x.numel) for x in slots], unit, buf)
        g, gb = grad if grad is not None else (engine.grads.in_ram(flat), 0)
        if out is None:
            if engine.stages_working_copy(flat):
                raise RuntimeError(f"infinity.optim: {flat.key} is stepped in units but no "
                                   "working-copy buffer was given (a bug in the pipeline)")
            out = (engine.home.working_buffer(flat), 0)
        o, ob = out
        if o is None or g is None:
            raise RuntimeError(f"infinity.optim: {flat.key} is stepped in units but has no "
                               "working buffer to write or no gradients (a bug in the unit "
                               "plan)")
        a, b = unit.start, unit.end
        master = views.master
        written: List[Tuple[int, int]] = []

        def pos(i: int) -> int:  # slot i's first element in its format's region
            return layout.slot_pos[i] if layout.mixed else slots[i].offset

        for j, r in enumerate(runs):
            if min(r.end, b) <= max(r.start, a):
                continue
            hyper = hypers[j] if hypers is not None else self._hyper(r, multiplier)
            for fmt, first, last in layout.split(r.first, r.last):
                m, v, m_abs, v_abs = views.regions[fmt]
                base = views.base[fmt]
                if fmt == "8bit":  # slot by slot: each slot's blocks start at its first element
                    for i in range(first, last + 1):
                        s = slots[i]
                        lo, hi = max(s.offset, a), min(s.offset + s.numel, b)
                        if lo >= hi:
                            continue
                        p = pos(i) + (lo - s.offset) - base
                        b0 = layout.block_start[i] + (lo - s.offset) // BLOCK_SIZE \
                            - unit.blocks[0]
                        nb = num_blocks(hi - lo)
                        cpu_adam_step_8bit(master[lo - a:hi - a], g[lo - gb:hi - gb],
                                           m[p:p + hi - lo], m_abs[b0:b0 + nb],
                                           v[p:p + hi - lo], v_abs[b0:b0 + nb],
                                           out=o[lo - ob:hi - ob], **hyper)
                        written.append((lo, hi))
                    continue
                # one call over the sub-run inside the unit, the padding between slots included
                start = slots[first].offset
                lo = max(start, a)
                hi = min(slots[last].offset + slots[last].numel, b)
                if lo >= hi:
                    continue
                p = pos(first) + (lo - start) - base
                kernel = cpu_adam_step if fmt == "fp32" else cpu_adam_step_bf16_moments
                kernel(master[lo - a:hi - a], g[lo - gb:hi - gb], m[p:p + hi - lo],
                       v[p:p + hi - lo], out=o[lo - ob:hi - ob], **hyper)
                written.append((lo, hi))
        if engine.stages_working_copy(flat):
            at = a  # elements the kernels did not write: the working copy from the master
            for lo, hi in written + [(b, b)]:
                if lo > at:
                    o[at - ob:lo - ob].copy_(master[at - a:lo - a])
                at = max(at, hi)

    @staticmethod
    def _keep_unstepped(shard: Shard, written: List[Tuple[int, int]],
                        value: torch.Tensor) -> torch.Tensor:
        """``value`` (fp32, the whole shard) with the current working copy outside ``written``."""
        keep = torch.ones(shard.flat.numel, dtype=torch.bool)
        for a, b in written:
            keep[a:b] = False
        if not bool(keep.any()):
            return value
        home = torch.empty(shard.flat.numel, dtype=shard.flat.home_dtype)
        shard.engine.read_home(shard.flat, home)
        return torch.where(keep, home.float(), value)

    def _home_staging(self, engine: Engine) -> torch.Tensor:
        """Host states with parameters homed on NVMe: one aligned buffer (the largest working
        copy) that each updated working copy passes through on its way to the swap file."""
        buf = self._staging.get(id(engine))
        if buf is None:
            nbytes = max(s.flat.home_nbytes for s in self._shards.values() if s.engine is engine)
            engine.host_budget.acquire(nbytes, what="optimizer working-copy staging buffer")
            buf = inf_io.aligned_empty(nbytes)
            self._staging[id(engine)] = buf
        return buf

    def _step_host(self, store: HostStates, plans: List[Tuple[Shard, List[_Run]]],
                   multiplier: float, stats: StepStats) -> None:
        for shard, runs in plans:
            buf = store.buffer(shard)
            engine = shard.engine
            staging = (self._home_staging(engine)
                       if engine.stages_working_copy(shard.flat) else None)
            if not shard.initialized:
                init_states(shard, store.views(shard, buf), staging)
                shard.initialized = True
            grad = None
            if engine.grads.in_ram(shard.flat) is None:
                grad = _read_grads(shard)
                stats.bytes_read += shard.numel * 4
            t0 = time.perf_counter()
            self._apply(shard, runs, buf, staging, multiplier, grad)
            stats.compute_s += time.perf_counter() - t0
            trace_events.span("optimizer_compute", shard.key, shard.numel, t0)
            self._commit_steps(shard)
            self._done[shard.key] = shard
            if staging is not None:  # the updated working copy goes to the parameter swap file
                home = staging[:shard.flat.home_nbytes].view(shard.flat.home_dtype)
                try:
                    engine.write_home(shard.flat, home).wait()
                except BaseException as exc:
                    # the states (in RAM) have taken this step; the swap file is rewritten
                    # from them by the next step() (or restore_parameters()), which also
                    # finishes the shards this step did not reach
                    self._dirty[shard.key] = shard
                    exc.add_note(
                        f"infinity.optim: {len(self._done)} of {len(plans)} shards took this "
                        "step before writing the parameters of "
                        f"{shard.key!r} failed. Call opt.step() again once the disk is fixed: "
                        "it rewrites them and finishes this same step (the gradients are "
                        "kept), so training continues as if nothing had failed.")
                    raise
                stats.bytes_written += shard.flat.home_nbytes
            stats.shards += 1
            stats.params += sum(r.end - r.start for r in runs)

    def _sets_for(self, engine: Engine, shards: List[Shard], later: int = 0) -> BufferSets:
        staging = engine.working_copy_staged
        grads = engine.grads.on_nvme
        store = self._stores[id(engine)]
        sets = self._sets.get(id(engine))
        if sets is not None and not sets.fits(store, shards, staging, grads):
            sets.close()
            sets = None
        if sets is None:
            sets = BufferSets(store, [s for s in self._shards.values()
                                      if s.engine is engine], staging, grads, later=later)
            self._sets[id(engine)] = sets
        return sets

    def _init_nvme(self, store: NvmeStates, sets: BufferSets, shard: Shard) -> None:
        """First use of a shard: states from the home copy, written and committed at once, so
        every later step has a committed state to fall back to."""
        if store.plan(shard).chunked:
            self._init_nvme_units(store, sets, shard)
            return
        buf = sets.state_view(0, store, shard)
        init_states(shard, store.views(shard, buf),
                    sets.staging[0] if sets.staging[0] is not None
                    and sets.staging_nbytes >= shard.flat.home_nbytes
                    else inf_io.aligned_empty(shard.flat.home_nbytes))
        store.write_and_commit(shard, buf, "initializing")
        shard.initialized = True

    def _init_nvme_units(self, store: NvmeStates, sets: BufferSets, shard: Shard) -> None:
        """:meth:`_init_nvme` of a shard stepped in units: the master of each unit from the
        home copy (NVMe homes: the whole pieces covering the unit, read into set 0's
        working-copy buffer; else the working buffer), zero moments, written unit by unit."""
        engine, flat = shard.engine, shard.flat
        h = store.home_piece(shard)
        home = None if h is not None else engine.home.working_buffer(flat)
        layout = store.layout(shard)
        slots = [(x.offset, x.numel) for x in flat.slots]

        def fill(un: Unit, buf: torch.Tensor) -> None:
            views = unit_views(layout, slots, un, buf)
            if home is not None:
                views.master.copy_(home[un.start:un.end])  # moments: zero (buffer zeroed)
                return
            base, end = piece_window(un.start, un.end, flat.numel, h)
            part = sets.home_view(0, flat, end - base)
            engine.read_home_range(flat, base, part)
            views.master.copy_(part[un.start - base:un.end - base])

        write_units(store, shard, sets, fill, "initializing")
        shard.initialized = True

    def _step_nvme(self, engine: Engine, store: NvmeStates,
                   plans: List[Tuple[Shard, List[_Run]]], multiplier: float,
                   stats: StepStats) -> None:
        shards = [s for s, _ in plans]
        runs_of = {s.key: r for s, r in plans}
        sets = self._sets_for(engine, shards)
        for shard in shards:
            if not shard.initialized:
                self._init_nvme(store, sets, shard)
        computed: List[Shard] = []
        write_home = engine.working_copy_staged
        try:
            run_pipeline(shards, store, sets,
                         lambda s, un, buf, out, g: self._apply_unit(s, runs_of[s.key], un, buf,
                                                                     multiplier, out, g),
                         write_home, stats, computed)
        except BaseException as failure:
            for shard in computed:
                self._dirty[shard.key] = shard
            whole = [s for s in shards if store.fully_stepped(s)]
            for shard in whole:  # every unit took the step: done, the retry skips it
                store.finish(shard)
                self._commit_steps(shard)
                self._done[shard.key] = shard
            partial = store.partial
            failure.add_note(
                f"infinity.optim: {len(whole)} of {len(shards)} shards on NVMe took this step "
                f"before it failed, {len(partial)} part way (units committed one by one); the "
                "others kept their states. Call opt.step() again once the cause is fixed: it "
                "finishes this same step (the gradients are kept) for the units that did not "
                "take it, so training continues as if nothing had failed.")
            try:
                self._restore_dirty()
            except Exception as exc:  # noqa: BLE001 - e.g. the disk is still full
                logger.warning("infinity.optim: could not restore the parameters of %d shards "
                               "from their committed states yet (%s); retried at the next "
                               "step()", len(self._dirty), exc)
                failure.add_note(f"The parameters of {len(self._dirty)} shard(s) on NVMe could "
                                 "not be rewritten from the committed states yet; the next "
                                 "step() (or restore_parameters()) does it: call it before "
                                 "reading or running the model.")
            raise
        for shard in shards:
            store.finish(shard)
            self._commit_steps(shard)
        stats.shards += len(shards)
        stats.params += sum(r.end - r.start for runs in runs_of.values() for r in runs)

    def restore_parameters(self) -> None:
        """After a failed step: rewrites the working copies it had already updated from the
        committed masters (step() does this first anyway)."""
        self._restore_dirty()

    def _restore_dirty(self) -> None:
        """Rewrites the working copy of shards a failed step touched from committed masters."""
        for key, shard in list(self._dirty.items()):
            store = self._stores[id(shard.engine)]
            engine = shard.engine
            engine.release_all()
            if isinstance(store, NvmeStates) and store.plan(shard).chunked:
                self._restore_units(store, shard)
                del self._dirty[key]
                continue
            if isinstance(store, HostStates):
                buf = store.buffer(shard)
            else:
                buf = store.empty(shard)
                store.read_whole(shard, buf)
            engine.home.write_from(shard.flat, store.views(shard, buf).master_value())
            del self._dirty[key]

    def _restore_units(self, store: NvmeStates, shard: Shard) -> None:
        """:meth:`_restore_dirty` of a shard stepped in units, through buffer set 0: each
        unit's committed extent is read and checked, and its masters written to the working
        copy (whole pieces of an NVMe home, the partial one at a unit's end finished by the
        next)."""
        engine, flat = shard.engine, shard.flat
        sets = self._sets_for(engine, [s for s in self._shards.values() if s.engine is engine])
        plan, layout = store.plan(shard), store.layout(shard)
        slots = [(x.offset, x.numel) for x in flat.slots]
        buf = sets.states[0]

        def read(un: Unit) -> None:
            future = store.read_unit(shard, un, buf)
            try:
                future.wait()
            except inf_io.InfinityIOError as exc:
                raise store.wrap_error(exc, shard, "reading") from exc
            store.check_unit(shard, un, future)

        h = store.home_piece(shard)
        home = None if h is not None else engine.home.working_buffer(flat)
        if h is None and home is None:
            raise RuntimeError(f"infinity.optim: {flat.key} is stepped in units but has no "
                               "working buffer (a bug in the unit plan)")
        carry: Optional[torch.Tensor] = None  # the start of the piece the next unit finishes
        for un in plan.units:
            read(un)
            master = unit_views(layout, slots, un, buf).master
            if home is not None:
                home[un.start:un.end].copy_(master)
                continue
            base = un.start // h * h
            out = sets.home_view(0, flat, un.end - base)
            if un.start > base:
                out[:un.start - base].copy_(carry)
            out[un.start - base:].copy_(master)
            a, b = home_write_range(un.start, un.end, flat.numel, h)
            if b > a:
                engine.write_home_range(flat, a, out[a - base:b - base]).wait()
            carry = out[b - base:].clone() if b < un.end else None

    # ---- unwrapped parameters ---------------------------------------------------------------
    def _step_unwrapped(self, multiplier: float, stats: StepStats) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None or self._is_wrapped(p):
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("infinity.optim does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(self._new_param_state(p))
                state["step"] += 1
                master = state.get("master")
                target = master if master is not None else p.data
                out = None
                if master is not None and p.device.type == "cpu" and p.is_contiguous():
                    out = p.data
                grad = p.grad.detach()
                if grad.device.type != "cpu" or not grad.is_contiguous():
                    grad = grad.to("cpu").contiguous()
                self._param_kernel(state, target, grad, out, param=p,
                                   step=int(state["step"].item()), lr=_float(group["lr"]),
                                   beta1=_float(beta1), beta2=_float(beta2),
                                   eps=_float(group["eps"]),
                                   weight_decay=_float(group["weight_decay"]),
                                   adamw=self._adamw, grad_multiplier=multiplier)
                if master is not None and out is None:
                    p.data.copy_(self._unwrapped_master_value(state).view_as(p))
                stats.params += p.numel()

    def _needs_master(self, p: torch.Tensor) -> bool:
        return (self.master_format != "fp32" or p.dtype != torch.float32
                or p.device.type != "cpu" or not p.is_contiguous())

    def _element_base(self, p: torch.Tensor) -> int:
        """Global index of parameter p's first element for the stochastic-rounding hash: its
        position among this optimizer's parameters * 2**40 (independent of shard layout)."""
        if self._element_bases is None:
            self._element_bases = {id(q): i << 40 for i, q in enumerate(self._param_index())}
        return self._element_bases[id(p)]

    def _new_master(self, value: torch.Tensor) -> Dict[str, torch.Tensor]:
        """An unwrapped parameter's master entries from fp32-convertible ``value``."""
        value = value.detach().to("cpu", torch.float32, copy=True).contiguous()
        if self.master_format == "fp32":
            return {"master": value}
        hi = value.to(torch.bfloat16)
        if self.master_format == "bf16_sr":
            return {"master": hi}
        d = value - hi.float()
        return {"master": hi, "master_comp": torch.where(torch.isfinite(d), d,
                                                         torch.zeros_like(d)).bfloat16()}

    @staticmethod
    def _unwrapped_master_value(state: Dict[str, Any]) -> torch.Tensor:
        value = state["master"].float()
        comp = state.get("master_comp")
        return value + comp.float() if comp is not None else value

    def _param_kernel(self, state: Dict[str, Any], target: torch.Tensor, grad: torch.Tensor,
                      out: Optional[torch.Tensor], param: Optional[torch.Tensor] = None,
                      **hyper: Any) -> None:
        """One unwrapped parameter's step in its state format (its 8-bit blocks start at the
        parameter's first element, as a wrapped slot's)."""
        fmt = self._format_of(param) if param is not None else self.states_format
        flat = [target.view(-1), grad.reshape(-1)]
        out = out.view(-1) if out is not None else None
        if self.master_format != "fp32":
            comp = state.get("master_comp")
            absmax = {}
            if fmt == "8bit":
                m, v = state["exp_avg_codes"], state["exp_avg_sq_codes"]
                absmax = dict(exp_avg_absmax=state["exp_avg_absmax"],
                              exp_avg_sq_absmax=state["exp_avg_sq_absmax"])
            else:
                m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
            cpu_adam_step_bf16_master(flat[0], comp.view(-1) if comp is not None else None,
                                      flat[1], m, v, states=fmt, **absmax,
                                      seed=self.sr_seed, index=self._element_base(param),
                                      out=out, **hyper)
            return
        if fmt == "fp32":
            cpu_adam_step(*flat, state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                          out=out, **hyper)
        elif fmt == "bf16":
            cpu_adam_step_bf16_moments(*flat, state["exp_avg"].view(-1),
                                       state["exp_avg_sq"].view(-1), out=out, **hyper)
        else:
            cpu_adam_step_8bit(*flat, state["exp_avg_codes"], state["exp_avg_absmax"],
                               state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], out=out,
                               **hyper)

    def _new_moments(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Zero moments of an unwrapped parameter in its state format."""
        fmt = self._format_of(p)
        if fmt == "8bit":
            return new_8bit_state(p.numel())
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        return {"exp_avg": torch.zeros(p.shape, dtype=dtype),
                "exp_avg_sq": torch.zeros(p.shape, dtype=dtype)}

    def _new_param_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        state = {"step": torch.tensor(0.0), **self._new_moments(p)}
        if self._needs_master(p):
            state.update(self._new_master(p))
        return state

    def _param_state_to_torch(self, p: torch.Tensor, state: Dict[str, Any]) -> Dict[str, Any]:
        """An unwrapped parameter's state in torch's format (fp32 moments, dequantized)."""
        out = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in state.items()
               if k in ("step", "master")}
        if "master" in state and self.master_format != "fp32":
            out["master"] = self._unwrapped_master_value(state)  # its value, in fp32
        if "exp_avg_codes" in state:  # 8bit
            out["exp_avg"] = dequantize_8bit(state["exp_avg_codes"], state["exp_avg_absmax"],
                                             signed=True).view(p.shape)
            out["exp_avg_sq"] = dequantize_8bit(state["exp_avg_sq_codes"],
                                                state["exp_avg_sq_absmax"],
                                                signed=False).view(p.shape)
        else:
            out["exp_avg"] = state["exp_avg"].to(torch.float32, copy=True)
            out["exp_avg_sq"] = state["exp_avg_sq"].to(torch.float32, copy=True)
        return out

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
            partial = getattr(store, "partial", ())
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
        for sets in self._sets.values():
            sets.close()
        self._sets.clear()
        for engine in self._engines():
            buf = self._staging.pop(id(engine), None)
            if buf is not None:
                engine.host_budget.release(buf.numel())
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
