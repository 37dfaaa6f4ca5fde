"""Every collective of a sharded engine, issued from one place (the thread running forward,
backward or the optimizer) in schedule order, each preceded by a small header exchange that
checks all ranks are at the same collective for the same block.

Design notes: docs/modules.md, runtime/zero/collectives.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ...policy import CommPolicy
from .compress import Codec
from .group import DistGroups

logger = logging.getLogger(__name__)

_CODES = {"none": 0, "int8": 1, "int4": 2}


@dataclass(frozen=True)
class Gather:
    """An all-gather in flight: its inputs stay alive until it completed; a quantized one
    is dequantized into ``out`` at :meth:`Collectives.wait`."""

    work: Any
    send: torch.Tensor
    recv: torch.Tensor
    out: torch.Tensor
    codec: Optional[Codec]
    kind: int
    world: int
    name: str  # its counters' key


KINDS = {
    1: "all-gather of parameters",
    2: "reduce-scatter of gradients",
    3: "all-reduce of gradients",
    4: "all-reduce of a scalar",
    5: "all-gather of a home copy",
    6: "all-gather of updated parameters",
    7: "agreement on the routed experts",
}


class RanksDivergedError(RuntimeError):
    """Ranks reached different collectives: they did not run the same blocks in order."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: another rank never joined it."""


class Collectives:
    def __init__(
        self, groups: DistGroups, device: torch.device, block_name: Callable[[int], str]
    ) -> None:
        self.g = groups
        self.device = device
        self._block_name = block_name
        self._seq = 0
        self._broken: Optional[str] = None
        self._have_gather_base = True
        self._have_reduce_scatter = True
        kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_gather_node")
        self.seconds = {k: 0.0 for k in kinds}
        self.bytes = {k: 0 for k in kinds}
        # what crossed the wire: below ``bytes`` (the values' full width) when compressed
        self.wire_bytes = {k: 0 for k in kinds}
        self.calls = {k: 0 for k in kinds}
        # wire bytes per "kind/phase" (phase: forward, backward, outside forward / no_grad)
        self.phase_bytes: Dict[str, int] = {}
        self.node_group: Any = None  # hpZ: the ranks of this rank's node (all_gather_node)

    # ---- the header ------------------------------------------------------------------------
    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if torch.is_grad_enabled() else "outside forward / no_grad"

    def _describe(self, kind: int, block: int) -> str:
        name = self._block_name(block) if block >= 0 else "-"
        return f"the {KINDS.get(kind, kind)} of block {name!r}"

    def check(
        self, kind: int, block: int, group=None, flags: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """Exchanges (kind, block, sequence number) with every rank of ``group``; raises
        RanksDivergedError on all of them when they differ. ``flags`` (0/1 per item, the same
        length on every rank) ride along: returns, per item, whether any rank set it."""
        if self._broken is not None:
            raise RanksDivergedError(
                f"infinity: collectives are disabled after an earlier "
                f"failure ({self._broken}); restart the job"
            )
        group = self.g.shard if group is None else group
        self._seq += 1
        phase = self._phase()
        mine = torch.tensor([kind, block, self._seq], dtype=torch.int64, device=self.device)
        extra = 0 if flags is None else flags.numel()
        if flags is not None:
            mine = torch.cat([mine, flags.to(device=self.device, dtype=torch.int64).reshape(-1)])
        world = dist.get_world_size(group)
        out = torch.empty(world * (3 + extra), dtype=torch.int64, device=self.device)
        what = self._describe(kind, block)
        self._run(lambda: self._gather(out, mine, group), f"{what} ({phase})")
        table = out.view(world, 3 + extra)
        rows = table[:, :3].tolist()
        if all(r == rows[0] for r in rows):
            return None if flags is None else table[:, 3:].amax(dim=0).cpu() > 0
        me = dist.get_rank(group)
        parts = []
        for r, (k, b, s) in enumerate(rows):
            parts.append(
                f"rank {dist.get_global_rank(group, r) if group is not None else r}: "
                f"{self._describe(int(k), int(b))} (collective #{s})"
            )
        msg = (
            f"infinity: ranks diverged at rank {self.g.global_rank}'s collective "
            f"#{self._seq} ({phase}): "
            + "; ".join(parts)
            + ". Every rank must run the same blocks in the same order (same code path, "
            "same number of forward/backward passes and optimizer steps); a rank that "
            f"skips or adds a block breaks ZeRO-3. (this is local shard rank {me})"
        )
        self._broken = "ranks diverged"
        raise RanksDivergedError(msg)

    def agree_comm(self, comm: CommPolicy) -> None:
        """At wrap: every rank must pass the same compression settings (else each raises,
        naming them), and the backend must do the all-to-all compressed gradients take."""
        mine = torch.tensor(
            [_CODES[comm.weights], _CODES[comm.grads], int(comm.error_feedback), comm.block],
            dtype=torch.int64,
            device=self.device,
        )
        world = dist.get_world_size(self.g.shard)
        out = torch.empty(world * 4, dtype=torch.int64, device=self.device)
        self._run(lambda: self._gather(out, mine, self.g.shard), "the exchange of comm settings")
        rows = out.view(world, 4).tolist()
        if any(r != rows[0] for r in rows):
            names = {v: k for k, v in _CODES.items()}
            said = "; ".join(
                f"rank {r}: weights={names[w]!r}, grads={names[g]!r}, error_feedback="
                f"{bool(e)}, block={b}"
                for r, (w, g, e, b) in enumerate(rows)
            )
            raise ValueError(
                f"infinity: the ranks passed different comm settings to wrap ({said}); "
                "every rank must compress its collectives the same way"
            )
        if comm.grads == "none":
            return
        probe_in = torch.zeros(world, dtype=torch.uint8, device=self.device)
        probe_out = torch.empty_like(probe_in)
        try:
            dist.all_to_all_single(probe_out, probe_in, group=self.g.shard)
        except (NotImplementedError, RuntimeError, ValueError) as exc:
            raise RuntimeError(
                f"infinity: comm grads={comm.grads!r} reduces gradients through an "
                f"all-to-all, which backend {self.g.backend!r} cannot do ({exc}). Use a "
                "gloo or NCCL process group, or CommPolicy(grads='none')"
            ) from exc

    def _run(self, fn: Callable[[], None], what: str) -> None:
        try:
            fn()
        except RanksDivergedError:
            raise
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL errors are RuntimeError/DistError
            self._broken = f"{what} failed"
            raise CollectiveTimeoutError(
                f"infinity: rank {self.g.global_rank} could not complete {what} (collective "
                f"#{self._seq}; group timeout {self.g.timeout_s:.0f} s): another rank did "
                "not join it -- it skipped this block, raised, or exited. Every rank must run "
                f"the same blocks in the same order. Cause: {type(exc).__name__}: {exc}"
            ) from exc

    # ---- raw collectives with fallbacks ---------------------------------------------------
    def _gather(self, out: torch.Tensor, inp: torch.Tensor, group) -> None:
        if self._have_gather_base:
            try:
                dist.all_gather_into_tensor(out, inp, group=group)
                return
            except (NotImplementedError, RuntimeError) as exc:
                if "not supported" not in str(exc).lower() and not isinstance(
                    exc, NotImplementedError
                ):
                    raise
                logger.info(
                    "infinity: all_gather_into_tensor unavailable (%s); using "
                    "all_gather into a list",
                    exc,
                )
                self._have_gather_base = False
        world = dist.get_world_size(group)
        parts = list(out.chunk(world))
        if inp.data_ptr() in [p.data_ptr() for p in parts]:
            inp = inp.clone()
        dist.all_gather(parts, inp, group=group)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group) -> None:
        if self._have_reduce_scatter:
            try:
                dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=group)
                return
            except (NotImplementedError, RuntimeError) as exc:
                if "not supported" not in str(exc).lower() and not isinstance(
                    exc, NotImplementedError
                ):
                    raise
                logger.info(
                    "infinity: reduce_scatter_tensor unavailable (%s); using "
                    "all_reduce and keeping this rank's part",
                    exc,
                )
                self._have_reduce_scatter = False
        dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group)
        rank = dist.get_rank(group)
        out.copy_(inp.chunk(dist.get_world_size(group))[rank])

    # ---- the engine's collectives ---------------------------------------------------------
    def all_gather(
        self,
        out: torch.Tensor,
        local: torch.Tensor,
        block: int,
        kind: int = 1,
        codec: Optional[Codec] = None,
        node: bool = False,
    ) -> None:
        """Every rank's ``local`` (its part) into ``out`` (the whole, rank order); with
        ``codec``, block-quantized on the wire and dequantized into ``out``; with ``node``,
        over the ranks of this rank's node only (hpZ, full width)."""
        if codec is not None:
            self.wait(self.all_gather_async(out, local, block, kind, codec, early=False), block)
            return
        group, name = self._gather_group(node)
        self.check(kind, block, group)
        t0 = time.perf_counter()
        self._run(
            lambda: self._gather(out, local, group),
            f"{self._describe(kind, block)} ({self._phase()})",
        )
        self._count(name, t0, out)

    def _gather_group(self, node: bool):
        if not node:
            return self.g.shard, "all_gather"
        if self.node_group is None:
            raise RuntimeError("infinity: a node all-gather without a node group (engine bug)")
        return self.node_group, "all_gather_node"

    def all_gather_async(
        self,
        out: torch.Tensor,
        local: torch.Tensor,
        block: int,
        kind: int = 1,
        codec: Optional[Codec] = None,
        early: bool = True,
        node: bool = False,
    ) -> Gather:
        """As :meth:`all_gather`, started asynchronously (the header is checked first, in
        order); returns a handle for :meth:`wait`."""
        group, name = self._gather_group(node)
        if codec is not None and node:
            raise RuntimeError("infinity: node all-gathers are full width (engine bug)")
        world = dist.get_world_size(group)
        self.check(kind, block, group)
        t0 = time.perf_counter()
        send, recv = local, out
        if codec is not None:
            send = torch.empty(codec.payload_bytes(local.numel()), dtype=torch.uint8)
            codec.encode(local.reshape(-1), send)
            send = send.to(self.device)
            recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=self.device)
        holder = {}

        def start() -> None:
            if self._have_gather_base:
                holder["work"] = dist.all_gather_into_tensor(recv, send, group=group, async_op=True)
            else:
                holder["work"] = dist.all_gather(
                    list(recv.chunk(world)), send, group=group, async_op=True
                )

        how = ", started early" if early else ""
        self._run(start, f"{self._describe(kind, block)} ({self._phase()}{how})")
        self._count(name, t0, out, recv)
        return Gather(holder["work"], send, recv, out, codec, kind, world, name)

    def wait(self, handle: Gather, block: int) -> None:
        t0 = time.perf_counter()
        self._run(handle.work.wait, f"{self._describe(handle.kind, block)} (started early)")
        if handle.codec is not None:  # every rank's part, dequantized, rank order
            part = handle.out.numel() // handle.world
            size = handle.recv.numel() // handle.world
            flat = handle.out.view(-1)
            for r in range(handle.world):
                handle.codec.decode(
                    handle.recv[r * size : (r + 1) * size], part, flat[r * part : (r + 1) * part]
                )
        self.seconds[handle.name] += time.perf_counter() - t0

    def reduce_scatter_avg(
        self,
        out: torch.Tensor,
        full: torch.Tensor,
        block: int,
        seen: torch.Tensor,
        codec: Optional[Codec] = None,
        residual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The average over all ranks (replicas included) of ``full``, this rank's part into
        ``out``. ``full`` is clobbered. ``seen`` (bool per slot: this rank has its gradient)
        becomes whether any rank has it, returned. With ``codec``: each part block-quantized
        (after adding ``residual``, the error feedback, which keeps what was lost), sent
        through an all-to-all, dequantized and summed in fp32 in rank order."""
        seen = self._agreed(self.check(2, block, flags=seen))
        t0 = time.perf_counter()
        if codec is None:
            self._run(
                lambda: self._reduce_scatter(out, full, self.g.shard),
                f"{self._describe(2, block)} ({self._phase()})",
            )
            self._count("reduce_scatter", t0, full)
        else:
            wire = self._reduce_quantized(out, full, codec, residual, block)
            self._count("reduce_scatter", t0, full, wire)
        if self.g.replicate is not None:
            seen = self._agreed(self.check(3, block, self.g.replicate, flags=seen))
            t0 = time.perf_counter()
            if codec is None:
                self._run(
                    lambda: dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.g.replicate),
                    f"{self._describe(3, block)} across replicas",
                )
                self._count("all_reduce", t0, out)
            else:
                wire = self._all_reduce_quantized(out, codec, block)
                self._count("all_reduce", t0, out, wire)
        out.div_(self.g.total)
        return seen

    def _all_reduce_quantized(self, out: torch.Tensor, codec: Codec, block: int) -> torch.Tensor:
        """The sum of ``out`` over the replicas, in place, block-quantized both ways: each
        replica's ``out`` cut into one piece per replica and sent through an all-to-all, each
        piece summed in fp32 by its replica, requantized and all-gathered. Every replica
        decodes the same gathered payloads, its own piece included, so all hold the same
        values. Returns the payload one replica sends in each of the two phases (the wire
        bytes beside ``out``'s full width, as for a ring all-reduce)."""
        group = self.g.replicate
        reps = dist.get_world_size(group)
        n = out.numel()
        per = -(-n // reps)
        size = codec.payload_bytes(per)
        values = torch.zeros(per * reps, dtype=torch.float32)
        values[:n].copy_(out.reshape(-1))
        send = torch.empty(reps * size, dtype=torch.uint8)
        for r in range(reps):
            codec.encode(values[r * per : (r + 1) * per], send[r * size : (r + 1) * size])
        what = f"{self._describe(3, block)} across replicas ({self._phase()}, quantized)"
        total, _ = self._exchange_sum(send, per, codec, group, what)
        got = torch.empty(per, dtype=torch.float32)
        mine = torch.empty(size, dtype=torch.uint8)
        codec.encode(total, mine)
        gathered = torch.empty(reps * size, dtype=torch.uint8, device=self.device)
        self._run(lambda: self._gather(gathered, mine.to(self.device), group), what)
        for r in range(reps):
            codec.decode(gathered[r * size : (r + 1) * size].cpu(), per, got)
            values[r * per : (r + 1) * per].copy_(got)
        out.copy_(values[:n].view_as(out))
        return send

    def _reduce_quantized(
        self,
        out: torch.Tensor,
        full: torch.Tensor,
        codec: Codec,
        residual: Optional[torch.Tensor],
        block: int,
    ) -> torch.Tensor:
        world = self.g.world
        n = out.numel()
        size = codec.payload_bytes(n)
        if residual is not None:
            full.add_(residual)
        send = torch.empty(world * size, dtype=torch.uint8)
        lost = torch.empty(n, dtype=torch.float32) if residual is not None else None
        for r in range(world):
            part = full[r * n : (r + 1) * n].cpu()
            payload = send[r * size : (r + 1) * size]
            codec.encode(part, payload)
            if residual is not None and lost is not None:
                codec.decode(payload, n, lost)
                residual[r * n : (r + 1) * n].copy_(part.sub_(lost))
        what = f"{self._describe(2, block)} ({self._phase()}, quantized)"
        total, recv = self._exchange_sum(send, n, codec, self.g.shard, what)
        out.copy_(total)
        return recv

    def _exchange_sum(
        self, send: torch.Tensor, n: int, codec: Codec, group, what: str
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One payload of ``n`` values per rank of ``group`` in ``send`` (CPU), through one
        all-to-all; returns the fp32 sum of what this rank received, decoded in rank order,
        and the received payloads."""
        ranks = dist.get_world_size(group)
        size = codec.payload_bytes(n)
        send = send.to(self.device)
        recv = torch.empty_like(send)
        self._run(lambda: dist.all_to_all_single(recv, send, group=group), what)
        got = torch.empty(n, dtype=torch.float32)
        total = torch.zeros(n, dtype=torch.float32)
        for r in range(ranks):
            codec.decode(recv[r * size : (r + 1) * size].cpu(), n, got)
            total.add_(got)
        return total, recv

    @staticmethod
    def _agreed(flags: Optional[torch.Tensor]) -> torch.Tensor:
        """The flags :meth:`check` returned (it raises instead when the ranks differ)."""
        if flags is None:
            raise RuntimeError("infinity: the header exchange returned no flags (engine bug)")
        return flags

    def all_reduce_avg(self, full: torch.Tensor, block: int, seen: torch.Tensor) -> torch.Tensor:
        """ZeRO-1/2 path for replicated gradients: the average over all ranks, in place;
        ``seen`` as in :meth:`reduce_scatter_avg`."""
        seen = self._agreed(self.check(3, block, flags=seen))
        t0 = time.perf_counter()
        self._run(
            lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.g.shard),
            f"{self._describe(3, block)} ({self._phase()})",
        )
        if self.g.replicate is not None:
            seen = self._agreed(self.check(3, block, self.g.replicate, flags=seen))
            self._run(
                lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.g.replicate),
                f"{self._describe(3, block)} across replicas",
            )
        self._count("all_reduce", t0, full)
        full.div_(self.g.total)
        return seen

    def any_rank(self, flags: torch.Tensor) -> torch.Tensor:
        """Per item of ``flags`` (bool, the same length on every rank): whether any
        data-parallel rank set it; rides on the header exchange (and the replicas')."""
        seen = self.check(7, -1, flags=flags)
        if self.g.replicate is not None:
            seen = self.check(7, -1, group=self.g.replicate, flags=seen)
        if seen is None:  # engine bug: check returns the flags it was given
            raise RuntimeError("infinity: the agreement returned no flags (engine bug)")
        return seen.to(flags.device)

    def all_reduce_scalar(self, value: float, op: str, *, replicas: bool = False) -> float:
        """``op`` ('sum', 'max', 'min') of one float over the shard group (and the replicas
        with ``replicas``)."""
        self.check(4, -1)
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        t0 = time.perf_counter()
        self._run(
            lambda: dist.all_reduce(t, op=rop, group=self.g.shard),
            "an all-reduce of a gradient statistic",
        )
        if replicas and self.g.replicate is not None:
            self._run(
                lambda: dist.all_reduce(t, op=rop, group=self.g.replicate),
                "an all-reduce of a gradient statistic across replicas",
            )
        self._count("all_reduce", t0, t)
        return float(t.item())

    def all_reduce_tensor(self, t: torch.Tensor, op: str, block: int) -> None:
        """``op`` ('sum', 'max') of a small tensor over the shard group, in place."""
        self.check(4, block)
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        t0 = time.perf_counter()
        self._run(
            lambda: dist.all_reduce(t, op=rop, group=self.g.shard),
            f"an all-reduce for block {self._block_name(block)!r}",
        )
        self._count("all_reduce", t0, t)

    def _count(
        self, name: str, t0: float, t: torch.Tensor, wire: Optional[torch.Tensor] = None
    ) -> None:
        self.seconds[name] += time.perf_counter() - t0
        self.bytes[name] += t.numel() * t.element_size()
        w = t if wire is None else wire
        sent = w.numel() * w.element_size()
        self.wire_bytes[name] += sent
        key = f"{name}/{self._phase()}"
        self.phase_bytes[key] = self.phase_bytes.get(key, 0) + sent
        self.calls[name] += 1

    def reset_counters(self) -> None:
        for d in (self.seconds, self.bytes, self.wire_bytes, self.calls):
            for k in d:
                d[k] = 0 if d is not self.seconds else 0.0
        self.phase_bytes.clear()
