"""Block-wise int8 of frozen weights (infinity.ops.int8_block): the format's definition
(code = round(x / absmax * 127), value = code * (absmax / 127)), its error bound, zero and
partial blocks, bf16 output rounded once from the fp32 product, and bad input."""
from __future__ import annotations

import pytest
import torch

from infinity.ops import int8_block as q


@pytest.mark.parametrize("n", [1, 255, 256, 1000, 256 * 40 + 7])
def test_definition_and_error_bound(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    if n >= 256:
        x[:256] = 0.0
    codes, absmax = q.quantize_int8(x)
    assert codes.dtype == torch.int8 and codes.numel() == n
    assert absmax.numel() == q.num_blocks(n)
    scale = absmax.repeat_interleave(256)[:n]
    expected = torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale)) * 127)
    assert torch.equal(codes.float(), expected)
    y = q.dequantize_int8(codes, absmax, n)
    assert torch.equal(y, codes.float() * (absmax * (1.0 / 127.0)).repeat_interleave(256)[:n])
    assert bool(((y - x).abs() <= scale / 254 * (1 + 1e-6) + 1e-12).all())
    yb = q.dequantize_int8(codes, absmax, n, out=torch.empty(n, dtype=torch.bfloat16))
    assert torch.equal(yb, y.bfloat16())
    if n >= 256:
        assert absmax[0].item() == 0.0 and bool((y[:256] == 0).all())


def test_bad_input():
    codes, absmax = q.quantize_int8(torch.randn(512))
    with pytest.raises(ValueError, match="codes must be a contiguous torch.int8"):
        q.dequantize_int8(codes.float(), absmax, 512)
    with pytest.raises(ValueError, match="absmax must be a contiguous torch.float32 tensor of 2"):
        q.dequantize_int8(codes, absmax[:1], 512)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        q.quantize_int8([1.0, 2.0])
