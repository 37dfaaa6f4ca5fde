"""Partitioner: ZeRO sharding of an engine's flat buffers over torch.distributed ranks.

Design notes: docs/modules.md, runtime/zero/partitioner.py."""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Set, Union

import torch

from ... import io as inf_io
from ...ops.adam_compact import BLOCK_SIZE
from ...policy import CommPolicy
from ...tiers import Tier
from ..core.flat import Binding, FlatParam
from ..homes.home import Home
from ..homes.shard_flat import ShardFlat
from ..homes.sharded import ShardedHome
from .collectives import Collectives
from .compress import Codec, Compression
from .group import DistGroups, node_group
from .secondary import SecondaryPartition

logger = logging.getLogger(__name__)

NO_COMPRESSION = CommPolicy()


class Partitioner:
    def __init__(
        self,
        groups: DistGroups,
        stage: str,
        device: torch.device,
        comm: CommPolicy = NO_COMPRESSION,
    ) -> None:
        self.groups = groups
        self.stage = stage
        self.rank = groups.rank
        self.world = groups.world
        self.device = device
        coll_device = device if groups.backend == "nccl" else torch.device("cpu")
        if device.type == "cuda" and groups.backend != "nccl":
            raise ValueError(
                f"infinity: computing on {device} needs an NCCL process group "
                f"for sharding; got backend {groups.backend!r}"
            )
        self.coll_device = coll_device
        self.blocks: List = []
        self._local: Dict[int, ShardFlat] = {}
        self._block_of: Dict[int, int] = {}
        self._gathered: Set[int] = set()
        self._early: Dict[int, list] = {}  # block index -> in-flight all-gathers
        self.early_gathers = 0
        self._grad_bufs: Dict[int, torch.Tensor] = {}
        self._grad_seen: Dict[int, Set[int]] = {}
        self.coll = Collectives(groups, coll_device, self._block_name)
        self.coll.agree_comm(comm)  # every rank the same settings (else an error on each)
        self._check_comm(comm)
        self.compression: Optional[Compression] = (
            None if comm.weights == comm.grads == "none" else Compression(comm)
        )
        self.secondary: Optional[SecondaryPartition] = None
        if comm.node_size:
            if not self.shards_params:
                raise ValueError(
                    f"infinity: a hierarchical partition (CommPolicy(node_size=...)) keeps "
                    f"part of ZeRO-3's gathered parameters; shard={self.stage!r} gathers none"
                )
            group, node_rank = node_group(groups, comm.node_size)
            self.coll.node_group = group
            self.secondary = SecondaryPartition(group, comm.node_size, node_rank)

    # ---- settings ----------------------------------------------------------------------
    @property
    def shards_params(self) -> bool:
        return self.stage == "zero3"

    @property
    def shards_grads(self) -> bool:
        return self.stage in ("zero2", "zero3")

    @property
    def swap_tag(self) -> str:
        return self.groups.swap_tag

    def pad_multiple(self, dtype: torch.dtype) -> int:
        """Flat buffers are padded to a multiple of this many elements."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.world * max(1, inf_io.ALIGNMENT // itemsize)

    def slot_align(self) -> int:
        """Each parameter starts at a multiple of this many elements of its flat buffer: the
        8-bit quantization block. Parts are cut at multiples of a page of elements (a multiple
        of it), so every cut falls on a block boundary of the parameter it splits: each rank's
        piece quantizes in exactly the blocks one process would use, and 8-bit states give
        the same numbers on any world size."""
        return BLOCK_SIZE

    def _block_name(self, index: int) -> str:
        if 0 <= index < len(self.blocks):
            return self.blocks[index].name
        return f"#{index}"

    def check_tiers(self, param_tier: Tier, grad_tier: Tier) -> None:
        if param_tier is Tier.DEVICE:
            raise ValueError(
                "infinity: shard=... with param_tier='device' is not built; "
                "use param_tier='host' or 'nvme' (each rank keeps its part there)"
            )
        if not self.shards_params and param_tier is Tier.NVME:
            raise ValueError(
                f"infinity: shard={self.stage!r} with parameters on NVMe is not "
                "built; use shard='zero3' (the default) or param_tier='host'"
            )
        if self.stage == "zero1" and grad_tier is Tier.NVME:
            raise ValueError(
                "infinity: shard='zero1' keeps every rank's whole gradient in "
                "host RAM; use grad_tier='host', or shard='zero2'/'zero3'"
            )

    def _check_comm(self, comm: CommPolicy) -> None:
        if comm.weights != "none" and not self.shards_params:
            raise ValueError(
                f"infinity: comm weights={comm.weights!r} compresses ZeRO-3's all-gathers of "
                f"parameters; shard={self.stage!r} gathers none for compute. Use "
                "shard='zero3', or CommPolicy(weights='none', grads=...)"
            )
        if comm.grads != "none" and not self.shards_grads:
            raise ValueError(
                f"infinity: comm grads={comm.grads!r} compresses the reduce-scatter of "
                f"gradients; shard={self.stage!r} all-reduces whole gradients. Use "
                "shard='zero2' or 'zero3', or CommPolicy(grads='none')"
            )

    # ---- structure ---------------------------------------------------------------------
    def attach(self, blocks: List) -> None:
        """Makes this rank's ShardFlat of every flat buffer."""
        self.blocks = list(blocks)
        for block in blocks:
            for flat in block.flats:
                if flat.numel % self.world:
                    raise AssertionError(
                        f"{flat.key}: {flat.numel} elements not padded to "
                        f"{self.world} ranks (engine bug)"
                    )
                n = flat.numel // self.world
                local = ShardFlat(flat, self.rank * n, (self.rank + 1) * n, self.rank, self.world)
                self._local[id(flat)] = local
                self._block_of[id(flat)] = block.index

    def local(self, flat: FlatParam) -> ShardFlat:
        return self._local[id(flat)]

    def home_flats(self) -> List[ShardFlat]:
        return [self._local[id(f)] for b in self.blocks for f in b.flats]

    def wrap_home(self, home: Home) -> Home:
        return ShardedHome(home, self) if self.shards_params else home

    def after_fill(self, flat: FlatParam) -> None:
        """zero1/zero2: the rank's part is a view of the (whole, replicated) home copy."""
        if not self.shards_params:
            local = self.local(flat)
            local.home = flat.home[local.start : local.end]

    def location(self, loc):
        """The optimizer's view of a parameter: its part in this rank's shard (None when no
        element of it is here: another rank steps it)."""
        local = self.local(loc.flat)
        index = local.local_index(loc.slot)
        if index is None:
            return None
        return type(loc)(loc.engine, loc.block, local, index)

    def take_user_writes(self, flat: FlatParam) -> List[int]:
        if not isinstance(flat, ShardFlat):
            written = sorted(flat.user_written)
            flat.user_written.clear()
            return written
        full = flat.full
        written = sorted(
            j for j in (flat.local_index(i) for i in full.user_written) if j is not None
        )
        full.user_written.clear()
        return written

    # ---- parameters outside forward (zero3) -------------------------------------------
    def bind_outside(self, flat: FlatParam) -> None:
        """Outside forward a zero3 parameter is not materialized on any rank: it views a NaN
        of its shape (one element, broadcast). Reading it gives NaN (loudly wrong, never a
        freed buffer); writing it in place raises; ``p.data = tensor`` is taken in. Use
        ``infinity.materialized(model)`` (on every rank) to read real values, or
        ``infinity.sharding.full_state_dict``."""
        for s in flat.slots:
            nan = torch.full((1,), float("nan"), dtype=flat.home_dtype)
            s.param.data = nan.view(()) if len(s.shape) == 0 else nan.expand(s.shape)
        flat.binding = Binding.OUTSIDE
        flat.record_versions()

    def refuse_inplace_outside(
        self, flat: FlatParam, written: List[int], rebound: List[int]
    ) -> None:
        silent = [i for i in written if i not in rebound]
        if silent:
            names = ", ".join(repr(flat.slots[i].qualname) for i in silent[:3])
            raise RuntimeError(
                f"infinity: parameter(s) {names} were changed in place outside forward, but "
                "with shard='zero3' a parameter outside forward is not materialized (it reads "
                "as NaN); the change is lost. Change it inside `with infinity.materialized("
                "model):` (on every rank), assign `p.data = new_tensor`, or load with "
                "infinity.sharding.load_full_state_dict"
            )

    # ---- fetch: all-gather (zero3) ----------------------------------------------------
    def gather_if_needed(self, block) -> None:
        """Called once the block's fetch (this rank's part) completed, when the block is
        needed: all-gathers the other ranks' parts into its compute buffers."""
        if not self.shards_params or block.index in self._gathered:
            return
        if block.index in self._early:
            self._finish_early(block)
            return
        for flat in block.flats:
            if flat.compute.device != self.coll_device:  # pragma: no cover - gloo with CUDA
                raise RuntimeError("infinity: collectives device mismatch (engine bug)")
            self._gather(block, flat, early=False)
        self._gathered.add(block.index)

    def _gather(self, block, flat: FlatParam, early: bool):
        """One flat's all-gather: in backward from the node's kept parts when there are
        (hpZ), else over every rank (then, in a forward that backward follows, keeping this
        rank's node part). Returns the in-flight gather (``early``) and whether to keep."""
        compute = flat.compute
        kept = None
        if self.secondary is not None and torch._C._current_graph_task_id() != -1:
            kept = self.secondary.take(flat)
        if kept is not None:
            if early:
                return self.coll.all_gather_async(compute, kept, block.index, node=True), False
            self.coll.all_gather(compute, kept, block.index, node=True)
            return None, False
        local = self.local(flat)
        part = compute[local.start : local.end].clone()
        codec = self._weight_codec(compute)
        keep = (
            self.secondary is not None
            and torch.is_grad_enabled()
            and torch._C._current_graph_task_id() == -1
        )
        if early:
            return self.coll.all_gather_async(compute, part, block.index, codec=codec), keep
        self.coll.all_gather(compute, part, block.index, codec=codec)
        if keep and self.secondary is not None:
            self.secondary.keep(flat, compute)
        return None, False

    def _weight_codec(self, compute: torch.Tensor) -> Optional[Codec]:
        """The codec of a compute buffer's all-gather (float buffers only: a frozen base's
        codes travel as they are)."""
        if self.compression is None or not compute.dtype.is_floating_point:
            return None
        return self.compression.weights

    def wants_early_gather(self, block) -> bool:
        return block.index not in self._gathered and block.index not in self._early

    def start_gather(self, block) -> None:
        """Starts the block's all-gather asynchronously (its part already fetched): it
        overlaps the running block's compute; :meth:`gather_if_needed` waits for it."""
        works = []
        for flat in block.flats:
            work, keep = self._gather(block, flat, early=True)
            works.append((flat, work, keep))
        self._early[block.index] = works
        self.early_gathers += 1

    def _finish_early(self, block) -> None:
        works = self._early.pop(block.index)
        for flat, work, keep in works:
            self.coll.wait(work, block.index)
            if keep and self.secondary is not None:
                self.secondary.keep(flat, flat.compute)
        self._gathered.add(block.index)

    def dropped(self, block) -> None:
        if block.index in self._early:  # never free a buffer a collective still writes
            self._finish_early(block)
        self._gathered.discard(block.index)

    def drain(self) -> None:
        """Waits for every early all-gather still in flight (close, recovery)."""
        for index in list(self._early):
            self._finish_early(self.blocks[index])

    def gather_home(self, flat: FlatParam, local_values: torch.Tensor) -> torch.Tensor:
        """The whole flat buffer (home dtype, CPU) from every rank's home part."""
        out = torch.empty(flat.numel, dtype=flat.home_dtype, device=self.coll_device)
        self.coll.all_gather(
            out, local_values.to(self.coll_device), self._block_of[id(flat)], kind=5
        )
        return out.cpu()

    def after_step(self) -> None:
        """zero1/zero2: every rank stepped its part of the replicated homes; all-gather them."""
        if self.shards_params:
            return
        for block in self.blocks:
            for flat in block.flats:
                local = self.local(flat)
                self.coll.all_gather(
                    flat.home, flat.home[local.start : local.end].clone(), block.index, kind=6
                )

    # ---- gradients ---------------------------------------------------------------------
    def add_grad(self, flat: FlatParam, index: int, grad: torch.Tensor) -> None:
        """Accumulates one parameter's gradient into the flat gradient buffer on the device
        (fp32), reduced once the block's backward is over."""
        buf = self._grad_bufs.get(id(flat))
        s = flat.slots[index]
        if buf is None:
            buf = torch.zeros(flat.numel, dtype=torch.float32, device=self.coll_device)
            self._grad_bufs[id(flat)] = buf
            self._grad_seen[id(flat)] = set()
        if grad.is_sparse:
            raise TypeError(f"{s.qualname}: sparse gradients are not supported")
        buf[s.offset : s.offset + s.numel].add_(grad.detach().reshape(-1).to(buf.dtype))
        self._grad_seen[id(flat)].add(index)

    def has_pending(self, flat: FlatParam) -> bool:
        return id(flat) in self._grad_bufs

    def sink_flat(self, flat: FlatParam) -> FlatParam:
        """What the gradient sink holds of ``flat``: this rank's part (zero2/3) or all of it."""
        return self.local(flat) if self.shards_grads else flat

    def reduce_grads(
        self,
        flat: FlatParam,
        sink,
        every_rank: bool = False,
        how: Optional[Callable[[FlatParam], object]] = None,
    ) -> None:
        """Reduces the flat's gradient buffer over the ranks and hands this rank's part to
        the gradient sink (zero2/3); zero1 hands the whole averaged gradient. A slot gets a
        gradient when any rank has one (as one process on the global batch would), so ranks
        that route to different experts agree. ``every_rank``: the block closed at the same
        moment on every rank, so this rank joins with zeros where it has no gradient.
        ``how``: how the sink closes what it got (an optimizer stepping it in backward may
        keep it in RAM); None: written."""
        buf = self._grad_bufs.pop(id(flat), None)
        seen = self._grad_seen.pop(id(flat), set())
        if buf is None:
            if not every_rank or not any(s.trainable for s in flat.slots):
                return
            buf = torch.zeros(flat.numel, dtype=torch.float32, device=self.coll_device)
        index = self._block_of[id(flat)]
        mine = torch.zeros(len(flat.slots), dtype=torch.bool)
        if seen:
            mine[sorted(seen)] = True
        if self.shards_grads:
            local = self.local(flat)
            out = torch.empty(local.numel, dtype=torch.float32, device=self.coll_device)
            codec = self.compression.grads if self.compression is not None else None
            residual = (
                self.compression.residual(id(flat), buf.numel(), buf.device)
                if self.compression is not None
                else None
            )
            anyone = self.coll.reduce_scatter_avg(out, buf, index, mine, codec, residual)
            for li, s in enumerate(local.slots):
                if anyone[s.full_index]:
                    sink.add(local, li, out[s.offset : s.offset + s.numel])
            if how is None:
                sink.close(local)
            else:
                sink.close(local, how(local))
        else:
            anyone = self.coll.all_reduce_avg(buf, index, mine)
            for i in anyone.nonzero().flatten().tolist():
                s = flat.slots[i]
                sink.add(flat, i, buf[s.offset : s.offset + s.numel].view(s.shape))
            if how is None:
                sink.close(flat)
            else:
                sink.close(flat, how(flat))

    def flush_grads(self, sink) -> None:
        """End of backward: reduces every flat still holding gradients, in block order (and
        lets the node parts kept for it go)."""
        if self.secondary is not None:
            self.secondary.clear()
        for block in self.blocks:
            for flat in block.flats:
                if id(flat) in self._grad_bufs:
                    self.reduce_grads(flat, sink)

    def drop_grads(self) -> None:
        """After a backward that raised: its unreduced gradients are dropped."""
        self._grad_bufs.clear()
        self._grad_seen.clear()

    def sync_zero1_views(self) -> None:
        """zero1: the optimizer's part of each flat views the whole gradient accumulator."""
        if self.stage != "zero1":
            return
        for block in self.blocks:
            for flat in block.flats:
                local = self.local(flat)
                local.grad = flat.grad[local.start : local.end] if flat.grad is not None else None
                local.grad_ready = [flat.grad_ready[s.full_index] for s in local.slots]

    # ---- optimizer: global values ------------------------------------------------------
    def all_reduce(self, value: float, op: str) -> float:
        return self.coll.all_reduce_scalar(value, op, replicas=False)

    def any_rank(self, flags: torch.Tensor) -> torch.Tensor:
        """Per item, whether any data-parallel rank set it (MoE routing agreement)."""
        return self.coll.any_rank(flags)

    def stats(self) -> Dict[str, object]:
        return {
            "stage": self.stage,
            "rank": self.rank,
            "world": self.world,
            "early_gathers": self.early_gathers,
            "replicas": self.groups.replicas,
            "seconds": dict(self.coll.seconds),
            "bytes": dict(self.coll.bytes),
            "wire_bytes": dict(self.coll.wire_bytes),
            "phase_bytes": dict(self.coll.phase_bytes),
            "secondary_peak_bytes": 0 if self.secondary is None else self.secondary.peak_bytes,
            "comm": None if self.compression is None else self.compression.policy,
            "error_feedback_bytes": (
                0 if self.compression is None else self.compression.residual_bytes
            ),
            "calls": dict(self.coll.calls),
        }


def make_partitioner(
    process_group,
    shard: str,
    timeout_s: float,
    device: torch.device,
    comm_setting: Union[None, str, CommPolicy] = None,
) -> Optional[Partitioner]:
    from .group import resolve, stage_of

    comm = CommPolicy.parse(comm_setting)
    groups = resolve(process_group, shard, timeout_s)
    if groups is None:
        if not comm.off:
            logger.warning(
                "infinity: comm=%s asks for compressed collectives, but the model is not "
                "sharded over several ranks: there is nothing to compress",
                comm,
            )
        return None
    return Partitioner(groups, stage_of(shard), device, comm)


__all__ = ["Partitioner", "make_partitioner"]
