"""Block-quantized payloads for ZeRO's compressed collectives: int8 weights on the all-gather,
int8 or int4 gradients on the reduce (all-to-all, summed in fp32), with optional error
feedback.

Design notes: docs/modules.md, runtime/zero/compress.py."""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from ...ops.int8_block import dequantize_int8, quantize_int8
from ...policy import CommPolicy

# per payload: the codes (padded to 4 bytes), then one fp32 absmax per block
_ALIGN = 4


class Codec:
    """One block-quantized format: ``bits`` (8 or 4) per value, one fp32 absmax per
    ``block`` values, symmetric, rounded to nearest. A payload is a uint8 tensor."""

    def __init__(self, bits: int, block: int) -> None:
        if bits not in (8, 4):
            raise ValueError(f"infinity: {bits}-bit codes are not built; use 8 or 4")
        if block <= 0 or block % 2:
            raise ValueError(f"infinity: the quantization block must be even, got {block}")
        self.bits = bits
        self.block = block
        self.levels = 127 if bits == 8 else 7

    def _code_bytes(self, numel: int) -> int:
        raw = numel if self.bits == 8 else (numel + 1) // 2
        return -(-raw // _ALIGN) * _ALIGN

    def payload_bytes(self, numel: int) -> int:
        return self._code_bytes(numel) + 4 * math.ceil(numel / self.block)

    def _split(self, payload: torch.Tensor, numel: int):
        cb = self._code_bytes(numel)
        if payload.numel() != self.payload_bytes(numel) or payload.dtype != torch.uint8:
            raise ValueError(
                f"infinity: a payload of {numel} values is {self.payload_bytes(numel)} uint8 "
                f"bytes, got {payload.numel()} {payload.dtype} (engine bug)"
            )
        return payload[:cb], payload[cb:].view(torch.float32)

    def encode(self, x: torch.Tensor, payload: torch.Tensor) -> None:
        """Quantizes the 1-D float tensor ``x`` into ``payload``."""
        numel = x.numel()
        codes, absmax = self._split(payload, numel)
        if self.bits == 8 and x.device.type == "cpu":  # the native SIMD kernel
            quantize_int8(x, self.block, out=(codes[:numel].view(torch.int8), absmax))
            return
        q, amax = _quantize(x.float(), self.block, self.levels)
        absmax.copy_(amax)
        if self.bits == 8:
            codes[:numel].view(torch.int8).copy_(q)
            return
        u = (q + 8).to(torch.uint8)  # 1..15
        if numel % 2:
            u = torch.cat([u, u.new_full((1,), 8)])
        pairs = u.view(-1, 2)
        codes[: pairs.shape[0]].copy_(pairs[:, 0] | (pairs[:, 1] << 4))

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor) -> None:
        """The values of ``payload`` into the 1-D float tensor ``out`` of ``numel``."""
        codes, absmax = self._split(payload, numel)
        if self.bits == 8:
            if out.device.type == "cpu" and out.dtype in (torch.float32, torch.bfloat16):
                dequantize_int8(codes[:numel].view(torch.int8), absmax, numel, self.block, out=out)
                return
            q = codes[:numel].view(torch.int8).float()
        else:
            packed = codes[: (numel + 1) // 2]
            q = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]
            q = q.to(torch.float32) - 8.0
        out.copy_(_scale(q, absmax, self.block, self.levels))


def _quantize(x: torch.Tensor, block: int, levels: int):
    n = x.numel()
    nb = math.ceil(n / block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    blocks = padded.view(nb, block)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    q = torch.round(blocks * (levels / safe)[:, None]).clamp_(-levels, levels)
    return q.view(-1)[:n].to(torch.int8), absmax


def _scale(q: torch.Tensor, absmax: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    n = q.numel()
    nb = absmax.numel()
    padded = torch.zeros(nb * block, dtype=torch.float32, device=q.device)
    padded[:n] = q
    return (padded.view(nb, block) * (absmax / levels)[:, None]).view(-1)[:n]


class Compression:
    """A partitioner's compressed collectives: the codecs its policy asks for and the error
    feedback residuals (fp32, one per flat buffer, in host RAM: 4 bytes per parameter of the
    whole model on every rank)."""

    def __init__(self, policy: CommPolicy) -> None:
        self.policy = policy
        self.weights: Optional[Codec] = Codec(8, policy.block) if policy.weights == "int8" else None
        self.grads: Optional[Codec] = (
            Codec(8 if policy.grads == "int8" else 4, policy.block)
            if policy.grads != "none"
            else None
        )
        self._residuals: Dict[int, torch.Tensor] = {}

    def residual(self, key: int, numel: int, device: torch.device) -> Optional[torch.Tensor]:
        """The error feedback buffer of flat ``key`` (None without error feedback)."""
        if not self.policy.error_feedback or self.grads is None:
            return None
        r = self._residuals.get(key)
        if r is None:
            r = torch.zeros(numel, dtype=torch.float32, device=device)
            self._residuals[key] = r
        return r

    @property
    def residual_bytes(self) -> int:
        return sum(r.numel() * 4 for r in self._residuals.values())

    def drop_residuals(self) -> None:
        self._residuals.clear()


__all__ = ["Codec", "Compression"]
