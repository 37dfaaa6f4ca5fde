"""Every combination of where parameters, gradients and optimizer states live trains exactly like
torch.optim.AdamW(fused=True) in memory (fp32: same losses, weights within 1e-6)."""
import copy
import itertools

import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)


def _train(model, opt, steps=4):
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = synthetic_batch(CFG, 2, 8, g)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    base = TinyGPT(CFG)
    model = copy.deepcopy(base)
    losses = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    return base, losses, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("param_tier,grad_tier,optimizer_tier",
                         list(itertools.product(["device", "host", "nvme"], ["host", "nvme"],
                                                ["host", "nvme"])))
def test_tier_combination_matches_torch(reference, tmp_path, param_tier, grad_tier,
                                        optimizer_tier):
    base, ref_losses, ref_weights = reference
    model = copy.deepcopy(base)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier=param_tier, grad_tier=grad_tier,
                  optimizer_tier=optimizer_tier)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    losses = _train(model, opt)
    assert set(opt.state_tiers.values()) == {optimizer_tier}
    opt.close()
    infinity.unwrap(model)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert losses == ref_losses
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
