"""Quantized checkpoints as ``source=``: what a CheckpointSource can decode, and what it refuses.

Design notes: docs/modules.md, runtime/homes/source_quant.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from ...ops import nf4

_NF4_STATE = ".quant_state.bitsandbytes__nf4"
_REFUSED = (
    (".quant_state.bitsandbytes__fp4", "bitsandbytes FP4"),
    (".SCB", "bitsandbytes LLM.int8 (8-bit)"),
    (".qweight", "GPTQ/AWQ"),
    (".weight_scale_inv", "FP8 (block-scaled)"),
    (".weight_scale", "FP8"),
)


@dataclass(frozen=True)
class Bnb4Weight:
    key: str
    shape: Tuple[int, ...]
    blocksize: int
    nested_offset: Optional[float]
    nested_blocksize: int


def _suffix_keys(key: str) -> Tuple[str, ...]:
    return (
        key + ".absmax",
        key + ".quant_map",
        key + ".nested_absmax",
        key + ".nested_quant_map",
        key + _NF4_STATE,
    )


def scan(
    path: str, keys: Iterable[str], read: Callable[[str], torch.Tensor], error: type
) -> Dict[str, Bnb4Weight]:
    """The checkpoint's bitsandbytes NF4 weights by key; raises ``error`` for a quantization
    format infinity does not read."""
    keys = set(keys)
    for key in sorted(keys):
        for suffix, what in _REFUSED:
            if key.endswith(suffix):
                raise error(
                    f"infinity.wrap(source={path!r}): the checkpoint is quantized in {what} "
                    f"(tensor {key!r}); infinity reads full-precision checkpoints and "
                    "bitsandbytes NF4 ones only. Pass the model's original (bf16/fp32) "
                    "checkpoint, and frozen_format='nf4' or 'int8' to quantize the frozen base "
                    "at wrap"
                )
    found: Dict[str, Bnb4Weight] = {}
    for key in keys:
        if not key.endswith(_NF4_STATE):
            continue
        weight = key[: -len(_NF4_STATE)]
        try:
            state = json.loads(bytes(read(key).tolist()).decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise error(
                f"infinity.wrap(source={path!r}): unreadable bitsandbytes quant state "
                f"{key!r}: {exc}"
            ) from None
        if state.get("quant_type") != "nf4":
            raise error(
                f"infinity.wrap(source={path!r}): {weight!r} is quantized as "
                f"{state.get('quant_type')!r}; only NF4 is read"
            )
        missing = [k for k in (weight, weight + ".absmax") if k not in keys]
        if missing:
            raise error(
                f"infinity.wrap(source={path!r}): bitsandbytes NF4 weight {weight!r} "
                f"lacks {missing}; the checkpoint is incomplete"
            )
        nested = weight + ".nested_absmax" in keys
        found[weight] = Bnb4Weight(
            weight,
            tuple(int(d) for d in state["shape"]),
            int(state["blocksize"]),
            float(state["nested_offset"]) if nested else None,
            int(state.get("nested_blocksize", 256)),
        )
    return found


def companions(weight: Bnb4Weight) -> Tuple[str, ...]:
    """The checkpoint's keys a decoded weight uses besides its own."""
    return _suffix_keys(weight.key)


def decode(
    weight: Bnb4Weight, read: Callable[[str], torch.Tensor], has: Callable[[str], bool]
) -> torch.Tensor:
    """The weight's fp32 values (its logical shape)."""
    numel = 1
    for d in weight.shape:
        numel *= d
    codes = read(weight.key).reshape(-1).contiguous()
    absmax = read(weight.key + ".absmax")
    if weight.nested_offset is not None:
        absmax = nf4.absmax_from_nested(
            absmax,
            read(weight.key + ".nested_quant_map"),
            read(weight.key + ".nested_absmax"),
            weight.nested_offset,
            weight.nested_blocksize,
        )
    absmax = absmax.float().reshape(-1).contiguous()
    if has(weight.key + ".quant_map"):
        qmap = read(weight.key + ".quant_map").float()
        if not torch.equal(qmap, nf4.nf4_levels()):
            raise ValueError(f"infinity: {weight.key!r} has a quant_map that is not NF4's")
    return nf4.dequantize_nf4(codes, absmax, numel, weight.blocksize).view(weight.shape)
