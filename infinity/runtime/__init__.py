"""The runtime: blocks, residency, schedule, hooks, transfers and the Engine that owns them."""

from .core.residency import Residency, ResidencyError
from .core.stats import Stats
from .engine import Engine, ParamLocation, engine_of, locate

__all__ = ["Engine", "ParamLocation", "engine_of", "locate", "Residency", "ResidencyError", "Stats"]
