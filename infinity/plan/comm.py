"""ZeRO-3's communication per optimizer step, full width and compressed (``wrap(comm=...)``),
and its time on a link of a given speed.

Design notes: docs/modules.md, plan/comm.py."""

from __future__ import annotations

from dataclasses import dataclass

from ..policy import CommPolicy
from .shape import ModelShape


@dataclass(frozen=True)
class CommEstimate:
    ranks: int
    link_gbps: float
    comm: CommPolicy
    gather_bytes: float  # on the wire per rank per step, compressed as ``comm`` says
    reduce_bytes: float
    full_gather_bytes: float  # the same at full width
    full_reduce_bytes: float
    error_feedback_bytes: int  # host RAM per rank
    node_gather_bytes: float = 0.0  # hpZ: backward's all-gathers inside the node, per rank
    secondary_bytes: float = 0.0  # hpZ: the node's share of every block, held per rank

    @property
    def seconds(self) -> float:
        return (self.gather_bytes + self.reduce_bytes) * 8 / (self.link_gbps * 1e9)

    @property
    def full_seconds(self) -> float:
        return (self.full_gather_bytes + self.full_reduce_bytes) * 8 / (self.link_gbps * 1e9)

    def step_s(self, compute_s: float, overlap: bool = True, compressed: bool = True) -> float:
        """A step's time beside ``compute_s`` of compute: the longer of the two when the
        collectives overlap compute, their sum when they do not."""
        wire = self.seconds if compressed else self.full_seconds
        return max(compute_s, wire) if overlap else compute_s + wire

    def __str__(self) -> str:
        gib = 2**30
        return (
            f"{self.ranks} ranks at {self.link_gbps:g} Gb/s: all-gathers "
            f"{self.full_gather_bytes / gib:.2f} -> {self.gather_bytes / gib:.2f} GiB, "
            f"reduces {self.full_reduce_bytes / gib:.2f} -> {self.reduce_bytes / gib:.2f} GiB "
            f"per rank per step; {self.full_seconds:.2f} -> {self.seconds:.2f} s on the wire"
            + (
                f"; error feedback {self.error_feedback_bytes / gib:.2f} GiB of RAM per rank"
                if self.error_feedback_bytes
                else ""
            )
            + (
                f"; hierarchical partition: {self.node_gather_bytes / gib:.2f} GiB gathered "
                f"inside the node, {self.secondary_bytes / gib:.2f} GiB kept per rank"
                if self.comm.node_size
                else ""
            )
        )


def _width(codes: str, full: float, block: int) -> float:
    """Bytes per value on the wire."""
    if codes == "int8":
        return 1 + 4 / block
    if codes == "int4":
        return 0.5 + 4 / block
    return full


def comm_per_step(
    shape: ModelShape,
    ranks: int,
    link_gbps: float,
    comm: CommPolicy,
    compute_bytes: int = 2,
    micro_batches: int = 1,
    layer_major: bool = False,
) -> CommEstimate:
    """ZeRO-3 traffic per rank per optimizer step of ``shape`` over ``ranks`` ranks."""
    if ranks < 2:
        raise ValueError("infinity.estimate: communication needs ranks >= 2")
    if not link_gbps > 0:
        raise ValueError(f"infinity.estimate: link_gbps must be > 0, got {link_gbps!r}")
    passes = 1 if layer_major else micro_batches
    share = (ranks - 1) / ranks
    n = shape.params
    trained = shape.trainable_params if shape.trainable_params is not None else n
    gathered = 2 * passes * n * share  # values: forward and backward
    reduced = passes * trained * share
    node = comm.node_size
    node_gathered = passes * n * (node - 1) / node if node else 0.0
    return CommEstimate(
        ranks=ranks,
        link_gbps=link_gbps,
        comm=comm,
        gather_bytes=(gathered / 2 if node else gathered)
        * _width(comm.weights, compute_bytes, comm.block),
        reduce_bytes=reduced * _width(comm.grads, 4, comm.block),
        full_gather_bytes=gathered * compute_bytes,
        full_reduce_bytes=reduced * 4,
        error_feedback_bytes=4 * trained if comm.error_feedback and comm.grads != "none" else 0,
        node_gather_bytes=node_gathered * compute_bytes,
        secondary_bytes=n * compute_bytes / node if node else 0.0,
    )


__all__ = ["CommEstimate", "comm_per_step"]
