"""Memory tiers: the Tier enum, byte budgets, the host staging pool and the NVMe SwapStore."""

from .budget import BudgetExceededError, ByteBudget
from .host_pool import HostPool
from .swap_store import SwapCorruptionError, SwapStore
from .tier import Tier

__all__ = [
    "Tier",
    "ByteBudget",
    "BudgetExceededError",
    "HostPool",
    "SwapStore",
    "SwapCorruptionError",
]
