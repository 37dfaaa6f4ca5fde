"""compute_dtype="auto", the default, end to end: a bf16 model on a CPU without fast bf16
computes in fp32 (losses and gradients those of plain PyTorch on the fp32 upcast), with
faked rates a CPU with fast bf16 keeps bf16 (its host blocks run in place, as before), an
explicit dtype is obeyed, stats() and explain() say what was chosen and why, and the budgets
count the fp32 compute buffers of bf16 homes (twice their bytes)."""
import copy

import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.runtime.build import dtypes
from infinity.runtime.build.dtypes import Rates
from infinity.runtime.engine import engine_of
from infinity.tiers import BudgetExceededError

CFG = GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, max_seq=64)
NVME = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
TIERS = {"host": dict(param_tier="host", grad_tier="host", optimizer_tier="host"),
         "nvme": NVME}


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FAST_BF16 = bool(_cpu_flags() & {"amx_bf16", "avx512_bf16"})


def _bf16_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(CFG).to(torch.bfloat16)


def _flat_dtypes(model):
    return {(f.home_dtype, f.compute_dtype) for b in engine_of(model).blocks for f in b.flats}


def _losses_and_grads(model, steps: int = 2):
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = synthetic_batch(CFG, 2, 16, gen)
        loss = lm_loss(model(x).float(), y)
        loss.backward()
        losses.append(loss.item())
    grads = {n: (infinity.gradient(p) if engine_of(model) else p.grad).float().clone()
             for n, p in model.named_parameters()}
    return losses, grads


class _FakeRates:
    def __init__(self, fp32: float, narrow: float):
        self.rates, self.asked = Rates(fp32, narrow, "faked for the test"), []

    def __call__(self, dtype):
        self.asked.append(dtype)
        return self.rates


@pytest.mark.skipif(FAST_BF16, reason="this CPU has fast bf16 (AMX/AVX512-BF16): auto keeps it")
@pytest.mark.parametrize("tier", sorted(TIERS))
def test_bf16_model_computes_in_fp32_by_default_on_this_cpu(tmp_path, tier):
    """No fake: the probe cache of the suite (a quick probe: not trusted for this) or wrap's
    quick check measures this CPU's bf16 and fp32 rates."""
    ref = _bf16_model()
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), **TIERS[tier])
    try:
        assert _flat_dtypes(model) == {(torch.bfloat16, torch.float32)}
        s = infinity.stats(model)["compute_dtype"]
        assert s["setting"] == "auto" and s["chosen"] == {"bfloat16": "float32"}
        assert "GFLOP/s" in s["why"]["bfloat16"]
        got_losses, got_grads = _losses_and_grads(model)
        with infinity.materialized(model):
            assert all(p.dtype == torch.float32 for p in model.parameters())  # computing
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # stored
    finally:
        infinity.unwrap(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    want_losses, want_grads = _losses_and_grads(copy.deepcopy(ref).float())
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses),
                               rtol=1e-6, atol=0)
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-7, msg=n)
    # the same model computing in bf16 as set: plain PyTorch's bf16 numbers, not fp32's
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), compute_dtype=torch.bfloat16,
                          **TIERS[tier])
    try:
        assert _flat_dtypes(model) == {(torch.bfloat16, torch.bfloat16)}
        bf16_losses, _ = _losses_and_grads(model)
    finally:
        infinity.unwrap(model)
    ref_bf16, _ = _losses_and_grads(copy.deepcopy(ref))
    assert bf16_losses == ref_bf16
    assert bf16_losses != got_losses


@pytest.mark.parametrize("case", ["amx_like", "avx2_like"])
def test_faked_rates_decide_end_to_end(tmp_path, monkeypatch, case):
    """Fast bf16 keeps bf16 (host blocks run in place in their homes on the CPU, no compute
    buffers); slow bf16 computes in fp32 (blocks streamed through fp32 buffers)."""
    fast = case == "amx_like"
    rates = _FakeRates(1e12, 6e12) if fast else _FakeRates(6e10, 1.5e9)
    monkeypatch.setattr(dtypes, "CPU_RATES", rates)
    model = infinity.wrap(_bf16_model(), nvme_path=str(tmp_path), **TIERS["host"])
    try:
        assert rates.asked == [torch.bfloat16]
        want = torch.bfloat16 if fast else torch.float32
        assert _flat_dtypes(model) == {(torch.bfloat16, want)}
        blocks = engine_of(model).blocks
        assert all(b.resident for b in blocks) == fast
        s = infinity.stats(model)["compute_dtype"]
        assert s["chosen"] == {"bfloat16": str(want).replace("torch.", "")}
        assert "faked for the test" in s["why"]["bfloat16"]
        assert ("6000.00 GFLOP/s" if fast else "1.50 GFLOP/s") in s["why"]["bfloat16"]
        losses, _ = _losses_and_grads(model, steps=1)
        assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        infinity.unwrap(model)


def test_fp32_model_and_explicit_settings_ask_no_rates(tmp_path, monkeypatch):
    rates = _FakeRates(1.0, 1e6)
    monkeypatch.setattr(dtypes, "CPU_RATES", rates)
    torch.manual_seed(0)
    model = infinity.wrap(TinyGPT(CFG), **TIERS["host"])
    assert _flat_dtypes(model) == {(torch.float32, torch.float32)}
    infinity.unwrap(model)
    for setting, want in ((torch.float32, torch.float32), (None, torch.bfloat16),
                          (torch.bfloat16, torch.bfloat16)):
        model = infinity.wrap(_bf16_model(), compute_dtype=setting, **TIERS["host"])
        assert _flat_dtypes(model) == {(torch.bfloat16, want)}
        s = infinity.stats(model)["compute_dtype"]
        assert s["setting"] == (None if setting is None else str(setting).replace("torch.", ""))
        infinity.unwrap(model)
    assert rates.asked == []


def test_explain_says_the_compute_dtype_and_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dtypes, "CPU_RATES", _FakeRates(6e10, 1.5e9))
    model = _bf16_model()
    plan = infinity.explain(model, nvme_path=str(tmp_path))  # before wrap: what it would do
    assert plan.reasons[-1].startswith("compute dtype: bfloat16 homes compute in float32")
    assert "1.50 GFLOP/s" in capsys.readouterr().out
    pinned = infinity.explain(model, nvme_path=str(tmp_path), compute_dtype=torch.bfloat16,
                              show=False)
    assert "compute_dtype=torch.bfloat16 as set" in pinned.reasons[-1]
    infinity.wrap(model, nvme_path=str(tmp_path))
    try:
        got = infinity.explain(model, show=False)  # the wrapped model's plan
        assert got.reasons[-1] == plan.reasons[-1]
    finally:
        infinity.unwrap(model)


def test_budgets_count_fp32_compute_buffers_of_bf16_homes(tmp_path, monkeypatch):
    """On a CPU the compute buffers are host RAM: computing bf16 homes in fp32 reserves twice
    the bytes, and a host budget that holds them in bf16 but not in fp32 is refused, naming
    the remedy."""
    monkeypatch.setattr(dtypes, "CPU_RATES", _FakeRates(6e10, 1.5e9))

    def reserved(**kw):
        model = infinity.wrap(_bf16_model(), nvme_path=str(tmp_path), host_budget=64 << 20,
                              **NVME, **kw)
        try:
            return infinity.stats(model)["tiers"]["host"]["compute"]
        finally:
            infinity.unwrap(model)

    wide, narrow = reserved(), reserved(compute_dtype=torch.bfloat16)
    assert narrow > 0 and wide == 2 * narrow

    def minimum(**kw):
        with pytest.raises(BudgetExceededError) as info:
            infinity.wrap(_bf16_model(), nvme_path=str(tmp_path), host_budget=1 << 16, **NVME,
                          **kw)
        msg = str(info.value)
        return int(msg.split("Raise host_budget to at least ")[1].split(" ")[0].replace(",", "")), msg

    need_wide, msg = minimum()
    need_narrow, msg_narrow = minimum(compute_dtype=torch.bfloat16)
    assert need_wide > need_narrow
    assert "compute_dtype=torch.bfloat16 halves them" in msg and "halves" not in msg_narrow
    between = (need_wide + need_narrow) // 2
    with pytest.raises(BudgetExceededError, match="compute in float32"):
        infinity.wrap(_bf16_model(), nvme_path=str(tmp_path), host_budget=between, **NVME)
    model = infinity.wrap(_bf16_model(), nvme_path=str(tmp_path), host_budget=between,
                          compute_dtype=torch.bfloat16, **NVME)
    infinity.unwrap(model)
