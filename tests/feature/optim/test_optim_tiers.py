"""Every combination of where parameters, gradients and optimizer states live trains exactly like
torch.optim.AdamW(fused=True) in memory (fp32: same losses, weights within 1e-6)."""
import copy
import itertools

import pytest
import torch
from test_optim import _model, _train

import infinity

STEPS = 4


@pytest.fixture(scope="module")
def reference():
    base = _model()
    model = copy.deepcopy(base)
    losses = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), STEPS)
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
    losses = _train(model, opt, STEPS)
    assert set(opt.state_tiers.values()) == {optimizer_tier}
    opt.close()
    infinity.unwrap(model)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert losses == ref_losses
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
