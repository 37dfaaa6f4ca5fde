"""What infinity.accumulate refuses, with a message naming the remedy and nothing changed,
and what it takes that the plain loop takes too (micro-batches of different lengths)."""
import copy

import pytest
import torch
from torch import nn

import infinity
import infinity.optim
from infinity import ChainError
from layer_major_helpers import NVME, batches, grads_of, llama, plain_backward, qwen3_moe, wrapped


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_bad_micro_batch_changes_nothing_then_train_on(tmp_path):
    model = llama()
    lm, plain = wrapped(model, tmp_path / "a", **NVME), wrapped(model, tmp_path / "b", **NVME)
    before = _weights(lm)
    mbs = batches(3, 1000, seed=1)
    bad = dict(input_ids=torch.full((1, 16), 5000), labels=torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ChainError, match="micro-batch 1 failed.*nothing was changed"):
        infinity.accumulate(lm, [mbs[0], bad, mbs[2]])
    assert grads_of(lm) == {}
    after = lm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the engine trains on: a layer-major step equals the plain loop's
    opts = [infinity.optim.AdamW(m.parameters(), lr=1e-3) for m in (lm, plain)]
    infinity.accumulate(lm, mbs)
    plain_backward(plain, mbs)
    for opt in opts:
        opt.step()
    own, got = plain.state_dict(), lm.state_dict()
    assert all(torch.equal(own[k], got[k]) for k in own)


def test_micro_batches_of_different_lengths_match_plain_loop(tmp_path):
    model = llama()
    ref, lm = copy.deepcopy(model), wrapped(model, tmp_path, **NVME)
    mbs = batches(1, 1000, seed=2, tokens=8) + batches(1, 1000, seed=3, tokens=24) + \
        batches(1, 1000, seed=4, rows=2, tokens=5)
    plain_backward(ref, mbs)
    infinity.accumulate(lm, mbs)
    got = grads_of(lm)
    for n, p in ref.named_parameters():
        assert torch.equal(p.grad, got[n]), n


class _NotAChain(nn.Module):
    def __init__(self, scale_between: bool) -> None:
        super().__init__()
        self.scale_between = scale_between
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if self.scale_between:
                x = x * 2
        return x


def test_model_whose_layers_are_not_a_chain():
    with pytest.raises(ChainError, match="changes the hidden state between layers.*plain"):
        infinity.accumulate(_NotAChain(True), [torch.randn(2, 8)], lambda out, b: out.sum())


class _Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def test_model_that_skips_a_layer():
    with pytest.raises(ChainError, match="ran 2 of its 3 layers"):
        infinity.accumulate(_Skips(), [torch.randn(2, 8)], lambda out, b: out.sum())


def test_generic_chain_with_loss_fn_matches_plain_loop():
    torch.manual_seed(0)
    model = _NotAChain(False)
    twin = copy.deepcopy(model)
    xs = [torch.randn(2, 8) for _ in range(4)]
    for x in xs:
        (model(x).square().mean() / 4).backward()
    infinity.accumulate(twin, xs, lambda out, b: out.square().mean())
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_moe_auxiliary_loss_refused(tmp_path):
    model = qwen3_moe()
    model.config.output_router_logits = True
    with pytest.raises(ChainError, match="output_router_logits.*set it to False"):
        infinity.accumulate(model, batches(2, 500, seed=5))


def test_kv_cache_in_training_refused(tmp_path):
    lm = wrapped(llama(), tmp_path, **NVME)
    mbs = [dict(mb, use_cache=True) for mb in batches(2, 1000, seed=6)]
    with pytest.raises(ChainError, match="use_cache=False"):
        infinity.accumulate(lm, mbs)
    assert grads_of(lm) == {}


def test_forward_hook_inside_a_layer_needs_opt_in(tmp_path):
    model = llama()
    calls = []
    ref = copy.deepcopy(model)
    lm = wrapped(model, tmp_path, **NVME)
    handle = lm.model.layers[1].mlp.register_forward_hook(lambda *a: calls.append(1))
    mbs = batches(2, 1000, seed=7)
    with pytest.raises(ChainError, match=r"layer 1 \(mlp\).*allow_hooks=True"):
        infinity.accumulate(lm, mbs)
    assert calls == []
    infinity.accumulate(lm, mbs, allow_hooks=True)
    assert len(calls) == 4  # forward and recomputation, per micro-batch
    handle.remove()
    plain_backward(ref, mbs)
    got = grads_of(lm)
    assert all(torch.equal(p.grad, got[n]) for n, p in ref.named_parameters())


def test_boundaries_over_the_host_budget_refused(tmp_path):
    lm = wrapped(llama(), tmp_path, host_budget="48MiB", **NVME)
    mbs = batches(48, 1000, seed=8, rows=8, tokens=128)  # 49152 tokens x 4 boundaries x 256 B
    with pytest.raises(ValueError, match="host budget.*fewer or shorter micro-batches"):
        infinity.accumulate(lm, mbs)
    assert grads_of(lm) == {}
    infinity.accumulate(lm, mbs[:2])  # a smaller step fits


def test_empty_and_loss_less_calls():
    model = llama()
    with pytest.raises(ValueError, match="no micro-batches"):
        infinity.accumulate(model, [])
    with pytest.raises(ValueError, match="divide_by"):
        infinity.accumulate(model, batches(1, 1000, seed=9), divide_by=0)
    with pytest.raises(ChainError, match="no loss.*labels"):
        infinity.accumulate(model, [dict(input_ids=torch.randint(0, 1000, (1, 8)))])


def test_fault_in_the_middle_of_the_step_then_train_on(tmp_path):
    """A loss_fn that raises on the second micro-batch's tail (after the first one's backward
    reached the head): the error reaches the caller, the engine recovers, and after zero_grad
    the next step equals the plain loop's."""
    model = llama()
    lm, plain = wrapped(model, tmp_path / "a", **NVME), wrapped(model, tmp_path / "b", **NVME)
    opts = [infinity.optim.AdamW(m.parameters(), lr=1e-3) for m in (lm, plain)]
    mbs = batches(3, 1000, seed=11)
    calls = []

    def flaky(out, batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return out.loss

    with pytest.raises(RuntimeError, match="injected fault"):
        infinity.accumulate(lm, mbs, flaky)
    opts[0].zero_grad()
    infinity.accumulate(lm, mbs)
    plain_backward(plain, mbs)
    for opt in opts:
        opt.step()
    own, got = plain.state_dict(), lm.state_dict()
    assert all(torch.equal(own[k], got[k]) for k in own)
    infinity.accumulate(lm, mbs)  # and on
