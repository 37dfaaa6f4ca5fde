"""Where a wrapped model's optimizer states live: the tier chosen once per model, and its
store made (:class:`~.host_states.HostStates` or :class:`~.nvme_states.NvmeStates`)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

from ...runtime.core.flat import FlatParam
from ...runtime.port import OptimizerPort
from ...tiers.tier import resolve_optimizer_tier
from ..step.layout import state_nbytes
from ..step.shard import Shard
from .host import HostStates
from .nvme import NvmeStates
from .store import StateStore

_STORES = {"host": HostStates, "nvme": NvmeStates}


def choose_tier(
    port: OptimizerPort,
    flats: List[FlatParam],
    fmt: Union[str, Sequence[Union[str, Sequence[str]]]] = "fp32",
    master: str = "fp32",
    later: int = 0,
) -> str:
    """The optimizer-state tier of ``port``'s model: the one resolved at wrap
    (:attr:`OptimizerPort.optimizer_tier`: set by hand, or by the planner), else -- where wrap
    left it "auto" because the planner did not run -- "nvme" when ``nvme_path`` is set and (no
    ``host_budget`` is set, or the states (in format ``fmt``: one for all, or per flat one
    format or one per slot) do not fit in what is left of it, ``later`` bytes that the engine
    still takes from it set aside), else "host". The states' size is known only here, once the
    optimizer has chosen their formats."""
    facts = port.facts
    fits = False
    if facts.optimizer_tier is None and facts.nvme_path is not None and facts.host_budget_set:
        per_flat = [fmt] * len(flats) if isinstance(fmt, str) else list(fmt)
        need = sum(state_nbytes(f, ff, master) for f, ff in zip(flats, per_flat))
        fits = port.host_budget.fits(need + later)
    tier = resolve_optimizer_tier(
        facts.optimizer_tier, facts.nvme_path, facts.host_budget_set, fits
    )
    return tier.value


def new_store(
    tier: str,
    port: OptimizerPort,
    master: str,
    chunk_bytes: Optional[int],
    shards: Dict[int, Shard],
) -> StateStore:
    """The store of ``tier`` (as :func:`choose_tier` decided) for ``port``'s shards;
    ``chunk_bytes``: the unit size of a tier that moves states in units."""
    cls = _STORES.get(tier)
    if cls is None:
        raise ValueError(f"infinity.optim: unknown optimizer-state tier {tier!r}")
    return cls(port, master, shards=shards, chunk_bytes=chunk_bytes)


__all__ = ["choose_tier", "new_store"]
