"""The accumulation window: one layer-major step's forwards and backwards, which the step
machine sees as one forward and one backward (runtime/layered/driver.py drives it). While it is
open the machine keeps no per-backward start and end events and closes no block's gradients by
itself: the driver closes each block when the step is done with it."""

from __future__ import annotations

import time

from ..core.block import Block
from .hooks import in_backward
from .machine import StepHooks


class AccumulationWindow:
    """Opens and closes the window of ``step`` (its ``window`` flag and closed blocks)."""

    def __init__(self, step: StepHooks) -> None:
        self.step = step

    def open(self) -> None:
        """The start of a forward with grad enabled (listeners told once), without
        per-backward events until :meth:`close`."""
        step = self.step
        with step.lock:
            if step.closed:
                raise RuntimeError("infinity.accumulate: this model was unwrapped")
            if step.window or in_backward() or step.forward_depth:
                raise RuntimeError(
                    "infinity.accumulate: called inside a forward, a backward or another "
                    "accumulate; call it from the training loop, outside the model's forward"
                )
            step.recover_failed_backward()
            step.recover_failed_forward()
            step.outside.sync()
            step.stats.forward_started(time.perf_counter())
            for listener in step.listeners:
                listener.forward_started(step.owner)
            step.grads.reconcile(detach=True)
            step.window = True
            step.window_closed = set()

    def close_block(self, block: Block) -> None:
        """The step is done with ``block`` (its last micro-batch's backward ran): its
        gradients are complete, so they are closed now (no later micro-batch reopens them),
        and the block is released. The root block too, once every backward of the step ran
        (an optimizer stepping in backward then takes its gradients from RAM as well)."""
        step = self.step
        with step.lock:
            if not step.window:
                raise RuntimeError("infinity: close_block outside a layer-major window (bug)")
            if block.index in step.window_closed:
                return
            step.window_closed.add(block.index)
            if block.grads_seen:
                step.close_grads(block)
            else:
                block.reset_backward()
                if block.active_forward == 0:
                    step.group.release(block)

    def close(self, *, failed: bool) -> None:
        """The end of one backward (gradients finished and exposed), or, ``failed``, the
        recovery of a backward that raised."""
        step = self.step
        with step.lock:
            if not step.window:
                return
            step.window = False
            step.window_closed = set()
            if failed:
                step.callback_task = 0  # recover_failed_backward's marker of a running backward
                step.recover_failed_backward()
                step.recover_failed_forward()
                return
            step.end_backward()
