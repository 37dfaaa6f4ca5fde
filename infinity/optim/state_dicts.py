"""state_dict / load_state_dict of the offloaded optimizer in torch's format, and the streamed
per-shard access that checkpoints use (one shard in RAM at a time)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from .. import io as inf_io
from .core import AdamCore
from .step.common import ShardState, _check_hyper, _float
from .step.layout import StateViews
from .step.shard import Shard, init_states

logger = logging.getLogger(__name__)


class StateDicts:
    """The state dicts of one optimizer, over its :class:`~.core.AdamCore`
    (``rollback(why)``: undoes the updates computed during backward first)."""

    def __init__(self, core: AdamCore, rollback: Callable[[str], None]) -> None:
        self.core = core
        self.rollback = rollback

    def read_committed(self, shard: Shard) -> Optional[torch.Tensor]:
        """The shard's committed state buffer (a copy for NVMe), or None without states."""
        return self.core.read_committed(shard)

    def _quiesce(self) -> None:
        for port in self.core.wrapped.ports():
            port.engine.quiesce()

    def committed_extent(self, key: str) -> Optional[Tuple[str, int, int, int]]:
        """(path, nbytes, crc32c, offset): ``nbytes`` at ``offset`` of the NVMe file holding
        shard ``key``'s committed fp32 states (layout [master | exp_avg | exp_avg_sq], fp32,
        ``flat.numel`` each), for a kernel-side copy; None where the states are not such an
        extent (host states, a shard with compact or mixed moments or stored in units, no
        state yet, no recorded checksum). Valid until the next step."""
        shard = self.core.wrapped.find(key)
        if shard is None or not shard.initialized or self.core.master != "fp32":
            return None
        store = self.core.wrapped.store_of(shard)
        layout = store.layout(shard)
        if layout.fmt != "fp32" or not layout.with_master or layout.master != "fp32":
            return None
        return store.committed_extent(shard)

    def shard_states(self, skip_extents: bool = False) -> Iterator[ShardState]:
        """Each wrapped shard's committed states, one shard in RAM at a time.
        ``skip_extents``: shards for which :meth:`committed_extent` gives a file are yielded
        without reading their states (master/exp_avg/exp_avg_sq None)."""
        self.rollback("shard_states() before opt.step()")
        self._quiesce()
        for shard in self.core.wrapped.shards.values():
            self.core.sync_user_writes(shard)
            fmt = shard.formats[0] if len(set(shard.formats)) == 1 else "mixed"
            if skip_extents and self.committed_extent(shard.key) is not None:
                yield ShardState(
                    shard.key,
                    shard.flat,
                    None,
                    None,
                    None,
                    tuple(shard.steps),
                    tuple(shard.groups),
                    fmt,
                    tuple(shard.formats),
                )
                continue
            buf = self.read_committed(shard)
            master = m = v = None
            if buf is not None:
                views = self.core.wrapped.store_of(shard).views(shard, buf)
                master = views.master_value()  # bf16 masters: their fp32 value (a copy)
                m, v = views.moments_fp32(shard.flat)  # compact moments: dequantized copies
            yield ShardState(
                shard.key,
                shard.flat,
                master,
                m,
                v,
                tuple(shard.steps),
                tuple(shard.groups),
                fmt,
                tuple(shard.formats),
            )

    def load_shard_state(self, key: str, per_slot: Dict[int, Dict[str, Any]]) -> None:
        """Loads one shard's states: ``per_slot[slot index] = {"step", "exp_avg",
        "exp_avg_sq", "master" (optional)}``; slots not given start without state."""
        self.rollback("load_shard_state() before opt.step()")
        shard = self.core.wrapped.find(key)
        if shard is None:
            raise KeyError(f"this optimizer has no wrapped shard {key!r}")
        by_param = {id(shard.flat.slots[i].param): e for i, e in per_slot.items()}
        self.load_shard(shard, by_param)

    def state_dict(self, *, wrapped: bool = True) -> Dict[str, Any]:
        """torch's format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq", "master"}},
        "param_groups": [...], "states": "fp32" | "bf16" | "8bit" (the default format),
        "state_formats": {index: format}, "master": "fp32" | "bf16_sr" | "bf16_kahan"}``;
        ``master`` is the fp32 value of the
        master weight (for unwrapped fp32 CPU parameters the parameter itself is the master and
        no entry is stored); the moments are fp32 in every state format (compact ones
        dequantized: exactly the values the next step starts from).
        ``wrapped=False`` leaves out the wrapped models' shards (see :meth:`shard_states`)."""
        self.rollback("state_dict() before opt.step()")
        core = self.core
        if core.wrapped.sharded is not None:
            raise refuse_sharded("optimizer.state_dict()")
        self._quiesce()
        for shard in core.wrapped.shards.values():
            core.sync_user_writes(shard)
        params = core.param_index()
        index = {id(p): i for i, p in enumerate(params)}
        groups = []
        for g in core.groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in g["params"]]
            groups.append(packed)
        state: Dict[int, Dict[str, Any]] = {}
        for shard in core.wrapped.shards.values() if wrapped else ():
            buf = self.read_committed(shard)
            if buf is None:
                continue
            views = core.wrapped.store_of(shard).views(shard, buf)
            for i, slot in enumerate(shard.flat.slots):
                if shard.groups[i] is None or shard.steps[i] == 0:
                    continue
                sl = slice(slot.offset, slot.offset + slot.numel)
                m, v = views.slot_moments(shard.flat, i)
                state[index[id(slot.param)]] = {
                    "step": torch.tensor(float(shard.steps[i])),
                    "exp_avg": m.view(slot.shape).clone(),
                    "exp_avg_sq": v.view(slot.shape).clone(),
                    "master": views.master_value(sl).view(slot.shape).clone(),
                }
        state.update(self.unwrapped_states())
        return {
            "state": state,
            "param_groups": groups,
            "states": core.formats.spec.default,
            "state_formats": {i: core.formats.format_of(p) for i, p in enumerate(params)},
            "master": core.master,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state from :meth:`state_dict` (or torch.optim.Adam/AdamW's: without a
        ``master`` the current parameter value is the master). The fp32 moments are stored in
        each parameter's state format in this optimizer, whatever the saved ``"states"`` /
        ``"state_formats"`` were (bf16: rounded; 8bit: quantized; moments saved from the same
        format come back bitwise). A state of
        another model (other number of groups/parameters or shapes) raises ValueError and
        changes nothing."""
        self.rollback("load_state_dict() before opt.step()")
        core = self.core
        if core.wrapped.sharded is not None:
            raise refuse_sharded("optimizer.load_state_dict()")
        entries = self.checked_entries(state_dict)
        params = core.param_index()
        for g, saved in zip(core.groups, state_dict["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        for group in core.groups:
            _check_hyper(group)
        core.discard_pending()
        self.load_unwrapped_states(entries)
        by_param = {id(params[i]): e for i, e in entries.items()}
        for shard in core.wrapped.shards.values():
            self.load_shard(shard, by_param)

    def checked_entries(self, state_dict: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
        if (
            not isinstance(state_dict, dict)
            or "state" not in state_dict
            or "param_groups" not in state_dict
        ):
            raise ValueError(
                "load_state_dict expects a dict with 'state' and 'param_groups' "
                "(from optimizer.state_dict())"
            )
        saved_groups = state_dict["param_groups"]
        groups = self.core.groups
        if len(saved_groups) != len(groups):
            raise ValueError(
                f"the loaded optimizer state has {len(saved_groups)} param groups "
                f"but this optimizer has {len(groups)}: it was saved "
                "for a different model or optimizer setup"
            )
        for n, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"param group {n} of the loaded optimizer state has "
                    f"{len(sg['params'])} parameters but this optimizer's has "
                    f"{len(g['params'])}: it was saved for a different model"
                )
        params = self.core.param_index()
        remap: Dict[Any, int] = {}
        for g, sg in zip(groups, saved_groups):
            for p, saved_id in zip(g["params"], sg["params"]):
                remap[saved_id] = len(remap)
        entries: Dict[int, Dict[str, Any]] = {}
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in remap:
                raise ValueError(
                    f"the loaded optimizer state has an entry for parameter "
                    f"{saved_id!r}, which no param group lists"
                )
            i = remap[saved_id]
            p = params[i]
            for name in ("exp_avg", "exp_avg_sq", "master"):
                t = entry.get(name)
                if name != "master" and t is None:
                    raise ValueError(f"the loaded state of parameter {i} has no {name!r}")
                if t is not None and tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"the loaded {name} of parameter {i} has shape "
                        f"{tuple(t.shape)} but the parameter has {tuple(p.shape)}: "
                        "the optimizer state was saved for a different model"
                    )
            if "step" not in entry:
                raise ValueError(f"the loaded state of parameter {i} has no 'step'")
            entries[i] = entry
        return entries

    def unwrapped_states(self) -> Dict[int, Dict[str, Any]]:
        """The states of the parameters outside wrapped models in torch's format (fp32
        moments, dequantized), by index in the param groups' order."""
        core = self.core
        return {
            i: core.params.to_torch(p, core.state[p])
            for i, p in enumerate(core.param_index())
            if not core.wrapped.is_wrapped(p) and core.state.get(p)
        }

    def load_unwrapped_states(self, entries: Dict[int, Dict[str, Any]]) -> None:
        """The parameters outside wrapped models take their states from ``entries`` (from
        :meth:`checked_entries`, in each one's moment format); every other state kept in
        torch's ``state`` is dropped."""
        core = self.core
        core.state.clear()
        for i, p in enumerate(core.param_index()):
            if not core.wrapped.is_wrapped(p) and i in entries:
                core.state[p] = core.params.from_torch(p, entries[i], core.formats.format_of(p))

    def current_states(self, shard: Shard) -> Optional[Tuple[torch.Tensor, ...]]:
        """``shard``'s (master, exp_avg, exp_avg_sq) in fp32 as its next step starts from
        them (masters following parameters written since); None before its first step."""
        self.core.sync_user_writes(shard)
        buf = self.read_committed(shard)
        if buf is None:
            return None
        views = self.core.wrapped.store_of(shard).views(shard, buf)
        return (views.master_value(), *views.moments_fp32(shard.flat))

    def load_shard(self, shard: Shard, by_param: Dict[int, Dict[str, Any]]) -> None:
        """Loads ``shard``'s states: ``by_param[id(param)] = {"step", "exp_avg", "exp_avg_sq",
        "master" (optional)}``; the slots not given start without state."""
        slots = shard.flat.slots
        loaded = [
            by_param.get(id(s.param)) if shard.groups[i] is not None else None
            for i, s in enumerate(slots)
        ]
        shard.steps = [0] * len(slots)
        if not any(e is not None for e in loaded):
            shard.initialized = False  # states are recreated from the home copy when needed
            return
        port = shard.port
        port.engine.quiesce()
        port.working.take_user_writes(shard.flat)  # the loaded (or current) values are masters
        store = self.core.wrapped.store_of(shard)
        scratch = inf_io.aligned_empty(shard.flat.home_nbytes) if port.working.staged else None

        def fill(views: StateViews) -> None:
            init_states(shard, views, scratch)
            for i, (slot, entry) in enumerate(zip(slots, loaded)):
                if entry is None:
                    continue
                sl = slice(slot.offset, slot.offset + slot.numel)
                views.set_slot_moments(shard.flat, i, entry["exp_avg"], entry["exp_avg_sq"])
                if entry.get("master") is not None:
                    views.set_master(entry["master"].reshape(-1), sl)
                shard.steps[i] = int(_float(entry["step"]))

        store.rewrite(shard, fill, "loading", read=False)
        shard.initialized = True


def refuse_sharded(what: str) -> RuntimeError:
    return RuntimeError(
        f"infinity: {what} of a sharded model (shard='zero1'/'zero2'/'zero3' over "
        "torch.distributed) is not built yet. Use infinity.sharding.save_sharded(path, model, "
        "optimizer) / load_sharded (one file per rank; loads on any number of ranks), or "
        "infinity.sharding.full_state_dict(model) and full_optimizer_state_dict(optimizer) on "
        "every rank (whole state dicts on rank 0; load_full_state_dict / "
        "load_full_optimizer_state_dict on any number of ranks); see docs/zero3.md"
    )
