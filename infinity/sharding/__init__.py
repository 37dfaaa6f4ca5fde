"""ZeRO sharding over torch.distributed: each rank keeps, offloads and steps only its part of
every block's flat buffer (see docs/zero3.md). Enabled by ``infinity.wrap`` when
torch.distributed is initialised (``shard='auto'``) or a process group / DeviceMesh is
given."""
from .collectives import CollectiveTimeoutError, RanksDivergedError
from .checkpoint import load_sharded, save_sharded
from .group import DistGroups
from .partitioner import Partitioner
from .state import (full_optimizer_state_dict, full_state_dict,
                    load_full_optimizer_state_dict, load_full_state_dict)

__all__ = ["CollectiveTimeoutError", "DistGroups", "Partitioner", "RanksDivergedError",
           "full_optimizer_state_dict", "full_state_dict", "load_full_optimizer_state_dict",
           "load_full_state_dict", "load_sharded", "save_sharded"]
