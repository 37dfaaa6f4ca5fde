"""bitsandbytes' serialized 4-bit format, written by ``consolidate(quantize="nf4" | "nf4-dq")``.

Design notes: docs/modules.md, checkpoint/bnb4.py."""

from __future__ import annotations

import json
import math
from typing import Dict, List, Sequence, Tuple

import torch

from ..ops import nf4, nf4_dq

QUANTIZE = ("nf4", "nf4-dq")
_STATE = ".quant_state.bitsandbytes__nf4"
_OFFSET_WIDTH = 26  # room for any fp32 offset's repr in the JSON (padded with spaces)


def check(quantize: object) -> None:
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(
            f"infinity.consolidate: quantize={quantize!r} is not supported; use "
            "'nf4', 'nf4-dq' (bitsandbytes' 4-bit format, double-quantized) or "
            "None (full-width weights)"
        )


def quantized(name: str, shape: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether ``consolidate(quantize=...)`` writes this tensor in NF4."""
    return (
        len(shape) == 2
        and name.endswith(".weight")
        and ".layers." in name
        and "lora_" not in name
        and dtype.is_floating_point
    )


def _state_json(shape: Sequence[int], dtype: torch.dtype, offset: object) -> bytes:
    state = {
        "quant_type": "nf4",
        "blocksize": nf4.DEFAULT_BLOCKSIZE,
        "dtype": str(dtype).replace("torch.", ""),
        "shape": list(shape),
    }
    if offset is not None:
        state.update(
            {
                "nested_blocksize": nf4_dq.NESTED_BLOCKSIZE,
                "nested_dtype": "float32",
                "nested_offset": offset,
            }
        )
    raw = json.dumps(state).encode("utf-8")
    width = (
        len(json.dumps({**state, "nested_offset": 0}).encode("utf-8")) + _OFFSET_WIDTH
        if offset is not None
        else len(raw)
    )
    if len(raw) > width:
        raise ValueError(f"infinity.consolidate: quant state of {len(raw)} bytes (engine bug)")
    return raw + b" " * (width - len(raw))  # JSON allows trailing blanks


def specs(
    name: str, shape: Sequence[int], dtype: torch.dtype, nested: bool
) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """The tensors (name, dtype, shape) that stand for the weight ``name`` in the file."""
    n = math.prod(shape)
    blocks = nf4.num_blocks(n)
    out = [
        (name, torch.uint8, (nf4.packed_nbytes(n), 1)),
        (name + ".absmax", torch.uint8 if nested else torch.float32, (blocks,)),
        (name + ".quant_map", torch.float32, (16,)),
    ]
    if nested:
        out += [
            (name + ".nested_absmax", torch.float32, (-(-blocks // nf4_dq.NESTED_BLOCKSIZE),)),
            (name + ".nested_quant_map", torch.float32, (256,)),
        ]
    out.append(
        (name + _STATE, torch.uint8, (len(_state_json(shape, dtype, 0.0 if nested else None)),))
    )
    return out


def encode(name: str, value: torch.Tensor, nested: bool) -> Dict[str, torch.Tensor]:
    """The tensors of :func:`specs` for the weight ``value`` (its logical shape and dtype)."""
    codes, absmax = nf4.quantize_nf4(value.detach().contiguous())
    out = {name: codes.view(-1, 1), name + ".quant_map": nf4.nf4_levels()}
    offset = None
    if nested:
        q, scales, off = nf4_dq.quantize_absmax(absmax)
        offset = float(off)
        out.update(
            {
                name + ".absmax": q,
                name + ".nested_absmax": scales,
                name + ".nested_quant_map": nf4_dq.dynamic_map(),
            }
        )
    else:
        out[name + ".absmax"] = absmax
    raw = _state_json(tuple(value.shape), value.dtype, offset)
    out[name + _STATE] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def hf_quantization_config(quantize: str, compute_dtype: str) -> Dict[str, object]:
    """``config.json``'s ``quantization_config`` for transformers' bitsandbytes loader."""
    return {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": quantize == "nf4-dq",
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": None,
    }


__all__ = ["QUANTIZE", "check", "quantized", "specs", "encode", "hf_quantization_config"]
