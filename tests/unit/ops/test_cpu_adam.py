"""CPU Adam/AdamW (infinity.ops.cpu_adam_step): every SIMD path this CPU has, plus the fallback.

Tolerances, stated once:
- against torch.optim.AdamW/Adam(fused=True) with fp32 gradients: |ours - torch| <=
  1e-6*|torch| + 1e-9. The native paths mirror torch's fused CPU kernel operation by operation
  (FMAs included) and agree bitwise over its vector body; torch's own scalar tail and the
  pure-PyTorch fallback (unfused ops) round differently by an ulp here and there.
- against a float64 reference of the same math (one step): |ours - f64| <= 4e-6 * scale + 1e-12,
  where scale is the magnitude of the terms that were summed (|p| + |update| for the param,
  |beta1*m| + |(1-beta1)*g| for exp_avg, |v| for exp_avg_sq): a few fp32 ulps of the inputs,
  so cancellation does not inflate a relative error. After 1,000 steps (parameters of order 1):
  1e-4 relative + 1e-6 absolute (fp32 drift, not an error).
- the working copy ``out`` must equal ``param.to(out.dtype)`` exactly (round to nearest even).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from infinity import _native, ops
from infinity.ops import _adam_native

ROOT = Path(__file__).resolve().parents[3]
NATIVE_CAPS: List[str] = ops.available_cpu_capabilities()
ALL_CAPS: List[str] = NATIVE_CAPS + ["torch"]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]
LENGTHS = [0, 1, 15, 17, 31, 33, 1000, 100003]

RTOL_TORCH, ATOL_TORCH = 1e-6, 1e-9
RTOL_F64, ATOL_F64 = 4e-6, 1e-12


def make_state(n: int, seed: int = 0, grad_dtype: torch.dtype = torch.float32,
               warm: bool = True) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    exp_avg = torch.randn(n, generator=gen) * 0.1 if warm else torch.zeros(n)
    exp_avg_sq = torch.rand(n, generator=gen) * 0.01 if warm else torch.zeros(n)
    return {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def clone_state(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def reference_f64(state: Dict[str, torch.Tensor], *, step: int, lr: float, beta1: float = 0.9,
                  beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                  adamw: bool = True, grad_multiplier: float = 1.0) -> Dict[str, torch.Tensor]:
    """The same update in float64 (inputs taken as their exact fp32 values)."""
    p = state["param"].double()
    g = state["grad"].double() * grad_multiplier
    m = state["exp_avg"].double()
    v = state["exp_avg_sq"].double()
    if weight_decay:
        if adamw:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m_scale = (beta1 * m).abs() + ((1 - beta1) * g).abs()
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    update = (lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps)
    return {"param": p - update, "exp_avg": m, "exp_avg_sq": v,
            "scale": {"param": p.abs() + update.abs(), "exp_avg": m_scale, "exp_avg_sq": v.abs()}}


def run_ours(state: Dict[str, torch.Tensor], cap: str, out: Optional[torch.Tensor] = None,
             **kw) -> None:
    with ops.cpu_capability_override(cap):
        assert ops.cpu_capability() == cap
        ops.cpu_adam_step(state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"],
                          out=out, **kw)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
                 what: str, scale: Optional[torch.Tensor] = None) -> None:
    actual, expected = actual.double(), expected.double()
    err = (actual - expected).abs()
    bound = atol + rtol * (expected.abs() if scale is None else scale.double())
    bad = err > bound
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements out of tolerance, first at {i}: "
                             f"{actual[i].item()!r} vs {expected[i].item()!r}")


@pytest.fixture(autouse=True)
def _restore_threads():
    before = ops.get_num_threads()
    yield
    ops.set_num_threads(before)


# ---- against torch.optim ------------------------------------------------------------------------

@pytest.mark.parametrize("cap", ALL_CAPS)
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("grad_multiplier", [1.0, 0.37])
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # 0.3: torch's lerp takes its weight >= 0.5 branch
def test_matches_torch_optim(cap, adamw, weight_decay, grad_multiplier, beta1):
    n, steps, lr = 1027, 5, 3e-3
    state = make_state(n, seed=1, warm=False)
    ref = torch.nn.Parameter(state["param"].clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=(beta1, 0.999), eps=1e-8, weight_decay=weight_decay,
              fused=True)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=gen)
        ref.grad = grad * grad_multiplier  # torch sees the already scaled gradient
        opt.step()
        state["grad"] = grad
        run_ours(state, cap, step=step, lr=lr, beta1=beta1, weight_decay=weight_decay,
                 adamw=adamw, grad_multiplier=grad_multiplier)
    torch_state = opt.state[ref]
    assert_close(state["param"], ref.detach(), RTOL_TORCH, ATOL_TORCH, "param")
    assert_close(state["exp_avg"], torch_state["exp_avg"], RTOL_TORCH, ATOL_TORCH, "exp_avg")
    assert_close(state["exp_avg_sq"], torch_state["exp_avg_sq"], RTOL_TORCH, ATOL_TORCH,
                 "exp_avg_sq")


# ---- every grad dtype x out dtype x length, against float64 and torch fused ----------------------

@pytest.mark.parametrize("cap", ALL_CAPS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_dtypes_and_lengths(cap, grad_dtype, out_dtype):
    kw = dict(step=7, lr=1e-2, weight_decay=0.01, grad_multiplier=0.5)
    for n in LENGTHS:
        state = make_state(n, seed=n, grad_dtype=grad_dtype)
        expected = reference_f64(state, **kw)
        # torch fused AdamW on the fp32 gradient: the fp32 result we mirror
        ref = torch.nn.Parameter(state["param"].clone())
        opt = torch.optim.AdamW([ref], lr=kw["lr"], weight_decay=kw["weight_decay"], fused=True)
        opt.state[ref] = {"step": torch.tensor(float(kw["step"] - 1)),
                          "exp_avg": state["exp_avg"].clone(),
                          "exp_avg_sq": state["exp_avg_sq"].clone()}
        ref.grad = state["grad"].float() * kw["grad_multiplier"]
        opt.step()
        out = torch.full((n,), 7.0, dtype=out_dtype) if out_dtype is not None else None
        run_ours(state, cap, out=out, **kw)
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert_close(state[key], expected[key], RTOL_F64, ATOL_F64, f"n={n} {key} vs f64",
                         scale=expected["scale"][key])
        assert_close(state["param"], ref.detach(), RTOL_TORCH, ATOL_TORCH, f"n={n} vs torch",
                     scale=expected["scale"]["param"])
        if out is not None:
            assert torch.equal(out, state["param"].to(out_dtype)), f"n={n}: out != param.to()"


@pytest.mark.parametrize("cap", NATIVE_CAPS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16], ids=str)
def test_unaligned_offsets_equal_aligned(cap, grad_dtype, out_dtype):
    """Tensors starting 1..3 elements into a buffer give bitwise the aligned result."""
    n = 1000
    aligned = make_state(n, seed=5, grad_dtype=grad_dtype)
    out_a = torch.empty(n, dtype=out_dtype) if out_dtype else None
    run_ours(aligned, cap, out=out_a, step=3, lr=1e-3, weight_decay=0.1)
    for offsets in [(1, 2, 3, 1, 2), (3, 1, 2, 2, 1), (2, 3, 1, 3, 3)]:
        original = make_state(n, seed=5, grad_dtype=grad_dtype)
        state = {}
        for (key, t), off in zip(original.items(), offsets):
            base = torch.zeros(n + off, dtype=t.dtype)
            base[off:] = t
            state[key] = base[off:]
        out = torch.empty(n + offsets[4], dtype=out_dtype)[offsets[4]:] if out_dtype else None
        run_ours(state, cap, out=out, step=3, lr=1e-3, weight_decay=0.1)
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], aligned[key]), (offsets, key)
        if out is not None:
            assert torch.equal(out, out_a)


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_thousand_steps_bias_correction(cap):
    n, lr = 4099, 1e-3
    state = make_state(n, seed=9, warm=False)
    ref = torch.nn.Parameter(state["param"].clone())
    opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.01, fused=True)
    p64, m64, v64 = state["param"].double(), torch.zeros(n, dtype=torch.float64), \
        torch.zeros(n, dtype=torch.float64)
    gen = torch.Generator().manual_seed(10)
    with ops.cpu_capability_override(cap):
        for step in range(1, 1001):
            grad = torch.randn(n, generator=gen) * 0.01
            ref.grad = grad
            opt.step()
            ops.cpu_adam_step(state["param"], grad, state["exp_avg"], state["exp_avg_sq"],
                              step=step, lr=lr, weight_decay=0.01)
            g = grad.double()
            p64 = p64 * (1 - lr * 0.01)
            m64 = 0.9 * m64 + 0.1 * g
            v64 = 0.999 * v64 + 0.001 * g * g
            p64 = p64 - (lr / (1 - 0.9 ** step)) * m64 / (
                v64.sqrt() / math.sqrt(1 - 0.999 ** step) + 1e-8)
    assert_close(state["param"], ref.detach(), 1e-5, 1e-6, "param vs torch after 1000 steps")
    assert_close(state["param"], p64, 1e-4, 1e-6, "param vs f64 after 1000 steps")
    assert_close(state["exp_avg_sq"], v64, 1e-4, 1e-10, "exp_avg_sq vs f64 after 1000 steps")


# ---- threads, capability selection ---------------------------------------------------------------

@pytest.mark.parametrize("cap", NATIVE_CAPS)
def test_multithread_equals_single_thread_bitwise(cap):
    n = (1 << 20) + 37  # large enough for several chunks and streaming stores of `out`
    results = []
    for threads in (1, 2, 3, 8):
        ops.set_num_threads(threads)
        assert ops.get_num_threads() == threads
        state = make_state(n, seed=11, grad_dtype=torch.bfloat16)
        base = torch.empty(n + 1, dtype=torch.bfloat16)
        out = base[1:]  # unaligned out: exercises the peeled head before the streaming stores
        for key in ("param", "exp_avg", "exp_avg_sq"):
            shifted = torch.empty(n + 1)[1:]
            shifted.copy_(state[key])
            state[key] = shifted
        run_ours(state, cap, out=out, step=4, lr=1e-3, weight_decay=0.01)
        results.append((state, out))
    first_state, first_out = results[0]
    for state, out in results[1:]:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], first_state[key]), key
        assert torch.equal(out, first_out)


@pytest.mark.skipif(not NATIVE_CAPS, reason="native library not built")
def test_forcing_each_capability_runs_that_path():
    lib = _adam_native.native()
    state = make_state(100, seed=3)
    for cap in NATIVE_CAPS:
        code = _adam_native.CAPABILITY_CODES[cap]
        before = {c: lib.inf_adam_calls(k) for c, k in _adam_native.CAPABILITY_CODES.items()}
        with ops.cpu_capability_override(cap):
            assert ops.cpu_capability() == cap
            ops.cpu_adam_step(state["param"], state["grad"], state["exp_avg"],
                              state["exp_avg_sq"], step=1, lr=1e-3)
        after = {c: lib.inf_adam_calls(k) for c, k in _adam_native.CAPABILITY_CODES.items()}
        assert after[cap] == before[cap] + 1
        assert all(after[c] == before[c] for c in after if c != cap)
        assert lib.inf_adam_calls(code) == after[cap]
    with ops.cpu_capability_override("torch"):
        assert ops.cpu_capability() == "torch"
        before = [lib.inf_adam_calls(k) for k in range(3)]
        ops.cpu_adam_step(state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"],
                          step=1, lr=1e-3)
        assert [lib.inf_adam_calls(k) for k in range(3)] == before
    with _native.force_fallback():
        assert ops.cpu_capability() == "torch"


def test_set_cpu_capability_errors():
    with pytest.raises(ValueError, match="unknown cpu capability"):
        ops.set_cpu_capability("sse9")
    with pytest.raises(TypeError, match="must be a str"):
        ops.set_cpu_capability(2)
    with pytest.raises(ValueError, match=">= 1"):
        ops.set_num_threads(0)
    with pytest.raises(TypeError, match="must be an int"):
        ops.set_num_threads(2.0)


def _capability_in_subprocess(value: str) -> subprocess.CompletedProcess:
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from infinity import ops; print(ops.cpu_capability())")
    env = dict(os.environ, INFINITY_CPU_CAPABILITY=value, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.mark.skipif(not NATIVE_CAPS, reason="native library not built")
def test_env_override():
    for cap in NATIVE_CAPS[-1:] + ["torch"]:  # a non-default path, and the fallback
        proc = _capability_in_subprocess(cap)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == cap
    proc = _capability_in_subprocess("sse9")
    assert proc.stdout.strip() == NATIVE_CAPS[0]
    assert "not one of" in proc.stderr


# ---- special values and aliasing ---------------------------------------------------------------

@pytest.mark.parametrize("cap", ALL_CAPS)
def test_nan_and_inf_survive_conversion(cap):
    state = make_state(40, seed=4, grad_dtype=torch.bfloat16)
    state["grad"][3] = float("nan")
    state["param"][5] = float("inf")
    out = torch.empty(40, dtype=torch.bfloat16)
    run_ours(state, cap, out=out, step=2, lr=1e-3)
    assert torch.isnan(state["param"][3]) and torch.isnan(out[3].float())
    assert torch.isinf(out[5].float())
    finite = torch.isfinite(state["param"])
    assert torch.equal(out[finite], state["param"][finite].bfloat16())


@pytest.mark.parametrize("cap", ALL_CAPS)
def test_out_may_be_the_grad_tensor(cap):
    state = make_state(1000, seed=6, grad_dtype=torch.bfloat16)
    expected = clone_state(state)
    run_ours(expected, cap, step=2, lr=1e-3)
    run_ours(state, cap, out=state["grad"], step=2, lr=1e-3)
    assert torch.equal(state["param"], expected["param"])
    assert torch.equal(state["grad"], expected["param"].bfloat16())


def test_zero_length_and_shapes():
    state = {k: v.reshape(10, 10) for k, v in make_state(100, seed=7).items()}
    flat = {k: v.reshape(-1).clone() for k, v in state.items()}
    ops.cpu_adam_step(state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"],
                      step=1, lr=1e-3)
    ops.cpu_adam_step(flat["param"], flat["grad"], flat["exp_avg"], flat["exp_avg_sq"], step=1,
                      lr=1e-3)
    assert torch.equal(state["param"].reshape(-1), flat["param"])
    empty = torch.empty(0)
    ops.cpu_adam_step(empty, empty.clone(), empty.clone(), empty.clone(), step=1, lr=1e-3)


def test_parameter_requiring_grad_is_accepted():
    p = torch.nn.Parameter(torch.randn(50))
    g, m, v = torch.randn(50), torch.zeros(50), torch.zeros(50)
    for cap in ALL_CAPS:
        run_ours({"param": p, "grad": g, "exp_avg": m, "exp_avg_sq": v}, cap, step=1, lr=1e-3)


# ---- bad inputs ---------------------------------------------------------------------------------

def _good():
    state = make_state(64, seed=8)
    return dict(param=state["param"], grad=state["grad"], exp_avg=state["exp_avg"],
                exp_avg_sq=state["exp_avg_sq"], step=1, lr=1e-3)


BAD_INPUTS = [
    ("param", lambda d: torch.randn(64, dtype=torch.float64), TypeError, "param has dtype float64"),
    ("param", lambda d: [0.0] * 64, TypeError, "param must be a torch.Tensor"),
    ("grad", lambda d: torch.randn(64).to(torch.int32), TypeError, "grad has dtype int32"),
    ("exp_avg", lambda d: torch.zeros(64, dtype=torch.bfloat16), TypeError, "exp_avg has dtype"),
    ("exp_avg_sq", lambda d: torch.zeros(65), ValueError, "exp_avg_sq has 65 elements"),
    ("grad", lambda d: torch.randn(128)[::2], ValueError, "grad must be contiguous"),
    ("param", lambda d: torch.randn(8, 8).t(), ValueError, "param must be contiguous"),
    ("grad", lambda d: torch.randn(64, device="meta"), ValueError, "grad must be on the CPU"),
    ("out", lambda d: torch.zeros(64, dtype=torch.int8), TypeError, "out has dtype int8"),
    ("out", lambda d: torch.zeros(63, dtype=torch.bfloat16), ValueError, "out has 63"),
    ("out", lambda d: d["param"], ValueError, "param and out overlap"),
    ("out", lambda d: d["exp_avg"][:64], ValueError, "exp_avg and out overlap"),
    ("exp_avg", lambda d: d["exp_avg_sq"], ValueError, "exp_avg and exp_avg_sq overlap"),
    ("step", lambda d: 0, ValueError, "step must be >= 1"),
    ("step", lambda d: 1.5, TypeError, "step must be an int"),
    ("step", lambda d: True, TypeError, "step must be an int"),
    ("lr", lambda d: "0.001", TypeError, "lr must be a real number"),
    ("lr", lambda d: None, TypeError, "lr must be a real number"),
    ("lr", lambda d: -1e-3, ValueError, "lr must be >= 0"),
    ("lr", lambda d: float("nan"), ValueError, "lr must be finite"),
    ("beta1", lambda d: 1.0, ValueError, "beta1 must be < 1"),
    ("beta2", lambda d: -0.1, ValueError, "beta2 must be >= 0"),
    ("eps", lambda d: float("inf"), ValueError, "eps must be finite"),
    ("weight_decay", lambda d: -0.01, ValueError, "weight_decay must be >= 0"),
    ("grad_multiplier", lambda d: float("nan"), ValueError, "grad_multiplier must be finite"),
    ("adamw", lambda d: "yes", TypeError, "adamw must be a bool"),
]


@pytest.mark.parametrize("cap", ["native", "torch"])
@pytest.mark.parametrize("key,make,exc,message", BAD_INPUTS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_clear_errors(cap, key, make, exc, message):
    if cap == "native" and not NATIVE_CAPS:
        pytest.skip("native library not built")
    kwargs = _good()
    kwargs[key] = make(kwargs)
    before = kwargs["param"].clone() if isinstance(kwargs["param"], torch.Tensor) else None
    with ops.cpu_capability_override(NATIVE_CAPS[0] if cap == "native" else "torch"):
        with pytest.raises(exc, match=message):
            ops.cpu_adam_step(**kwargs)
    if before is not None and kwargs["param"].shape == before.shape \
            and kwargs["param"].dtype == before.dtype and kwargs["param"].device.type == "cpu":
        assert torch.equal(kwargs["param"], before), "a rejected call must not modify param"


# ---- benchmark smoke test -------------------------------------------------------------------------

def test_benchmark_quick_writes_json(tmp_path):
    out = tmp_path / "bench_adam.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_adam.py"), "--quick",
                           "--out", str(out), "--no-plot"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["config"]["quick"] is True
    assert data["results"], "no measurements recorded"
    assert all(r["median_s"] > 0 for r in data["results"])
