"""bf16 master weights for Adam(W) (opt-in): stochastic rounding or a Kahan compensation term.

Design notes: docs/modules.md, ops/bf16_master.py."""

from __future__ import annotations

from typing import Optional

import torch

from infinity.ops import _adam_native as _an
from infinity.ops.adam import OUT_DTYPES, _check_tensor, cpu_adam_step
from infinity.ops.adam_compact import BLOCK_SIZE, cpu_adam_step_8bit, cpu_adam_step_bf16_moments
from infinity.ops.cpu import use_torch_fallback

MASTER_FORMATS = ("fp32", "bf16_sr", "bf16_kahan")
"""The master-weight formats of the optimizer (``master=``)."""
MASTER_BYTES = {"fp32": 4, "bf16_sr": 2, "bf16_kahan": 4}
"""Bytes per parameter of the master weights in each format."""
CHUNK = 1 << 20
"""Elements per widen / step / round round trip (a multiple of the 8-bit block size)."""

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B


def check_master(master: object) -> str:
    """Validates the optimizer's ``master=`` argument; returns the format name."""
    if not isinstance(master, str) or master not in MASTER_FORMATS:
        raise ValueError(
            "infinity.optim: master must be 'fp32' (default: fp32 master weights, 4 bytes per "
            "parameter), 'bf16_sr' (bf16 masters with stochastic rounding, 2 B/param) or "
            f"'bf16_kahan' (bf16 masters with a bf16 compensation term, 4 B/param); got "
            f"{master!r}"
        )
    return master


# ---- hash ---------------------------------------------------------------------------------
def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sr_key(seed: int, step: int) -> int:
    """The 64-bit key of one step: splitmix64(seed ^ splitmix64(step))."""
    return _splitmix64((int(seed) & _M64) ^ _splitmix64(int(step) & _M64))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) as int64 without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def sr_hash(seed: int, step: int, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash (int64 tensor) of (seed, step, j) for each global element index j in
    ``index`` (int64, >= 0); stochastic rounding adds its high 16 bits. Same as the kernel's."""
    key = sr_key(seed, step)
    k1, k2 = key & _M32, key >> 32
    j = index.to(torch.int64)
    h = _lowbias32((j & _M32) ^ k1)
    return _lowbias32(h ^ ((j >> 32) & _M32) ^ k2)


# ---- widen / round --------------------------------------------------------------------------
def widen_bf16_master(
    master: torch.Tensor, comp: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp32 value of a bf16 master: ``f32(master)`` (+ ``f32(comp)`` for Kahan), into ``out``
    (fp32, same numel) or a new tensor."""
    master = _check_tensor("master", master, (torch.bfloat16,))
    n = master.numel()
    if comp is not None:
        _same("comp", _check_tensor("comp", comp, (torch.bfloat16,)), n)
    if out is None:
        out = torch.empty(master.shape, dtype=torch.float32)
    _same("out", _check_tensor("out", out, (torch.float32,)), n)
    if n == 0:
        return out
    lib = None if use_torch_fallback() else _lib()
    if lib is None:
        value = master.reshape(-1).float()
        if comp is not None:
            value = value + comp.reshape(-1).float()
        out.view(-1).copy_(value)
        return out
    _check_code(
        lib,
        lib.inf_bf16_master_widen(
            master.data_ptr(), comp.data_ptr() if comp is not None else None, out.data_ptr(), n
        ),
        "bf16 master widen",
    )
    return out


def round_bf16_master(
    param: torch.Tensor,
    master: torch.Tensor,
    comp: Optional[torch.Tensor] = None,
    *,
    seed: int = 0,
    step: int = 0,
    index: int = 0,
    out: Optional[torch.Tensor] = None,
) -> None:
    """Stores fp32 ``param`` as a bf16 master: stochastically rounded into ``master`` (element
    i with :func:`sr_hash` of (seed, step, index + i)) when ``comp`` is None, else as a Kahan
    pair into ``master`` + ``comp``. ``out`` (fp32/bf16/fp16, optional): the working copy,
    written from the stored value."""
    param = _check_tensor("param", param, (torch.float32,))
    n = param.numel()
    _same("master", _check_tensor("master", master, (torch.bfloat16,)), n)
    if comp is not None:
        _same("comp", _check_tensor("comp", comp, (torch.bfloat16,)), n)
    if out is not None:
        _same("out", _check_tensor("out", out, OUT_DTYPES), n)
    for name, v in (("seed", seed), ("step", step), ("index", index)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= 1 << 64:
            raise ValueError(f"{name} must be an int in [0, 2**64), got {v!r}")
    if n == 0:
        return
    lib = None if use_torch_fallback() else _lib()
    if lib is None:
        _torch_round(
            param.view(-1),
            master.view(-1),
            comp.view(-1) if comp is not None else None,
            seed,
            step,
            index,
            out.view(-1) if out is not None else None,
        )
        return
    mode = _an.BF16_MASTER_MODES["kahan" if comp is not None else "sr"]
    od = _an.DTYPE_CODES[out.dtype] if out is not None else _an.DTYPE_NONE
    _check_code(
        lib,
        lib.inf_bf16_master_round(
            param.data_ptr(),
            master.data_ptr(),
            comp.data_ptr() if comp is not None else None,
            mode,
            seed,
            step,
            index,
            out.data_ptr() if out is not None else None,
            od,
            n,
        ),
        "bf16 master round",
    )


@torch.no_grad()
def _torch_round(
    p: torch.Tensor,
    master: torch.Tensor,
    comp: Optional[torch.Tensor],
    seed: int,
    step: int,
    index: int,
    out: Optional[torch.Tensor],
) -> None:
    if comp is None:
        bits = p.view(torch.int32).to(torch.int64) & _M32
        h = sr_hash(seed, step, torch.arange(p.numel(), dtype=torch.int64) + index)
        r = ((bits + (h >> 16)) >> 16) & 0xFFFF
        r = torch.where(torch.isnan(p), torch.full_like(r, 0x7FC0), r)
        master.view(torch.int16).copy_(torch.where(r >= 0x8000, r - 0x10000, r).to(torch.int16))
        value = master.float()
    else:
        _rne(p, master)
        d = p - master.float()
        comp.copy_(torch.where(torch.isfinite(d), d, torch.zeros_like(d)))
        value = master.float() + comp.float()
    if out is not None:
        if out.dtype == torch.bfloat16:
            _rne(value, out)
        else:
            out.copy_(value)


def _rne(x: torch.Tensor, dst: torch.Tensor) -> None:
    """fp32 -> bf16 round to nearest even with NaN -> 0x7FC0 (the kernels' rule; torch keeps
    the NaN's sign and payload bits)."""
    dst.copy_(x)
    nan = torch.isnan(x)
    if bool(nan.any()):
        dst.view(torch.int16)[nan] = 0x7FC0


# ---- the step ---------------------------------------------------------------------------------
def cpu_adam_step_bf16_master(
    master: torch.Tensor,
    comp: Optional[torch.Tensor],
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    states: str = "bf16",
    exp_avg_absmax: Optional[torch.Tensor] = None,
    exp_avg_sq_absmax: Optional[torch.Tensor] = None,
    seed: int = 0,
    index: int = 0,
    out: Optional[torch.Tensor] = None,
    chunk: int = CHUNK,
    **hyper,
) -> None:
    """One Adam(W) step on a bf16 master (``comp`` None: stochastic rounding; else Kahan), in
    place. ``states`` is the moments' format, with the arguments of that kernel: "fp32"
    (:func:`infinity.ops.cpu_adam_step`), "bf16" (:func:`cpu_adam_step_bf16_moments`) or
    "8bit" (:func:`cpu_adam_step_8bit`: ``exp_avg``/``exp_avg_sq`` are the codes, the absmax
    scales given too; blocks start at element 0). ``index``: the global index of element 0 for
    the rounding hash; ``hyper``: step, lr, beta1, ... as :func:`infinity.ops.cpu_adam_step`.
    Per chunk: widen, step the fp32 scratch, round back (writing ``out``)."""
    master = _check_tensor("master", master, (torch.bfloat16,))
    n = master.numel()
    if states not in ("fp32", "bf16", "8bit"):
        raise ValueError(f"states must be 'fp32', 'bf16' or '8bit', got {states!r}")
    if not isinstance(chunk, int) or chunk <= 0 or chunk % BLOCK_SIZE:
        raise ValueError(f"chunk must be a positive multiple of {BLOCK_SIZE}, got {chunk!r}")
    if comp is not None:
        _same("comp", _check_tensor("comp", comp, (torch.bfloat16,)), n)
    step = hyper.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _same(name, _check_tensor(name, t, (t.dtype,) if isinstance(t, torch.Tensor) else ()), n)
    if out is not None:
        _same("out", _check_tensor("out", out, OUT_DTYPES), n)
    if n == 0:
        return
    m, c, g = master.view(-1), comp.view(-1) if comp is not None else None, grad.view(-1)
    ea, es, o = exp_avg.view(-1), exp_avg_sq.view(-1), out.view(-1) if out is not None else None
    scratch = torch.empty(min(chunk, n), dtype=torch.float32)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        p = scratch[: b - a]
        widen_bf16_master(m[a:b], c[a:b] if c is not None else None, p)
        if states == "fp32":
            cpu_adam_step(p, g[a:b], ea[a:b], es[a:b], **hyper)
        elif states == "bf16":
            cpu_adam_step_bf16_moments(p, g[a:b], ea[a:b], es[a:b], **hyper)
        else:
            blk = slice(a // BLOCK_SIZE, -(-b // BLOCK_SIZE))
            cpu_adam_step_8bit(
                p, g[a:b], ea[a:b], exp_avg_absmax[blk], es[a:b], exp_avg_sq_absmax[blk], **hyper
            )
        round_bf16_master(
            p,
            m[a:b],
            c[a:b] if c is not None else None,
            seed=seed,
            step=step,
            index=index + a,
            out=o[a:b] if o is not None else None,
        )


# ---- helpers ----------------------------------------------------------------------------------
def _same(name: str, t: torch.Tensor, n: int) -> None:
    if t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements; expected {n} (as the master)")


def _lib():
    """The native library with the bf16-master kernels, or None (warns once on a stale build)."""
    return _an.kernels_or_warn(_an.native_bf16_master, "bf16-master")


def _check_code(lib, code: int, what: str) -> None:
    if code == -7:
        raise RuntimeError(
            f"native {what} failed: invalid mode / compensation buffer "
            "(Kahan needs comp, stochastic rounding must not have one)"
        )
    if code != 0:
        raise RuntimeError(f"native {what} failed: {_an.strerror(lib, code)} (code {code})")
