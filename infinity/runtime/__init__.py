"""The runtime: blocks, residency, schedule, hooks, transfers and the Engine that owns them."""
from .engine import Engine, engine_of
from .residency import Residency, ResidencyError
from .stats import Stats

__all__ = ["Engine", "engine_of", "Residency", "ResidencyError", "Stats"]
