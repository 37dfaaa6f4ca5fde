"""The usage patterns a wrapped model must support, each against plain PyTorch."""
import copy

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import SMALL, assert_grads_equal, batches, loss_of, pair
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.models import TinyGPT, lm_loss

TIERS = ["host", "nvme"]


def _kw(tier, tmp_path, **extra):
    return dict(param_tier=tier, nvme_path=str(tmp_path), **extra)


@pytest.mark.parametrize("tier", TIERS)
def test_frozen_parameters_lora_style(tier, tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT(SMALL)
    for name, p in ref.named_parameters():
        if not name.startswith("layers.") or "fc" not in name:
            p.requires_grad_(False)  # only the MLP input projections train
    wrapped = copy.deepcopy(ref)
    infinity.wrap(wrapped, **_kw(tier, tmp_path))
    (x, y), = batches(SMALL, 1)
    loss_of(ref, x, y).backward()
    loss_of(wrapped, x, y).backward()
    assert_grads_equal(ref, wrapped, rtol=0, atol=0)
    for name, p in wrapped.named_parameters():
        if not p.requires_grad:
            assert infinity.gradient(p) is None, name
    engine = wrapped._infinity_engine
    frozen_flats = [f for f in engine.flats if not f.trainable]
    assert all(f.grad is None for f in frozen_flats)  # no gradient memory for frozen blocks


@pytest.mark.parametrize("tier", TIERS)
def test_tied_embedding_and_head(tier, tmp_path):
    ref, wrapped = pair(**_kw(tier, tmp_path))
    assert wrapped.lm_head.weight is wrapped.tok.weight
    (x, y), = batches(SMALL, 1)
    loss_of(ref, x, y).backward()
    loss_of(wrapped, x, y).backward()
    assert_grads_equal(ref, wrapped, rtol=0, atol=0)


class _Twice(nn.Module):
    """Calls its shared layer twice in one forward (weight sharing across depth)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        h = self.emb(x)
        h = torch.tanh(self.layers[0](h))
        h = torch.tanh(self.layers[1](h))
        h = torch.tanh(self.layers[0](h))  # again
        return self.head(h)


@pytest.mark.parametrize("tier", TIERS)
def test_module_called_twice(tier, tmp_path):
    torch.manual_seed(0)
    ref = _Twice()
    wrapped = copy.deepcopy(ref)
    infinity.wrap(wrapped, **_kw(tier, tmp_path))
    x = torch.randint(0, 32, (4, 8))
    for _ in range(2):
        F.cross_entropy(ref(x).flatten(0, 1), x.flatten()).backward()
        F.cross_entropy(wrapped(x).flatten(0, 1), x.flatten()).backward()
    assert_grads_equal(ref, wrapped, rtol=0, atol=0)


@pytest.mark.parametrize("tier", TIERS)
def test_no_grad_inference(tier, tmp_path):
    ref, wrapped = pair(**_kw(tier, tmp_path))
    (x, _), = batches(SMALL, 1)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(ref(x), wrapped(x))
    with torch.inference_mode():
        assert torch.equal(ref(x), wrapped(x))
    engine = wrapped._infinity_engine
    if tier == "nvme":
        # nothing but the root block stays materialized after an inference forward
        assert all(not b.materialized for b in engine.blocks if not b.is_root)


class _Checkpointed(TinyGPT):
    def __init__(self, cfg, use_reentrant):
        super().__init__(cfg)
        self.use_reentrant = use_reentrant

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=self.use_reentrant)
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(tier, use_reentrant, tmp_path):
    torch.manual_seed(0)
    ref = _Checkpointed(SMALL, use_reentrant)
    wrapped = copy.deepcopy(ref)
    infinity.wrap(wrapped, **_kw(tier, tmp_path))
    for x, y in batches(SMALL, 2):
        ref.zero_grad()
        wrapped._infinity_engine.zero_grad()
        loss_of(ref, x, y).backward()
        loss_of(wrapped, x, y).backward()
        assert_grads_equal(ref, wrapped, rtol=0, atol=0)


@pytest.mark.parametrize("tier", TIERS)
def test_parameter_read_outside_forward(tier, tmp_path):
    """The loss reads model.lm_head.weight directly (an auxiliary penalty on the head)."""
    ref, wrapped = pair(**_kw(tier, tmp_path))
    (x, y), = batches(SMALL, 1)
    for m in (ref, wrapped):
        logits = m(x)
        loss = lm_loss(logits, y) + 1e-3 * m.lm_head.weight.pow(2).sum()
        loss.backward()
    assert_grads_equal(ref, wrapped, rtol=0, atol=0)
    # a layer's parameters outside forward: inside infinity.materialized they are readable
    with infinity.materialized(wrapped, wrapped.layers[1]):
        assert torch.equal(wrapped.layers[1].fc.weight, ref.layers[1].fc.weight)


@pytest.mark.parametrize("tier", TIERS)
def test_gradient_accumulation_matches_large_batch(tier, tmp_path):
    ref, wrapped = pair(**_kw(tier, tmp_path))
    micro = batches(SMALL, 3)
    for x, y in micro:
        loss_of(ref, x, y).backward()
        loss_of(wrapped, x, y).backward()
    assert_grads_equal(ref, wrapped, rtol=0, atol=0)
    wrapped._infinity_engine.zero_grad()
    ref.zero_grad()
    x, y = micro[0]
    loss_of(ref, x, y).backward()
    loss_of(wrapped, x, y).backward()  # after zero_grad the next gradient overwrites
    assert_grads_equal(ref, wrapped, rtol=0, atol=0)
