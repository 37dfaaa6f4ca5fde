"""Filling quantized homes at wrap (runtime/homes/quantized.py): each segment is quantized straight
from the parameters as pieces (their own dtype, zeros in the gaps between parameters). The
stored bytes equal those of quantizing the gathered fp32 flat (gaps and padding zero) segment by
segment, for NF4 and int8, bf16 and fp32 parameters, several segments, odd-sized parameters."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from infinity.runtime.engine import engine_of
from infinity.runtime.homes.home import _gather_range
from infinity.runtime.homes.quantized import QuantFlat


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(701, 1023)        # 717,123 + 1,023: odd sizes, gaps, 2+ segments
        self.b = nn.Linear(1023, 5, bias=False)
        self.norm = nn.LayerNorm(1023)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(2)])
        self.head = nn.Linear(5, 701)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.head(layer(x))
        return x


@pytest.mark.parametrize("fmt", ["nf4", "nf4-dq", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_stored_bytes_equal_the_gathered_flat_quantized(fmt, dtype, tmp_path):
    torch.manual_seed(0)
    model = _Model().to(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))
    with torch.no_grad():
        model.layers[0].a.weight[3, :64] = 0.0            # a zero block
        model.layers[1].a.weight[7, 9] = float("nan")     # a NaN block (stored as the rule has it)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="host", frozen_format=fmt)
    flats = [f for b in engine_of(model).blocks for f in b.flats if isinstance(f, QuantFlat)]
    assert flats and any(f.numel > f.fmt.segment_elems for f in flats)  # 2 segments
    params = dict(model.named_parameters())
    checked = 0
    for flat in flats:
        by_id = {id(p): n for n, p in params.items()}
        for s in flat.slots:  # the wrapped parameters view placeholders: restore originals
            s.param.data = originals[by_id[id(s.param)]]
        expected = torch.zeros_like(flat.home)
        values = torch.empty(flat.numel, dtype=torch.float32)
        _gather_range(flat, values, 0, flat.numel)
        for _, start, count, offset in flat.fmt.segments(flat.numel):
            flat.fmt.quantize_segment(values[start:start + count],
                                      expected[offset:offset + flat.fmt.raw_nbytes(count)])
        assert torch.equal(flat.home, expected), flat.key
        checked += 1
    assert checked == len(flats)
