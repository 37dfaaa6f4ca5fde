"""infinity: heterogeneous GPU/CPU/NVMe offload engine for PyTorch training.

model = infinity.wrap(model, nvme_path="/mnt/ssd")
opt = infinity.optim.AdamW(model.parameters(), lr=1e-4)
"""

from .accumulation import ChainError, accumulate
from .api import empty_init, gradient, materialized, parameters_changed, stats, unwrap, wrap
from .checkpoint import consolidate, load_checkpoint, save_checkpoint
from .plan import PlanError, estimate, explain, probe
from .policy import CommPolicy, OffloadPolicy
from .runtime.experts import expert_block_rule, fuse_experts, slice_experts
from .tiers import Tier
from .trace_events import trace
from .version import __version__

__all__ = [
    "wrap",
    "unwrap",
    "stats",
    "materialized",
    "gradient",
    "empty_init",
    "parameters_changed",
    "CommPolicy",
    "OffloadPolicy",
    "Tier",
    "__version__",
]
__all__ += ["accumulate", "ChainError"]
__all__ += ["save_checkpoint", "load_checkpoint", "consolidate"]
__all__ += ["slice_experts", "fuse_experts", "expert_block_rule"]
__all__ += ["probe", "estimate", "explain", "PlanError", "trace"]


def __getattr__(name: str):
    # optim is imported lazily so `import infinity` stays light and one-way layered
    if name == "optim":
        import importlib

        return importlib.import_module(".optim", __name__)
    if name == "dist":
        raise AttributeError(
            "infinity.dist was renamed infinity.sharding: use "
            "infinity.sharding (import infinity.sharding)"
        )
    raise AttributeError(f"module 'infinity' has no attribute {name!r}")
