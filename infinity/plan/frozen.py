"""The shape of a model whose frozen base is stored quantized (``wrap(frozen_format=)``): its
homes' bytes in the stored format and the parameters the optimizer steps, for the estimate
and the planner."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import nn

from ..runtime.build.split import LAYER, partition
from ..runtime.homes.quant_format import frozen_format as _format
from .shape import PERSISTENCE_THRESHOLD, ModelShape


def frozen_shape(
    shape: ModelShape,
    fmt_name: str,
    model: Any = None,
    trainable_params: Optional[int] = None,
    block_rule: Any = None,
    persistence_threshold: Optional[int] = PERSISTENCE_THRESHOLD,
) -> ModelShape:
    """``shape`` with ``stored_bytes`` and ``trainable_params`` set. For a module: exactly as
    the engine stores it (the frozen matrices of the layer blocks in ``fmt_name``, the rest in
    its dtype) and its ``requires_grad`` parameters; for a config or a count: every layer
    parameter in the format, ``trainable_params`` (default 0) trainable."""
    fmt = _format(fmt_name)
    if isinstance(model, nn.Module):
        stored = 0
        for spec in partition(model, block_rule, persistence_threshold):
            for _, _, _, p in spec.params:
                quantized = spec.kind == LAYER and not p.requires_grad and p.dim() >= 2
                stored += (
                    p.numel() * fmt.bytes_per_param if quantized else p.numel() * p.element_size()
                )
        if trainable_params is None:
            trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    else:
        bpp = shape.bytes_per_param
        stored = sum(
            p * fmt.bytes_per_param if kind == LAYER else p * bpp
            for p, kind in zip(shape.block_params, shape.kinds)
        )
    trainable = int(trainable_params or 0)
    if trainable < 0 or trainable > shape.params:
        raise ValueError(
            f"infinity.estimate: trainable_params={trainable_params!r} must be "
            f"between 0 and the model's {shape.params:,} parameters"
        )
    return dataclasses.replace(shape, stored_bytes=int(stored), trainable_params=trainable)
