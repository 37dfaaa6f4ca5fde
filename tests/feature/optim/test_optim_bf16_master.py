"""bf16 master weights on the optimizer: ``infinity.optim.AdamW(..., master="bf16_sr" |
"bf16_kahan")``, with every moment format, host and NVMe states and unwrapped parameters.

Reference: torch.optim.AdamW(fused=True) (bitwise equal to our fp32 kernel, see test_optim.py)
whose parameters are replaced after every step by their stored bf16 master value, computed with
the ops' pure-PyTorch fallback (``bf16_master._torch_round``: the same hash of (seed, step,
parameter position * 2**40 + element)); at the first step the master is first taken from the
parameter (bf16_sr: nearest even; Kahan: hi + comp). Tolerance: rtol 1e-6 / atol 1e-7 (as
test_optim_compact; measured bitwise equal).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from typing import Dict, List

import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.ops import bf16_master as bm
from infinity.optim.step.layout import layout_for, state_views

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOL = dict(rtol=1e-6, atol=1e-7)
STEPS = 5
SEED = 1234
FROZEN = "layers.1.proj.weight"
MASTERS = ["bf16_sr", "bf16_kahan"]


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


def _batches(steps: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [synthetic_batch(CFG, 2, 8, gen) for _ in range(steps)]


def _train(model, opt, batches) -> List[float]:
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(master: str, steps: int = STEPS):
    model = _model()
    groups = _groups(model)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    losses = []
    for step, (x, y) in enumerate(_batches(steps), start=1):
        loss = lm_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            if step == 1:  # the master is taken from the parameter before the first step
                for p in params:
                    if p.grad is not None:
                        p.copy_(_stored(p, master, None, 0))
            opt.step()
            for i, p in enumerate(params):
                if p.grad is not None:
                    p.copy_(_stored(p, master, step, i << 40))
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _weights(model)


def _stored(p: torch.Tensor, master: str, step, index: int) -> torch.Tensor:
    """The fp32 value of p stored as a bf16 master (step None: the initial nearest-even)."""
    flat = p.detach().reshape(-1).contiguous()
    hi = torch.empty(flat.numel(), dtype=torch.bfloat16)
    comp = torch.empty_like(hi) if master == "bf16_kahan" else None
    if step is None and comp is None:
        return flat.bfloat16().float().view_as(p)
    bm._torch_round(flat, hi, comp, SEED, step or 0, index, None)
    value = hi.float() + (comp.float() if comp is not None else 0)
    return value.view_as(p)


@pytest.fixture(scope="module")
def references():
    return {m: _reference(m) for m in MASTERS}


def _run(tmp_path, states, master, param_tier, optimizer_tier, steps=STEPS):
    model = _model()
    if param_tier != "unwrapped":
        infinity.wrap(model, nvme_path=str(tmp_path), param_tier=param_tier,
                      grad_tier="host", optimizer_tier=optimizer_tier)
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2, states=states, master=master,
                               sr_seed=SEED)
    losses = _train(model, opt, _batches(steps))
    if optimizer_tier is not None:
        assert set(opt.state_tiers.values()) == {optimizer_tier}
    sd = opt.state_dict()
    opt.close()
    if param_tier != "unwrapped":
        infinity.unwrap(model)
    return losses, _weights(model), sd


# ---- API / layout -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["bf16", "fp16", "", None, 2])
def test_bad_master_value_raises(bad):
    with pytest.raises(ValueError, match=r"infinity.optim: master must be 'fp32'.*'bf16_sr'"):
        infinity.optim.AdamW(_model().parameters(), master=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, 2**64, True])
def test_bad_seed_raises(bad):
    with pytest.raises(ValueError, match="sr_seed"):
        infinity.optim.AdamW(_model().parameters(), master="bf16_sr", sr_seed=bad)


def test_layout_bytes_per_parameter():
    model = infinity.wrap(_model())
    from infinity.runtime import engine_of
    flat = max(engine_of(model).flats, key=lambda f: f.numel)
    n = flat.numel
    pad = -(-2 * n // 4) * 4

    def size(fmt, master):
        return layout_for(flat, fmt, True, master).nbytes

    page = lambda b: -(-b // 4096) * 4096  # noqa: E731
    assert size("bf16", "bf16_sr") == page(pad + 4 * n)           # 2 + 4 = 6 B/param
    assert size("bf16", "bf16_kahan") == page(2 * pad + 4 * n)     # 4 + 4 = 8 B/param
    assert size("fp32", "bf16_sr") == page(pad + 8 * n)            # 2 + 8 = 10 B/param
    blocks = sum(-(-s.numel // 256) for s in flat.slots)
    assert size("8bit", "bf16_sr") == page(pad + 2 * n + 8 * blocks)  # ~4.03 B/param
    for fmt in ("fp32", "bf16", "8bit"):
        for master in MASTERS:
            lay = layout_for(flat, fmt, True, master)
            buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
            v = state_views(lay, buf)
            assert v.master.dtype == torch.bfloat16
            assert (v.master_comp is not None) == (master == "bf16_kahan")
            parts = [t for t in (v.master, v.master_comp, v.exp_avg, v.exp_avg_sq,
                                 v.exp_avg_absmax, v.exp_avg_sq_absmax) if t is not None]
            ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                            for t in parts)
            assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
            assert all(t.data_ptr() % 4 == 0 for t in parts)
            assert ranges[-1][1] - buf.data_ptr() <= lay.nbytes
    infinity.unwrap(model)


# ---- training equals the reference; tiers and moment formats ------------------------------------
@pytest.mark.parametrize("master,param_tier,optimizer_tier", [
    ("bf16_sr", "host", "host"), ("bf16_sr", "nvme", "nvme"), ("bf16_sr", "unwrapped", None),
    ("bf16_kahan", "host", "nvme"), ("bf16_kahan", "unwrapped", None)])
def test_trains_like_reference(references, tmp_path, master, param_tier, optimizer_tier):
    ref_losses, ref_weights = references[master]
    losses, weights, sd = _run(tmp_path, "fp32", master, param_tier, optimizer_tier)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for k, v in weights.items():
        torch.testing.assert_close(v, ref_weights[k], **TOL, msg=k)
        if k != FROZEN and master == "bf16_sr":  # the model runs on the bf16 master values
            assert torch.equal(v, v.bfloat16().float()), k
    assert sd["master"] == master and sd["states"] == "fp32"


def test_masters_differ(references):
    """The variants are different algorithms: SR != Kahan != fp32 (the reference would not
    notice a bf16 master silently running fp32 otherwise)."""
    fp32 = _weights(_model())
    w = {m: torch.cat([v.flatten() for v in references[m][1].values()]) for m in MASTERS}
    assert not torch.equal(w["bf16_sr"], w["bf16_kahan"])
    kahan = references["bf16_kahan"][1]
    assert any(not torch.equal(v, v.bfloat16().float()) for k, v in kahan.items()
               if k != FROZEN)  # Kahan values carry more than bf16's 8 bits
    assert not torch.equal(w["bf16_sr"], torch.cat([v.flatten() for v in fp32.values()]))


@pytest.mark.parametrize("states,master", [("bf16", "bf16_sr"), ("8bit", "bf16_kahan"),
                                           pytest.param("8bit", "bf16_sr", marks=pytest.mark.slow),
                                           pytest.param("bf16", "bf16_kahan",
                                                        marks=pytest.mark.slow)])
def test_compact_moments_same_on_every_tier(tmp_path, states, master):
    """Any shard layout (unwrapped: one parameter at a time; wrapped: flat shards), host or
    NVMe: bitwise the same training (the rounding hash follows the parameter, not the shard)."""
    runs = {}
    for param_tier, optimizer_tier in [("host", "host"), ("nvme", "nvme"), ("unwrapped", None)]:
        path = tmp_path / f"{param_tier}{optimizer_tier}"
        path.mkdir()
        runs[param_tier, optimizer_tier] = _run(path, states, master, param_tier,
                                                optimizer_tier, 4)
    base_losses, base_w, _ = runs["unwrapped", None]
    for key, (losses, w, _) in runs.items():
        assert losses == base_losses, key
        for k in w:
            assert torch.equal(w[k], base_w[k]), (key, k)


def test_seed_changes_the_rounding(tmp_path):
    a = _run(tmp_path, "bf16", "bf16_sr", "host", "host", 2)[1]
    model = _model()
    infinity.wrap(model, param_tier="host", optimizer_tier="host")
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2, states="bf16", master="bf16_sr",
                               sr_seed=SEED + 1)
    _train(model, opt, _batches(2))
    opt.close()
    infinity.unwrap(model)
    b = _weights(model)
    assert any(not torch.equal(a[k], b[k]) for k in a)


# ---- state_dict ----------------------------------------------------------------------------------
@pytest.mark.parametrize("master,tier", [("bf16_sr", "nvme"), ("bf16_kahan", "host"),
                                         ("bf16_sr", "unwrapped"),
                                         pytest.param("bf16_kahan", "nvme",
                                                      marks=pytest.mark.slow)])
def test_checkpoint_resumes_bitwise(tmp_path, master, tier):
    batches = _batches(6)

    def make(path):
        model = _model()
        if tier != "unwrapped":
            infinity.wrap(model, nvme_path=str(path), param_tier="host", grad_tier="host",
                          optimizer_tier=tier)
        return model, infinity.optim.AdamW(_groups(model), lr=1e-2, states="bf16",
                                           master=master, sr_seed=SEED)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, opt = make(tmp_path / "a")
    _train(model, opt, batches[:3])
    sd = copy.deepcopy(opt.state_dict())
    msd = copy.deepcopy(model.state_dict())
    assert sd["master"] == master
    _train(model, opt, batches[3:])
    full = _weights(model)
    opt.close()

    model2, opt2 = make(tmp_path / "b")
    model2.load_state_dict(msd)
    opt2.load_state_dict(sd)
    again = copy.deepcopy(opt2.state_dict())
    for i, e in sd["state"].items():  # the loaded masters and moments are the saved ones
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(again["state"][i][key], e[key]), (i, key)
    _train(model2, opt2, batches[3:])
    resumed = _weights(model2)
    opt2.close()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_load_across_master_formats_converts(tmp_path):
    """A bf16-master checkpoint loads into an fp32-master optimizer (its fp32 masters take the
    saved values exactly) and trains on; an fp32-master one loads into bf16_sr (nearest even)
    and bf16_kahan (hi + comp, within 2**-16)."""
    batches = _batches(4)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = infinity.wrap(_model(), nvme_path=str(tmp_path / "a"), param_tier="host",
                          optimizer_tier="nvme")
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2, states="bf16", master="bf16_sr",
                               sr_seed=SEED)
    _train(model, opt, batches[:2])
    sd_bf16 = copy.deepcopy(opt.state_dict())
    msd = copy.deepcopy(model.state_dict())
    opt.close()
    infinity.unwrap(model)

    model = infinity.wrap(_model(), nvme_path=str(tmp_path / "b"), param_tier="host",
                          optimizer_tier="nvme")
    model.load_state_dict(msd)
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2, states="fp32")  # fp32 master
    opt.load_state_dict(sd_bf16)
    sd_fp32 = opt.state_dict()
    assert sd_fp32["master"] == "fp32"
    for i, e in sd_bf16["state"].items():
        assert torch.equal(sd_fp32["state"][i]["master"], e["master"])
        assert torch.equal(sd_fp32["state"][i]["exp_avg"], e["exp_avg"])
    losses = _train(model, opt, batches[2:])
    assert all(torch.isfinite(torch.tensor(losses)))
    after = opt.state_dict()
    moved = [not torch.equal(after["state"][i]["master"], sd_fp32["state"][i]["master"])
             for i in after["state"]]
    assert all(moved)
    # fp32 masters that are not bf16 values now: into bf16_sr / bf16_kahan
    assert any(not torch.equal(e["master"], e["master"].bfloat16().float())
               for e in after["state"].values())
    for master in MASTERS:
        m2 = infinity.wrap(_model(), param_tier="host", optimizer_tier="host")
        o2 = infinity.optim.AdamW(_groups(m2), lr=1e-2, states="bf16", master=master)
        o2.load_state_dict(after)
        got = o2.state_dict()
        for i, e in after["state"].items():
            x = e["master"]
            if master == "bf16_sr":
                assert torch.equal(got["state"][i]["master"], x.bfloat16().float())
            else:
                err = (got["state"][i]["master"].double() - x.double()).abs()
                assert bool((err <= x.double().abs() * 2**-16).all())
        _train(m2, o2, batches[2:3])
        o2.close()
        infinity.unwrap(m2)
    opt.close()
    infinity.unwrap(model)


# ---- bytes on NVMe --------------------------------------------------------------------------------
def test_nvme_bytes_shrink(tmp_path):
    moved, held = {}, {}
    for states, master in (("fp32", "fp32"), ("bf16", "bf16_sr"), ("8bit", "bf16_sr"),
                           ("bf16", "bf16_kahan")):
        key = f"{states}+{master}"
        (tmp_path / key).mkdir()
        model = infinity.wrap(_model(), nvme_path=str(tmp_path / key), param_tier="host",
                              grad_tier="host", optimizer_tier="nvme")
        # 8bit: every parameter (names the model, min_8bit_size=0), without the 8-bit
        # safeguards that keep this tiny model's embeddings and small parameters fp32
        every = dict(states={"default": "8bit", model: "8bit"}, min_8bit_size=0) \
            if states == "8bit" else dict(states=states)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, master=master, **every)
        _train(model, opt, _batches(2))
        st = opt.last_step_stats
        moved[key] = st.bytes_read + st.bytes_written
        held[key] = opt.state_bytes["nvme"]
        opt.close()
        infinity.unwrap(model)
    # 12 -> 6, 4.03 and 8 bytes per parameter (plus page rounding per shard)
    assert moved["bf16+bf16_sr"] <= 0.55 * moved["fp32+fp32"], moved
    assert moved["8bit+bf16_sr"] <= 0.40 * moved["fp32+fp32"], moved
    assert moved["bf16+bf16_kahan"] <= 0.70 * moved["fp32+fp32"], moved
    assert held["8bit+bf16_sr"] <= 0.40 * held["fp32+fp32"], held


# ---- benchmark -------------------------------------------------------------------------------------
def test_benchmark_quick_masters_runs(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks",
                                                        "bench_compact_states.py"),
                           "--quick", "--masters", "--nvme-path", str(tmp_path), "--json",
                           str(out), "--no-plot"],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    steps = {r["states"]: r for r in res["nvme_step"]}
    assert set(steps) == {"fp32", "bf16", "bf16+bf16_sr", "bf16+bf16_kahan", "8bit+bf16_sr"}
    assert steps["bf16+bf16_sr"]["bytes_per_step"] < 0.55 * steps["fp32"]["bytes_per_step"]
    assert {c["task"] for c in res["convergence"]} == {"demo", "llama"}
    for c in res["convergence"]:
        assert set(c["final_loss"]) == set(steps)


def test_infinity_checkpoint_resumes_bitwise(tmp_path):
    """infinity.save_checkpoint / load_checkpoint (streamed per shard: the masters' fp32
    values) of a bf16_sr optimizer with NVMe states: resuming equals not stopping."""
    batches = _batches(4)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    model = infinity.wrap(_model(), nvme_path=str(tmp_path / "a"), param_tier="host",
                          optimizer_tier="nvme")
    opt = infinity.optim.AdamW(_groups(model), lr=1e-2, states="8bit", master="bf16_sr",
                               sr_seed=SEED)
    _train(model, opt, batches[:2])
    infinity.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    _train(model, opt, batches[2:])
    full = _weights(model)
    opt.close()
    model2 = infinity.wrap(_model(seed=5), nvme_path=str(tmp_path / "b"), param_tier="host",
                           optimizer_tier="nvme")
    opt2 = infinity.optim.AdamW(_groups(model2), lr=1e-2, states="8bit", master="bf16_sr",
                                sr_seed=SEED)
    infinity.load_checkpoint(str(tmp_path / "ckpt"), model2, opt2)
    _train(model2, opt2, batches[2:])
    resumed = _weights(model2)
    opt2.close()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
