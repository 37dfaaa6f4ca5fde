"""The block-wise quantizers at fill time (csrc/nf4.cpp, csrc/int8_block.cpp,
csrc/quant_pieces.h): every native path (scalar, AVX2, AVX-512, forced with
cpu_capability_override) and the PyTorch fallback give, element by element, the bytes of the
reference definitions below (the quantizers as they were: the NF4 rule of the former scalar
kernel, the int8 PyTorch definition), from fp32, bf16 and fp16 inputs and from pieces with
gaps, on random and adversarial inputs (zeros, -0, subnormals, values on the NF4 midpoints and
on int8 rounding ties, inf, NaN, overflowing scales)."""
from __future__ import annotations

import pytest
import torch

from infinity import ops
from infinity.ops import int8_block, nf4, quant_pieces

CAPS = ops.available_cpu_capabilities() + ["torch"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- the references ----------------------------------------------------------------------
def ref_nf4(x: torch.Tensor, blocksize: int):
    """The NF4 rule in float64-free scalar steps: absmax (canonical NaN if any NaN), inv =
    1/absmax, code = #{fp32 midpoints < x * inv} (NaN or a block with absmax 0/inf/NaN: 7)."""
    x = x.float().reshape(-1)
    n = x.numel()
    lv = nf4.nf4_levels().double()
    mids = ((lv[:-1] + lv[1:]) * 0.5).float()
    nb = nf4.num_blocks(n, blocksize)
    codes = torch.full((nb * blocksize + 1,), 7, dtype=torch.int64)
    absmax = torch.empty(nb, dtype=torch.float32)
    for b in range(nb):
        blk = x[b * blocksize:(b + 1) * blocksize]
        if bool(blk.isnan().any()):
            absmax[b] = float("nan")
        else:
            absmax[b] = blk.abs().max() if blk.numel() else 0.0
        scale = absmax[b]
        ok = bool(scale > 0) and bool(scale.isfinite())
        if ok:
            inv = torch.tensor(1.0, dtype=torch.float32) / scale
            y = blk * inv
            c = (y[:, None] > mids[None, :]).sum(dim=1)
            codes[b * blocksize:b * blocksize + blk.numel()] = torch.where(y.isnan(), 7, c)
    codes = codes[:n]
    if n % 2:
        codes = torch.cat([codes, torch.zeros(1, dtype=torch.int64)])
    pairs = codes.view(-1, 2)
    return (pairs[:, 0] * 16 + pairs[:, 1]).to(torch.uint8), absmax


def ref_int8(x: torch.Tensor, blocksize: int):
    """The int8 PyTorch definition (zero-padded blocks; round half to even; clamp)."""
    x = x.float().reshape(-1)
    n = x.numel()
    nb = int8_block.num_blocks(n, blocksize)
    padded = torch.zeros(nb * blocksize, dtype=torch.float32)
    padded[:n] = x
    blocks = padded.view(nb, blocksize)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = torch.round(blocks * (127.0 / safe)[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1)[:n].contiguous(), absmax


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(got, ref, what):
    for g, r, name in zip(got, ref, ("codes", "absmax")):
        gb, rb = _bits(g), _bits(r)
        if not torch.equal(gb, rb):
            bad = (gb != rb).nonzero()[:5].view(-1).tolist()
            raise AssertionError(f"{what}: {name} differ at bytes {bad}")


# ---- inputs ------------------------------------------------------------------------------
def adversarial(n: int, blocksize: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 6 - 3)
    lv = nf4.nf4_levels().double()
    mids = ((lv[:-1] + lv[1:]) * 0.5).float()
    kind = torch.randint(0, 10, (n,), generator=g)
    pick = torch.randint(0, 15, (n,), generator=g)
    x = torch.where(kind == 0, mids[pick] * 2.0, x)        # exactly on a midpoint (absmax 2)
    x = torch.where(kind == 1, torch.zeros(()), x)
    x = torch.where(kind == 2, -torch.zeros(()), x)
    x = torch.where(kind == 3, torch.randn(n, generator=g) * 1e-40, x)  # subnormal
    x = torch.where(kind == 4, (torch.randint(-127, 128, (n,), generator=g) + 0.5) * (2.0 / 127),
                    x)                                      # int8 ties (absmax 2)
    x[::blocksize] = 2.0                                    # those blocks' absmax
    if n > 6 * blocksize:
        x[blocksize:2 * blocksize] = 0.0                    # all zeros
        x[2 * blocksize:3 * blocksize] = -0.0
        x[3 * blocksize:4 * blocksize] *= 1e-41             # subnormal absmax: 1/absmax = inf
        x[3 * blocksize] = 1e-41
        x[4 * blocksize + 3] = float("nan")
        x[5 * blocksize + 1] = float("inf")
        x[5 * blocksize + 2] = float("-inf")
        x[6 * blocksize:6 * blocksize + 5] = float("nan")
        x[-1] = float("-inf")
    return x


SIZES = [(1, 64), (63, 64), (64, 64), (1001, 64), (4097, 128), (70000, 64), (300001, 64),
         (513, 2), (999, 6)]


@pytest.mark.parametrize("n,blocksize", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nf4_every_path_matches_reference(n, blocksize, dtype):
    for seed in range(2):
        x = adversarial(n, blocksize, seed).to(dtype)
        ref = ref_nf4(x, blocksize)
        for cap in CAPS:
            with ops.cpu_capability_override(cap):
                _same(nf4.quantize_nf4(x, blocksize), ref, f"nf4 {cap} {dtype} n={n} seed={seed}")


@pytest.mark.parametrize("n,blocksize", SIZES + [(70000, 256), (300001, 256), (5, 3)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_every_path_matches_reference(n, blocksize, dtype):
    for seed in range(2):
        x = adversarial(n, blocksize, seed).to(dtype)
        ref = ref_int8(x, blocksize)
        for cap in CAPS:
            with ops.cpu_capability_override(cap):
                _same(int8_block.quantize_int8(x, blocksize), ref,
                      f"int8 {cap} {dtype} n={n} seed={seed}")


def ref_int8_decode(codes: torch.Tensor, absmax: torch.Tensor, n: int, blocksize: int):
    """The int8 decode as PyTorch defines it: code * (absmax * (1.0 / 127.0)) in fp32."""
    scale = (absmax * (1.0 / 127.0)).repeat_interleave(blocksize)[:n]
    return codes.float() * scale


@pytest.mark.parametrize("n,blocksize", [(1, 256), (255, 256), (4097, 256), (300001, 256),
                                         (1001, 5)])
def test_int8_dequantize_every_path_matches_reference(n, blocksize):
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)
    nb = int8_block.num_blocks(n, blocksize)
    absmax = torch.randn(nb, generator=g).abs() * 10 ** (torch.rand(nb, generator=g) * 8 - 4)
    special = [0.0, float("nan"), float("inf"), 1e-42, 3.4e38, 1e-38]
    absmax[:len(special)] = torch.tensor(special)[:nb]
    ref = ref_int8_decode(codes, absmax, n, blocksize)
    for cap in CAPS:
        with ops.cpu_capability_override(cap):
            y = int8_block.dequantize_int8(codes, absmax, n, blocksize)
            yb = int8_block.dequantize_int8(codes, absmax, n, blocksize, dtype=torch.bfloat16)
        assert torch.equal(_bits(y), _bits(ref)), cap
        # bf16: the fp32 product rounded to nearest even; a NaN is the quiet NaN 0x7FC0 (as
        # the NF4 kernel; PyTorch's conversion may keep another NaN's sign and payload)
        nan = ref.isnan()
        assert (nb < 2 or bool(nan.any())) and bool(yb[nan].isnan().all()), cap
        assert bool((yb[nan].view(torch.int16) == 0x7FC0).all()) or cap == "torch", cap
        assert torch.equal(_bits(yb[~nan]), _bits(ref[~nan].bfloat16())), cap


def _random_pieces(seed: int, blocksize: int):
    g = torch.Generator().manual_seed(seed)
    pieces = [(torch.empty(0), blocksize * 3)]               # leading zeros
    for k in range(6):
        valid = int(torch.randint(0, 5000, (1,), generator=g))
        total = nf4.num_blocks(valid, blocksize) * blocksize + blocksize * (k % 2)
        dtype = DTYPES[k % 3] if k != 4 else torch.float64   # float64: widened first
        pieces.append((adversarial(valid, blocksize, seed + k).to(dtype), total))
    last = torch.randn(777, generator=g).bfloat16()
    pieces.append((last, 777 + 31))                          # the last ends mid-block
    return pieces


@pytest.mark.parametrize("seed", [0, 1])
def test_pieces_equal_the_concatenation(seed):
    for fmt, blocksize, quant, ref in (("nf4", 64, nf4.quantize_nf4_pieces, ref_nf4),
                                       ("int8", 256, int8_block.quantize_int8_pieces, ref_int8)):
        pieces = _random_pieces(seed, blocksize)
        expected = ref(quant_pieces.as_fp32(pieces), blocksize)
        for cap in CAPS:
            with ops.cpu_capability_override(cap):
                _same(quant(pieces, blocksize), expected, f"{fmt} pieces {cap}")


def test_forcing_each_capability_runs_that_path():
    x = torch.randn(4096)
    for cap in ops.available_cpu_capabilities():
        calls = [lambda: nf4.nf4_calls("quantize", cap),
                 lambda: int8_block.int8_calls("quantize", cap),
                 lambda: int8_block.int8_calls("dequantize", cap)]
        before = [c() for c in calls]
        with ops.cpu_capability_override(cap):
            nf4.quantize_nf4(x)
            codes, absmax = int8_block.quantize_int8(x)
            int8_block.dequantize_int8(codes, absmax, x.numel())
        assert [c() for c in calls] == [b + 1 for b in before], cap


def test_bad_pieces():
    with pytest.raises(ValueError, match="not a multiple of the blocksize"):
        nf4.quantize_nf4_pieces([(torch.randn(10), 10), (torch.randn(64), 64)])
    with pytest.raises(ValueError, match="total must be an int >= its"):
        int8_block.quantize_int8_pieces([(torch.randn(10), 5)])
    with pytest.raises(TypeError, match=r"\(tensor, total\) tuple"):
        nf4.quantize_nf4_pieces([torch.randn(10)])
    with pytest.raises(ValueError, match="blocksize must be a positive int"):
        int8_block.quantize_int8(torch.randn(10), 0)
    with pytest.raises(ValueError, match="int8_block: codes must be"):
        int8_block.quantize_int8(torch.randn(10), out=(torch.empty(9, dtype=torch.int8),
                                                       torch.empty(1)))
