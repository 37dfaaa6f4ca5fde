"""Registers the engine's module and tensor hooks (bound methods of the step machine,
runtime/step/machine.py, reached through weak references), and keeps every handle so they can be
removed."""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any, Callable, List, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..core.block import Block
from ..process.compile_guard import eager_only
from ..vocab import rows as rows_mod
from ..vocab import tiled_head as tiled_head_mod


def output_tensors(output: Any) -> List[torch.Tensor]:
    """Tensors in a module's output that backward can flow through (tuples, dicts, dataclasses)."""
    if hasattr(output, "to_tuple") and callable(output.to_tuple):  # HF ModelOutput
        output = output.to_tuple()
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class HookSet:
    def __init__(self) -> None:
        self._handles: List[Any] = []

    def add(self, handle: Any) -> None:
        self._handles.append(handle)

    def remove_all(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


class _BlockIndex:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class WeakHook:
    """A hook that calls a bound method ``method(*bound, *args)`` of an object it holds
    weakly (a dropped engine's hooks do nothing). A copy of the module (``copy.deepcopy``)
    gets a no-op in its place, and pickling gives one: the copy is a plain module, not a
    second user of this engine's buffers."""

    __slots__ = ("_method", "_bound")

    def __init__(self, method: Callable[..., Any], *bound: Any) -> None:
        self._method = weakref.WeakMethod(method)
        # a Block is bound by its index, not held: a parameter's gradient hook lives in C++
        # (invisible to the garbage collector), and a Block reaches the model and so the
        # engine -- holding it would keep every engine never unwrapped alive, swap files open
        self._bound = tuple(_BlockIndex(b.index) if isinstance(b, Block) else b for b in bound)

    @eager_only  # a compiled model runs the hooks eagerly between its graphs (compile_guard.py)
    def __call__(self, *args: Any) -> Any:
        method = self._method()
        if method is None:
            return None
        if not self._bound:
            return method(*args)
        blocks = method.__self__.blocks
        bound = tuple(blocks[b.index] if isinstance(b, _BlockIndex) else b for b in self._bound)
        return method(*bound, *args)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _no_op

    def __reduce__(self):
        return (_restore_no_op, ())


def _restore_no_op() -> Callable[..., None]:
    return _no_op


class StepHandlers(Protocol):
    """The handlers the hooks call (runtime/step/machine.py)."""

    blocks: List[Block]

    def on_model_pre_forward(self, module: nn.Module, args: Any) -> None: ...

    def on_model_post_forward(self, module: nn.Module, args: Any, output: Any) -> None: ...

    def on_block_pre_forward(self, block: Block, module: nn.Module, args: Any) -> None: ...

    def on_block_post_forward(
        self, block: Block, module: nn.Module, args: Any, output: Any
    ) -> None: ...

    def on_model_labels(self, module: nn.Module, args: Any, kwargs: Any) -> None: ...

    def on_model_output(self, module: nn.Module, args: Any, output: Any) -> None: ...

    def on_grad_ready(
        self, block: Block, flat_index: int, slot_index: int, param: torch.Tensor
    ) -> None: ...


def register(
    model: nn.Module,
    blocks: List[Block],
    head: Optional[nn.Linear],
    step: StepHandlers,
    state_dict: Sequence[Callable[..., None]] = (),
) -> HookSet:
    """The hooks of one wrapped model: its forward, each block's forward, the rows read
    (embedding lookups, the tiled head), each trainable parameter's gradient, and
    ``state_dict`` (bound methods filling ``model.state_dict()``)."""
    hooks = HookSet()
    hooks.add(model.register_forward_pre_hook(WeakHook(step.on_model_pre_forward)))
    hooks.add(model.register_forward_hook(WeakHook(step.on_model_post_forward), always_call=True))
    for block in blocks:
        if block.is_root:
            continue  # the root block is driven by the model hooks above
        for module in block.modules:  # several for a shared (tied) block: fetched at each use
            hooks.add(module.register_forward_pre_hook(WeakHook(step.on_block_pre_forward, block)))
            hooks.add(
                module.register_forward_hook(
                    WeakHook(step.on_block_post_forward, block), always_call=True
                )
            )
    for block in blocks:
        if block.row_lookup:  # its forwards read only the rows they need (rows.py)
            for module in block.modules:
                if module is not head:
                    hooks.add(rows_mod.RowForward(module))
    if head is not None:  # the LM head in tiles (tiled_head.py)
        hooks.add(tiled_head_mod.Installed(model, head))
        hooks.add(
            model.register_forward_pre_hook(
                WeakHook(step.on_model_labels), with_kwargs=True, prepend=True
            )
        )
        hooks.add(model.register_forward_hook(WeakHook(step.on_model_output), always_call=True))
    for block in blocks:
        for fi, flat in enumerate(block.flats):
            for si, slot in enumerate(flat.slots):
                if slot.trainable:
                    cb: Callable = WeakHook(step.on_grad_ready, block, fi, si)
                    hooks.add(slot.param.register_post_accumulate_grad_hook(cb))
    for method in state_dict:
        hooks.add(model._register_state_dict_hook(WeakHook(method)))
    return hooks


def graph_task_id() -> int:
    """The running autograd graph task, -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    return graph_task_id() != -1


def queue_callback(fn: Callable[[], None]) -> None:
    """Runs ``fn`` when the running backward ends."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def timed_hook(handler: Callable) -> Callable:
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


def reads_params_in_backward(module: nn.Module) -> bool:
    """Whether the backward of ``module``'s forward reads its parameters. An nn.Embedding's
    (its own forward, not a subclass's) does not: the gradient of a lookup needs only the
    indices, so its block is not fetched again for backward."""
    return type(module).forward is not nn.Embedding.forward


def register_pre_backward(output: Any, callback: Callable[[], None]) -> None:
    """Calls ``callback`` once the gradient of any output tensor arrives (before the module's
    own backward runs)."""
    for t in output_tensors(output):
        t.register_hook(lambda grad, _cb=callback: _cb())


def register_post_backward(args: Any, callback: Callable[[], None]) -> None:
    """Calls ``callback`` when the gradients of all of a module's inputs that need one have
    been computed, i.e. when its backward is over."""
    leaves, _ = tree_flatten(args)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: callback())
