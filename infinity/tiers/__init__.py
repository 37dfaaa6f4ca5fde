"""Memory tiers: the Tier enum, byte budgets, the host staging pool and the NVMe SwapStore."""
from .tier import Tier
from .budget import ByteBudget, BudgetExceededError
from .host_pool import HostPool
from .swap_store import SwapStore, SwapCorruptionError

__all__ = ["Tier", "ByteBudget", "BudgetExceededError", "HostPool", "SwapStore",
           "SwapCorruptionError"]
