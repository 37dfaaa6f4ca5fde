"""Activation offload (activation_tier="host" / "nvme"): the tensors autograd saves are moved
out during forward and come back for backward; training is bitwise the same as without it."""
import copy
import errno
from typing import Dict, List, Optional

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.io import clear_faults, inject_fault
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.runtime.activations.offload import ActivationOffloadError
from infinity.runtime.core.registry import _ENGINES

CFG = GPTConfig(vocab_size=128, d_model=32, n_layers=3, n_heads=4, max_seq=64)
B, T = 2, 64
ACT = B * T * CFG.d_model * 4  # bytes of one (B, T, d_model) fp32 activation
MIN_BYTES = 4096


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [synthetic_batch(CFG, B, T, g) for _ in range(n)]


def _weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(model: nn.Module, batches, tier: Optional[str], tmp_path, **extra):
    """Wraps ``model`` (params on host), runs AdamW steps; returns losses, weights, stats."""
    kw = dict(activation_tier=tier, activation_min_bytes=MIN_BYTES, **extra) if tier else {}
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="host", **kw)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    losses, stats = [], []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        stats.append(infinity.stats(model, reset=True))
    weights = _weights(model)
    infinity.unwrap(model)
    opt.close()
    return losses, weights, stats


def _assert_same(run_a, run_b) -> None:
    assert run_a[0] == run_b[0]  # losses, bitwise (floats compare exactly)
    for k, v in run_a[1].items():
        assert torch.equal(v, run_b[1][k]), k


@pytest.fixture(autouse=True)
def _no_faults_and_no_engines_left():
    """Clears injected faults; closes the engines a test left wrapped (their files)."""
    before = set(_ENGINES)
    yield
    clear_faults()
    for engine in set(_ENGINES) - before:
        engine.close(restore=False)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_training_is_bitwise_the_same_with_activations_offloaded(tier, tmp_path):
    torch.manual_seed(0)
    base = TinyGPT(CFG)
    data = _batches(4)
    plain = _train(copy.deepcopy(base), data, None, tmp_path)
    offl = _train(copy.deepcopy(base), data, tier, tmp_path)
    _assert_same(plain, offl)
    first, last = offl[2][0]["activations"], offl[2][-1]["activations"]
    step = last["last_step"]
    # most saved bytes went out; small ones (stats, indices) stayed
    assert step["offloaded_bytes"] >= 20 * ACT and step["offloaded_tensors"] > 30
    assert step["kept_tensors"] > 0 and step["kept_bytes"] < step["offloaded_bytes"] / 10
    assert offl[2][-1]["time"]["activation_bytes"]["offloaded"] == step["offloaded_bytes"]
    assert "activation_wait" in offl[2][-1]["time"]
    assert last["device"]["now"] == 0  # everything handed back and freed after backward
    if tier == "nvme":
        assert step["fetched_bytes"] == step["offloaded_bytes"]
        # step 1 has no record (on demand); afterwards the recorded order is followed
        assert first["last_step"]["on_demand_fetches"] == first["last_step"]["offloaded_tensors"]
        assert step["on_demand_fetches"] == 0 and last["schedule_deviations"] == 0
        assert last["prefetch_hits"] > 0
        # scratch extents are reused step after step, in a few files (not one per tensor)
        assert last["nvme_files"] == first["nvme_files"] <= step["offloaded_tensors"] / 4
        assert last["nvme_bytes"] == first["nvme_bytes"] >= step["offloaded_bytes"]
        assert offl[2][-1]["moved"]["host_to_nvme"] >= step["offloaded_bytes"]
    else:
        assert step["fetched_bytes"] == 0  # used in place on the CPU device tier
        assert last["host"]["now"] >= step["offloaded_bytes"]  # pooled, reused next step


def test_first_step_matches_plain_pytorch_gradients(tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), activation_tier="nvme",
                  activation_min_bytes=MIN_BYTES)
    (x, y), = _batches(1)
    lm_loss(ref(x), y).backward()
    loss = lm_loss(model(x), y)
    loss.backward()
    assert torch.equal(loss.detach(), lm_loss(ref(x), y).detach())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(infinity.gradient(p), q.grad), name


def test_device_resident_activation_peak_falls_to_the_window(tmp_path):
    """Engine accounting: without a window every saved activation would stay resident until
    its backward; with NVMe offload the peak is bounded by the window (in flight out + in)."""
    window = 12 * ACT  # a layer saves ~17 ACT
    torch.manual_seed(0)
    model = infinity.wrap(TinyGPT(GPTConfig(vocab_size=128, d_model=32, n_layers=16,
                                            n_heads=4, max_seq=64)),
                          nvme_path=str(tmp_path), activation_tier="nvme",
                          activation_min_bytes=MIN_BYTES, activation_prefetch_bytes=window)
    largest = 4 * ACT  # the MLP's hidden activation
    for x, y in _batches(3):
        infinity.stats(model, reset=True)
        lm_loss(model(x), y).backward()
        model._infinity_engine.zero_grad()
    s = infinity.stats(model)["activations"]
    total = s["last_step"]["offloaded_bytes"]
    peak = s["device"]["peak"]
    assert peak <= 2 * window + largest, (peak, window)
    assert total >= 8 * peak, (total, peak)  # "all of them" vs the window
    assert s["last_step"]["on_demand_fetches"] == 0


@pytest.mark.parametrize("params", ["nvme", "host"])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_with_checkpointing_only_the_boundaries_are_offloaded(tier, reentrant, params, tmp_path):
    """params="host": on a CPU-only machine the parameters run in place in their host home;
    a saved view of one (the tied head's transposed weight) is still a parameter, not an
    activation to offload (it was, before the engine counted the parameters' own storages)."""
    class Checkpointed(TinyGPT):
        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t))
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=reentrant)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(0)
    ref = Checkpointed(CFG)
    model = copy.deepcopy(ref)
    # threshold = one (B, T, d) activation: the boundaries are exactly that size
    infinity.wrap(model, nvme_path=str(tmp_path), activation_tier=tier,
                  activation_min_bytes=ACT, param_tier=params, grad_tier="nvme",
                  optimizer_tier="nvme")
    for x, y in _batches(2):
        ref.zero_grad()
        model._infinity_engine.zero_grad()
        want = lm_loss(ref(x), y)
        want.backward()
        got = lm_loss(model(x), y)
        got.backward()
        assert torch.equal(got.detach(), want.detach())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(infinity.gradient(p), q.grad), name
    step = infinity.stats(model)["activations"]["last_step"]
    # one input per checkpointed layer + ln_f's input + lm_head's input (the root block);
    # nothing saved inside a layer (its recomputation in backward keeps its own saves)
    assert step["offloaded_tensors"] == CFG.n_layers + 2, step
    assert step["offloaded_bytes"] == (CFG.n_layers + 2) * ACT


class _Twice(TinyGPT):
    """Layer 1 runs twice; the embeddings and layer 0 are frozen."""

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for i in (0, 1, 1, 2):
            x = self.layers[i](x)
        return self.lm_head(self.ln_f(x))


def _frozen_twice() -> TinyGPT:
    torch.manual_seed(0)
    m = _Twice(GPTConfig(vocab_size=128, d_model=32, n_layers=3, n_heads=4, max_seq=64,
                         tie_embeddings=False))
    for p in list(m.layers[0].parameters()) + [m.tok.weight, m.pos.weight]:
        p.requires_grad_(False)
    return m


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_frozen_parameters_and_a_layer_used_twice(tier, tmp_path):
    base = _frozen_twice()
    data = _batches(3)
    plain = _train(copy.deepcopy(base), data, None, tmp_path)
    offl = _train(copy.deepcopy(base), data, tier, tmp_path)
    _assert_same(plain, offl)
    assert offl[2][-1]["activations"]["last_step"]["offloaded_tensors"] > 0


def test_no_grad_and_inference_mode_offload_nothing(tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), activation_tier="nvme",
                          activation_min_bytes=MIN_BYTES)
    (x, _), = _batches(1)
    with torch.no_grad():
        out = model(x)
    with torch.inference_mode():
        out2 = model(x)
    with torch.no_grad():
        assert torch.equal(out, ref(x)) and torch.equal(out2, ref(x))
    s = infinity.stats(model)
    assert s["activations"]["last_step"]["offloaded_tensors"] == 0
    assert s["time"]["activation_bytes"]["offloaded"] == 0
    assert s["activations"]["nvme_files"] == 0


def test_hooks_are_popped_when_a_block_raises_and_next_step_is_exact(tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), activation_tier="host",
                          activation_min_bytes=MIN_BYTES)
    (x, y), = _batches(1)
    boom = model.layers[1].fc.register_forward_hook(
        lambda *a: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        model(x)
    boom.remove()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    loss = lm_loss(model(x), y)
    loss.backward()
    lm_loss(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(infinity.gradient(p), q.grad), name


def test_a_users_own_saved_tensor_hooks_take_precedence(tmp_path):
    """Under the user's own pack/unpack hooks (here torch's save_on_cpu) nothing is pushed:
    theirs see every save, ours none."""
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), activation_tier="host",
                          activation_min_bytes=MIN_BYTES)
    (x, y), = _batches(1)
    with torch.autograd.graph.save_on_cpu():
        loss = lm_loss(model(x), y)
    loss.backward()
    lm_loss(ref(x), y).backward()
    assert infinity.stats(model)["activations"]["last_step"]["offloaded_tensors"] == 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(infinity.gradient(p), q.grad), name


@pytest.mark.parametrize("settings, match", [
    (dict(activation_tier="gpu"), "activation_tier='gpu' is not supported"),
    (dict(activation_tier="device"), "use None"),
    (dict(activation_tier=1), "activation_tier=1"),
    (dict(activation_tier="nvme", nvme_path=None), "needs nvme_path"),
    (dict(activation_tier="host", activation_min_bytes=-1), "activation_min_bytes must be"),
    (dict(activation_tier="host", activation_min_bytes=1.5), "activation_min_bytes must be"),
    (dict(activation_tier="host", activation_min_bytes=True), "activation_min_bytes must be"),
    (dict(activation_tier="host", activation_min_bytes="1MB"), "activation_min_bytes must be"),
    (dict(activation_min_bytes=1 << 20), "has no effect without activation_tier"),
    (dict(activation_tier="host", activation_prefetch_bytes=0), "activation_prefetch_bytes"),
])
def test_bad_settings_are_refused_with_a_clear_error(settings, match, tmp_path):
    settings.setdefault("nvme_path", str(tmp_path))
    model = TinyGPT(CFG)
    before = _weights(model)
    with pytest.raises(ValueError, match=match) as info:
        infinity.wrap(model, **settings)
    assert "infinity" in str(info.value)
    assert not hasattr(model, "_infinity_engine")
    for k, v in _weights(model).items():
        assert torch.equal(v, before[k]), k


def test_host_budget_too_small_for_host_activations(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    # what the engine itself holds on host (parameter homes and gradient accumulators)
    sizing = infinity.wrap(copy.deepcopy(model), param_tier="host")
    held = sum(infinity.api._engine(sizing).sizing.host_needs().values())
    infinity.unwrap(sizing)
    infinity.wrap(model, param_tier="host", grad_tier="host", optimizer_tier="host",
                  host_budget=held + 8 * ACT,
                  activation_tier="host", activation_min_bytes=MIN_BYTES)
    (x, y), = _batches(1)
    with pytest.raises(infinity.tiers.BudgetExceededError, match="host_budget") as info:
        lm_loss(model(x), y).backward()
    assert "activation_tier='nvme'" in str(info.value)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _redo_after_failure(model, opt, batch, op: str, fail_after: int) -> List[float]:
    """Injects a disk error into activation writes (from the start of forward) or reads (after
    forward); the step raises; then it is redone."""
    code = errno.ENOSPC if op == "write" else errno.EIO
    raised_in = None
    if op == "write":
        inject_fault("write", code, after_bytes=fail_after)
    try:
        raised_in = "forward"
        loss = lm_loss(model(batch[0]), batch[1])
        if op == "read":
            inject_fault("read", code, after_bytes=fail_after)
        raised_in = "backward"
        loss.backward()
        raised_in = None
    except ActivationOffloadError as exc:
        error = exc
    clear_faults()
    assert raised_in is not None, "the injected disk error did not raise"
    if op == "read":
        assert raised_in == "backward"
    assert error.errno == code, error
    assert "nvme_path" in str(error) and "infinity" in str(error)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    loss = error = None  # noqa: F841 - drops the failed graph
    opt.zero_grad()
    loss = lm_loss(model(batch[0]), batch[1])
    loss.backward()
    return [loss.item()]


@pytest.mark.parametrize("op, fail_after", [("write", 0), ("write", 6 * ACT), ("read", 0)])
def test_failed_activation_io_raises_and_the_next_step_is_exact(op, fail_after, tmp_path):
    """ENOSPC on an activation write, or EIO on a read back (injected into the O_DIRECT
    engine): forward or backward raises ActivationOffloadError carrying the errno; after it,
    training continues and equals a run where nothing failed."""
    torch.manual_seed(0)
    base = TinyGPT(CFG)
    data = _batches(3)
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    want = _train(copy.deepcopy(base), data, None, tmp_path / "ref")
    model = infinity.wrap(copy.deepcopy(base), nvme_path=str(tmp_path / "run"),
                          param_tier="host", activation_tier="nvme",
                          activation_min_bytes=MIN_BYTES)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i, batch in enumerate(data):
        if i == 1:
            losses += _redo_after_failure(model, opt, batch, op, fail_after)
        else:
            loss = lm_loss(model(batch[0]), batch[1])
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    weights = _weights(model)
    infinity.unwrap(model)
    opt.close()
    _assert_same(want, (losses, weights))


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_retain_graph_second_backward_reads_back_again(tier, tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), activation_tier=tier,
                          activation_min_bytes=MIN_BYTES)
    (x, y), = _batches(1)
    want = lm_loss(ref(x), y)
    want.backward(retain_graph=True)
    want.backward()
    loss = lm_loss(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(infinity.gradient(p), q.grad), name
    step = infinity.stats(model)["activations"]["last_step"]
    if tier == "nvme":
        assert step["fetched_bytes"] == 2 * step["offloaded_bytes"]
