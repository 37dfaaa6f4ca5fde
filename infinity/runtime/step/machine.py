"""The per-step state machine: what to fetch, prefetch and release at each point of a
forward and backward, driven by the module and tensor hooks (hooks.py registers its bound
methods through weak references), and recovery when a forward or backward raised. The blocks'
movement itself is the BlockGroup's (blockgroup.py)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, List, Optional, Set

import torch
from torch import nn

from ..core.block import Block
from ..core.flat import FlatParam
from ..core.residency import Residency
from ..core.schedule import Schedule
from ..core.stats import Stats
from ..grads.store import WRITE, Handover
from ..process.rss_bound import RssBound
from ..vocab import tiled_head as tiled_head_mod
from . import hooks as hooks_mod
from .group import BlockGroup
from .hooks import graph_task_id, in_backward, queue_callback, timed_hook
from .outside import OutsideWrites, fill_sharded_state_dict

logger = logging.getLogger(__name__)


def _raised(output: Any) -> bool:
    """In an ``always_call`` forward hook: True when the module's forward raised."""
    return output is None and sys.exc_info()[1] is not None


class StepHooks:
    """The forward/backward handlers of one wrapped model and the state of the step running
    now (forward depth, backward task, whether a loss over labels follows)."""

    def __init__(
        self,
        owner: Any,
        lock: threading.RLock,
        stats: Stats,
        blocks: List[Block],
        schedule: Schedule,
        group: BlockGroup,
        outside: OutsideWrites,
        grads: Any,
        partitioner: Any,
        activations: Any,
        listeners: List[Any],
    ) -> None:
        self.owner = owner  # the engine: what listeners and row reads are handed
        self.lock = lock
        self.stats = stats
        self.blocks = blocks
        self.schedule = schedule
        self.group = group
        self.outside = outside
        self.grads = grads
        self.partitioner = partitioner
        self.activations = activations
        # optimizers overlapping their step with backward (the engine's backward_listeners)
        self.listeners = listeners
        self.closed = False
        self.callback_task = -1  # the backward running now (-1: none)
        self.forward_depth = 0  # model forwards running (nested calls)
        self.loss_follows = False  # a model forward with labels runs (tiled head)
        # Set by an optimizer over this engine: it changes the home copies in step(), so the
        # next forward's blocks are prefetched after the step (resume), not after backward.
        self.optimizer_attached = False
        # a layer-major accumulation runs (runtime/layered): one window for the whole step's
        # forwards and backwards, whose blocks the driver fetches, releases and closes
        self.window = False
        self.window_closed: Set[int] = set()  # blocks whose gradients the window closed
        # with a host_budget on a CPU device: the peak RSS checked after the first backward
        self.rss_bound: Optional[RssBound] = None

    def idle(self) -> bool:
        """No forward or backward runs."""
        return self.forward_depth == 0 and self.callback_task == -1 and not self.window

    def recover(self) -> None:
        """Before the homes change outside a step: recovers from a failed backward, and from
        a failed forward when no forward runs."""
        if not in_backward():
            self.recover_failed_backward()
            if self.forward_depth == 0:
                self.recover_failed_forward()

    def on_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        """ZeRO-3: ``model.state_dict()`` holds the whole parameters (every rank calls it)."""
        fill_sharded_state_dict(self.owner, state_dict, prefix)

    def recover_failed_backward(self) -> None:
        """A backward that raised never reached its end callback: forget its bookkeeping
        (its partial gradients stay accumulated, as in PyTorch: call zero_grad before
        retrying) and free what it had materialized."""
        if self.callback_task == -1:
            return
        logger.warning(
            "infinity: the previous backward did not finish (it raised); resetting "
            "the engine's backward state"
        )
        self.callback_task = -1
        self.group.backward_block = None
        self.stats.forward_backward_aborted()
        self.schedule.abort("backward")
        if self.partitioner is not None:
            self.partitioner.drop_grads()
        try:
            self.grads.abort_backward()
        finally:
            for block in self.blocks:
                block.reset_backward()
                if block.active_forward == 0:
                    self.group.discard(
                        block
                    ) if block.state is Residency.FETCHING else self.group.release(block)

    def recover_failed_forward(self) -> None:
        """A forward that raised left blocks counted as running: release them."""
        for block in self.blocks:
            if block.active_forward > 0 and block.pins == 0:
                block.active_forward = 0
                self.group.release(block)

    def _visit(self, block: Block, phase: str) -> None:
        if self.window:
            return  # the layer-major driver prefetches in its own order
        _, newly_deviated, upcoming = self.schedule.visit(phase, block.index)
        if newly_deviated:
            self.stats.schedule_deviations += 1
            logger.debug(
                "schedule deviation at block %s in %s; fetching on demand", block.name, phase
            )
        self.group.prefetch(upcoming)

    @timed_hook
    def on_model_pre_forward(self, module: nn.Module, args) -> None:
        with self.lock:
            if self.closed:
                return
            if not in_backward() and not self.window:
                self.recover_failed_backward()
                if self.forward_depth == 0:
                    self.stats.forward_started(time.perf_counter())
                    if self.rss_bound is not None:
                        self.rss_bound.forward_started()
                    self.recover_failed_forward()
                    self.outside.sync()
                    for listener in self.listeners:
                        listener.forward_started(self.owner)
                    if torch.is_grad_enabled():
                        self.grads.reconcile(detach=True)
                self.schedule.begin("forward")
                self.group.prefetch(self.schedule.upcoming("forward"))
            self.forward_depth += 1
            for block in self.blocks:
                if block.is_root:
                    self.group.ensure_on_device(block)
            if self.activations is not None and not in_backward():
                self.activations.enter(None, model_level=True)

    @timed_hook
    def on_model_post_forward(self, module: nn.Module, args, output) -> None:
        with self.lock:
            self.forward_depth = max(0, self.forward_depth - 1)
            if self.activations is not None and not in_backward():
                self.activations.exit(None)
            if self.closed or in_backward():
                return
            if self.window:  # the driver keeps the root materialized for the whole window
                if not _raised(output) and self.activations is not None:
                    if torch.is_grad_enabled() and hooks_mod.output_tensors(output):
                        self.activations.forward_done()
                return
            if _raised(output):
                self.schedule.abort("forward")
                if self.forward_depth == 0 and self.callback_task == -1:
                    self.stats.forward_backward_ended(time.perf_counter())
                return
            self.schedule.end("forward")
            root = next((b for b in self.blocks if b.is_root), None)
            if torch.is_grad_enabled() and hooks_mod.output_tensors(output):
                if root is not None:
                    hooks_mod.register_pre_backward(output, lambda: self.on_pre_backward(root))
                # the first blocks of backward are the last of forward: start fetching them
                self.group.prefetch(self.schedule.upcoming("backward"))
                if self.activations is not None:
                    self.activations.forward_done()
                if self.rss_bound is not None and self.forward_depth == 0:
                    self.rss_bound.forward_done()
            elif self.forward_depth == 0 and self.callback_task == -1:
                # no backward follows (inference): outside forward again, so the parameters
                # view their homes (the root block is not kept materialized)
                self.stats.forward_backward_ended(time.perf_counter())
                for block in self.blocks:
                    if block.active_forward == 0:
                        self.group.release(block)

    @timed_hook
    def on_block_pre_forward(self, block: Block, module: nn.Module, args) -> None:
        with self.lock:
            if self.closed:
                return
            # Activation checkpointing recomputes inside backward. A recompute is not counted
            # in active_forward: non-reentrant checkpointing stops it early by raising inside
            # the forward, so its post-forward bookkeeping may never run. The block is held
            # as the running backward block instead.
            recompute = in_backward()
            if recompute:
                self.start_backward_if_needed()
                self._visit(block, "backward")
                self.group.backward_block = block
            else:
                self._visit(block, "forward")
            if not block.row_lookup:  # else its forward reads only its rows (rows.py)
                self.group.ensure_on_device(block)
            if not recompute:
                block.active_forward += 1
                if self.activations is not None:
                    self.activations.enter(block.index)
            signal = block.needs_input_signal or block.shared or block.close_on_inputs
            if signal and torch.is_grad_enabled():
                # a shared block: the end of this use's backward (its inputs' gradients) lets
                # it go until its next use, though its gradient is complete only after the
                # backward of every use
                hooks_mod.register_post_backward(args, lambda: self.on_inputs_grad(block))

    def on_model_labels(self, module: nn.Module, args, kwargs) -> None:
        """Model forward pre-hook (tiled head): whether a loss over labels follows."""
        if self.forward_depth == 0 and not in_backward():
            self.loss_follows = tiled_head_mod.labels_given(kwargs) and isinstance(
                getattr(module, "loss_function", None), tiled_head_mod.LossFunction
            )

    def on_model_output(self, module: nn.Module, args, output) -> None:
        """Model forward hook (tiled head): the placeholder logits become None."""
        if self.forward_depth == 0:
            self.loss_follows = False
            tiled_head_mod.drop_placeholder(output)

    @timed_hook
    def on_inputs_grad(self, block: Block) -> None:
        with self.lock:
            if self.closed:
                return
            block.inputs_done = True
            if self.window:
                return  # the layer-major driver closes the block when the step is done with it
            if block.backward_done():
                self._release_if_backward_done(block)
            elif block.shared:
                self._release_between_uses(block)

    def _release_between_uses(self, block: Block) -> None:
        """A shared block after one use's backward: released unless a use running now holds it
        or the recorded backward uses it again within the prefetch window."""
        if block.active_forward > 0 or block.resident or not block.materialized:
            return
        ahead = self.schedule.next_visit("backward", block.index)
        if ahead is not None and ahead <= self.schedule.window + 1:
            return  # the next visit would prefetch it again
        if block is self.group.backward_block:
            self.group.backward_block = None
        self.group.release(block)

    def _keep_after_forward(self, block: Block, backward_reads: bool) -> bool:
        """After a forward use: keep the block materialized when the recorded forward uses it
        again before the prefetch window would fetch it anew (within window + 1 visits), or
        when this was its last use in forward and the first blocks of backward (as many as
        the window) include it."""
        window = self.schedule.window
        ahead = self.schedule.next_visit("forward", block.index)
        if ahead is not None:
            return ahead <= window + 1
        return backward_reads and block.index in self.schedule.upcoming("backward", max(1, window))

    def _release_if_backward_done(self, block: Block) -> None:
        if block.is_root or not block.backward_done():
            return
        self.close_grads(block)

    def close_grads(self, block: Block) -> None:
        """The block's gradients are complete: hand them to the sink (reduced first under
        ZeRO), release the block, tell the listeners."""
        block.grads_seen.clear()
        block.inputs_done = False
        if block is self.group.backward_block:
            self.group.backward_block = None
        for flat in block.flats:
            if self.partitioner is not None:  # reduce(-scatter) now, in backward order
                # closed on its inputs: every rank reduces it, with a gradient or none
                self.partitioner.reduce_grads(
                    flat, self.grads, every_rank=block.close_on_inputs, how=self._handover
                )
            else:
                self.grads.close(flat, self._handover(flat))
        self.group.release(block)
        for listener in self.listeners:
            for flat in block.flats:
                # under ZeRO-2/3 the sink closed this rank's part: the optimizer steps that
                part = self.partitioner.sink_flat(flat) if self.partitioner is not None else flat
                listener.grads_complete(self.owner, part)

    def _handover(self, flat: FlatParam) -> Handover:
        """How the sink closes ``flat`` (this rank's part under ZeRO-2/3): an optimizer
        stepping it now may take its gradients from RAM, and then they are not written to
        NVMe (see GradientSink.close)."""
        taker = next(
            (listener for listener in self.listeners if listener.takes_in_ram(self.owner, flat)),
            None,
        )
        if taker is None:
            return WRITE
        return Handover(True, taker.writes(self.owner), taker.in_place(self.owner))

    @timed_hook
    def on_block_post_forward(self, block: Block, module: nn.Module, args, output) -> None:
        with self.lock:
            if self.closed:
                return
            if not in_backward():
                block.active_forward = max(0, block.active_forward - 1)
                if self.activations is not None:
                    self.activations.exit(block.index)
            if _raised(output):  # the forward raised: nothing will use this block's output
                if block.active_forward == 0 and not in_backward():
                    self.group.release(block)
                return
            needs_backward = torch.is_grad_enabled() and bool(hooks_mod.output_tensors(output))
            # an nn.Embedding's backward needs only the indices: its block is not fetched
            backward_reads = needs_backward and hooks_mod.reads_params_in_backward(module)
            if backward_reads:
                hooks_mod.register_pre_backward(output, lambda: self.on_pre_backward(block))
            if in_backward() or self.window:
                return  # recomputed for backward, or held by the layer-major driver
            # the last blocks of forward are the first of backward (as many as the prefetch
            # window), and a block used again soon in forward: keep them rather than read them
            # again; under a device budget a required fetch still releases them (_make_room)
            if block.active_forward == 0 and not self._keep_after_forward(block, backward_reads):
                self.group.release(block)

    def start_backward_if_needed(self) -> None:
        task = graph_task_id()
        if self.window or task == -1 or task == self.callback_task:
            return
        self.callback_task = task
        self.schedule.begin("backward")
        self.grads.reconcile(detach=True)
        queue_callback(self._on_backward_end)

    @timed_hook
    def on_pre_backward(self, block: Block) -> None:
        with self.lock:
            if self.closed:
                return
            self.start_backward_if_needed()
            task = graph_task_id()
            if block.backward_task == task and block.materialized:
                return
            block.backward_task = task
            if not block.is_root:
                self._visit(block, "backward")
                self.group.backward_block = block
            if not block.row_lookup:  # a tiled head reads its tiles itself (tiled_head.py)
                self.group.ensure_on_device(block)

    @timed_hook
    def on_grad_ready(
        self, block: Block, flat_index: int, slot_index: int, param: torch.Tensor
    ) -> None:
        with self.lock:
            self.start_backward_if_needed()
            grad = param.grad
            if grad is None:
                return
            if self.partitioner is not None:  # reduced once the block's backward is over
                self.partitioner.add_grad(block.flats[flat_index], slot_index, grad)
            else:
                self.grads.add(block.flats[flat_index], slot_index, grad)
            param.grad = None
            block.grads_seen.add((flat_index, slot_index))
            if not self.window:
                self._release_if_backward_done(block)

    @timed_hook
    def _on_backward_end(self) -> None:
        with self.lock:
            self.schedule.end("backward")
            self.end_backward()

    def end_backward(self) -> None:
        """The end of a backward (or of a layer-major window): gradients finished and exposed,
        blocks released."""
        with self.lock:
            self.callback_task = -1
            try:
                if self.partitioner is not None:
                    self.partitioner.flush_grads(self.grads)
                self.grads.finish_backward()
            finally:
                for block in self.blocks:
                    block.reset_backward()
                    if block.active_forward == 0:
                        self.group.release(block)
                self.group.backward_block = None
                self.stats.forward_backward_ended(time.perf_counter())
            if self.partitioner is None or not self.partitioner.shards_grads:
                self.grads.expose()  # a rank's part of a gradient is not a p.grad
            if self.partitioner is not None:
                self.partitioner.sync_zero1_views()
            if not self.optimizer_attached:
                self.group.prefetch_for_forward()
            if self.rss_bound is not None:
                self.rss_bound.backward_done()
