"""Which engine owns a model or a parameter."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
from torch import nn

from .block import Block
from .flat import FlatParam

if TYPE_CHECKING:
    from .engine import Engine

_ENGINE_ATTR = "_infinity_engine"


def engine_of(model: nn.Module) -> Optional["Engine"]:
    return getattr(model, _ENGINE_ATTR, None)


class ParamLocation(NamedTuple):
    engine: "Engine"
    block: Block
    flat: FlatParam
    slot: int


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def locate(param: torch.Tensor) -> Optional[ParamLocation]:
    """Where a wrapped parameter lives (engine, block, flat buffer, slot), or None if the
    parameter does not belong to a wrapped model."""
    for engine in list(_ENGINES):
        loc = engine._locations.get(id(param))
        if loc is not None and loc.flat.slots[loc.slot].param is param:
            return loc
    return None


