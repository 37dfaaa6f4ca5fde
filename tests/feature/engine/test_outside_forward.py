"""A wrapped model stays a PyTorch module outside forward.

Between steps every parameter of a wrapped model must read as its current value on every tier
(host: a view of its host home copy; NVMe: a view of a shared memory map of its swap file;
device, which is the CPU here: the resident buffer), and writes made through the parameters
under ``no_grad`` (``mul_``, ``copy_``, ``load_state_dict``, an EMA copied back, torch
optimizers, ``p.data = t``) must reach the home, be seen by the next forward and by
``infinity.optim``'s fp32 master weights.

Each (tier, operation) case runs in its own subprocess: reading a released buffer segfaults on
the CPU, and a segfault must fail only its own case. Every case first trains two steps with
``infinity.optim.AdamW`` (and the reference, an unwrapped copy, with
``torch.optim.AdamW(fused=True)``), so blocks have been fetched, released and prefetched again
before the operation. All comparisons are exact (``torch.equal``): the engine computes in the
same order as the reference. The ``host_bf16`` tier (``compute_dtype=torch.bfloat16``: fp32
homes, bf16 compute buffers, so host blocks are not resident) is compared with a reference that
does the same thing in plain PyTorch: forward/backward on a bf16 copy of the fp32 model, the
bf16 gradients accumulated in fp32, fused AdamW on the fp32 weights.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Tuple

import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TIERS = ["host", "nvme", "device", "host_bf16"]
OPS = ["read", "write", "state_dict", "ema", "deepcopy", "torch_optim", "materialized"]

# Runs in a fresh interpreter: argv = [tier, op, tmpdir]. Prints "CASE OK" at the end.
CHILD = r'''
import copy, io, os, sys
import torch
import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.runtime.engine import engine_of

torch.set_num_threads(1)
TIER, OP, TMP = sys.argv[1], sys.argv[2], sys.argv[3]
CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)
BF16 = TIER == "host_bf16"
CDT = torch.bfloat16 if BF16 else torch.float32
LR = 1e-2

WRAP = {
    "host": dict(param_tier="host", grad_tier="host", optimizer_tier="host"),
    "nvme": dict(nvme_path=TMP, param_tier="nvme", optimizer_tier="nvme",
                 grad_tier="host" if OP == "torch_optim" else "nvme"),
    "device": dict(param_tier="device", grad_tier="host", optimizer_tier="host"),
    "host_bf16": dict(param_tier="host", grad_tier="host", optimizer_tier="host",
                      compute_dtype=torch.bfloat16),
}[TIER]

torch.manual_seed(0)
ref = TinyGPT(CFG)
model = copy.deepcopy(ref)
infinity.wrap(model, **WRAP)
gen = torch.Generator().manual_seed(1)
BATCHES = [synthetic_batch(CFG, 2, 8, gen) for _ in range(12)]


def check_equal(got, want, what):
    got, want = got.detach(), want.detach()
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        diff = ((got.double() - want.double()).abs().max().item()
                if got.shape == want.shape else "shape")
        raise AssertionError(f"{TIER}/{OP}: {what} differs from the reference: got "
                             f"{got.dtype}{tuple(got.shape)}, want {want.dtype}"
                             f"{tuple(want.shape)}, max abs diff {diff}")


def ref_compute():
    """The reference module forward runs on: ref itself, or a bf16 copy of it."""
    return copy.deepcopy(ref).to(torch.bfloat16) if BF16 else ref


def ref_backward(x, y):
    m = ref_compute()
    loss = lm_loss(m(x), y)
    loss.backward()
    if m is not ref:  # bf16 gradients accumulated in fp32, as the engine does
        for p, pc in zip(ref.parameters(), m.parameters()):
            if pc.grad is not None:
                g = pc.grad.float()
                p.grad = g if p.grad is None else p.grad + g
    return loss


def both_backward(x, y):
    lw = lm_loss(model(x), y)
    lw.backward()
    lr_ = ref_backward(x, y)
    check_equal(lw, lr_, "loss")


def step_both(x, y, opt, ropt):
    both_backward(x, y)
    opt.step(); opt.zero_grad()
    ropt.step(); ropt.zero_grad()


def check_params(what):
    names = [n for n, _ in ref.named_parameters()]
    wp = dict(model.named_parameters())
    assert names == [n for n, _ in model.named_parameters()], "parameter names differ"
    for n, p in ref.named_parameters():
        w = wp[n]
        assert w.untyped_storage().nbytes() >= w.numel() * w.element_size(), \
            f"{n}: the parameter views a released buffer ({w.untyped_storage().nbytes()} B)"
        check_equal(w, p, f"{what}: parameter {n}")


def check_forward(x, what):
    with torch.no_grad():
        check_equal(model(x), ref_compute()(x), f"{what}: forward output")


opt = infinity.optim.AdamW(model.parameters(), lr=LR)
ropt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
for x, y in BATCHES[:2]:
    step_both(x, y, opt, ropt)
check_params("after 2 training steps")
x_eval = BATCHES[-1][0]
named = dict(model.named_parameters())
rnamed = dict(ref.named_parameters())
# one parameter of a layer block, one of the root block (the tied embedding/head)
L, R = "layers.0.fc.weight", "tok.weight"

if OP == "read":
    for n, rp in rnamed.items():
        w = named[n]
        check_equal(w.sum(), rp.sum(), f"{n}.sum()")
        check_equal(w.norm(), rp.norm(), f"{n}.norm()")
        c = w.detach().clone()
        check_equal(c, rp, f"{n}.detach().clone()")
        assert str(w) == str(rp), f"print({n}) differs:\n{w}\nvs\n{rp}"
    assert str(model) == str(ref), f"print(model) differs:\n{model}\nvs\n{ref}"
    ptrs = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs), "parameters share a storage outside forward"
    # reading does not disturb training
    step_both(*BATCHES[2], opt, ropt)
    check_params("a step after the reads")
    check_forward(x_eval, "after the reads")

elif OP == "write":
    g = torch.Generator().manual_seed(5)
    new_bias = torch.randn(rnamed["layers.1.qkv.bias"].shape, generator=g)
    new_proj = torch.randn(rnamed["layers.1.proj.weight"].shape, generator=g) * 0.02
    for m_named in (named, rnamed):
        with torch.no_grad():
            m_named[L].mul_(0.5)
            m_named[R].mul_(0.5)
            m_named["layers.1.qkv.bias"].copy_(new_bias)
            m_named["ln_f.weight"].add_(0.125)
    named["layers.1.proj.weight"].data = new_proj.clone()  # rebinding is taken in too
    rnamed["layers.1.proj.weight"].data = new_proj.clone()
    check_params("right after the writes")
    check_forward(x_eval, "after the writes")
    check_params("after the forward that took the writes in")
    step_both(*BATCHES[2], opt, ropt)  # infinity's master weights must have followed
    check_params("one step after the writes")
    step_both(*BATCHES[3], opt, ropt)
    check_params("two steps after the writes")
    check_forward(x_eval, "two steps after the writes")

elif OP == "state_dict":
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict()), "state_dict keys differ"
    path = os.path.join(TMP, "sd.pt")
    torch.save(sd, path)
    loaded = torch.load(path)
    torch.manual_seed(123)
    fresh = TinyGPT(CFG)
    fresh.load_state_dict(loaded)
    for k, v in fresh.state_dict().items():
        check_equal(v, sd[k], f"state_dict round trip {k} (vs wrapped)")
        check_equal(v, ref.state_dict()[k], f"state_dict round trip {k} (vs reference)")
    # the reverse: a modified state dict loaded into the wrapped model
    g = torch.Generator().manual_seed(7)
    modified = {}
    for k, v in ref.state_dict().items():
        modified[k] = v * 0.9 + 0.01 * torch.randn(v.shape, generator=g)
    modified["lm_head.weight"] = modified["tok.weight"]  # tied
    buf = io.BytesIO(); torch.save(modified, buf); buf.seek(0)
    modified = torch.load(buf)
    model.load_state_dict(modified)
    ref.load_state_dict(modified)
    check_params("after load_state_dict")
    check_forward(x_eval, "after load_state_dict")
    step_both(*BATCHES[2], opt, ropt)
    check_params("one step after load_state_dict")
    step_both(*BATCHES[3], opt, ropt)
    check_params("two steps after load_state_dict")

elif OP == "ema":
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    rema = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for i in range(3):
        step_both(*BATCHES[2 + i], opt, ropt)
        with torch.no_grad():
            for n, p in model.named_parameters():
                ema[n].lerp_(p, 0.1)
            for n, p in ref.named_parameters():
                rema[n].lerp_(p, 0.1)
        for n in rema:
            check_equal(ema[n], rema[n], f"EMA of {n} after step {i + 1}")
    # EMA copy-back (e.g. for evaluation), then keep training from the EMA weights
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ema[n])
        for n, p in ref.named_parameters():
            p.copy_(rema[n])
    check_params("after copying the EMA back")
    check_forward(x_eval, "after copying the EMA back")
    step_both(*BATCHES[6], opt, ropt)
    check_params("one step after copying the EMA back")

elif OP == "deepcopy":
    try:
        dup = copy.deepcopy(model)
    except Exception as exc:  # a clear error is acceptable; an obscure one is not
        msg = f"{type(exc).__name__}: {exc}"
        print("DEEPCOPY raises", msg)
        assert "infinity" in str(exc).lower(), f"deepcopy(model) raised an unclear error: {msg}"
    else:
        print("DEEPCOPY works; the copy is", "wrapped" if engine_of(dup) is not None
              else "a plain module")
        dnamed = dict(dup.named_parameters())
        for n, rp in rnamed.items():
            check_equal(dnamed[n], rp, f"deepcopy: parameter {n}")
            assert dnamed[n].untyped_storage().data_ptr() != \
                named[n].untyped_storage().data_ptr(), f"deepcopy: {n} shares storage"
        with torch.no_grad():
            # the copy is a plain module of the home dtype (fp32 even when the wrapped model
            # computes in bf16): it computes like the fp32 reference
            check_equal(dup(x_eval), ref(x_eval), "deepcopy: forward of the copy")
            dnamed[L].add_(1.0)  # the copy is independent of the original
        check_params("after changing the copy")
        step_both(*BATCHES[2], opt, ropt)
        check_params("a step of the original after deepcopy")
    check_forward(x_eval, "after deepcopy")

elif OP == "torch_optim":
    opt.close()
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                 lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=True),
                 lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True)):
        topt, tref = make(list(model.parameters())), make(list(ref.parameters()))
        name = f"{type(topt).__name__}{topt.defaults.get('foreach') and '(foreach)' or ''}" \
               f"{topt.defaults.get('fused') and '(fused)' or ''}"
        for i, (x, y) in enumerate(BATCHES[2:7]):
            both_backward(x, y)
            for n, rp in rnamed.items():
                assert named[n].grad is not None, f"{name} step {i}: {n}.grad is None"
                check_equal(named[n].grad, rp.grad, f"{name} step {i}: {n}.grad")
            nw = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            nr = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            check_equal(nw, nr, f"{name} step {i}: clip_grad_norm_ result")
            for n, rp in rnamed.items():
                check_equal(infinity.gradient(named[n]), rp.grad,
                            f"{name} step {i}: clipped infinity.gradient({n})")
            topt.step(); topt.zero_grad()
            tref.step(); tref.zero_grad()
            check_params(f"{name} step {i}")
        check_forward(x_eval, f"after 5 {name} steps")
    # model.zero_grad() forgets: the same batch twice gives the gradient of one
    x, y = BATCHES[8]
    for twice_without_zero in (False, True):
        model.zero_grad(); ref.zero_grad()
        both_backward(x, y)
        if not twice_without_zero:
            model.zero_grad(); ref.zero_grad()
        both_backward(x, y)
        for n, rp in rnamed.items():
            what = f"{'accumulated' if twice_without_zero else 'zero_grad then'} {n}"
            check_equal(infinity.gradient(named[n]), rp.grad, f"{what}: infinity.gradient")
            check_equal(named[n].grad, rp.grad, f"{what}: p.grad")
    model.zero_grad()
    for n, p in named.items():
        assert p.grad is None, f"after model.zero_grad(): {n}.grad is not None"
        assert infinity.gradient(p) is None, \
            f"after model.zero_grad(): infinity.gradient({n}) still returns the old gradient"

elif OP == "materialized":
    with infinity.materialized(model):
        for n, rp in rnamed.items():
            check_equal(named[n], rp.to(CDT), f"inside materialized: {n}")
        with torch.no_grad():
            named[L].mul_(0.5)
            named["ln_f.bias"].add_(0.25)
    with torch.no_grad():  # the same write in the compute dtype, kept in the fp32 home
        rnamed[L].copy_(rnamed[L].to(CDT).mul_(0.5).float())
        rnamed["ln_f.bias"].copy_(rnamed["ln_f.bias"].to(CDT).add_(0.25).float())
    check_params("after leaving materialized")
    check_forward(x_eval, "after leaving materialized")
    step_both(*BATCHES[2], opt, ropt)
    check_params("one step after materialized")
    with infinity.materialized(model):
        check_equal(named[L], rnamed[L].to(CDT), "inside materialized after a step")
    check_params("after a read-only materialized")

else:
    raise SystemExit(f"unknown op {OP}")
print("CASE OK")
'''


def _run_case(tier: str, op: str, tmp_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", CHILD, tier, op, tmp_dir], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def cases(request, tmp_path_factory) -> Dict[Tuple[str, str], Future]:
    """Starts every selected (tier, op) case at once, each in its own subprocess, a few at a
    time: most of a case's time is importing torch, so running them side by side keeps the
    file within a minute on two cores."""
    selected = [item.callspec.params for item in request.session.items
                if getattr(item, "originalname", None) == "test_outside_forward"
                and hasattr(item, "callspec")]
    pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1))
    futures = {}
    for params in selected:
        key = (params["tier"], params["op"])
        if key not in futures:
            tmp = str(tmp_path_factory.mktemp(f"{key[0]}-{key[1]}"))
            futures[key] = pool.submit(_run_case, key[0], key[1], tmp)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("tier", TIERS)
def test_outside_forward(tier, op, cases, tmp_path):
    future = cases.get((tier, op))
    proc = future.result() if future is not None else _run_case(tier, op, str(tmp_path))
    signal = f" (killed by signal {-proc.returncode})" if proc.returncode < 0 else ""
    if proc.returncode != 0 or "CASE OK" not in proc.stdout:
        pytest.fail(f"case {tier}/{op} exited with {proc.returncode}{signal}\n"
                    f"--- stdout ---\n{proc.stdout[-3000:]}\n"
                    f"--- stderr ---\n{proc.stderr[-6000:]}", pytrace=False)
    for line in proc.stdout.splitlines():  # e.g. what deepcopy did, for the -rA summary
        if line.startswith("DEEPCOPY"):
            print(line)


# =========================================================================================
# a torch optimizer cannot see NVMe gradients: a loud error, never a silent no-op
# =========================================================================================
@pytest.mark.parametrize("param_tier", ["host", "nvme"])
def test_torch_optimizer_reads_nvme_gradients_through_memory_maps(tmp_path, param_tier):
    """fp32 parameters with gradients on NVMe: p.grad is a memory map of the gradient swap
    file, so a torch optimizer and torch.nn.utils.clip_grad_norm_ work as on the plain
    model (the clip's in-place change reaches the file and is re-checksummed)."""
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)
    torch.manual_seed(0)
    ref = TinyGPT(cfg)
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), param_tier=param_tier,
                          grad_tier="nvme")
    try:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = synthetic_batch(cfg, 2, 8, gen)
            norms = []
            for m, opt in zip((ref, model), opts):
                lm_loss(m(x), y).backward()
                norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
                opt.step()
                m.zero_grad()
            assert torch.equal(norms[0], norms[1]) and norms[0] > 0.05  # clipping active
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), n
    finally:
        infinity.unwrap(model)


@pytest.mark.parametrize("param_tier", ["host", "nvme"])
def test_torch_optimizer_refuses_nvme_gradients_it_cannot_see(tmp_path, param_tier):
    """bf16 parameters with gradients on NVMe: p.grad cannot view the fp32 gradient file, so
    a torch optimizer's step raises, naming infinity and the remedy; nothing changes."""
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)
    torch.manual_seed(0)
    model = infinity.wrap(TinyGPT(cfg).to(torch.bfloat16), nvme_path=str(tmp_path),
                          param_tier=param_tier, grad_tier="nvme", compute_dtype=torch.bfloat16)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = synthetic_batch(cfg, 2, 8, torch.Generator().manual_seed(1))
        lm_loss(model(x), y).backward()
        assert all(p.grad is None for p in model.parameters())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(RuntimeError) as info:
            opt.step()
        msg = str(info.value)
        assert "infinity" in msg, msg
        assert "grad_tier='host'" in msg and "infinity.optim" in msg, msg
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), f"{n} changed although the step was refused"
    finally:
        infinity.unwrap(model)
