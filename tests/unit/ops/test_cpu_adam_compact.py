"""Compact Adam states (infinity.ops.adam_compact): bf16 moments and 8-bit block-wise moments.

Every native path (avx512 / avx2 / scalar, forced with cpu_capability_override) and the
pure-PyTorch fallback ("torch") are checked three ways:
- composition, bitwise: from the same stored state, the compact step equals "decode the moments,
  run the fp32 kernel (ops.cpu_adam_step) on the same path, store the new moments compactly"
  (bf16: ``m32.to(torch.bfloat16)``, round to nearest even; 8-bit: the step's encoding,
  ``q8_format.step_codes``, in PyTorch operations). The 8-bit step's moments are the fp32
  kernel's; its parameter update divides once, with the bias corrections folded into two
  scalars (q8_update_reference, in fp32 tensor operations);
- against a float64 reference of the same algorithm, from the state before each step:
  param within 4e-6 * (|p| + |update|) + 1e-12 (as tests/unit/ops/test_cpu_adam.py); bf16 moments
  equal to the float64 moment rounded to nearest even, except where that moment lies within the
  fp32 error of a rounding midpoint (then one of the two neighbours); 8-bit moments decoded
  within half a code step of the float64 moment (plus its fp32 error);
- the native paths agree with each other bitwise (any thread count).
Sizes are odd (not multiples of 256 nor of the SIMD width), several steps run, with and without
weight decay, Adam and AdamW, every gradient and working-copy dtype.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import pytest
import torch

from infinity import _native, ops
from infinity.ops import _adam_native, adam_compact, q8_format
from infinity.ops.adam import bias_corrections

NATIVE_CAPS: List[str] = ops.available_cpu_capabilities()
ALL_CAPS: List[str] = NATIVE_CAPS + ["torch"]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]
LENGTHS = [1, 17, 255, 257, 1000, 2309]
DECAY = [(0.0, True), (0.05, True), (0.05, False)]  # (weight_decay, adamw)
DECAY_IDS = ["no_wd", "adamw_wd", "adam_wd"]
STEPS = 3
RTOL, ATOL = 4e-6, 1e-12
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, grad_multiplier=0.5)

needs_native = pytest.mark.skipif(not NATIVE_CAPS or _adam_native.native_compact() is None,
                                  reason="native library (with the compact kernels) not built")


@pytest.fixture(autouse=True)
def _threads():
    """Restores our thread count; torch runs single-threaded on these small tensors (its
    thread-pool wake-ups cost more than the work, e.g. in the fallback's searchsorted)."""
    before, torch_before = ops.get_num_threads(), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    ops.set_num_threads(before)
    torch.set_num_threads(torch_before)


def step_cases():
    """Every path (the fallback too) x grad dtype x out dtype x decay mode."""
    cases = []
    for cap in ALL_CAPS:
        for grad_dtype in GRAD_DTYPES:
            for out_dtype in OUT_DTYPES:
                for (weight_decay, adamw), name in zip(DECAY, DECAY_IDS):
                    cases.append(pytest.param(
                        cap, grad_dtype, out_dtype, weight_decay, adamw,
                        id=f"{cap}-{str(grad_dtype)[6:]}-{str(out_dtype)[6:] or 'none'}-{name}"))
    return cases


def grads(n: int, seed: int, dtype: torch.dtype, steps: int = STEPS) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes spread over decades, so the 8-bit maps' small codes are used too
    return [(torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 4 - 3))
            .to(dtype) for _ in range(steps)]


def reference_f64(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                  step: int, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, adamw: bool, grad_multiplier: float) -> Dict:
    """One step in float64 from exact inputs; also the magnitudes of the summed terms."""
    p, g, m, v = param.double(), grad.double() * grad_multiplier, m.double(), v.double()
    if weight_decay:
        if adamw:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m_scale = (beta1 * m).abs() + ((1 - beta1) * g).abs()
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    update = (lr / (1 - beta1 ** step)) * m / (v.sqrt() / math.sqrt(1 - beta2 ** step) + eps)
    return {"param": p - update, "exp_avg": m, "exp_avg_sq": v, "param_scale": p.abs() +
            update.abs(), "exp_avg_scale": m_scale, "exp_avg_sq_scale": v.abs()}


def assert_close(actual, expected, scale, what):
    err = (actual.double() - expected).abs()
    bad = err > ATOL + RTOL * scale
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} out of tolerance, first at {i}: "
                             f"{actual[i].item()!r} vs {expected[i].item()!r}")


def out_tensor(n: int, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    return None if dtype is None else torch.full((n,), 7.0, dtype=dtype)


# ---- bf16 moments --------------------------------------------------------------------------------

def assert_bf16_rounding(stored: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor,
                         what: str) -> None:
    """stored (bf16) is the round-to-nearest-even of some value within the fp32 error
    err = RTOL * scale + ATOL of the float64 moment: RNE is monotone, so stored must lie between
    RNE(exact - err) and RNE(exact + err). Where err is far below a bf16 step (the usual case)
    both bounds are RNE(exact) itself: exact equality, except within err of a rounding tie."""
    err = RTOL * scale + ATOL
    lo = (exact - err).float().bfloat16().double()
    hi = (exact + err).float().bfloat16().double()
    s = stored.double()
    ok = (lo <= s) & (s <= hi)
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise AssertionError(f"{what}: {int((~ok).sum())} bf16 values not the nearest, e.g. "
                             f"{s[i].item()!r} for {exact[i].item()!r} (allowed "
                             f"[{lo[i].item()!r}, {hi[i].item()!r}])")


@pytest.mark.parametrize("cap,grad_dtype,out_dtype,weight_decay,adamw", step_cases())
def test_bf16_moments_steps(cap, grad_dtype, out_dtype, weight_decay, adamw):
    kw = dict(HYPER, weight_decay=weight_decay, adamw=adamw)
    with ops.cpu_capability_override(cap):
        for n in LENGTHS:
            gen = torch.Generator().manual_seed(n)
            param = torch.randn(n, generator=gen)
            m = torch.zeros(n, dtype=torch.bfloat16)
            v = torch.zeros(n, dtype=torch.bfloat16)
            for step, grad in enumerate(grads(n, n + 1, grad_dtype), start=1):
                ref = reference_f64(param, grad, m, v, step=step, **kw)
                # the fp32 kernel on the widened moments, same path
                p32, m32, v32 = param.clone(), m.float(), v.float()
                out32 = out_tensor(n, out_dtype)
                ops.cpu_adam_step(p32, grad, m32, v32, step=step, out=out32, **kw)
                out = out_tensor(n, out_dtype)
                ops.cpu_adam_step_bf16_moments(param, grad, m, v, step=step, out=out, **kw)
                what = f"n={n} step={step}"
                assert torch.equal(param, p32), f"{what}: param != guard + fp32 kernel"
                assert torch.equal(m.view(torch.int16), m32.bfloat16().view(torch.int16)), what
                assert torch.equal(v.view(torch.int16), v32.bfloat16().view(torch.int16)), what
                if out is not None:
                    assert torch.equal(out, out32) and torch.equal(out, param.to(out_dtype))
                assert_close(param, ref["param"], ref["param_scale"], f"{what} param vs f64")
                assert_bf16_rounding(m, ref["exp_avg"], ref["exp_avg_scale"], f"{what} exp_avg")
                assert_bf16_rounding(v, ref["exp_avg_sq"], ref["exp_avg_sq_scale"],
                                     f"{what} exp_avg_sq")


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_bf16_moments_round_to_nearest_even(cap):
    """beta1 = beta2 = 0: the fp32 moments are exactly g and fp32(g*g), so the stored bf16 must be
    their round-to-nearest-even, ties (low 16 bits 0x8000) to even, overflow to inf, NaN to a
    quiet NaN."""
    low = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    high = torch.tensor([0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x4000, 0x0001, 0x7F7F], dtype=torch.int64)
    bits = (high[:, None] * 65536 + low[None, :]).reshape(-1)
    g = bits.to(torch.int32).view(torch.float32)
    g = torch.cat([g, torch.tensor([float("nan"), 0.0, 1e-30])])
    n = g.numel()
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    param = torch.zeros(n)
    with ops.cpu_capability_override(cap):
        ops.cpu_adam_step_bf16_moments(param, g, m, v, step=1, lr=1e-3, beta1=0.0, beta2=0.0)
    ok = ~g.isnan()  # torch's vectorized conversion writes NaN as 0xFFFF, c10 and we as 0x7FC0
    assert torch.equal(m.view(torch.int16)[ok], g.bfloat16().view(torch.int16)[ok])
    assert bool(m[n - 3].isnan()) and bool(v[n - 3].isnan())
    if cap != "torch":
        assert m.view(torch.int16)[n - 3].item() == 0x7FC0  # quiet NaN, as inf_adam_step's out
    # hand-checked ties: 0x3F808000 -> 0x3F80 (even), 0x3F818000 -> 0x3F82 (odd rounds up)
    assert m.view(torch.int16)[2].item() == 0x3F80 and m.view(torch.int16)[7].item() == 0x3F82
    sq = (g.double() * g.double()).float()  # fma(1*g, g, 0): one rounding
    assert torch.equal(v.view(torch.int16)[ok], sq.bfloat16().view(torch.int16)[ok])


# ---- 8-bit moments -------------------------------------------------------------------------------

def _units(scale: torch.Tensor, n: int) -> torch.Tensor:
    return q8_format.unit(scale).double().repeat_interleave(256)[:n]


def check_8bit_moment(codes: torch.Tensor, scale: torch.Tensor, exact: torch.Tensor,
                      err_scale: torch.Tensor, signed: bool, what: str) -> None:
    """Decoded values against the float64 moment: within half a code step (1/32 of the value's
    binade, and the floor's 1/16 of a unit for exp_avg_sq) plus the fp32 error of the moment."""
    deq = ops.dequantize_8bit(codes, scale, signed=signed).double()
    u = _units(scale, exact.numel())
    bound = exact.abs() / 32 + u / 16 + RTOL * err_scale + ATOL
    bad = (deq - exact).abs() > bound
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} values off by more than half a step, "
                             f"e.g. {deq[i].item()!r} for {exact[i].item()!r}")


@pytest.mark.parametrize("cap,grad_dtype,out_dtype,weight_decay,adamw", step_cases())
def test_8bit_moments_steps(cap, grad_dtype, out_dtype, weight_decay, adamw):
    """Each step: the parameter is guard + the 8-bit update of the decoded moments, bitwise; the
    stored state is the step's encoding (q8_format.step_codes) of the fp32 kernel's moments,
    bitwise; the decoded moments are within half a step of the float64 ones."""
    kw = dict(HYPER, weight_decay=weight_decay, adamw=adamw)
    with ops.cpu_capability_override(cap):
        for n in LENGTHS:
            gen = torch.Generator().manual_seed(n)
            param = torch.randn(n, generator=gen)
            state = ops.new_8bit_state(n)
            mq, ma = state["exp_avg_codes"], state["exp_avg_absmax"]
            vq, va = state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"]
            for step, grad in enumerate(grads(n, n + 1, grad_dtype), start=1):
                v32 = ops.dequantize_8bit(vq, va, signed=False)
                bound = ops.moment_bound(step - 1, kw["beta1"], kw["beta2"])
                m32 = ops.guard_moment(ops.dequantize_8bit(mq, ma, signed=True), v32, bound)
                ref = reference_f64(param, grad, m32.double(), v32.double(), step=step, **kw)
                p32 = q8_update_reference(param, grad, m32, v32, step=step, **kw)
                old_ma, old_va = ma.clone(), va.clone()
                out = out_tensor(n, out_dtype)
                ops.cpu_adam_step_8bit(param, grad, mq, ma, vq, va, step=step, out=out, **kw)
                what = f"n={n} step={step}"
                assert torch.equal(param, p32), f"{what}: param != guard + the 8-bit update"
                if out is not None:
                    assert torch.equal(out, param.to(out_dtype))
                ec_m, es_m, ec_v, es_v = q8_format.step_codes(
                    q8_format.rows(m32), q8_format.rows(v32), old_ma, old_va, adamw or weight_decay == 0.0)
                assert torch.equal(mq, ec_m.view(-1)[:n]) and torch.equal(vq, ec_v.view(-1)[:n])
                assert torch.equal(ma.view(torch.int32), es_m.view(torch.int32)), what
                assert torch.equal(va.view(torch.int32), es_v.view(torch.int32)), what
                assert_close(param, ref["param"], ref["param_scale"], f"{what} param vs f64")
                check_8bit_moment(mq, ma, ref["exp_avg"], ref["exp_avg_scale"], True,
                                  f"{what} exp_avg")
                check_8bit_moment(vq, va, ref["exp_avg_sq"], ref["exp_avg_sq_scale"], False,
                                  f"{what} exp_avg_sq")


def q8_update_reference(param: torch.Tensor, grad: torch.Tensor, m32: torch.Tensor,
                        v32: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                        eps: float, weight_decay: float, adamw: bool,
                        grad_multiplier: float) -> torch.Tensor:
    """The 8-bit step's update from fp32 moments, bitwise: the new moments are the fp32 kernel's
    (ops.cpu_adam_step, the same operations; updated in place in m32 and v32), the parameter is
    ``p' - (step * m) / (sqrt(v) + eps')`` in fp32 operations (p' the decayed parameter for
    AdamW, step = lr / bc1 * sqrt(bc2) and eps' = eps * sqrt(bc2) rounded to fp32, the sqrt
    correctly rounded). Returns the new parameter; param is not changed."""
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
              grad_multiplier=grad_multiplier)
    ops.cpu_adam_step(param.clone(), grad, m32, v32, step=step, **kw)
    bc1, bc2_sqrt = bias_corrections(step, beta1, beta2)
    step_size, eps_ = adam_compact.update_scalars_8bit(lr, eps, bc1, bc2_sqrt)
    p = param.clone()
    if weight_decay and adamw:
        p = p * float(torch.tensor(1.0 - lr * weight_decay, dtype=torch.float32))
    denom = v32.double().sqrt().float() + torch.tensor(eps_, dtype=torch.float32)
    return p - (m32 * torch.tensor(step_size, dtype=torch.float32)) / denom


def test_code_tables():
    """The 256 values at unit 1: (z - 1) for z = float bits((a << 19) + bits(1.0)), i.e. 16
    steps per binade of z over 7 (signed, e3m4) or 15 (unsigned, e4m4) binades; the signed byte
    is a two's-complement sign; native and PyTorch tables are equal."""
    for signed in (True, False):
        table = ops.code_table(signed)
        with _native.force_fallback():
            assert torch.equal(ops.code_table(signed), table), "python table != native table"
        mags = torch.arange(128 if signed else 256)
        z = 2.0 ** (mags // 16).double() * (1 + (mags % 16).double() / 16)
        assert torch.equal(table[:len(mags)].double(), z - 1)
        assert bool((table[1:len(mags)] > table[:len(mags) - 1]).all())
        assert table[len(mags) - 1].item() == (247.0 if signed else 63487.0)
        if signed:
            assert torch.equal(table[129:], -table[1:128].flip(0))  # byte 256 - a: -a
    assert q8_format.TOP == {True: 247.0, False: 63487.0}


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_quantize_dequantize(cap):
    """The exact rule: per block the largest magnitude in the top binade, the nearest code
    (half a step), zero and poisoned blocks; every path equals the PyTorch reference bitwise;
    values of the format come back as themselves."""
    gen = torch.Generator().manual_seed(3)
    n = 1000 + 37
    x = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 6 - 4)
    x[256:512] = 0.0                 # an all-zero block: scale 0, codes 0
    x[600] = float("nan")            # poisons its block only
    with ops.cpu_capability_override(cap):
        for signed in (True, False):
            xs = x if signed else x.abs()
            codes, scale = ops.quantize_8bit(xs, signed=signed)
            with ops.cpu_capability_override("torch"):
                tc, ta = ops.quantize_8bit(xs, signed=signed)
            assert torch.equal(codes, tc)
            assert torch.equal(scale.view(torch.int32), ta.view(torch.int32))
            assert scale[1].item() == 0.0 and bool(scale[2].isnan())
            assert bool((codes[256:512] == 0).all()) and bool((codes[512:768] == 0).all())
            y = ops.dequantize_8bit(codes, scale, signed=signed)
            table = ops.code_table(signed)
            expected = table[codes.long()] * q8_format.unit(scale).repeat_interleave(256)[:n]
            assert torch.equal(y[:512], expected[:512]) and torch.equal(y[768:], expected[768:])
            assert bool(y[512:768].isnan().all())
            for b in (0, 3, 4):  # the other blocks: the largest code in the top binade
                sl = slice(256 * b, min(256 * (b + 1), n))
                check_8bit_moment(codes[sl], scale[b:b + 1], xs[sl].double(),
                                  xs[sl].double().abs(), signed, f"block {b}")
                cm = q8_format.c_max(scale[b:b + 1]).item()
                assert cm == int(q8_format.magnitude(codes[sl], signed).max())
                assert cm >= (112 if signed else 240), cm  # z >= 2**7 (2**15)
            # the format's own values come back as their codes at any unit
            own = table.clone()
            if signed:
                own[128] = 0.0  # byte 0x80 (-128) is never written
            for k in (0, -20, 30, -120):
                vals = own * 2.0 ** k
                tc, ta = ops.quantize_8bit(vals, signed=signed)
                assert torch.equal(ops.dequantize_8bit(tc, ta, signed=signed), vals), k


@needs_native
def test_quantize_paths_agree_over_a_dense_sweep_and_tiny_blocks():
    """Every native path gives the PyTorch reference's codes and scale fields for a dense sweep
    of fp32 bit patterns (every binade, every rounding boundary) and for blocks whose largest
    value is subnormal (the exponent clamped at -126)."""
    bits = torch.arange(0x2F000000, 0x4F000000, 4093, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.where(torch.arange(x.numel()) % 2 == 1, -x, x)
    tiny = torch.zeros(256)
    tiny[:4] = torch.tensor([2e-39, -2e-39, 1e-39, 1e-45])
    for signed in (True, False):
        xs, ts = (x, tiny) if signed else (x.abs(), tiny.abs())
        with ops.cpu_capability_override("torch"):
            want = [ops.quantize_8bit(t, signed=signed) for t in (xs, ts)]
        for cap in NATIVE_CAPS:
            with ops.cpu_capability_override(cap):
                for t, (wc, ws) in zip((xs, ts), want):
                    c, sc = ops.quantize_8bit(t, signed=signed)
                    assert torch.equal(c, wc), (cap, signed)
                    assert torch.equal(sc.view(torch.int32), ws.view(torch.int32)), (cap, signed)


@needs_native
@pytest.mark.parametrize("grad_multiplier", [1.0, 0.5])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
@pytest.mark.parametrize("weight_decay,adamw", DECAY, ids=DECAY_IDS)
def test_8bit_step_variants_agree(grad_multiplier, beta1, weight_decay, adamw):
    """The native paths compile the common updates (grad_multiplier 1, beta1 > 0.5; AdamW or no
    decay) separately from the general one: every combination gives the PyTorch reference's
    parameters, codes and scale fields bitwise over several steps, the clip-and-redo and exact
    paths included (a gradient that jumps 1e4x at step 3)."""
    n = 2309
    kw = dict(lr=1e-2, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
              adamw=adamw, grad_multiplier=grad_multiplier)
    gs = grads(n, 11, torch.float32, steps=5)
    gs[2] = gs[2] * 1e4
    results = {}
    for cap in ["torch"] + NATIVE_CAPS:
        with ops.cpu_capability_override(cap):
            param = torch.randn(n, generator=torch.Generator().manual_seed(12))
            state = ops.new_8bit_state(n)
            trace = []
            for step, grad in enumerate(gs, start=1):
                ops.cpu_adam_step_8bit(param, grad, *state.values(), step=step, **kw)
                trace.append([param.clone()] + [t.clone() for t in state.values()])
            results[cap] = trace
    for cap in NATIVE_CAPS:
        for step, (got, want) in enumerate(zip(results[cap], results["torch"]), start=1):
            for a, b in zip(got, want):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (cap, step)


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_8bit_step_reads_every_code(cap):
    """Every code of both moments, in full blocks and in a padded last block, at several units,
    is decoded by the step as code_table[code] * unit: the step equals guard + update, and its
    encoding is the reference's, bitwise."""
    n = 3 * 256 + 100
    codes = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)
    gen = torch.Generator().manual_seed(12)
    grad = torch.randn(n, generator=gen) * 1e-3
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True,
              grad_multiplier=1.0)
    with ops.cpu_capability_override(cap):
        mq, vq = codes.clone(), codes.flip(0).contiguous()
        km, kv = torch.tensor([-2, -9, 2, -20]), torch.tensor([-7, -15, 2, -30])
        ma = q8_format.scale_field(km, q8_format.magnitude(q8_format.rows(mq), True).amax(1))
        va = q8_format.scale_field(kv, q8_format.rows(vq).long().amax(1))
        m32 = ops.dequantize_8bit(mq, ma, signed=True)
        v32 = ops.dequantize_8bit(vq, va, signed=False)
        unit_m = q8_format.unit(ma).repeat_interleave(256)[:n]
        unit_v = q8_format.unit(va).repeat_interleave(256)[:n]
        assert torch.equal(m32, ops.code_table(True)[mq.long()] * unit_m)
        assert torch.equal(v32, ops.code_table(False)[vq.long()] * unit_v)
        bound = ops.moment_bound(4, 0.9, 0.999)
        m32 = ops.guard_moment(m32, v32, bound)
        param = torch.randn(n, generator=gen)
        expected = q8_update_reference(param, grad, m32, v32, step=5, **kw)
        old_ma, old_va = ma.clone(), va.clone()
        ops.cpu_adam_step_8bit(param, grad, mq, ma, vq, va, step=5, **kw)
        assert torch.equal(param, expected)
        ec_m, es_m, ec_v, es_v = q8_format.step_codes(q8_format.rows(m32), q8_format.rows(v32), old_ma, old_va, True)
        assert torch.equal(mq, ec_m.view(-1)[:n]) and torch.equal(vq, ec_v.view(-1)[:n])
        assert torch.equal(ma.view(torch.int32), es_m.view(torch.int32))
        assert torch.equal(va.view(torch.int32), es_v.view(torch.int32))


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_8bit_delayed_exponent_and_the_exact_rule_where_it_would_clip(cap):
    """A block keeps its exponent two binades above its last largest value (the step encodes
    without looking at the new maximum first); a block whose new values would clip at that
    exponent (a gradient 1000x its past) is encoded by the exact rule instead: no value is
    clipped, and the scale field carries the block's largest code."""
    n = 512
    gen = torch.Generator().manual_seed(9)
    param = torch.randn(n, generator=gen)
    state = ops.new_8bit_state(n)
    ma, va = state["exp_avg_absmax"], state["exp_avg_sq_absmax"]
    with ops.cpu_capability_override(cap):
        for step in range(1, 5):
            g = torch.randn(n, generator=gen) * 1e-3
            if step == 4:
                g[256:] *= 1000.0  # block 1 jumps; block 0 stays quiet
            before_m, before_v = ma.clone(), va.clone()
            ops.cpu_adam_step_8bit(param, g, *state.values(), step=step, lr=1e-3)
            if step == 1:  # a zero state: the exact rule
                assert bool((q8_format.c_max(ma) >= 112).all())
                continue
            top_m = q8_format.decode(q8_format.c_max(before_m).to(torch.uint8),
                                     q8_format.unit(before_m), True)
            hinted = q8_format.block_exponent(top_m, True, q8_format.HEADROOM)
            k = q8_format.unit(ma).frexp()[1].long() - 1
            m = ops.dequantize_8bit(state["exp_avg_codes"], ma, signed=True)
            exact_k = q8_format.block_exponent(m.view(2, 256).abs().amax(1), True, 0)
            if step < 4:
                assert torch.equal(k, hinted), step
            else:
                assert k[0].item() == hinted[0].item()
                assert k[1].item() == exact_k[1].item() != hinted[1].item()
            cm = q8_format.magnitude(state["exp_avg_codes"].view(2, 256), True).amax(1)
            assert torch.equal(q8_format.c_max(ma), cm)
            assert int(cm.max()) <= 127


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_8bit_zero_state_and_nonfinite_gradient(cap):
    n = 700
    gen = torch.Generator().manual_seed(5)
    param, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    grad[300] = float("nan")
    state = ops.new_8bit_state(n)
    with ops.cpu_capability_override(cap):
        assert torch.equal(ops.dequantize_8bit(state["exp_avg_codes"], state["exp_avg_absmax"],
                                               signed=True), torch.zeros(n))
        ops.cpu_adam_step_8bit(param, grad, *state.values(), step=1, lr=1e-3)
    assert bool(param[300].isnan()) and int(param.isnan().sum()) == 1
    for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        assert bool(state[key][1].isnan()), "the block holding the NaN is poisoned"
        assert bool(state[key][[0, 2]].isfinite().all()), "the other blocks are not"


# ---- both kernels: paths, threads, aliasing, errors ----------------------------------------------

def _run_kernel(kernel: str, n: int, cap: str, threads: int = 1, out_dtype=torch.bfloat16):
    ops.set_num_threads(threads)
    gen = torch.Generator().manual_seed(21)
    param = torch.randn(n, generator=gen)
    if kernel == "bf16":
        state = [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
        fn = ops.cpu_adam_step_bf16_moments
    else:
        state = list(ops.new_8bit_state(n).values())
        fn = ops.cpu_adam_step_8bit
    out = torch.empty(n, dtype=out_dtype)
    with ops.cpu_capability_override(cap):
        for step, grad in enumerate(grads(n, 22, torch.bfloat16), start=1):
            fn(param, grad, *state, step=step, out=out, lr=1e-2, weight_decay=0.01)
    return [param, out] + state


@needs_native
@pytest.mark.parametrize("kernel", ["bf16", "8bit"])
def test_native_paths_and_threads_agree_bitwise(kernel):
    n = (1 << 17) + 37  # several tasks per thread count
    first = _run_kernel(kernel, n, NATIVE_CAPS[0], threads=1)
    for cap in NATIVE_CAPS:
        for threads in (1, 2, 3):
            got = _run_kernel(kernel, n, cap, threads=threads)
            for a, b in zip(first, got):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (cap, threads)


@needs_native
@pytest.mark.parametrize("kernel", ["bf16", "8bit"])
def test_unaligned_tensors_equal_aligned(kernel):
    """Tensors starting 1..3 elements into their buffers give bitwise the aligned result."""
    n = 1000
    expected = _run_kernel(kernel, n, NATIVE_CAPS[0])
    for cap in NATIVE_CAPS:
        for offset in (1, 2, 3):
            gen = torch.Generator().manual_seed(21)
            param = _shifted(torch.randn(n, generator=gen), offset)
            if kernel == "bf16":
                state = [_shifted(torch.zeros(n, dtype=torch.bfloat16), offset + i)
                         for i in (1, 2)]
                fn = ops.cpu_adam_step_bf16_moments
            else:
                state = [_shifted(t, offset + i)
                         for i, t in enumerate(ops.new_8bit_state(n).values())]
                fn = ops.cpu_adam_step_8bit
            out = _shifted(torch.empty(n, dtype=torch.bfloat16), offset + 2)
            with ops.cpu_capability_override(cap):
                for step, grad in enumerate(grads(n, 22, torch.bfloat16), start=1):
                    fn(param, _shifted(grad, offset), *state, step=step, out=out, lr=1e-2,
                       weight_decay=0.01)
            for a, b in zip(expected, [param, out] + state):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (cap, offset)


def _shifted(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of t that starts ``offset`` elements into a larger buffer."""
    base = torch.zeros(t.numel() + offset, dtype=t.dtype)
    base[offset:] = t
    return base[offset:]


@needs_native
def test_forcing_each_capability_runs_that_path():
    lib = _adam_native.native_compact()
    kernels = _adam_native.COMPACT_KERNELS
    for kernel, code in kernels.items():
        for cap in NATIVE_CAPS:
            before = [lib.inf_adam_compact_calls(code, c) for c in range(3)]
            _run_kernel("bf16" if kernel == "bf16_moments" else "8bit", 100, cap)
            after = [lib.inf_adam_compact_calls(code, c) for c in range(3)]
            k = _adam_native.CAPABILITY_CODES[cap]
            assert after[k] == before[k] + STEPS
            assert all(after[c] == before[c] for c in range(3) if c != k)
        before = [lib.inf_adam_compact_calls(code, c) for c in range(3)]
        _run_kernel("bf16" if kernel == "bf16_moments" else "8bit", 100, "torch")
        assert [lib.inf_adam_compact_calls(code, c) for c in range(3)] == before


def test_fallback_without_native_library_matches():
    """With the library forced off, the fallback gives the native results (to an ulp)."""
    native = {k: _run_kernel(k, 1000, ALL_CAPS[0]) for k in ("bf16", "8bit")}
    with _native.force_fallback():
        assert ops.cpu_capability() == "torch"
        for kernel, expected in native.items():
            got = _run_kernel(kernel, 1000, "torch")
            assert torch.allclose(got[0], expected[0], rtol=1e-5, atol=1e-7), kernel


@pytest.mark.parametrize("cap", ALL_CAPS)
@pytest.mark.parametrize("kernel", ["bf16", "8bit"])
def test_out_may_be_the_grad_tensor(cap, kernel):
    n = 600
    gen = torch.Generator().manual_seed(6)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).bfloat16()
    if kernel == "bf16":
        fn, make = ops.cpu_adam_step_bf16_moments, lambda: [
            torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    else:
        fn, make = ops.cpu_adam_step_8bit, lambda: list(ops.new_8bit_state(n).values())
    expected = param.clone()
    with ops.cpu_capability_override(cap):
        fn(expected, grad, *make(), step=1, lr=1e-3)
        fn(param, grad, *make(), step=1, lr=1e-3, out=grad)
    assert torch.equal(param, expected)
    assert torch.equal(grad, expected.bfloat16())


def _good(kernel: str):
    n = 300
    base = dict(param=torch.randn(n), grad=torch.randn(n), step=1, lr=1e-3)
    if kernel == "bf16":
        base.update(exp_avg=torch.zeros(n, dtype=torch.bfloat16),
                    exp_avg_sq=torch.zeros(n, dtype=torch.bfloat16))
    else:
        base.update(ops.new_8bit_state(n))
    return base


BAD_INPUTS = [
    ("bf16", "exp_avg", lambda d: torch.zeros(300), TypeError, "exp_avg has dtype float32"),
    ("bf16", "exp_avg_sq", lambda d: torch.zeros(301, dtype=torch.bfloat16), ValueError,
     "exp_avg_sq has 301 elements"),
    ("bf16", "exp_avg", lambda d: d["exp_avg_sq"], ValueError, "exp_avg and exp_avg_sq overlap"),
    ("bf16", "grad", lambda d: torch.zeros(300, dtype=torch.float64), TypeError, "grad has dtype"),
    ("bf16", "out", lambda d: d["param"], ValueError, "param and out overlap"),
    ("8bit", "exp_avg_codes", lambda d: torch.zeros(300, dtype=torch.int8), TypeError,
     "exp_avg_codes has dtype int8"),
    ("8bit", "exp_avg_absmax", lambda d: torch.zeros(1), ValueError,
     r"exp_avg_absmax has 1 elements; expected ceil\(300 / 256\) = 2"),
    ("8bit", "exp_avg_sq_absmax", lambda d: torch.zeros(2, dtype=torch.float16), TypeError,
     "exp_avg_sq_absmax has dtype float16"),
    ("8bit", "exp_avg_sq_codes", lambda d: d["exp_avg_codes"], ValueError,
     "exp_avg_codes and exp_avg_sq_codes overlap"),
    ("8bit", "exp_avg_sq_codes", lambda d: torch.zeros(600, dtype=torch.uint8)[::2], ValueError,
     "must be contiguous"),
    ("8bit", "step", lambda d: 0, ValueError, "step must be >= 1"),
    ("8bit", "lr", lambda d: float("nan"), ValueError, "lr must be finite"),
    ("8bit", "adamw", lambda d: 1, TypeError, "adamw must be a bool"),
]


@pytest.mark.parametrize("cap", ["native", "torch"])
@pytest.mark.parametrize("kernel,key,make,exc,message", BAD_INPUTS,
                         ids=[f"{b[0]}-{b[1]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_clear_errors(cap, kernel, key, make, exc, message):
    if cap == "native" and not NATIVE_CAPS:
        pytest.skip("native library not built")
    kwargs = _good(kernel)
    kwargs[key] = make(kwargs)
    before = kwargs["param"].clone()
    fn = ops.cpu_adam_step_bf16_moments if kernel == "bf16" else ops.cpu_adam_step_8bit
    with ops.cpu_capability_override(NATIVE_CAPS[0] if cap == "native" else "torch"):
        with pytest.raises(exc, match=message):
            fn(**kwargs)
    assert torch.equal(kwargs["param"], before), "a rejected call must not modify param"


def test_quantize_bad_inputs():
    with pytest.raises(TypeError, match="signed must be a bool"):
        ops.quantize_8bit(torch.zeros(3), signed=1)
    with pytest.raises(TypeError, match="x has dtype float64"):
        ops.quantize_8bit(torch.zeros(3, dtype=torch.float64), signed=True)
    with pytest.raises(ValueError, match="absmax has 2 elements; expected 1"):
        ops.dequantize_8bit(torch.zeros(3, dtype=torch.uint8), torch.zeros(2), signed=True)
    codes, absmax = ops.quantize_8bit(torch.zeros(0), signed=False)
    assert codes.numel() == 0 and absmax.numel() == 0


# ---- convergence smoke test ----------------------------------------------------------------------

def _train(kind: str, seed: int, steps: int = 300, lr: float = 2e-2) -> float:
    """A teacher-student regression (16 -> 16 tanh -> 1, 2,048 noisy samples), full batch,
    AdamW with cosine learning-rate decay; returns the final training loss."""
    gen = torch.Generator().manual_seed(seed)
    d, h, samples = 16, 16, 2048
    x = torch.randn(samples, d, generator=gen)

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Tanh(), torch.nn.Linear(h, 1))

    teacher, model = mlp(), mlp()
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        y = teacher(x) + 0.3 * torch.randn(samples, 1, generator=gen)
        for p in model.parameters():
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(p.shape[-1]))
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:  # parameters view one flat fp32 master buffer
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    n = flat.numel()
    if kind == "fp32":
        fn, state = ops.cpu_adam_step, [torch.zeros(n), torch.zeros(n)]
    elif kind == "bf16":
        fn, state = ops.cpu_adam_step_bf16_moments, [torch.zeros(n, dtype=torch.bfloat16),
                                                     torch.zeros(n, dtype=torch.bfloat16)]
    else:
        fn, state = ops.cpu_adam_step_8bit, list(ops.new_8bit_state(n).values())
    for step in range(1, steps + 1):
        for p in params:
            p.grad = None
        torch.nn.functional.mse_loss(model(x), y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in params])
        fn(flat, grad, *state, step=step, weight_decay=0.01,
           lr=lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps)))
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


@pytest.mark.parametrize("seed", [0, 1])
def test_convergence_smoke(seed):
    losses = {kind: _train(kind, seed) for kind in ("fp32", "bf16", "8bit")}
    start = _train("fp32", seed, steps=0)
    assert losses["fp32"] < 0.5 * start, losses  # it did learn
    for kind in ("bf16", "8bit"):
        assert abs(losses[kind] / losses["fp32"] - 1) <= 0.02, losses


# ---- the moment guard: quiet elements beside busy ones --------------------------------------------

def _adam_step_bound(step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The largest |update| exact Adam can make at step t (without weight decay):
    lr * K_t * sqrt(1 - beta2^t) / (1 - beta1^t), K_t = ops.moment_bound(t)."""
    return lr * ops.moment_bound(step, beta1, beta2) * math.sqrt(1 - beta2 ** step) / (
        1 - beta1 ** step)


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_8bit_quiet_elements_never_step_beyond_adam(cap):
    """The mechanism of the embedding-row drift, on one block: 4 busy elements with large
    gradients every step, 252 quiet ones that got one small gradient at step 1 and none after.
    Their exp_avg_sq is ~1e-7 of the block's absmax and rounded to 0 while their exp_avg
    (~3e-4 of its absmax) did not: the update was ~lr * m / eps (the quiet elements moved by
    ~100 per step at lr=3e-3). Every element's update must stay within Adam's own bound, and
    within 2 * lr of the fp32 update, at every step."""
    n, lr, wd = 256, 3e-3, 0.0
    gen = torch.Generator().manual_seed(0)
    busy = torch.randn(6, 4, generator=gen)
    first = torch.randn(n - 4, generator=gen) * 3e-4
    p8, p32 = torch.zeros(n), torch.zeros(n)
    state = ops.new_8bit_state(n)
    m, v = torch.zeros(n), torch.zeros(n)
    with ops.cpu_capability_override(cap):
        for step in range(1, 7):
            g = torch.zeros(n)
            g[:4] = busy[step - 1]
            if step == 1:
                g[4:] = first
            before8, before32 = p8.clone(), p32.clone()
            ops.cpu_adam_step_8bit(p8, g, *state.values(), step=step, lr=lr, weight_decay=wd)
            ops.cpu_adam_step(p32, g, m, v, step=step, lr=lr, weight_decay=wd)
            d8, d32 = (p8 - before8).abs(), (p32 - before32)
            bound = _adam_step_bound(step, lr) * (1 + 1e-5)
            assert float(d8.max()) <= bound, (step, float(d8.max()), bound)
            assert float(d32.abs().max()) <= bound, "the bound itself holds for fp32 Adam"
            assert float(((p8 - before8) - d32).abs().max()) <= 2 * lr, step
            mq = ops.dequantize_8bit(state["exp_avg_codes"], state["exp_avg_absmax"], signed=True)
            vq = ops.dequantize_8bit(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"],
                                     signed=False)
            assert not bool(((vq == 0) & (mq != 0)).any()), "a second moment rounded to 0"
        assert float((p8 - p32).abs().max()) <= 2 * 6 * lr


def test_moment_bound_is_adams_bound():
    """K_t bounds |m_t| / sqrt(v_t) of exact Adam (float64) over adversarial gradient runs, and is
    reached by a constant gradient at t = 1 (K_1 = 1)."""
    assert ops.moment_bound(0, 0.9, 0.999) == 0.0
    assert ops.moment_bound(1, 0.9, 0.999) == pytest.approx(1.0 / math.sqrt(0.001) * 0.1)
    gen = torch.Generator().manual_seed(4)
    for beta1, beta2 in ((0.9, 0.999), (0.9, 0.95), (0.0, 0.99), (0.5, 0.9)):
        g = torch.randn(200, 4000, generator=gen, dtype=torch.float64)
        g[:, :1000] = g[:, :1000].sign()  # constant-sign runs are the extreme case
        g[:, 1000:2000] *= torch.linspace(1, 1e-6, 200, dtype=torch.float64)[:, None]
        m = torch.zeros(4000, dtype=torch.float64)
        v = torch.zeros(4000, dtype=torch.float64)
        for t in range(1, 201):
            m = beta1 * m + (1 - beta1) * g[t - 1]
            v = beta2 * v + (1 - beta2) * g[t - 1] ** 2
            ratio = (m.abs() / v.sqrt()).max().item()
            assert ratio <= ops.moment_bound(t, beta1, beta2) * (1 + 1e-9), (beta1, beta2, t)


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_8bit_guard_leaves_reachable_states_alone(cap):
    """A state that exact Adam can reach is not changed by the guard: from fp32 moments that
    satisfy |m| <= K sqrt(v) by a margin, the 8-bit step equals its update run on the same
    dequantized moments without the guard (q8_update_reference)."""
    n = 2309
    gen = torch.Generator().manual_seed(8)
    v = torch.rand(n, generator=gen) * 1e-2
    m = (torch.rand(n, generator=gen) * 2 - 1) * v.sqrt() * 0.5  # K_1 = 3.16 >> 0.5
    with ops.cpu_capability_override(cap):
        mq, ma = ops.quantize_8bit(m, signed=True)
        vq, va = ops.quantize_8bit(v, signed=False)
        m32 = ops.dequantize_8bit(mq, ma, signed=True)
        v32 = ops.dequantize_8bit(vq, va, signed=False)
        assert not bool((m32 * m32 > ops.moment_bound(1, 0.9, 0.999) ** 2 * v32).any())
        p8 = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen)
        p32 = q8_update_reference(p8, g, m32, v32, step=2, lr=1e-2, beta1=0.9, beta2=0.999,
                                  eps=1e-8, weight_decay=0.0, adamw=True, grad_multiplier=1.0)
        ops.cpu_adam_step_8bit(p8, g, mq, ma, vq, va, step=2, lr=1e-2)
    assert torch.equal(p8, p32)


def test_bench_adam_formats_quick_runs(tmp_path):
    """benchmarks/bench_adam_formats.py --quick runs and writes every kernel's row."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent.parent.parent
    out = tmp_path / "formats.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_adam_formats.py"),
                           "--quick", "--no-plot", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert {r["grads"] for r in results} == {"fresh", "constant"}
    for result in results:
        rows = result["kernels"]
        assert set(rows) == {"torch_fused", "fp32", "bf16", "8bit", "rmw", "copy"}
        assert all(r["median_s"] > 0 and r["memory_limit_s"] > 0 for r in rows.values())
        assert rows["fp32"]["speed_vs_fp32_same_rep_median"] == 1.0
        assert rows["8bit"]["bytes_per_param"] < rows["bf16"]["bytes_per_param"] \
            < rows["fp32"]["bytes_per_param"]


_GARBAGE_STATE = r"""
import sys, torch
from infinity import ops
n = 256 * 40 + 13
gen = torch.Generator().manual_seed(31)
results = []
for cap in ops.available_cpu_capabilities():
    param = torch.randn(n, generator=gen.manual_seed(1))
    codes = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for _ in range(2)]
    # scale fields of arbitrary bits: NaN, inf, subnormal, negative, huge, zero
    scales = [torch.randint(-2 ** 31, 2 ** 31 - 1, (ops.adam_compact.num_blocks(n),),
                            dtype=torch.int32, generator=gen).view(torch.float32)
              for _ in range(2)]
    with ops.cpu_capability_override(cap):
        for step in (1, 2, 3):
            ops.cpu_adam_step_8bit(param, torch.randn(n, generator=gen), codes[0], scales[0],
                                   codes[1], scales[1], step=step, lr=1e-3)
    results.append(torch.cat([c.float() for c in codes]))
print(all(torch.equal(r, results[0]) for r in results))
"""


def test_8bit_step_on_a_corrupted_state_does_not_crash():
    """Codes and scale fields of arbitrary bits (a corrupted state the kernels never write):
    every native path steps through them without a crash (in a subprocess) and writes the same
    codes."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _GARBAGE_STATE], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True", proc.stdout
