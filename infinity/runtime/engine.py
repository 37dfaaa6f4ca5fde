"""Engine: one per wrapped model. Owns the blocks, homes, pools, swap store, schedule,
transfers and stats; builds them at wrap (streaming, block by block) and takes them down at
unwrap.

Its behaviour is split by concern, one file each, all sharing the Engine's state:
    residence.py   fetch / release under the device budget (the residency state machine)
    outside.py     parameters outside forward: views of the homes, writes through them
    lifecycle.py   the forward/backward hook handlers, recovery after an exception
    homes.py       the tier of each home (host / NVMe / device)
    grads.py       where gradients go (GradientSink), also the optimizer's gradient source
The optimizer sees only: quiesce()/resume() around its step, engine.grads (ready, in_ram,
read/verify, finite, slot_norms, lost), engine.home (read_into, write_from, working_buffer),
take_user_writes(), attach_optimizer(), working_copy_staged. Every state change happens on the
thread running forward/backward (or the optimizer), under one lock; transfer threads only copy
bytes and complete futures.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import io as inf_io
from ..policy import OffloadPolicy
from ..tiers import BudgetExceededError, ByteBudget, HostPool, SwapStore, Tier
from ..tiers.disk_space import check_free_space
from ..tiers.chunk_size import resolve_chunk_bytes
from ..tiers.pool_plan import MAX_PIECE_BYTES, PoolPlan, plan_pools
from . import hooks as hooks_mod
from . import compute_pool
from . import rows as rows_mod
from . import tiled_head as tiled_head_mod
from .block import Block
from .compute_pool import ComputeBuffers
from .device import resolve_device
from .flat import FlatParam
from .guard import guard_foreign_optimizers
from .grads import GradientSink
from .homes import DeviceHome, Home, HostHome, NvmeHome, TieredHome
from .host_malloc import trim_heap
from .host_memory import HOST_MEMORY, RELEASE, REUSE, HostMemoryLease
from .partition import LAYER, partition
from .quant_format import frozen_format
from .quant_home import QuantFlat, QuantizedHome
from ..sharding.partitioner import make_partitioner
from ..sharding.shard_flat import ShardFlat
from ..sharding.sharded_home import ShardedHome
from .activations import make_activation_offloader
from .lifecycle import HookHandlers
from .outside import OutsideWrites
from .registry import _ENGINE_ATTR, _ENGINES, ParamLocation, engine_of, locate  # noqa: F401 (re-exported)
from .residence import Residence
from .schedule import Schedule
from .sources import (InitSource, ParamSource, materialize_meta_buffers, param_owners,
                      replace_param)
from .stats import Stats
from .transfer import Transfers

logger = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
class Engine(Residence, OutsideWrites, HookHandlers):
    """One per wrapped model: owns the blocks, homes, pools, swap store, schedule, transfers
    and stats. Its behaviour is split by concern: fetch/release (residence.py), parameters
    outside forward (outside.py) and the forward/backward hook handlers (lifecycle.py)."""

    def __init__(self, model: nn.Module, policy: OffloadPolicy,
                 source: Optional[ParamSource] = None, process_group=None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"infinity.wrap expects an nn.Module, got {type(model).__name__}")
        if engine_of(model) is not None:
            raise RuntimeError("this model is already wrapped by infinity; call "
                               "infinity.unwrap(model) first if you want to wrap it again")
        self.model = model
        self.policy = policy
        self.source = source
        self.device = resolve_device(policy.device)
        self.stats = Stats()
        self._lock = threading.RLock()
        self._closed = False
        # process-wide state this engine uses (released in close, or when it is collected)
        self._host_memory: Optional[HostMemoryLease] = None    # glibc's thresholds
        self._release_guard: Optional[Callable[[], None]] = None  # global optimizer hooks
        self.store: Optional[SwapStore] = None
        self.pool: Optional[HostPool] = None
        self.home: Optional[Home] = None           # routes each flat to its tier's home
        self.homes: Dict[Tier, Home] = {}          # one home per tier in use
        # ZeRO sharding over torch.distributed ranks (None: single process, code unchanged)
        self.partitioner = make_partitioner(process_group, policy.shard,
                                            policy.collective_timeout, self.device)

        if policy.frozen_format is not None and self.partitioner is not None:
            raise ValueError("infinity: frozen_format with shard=zero1/2/3 is not built; use "
                             "one process (shard='none') or frozen_format=None")
        specs = partition(model, policy.block_rule, policy.param_persistence_threshold)
        if not specs:
            raise ValueError("the model has no parameters: there is nothing to offload")
        self._check_params(specs)
        home_bytes = sum(self._numel_bytes(p) for s in specs for _, _, _, p in s.params)
        self.param_tier = self._choose_param_tier(home_bytes)
        self.device_budget = ByteBudget("device", policy.device_budget)
        self.host_budget = ByteBudget("host", policy.host_budget)
        self.blocks = self._plan_blocks(specs, self._choose_block_tiers(len(specs)))
        self.tiled_head: Optional[nn.Linear] = (tiled_head_mod.head_module(model)
                                                if policy.tiled_head else None)
        self._loss_follows = False  # a model forward with labels runs (tiled head)
        self._mark_row_blocks()
        if self.partitioner is not None:
            self.partitioner.attach(self.blocks)
        self._check_budgets()
        self.schedule = Schedule(policy.prefetch_window, guess=self._guess_order())
        self._callback_task = -1
        self._last_backward_block: Optional[Block] = None
        self._model_forward_depth = 0
        # Set by an optimizer over this engine: it changes the home copies in step(), so the
        # next forward's blocks are prefetched after the step (resume), not after backward.
        self.optimizer_attached = False
        # optimizers overlapping their step with backward: takes_in_ram(engine, flat) just
        # before a block's gradients are closed (True: kept in RAM for it, not written),
        # grads_complete(engine, flat) when they are complete, forward_started(engine) when a
        # forward begins, engine_closing(engine) at close
        self.backward_listeners: List[Any] = []
        self.grad_tier = self._choose_grad_tier()
        if self.partitioner is not None:
            self.partitioner.check_tiers(self.param_tier, self.grad_tier)
        self._original_devices = {
            id(s.param): (torch.device("cpu") if s.param.is_meta else s.param.device)
            for b in self.blocks for f in b.flats for s in f.slots}
        self.compute_buffers = self._make_compute_buffers()
        self.activations = make_activation_offloader(policy, self.device, self.host_budget,
                                                     self.stats, self._owned_storages,
                                                     [b.name for b in self.blocks],
                                                     self._owned_ranges)
        try:
            self._compute_reserved = self._check_host_budget()
            self._check_disk()
            self._materialize_homes()
        except BaseException:
            if self.activations is not None:
                self.activations.close()
            self._release_process_state()
            raise
        self.transfers = Transfers(self.device, self.stats, self.home, self.pool,
                                   self.home_flats, workers=self._transfer_workers())
        self._hooks = hooks_mod.register(self)
        if any(isinstance(f, QuantFlat) for f in self.flats):
            # model.state_dict(): the quantized frozen parameters' dequantized values
            self._hooks.add(model._register_state_dict_hook(
                hooks_mod.EngineHook(self, "on_state_dict_quantized")))
        if self.partitioner is not None and self.partitioner.shards_params:
            # model.state_dict() gathers the whole parameters (every rank must call it)
            self._hooks.add(model._register_state_dict_hook(
                hooks_mod.EngineHook(self, "on_state_dict")))
        self._locations: Dict[int, ParamLocation] = {
            id(slot.param): ParamLocation(self, block, flat, i)
            for block in self.blocks for flat in block.flats
            for i, slot in enumerate(flat.slots)}
        _ENGINES.add(self)
        self._release_guard = guard_foreign_optimizers(self)
        setattr(model, _ENGINE_ATTR, self)
        logger.info("infinity: wrapped %d blocks (%s bytes of parameters) with parameters on %s",
                    len(self.blocks), f"{home_bytes:,}", ", ".join(
                        f"{t.value} ({n} blocks)" for t, n in self.param_blocks().items()))

    # =====================================================================================
    # construction
    # =====================================================================================
    @staticmethod
    def _numel_bytes(p: torch.Tensor) -> int:
        return p.numel() * p.element_size()

    def _owned_storages(self) -> set:
        """Storages of the parameters' buffers (saved activations never offload these)."""
        return {t.untyped_storage()._cdata for f in self.flats for t in (f.compute, f.home)
                if isinstance(t, torch.Tensor)}

    def _owned_ranges(self) -> List[Tuple[int, int]]:
        """Address ranges of the host homes: on a CPU-only machine parameters run in place in
        them through storages of their own (saved activations never offload these either)."""
        ranges = []
        for f in self.flats:
            home = f.home
            if isinstance(home, torch.Tensor) and home.device.type == "cpu" and home.numel():
                start = home.data_ptr()
                ranges.append((start, start + home.numel() * home.element_size()))
        return sorted(ranges)

    def _check_params(self, specs) -> None:
        for spec in specs:
            for qual, _, _, p in spec.params:
                if p.dtype not in _SUPPORTED_DTYPES:
                    raise TypeError(f"parameter {qual!r} has dtype {p.dtype}; infinity offloads "
                                    "float32, bfloat16 and float16 parameters")
                if p.is_meta:
                    if self.source is None:
                        raise ValueError(
                            f"parameter {qual!r} is on the meta device; pass where its values "
                            "come from: infinity.wrap(model, source='<.safetensors file, index "
                            "or Hugging Face folder>') or init='reset_parameters' (or an "
                            "init(module) function)")
                    continue
                if p.device.type not in ("cpu", self.device.type):
                    raise ValueError(f"parameter {qual!r} is on {p.device}; build the model on "
                                     f"the CPU (or on {self.device}) before infinity.wrap")

    def _choose_param_tier(self, home_bytes: int) -> Tier:
        p = self.policy
        if p.param_tier != "auto":
            return Tier.parse(p.param_tier, what="param_tier")
        if p.device_budget is not None and self.device.type == "cuda" \
                and home_bytes <= p.device_budget and p.frozen_format is None:
            return Tier.DEVICE
        if p.nvme_path is not None and (p.host_budget is None or home_bytes > p.host_budget):
            return Tier.NVME
        return Tier.HOST

    def _choose_block_tiers(self, n_blocks: int) -> List[Tier]:
        """Each block's parameter tier: ``param_tier``, except the first ``host_blocks``
        blocks, whose parameters stay in host RAM."""
        k = self.policy.host_blocks or 0
        if k:
            if self.param_tier is not Tier.NVME:
                raise ValueError(f"infinity: host_blocks={k} keeps the first blocks on host and "
                                 f"the rest on NVMe, but param_tier resolved to "
                                 f"{self.param_tier.value!r}; pass param_tier='nvme'")
            if k > n_blocks:
                raise ValueError(f"infinity: host_blocks={k}, but the model has {n_blocks} "
                                 f"blocks; use at most {n_blocks} (or param_tier='host')")
            if self.partitioner is not None:
                raise ValueError("infinity: host_blocks (parameters split between host and "
                                 "NVMe per block) with shard=zero1/2/3 is not built; use one "
                                 "param_tier for the whole model")
        return [Tier.HOST if i < k else self.param_tier for i in range(n_blocks)]

    def param_blocks(self) -> Dict[Tier, int]:
        """How many blocks keep their parameters in each tier."""
        counts: Dict[Tier, int] = {}
        for b in self.blocks:
            counts[b.home] = counts.get(b.home, 0) + 1
        return counts

    def _choose_grad_tier(self) -> Tier:
        choice = self.policy.grad_tier
        if choice == "auto":
            return Tier.NVME if self.param_tier is Tier.NVME else Tier.HOST
        return Tier.parse(choice, what="grad_tier")

    def _compute_dtype(self, home_dtype: torch.dtype) -> torch.dtype:
        return self.policy.compute_dtype or home_dtype

    def _plan_blocks(self, specs, tiers: List[Tier]) -> List[Block]:
        fmt = frozen_format(self.policy.frozen_format) if self.policy.frozen_format else None
        blocks: List[Block] = []
        for index, (spec, tier) in enumerate(zip(specs, tiers)):
            by_dtype: Dict[torch.dtype, list] = defaultdict(list)
            frozen: Dict[torch.dtype, list] = defaultdict(list)
            for entry in spec.params:
                p = entry[3]
                if fmt is not None and spec.kind == LAYER and not p.requires_grad \
                        and p.dim() >= 2:
                    frozen[p.dtype].append(entry)
                else:
                    by_dtype[p.dtype].append(entry)
            flats: List[FlatParam] = []
            for dtype, entries in by_dtype.items():
                key = f"block{index:04d}.{str(dtype).replace('torch.', '')}"
                pad = self.partitioner.pad_multiple(dtype) if self.partitioner else 0
                align = self.partitioner.slot_align() if self.partitioner else 0
                flats.append(FlatParam(key, entries, dtype, self._compute_dtype(dtype),
                                       self.device, pad, elem_align=align))
            for dtype, entries in frozen.items():
                name = str(dtype).replace('torch.', '')
                flats.append(QuantFlat(f"block{index:04d}.{fmt.name}.{name}", entries, dtype,
                                       self._compute_dtype(dtype), self.device, fmt))
            for flat in flats:
                trainable = [s.trainable for s in flat.slots]
                use = "trainable" if all(trainable) else "frozen" if not any(trainable) \
                    else "mixed"
                stored = flat.fmt.name if isinstance(flat, QuantFlat) \
                    else str(flat.home_dtype).replace("torch.", "")
                flat.category = f"{use}.{spec.kind}.{stored}"
            resident = tier is Tier.DEVICE or (
                tier is Tier.HOST and self.device.type == "cpu"
                and all(f.compute_dtype == f.home_dtype and not isinstance(f, QuantFlat)
                        for f in flats))
            if self.partitioner is not None and self.partitioner.shards_params:
                resident = False  # a rank's home holds only its part: always all-gathered
            blocks.append(Block(index, spec.name, spec.module, spec.is_root, flats, tier,
                                resident, spec.kind, spec.modules))
        if fmt is not None and not any(isinstance(f, QuantFlat) for b in blocks
                                       for f in b.flats):
            logger.warning("infinity: frozen_format=%r, but no layer block has frozen matrices "
                           "(requires_grad=False at wrap, 2 or more dimensions): nothing was "
                           "quantized. Freeze the base before wrap (e.g. apply PEFT's "
                           "get_peft_model first) or drop frozen_format", fmt.name)
        return blocks

    def _mark_row_blocks(self) -> None:
        """The blocks read by rows, never fetched whole: plain embeddings (embedding_rows,
        runtime/rows.py) and the LM head (tiled_head, runtime/tiled_head.py)."""
        sharded = self.partitioner is not None
        for block in self.blocks:
            block.row_lookup = rows_mod.eligible(block, sharded, self.tiled_head,
                                                 self.policy.embedding_rows)
        head = self.tiled_head
        if head is not None and not any(b.row_lookup and any(m is head for m in b.modules)
                                        for b in self.blocks):
            owner = next((b for b in self.blocks if any(m is head for m in b.modules)), None)
            if owner is None or owner.is_root:
                why = "its weight stays in the root block (below param_persistence_threshold)"
            elif sharded:
                why = "parameters are sharded across ranks (shard=zero3)"
            elif owner.home is Tier.DEVICE:
                why = "its block lives on the device tier (nothing to stream)"
            else:
                why = (f"its block {owner.name!r} is shared with a module that is not a plain "
                       "nn.Embedding, or holds more than its weight"
                       + ("" if self.policy.embedding_rows else " (or embedding_rows=False)"))
            raise ValueError(f"infinity: tiled_head=True, but the LM head cannot be tiled: "
                             f"{why}. Pass tiled_head=False")

    @property
    def chunk_bytes(self) -> int:
        """The chunk: the size of the host buffers I/O passes through (policy.chunk_bytes)."""
        return resolve_chunk_bytes(self.policy.chunk_bytes, self.host_budget.limit)

    def _guess_order(self) -> Dict[str, List[int]]:
        """The first step's schedule: the blocks' modules in the order the model registers
        them (an embedding before the layers, the head after; a tied block at both) for
        forward, the reverse for backward, leaving out the uses whose backward does not read
        the parameters (an nn.Embedding: its block is not fetched for backward)."""
        use_of: Dict[int, int] = {}
        for b in self.blocks:
            if not b.is_root:
                for m in b.modules:
                    use_of.setdefault(id(m), b.index)
        forward: List[int] = []
        backward: List[int] = []
        for _, module in self.model.named_modules():
            index = use_of.get(id(module))
            if index is not None:
                forward.append(index)
                # a block read by rows reads its tiles itself, not in a pre-backward fetch
                if (hooks_mod.reads_params_in_backward(module)
                        and not self.blocks[index].row_lookup):
                    backward.append(index)
        return {"forward": forward, "backward": backward[::-1]}

    def _transfer_workers(self) -> int:
        """Fetches in flight at once (one transfer thread each)."""
        return max(1, min(2, self.policy.prefetch_window))

    def _make_compute_buffers(self) -> Optional[ComputeBuffers]:
        """CPU device: streamed blocks borrow their compute memory from a pool (no mmap, page
        faults and munmap per fetch; O_DIRECT reads straight into it). Without the torch
        feature this needs, freed buffers go back to the OS through malloc instead."""
        streamed = [f for b in self.blocks if not b.resident for f in b.flats]
        if self.device.type != "cpu" or not streamed:
            return None
        # while the blocks are filled, the originals freed are mmap'ed chunks given back to
        # the OS, leaving no holes in the heap (runtime/host_malloc.py); with the pool, the
        # threshold goes back up once the wrap is done
        self._host_memory = HOST_MEMORY.acquire(RELEASE, owner=self, name="engine")
        if not compute_pool.supported():
            return None
        buffers = ComputeBuffers(self.device_budget.limit)
        for flat in streamed:
            flat.buffers = buffers
        return buffers

    def _host_needs(self, limit: Optional[int] = None) -> Dict[str, int]:
        """What the engine itself holds in host RAM (bytes), by purpose, before any optimizer,
        under the host budget (``limit``: under that budget instead). Staging and NVMe gradient
        buffers are chunk-sized (see :meth:`_pool_plan`)."""
        trainable = [f for f in self._sink_flats() if f.trainable]
        plan = self._pool_plan(limit)
        needs: Dict[str, int] = {}
        host_flats = [f for b in self.blocks if b.home is Tier.HOST for f in b.flats]
        if host_flats:
            needs["parameter homes"] = sum(self._home_flat(f).home_nbytes for f in host_flats)
        if plan.staging_bytes:
            needs["staging"] = plan.staging_total
        if trainable:
            if self.grad_tier is Tier.HOST:
                needs["gradient accumulators"] = sum(f.numel * 4 for f in trainable)
            else:
                needs["gradient buffers"] = plan.grad_total
        return needs

    def _grad_buffer_count(self) -> int:
        return self._pool_plan().grad_count

    def _pool_plan(self, limit: Optional[int] = None) -> PoolPlan:
        """Sizes and counts of the staging and NVMe gradient pools: buffers of one chunk
        (``chunk_bytes``, by default derived from the host budget), or of the largest flat
        when that is smaller; with a host budget, counts shrink towards 1 staging + 2 gradient
        buffers to leave room for the rest (parameter homes, host gradients, and on a CPU
        device the compute buffers' minimum: the root block + the largest block)."""
        from_nvme = [b for b in self.blocks if not b.resident and b.home is Tier.NVME]
        largest_home = max((self._home_flat(f).home_nbytes for b in from_nvme for f in b.flats),
                           default=0)
        trainable = [f for f in self._sink_flats() if f.trainable]
        largest_grad = (max((f.numel * 4 for f in trainable), default=0)
                        if self.grad_tier is Tier.NVME else 0)
        limit = self.host_budget.limit if limit is None else limit
        room: Optional[int] = None
        if limit is not None:
            fixed = sum(self._home_flat(f).home_nbytes for b in self.blocks
                        if b.home is Tier.HOST for f in b.flats)
            if self.grad_tier is Tier.HOST:
                fixed += sum(f.numel * 4 for f in trainable)
            if self.compute_buffers is not None:
                streamed = [b for b in self.blocks if not b.resident]
                fixed += sum(b.compute_nbytes for b in streamed if b.is_root)
                fixed += max((b.compute_nbytes for b in streamed if not b.is_root), default=0)
            room = limit - fixed
        return plan_pools(resolve_chunk_bytes(self.policy.chunk_bytes, limit),
                          largest_home=largest_home,
                          staging_default=(1 if self.compute_buffers is not None
                                           else self._transfer_workers()),
                          largest_grad=largest_grad,
                          grad_default=self.policy.prefetch_window + 2, room=room)

    def _working_set(self) -> Tuple[int, Optional[Block], int, int]:
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

    def _check_host_budget(self) -> int:
        """With a host budget: checks that what the engine holds in host RAM fits, naming the
        minimum if not; on a CPU device also reserves the compute buffers of the streamed
        blocks there (they are RAM too): root + the largest block + window x the largest
        layer block when it fits (the running block and the window's blocks prefetched or
        kept around it: window + 1 blocks at once, the largest among them; as
        ``infinity.estimate`` counts them), at least root + the largest block. One layer more
        is not needed by the window, but the pool keeps idle buffers up to its reservation,
        and autograd's working set comes on top of them. Returns the bytes reserved."""
        limit = self.host_budget.limit
        if limit is None:
            return 0
        needs = self._host_needs()
        minimal = comfortable = 0
        largest_block: Optional[Block] = None
        if self.compute_buffers is not None:
            root, largest_block, largest, layer = self._working_set()
            streamed = [b for b in self.blocks if not b.resident and not b.is_root]
            minimal = root + largest
            comfortable = min(root + largest + self.policy.prefetch_window * layer,
                              root + sum(b.compute_nbytes for b in streamed))
            comfortable = max(minimal, comfortable)
            if self.device_budget.limit is not None:
                comfortable = max(minimal, min(comfortable, self.device_budget.limit))
        fixed = sum(needs.values())
        if fixed + minimal > limit:
            # the chunk follows the budget (1/32 of it by default), and the pools with it: the
            # smallest budget that holds what it implies, found by iterating up to it
            need = fixed + minimal
            for _ in range(64):
                implied = sum(self._host_needs(need).values()) + minimal
                if implied <= need:
                    break
                need = implied
            needs = self._host_needs(need)
            fixed = sum(needs.values())
            parts = dict(needs)
            if minimal:
                who = f" {largest_block.name!r}" if largest_block is not None else ""
                parts[f"compute buffers (CPU device: the root block + the largest "
                      f"block{who})"] = minimal
            listed = " + ".join(f"{k} {v:,}" for k, v in parts.items())
            raise BudgetExceededError(
                f"infinity: host_budget={limit:,} bytes is smaller than what the engine holds in "
                f"host RAM: {listed} = {fixed + minimal:,} bytes (with the pools of that budget). "
                f"Raise host_budget to at least {need:,} bytes (an optimizer needs more on top: its states on host, "
                "or with states on NVMe its buffer sets), or "
                + (self._outer_remedy(largest_block) if largest_block is not None
                   and largest_block.kind == "outer" else "use smaller blocks (block_rule)"))
        if not minimal:
            return 0
        # the compute buffers beyond their minimum leave room for what an optimizer with its
        # states on NVMe needs at least (3 buffer sets of about a chunk, with edge pieces)
        optimizer_room = 0
        if self.policy.optimizer_tier != "host":
            chunk = resolve_chunk_bytes(self.policy.chunk_bytes, limit)
            optimizer_room = 3 * (chunk + 2 * MAX_PIECE_BYTES)
        reserve = max(minimal, min(comfortable, limit - fixed - optimizer_room))
        reserve = min(reserve, limit - fixed)
        self.host_budget.acquire(reserve, what="compute buffers of the streamed blocks (CPU)")
        if self.device_budget.limit is None or reserve < self.device_budget.limit:
            self.device_budget = ByteBudget("device", reserve)
        self.compute_buffers.limit = reserve
        return reserve

    def _outer_remedy(self, block: Block) -> str:
        """What lets an outer block that is fetched whole need less memory at once."""
        head = None
        get = getattr(self.model, "get_output_embeddings", None)
        if callable(get):
            head = get()
        if head is not None and any(m is head for m in block.modules):
            return (f"wrap with tiled_head=True: module {block.name!r} (the LM head) is then "
                    "read in tiles of vocabulary rows, never whole, or compute in a narrower "
                    "dtype (compute_dtype=torch.bfloat16)")
        if any(isinstance(m, nn.Embedding) for m in block.modules):
            return (f"compute in a narrower dtype (compute_dtype=torch.bfloat16); module "
                    f"{block.name!r} is fetched whole (an embedding is read row by row when "
                    "it is a plain nn.Embedding with a block of its own and "
                    "embedding_rows=True)")
        return (f"compute in a narrower dtype (compute_dtype=torch.bfloat16); module "
                f"{block.name!r} is fetched whole")

    def _check_disk(self) -> None:
        """The parameter homes and gradient files this engine puts on NVMe must fit on the
        disk under nvme_path: refused before anything is written (an optimizer checks its
        states' extents the same way when it is constructed)."""
        if Tier.NVME not in self.param_blocks() and self.grad_tier is not Tier.NVME:
            return
        align = inf_io.ALIGNMENT
        needs = {"parameters": sum(-(-self._home_flat(f).home_nbytes // align) * align
                                   for b in self.blocks if b.home is Tier.NVME
                                   for f in b.flats)}
        if self.grad_tier is Tier.NVME:
            needs["gradients"] = sum(-(-f.numel * 4 // align) * align
                                     for f in self._sink_flats() if f.trainable)
        check_free_space(self.policy.nvme_path, needs, "the model's parameters and gradients")

    def _check_budgets(self) -> None:
        """With a device budget: the root block (materialized for the whole step), the blocks
        resident on the device and the largest streamed block must fit at once."""
        if self.device_budget.limit is None:
            return
        root_bytes, largest, largest_bytes, _ = self._working_set()
        resident_dev = sum(b.compute_nbytes for b in self.blocks
                           if b.resident and b.home is Tier.DEVICE)
        need = resident_dev + root_bytes + largest_bytes
        if need > self.device_budget.limit:
            root = next((b for b in self.blocks if b.is_root), None)
            who = largest if largest is not None else root
            if who is None or who.kind == "layer":
                remedy = "split the block with block_rule"
            elif who.kind == "outer":
                remedy = self._outer_remedy(who)
            else:
                remedy = ("lower param_persistence_threshold so that more modules outside the "
                          "layers become blocks of their own")
            raise BudgetExceededError(
                f"infinity: device_budget={self.device_budget.limit:,} bytes is smaller than "
                f"what must be materialized at once: block {who.name!r} needs "
                f"{who.compute_nbytes:,} bytes"
                + (f", plus {root_bytes:,} for the root block (the parameters outside the "
                   "layers under param_persistence_threshold), which stays materialized "
                   "during a step" if root_bytes and who is not root else "")
                + (f", plus {resident_dev:,} resident" if resident_dev else "")
                + f" = {need:,} bytes. Raise device_budget to at least {need:,} or {remedy}")

    def _make_home(self, tier: Tier) -> Home:
        if tier is Tier.DEVICE:
            return DeviceHome(self.device_budget, self.device)
        if tier is Tier.HOST:
            home: Home = HostHome(self.host_budget)
        else:
            home = NvmeHome(self.store, self.pool, self.stats)
        return self.partitioner.wrap_home(home) if self.partitioner else home

    def _make_homes(self) -> Home:
        """One home per tier the blocks use; with more than one, a TieredHome routes each
        flat to the home of its block's tier."""
        for tier in Tier:
            if any(b.home is tier for b in self.blocks):
                self.homes[tier] = self._make_home(tier)
        routed = dict(self.homes)
        for tier, home in self.homes.items():  # frozen_format: quantized flats of this tier
            if any(isinstance(f, QuantFlat) for b in self.blocks if b.home is tier
                   for f in b.flats):
                routed[tier] = QuantizedHome(home, tier, self.host_budget, self.store,
                                             self.pool, self.stats)
        if len(routed) == 1:
            return next(iter(routed.values()))
        return TieredHome(routed, {f.key: b.home for b in self.blocks for f in b.flats})

    def _materialize_homes(self) -> None:
        """Moves every block's parameters to their home tier. On any error, the model is put
        back exactly as it was (nothing half-wrapped)."""
        originals = [(s, s.param, s.param.data if s.param.is_meta else None)
                     for b in self.blocks for f in b.flats for s in f.slots]
        filled: List[FlatParam] = []
        try:
            if Tier.NVME in self.param_blocks() or self.grad_tier is Tier.NVME:
                self.store = SwapStore(self.policy.nvme_path,
                                       require_direct=self.policy.require_direct_io,
                                       verify=self.policy.verify_checksums, tag=self.swap_tag)
            plan = self._pool_plan()
            if plan.staging_bytes:
                # chunk-sized buffers: every flat streams through them chunk by chunk. CPU
                # device with pooled compute buffers: fetches read straight into those, so one
                # staging buffer serves the rest (wrap, partial writes, rehash)
                self.pool = HostPool(plan.staging_count, plan.staging_bytes, self.host_budget)
            self.home = self._make_homes()
            total = sum(b.home_nbytes for b in self.blocks)
            with tqdm(total=total, unit="B", unit_scale=True, desc="infinity: offloading",
                      disable=total < (1 << 30), leave=False) as bar:
                def fill(block: Block) -> None:
                    for flat in block.flats:
                        self.home.fill(flat)
                        if self.partitioner is not None:
                            self.partitioner.after_fill(flat)
                        filled.append(flat)
                        self._bind_initial(block, flat)
                        bar.update(flat.home_nbytes)
                self._fill_blocks(fill)
            self.grads = GradientSink(self.grad_tier, self.device, self.stats, self.host_budget,
                                      self.store, self._sink_flats(),
                                      plan.grad_count, chunk_bytes=plan.chunk_bytes)
        except BaseException as failure:
            self._unfill(originals, filled, failure)
            for home in self.homes.values():
                home.close()
            if self.home is not None:
                self.home.close()  # a quantized home's budget (closing twice is harmless)
            if self.pool is not None:
                self.pool.close()
            if self.store is not None:
                self.store.close()
            raise
        self._move_buffers()
        if self.device.type == "cpu":
            if self.compute_buffers is not None and self.policy.host_budget is None:
                # the originals are gone and streamed blocks use the pool: forward and
                # backward's temporaries reuse the heap as in plain PyTorch instead of
                # faulting in fresh pages each. With a host_budget, RAM is what the user
                # constrains: they keep going back to the OS (runtime/host_malloc.py)
                self._host_memory.set(REUSE)
            trim_heap()

    def _fill_blocks(self, fill: Callable[[Block], None]) -> None:
        """Fills every block's home, streaming: one block's values exist in RAM at a time
        (for a model built on meta, the source makes them real just before)."""
        source = self.source
        if source is None:
            for block in self.blocks:
                fill(block)
            return
        materialize_meta_buffers(self.model, source)
        owners, names = param_owners(self.model)
        slot_of = {id(s.param): s for b in self.blocks for f in b.flats for s in f.slots}
        block_of = {id(s.param): b for b in self.blocks for f in b.flats for s in f.slots}
        remaining = {b.index: sum(1 for f in b.flats for s in f.slots if s.param.is_meta)
                     for b in self.blocks}
        done: set = set()
        # Each flat's meta parameters become views of one arena of the flat's size: a single
        # large allocation (mmap'ed, so really returned to the OS once the block is filled and
        # the parameters point at their home), not many small ones that fragment the heap.
        arenas: Dict[int, torch.Tensor] = {}
        flat_of = {id(s.param): f for b in self.blocks for f in b.flats for s in f.slots}

        def place(param: nn.Parameter) -> torch.Tensor:
            slot = slot_of[id(param)]
            flat = flat_of[id(param)]
            arena = arenas.get(id(flat))
            if arena is None:
                arena = arenas[id(flat)] = torch.empty(flat.numel, dtype=flat.home_dtype)
            return arena[slot.offset:slot.offset + slot.numel].view(slot.shape)

        def real(param: nn.Parameter, value: torch.Tensor) -> None:
            slot = slot_of.pop(id(param))
            flat = flat_of.pop(id(param))
            block = block_of.pop(id(param))
            slot.param = replace_param(owners, param, value)
            slot_of[id(slot.param)] = slot
            flat_of[id(slot.param)] = flat
            block_of[id(slot.param)] = block
            remaining[block.index] -= 1

        def fill_ready() -> None:
            for block in self.blocks:
                if block.index not in done and remaining[block.index] == 0:
                    done.add(block.index)
                    fill(block)
                    for flat in block.flats:
                        arenas.pop(id(flat), None)

        if isinstance(source, InitSource):
            fill_ready()  # blocks without meta parameters
            for _, module in self.model.named_modules():
                metas = [p for p in module._parameters.values() if p is not None and p.is_meta]
                for p in metas:
                    real(p, place(p))
                if metas:
                    source.init_module(module)
                    fill_ready()
        else:
            for block in self.blocks:
                for flat in block.flats:
                    for slot in list(flat.slots):
                        p = slot.param
                        if p.is_meta:
                            value = place(p)
                            source.read_into(names.get(id(p), [slot.qualname]), value)
                            real(p, value)
                fill_ready()
        fill_ready()
        source.finish()

    def _unfill(self, originals, filled: List[FlatParam], failure: BaseException) -> None:
        """Wrap failed: puts every parameter back as it was (values read back from the homes
        already filled; meta parameters back on meta)."""
        filled_ids = {id(f) for f in filled}
        by_slot = {id(o[0]): o for o in originals}
        owners, _ = param_owners(self.model)
        for block in self.blocks:
            for flat in block.flats:
                values = None
                if id(flat) in filled_ids:
                    try:
                        values = self.home.snapshot(flat)
                    except BaseException as exc:  # noqa: BLE001
                        failure.add_note(f"infinity.wrap: could not read back {flat.key} to "
                                         f"undo the wrap ({exc}); its parameters are lost")
                for s in flat.slots:
                    original = by_slot[id(s)]
                    if original[2] is not None:  # was on meta: the original Parameter returns
                        if s.param is not original[1]:
                            for module, attr in owners.get(id(s.param), []):
                                module._parameters[attr] = original[1]
                            s.param = original[1]
                    elif values is not None:
                        s.param.data = values[s.offset:s.offset + s.numel].view(
                            s.shape).clone()

    def on_state_dict_quantized(self, module, state_dict, prefix, local_metadata) -> None:
        """``model.state_dict()``: each parameter stored quantized (frozen_format) is given
        its dequantized values (home dtype), decoded from its home one flat at a time."""
        with self._lock:
            for flat in self.flats:
                if not isinstance(flat, QuantFlat):
                    continue
                keys = [(s, prefix + s.qualname) for s in flat.slots
                        if prefix + s.qualname in state_dict]
                if not keys:
                    continue
                values = self.home.snapshot(flat)
                for s, key in keys:
                    state_dict[key] = values[s.offset:s.offset + s.numel].view(s.shape).clone()

    def _bind_initial(self, block: Block, flat: FlatParam) -> None:
        """After fill: resident blocks compute on their home; the others get an (unallocated)
        compute buffer; outside forward every parameter views its home where it can."""
        if block.resident:
            if flat.compute is None:  # host home used in place
                flat.compute = flat.home
        else:
            flat.compute = torch.empty(flat.numel, dtype=flat.compute_dtype, device=self.device)
            flat.free_storage()
        self._bind_outside(flat)


    def _move_buffers(self) -> None:
        if self.device.type == "cpu":
            return
        for module in self.model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != self.device:
                    module._buffers[name] = buf.to(self.device)

    # =====================================================================================
    # the optimizer's side: quiesce / resume around a step
    # =====================================================================================
    def _finish_speculative_writes(self) -> None:
        """Before the homes are read or replaced outside forward: an optimizer updating
        blocks while backward ran finishes writing their parameters first (a read racing
        those writes would see a home half old, half new)."""
        for listener in self.backward_listeners:
            listener.homes_needed(self)

    def quiesce(self) -> None:
        """Before an optimizer changes the homes: recovers from a failed forward/backward,
        frees every compute buffer (writing back in-place changes), and takes in the user's
        changes to parameters and gradients made since backward."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this model was unwrapped; its optimizer cannot step")
            if not self._in_backward():
                self._recover_failed_backward()
                if self._model_forward_depth == 0:
                    self._recover_failed_forward()
            self._finish_speculative_writes()
            self.sync_outside_writes()
            self.release_all()
            self.grads.reconcile(detach=False)
            if self.partitioner is not None:
                self.partitioner.sync_zero1_views()

    def resume(self) -> None:
        """After an optimizer updated the homes: start fetching what the next forward needs."""
        with self._lock:
            if not self._closed:
                if self.partitioner is not None:  # zero1/2: all-gather the updated parts
                    self.partitioner.after_step()
                if (self.device.type == "cpu" and HOST_MEMORY.state() != REUSE
                        and any(b.home is not Tier.HOST for b in self.blocks)):
                    trim_heap()  # the step's temporaries go back to the OS, not to RSS
                self._prefetch_for_forward()

    after_step = resume

    def record_optimizer_step(self, step) -> None:
        """An optimizer reports what its step did here (its StepStats), for ``infinity.stats``."""
        self.stats.record_optimizer_step(step)

    def sync_gradients(self) -> None:
        """Takes in the user's changes to the exposed ``p.grad`` (zero_grad, reassignment)."""
        with self._lock:
            self.grads.reconcile(detach=False)


    def attach_optimizer(self) -> None:
        """An optimizer that changes the homes in its step steps this engine: the next
        forward's first blocks are prefetched after that step (resume), not after backward."""
        self.optimizer_attached = True

    @property
    def working_copy_staged(self) -> bool:
        """True when an updated working copy must pass through a staging buffer to reach its
        home (an NVMe swap file) instead of being written in place, for some flat (with
        host_blocks, only the flats homed on NVMe: :meth:`stages_working_copy`)."""
        return any(b.home is Tier.NVME for b in self.blocks)

    def stages_working_copy(self, flat: FlatParam) -> bool:
        """Whether ``flat``'s updated working copy passes through a staging buffer to reach
        its home (:meth:`write_home`), instead of being written in place."""
        return self.home.staged(flat)

    # =====================================================================================
    # gradients
    # =====================================================================================
    def zero_grad(self) -> None:
        """Forgets accumulated gradients (set_to_none semantics: the next one overwrites)."""
        with self._lock:
            self.grads.zero_grad()
            if self.partitioner is not None:
                self.partitioner.sync_zero1_views()

    # =====================================================================================
    # for the optimizer and users
    # =====================================================================================
    @property
    def flats(self) -> List[FlatParam]:
        return [f for b in self.blocks for f in b.flats]

    # ---- ZeRO sharding: what this rank keeps (the whole flats without a partitioner) ------
    @property
    def home_flats(self) -> List[FlatParam]:
        """The flat buffers whose homes this rank keeps: each flat's part on this rank with
        shard='zero3' (or zero1/2: views of the replicated home), else the flats."""
        return self.partitioner.home_flats() if self.partitioner else self.flats

    def _home_flat(self, flat: FlatParam) -> FlatParam:
        p = self.partitioner
        return p.local(flat) if p is not None and p.shards_params else flat

    def _sink_flats(self) -> List[FlatParam]:
        p = self.partitioner
        return p.home_flats() if p is not None and p.shards_grads else self.flats

    @property
    def swap_tag(self) -> str:
        """Prefix of this engine's swap directories (host and rank when sharded)."""
        return self.partitioner.swap_tag if self.partitioner is not None else ""

    def block_of_flat(self, flat: FlatParam) -> Block:
        for b in self.blocks:
            if flat in b.flats:
                return b
        raise KeyError(flat.key)

    def write_home(self, flat: FlatParam, src: torch.Tensor) -> "inf_io.IOFuture":
        """Starts writing an updated working copy (home dtype, aligned) to the NVMe home."""
        if self.home.tier_of(flat) is not Tier.NVME:
            raise RuntimeError(f"write_home is only for parameters homed on NVMe, not "
                               f"{flat.key!r}")
        return self.home.write_async(flat, src)

    def read_home(self, flat: FlatParam, dst: torch.Tensor) -> None:
        self.home.read_into(flat, dst)

    # ---- ranged working-copy I/O: an optimizer stepping a flat in element ranges ----------
    def _nvme_home(self, flat: FlatParam, what: str) -> NvmeHome:
        home = self.homes.get(Tier.NVME)
        if isinstance(home, ShardedHome) and isinstance(flat, ShardFlat):
            home = home.inner  # ZeRO: a rank's part has a swap file of its own
        if not isinstance(home, NvmeHome) or self.home.tier_of(flat) is not Tier.NVME:
            raise RuntimeError(f"infinity: {what} is only for parameters homed on NVMe, not "
                               f"{flat.key!r}")
        return home

    def home_range_elems(self, flat: FlatParam) -> int:
        """Elements per piece of an NVMe-homed flat's swap file: a ranged read or write of
        its working copy starts at a multiple of it and ends at one or at the flat's end."""
        return self._nvme_home(flat, "home_range_elems").range_elems(flat)

    def write_home_range(self, flat: FlatParam, start: int,
                         src: torch.Tensor) -> "inf_io.IOFuture":
        """Starts writing elements [start, start + len(src)) of an updated working copy
        (home dtype, aligned) to the NVMe home (whole pieces: :meth:`home_range_elems`)."""
        return self._nvme_home(flat, "write_home_range").write_range_async(flat, start, src)

    def read_home_range(self, flat: FlatParam, start: int, dst: torch.Tensor) -> None:
        """Reads elements [start, start + len(dst)) of the NVMe home into ``dst`` (home dtype,
        aligned; whole pieces) and checks them against their checksums."""
        self._nvme_home(flat, "read_home_range")
        if dst.dtype != flat.home_dtype:
            raise TypeError(f"infinity: {flat.key}: a ranged home read takes the home dtype "
                            f"{flat.home_dtype}, got {dst.dtype}")
        self.store.read_at_sync(flat.key, start * flat.home_itemsize, dst)
        self.stats.add_moved("nvme_to_host", dst.numel() * flat.home_itemsize)

    @contextlib.contextmanager
    def materialized(self, module: Optional[nn.Module] = None) -> Iterator[None]:
        """Keeps the blocks inside ``module`` (all blocks when None) materialized in the
        block, so their parameters can be read outside forward; in-place changes made to them
        there are written back to their homes when the block ends."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this model was unwrapped")
            self._finish_speculative_writes()
            self.sync_outside_writes()
            chosen = [b for b in self.blocks if module is None or b.contains(module)
                      or any(m is own for own in b.modules for m in module.modules())]
            pinned: List[Block] = []
            try:
                for b in chosen:
                    self._ensure_on_device(b)
                    b.active_forward += 1
                    b.pins += 1
                    pinned.append(b)
            except BaseException:
                self._unpin(pinned)
                raise
        try:
            yield
        finally:
            with self._lock:
                self._unpin(pinned)

    def _unpin(self, blocks: List[Block]) -> None:
        failure: Optional[BaseException] = None
        for b in blocks:
            b.active_forward = max(0, b.active_forward - 1)
            b.pins = max(0, b.pins - 1)
            if b.active_forward == 0 and (not b.is_root or (
                    self._model_forward_depth == 0 and self._callback_task == -1)):
                try:
                    self._release(b)
                except BaseException as exc:  # noqa: BLE001 - release the others first
                    failure = failure or exc
        if failure is not None:
            raise failure

    def tier_bytes(self) -> Dict[str, Dict[str, int]]:
        """Bytes per tier. Host: everything counted in the host budget (``now``: the engine's
        and its optimizer's buffers), by purpose; ``compute`` is the RAM reserved for the
        compute buffers on a CPU device, ``optimizer`` what an optimizer holds (states on host,
        its NVMe buffer sets, staging). ``staging`` and (NVMe tier) ``grads`` are
        ``staging_buffers`` / ``grad_buffers`` buffers of at most ``chunk`` bytes each. With
        ZeRO sharding: this rank's parts."""
        mine = self._sink_flats() if self.partitioner is not None else self.flats
        host_homes = sum(self._home_flat(f).home_nbytes for f in self.flats
                         if self._home_flat(f).home is not None)
        grads = (sum(f.numel * 4 for f in mine if f.grad is not None)
                 if self.grad_tier is Tier.HOST else self.grads.host_bytes())
        staging = self.pool.count * self.pool.nbytes if self.pool is not None else 0
        nvme = self.store.total_bytes if self.store is not None else 0
        nvme_homes = sum(self._home_flat(f).home_nbytes for b in self.blocks
                         if b.home is Tier.NVME for f in b.flats)
        used = self.host_budget.used
        engine_host = host_homes + grads + staging + self._compute_reserved
        device = {"now": self.device_budget.used, "peak": self.device_budget.peak}
        if self.compute_buffers is not None:
            device["held"] = self.compute_buffers.held  # in use + kept for reuse
        return {
            "device": device,
            "host": {"now": used, "peak": self.host_budget.peak, "limit": self.host_budget.limit,
                     "params": host_homes, "grads": grads, "staging": staging,
                     "compute": self._compute_reserved, "chunk": self.grads.chunk_bytes,
                     "staging_buffers": self.pool.count if self.pool is not None else 0,
                     "grad_buffers": self.grads.pool.count if self.grads.pool is not None else 0,
                     "optimizer": max(0, used - engine_host)},
            "nvme": {"now": nvme, "peak": nvme, "params": nvme_homes},
        }

    def close(self, *, restore: bool = True) -> None:
        """Removes every hook and, with ``restore``, gives the parameters back as plain
        tensors holding their current values, on the devices they had before wrap and in
        their home dtype. Transactional: if reading the homes fails, the engine stays as it
        was and close can be retried."""
        with self._lock:
            if self._closed:
                return
            for listener in list(self.backward_listeners):
                listener.engine_closing(self)  # an update overlapping backward is undone
            values: Dict[str, torch.Tensor] = {}
            if restore:
                if not self._in_backward():
                    self._recover_failed_backward()
                self.sync_outside_writes()
                self.release_all()
                self.grads.reconcile(detach=False)
                for flat in self.flats:
                    values[flat.key] = self.home.snapshot(flat)
            if self.partitioner is not None:
                self.partitioner.drain()  # early all-gathers land before buffers go
            # ---- commit: nothing below reads a home
            self._closed = True
            self._hooks.remove_all()
            self.transfers.close()
            if self.activations is not None:
                self.activations.close()
            _ENGINES.discard(self)
            self._locations.clear()
            if restore:
                for flat in self.flats:
                    full = values[flat.key]
                    for s in flat.slots:
                        device = self._original_devices.get(id(s.param), torch.device("cpu"))
                        grad = s.param.grad
                        s.param.grad = None
                        s.param.data = full[s.offset:s.offset + s.numel].view(
                            s.shape).to(device, copy=True)
                        if grad is not None:
                            s.param.grad = grad.detach().to(device, copy=True)
            for flat in self.flats + (self.home_flats if self.partitioner else []):
                flat.compute = None
                flat.home = None
                flat.grad = None
            self.grads.shutdown()
            if self.compute_buffers is not None:
                self.compute_buffers.trim()
            if self._compute_reserved:
                self.host_budget.release(self._compute_reserved)
                self._compute_reserved = 0
            self.home.close()
            if self.pool is not None:
                self.pool.close()
            if self.store is not None:
                self.store.close()
            if engine_of(self.model) is self:
                delattr(self.model, _ENGINE_ATTR)
            # last: what was freed above went back under this engine's thresholds
            self._release_process_state()

    def _release_process_state(self) -> None:
        """The one place an engine gives back the process-wide state it used: glibc's
        thresholds (runtime/host_memory.py) and the global optimizer hooks (runtime/guard.py),
        restored / removed when the last user gives them back. An engine collected without
        close gives them back through the same (idempotent) releases, run by its finalizers."""
        if self._host_memory is not None:
            self._host_memory.release()
        if self._release_guard is not None:
            self._release_guard()

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """Holds the engine's lock with the homes quiesced (:meth:`quiesce`): inside, every
        home can be read or written whole (ZeRO state dicts) while nothing else moves them."""
        with self._lock:
            self.quiesce()
            yield


def _no_deepcopy_of_engine(engine: "Engine", memo: dict) -> None:
    return None


def _no_pickling_of_engine(engine: "Engine"):
    raise TypeError("infinity: a wrapped model cannot be pickled whole (torch.save(model)); save "
                    "model.state_dict() or use infinity.save_checkpoint(path, model, optimizer)")


Engine.__deepcopy__ = _no_deepcopy_of_engine  # a deepcopy of a wrapped model is unwrapped
Engine.__reduce__ = _no_pickling_of_engine


