"""The forward/backward state machine driven by the module and tensor hooks (hooks.py wires
them): what to fetch, prefetch and release at each point of a step, and recovery when a
forward or backward raised. Part of the Engine."""
from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

from . import hooks as hooks_mod
from . import rows as rows_mod
from . import tiled_head as tiled_head_mod
from .block import Block
from .flat import Binding
from .residency import Residency

logger = logging.getLogger("infinity.runtime.engine")


def _graph_task_id() -> int:
    return torch._C._current_graph_task_id()


def _queue_callback(fn) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _timed_hook(handler: Callable) -> Callable:
    """Counts the wall time of a hook handler (lock wait included) in ``stats.hook_seconds``:
    the engine's share of a forward+backward (see Stats.time_breakdown)."""
    @functools.wraps(handler)
    def timed(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return handler(self, *args)
        finally:
            self.stats.hook_seconds += time.perf_counter() - t0
    return timed


def _raised(output: Any) -> bool:
    """In an ``always_call`` forward hook: True when the module's forward raised."""
    return output is None and sys.exc_info()[1] is not None


class HookHandlers:
    """Part of :class:`~infinity.runtime.engine.Engine` (its state lives there)."""

    def _recover_failed_backward(self) -> None:
        """A backward that raised never reached its end callback: forget its bookkeeping
        (its partial gradients stay accumulated, as in PyTorch: call zero_grad before
        retrying) and free what it had materialized."""
        if self._callback_task == -1:
            return
        logger.warning("infinity: the previous backward did not finish (it raised); resetting "
                       "the engine's backward state")
        self._callback_task = -1
        self._last_backward_block = None
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
                    self._discard(block) if block.state is Residency.FETCHING \
                        else self._release(block)

    def _recover_failed_forward(self) -> None:
        """A forward that raised left blocks counted as running: release them."""
        for block in self.blocks:
            if block.active_forward > 0 and block.pins == 0:
                block.active_forward = 0
                self._release(block)

    def _in_backward(self) -> bool:
        return _graph_task_id() != -1

    def _visit(self, block: Block, phase: str) -> None:
        _, newly_deviated, upcoming = self.schedule.visit(phase, block.index)
        if newly_deviated:
            self.stats.schedule_deviations += 1
            logger.debug("schedule deviation at block %s in %s; fetching on demand",
                         block.name, phase)
        self._prefetch(upcoming)

    @_timed_hook
    def on_model_pre_forward(self, module: nn.Module, args) -> None:
        with self._lock:
            if self._closed:
                return
            if not self._in_backward():
                self._recover_failed_backward()
                if self._model_forward_depth == 0:
                    self.stats.forward_started(time.perf_counter())
                    self._recover_failed_forward()
                    self.sync_outside_writes()
                    for listener in self.backward_listeners:
                        listener.forward_started(self)
                    if torch.is_grad_enabled():
                        self.grads.reconcile(detach=True)
                self.schedule.begin("forward")
                self._prefetch(self.schedule.upcoming("forward"))
            self._model_forward_depth += 1
            for block in self.blocks:
                if block.is_root:
                    self._ensure_on_device(block)
            if self.activations is not None and not self._in_backward():
                self.activations.enter(None, model_level=True)

    @_timed_hook
    def on_model_post_forward(self, module: nn.Module, args, output) -> None:
        with self._lock:
            self._model_forward_depth = max(0, self._model_forward_depth - 1)
            if self.activations is not None and not self._in_backward():
                self.activations.exit(None)
            if self._closed or self._in_backward():
                return
            if _raised(output):
                self.schedule.abort("forward")
                if self._model_forward_depth == 0 and self._callback_task == -1:
                    self.stats.forward_backward_ended(time.perf_counter())
                return
            self.schedule.end("forward")
            root = next((b for b in self.blocks if b.is_root), None)
            if torch.is_grad_enabled() and hooks_mod.output_tensors(output):
                if root is not None:
                    hooks_mod.register_pre_backward(
                        output, lambda: self.on_pre_backward(root))
                # the first blocks of backward are the last of forward: start fetching them
                self._prefetch(self.schedule.upcoming("backward"))
                if self.activations is not None:
                    self.activations.forward_done()
            elif self._model_forward_depth == 0 and self._callback_task == -1:
                # no backward follows (inference): outside forward again, so the parameters
                # view their homes (the root block is not kept materialized)
                self.stats.forward_backward_ended(time.perf_counter())
                for block in self.blocks:
                    if block.active_forward == 0:
                        self._release(block)

    @_timed_hook
    def on_block_pre_forward(self, block: Block, module: nn.Module, args) -> None:
        with self._lock:
            if self._closed:
                return
            # Activation checkpointing recomputes inside backward. A recompute is not counted
            # in active_forward: non-reentrant checkpointing stops it early by raising inside
            # the forward, so its post-forward bookkeeping may never run. The block is held
            # as the running backward block instead.
            recompute = self._in_backward()
            if recompute:
                self._start_backward_if_needed()
                self._visit(block, "backward")
                self._last_backward_block = block
            else:
                self._visit(block, "forward")
            if not block.row_lookup:  # else its forward reads only its rows (rows.py)
                self._ensure_on_device(block)
            if not recompute:
                block.active_forward += 1
                if self.activations is not None:
                    self.activations.enter(block.index)
            if (block.needs_input_signal or block.shared) and torch.is_grad_enabled():
                # a shared block: the end of this use's backward (its inputs' gradients) lets
                # it go until its next use, though its gradient is complete only after the
                # backward of every use
                hooks_mod.register_post_backward(args, lambda: self.on_inputs_grad(block))

    @_timed_hook
    def lookup_rows(self, block: Block, module: nn.Module, input: torch.Tensor) -> torch.Tensor:
        """The forward of an embedding looked up row by row (runtime/rows.py), between its
        block's pre- and post-forward hooks."""
        with self._lock:
            flat = block.flats[0]
            if flat.binding is Binding.OUTSIDE and flat.written_slots():
                self.sync_outside_writes()  # written through the parameter: the home first
            return rows_mod.lookup(self, block, module, input)

    @_timed_hook
    def tiled_head_forward(self, block: Block, module: nn.Module, hidden: torch.Tensor) -> Any:
        """The forward of the LM head tiled over its vocabulary (runtime/tiled_head.py)."""
        with self._lock:
            flat = block.flats[0]
            if flat.binding is Binding.OUTSIDE and flat.written_slots():
                self.sync_outside_writes()
            return tiled_head_mod.head_forward(self, block, module, hidden, self._loss_follows)

    def read_head_tile(self, block: Block, weight: torch.Tensor, r0: int,
                       r1: int) -> torch.Tensor:
        with self._lock:
            return rows_mod.read_row_span(self, block, weight, r0, r1)

    def add_row_grads(self, block: Block, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Gradient rows of a block read by rows (an embedding's lookup, a tile of the LM
        head): ``rows`` distinct and sorted, ``values`` their gradients."""
        with self._lock:
            self._start_backward_if_needed()
            grad = torch.sparse_coo_tensor(rows.to("cpu").unsqueeze(0),
                                           values.detach().to("cpu", torch.float32),
                                           block.flats[0].slots[0].shape, is_coalesced=True,
                                           check_invariants=False)
            self.grads.add(block.flats[0], 0, grad)

    def on_model_labels(self, module: nn.Module, args, kwargs) -> None:
        """Model forward pre-hook (tiled head): whether a loss over labels follows."""
        if self._model_forward_depth == 0 and not self._in_backward():
            self._loss_follows = (tiled_head_mod.labels_given(kwargs) and isinstance(
                getattr(module, "loss_function", None), tiled_head_mod.LossFunction))

    def on_model_output(self, module: nn.Module, args, output) -> None:
        """Model forward hook (tiled head): the placeholder logits become None."""
        if self._model_forward_depth == 0:
            self._loss_follows = False
            tiled_head_mod.drop_placeholder(output)

    @_timed_hook
    def on_inputs_grad(self, block: Block) -> None:
        with self._lock:
            if self._closed:
                return
            block.inputs_done = True
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
        if block is self._last_backward_block:
            self._last_backward_block = None
        self._release(block)

    def _keep_after_forward(self, block: Block, backward_reads: bool) -> bool:
        """After a forward use: keep the block materialized when the recorded forward uses it
        again before the prefetch window would fetch it anew (within window + 1 visits), or
        when this was its last use in forward and the first blocks of backward (as many as
        the window) include it."""
        window = self.schedule.window
        ahead = self.schedule.next_visit("forward", block.index)
        if ahead is not None:
            return ahead <= window + 1
        return backward_reads and block.index in self.schedule.upcoming("backward",
                                                                         max(1, window))

    def _release_if_backward_done(self, block: Block) -> None:
        if block.is_root or not block.backward_done():
            return
        block.grads_seen.clear()
        block.inputs_done = False
        if block is self._last_backward_block:
            self._last_backward_block = None
        for flat in block.flats:
            if self.partitioner is not None:  # reduce(-scatter) now, in backward order
                self.partitioner.reduce_grads(flat, self.grads)
            else:
                self.grads.close(flat)
        self._release(block)
        for listener in self.backward_listeners:
            for flat in block.flats:
                listener.grads_complete(self, flat)

    @_timed_hook
    def on_block_post_forward(self, block: Block, module: nn.Module, args, output) -> None:
        with self._lock:
            if self._closed:
                return
            if not self._in_backward():
                block.active_forward = max(0, block.active_forward - 1)
                if self.activations is not None:
                    self.activations.exit(block.index)
            if _raised(output):  # the forward raised: nothing will use this block's output
                if block.active_forward == 0 and not self._in_backward():
                    self._release(block)
                return
            needs_backward = torch.is_grad_enabled() and bool(hooks_mod.output_tensors(output))
            # an nn.Embedding's backward needs only the indices: its block is not fetched
            backward_reads = needs_backward and hooks_mod.reads_params_in_backward(module)
            if backward_reads:
                hooks_mod.register_pre_backward(output, lambda: self.on_pre_backward(block))
            if self._in_backward():
                return  # recomputed for backward: its backward comes next
            # the last blocks of forward are the first of backward (as many as the prefetch
            # window), and a block used again soon in forward: keep them rather than read them
            # again; under a device budget a required fetch still releases them (_make_room)
            if block.active_forward == 0 and not self._keep_after_forward(block,
                                                                          backward_reads):
                self._release(block)

    def _start_backward_if_needed(self) -> None:
        task = _graph_task_id()
        if task == -1 or task == self._callback_task:
            return
        self._callback_task = task
        self.schedule.begin("backward")
        self.grads.reconcile(detach=True)
        _queue_callback(self._on_backward_end)

    @_timed_hook
    def on_pre_backward(self, block: Block) -> None:
        with self._lock:
            if self._closed:
                return
            self._start_backward_if_needed()
            task = _graph_task_id()
            if block.backward_task == task and block.materialized:
                return
            block.backward_task = task
            if not block.is_root:
                self._visit(block, "backward")
                self._last_backward_block = block
            if not block.row_lookup:  # a tiled head reads its tiles itself (tiled_head.py)
                self._ensure_on_device(block)

    @_timed_hook
    def on_grad_ready(self, block: Block, flat_index: int, slot_index: int,
                      param: torch.Tensor) -> None:
        with self._lock:
            self._start_backward_if_needed()
            grad = param.grad
            if grad is None:
                return
            if self.partitioner is not None:  # reduced once the block's backward is over
                self.partitioner.add_grad(block.flats[flat_index], slot_index, grad)
            else:
                self.grads.add(block.flats[flat_index], slot_index, grad)
            param.grad = None
            block.grads_seen.add((flat_index, slot_index))
            self._release_if_backward_done(block)

    @_timed_hook
    def _on_backward_end(self) -> None:
        with self._lock:
            self._callback_task = -1
            self.schedule.end("backward")
            try:
                if self.partitioner is not None:
                    self.partitioner.flush_grads(self.grads)
                self.grads.finish_backward()
            finally:
                for block in self.blocks:
                    block.reset_backward()
                    if block.active_forward == 0:
                        self._release(block)
                self._last_backward_block = None
                self.stats.forward_backward_ended(time.perf_counter())
            if self.partitioner is None or not self.partitioner.shards_grads:
                self.grads.expose()  # a rank's part of a gradient is not a p.grad
            if self.partitioner is not None:
                self.partitioner.sync_zero1_views()
            if not self.optimizer_attached:
                self._prefetch_for_forward()

    def _prefetch_for_forward(self) -> None:
        root = [b.index for b in self.blocks if b.is_root]
        self._prefetch(root + self.schedule.upcoming("forward"))
