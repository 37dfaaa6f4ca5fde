"""Which ranks shard a model and which replicate it: resolved once at wrap from the
``process_group`` argument (a ProcessGroup, a 1-D or 2-D DeviceMesh, or None: the default
group when torch.distributed is initialised)."""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch.distributed as dist

logger = logging.getLogger(__name__)

SHARD_STAGES = ("auto", "none", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class DistGroups:
    """The resolved groups: ``shard`` holds the ranks that split each flat buffer (this rank
    keeps part ``rank`` of ``world``); ``replicate`` (hybrid sharding, 2-D mesh) holds the
    ranks with the same part, whose gradients are all-reduced (None: no replication)."""

    shard: Any
    replicate: Any
    rank: int
    world: int
    replicas: int
    global_rank: int
    backend: str
    timeout_s: float

    @property
    def total(self) -> int:
        return self.world * self.replicas

    @property
    def swap_tag(self) -> str:
        """Prefix of this rank's swap directories: host name and global rank, so ranks on one
        host and nodes sharing a filesystem never use the same directory."""
        host = socket.gethostname().split(".")[0] or "host"
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in host)
        return f"{safe}-rank{self.global_rank}-"


def _is_mesh(obj: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - old torch
        return False
    return isinstance(obj, DeviceMesh)


def resolve(process_group: Any, shard: str, timeout_s: float) -> Optional[DistGroups]:
    """The groups to shard over, or None for the single-process path (torch.distributed not
    initialised and no group given, world size 1, or ``shard='none'``)."""
    if shard not in SHARD_STAGES:
        raise ValueError(
            f"infinity: shard={shard!r}; use 'zero3' (parameters, gradients and "
            "optimizer states sharded), 'zero2' (gradients and states), 'zero1' "
            "(optimizer states), 'none' or 'auto' (zero3 when torch.distributed "
            "is initialised with more than one rank)"
        )
    if shard == "none":
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None or shard != "auto":
            raise RuntimeError(
                f"infinity: shard={shard!r} / process_group need torch.distributed: call "
                "torch.distributed.init_process_group(...) first (torchrun sets up the "
                "environment), or pass shard='none'"
            )
        return None
    replicate = None
    if process_group is None:
        ranks = list(range(dist.get_world_size()))
        if len(ranks) == 1:
            return None
        # a group of our own: its timeout bounds every collective (divergent ranks fail)
        group = dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=float(timeout_s)))
    elif _is_mesh(process_group):
        mesh = process_group
        if mesh.ndim == 1:
            group = mesh.get_group(0)
        elif mesh.ndim == 2:
            replicate, group = mesh.get_group(0), mesh.get_group(1)
        else:
            raise ValueError(
                f"infinity: a DeviceMesh of {mesh.ndim} dimensions; pass a 1-D "
                "mesh (shard) or a 2-D mesh (replicate, shard)"
            )
    else:
        group = process_group
    world = dist.get_world_size(group)
    replicas = dist.get_world_size(replicate) if replicate is not None else 1
    if world * replicas == 1:
        return None
    backend = str(dist.get_backend(group)).lower()
    groups = DistGroups(
        group,
        replicate,
        dist.get_rank(group),
        world,
        replicas,
        dist.get_rank(),
        backend,
        float(timeout_s),
    )
    logger.info(
        "infinity: sharding over %d rank(s) (this is part %d)%s, backend %s",
        world,
        groups.rank,
        f", {replicas} replicas" if replicas > 1 else "",
        backend,
    )
    return groups


def node_group(groups: DistGroups, node_size: int) -> Tuple[Any, int]:
    """hpZ: the group of the ranks in this rank's node (``node_size`` consecutive ranks of the
    shard group) and this rank's place in it. Every rank makes every node's group (collective
    over the default group)."""
    if groups.replicate is not None:
        raise ValueError(
            "infinity: CommPolicy(node_size=...) cuts nodes out of a 1-D group; a 2-D mesh "
            "(replicate, shard) already keeps every all-gather inside its shard dimension: "
            "make that dimension the node (init_device_mesh(..., (nodes, ranks_per_node))) "
            "and drop node_size, or pass a 1-D group with node_size"
        )
    if node_size < 2 or node_size >= groups.world or groups.world % node_size:
        raise ValueError(
            f"infinity: CommPolicy(node_size={node_size}) must divide the {groups.world} "
            f"ranks into nodes of 2 or more ranks (and fewer than all of them)"
        )
    ranks = dist.get_process_group_ranks(groups.shard)
    mine = None
    for start in range(0, groups.world, node_size):
        group = dist.new_group(ranks=ranks[start : start + node_size])
        if start <= groups.rank < start + node_size:
            mine = group
    return mine, groups.rank % node_size


def stage_of(shard: str) -> str:
    return "zero3" if shard == "auto" else shard


__all__ = ["DistGroups", "SHARD_STAGES", "node_group", "resolve", "stage_of"]
