"""Which engine owns a model or a parameter. The engines register here at wrap (with where
each of their parameters lives) and unregister at close; the registry holds them weakly."""

from __future__ import annotations

import weakref
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from .block import Block
from .flat import FlatParam

_ENGINE_ATTR = "_infinity_engine"


def engine_of(model: nn.Module) -> Optional[Any]:
    """The engine (runtime/engine.py) wrapping ``model``, or None."""
    return getattr(model, _ENGINE_ATTR, None)


class ParamLocation(NamedTuple):
    engine: Any  # the Engine (runtime/engine.py)
    block: Block
    flat: FlatParam
    slot: int


# every live engine, with where its parameters live: (block index, flat index, slot) by id
# of the parameter -- indices, not objects: a value reaching the model (a Block does) would
# keep its engine, the key, alive
_LOCATIONS: weakref.WeakKeyDictionary[Any, Dict[int, Tuple[int, int, int]]] = (
    weakref.WeakKeyDictionary()
)
_ENGINES = _LOCATIONS  # iterating gives the live engines


def register(engine: Any, model: nn.Module, blocks: Sequence[Block]) -> None:
    """``engine`` wraps ``model``, whose parameters lie in the slots of ``blocks``' flats."""
    _LOCATIONS[engine] = {
        id(s.param): (b.index, fi, si)
        for b in blocks
        for fi, f in enumerate(b.flats)
        for si, s in enumerate(f.slots)
    }
    setattr(model, _ENGINE_ATTR, engine)


def unregister(engine: Any, model: nn.Module) -> None:
    _LOCATIONS.pop(engine, None)
    if engine_of(model) is engine:
        delattr(model, _ENGINE_ATTR)


def locate(param: torch.Tensor) -> Optional[ParamLocation]:
    """Where a wrapped parameter lives (engine, block, flat buffer, slot), or None if the
    parameter does not belong to a wrapped model."""
    for engine, locations in list(_LOCATIONS.items()):
        found = locations.get(id(param))
        if found is None:
            continue
        block = engine.blocks[found[0]]
        flat = block.flats[found[1]]
        if flat.slots[found[2]].param is param:
            return ParamLocation(engine, block, flat, found[2])
    return None
