"""The optimizer's side of the wrapped models it steps: one :class:`ModelSide` per model (its
port, its state store once the tier is chosen, the modules holding each parameter) and the
shards of all of them (:class:`WrappedModels`)."""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..runtime.port import BackwardListener, OptimizerPort, PortLocation
from ..tiers.chunk_size import resolve_chunk_bytes
from .states.store import StateStore
from .states.tier import choose_tier, new_store
from .step.choices import FormatChoices
from .step.formats import param_owners
from .step.layout import state_nbytes
from .step.shard import Shard

logger = logging.getLogger(__name__)


class ModelSide:
    """What the optimizer holds for one wrapped model: its port, the state store of its
    shards (made at first use, in the tier :func:`.stores.choose_tier` decides) and the modules
    that hold each of its parameters (for the moment formats' safeguards)."""

    def __init__(self, port: OptimizerPort) -> None:
        self.port = port
        self.store: Optional[StateStore] = None
        self._owners: Optional[Dict[int, List[torch.nn.Module]]] = None

    @property
    def owners(self) -> Dict[int, List[torch.nn.Module]]:
        """id(param) -> the modules of the model that hold it."""
        if self._owners is None:
            self._owners = param_owners(self.port.model)
        return self._owners


class WrappedModels:
    """The optimizer's wrapped parameters: the shards (one per FlatParam, this rank's part of a
    sharded one), where each parameter sits in them, and one :class:`ModelSide` per model.

    ``master``: the master-weight format; ``chunk_bytes``: the optimizer's own chunk (None: the
    model's)."""

    def __init__(self, formats: FormatChoices, master: str, chunk_bytes: Optional[int]) -> None:
        self.formats = formats
        self.master = master
        self.chunk_bytes = chunk_bytes
        self.shards: Dict[int, Shard] = {}  # id(flat) -> shard, in registration order
        self._where: Dict[int, Tuple[Shard, int]] = {}  # id(param) -> (shard, slot)
        self._elsewhere: Set[int] = set()  # ZeRO: ids of params other ranks step
        self._models: Dict[OptimizerPort, ModelSide] = {}  # in the order first seen

    # ---- registration ------------------------------------------------------------------------
    def add(
        self,
        p: torch.Tensor,
        loc: Optional[PortLocation],
        group: int,
        listener: BackwardListener,
    ) -> None:
        """Records parameter ``p`` of param group ``group`` (``loc``: where it is wrapped, None
        for an unwrapped one); ``listener`` hears the backward of its model."""
        if loc is None:
            self.formats.choose(p)
            return
        side = self.side(loc.port)
        whole = loc.flat.slots[loc.slot].numel  # the whole parameter (full flat)
        self.formats.choose(p, whole, side.owners.get(id(p), []))
        loc.port.engine.attach_optimizer()  # the engine prefetches after our step (sharded: even without part)
        if loc.part is None:  # another rank steps it: never an unwrapped parameter here
            self._elsewhere.add(id(p))
            return
        flat, slot = loc.part
        shard = self.shards.get(id(flat))
        if shard is None:
            shard = Shard(
                loc.port,
                flat,
                [None] * len(flat.slots),
                formats=self.formats.slot_formats(flat, side.owners),
            )
            self.shards[id(flat)] = shard
        shard.groups[slot] = group
        self._where[id(p)] = (shard, slot)
        loc.port.add_listener(listener)

    def is_wrapped(self, p: torch.Tensor) -> bool:
        if id(p) in self._elsewhere:
            return True
        where = self._where.get(id(p))
        return where is not None and where[0].flat.slots[where[1]].param is p

    # ---- models ------------------------------------------------------------------------------
    def side(self, port: OptimizerPort) -> ModelSide:
        side = self._models.get(port)
        if side is None:
            side = self._models[port] = ModelSide(port)
        return side

    def ports(self) -> List[OptimizerPort]:
        """The ports of the models this optimizer steps, in the same order on every rank."""
        return list(self._models)

    def sides(self) -> List[ModelSide]:
        return list(self._models.values())

    @property
    def sharded(self) -> Optional[OptimizerPort]:
        """The port of the first sharded model, or None."""
        return next((p for p in self._models if p.sharded), None)

    def shards_of(self, port: OptimizerPort) -> List[Shard]:
        return [s for s in self.shards.values() if s.port is port]

    def find(self, key: str) -> Optional[Shard]:
        return next((s for s in self.shards.values() if s.key == key), None)

    # ---- state stores ------------------------------------------------------------------------
    def store(self, port: OptimizerPort, later: int = 0) -> StateStore:
        """The model's state store, made on first use (``later``: host bytes the engine still
        takes from its budget, set aside when the tier is chosen before the first backward)."""
        side = self.side(port)
        if side.store is None:
            shards = [s for s in self.shards_of(port) if any(g is not None for g in s.groups)]
            flats, fmts = [s.flat for s in shards], [s.formats for s in shards]
            tier = choose_tier(port, flats, fmts, self.master, later)
            side.store = new_store(tier, port, self.master, self.chunk_for(port), self.shards)
            present = sorted({f for ff in fmts for f in ff})
            logger.info(
                "infinity.optim: %s bytes of %s optimizer states (%s master) on %s",
                f"{sum(state_nbytes(f, ff, self.master) for f, ff in zip(flats, fmts)):,}",
                "+".join(present) or self.formats.spec.default,
                self.master,
                tier,
            )
        return side.store

    def store_of(self, shard: Shard) -> StateStore:
        return self.store(shard.port)

    def stores(self) -> List[StateStore]:
        """The stores made so far."""
        return [s.store for s in self._models.values() if s.store is not None]

    def sets(self) -> List[object]:
        """The NVMe step's buffer sets of the stores that have them."""
        return [s.sets for s in self.stores() if s.sets is not None]

    def chunk_for(self, port: OptimizerPort) -> int:
        """The chunk of this model's NVMe step: ``chunk_bytes=`` given to the optimizer, else
        the model's policy, else derived from its host budget."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return resolve_chunk_bytes(port.facts.chunk_bytes, port.host_budget.limit, "infinity.optim")

    def reserve(self) -> None:
        """With a host budget: the state tier is chosen and, on NVMe, the buffer sets are
        counted in the budget now, so a budget below their minimum is refused at construction
        rather than at the first step (after a whole forward and backward)."""
        for port in self.ports():
            if port.host_budget.limit is None or not self.shards_of(port):
                continue
            later = port.host_bytes_later  # before the first backward: its gradients
            self.store(port, later).reserve(later)

    def close(self, listener: object) -> None:
        """Releases the stores and stops ``listener`` hearing the models' backward."""
        for side in self._models.values():
            side.port.remove_listener(listener)
            if side.store is not None:
                side.store.close()
                side.store = None
        for shard in self.shards.values():
            shard.initialized = False


__all__ = ["ModelSide", "WrappedModels"]
