"""bf16 master-weight kernels (infinity.ops.bf16_master, csrc/cpu_bf16_master.cpp).

Every native path (avx512 / avx2 / scalar, forced with cpu_capability_override) and the
pure-PyTorch fallback ("torch") are checked against references written independently here:
- the hash: numpy uint32/uint64 arithmetic (wrapping) and Python ints;
- stochastic rounding: bits == (bits(p) + (hash >> 16)) >> 16 (NaN -> 0x7FC0), computed with
  numpy from the reference hash: exact equality; in float64 the result is one of the two bf16
  neighbours of p; unbiasedness: the mean of 2**20 roundings of a value equals it within 6
  standard deviations of that mean (ulp * sqrt(f (1 - f) / N)), and so does the fraction
  rounded up;
- Kahan: hi = RNE(p), comp = RNE(p - hi) from float64, and |hi + comp - p| <= 2**-16 |p|;
- widen: the float64 sum rounded to fp32;
- the step: bitwise "widen, fp32 kernel of the same path, round", and within one bf16 ulp of a
  float64 Adam reference;
- every native path agrees bitwise with every other and with the fallback, any thread count,
  any split of the array into calls (given the index offset), across the 2**32 index boundary.
"""
from __future__ import annotations

import math
from typing import List

import numpy as np
import pytest
import torch

from infinity import ops
from infinity.ops import _adam_native
from infinity.ops import bf16_master as bm

NATIVE_CAPS: List[str] = ops.available_cpu_capabilities()
ALL_CAPS: List[str] = NATIVE_CAPS + ["torch"]
LENGTHS = [1, 7, 17, 255, 1000, 2309]
OUT_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]
needs_native = pytest.mark.skipif(_adam_native.native_bf16_master() is None,
                                  reason="native library (with the bf16-master kernels) not built")


@pytest.fixture(autouse=True)
def _threads():
    before, torch_before = ops.get_num_threads(), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    ops.set_num_threads(before)
    torch.set_num_threads(torch_before)


# ---- independent references -------------------------------------------------------------------
def ref_key(seed: int, step: int) -> int:
    m = (1 << 64) - 1

    def sm(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    return sm(seed ^ sm(step))


def ref_hash(seed: int, step: int, j: np.ndarray) -> np.ndarray:
    """numpy uint32 (wrapping multiplies)."""
    key = ref_key(seed, step)
    k1, k2 = np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)

    def lb(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))

    j = j.astype(np.uint64)
    lo, hi = (j & np.uint64(0xFFFFFFFF)).astype(np.uint32), (j >> np.uint64(32)).astype(np.uint32)
    with np.errstate(over="ignore"):
        return lb(lb(lo ^ k1) ^ hi ^ k2)


def ref_sr_bits(p: torch.Tensor, seed: int, step: int, index: int) -> np.ndarray:
    bits = p.numpy().view(np.uint32).astype(np.uint64)
    h = ref_hash(seed, step, np.arange(p.numel(), dtype=np.uint64) + np.uint64(index))
    r = ((bits + (h >> np.uint32(16)).astype(np.uint64)) >> np.uint64(16)).astype(np.uint16)
    r[np.isnan(p.numpy())] = 0x7FC0
    return r


def rne_bits(x: torch.Tensor) -> np.ndarray:
    """fp32 -> bf16 round to nearest even in numpy (NaN -> 0x7FC0)."""
    u = x.numpy().view(np.uint32).astype(np.uint64)
    r = ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))
    r = r.astype(np.uint16)
    r[np.isnan(x.numpy())] = 0x7FC0
    return r


def bf16_of_bits(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(b.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16)


def values(n: int, seed: int, special: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 8 - 4)
    if special and n >= 8:
        p[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.39e38, -3.39e38, 0.0])
    return p


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16).copy()


# ---- hash ------------------------------------------------------------------------------------
@needs_native
def test_hash_matches_references():
    lib = _adam_native.native_bf16_master()
    idx = np.array([0, 1, 2, 255, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 12345, 2**62 + 3],
                   dtype=np.uint64)
    for seed, step in ((0, 1), (1, 1), (12345, 987654), (2**64 - 1, 2**63)):
        ref = ref_hash(seed, step, idx).astype(np.int64)
        torch_h = bm.sr_hash(seed, step, torch.from_numpy(idx.astype(np.int64))).numpy()
        native = np.array([lib.inf_sr_hash(seed, step, int(j)) for j in idx], dtype=np.int64)
        np.testing.assert_array_equal(torch_h, ref)
        np.testing.assert_array_equal(native, ref)
    # different steps / seeds / indices give different bits
    h = ref_hash(0, 1, np.arange(4096, dtype=np.uint64))
    assert len(np.unique(h)) > 4090
    assert (ref_hash(0, 2, np.arange(64, dtype=np.uint64)) != h[:64]).mean() > 0.9
    assert (ref_hash(1, 1, np.arange(64, dtype=np.uint64)) != h[:64]).mean() > 0.9


# ---- stochastic rounding ---------------------------------------------------------------------
@pytest.mark.parametrize("cap", ALL_CAPS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: str(d)[6:] if d else "none")
def test_sr_round_exact_bits(cap, out_dtype):
    for n in LENGTHS:
        for index in (0, 3, 2**32 - 9, 7 << 40):
            p = values(n, seed=n + index % 1000)
            m = torch.empty(n, dtype=torch.bfloat16)
            out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
            with ops.cpu_capability_override(cap):
                bm.round_bf16_master(p, m, seed=42, step=5, index=index, out=out)
            ref = ref_sr_bits(p, 42, 5, index)
            np.testing.assert_array_equal(bits16(m), ref, err_msg=f"{cap} n={n} index={index}")
            if out is not None:
                value = bf16_of_bits(ref).float()
                if out_dtype == torch.bfloat16:
                    np.testing.assert_array_equal(bits16(out), ref)
                else:
                    torch.testing.assert_close(out, value.to(out_dtype), rtol=0, atol=0,
                                               equal_nan=True)


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_sr_result_is_a_bf16_neighbour(cap):
    n = 5000
    p = values(n, seed=3, special=False)
    m = torch.empty(n, dtype=torch.bfloat16)
    with ops.cpu_capability_override(cap):
        bm.round_bf16_master(p, m, seed=1, step=1)
    x = p.double()
    r = m.double()
    down = bf16_of_bits((p.numpy().view(np.uint32) >> 16).astype(np.uint16)).double()  # toward 0
    up = bf16_of_bits(((p.numpy().view(np.uint32) >> 16) + 1).astype(np.uint16)).double()
    assert bool(((r == down) | (r == up)).all())
    assert bool(((x - r).abs() <= (up - down).abs()).all())
    exact = x == down
    assert bool((r[exact] == x[exact]).all())  # representable values never move


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_sr_unbiased(cap):
    """Mean of N roundings (one per element index) of a value ~ the value; the fraction
    rounded up ~ the value's position between its neighbours."""
    n = 1 << 20
    gen = torch.Generator().manual_seed(7)
    for base, frac in ((1.0, 0.3), (-3.0, 0.77), (1e-20, 0.5), (12345.0, 0.01)):
        lo = torch.tensor([base], dtype=torch.float32).bfloat16().float()
        ulp = 2.0 ** (math.floor(math.log2(abs(float(lo)))) - 7)  # bf16: 8 significant bits
        x = float(lo) + math.copysign(frac * ulp, float(lo))
        p = torch.full((n,), x, dtype=torch.float32)
        f = abs(float(p[0]) - float(lo)) / ulp  # the fp32 value's exact position
        m = torch.empty(n, dtype=torch.bfloat16)
        with ops.cpu_capability_override(cap):
            bm.round_bf16_master(p, m, seed=int(torch.randint(0, 2**31, (1,), generator=gen)),
                                 step=3)
        r = m.double()
        sigma = ulp * math.sqrt(f * (1 - f) / n)
        assert abs(float(r.mean()) - float(p[0])) <= 6 * sigma + 1e-30, (base, frac)
        up = float((r.abs() > abs(float(lo))).double().mean())
        assert abs(up - f) <= 6 * math.sqrt(f * (1 - f) / n), (base, frac, up, f)
    # over steps: one element rounded at 4096 steps
    p = torch.full((16,), 1.0 + 0.25 * 2**-7, dtype=torch.float32)
    acc = torch.zeros(16, dtype=torch.float64)
    m = torch.empty(16, dtype=torch.bfloat16)
    with ops.cpu_capability_override(cap):
        for step in range(1, 4097):
            bm.round_bf16_master(p, m, seed=9, step=step)
            acc += m.double()
    mean = acc / 4096
    sigma = 2**-7 * math.sqrt(0.25 * 0.75 / 4096)
    assert bool(((mean - float(p[0])).abs() <= 6 * sigma).all())


# ---- Kahan -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", ALL_CAPS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: str(d)[6:] if d else "none")
def test_kahan_round_against_float64(cap, out_dtype):
    for n in LENGTHS:
        p = values(n, seed=100 + n)
        m = torch.empty(n, dtype=torch.bfloat16)
        c = torch.empty(n, dtype=torch.bfloat16)
        out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
        with ops.cpu_capability_override(cap):
            bm.round_bf16_master(p, m, c, out=out)
        hi_ref = rne_bits(p)
        np.testing.assert_array_equal(bits16(m), hi_ref)
        d64 = p.double() - bf16_of_bits(hi_ref).double()  # exact (Sterbenz)
        finite = torch.isfinite(d64)
        d32 = torch.where(finite, d64, torch.zeros_like(d64)).float()
        assert bool((d32.double() == torch.where(finite, d64, torch.zeros_like(d64))).all())
        np.testing.assert_array_equal(bits16(c), rne_bits(d32))
        value = m.double() + c.double()
        ok = torch.isfinite(p) & (p.abs() < 3e38)
        err = (value - p.double()).abs()[ok]
        assert bool((err <= p.double().abs()[ok] * 2**-16).all())
        if out is not None:
            expect = (m.float() + c.float()).to(out_dtype)
            if out_dtype == torch.bfloat16:
                np.testing.assert_array_equal(bits16(out), rne_bits(m.float() + c.float()))
            else:
                torch.testing.assert_close(out, expect, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_widen(cap):
    for n in LENGTHS:
        p = values(n, seed=n, special=False)
        m = torch.empty(n, dtype=torch.bfloat16)
        c = torch.empty(n, dtype=torch.bfloat16)
        bm._torch_round(p, m, c, 0, 0, 0, None)
        with ops.cpu_capability_override(cap):
            w = bm.widen_bf16_master(m, c)
            w1 = bm.widen_bf16_master(m)
        assert torch.equal(w, (m.double() + c.double()).float())
        assert torch.equal(w1, m.float())


# ---- paths agree: ISA, threads, splits -------------------------------------------------------
@needs_native
def test_paths_threads_and_splits_agree():
    n = 300_001  # several tasks at 2 threads
    p = values(n, seed=5)
    index = (3 << 40) + 2**32 - 150_000  # crosses a 2**32 boundary of the low word
    results = {}
    for cap in ALL_CAPS:
        for threads in (1, 2):
            ops.set_num_threads(threads)
            for kahan in (False, True):
                m = torch.empty(n, dtype=torch.bfloat16)
                c = torch.empty(n, dtype=torch.bfloat16) if kahan else None
                o = torch.empty(n, dtype=torch.float16)
                with ops.cpu_capability_override(cap):
                    bm.round_bf16_master(p, m, c, seed=77, step=1234, index=index, out=o)
                results[(cap, threads, kahan)] = (bits16(m), bits16(c) if kahan else None,
                                                  bits16(o))
    ref = ref_sr_bits(p, 77, 1234, index)
    for (cap, threads, kahan), (m, c, o) in results.items():
        base = results[("scalar", 1, kahan)]
        np.testing.assert_array_equal(m, base[0], err_msg=f"{cap} {threads}")
        np.testing.assert_array_equal(o, base[2], err_msg=f"{cap} {threads}")
        if kahan:
            np.testing.assert_array_equal(c, base[1])
        else:
            np.testing.assert_array_equal(m, ref)
    # split into two calls with the index offset: the same bits
    m = torch.empty(n, dtype=torch.bfloat16)
    cut = 123_457
    bm.round_bf16_master(p[:cut], m[:cut], seed=77, step=1234, index=index)
    bm.round_bf16_master(p[cut:], m[cut:], seed=77, step=1234, index=index + cut)
    np.testing.assert_array_equal(bits16(m), ref)


@needs_native
def test_call_counters_follow_the_forced_path():
    lib = _adam_native.native_bf16_master()
    p = values(100, seed=1)
    m = torch.empty(100, dtype=torch.bfloat16)
    for cap in NATIVE_CAPS:
        code = _adam_native.CAPABILITY_CODES[cap]
        before = [lib.inf_bf16_master_calls(k, code) for k in (0, 1)]
        with ops.cpu_capability_override(cap):
            bm.round_bf16_master(p, m)
            bm.widen_bf16_master(m)
        assert [lib.inf_bf16_master_calls(k, code) for k in (0, 1)] == [b + 1 for b in before]


# ---- the step ----------------------------------------------------------------------------------
def adam_f64(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, grad_multiplier):
    g = g.double() * grad_multiplier
    p = p.double() * (1 - lr * weight_decay)
    m = m.double() + (1 - beta1) * (g - m.double())
    v = v.double() * beta2 + (1 - beta2) * g * g
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)) + eps
    return p - (lr / (1 - beta1 ** step)) * m / denom


@pytest.mark.parametrize("cap", ALL_CAPS)
@pytest.mark.parametrize("states", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("master", ["bf16_sr", "bf16_kahan"])
def test_step_composition_and_float64(cap, states, master):
    n = 2309
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                 grad_multiplier=0.5)
    p0 = values(n, seed=11, special=False)
    m = p0.bfloat16()
    c = torch.zeros(n, dtype=torch.bfloat16) if master == "bf16_kahan" else None
    if states == "8bit":
        st = ops.new_8bit_state(n)
        ea, es = st["exp_avg_codes"], st["exp_avg_sq_codes"]
        extra = dict(exp_avg_absmax=st["exp_avg_absmax"],
                     exp_avg_sq_absmax=st["exp_avg_sq_absmax"])
    else:
        dt = torch.float32 if states == "fp32" else torch.bfloat16
        ea, es, extra = torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt), {}
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen)
        # composition, on the same path: widen, the moment kernel, round
        before = [t.clone() for t in (m, ea, es)] + ([c.clone()] if c is not None else [])
        before_extra = {k: v.clone() for k, v in extra.items()}
        with ops.cpu_capability_override(cap):
            x = bm.widen_bf16_master(before[0], c.clone() if c is not None else None)
            m_mom = moments_fp32(states, before[1], before[2], before_extra, n, step)
            r_ea, r_es = before[1].clone(), before[2].clone()
            r_extra = {k: v.clone() for k, v in before_extra.items()}
            kernel_step(states, x, g, r_ea, r_es, r_extra, step=step, **hyper)
            r_m = torch.empty(n, dtype=torch.bfloat16)
            r_c = torch.empty(n, dtype=torch.bfloat16) if c is not None else None
            bm.round_bf16_master(x, r_m, r_c, seed=5, step=step, index=1 << 40)
            out = torch.empty(n, dtype=torch.bfloat16)
            bm.cpu_adam_step_bf16_master(m, c, g, ea, es, states=states, seed=5,
                                         index=1 << 40, out=out, chunk=512, step=step,
                                         **extra, **hyper)
        assert torch.equal(m.view(torch.int16), r_m.view(torch.int16))
        if c is not None:
            assert torch.equal(c.view(torch.int16), r_c.view(torch.int16))
        assert torch.equal(ea.view(torch.uint8), r_ea.view(torch.uint8))
        assert torch.equal(es.view(torch.uint8), r_es.view(torch.uint8))
        value = bm.widen_bf16_master(m, c)
        assert torch.equal(out.view(torch.int16),
                           torch.from_numpy(rne_bits(value).view(np.int16)))
        # float64: the fp32 value before rounding is the f64 Adam update (fp32 error); the stored
        # master is one bf16 ulp (SR) or 2**-16 relative (Kahan) from it
        x0 = bm.widen_bf16_master(before[0], before[3] if c is not None else None).double()
        p64 = adam_f64(x0, g, m_mom[0], m_mom[1], step=step, **hyper)
        # as tests/unit/ops/test_cpu_adam.py
        fp32_err = 4e-6 * (x0.abs() + (p64 - x0).abs()) + 1e-12
        tol = p64.abs() * (2**-7 if master == "bf16_sr" else 2**-15) + fp32_err
        assert bool(((value.double() - p64).abs() <= tol).all())


def moments_fp32(states, ea, es, extra, n, step):
    """The moments the step starts from (8-bit: dequantized, exp_avg through the guard)."""
    if states == "8bit":
        v = ops.dequantize_8bit(es, extra["exp_avg_sq_absmax"], signed=False)
        m = ops.dequantize_8bit(ea, extra["exp_avg_absmax"], signed=True)
        return ops.guard_moment(m, v, ops.moment_bound(step - 1, 0.9, 0.999)), v
    return ea.float(), es.float()


def kernel_step(states, x, g, ea, es, extra, **hyper):
    if states == "fp32":
        ops.cpu_adam_step(x, g, ea, es, **hyper)
    elif states == "bf16":
        ops.cpu_adam_step_bf16_moments(x, g, ea, es, **hyper)
    else:
        ops.cpu_adam_step_8bit(x, g, ea, extra["exp_avg_absmax"], es,
                               extra["exp_avg_sq_absmax"], **hyper)


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_input_raises():
    p = torch.zeros(10)
    m = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError)):
        bm.round_bf16_master(p, torch.zeros(10))  # fp32 master
    with pytest.raises(ValueError, match="elements"):
        bm.round_bf16_master(p, torch.zeros(9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="seed"):
        bm.round_bf16_master(p, m, seed=-1)
    with pytest.raises(ValueError, match="master must be"):
        bm.check_master("bf16")
    with pytest.raises(ValueError, match="chunk"):
        bm.cpu_adam_step_bf16_master(m, None, p, m.clone(), m.clone(), states="bf16", chunk=100,
                                     step=1, lr=1e-3)
    with pytest.raises(ValueError, match="states"):
        bm.cpu_adam_step_bf16_master(m, None, p, m.clone(), m.clone(), states="int4", step=1,
                                     lr=1e-3)
