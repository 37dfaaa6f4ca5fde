"""The 8-bit optimizer-state format, in PyTorch operations (the reference of the native kernels in
csrc/cpu_adam_compact.cpp, and the fallback without them).

Design notes: docs/modules.md, ops/q8_format.py."""

from __future__ import annotations

from typing import Tuple

import torch

BLOCK_SIZE = 256
ONE = 0x3F800000  # bits of 1.0f
SHIFT = 19
ROUND = 1 << 18
TOP = {True: 247.0, False: 63487.0}  # the largest value of a code, in units
TOP_CODE = {True: 127, False: 255}
TOP_BINADE = {True: 7, False: 15}  # exponent of z's top binade
K_MIN, K_MAX = -126, 126
HEADROOM = 2  # binades the delayed rule leaves above the last maximum
_LOW_BYTE = 0xFF


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).contiguous().view(torch.float32)


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape, read flat) zero-padded to whole blocks, as rows of :data:`BLOCK_SIZE`."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(-(-n // BLOCK_SIZE) * BLOCK_SIZE, dtype=x.dtype)
    padded[:n] = flat
    return padded.view(-1, BLOCK_SIZE)


def unit(scale: torch.Tensor) -> torch.Tensor:
    """The blocks' units ``2**k`` (fp32) from their scale fields (the c_max byte masked off;
    +0 for a zero block, inf/NaN for a poisoned one)."""
    return _float(_bits(scale) & ~_LOW_BYTE)


def c_max(scale: torch.Tensor) -> torch.Tensor:
    """The blocks' largest code magnitudes (int64) from their scale fields."""
    return (_bits(scale) & _LOW_BYTE).long()


def magnitude(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """Code magnitudes ``a`` (int64) of uint8 codes."""
    c = codes.long()
    return torch.where(c >= 128, 256 - c, c) if signed else c


def decode(codes: torch.Tensor, units: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of uint8 codes, ``units`` broadcast against them (the fma z*u - u: z*u is
    exact for a power of two u, and so is the difference; inf/NaN units give NaN)."""
    a = magnitude(codes, signed)
    z = _float((a << SHIFT) + ONE)
    value = z * units - units
    if signed:
        value = torch.where(codes.long() >= 128, -value, value)
    return value


def decode_magnitude(a: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """fp32 values (positive) of code magnitudes ``a`` (int64, 0..255) at ``units``."""
    z = _float((a << SHIFT) + ONE)
    return z * units - units


def code_table(signed: bool) -> torch.Tensor:
    """The 256 values of the codes at unit 1 (indexed by the byte)."""
    return decode(torch.arange(256, dtype=torch.uint8), torch.ones(()), signed)


def block_exponent(mx: torch.Tensor, signed: bool, headroom: int) -> torch.Tensor:
    """k (int64) per block for largest magnitudes ``mx`` (fp32, > 0 and finite): the smallest k
    with ``mx * 2**-k <= TOP`` (mx in the top binade), plus ``headroom``, clamped to the normal
    powers of two."""
    _, e = torch.frexp(mx)
    k = e.long() - 1 - TOP_BINADE[signed]
    scaled = mx.double() * torch.pow(2.0, -k.double())  # exact in double
    k = torch.where(scaled > TOP[signed], k + 1, k) + headroom
    return k.clamp(K_MIN, K_MAX)


def encode(x: torch.Tensor, k: torch.Tensor, signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, q int64) of fp32 ``x`` at exponents ``k`` (broadcast per block row): q is
    the unclipped magnitude code (above the top: the value would clip)."""
    inv = torch.pow(2.0, -k.double()).float()
    mag = x.abs() if signed else x
    z = mag * inv + 1.0  # the fma: the product by a power of two is exact (or below 1.0's ulp)
    q = ((_bits(z).long() & 0xFFFFFFFF) + (ROUND - ONE)) >> SHIFT
    a = q.clamp(max=TOP_CODE[signed])
    if signed:
        t = torch.where(torch.signbit(x), -a, a)
        return (t & 0xFF).to(torch.uint8), q
    a = torch.maximum(a, _bits(x).long().clamp(max=1))  # floor: a positive x keeps code 1
    return a.clamp(0, 255).to(torch.uint8), q


def _absmax_bits(blocks: torch.Tensor) -> torch.Tensor:
    """Per row the largest |x| as the fp32 bit order gives it (NaN above inf), as fp32."""
    mag = _bits(blocks).long() & 0x7FFFFFFF
    top = mag.amax(dim=1)
    return _float(torch.where(top > 0x7F800000, torch.full_like(top, 0x7FC00000), top))


def quantize_blocks(blocks: torch.Tensor, signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact rule on fp32 rows of 256: (codes uint8 [rows, 256], scale fields fp32)."""
    mx = _absmax_bits(blocks)
    ok = torch.isfinite(mx) & (mx > 0)
    k = block_exponent(torch.where(ok, mx, torch.ones_like(mx)), signed, 0)
    codes, _ = encode(blocks, k[:, None], signed)
    codes = torch.where(ok[:, None], codes, torch.zeros_like(codes))
    return codes, _scale_fields(k, codes, signed, ok, mx)


def scale_field(k: torch.Tensor, cm: torch.Tensor) -> torch.Tensor:
    """Scale fields (fp32) of exponents ``k`` and largest code magnitudes ``cm``."""
    return _float(((k + 127) << 23) | cm)


def _scale_fields(
    k: torch.Tensor, codes: torch.Tensor, signed: bool, ok: torch.Tensor, special: torch.Tensor
) -> torch.Tensor:
    """bits(2**k) | c_max for the rows where ``ok``, else ``special`` (0, inf or NaN)."""
    return torch.where(ok, scale_field(k, magnitude(codes, signed).amax(dim=1)), special)


def step_codes(
    m: torch.Tensor,
    v: torch.Tensor,
    old_m_scale: torch.Tensor,
    old_v_scale: torch.Tensor,
    delayed_allowed: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's encoding of the new fp32 moments (rows of 256) given the old scale fields:
    the delayed rule where it applies (module docstring), else the exact rule. Returns
    (m codes, m scale fields, v codes, v scale fields)."""
    mc_e, ms_e = quantize_blocks(m, True)
    vc_e, vs_e = quantize_blocks(v, False)
    if not delayed_allowed:
        return mc_e, ms_e, vc_e, vs_e
    um, uv = unit(old_m_scale), unit(old_v_scale)
    cmm, cmv = c_max(old_m_scale), c_max(old_v_scale)
    fast = torch.isfinite(um) & torch.isfinite(uv) & (cmm > 0) & (cmv > 0)
    if not bool(fast.any()):
        return mc_e, ms_e, vc_e, vs_e
    # the blocks' previous largest values, decoded at their old units
    top_m = decode_magnitude(cmm, um)
    top_v = decode_magnitude(cmv, uv)
    safe = torch.ones_like(top_m)
    km = block_exponent(torch.where(fast, top_m, safe), True, HEADROOM)
    kv = block_exponent(torch.where(fast, top_v, safe), False, HEADROOM)
    mc_d, qm = encode(m, km[:, None], True)
    vc_d, qv = encode(v, kv[:, None], False)
    fast &= (qm.amax(dim=1) <= TOP_CODE[True]) & (qv.amax(dim=1) <= TOP_CODE[False])
    ms_d = _scale_fields(km, mc_d, True, fast, ms_e)
    vs_d = _scale_fields(kv, vc_d, False, fast, vs_e)
    col = fast[:, None]
    return (torch.where(col, mc_d, mc_e), ms_d, torch.where(col, vc_d, vc_e), vs_d)
