"""ZeRO sharding over torch.distributed, the public names: each rank keeps, offloads and steps
only its part of every block's flat buffer (see docs/zero3.md). ``infinity.wrap`` shards when
torch.distributed is initialised (``shard='auto'``) or a process group / DeviceMesh is given;
the machinery lives in :mod:`infinity.runtime.zero`, checkpoints in :mod:`infinity.checkpoint`."""

from .checkpoint.per_rank import FORMAT, VERSION, is_sharded_checkpoint, trainer_state
from .checkpoint.sharded import load_sharded, save_sharded
from .optim.zero_states import full_optimizer_state_dict, load_full_optimizer_state_dict
from .runtime.zero.collectives import CollectiveTimeoutError, RanksDivergedError
from .runtime.zero.group import DistGroups
from .runtime.zero.partitioner import Partitioner
from .runtime.zero.state import full_state_dict, load_full_state_dict

__all__ = [
    "FORMAT",
    "VERSION",
    "CollectiveTimeoutError",
    "DistGroups",
    "Partitioner",
    "RanksDivergedError",
    "full_optimizer_state_dict",
    "full_state_dict",
    "is_sharded_checkpoint",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "load_sharded",
    "save_sharded",
    "trainer_state",
]
