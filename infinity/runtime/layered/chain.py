"""The chain of layers a layer-major step runs: found in the model, checked, and tapped.

A model's layers form a chain when its forward calls each layer of one ``nn.ModuleList`` once,
in order, each on the previous layer's output, and the rest of the model (the head, the loss)
reads only the last layer's output. Tapping a layer swaps its class for a subclass whose
``__call__`` goes to a function the driver sets (the layer keeps its identity, attributes and
parameters); the model's forward then runs with the taps in place of its layers."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

Tap = Callable[[int, Tuple[Any, ...], Dict[str, Any]], Any]

_TAPPED: Dict[type, type] = {}  # a layer class -> its tapped subclass
_TAP_ATTR = "_infinity_layer_tap"


class ChainError(ValueError):
    """The model (or a micro-batch) does not fit a layer-major step."""


def _refuse(why: str) -> ChainError:
    return ChainError(
        f"infinity.accumulate: {why}. Layer-major accumulation needs a model whose layers form "
        "a chain; run the plain micro-batch loop instead (for each micro-batch: "
        "(loss / k).backward(); then opt.step()), which infinity runs unchanged"
    )


def _tap_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    index, tap = self.__dict__[_TAP_ATTR]
    return tap(index, args, kwargs)


def _tapped_class(cls: type) -> type:
    sub = _TAPPED.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__call__": _tap_call, "__module__": cls.__module__})
        sub.__qualname__ = cls.__qualname__
        _TAPPED[cls] = sub
    return sub


def find_layers(
    model: nn.Module, layer_modules: Optional[List[nn.Module]] = None
) -> List[nn.Module]:
    """The layers of the chain. ``layer_modules``: the wrapped model's layer blocks' modules
    (they must be the children of one ``nn.ModuleList``, in its order); None: the longest
    ``nn.ModuleList`` of modules of one class (an unwrapped model)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if layer_modules is not None:
        ids = [id(m) for m in layer_modules]
        for lst in lists:
            if [id(m) for m in lst] == ids:
                return list(lst)
        raise _refuse(
            "the wrapped model's layer blocks are not the children of one nn.ModuleList in "
            "its order (a custom block_rule, or blocks outside a layer list)"
        )
    best: List[nn.Module] = []
    for lst in lists:
        if len({type(m) for m in lst}) == 1 and len(lst) > len(best):
            best = list(lst)
    if not best:
        raise _refuse("the model has no nn.ModuleList of layers")
    return best


def check_model(model: nn.Module, layers: List[nn.Module], allow_hooks: bool) -> None:
    """Refuses what a chain of recorded layers cannot honour, before anything runs."""
    config = getattr(model, "config", None)
    for name in ("output_router_logits", "output_hidden_states", "output_attentions"):
        if getattr(config, name, False) is True:
            raise _refuse(
                f"config.{name}=True collects per-layer outputs besides the hidden state (an MoE "
                "auxiliary loss, hidden states or attentions); set it to False"
            )
    if allow_hooks:
        return
    for i, layer in enumerate(layers):
        for name, sub in layer.named_modules():
            user = [
                h
                for hooks in (sub._forward_pre_hooks, sub._forward_hooks)
                for h in hooks.values()
                if type(h).__name__ != "WeakHook"  # the engine's own block hooks
            ]
            if user:
                where = f"layer {i}" + (f" ({name})" if name else "")
                raise ChainError(
                    f"infinity.accumulate: a forward hook is registered on {where}. Layer-major "
                    "accumulation runs each layer's forward again in backward (recomputation), "
                    "so the hook would run twice per micro-batch. Remove it, or pass "
                    "allow_hooks=True if running it again is harmless"
                )


def check_call(index: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Refuses a layer call whose inputs a recorded replay cannot reproduce."""
    for key in ("past_key_values", "past_key_value", "cache"):
        if kwargs.get(key) is not None:
            raise _refuse(
                f"layer {index} was called with a key/value cache ({key}); pass use_cache=False "
                "in training"
            )
    if kwargs.get("use_cache") is True:
        raise _refuse(f"layer {index} was called with use_cache=True; pass use_cache=False")
    for key in ("output_router_logits", "output_attentions"):
        if kwargs.get(key) is True:
            raise _refuse(f"layer {index} was asked for {key}, an output besides the hidden state")
    for value in list(args) + list(kwargs.values()):
        for t in _tensors(value):
            if t.requires_grad:
                raise _refuse(
                    f"layer {index} takes a tensor besides the hidden state that needs a "
                    "gradient (a per-layer input computed from parameters)"
                )


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def split_hidden(
    index: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[torch.Tensor, Tuple[Any, ...], Dict[str, Any]]:
    """A layer call's hidden state (its first argument) and the rest."""
    if args:
        hidden, rest = args[0], tuple(args[1:])
    elif "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        hidden, rest = kwargs.pop("hidden_states"), ()
    else:
        raise _refuse(f"layer {index} was called without a hidden state as its first argument")
    if not isinstance(hidden, torch.Tensor):
        raise _refuse(f"layer {index}'s first argument is a {type(hidden).__name__}, not a tensor")
    return hidden, rest, dict(kwargs)


@contextlib.contextmanager
def tapped(layers: Sequence[nn.Module], tap: Tap) -> Iterator[None]:
    """Within the block, calling layer ``i`` calls ``tap(i, args, kwargs)`` instead (hooks
    included: none of the layer's own hooks run)."""
    originals = [type(layer) for layer in layers]
    try:
        for i, layer in enumerate(layers):
            layer.__dict__[_TAP_ATTR] = (i, tap)
            layer.__class__ = _tapped_class(originals[i])
        yield
    finally:
        for layer, cls in zip(layers, originals):
            layer.__class__ = cls
            layer.__dict__.pop(_TAP_ATTR, None)


def run_layer(
    layer: nn.Module, hidden: torch.Tensor, rest: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> torch.Tensor:
    """One layer's own forward (no hooks: the driver moves its block)."""
    out = layer.forward(hidden, *rest, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise _refuse(
            f"layer {type(layer).__name__} returns a {type(out).__name__}, not the hidden state "
            "as one tensor"
        )
    return out
