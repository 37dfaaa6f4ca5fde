"""What a wrapped model holds where, computed from its planned blocks: the host RAM the engine
itself needs by purpose, the staging and gradient pools, the working set of the streamed
compute buffers. Read at wrap (the budget checks, the pools) and after (``tier_bytes``)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ...policy import OffloadPolicy
from ...tiers import ByteBudget, Tier
from ...tiers.chunk_size import resolve_chunk_bytes
from ...tiers.pool_plan import PoolPlan, plan_pools
from ..core.block import Block
from ..core.flat import FlatParam


class Sizing:
    """Sizes of one wrapped model's parts (ZeRO: this rank's parts)."""

    def __init__(
        self,
        policy: OffloadPolicy,
        blocks: List[Block],
        partitioner,
        grad_tier: Tier,
        host_budget: ByteBudget,
        pooled_compute: bool,
    ) -> None:
        self.policy = policy
        self.blocks = blocks
        self.partitioner = partitioner
        self.grad_tier = grad_tier
        self.host_budget = host_budget
        # CPU device: streamed blocks borrow their compute memory from a pool (compute_pool.py)
        self.pooled_compute = pooled_compute

    @property
    def flats(self) -> List[FlatParam]:
        return [f for b in self.blocks for f in b.flats]

    def home_flat(self, flat: FlatParam) -> FlatParam:
        """The flat whose home this rank keeps: its part with shard='zero3', else ``flat``."""
        p = self.partitioner
        return p.local(flat) if p is not None and p.shards_params else flat

    def sink_flats(self) -> List[FlatParam]:
        """The flats whose gradients this rank keeps (its parts with shard='zero2/3')."""
        p = self.partitioner
        return p.home_flats() if p is not None and p.shards_grads else self.flats

    def transfer_workers(self) -> int:
        """Fetches in flight at once (one transfer thread each)."""
        return max(1, min(2, self.policy.prefetch_window))

    def host_needs(self, limit: Optional[int] = None) -> Dict[str, int]:
        """What the engine itself holds in host RAM (bytes), by purpose, before any optimizer,
        under the host budget (``limit``: under that budget instead). Staging and NVMe gradient
        buffers are chunk-sized (see :meth:`pool_plan`)."""
        trainable = [f for f in self.sink_flats() if f.trainable]
        plan = self.pool_plan(limit)
        needs: Dict[str, int] = {}
        host_flats = [f for b in self.blocks if b.home is Tier.HOST for f in b.flats]
        if host_flats:
            needs["parameter homes"] = sum(self.home_flat(f).home_nbytes for f in host_flats)
        if plan.staging_bytes:
            needs["staging"] = plan.staging_total
        if trainable:
            if self.grad_tier is Tier.HOST:
                needs["gradient accumulators"] = sum(f.numel * 4 for f in trainable)
            else:
                needs["gradient buffers"] = plan.grad_total
        return needs

    def pool_plan(self, limit: Optional[int] = None) -> PoolPlan:
        """Sizes and counts of the staging and NVMe gradient pools: buffers of one chunk
        (``chunk_bytes``, by default derived from the host budget), or of the largest flat
        when that is smaller; with a host budget, counts shrink towards 1 staging + 2 gradient
        buffers to leave room for the rest (parameter homes, host gradients, and on a CPU
        device the compute buffers' minimum: the root block + the largest block)."""
        from_nvme = [b for b in self.blocks if not b.resident and b.home is Tier.NVME]
        largest_home = max(
            (self.home_flat(f).home_nbytes for b in from_nvme for f in b.flats), default=0
        )
        trainable = [f for f in self.sink_flats() if f.trainable]
        largest_grad = (
            max((f.numel * 4 for f in trainable), default=0) if self.grad_tier is Tier.NVME else 0
        )
        limit = self.host_budget.limit if limit is None else limit
        room: Optional[int] = None
        if limit is not None:
            fixed = sum(
                self.home_flat(f).home_nbytes
                for b in self.blocks
                if b.home is Tier.HOST
                for f in b.flats
            )
            if self.grad_tier is Tier.HOST:
                fixed += sum(f.numel * 4 for f in trainable)
            if self.pooled_compute:
                streamed = [b for b in self.blocks if not b.resident]
                fixed += sum(b.compute_nbytes for b in streamed if b.is_root)
                fixed += max((b.compute_nbytes for b in streamed if not b.is_root), default=0)
            room = limit - fixed
        return plan_pools(
            resolve_chunk_bytes(self.policy.chunk_bytes, limit),
            largest_home=largest_home,
            staging_default=(1 if self.pooled_compute else self.transfer_workers()),
            largest_grad=largest_grad,
            grad_default=self.policy.prefetch_window + 2,
            room=room,
        )

    def working_set(self) -> Tuple[int, Optional[Block], int, int]:
        """What streamed compute buffers must hold at once: (root bytes, the largest streamed
        block other than the root, its bytes, the largest layer block's bytes). The root
        block stays materialized for the whole step; every other block (layers, outer
        blocks such as the embedding or the head) is fetched when used and released after."""
        streamed = [b for b in self.blocks if not b.resident]
        root = sum(b.compute_nbytes for b in streamed if b.is_root)
        # an embedding looked up row by row is never materialized whole in a step
        others = [b for b in streamed if not b.is_root and not b.row_lookup]
        largest = max(others, key=lambda b: b.compute_nbytes, default=None)
        layer = max((b.compute_nbytes for b in others if b.kind == "layer"), default=0)
        return root, largest, (largest.compute_nbytes if largest is not None else 0), layer
