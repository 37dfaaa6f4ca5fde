"""NF4 block-wise quantization (infinity.ops.nf4, csrc/nf4.cpp): every native path (forced with
cpu_capability_override) and the PyTorch fallback agree bitwise; the layout and the values are
bitsandbytes' (its quantize_4bit / dequantize_4bit on this CPU are the reference where it is
installed); bad input gets clear errors."""
from __future__ import annotations

import pytest
import torch

from infinity import ops
from infinity.ops import nf4

CAPS = ops.available_cpu_capabilities() + ["torch"]


def _x(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 3 - 2)
    return x


@pytest.mark.parametrize("n,blocksize", [(1, 64), (63, 64), (64, 64), (1001, 64), (4097, 128),
                                         (70000, 64), (300001, 64), (513, 2)])
def test_paths_agree_and_roundtrip(n, blocksize):
    x = _x(n)
    if n >= blocksize:
        x[:blocksize] = 0.0           # an all-zero block
    results = {}
    for cap in CAPS:
        with ops.cpu_capability_override(cap):
            codes, absmax = nf4.quantize_nf4(x, blocksize)
            y = nf4.dequantize_nf4(codes, absmax, n, blocksize)
            yb = nf4.dequantize_nf4(codes, absmax, n, blocksize, dtype=torch.bfloat16)
        results[cap] = (codes, absmax, y, yb)
    first = results[CAPS[0]]
    for cap, got in results.items():
        for a, b in zip(first, got):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), cap
    codes, absmax, y, yb = first
    assert torch.equal(yb, y.bfloat16())
    # each value is the nearest level times the block's absmax (ties excepted)
    levels = nf4.nf4_levels().double()
    scale = absmax.double().repeat_interleave(blocksize)[:n]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    best = (levels[None, :] - (x.double() / safe)[:, None]).abs().min(dim=1).values
    mine = ((y.double() - x.double()).abs() / safe)
    assert bool((mine <= best + 1e-6).all())
    if n >= blocksize:
        assert absmax[0].item() == 0.0 and bool((y[:blocksize] == 0).all())


def test_packing_order_and_levels():
    x = torch.zeros(64)
    x[0], x[1], x[2] = 1.0, -1.0, 0.5
    codes, absmax = nf4.quantize_nf4(x)
    assert codes[0].item() == 0xF0          # element 0 (code 15) in the high nibble
    assert codes[1].item() >> 4 == 12       # 0.5 -> 0.4407 (code 12; 0.5626 is farther)
    lv = nf4.nf4_levels()
    assert lv.numel() == 16 and bool((lv[1:] > lv[:-1]).all()) and lv[7].item() == 0.0


def test_nan_block_and_odd_lengths():
    x = _x(130)
    x[5] = float("nan")
    for cap in CAPS:
        with ops.cpu_capability_override(cap):
            codes, absmax = nf4.quantize_nf4(x)
            y = nf4.dequantize_nf4(codes, absmax, 130)
        assert bool(absmax[0].isnan()) and bool(absmax[1:].isfinite().all()), cap
        assert bool(y[64:].isfinite().all()), cap


def test_matches_bitsandbytes():
    """Against bitsandbytes on a flat tensor (its blocks are the flat 64-element runs, as ours).
    On a 2-D tensor whose rows are shorter than a block, bitsandbytes 0.50's CPU dequantization
    on an AVX-512 CPU disagrees with its own format from the second block on (its codes and
    absmax do not: they are checked here); so the comparison uses the flat tensor, and every
    path is also checked against the format's definition: level[code] * absmax[block]."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    x = _x(64 * 257 + 32, seed=3)
    try:
        q, state = bnb_f.quantize_4bit(x, blocksize=64, quant_type="nf4")
        ref = bnb_f.dequantize_4bit(q, state)
    except Exception as exc:  # no CPU kernel in this bitsandbytes build
        pytest.skip(f"bitsandbytes NF4 unavailable on this CPU: {exc}")
    n = x.numel()
    assert torch.equal(state.code.float(), nf4.nf4_levels()), "the same 16 levels"
    packed = q.view(-1)
    codes_of = torch.stack([(packed >> 4) & 15, packed & 15], 1).view(-1)[:n].long()
    definition = nf4.nf4_levels()[codes_of] * state.absmax.float().repeat_interleave(64)[:n]
    for cap in CAPS:
        with ops.cpu_capability_override(cap):
            y = nf4.dequantize_nf4(packed, state.absmax.float(), n)
        assert torch.equal(y, definition), f"{cap}: dequantization != level[code] * absmax"
        assert torch.equal(y, ref.float().view(-1)), f"{cap}: dequantization != bitsandbytes"
    q_2d, state_2d = bnb_f.quantize_4bit(x.view(-1, 32), blocksize=64, quant_type="nf4")
    assert torch.equal(q_2d.view(-1), packed) and torch.equal(state_2d.absmax, state.absmax)
    codes, absmax = nf4.quantize_nf4(x)
    assert torch.equal(absmax, state.absmax.float())
    differ = (codes != q.view(-1)).sum().item()
    assert differ <= n // 10000 + 2, f"{differ} bytes differ from bitsandbytes' codes"
    # double quantization: the nested absmax decodes to bitsandbytes' own
    q2, st2 = bnb_f.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    ref2 = bnb_f.dequantize_4bit(q2, st2)
    am = nf4.absmax_from_nested(st2.absmax, st2.state2.code, st2.state2.absmax, st2.offset,
                                st2.state2.blocksize)
    y2 = nf4.dequantize_nf4(q2.view(-1), am, n)
    assert torch.allclose(y2, ref2.float().view(-1), rtol=1e-6, atol=0)


def test_bad_input():
    with pytest.raises(ValueError, match="blocksize"):
        nf4.quantize_nf4(torch.zeros(10), blocksize=63)
    with pytest.raises(ValueError, match="elements"):
        nf4.dequantize_nf4(torch.zeros(4, dtype=torch.uint8), torch.zeros(1), 10)
    with pytest.raises(ValueError, match="dtype must be"):
        nf4.dequantize_nf4(torch.zeros(5, dtype=torch.uint8), torch.zeros(1), 10,
                           dtype=torch.float16)
    with pytest.raises(ValueError, match="uint8"):
        nf4.dequantize_nf4(torch.zeros(5), torch.zeros(1), 10)


def test_forcing_each_capability_runs_that_path():
    x = _x(1000)
    codes, absmax = nf4.quantize_nf4(x)
    for cap in ops.available_cpu_capabilities():
        before = nf4.nf4_calls("dequantize", cap)
        with ops.cpu_capability_override(cap):
            nf4.dequantize_nf4(codes, absmax, 1000)
        assert nf4.nf4_calls("dequantize", cap) == before + 1, cap


def test_bench_nf4_quick(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent.parent.parent
    out = tmp_path / "nf4.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_nf4.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows["fp32"]["vs_copy"] > 0 and rows["bf16"]["vs_copy"] > 0


def test_quantize_into_given_tensors():
    x = _x(1000, seed=7)
    codes, absmax = nf4.quantize_nf4(x)
    out = (torch.full((500,), 0xAB, dtype=torch.uint8), torch.empty(16))
    got = nf4.quantize_nf4(x, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0], codes) and torch.equal(out[1], absmax)
    with pytest.raises(ValueError, match="codes has 499 elements; expected 500"):
        nf4.quantize_nf4(x, out=(out[0][:499], out[1]))
