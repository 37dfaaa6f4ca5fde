"""Compact optimizer states on the optimizer: ``infinity.optim.AdamW(..., states="bf16"|"8bit")``.

Reference: torch.optim.AdamW(fused=True) (bitwise equal to our fp32 kernel, see test_optim.py)
with its moments replaced after every step by their compact value, computed with the ops'
pure-PyTorch fallbacks: bf16 = ``m.to(bfloat16).float()`` (nearest even); 8bit = quantize then
dequantize in 256-element blocks per parameter (``adam_compact._torch_quantize`` /
``_torch_dequantize``). That is the algorithm of the compact kernels (the update uses the
unrounded fp32 moments, the stored moments are rounded afterwards). For 8bit the parameter is
then recomputed with the 8-bit step's update, ``p' - (step * m) / (sqrt(v) + eps')`` (one
division, the bias corrections folded into two fp32 scalars), from the same fp32 moments. Tolerance: losses and
weights equal to rtol 1e-6 / atol 1e-7 (FP32_TOL, as test_optim); measured bitwise equal.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional

import pytest
import torch
from engine_helpers import assert_tensors_equal

import infinity
from infinity import ops
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.ops import adam_compact, q8_format
from infinity.ops.adam import bias_corrections
from infinity.optim.step.layout import STATE_FORMATS, layout_for, quantize_exact, state_views

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, max_seq=16)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOL = dict(rtol=1e-6, atol=1e-7)
STEPS = 6
NO_GRAD_STEP = 3                       # in this step layers.2.fc.weight gets no gradient
FROZEN = "layers.1.proj.weight"        # requires_grad=False throughout
NO_GRAD = "layers.2.fc.weight"


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    model = TinyGPT(CFG)
    dict(model.named_parameters())[FROZEN].requires_grad_(False)
    return model


def _groups(model: torch.nn.Module) -> List[Dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _round_torch_states(opt: torch.optim.Optimizer, fmt: str) -> None:
    """The reference's compact storage: the moments of each parameter that took this step
    replaced by their stored value (only those). 8-bit: the step's encoding
    (q8_format.step_codes), which depends on the block's previous scale fields: the reference
    keeps them beside torch's state (``opt.q8_reference_scales``)."""
    scales = opt.__dict__.setdefault("q8_reference_scales", {})
    for p, state in opt.state.items():
        if p.grad is None:
            continue
        if fmt == "bf16":
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].to(torch.bfloat16).float())
            continue
        if fmt != "8bit":
            continue
        m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        n = m.numel()
        blocks = adam_compact.num_blocks(n)
        old_m, old_v = scales.get(p, (torch.zeros(blocks), torch.zeros(blocks)))
        mc, ms, vc, vs = q8_format.step_codes(q8_format.rows(m), q8_format.rows(v), old_m,
                                              old_v, True)
        scales[p] = (ms, vs)
        m.copy_(q8_format.decode(mc, q8_format.unit(ms)[:, None], True).view(-1)[:n])
        v.copy_(q8_format.decode(vc, q8_format.unit(vs)[:, None], False).view(-1)[:n])
        # the moment guard the next step applies (idempotent until then)
        beta1, beta2 = opt.param_groups[0]["betas"]
        bound = adam_compact.moment_bound(int(state["step"]), beta1, beta2)
        m.copy_(adam_compact.guard_moment(m.clone(), v, bound))


def _redo_8bit_update(opt: torch.optim.Optimizer, before: Dict) -> None:
    """The reference's 8-bit parameter update (``adam_compact.update_scalars_8bit``) for each
    parameter that took this step, from its value before the step and the fp32 moments torch
    just computed (bitwise the 8-bit kernel's moments), in fp32 tensor operations."""
    for group in opt.param_groups:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p not in before:
                continue
            state = opt.state[p]
            step = int(state["step"])
            bc1, bc2_sqrt = bias_corrections(step, beta1, beta2)
            step_size, eps_ = adam_compact.update_scalars_8bit(lr, eps, bc1, bc2_sqrt)
            q = before[p]
            if wd:
                q = q * float(torch.tensor(1.0 - lr * wd, dtype=torch.float32))
            m, v = state["exp_avg"], state["exp_avg_sq"]
            denom = v.double().sqrt().float() + torch.tensor(eps_, dtype=torch.float32)
            with torch.no_grad():
                p.copy_(q - (m * torch.tensor(step_size, dtype=torch.float32)) / denom)


def _every_param(fmt: str, model: torch.nn.Module) -> Dict:
    """``states=fmt`` for every parameter of ``model``: "8bit" names the whole model
    explicitly and sets ``min_8bit_size=0``, so the 8-bit safeguards (fp32 moments for
    embeddings and parameters under 4096 elements, tested in test_optim_state_formats.py)
    leave this tiny model all 8-bit, as the reference rounds it."""
    if fmt != "8bit":
        return dict(states=fmt)
    return dict(states={"default": "8bit", model: "8bit"}, min_8bit_size=0)


def _materialized(model):
    import contextlib

    from infinity.runtime import engine_of
    return infinity.materialized(model) if engine_of(model) is not None \
        else contextlib.nullcontext()


def _train(model, opt, steps: int, *, seed: int = 1, fmt: Optional[str] = None,
           observe: Optional[Dict] = None) -> List[float]:
    """``fmt``: round the (torch) reference's states after each step. ``observe``: filled
    with the no-grad parameter before/after its gradient-less step."""
    gen = torch.Generator().manual_seed(seed)
    named = dict(model.named_parameters())
    losses = []
    for step in range(1, steps + 1):
        x, y = synthetic_batch(CFG, 2, 8, gen)
        skip = step == NO_GRAD_STEP and observe is not None
        if skip:
            named[NO_GRAD].requires_grad_(False)
        loss = lm_loss(model(x), y)
        loss.backward()
        if skip:
            named[NO_GRAD].requires_grad_(True)
            with _materialized(model):
                observe["before"] = named[NO_GRAD].detach().clone()
        before = {p: p.detach().clone() for p in model.parameters()
                  if p.grad is not None} if fmt == "8bit" else None
        opt.step()
        if before is not None:
            _redo_8bit_update(opt, before)
        if skip:
            with _materialized(model):
                observe["after"] = named[NO_GRAD].detach().clone()
        if fmt is not None:
            _round_torch_states(opt, fmt)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def references():
    out = {}
    for fmt in STATE_FORMATS:
        model = _model()
        opt = torch.optim.AdamW(_groups(model), lr=1e-2, fused=True)
        observe: Dict = {}
        losses = _train(model, opt, STEPS, fmt=fmt, observe=observe)
        out[fmt] = (losses, _weights(model))
    return out


# =========================================================================================
# API and layout
# =========================================================================================
@pytest.mark.parametrize("bad", ["int8", "FP32", "", None, 8, torch.bfloat16])
def test_bad_states_value_raises(bad):
    model = _model()
    with pytest.raises(ValueError, match=r"states must be 'fp32'.*'bf16'.*'8bit'"):
        infinity.optim.AdamW(model.parameters(), states=bad)


def test_layout_sizes_and_views():
    model = infinity.wrap(_model())
    from infinity.runtime import engine_of
    flat = max(engine_of(model).flats, key=lambda f: f.numel)
    n = flat.numel
    sizes = {fmt: layout_for(flat, fmt, True).nbytes for fmt in STATE_FORMATS}
    assert sizes["fp32"] == 12 * n and sizes["bf16"] == 8 * n
    blocks = sum(adam_compact.num_blocks(s.numel) for s in flat.slots)
    assert sizes["8bit"] == -(-(6 * n + 8 * blocks) // 4096) * 4096
    assert all(v % 4096 == 0 for v in sizes.values())
    assert sizes["8bit"] / sizes["fp32"] < 0.52
    lay = layout_for(flat, "8bit", True)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    v = state_views(lay, buf)
    parts = [v.master, v.exp_avg_absmax, v.exp_avg_sq_absmax, v.exp_avg, v.exp_avg_sq]
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in parts)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # no overlap
    assert ranges[-1][1] - buf.data_ptr() <= lay.nbytes
    assert lay.block_start[1] == adam_compact.num_blocks(flat.slots[0].numel)
    infinity.unwrap(model)


# =========================================================================================
# training equals the reference
# =========================================================================================
@pytest.mark.parametrize("fmt", STATE_FORMATS)
@pytest.mark.parametrize("param_tier,optimizer_tier",
                         [("host", "host"), ("host", "nvme"), ("nvme", "host"),
                          ("nvme", "nvme"), ("unwrapped", None)])
def test_trains_like_reference(references, tmp_path, fmt, param_tier, optimizer_tier):
    ref_losses, ref_weights = references[fmt]
    model = _model()
    frozen_before = dict(model.named_parameters())[FROZEN].detach().clone()
    if param_tier != "unwrapped":
        infinity.wrap(model, nvme_path=str(tmp_path), param_tier=param_tier,
                      grad_tier="host", optimizer_tier=optimizer_tier)
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2, **_every_param(fmt, model))
    observe: Dict = {}
    losses = _train(model, opt, STEPS, observe=observe)
    if optimizer_tier is not None:
        assert set(opt.state_tiers.values()) == {optimizer_tier}
    sd = opt.state_dict()
    names = [n for g in _groups(model) for n, p in model.named_parameters()
             if any(p is q for q in g["params"])]
    steps = {names[i]: e["step"].item() for i, e in sd["state"].items()}
    assert FROZEN not in steps
    assert steps[NO_GRAD] == STEPS - 1 and steps["layers.2.fc.bias"] == STEPS
    assert torch.equal(observe["before"], observe["after"])  # no gradient: left alone
    opt.close()
    if param_tier != "unwrapped":
        infinity.unwrap(model)
    assert torch.equal(dict(model.named_parameters())[FROZEN], frozen_before)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for k, v in _weights(model).items():
        torch.testing.assert_close(v, ref_weights[k], **TOL, msg=k)


def test_compact_states_differ_from_fp32(references):
    """The reference variants really are different algorithms (the test above would not
    notice a compact optimizer silently running fp32 states otherwise)."""
    w = {fmt: torch.cat([v.flatten() for v in references[fmt][1].values()])
         for fmt in STATE_FORMATS}
    assert not torch.equal(w["fp32"], w["bf16"]) and not torch.equal(w["fp32"], w["8bit"])


def test_step_8bit_with_bf16_parameters_and_nvme_everything(tmp_path):
    """bf16 parameters (fp32 masters in the states), everything on NVMe: trains."""
    model = _model().to(torch.bfloat16)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", grad_tier="nvme",
                  optimizer_tier="nvme", compute_dtype=torch.bfloat16)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, states="8bit")
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(8):
        x, y = synthetic_batch(CFG, 4, 8, gen)
        loss = lm_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    sd = opt.state_dict()
    assert sd["states"] == "8bit"
    entry = next(iter(sd["state"].values()))
    assert entry["master"].dtype == torch.float32 and entry["exp_avg"].dtype == torch.float32
    opt.close()
    infinity.unwrap(model)


# =========================================================================================
# state_dict and checkpoints
# =========================================================================================
def test_quantize_exact_reproduces_decoded_moments():
    """The 8-bit round trip: a step encodes a block two binades above its previous largest value,
    so its decoded values need not be representable at the exponent the exact rule picks from
    them; quantize_exact finds one that reproduces them bitwise, with the same largest value
    (what the next step reads), and quantizes other values by the exact rule."""
    gen = torch.Generator().manual_seed(0)
    n = 256 * 300 + 77
    x = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 4 - 3)
    blocks = adam_compact.num_blocks(n)
    for signed, values in ((True, x), (False, x.abs())):
        rows = q8_format.rows(values)
        mx = rows.abs().amax(1)
        k = q8_format.block_exponent(mx, signed, q8_format.HEADROOM)  # as a step encodes
        c, _ = q8_format.encode(rows, k[:, None], signed)
        deq = q8_format.decode(c, torch.pow(2.0, k.double()).float()[:, None], signed)
        deq = deq.view(-1)[:n].contiguous()
        plain_c, plain_a = ops.quantize_8bit(deq, signed=signed)
        plain = ops.dequantize_8bit(plain_c, plain_a, signed=signed)
        assert not torch.equal(plain, deq)  # why quantize_exact exists
        c2 = torch.empty(n, dtype=torch.uint8)
        a2 = torch.empty(blocks)
        quantize_exact(deq, signed, c2, a2)
        back = ops.dequantize_8bit(c2, a2, signed=signed)
        assert torch.equal(back, deq)
        top = q8_format.decode(q8_format.c_max(a2).to(torch.uint8), q8_format.unit(a2), signed)
        assert torch.equal(top.abs(), q8_format.rows(deq).abs().amax(1))
        # moments that are not 8-bit values: the exact rule
        quantize_exact(values, signed, c2, a2)
        qc, qa = ops.quantize_8bit(values, signed=signed)
        assert torch.equal(c2, qc) and torch.equal(a2.view(torch.int32), qa.view(torch.int32))


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_state_dict_round_trip_is_bitwise(tmp_path, fmt, tier):
    wrap_kw = {} if tier == "host" else dict(nvme_path=str(tmp_path), optimizer_tier="nvme",
                                             param_tier="nvme")
    model = infinity.wrap(_model(), **wrap_kw)
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2, states=fmt)
    _train(model, opt, 4, seed=1)
    with infinity.materialized(model):
        saved_weights = _weights(model)
    saved = opt.state_dict()
    assert saved["states"] == fmt
    assert all(e["exp_avg"].dtype == torch.float32 for e in saved["state"].values())
    again = opt.state_dict()
    losses_a = _train(model, opt, 4, seed=2)
    infinity.unwrap(model)
    opt.close()
    weights_a = _weights(model)

    model2 = _model(seed=123)
    model2.load_state_dict(saved_weights)
    infinity.wrap(model2, **wrap_kw)
    opt2 = infinity.optim.AdamW(_groups(model2), lr=1e-2, states=fmt)
    opt2.load_state_dict(saved)
    reloaded = opt2.state_dict()
    for i, e in again["state"].items():  # loading re-quantizes to the very same state
        for k in ("exp_avg", "exp_avg_sq", "master", "step"):
            assert torch.equal(reloaded["state"][i][k], e[k]), (i, k)
    losses_b = _train(model2, opt2, 4, seed=2)
    infinity.unwrap(model2)
    opt2.close()
    assert losses_a == losses_b
    assert_tensors_equal(_weights(model2), weights_a)


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_checkpoint_round_trip_resumes_bitwise(tmp_path, fmt):
    """save_checkpoint stores the dequantized fp32 moments; load_checkpoint re-quantizes them
    (bf16: exact; 8bit: quantize_exact) and training resumes bit for bit."""
    (tmp_path / "swap").mkdir()
    kw = dict(nvme_path=str(tmp_path / "swap"), param_tier="nvme", optimizer_tier="nvme")
    model = infinity.wrap(_model(), **kw)
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2, states=fmt)
    _train(model, opt, 3, seed=1)
    infinity.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    losses_a = _train(model, opt, 3, seed=2)
    infinity.unwrap(model)
    opt.close()
    weights_a = _weights(model)

    model2 = infinity.wrap(_model(seed=7), **kw)
    opt2 = infinity.optim.AdamW(_groups(model2), lr=1e-2, states=fmt)
    infinity.load_checkpoint(str(tmp_path / "ckpt"), model2, opt2)
    losses_b = _train(model2, opt2, 3, seed=2)
    infinity.unwrap(model2)
    opt2.close()
    assert losses_a == losses_b
    assert_tensors_equal(_weights(model2), weights_a)


def test_load_fp32_state_into_8bit_optimizer(tmp_path):
    """A state saved with fp32 moments loads into an 8-bit optimizer (quantized) and trains."""
    model = infinity.wrap(_model())
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2)
    _train(model, opt, 2)
    saved = opt.state_dict()
    opt.close()
    opt8 = infinity.optim.AdamW(_groups(model), lr=1e-2, states="8bit")
    opt8.load_state_dict(saved)
    sd = opt8.state_dict()
    for i, e in saved["state"].items():
        m, m8 = e["exp_avg"], sd["state"][i]["exp_avg"]
        # half a code step: 1/32 of the value (e3m4), and the linear bottom binade's steps of
        # 2**-12 of the block's largest value (its unit is 2**-7 of it or less, steps of 1/16)
        scale = m.abs().max().clamp_min(1e-30)
        assert ((m - m8).abs() <= m.abs() / 32 + scale * 2.0 ** -11).all()
        assert sd["state"][i]["step"].item() == e["step"].item()
    _train(model, opt8, 2)
    opt8.close()
    infinity.unwrap(model)


# =========================================================================================
# bytes
# =========================================================================================
def test_nvme_bytes_per_step_fall_with_compact_states(tmp_path):
    """Parameters and gradients in host RAM, states on NVMe: bytes read + written per step
    (StepStats) fall by >= 40% with 8-bit moments (~6.03 vs 12 B/param each way)."""
    moved, held = {}, {}
    for fmt in STATE_FORMATS:
        (tmp_path / fmt).mkdir()
        model = infinity.wrap(_model(), nvme_path=str(tmp_path / fmt), param_tier="host",
                              grad_tier="host", optimizer_tier="nvme")
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, **_every_param(fmt, model))
        _train(model, opt, 2)
        st = opt.last_step_stats
        assert st.bytes_read == st.bytes_written > 0
        moved[fmt] = st.bytes_read + st.bytes_written
        held[fmt] = opt.state_bytes["nvme"]
        opt.close()
        infinity.unwrap(model)
    assert moved["8bit"] <= 0.60 * moved["fp32"], moved
    assert moved["bf16"] <= 0.70 * moved["fp32"], moved
    assert held["8bit"] <= 0.60 * held["fp32"], held


# =========================================================================================
# benchmark
# =========================================================================================
def test_benchmark_quick_runs(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks",
                                                        "bench_compact_states.py"),
                           "--quick", "--nvme-path", str(tmp_path), "--json", str(out),
                           "--no-plot"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    steps = {r["states"]: r for r in res["nvme_step"]}
    assert set(steps) == set(STATE_FORMATS)
    assert steps["8bit"]["bytes_per_step"] < 0.6 * steps["fp32"]["bytes_per_step"]
    assert {c["task"] for c in res["convergence"]} == {"demo", "llama"}
    for c in res["convergence"]:
        assert set(c["final_loss"]) == set(STATE_FORMATS)


def test_benchmark_nvme_step_sequential_frees_each_format(tmp_path, monkeypatch):
    """bench_compact_states' NVMe step one format at a time (what it picks when all formats would
    not fit in RAM, e.g. at 1e9 parameters): at most one format's model is alive at any time,
    and each is garbage once its rows are taken."""
    import gc
    import importlib.util
    import weakref
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))  # its _common helper
    spec = importlib.util.spec_from_file_location(
        "bench_compact_states", os.path.join(REPO, "benchmarks", "bench_compact_states.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    live: List[weakref.ref] = []
    most = []
    real = bench.StepCase

    class Counting(real):
        def __init__(self, *args, **kwargs):
            most.append(sum(r() is not None for r in live) + 1)
            super().__init__(*args, **kwargs)
            live.append(weakref.ref(self.model))

    monkeypatch.setattr(bench, "StepCase", Counting)
    n_params, rows = bench.bench_nvme_step(2 * 256 * 256, 256, 1, 1, str(tmp_path),
                                           sequential=True)
    gc.collect()
    assert [r["states"] for r in rows] == list(bench.FORMATS)
    assert all(r["schedule"] == "sequential" for r in rows)
    assert max(most) == 1, most
    assert len(live) == len(bench.FORMATS) and all(r() is None for r in live)
