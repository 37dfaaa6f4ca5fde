"""PEFT: merging LoRA adapters into a wrapped base model.

Design notes: docs/modules.md, integrations/peft.py."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..api import parameters_changed
from ..runtime.engine import engine_of


def _wrapped_modules(model: nn.Module):
    return [m for m in model.modules() if engine_of(m) is not None]


def merge_and_unload(peft_model: nn.Module, **kwargs: Any) -> nn.Module:
    """``peft_model.merge_and_unload(**kwargs)`` for a PEFT model whose base is wrapped by
    infinity; the merged weights reach the engine's homes. Returns the merged base model."""
    wrapped = _wrapped_modules(peft_model)
    merged = peft_model.merge_and_unload(**kwargs)
    for module in wrapped:
        parameters_changed(module)
    return merged
