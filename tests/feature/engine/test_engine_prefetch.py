"""Prefetch by the recorded schedule, and correctness when the model deviates from it."""
import copy
import random

import pytest
import torch
from engine_helpers import assert_grads_equal, batches, loss_of

import infinity
from infinity.models import GPTConfig, TinyGPT

# Per step, the root block and the first layer are needed right after the previous backward
# (nothing to overlap their fetch with); with 16 layers that is 2 of 32 fetches.
CFG = GPTConfig(vocab_size=256, d_model=96, n_layers=16, n_heads=4, max_seq=64)


def test_prefetch_hits_after_first_step(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", prefetch_window=2)
    data = batches(CFG, 4, batch=8, seq=64)  # enough compute per block to hide its I/O
    x, y = data[0]
    loss_of(model, x, y).backward()  # step 1 records the schedule (prefetched by the guess)
    first = infinity.stats(model, reset=True)
    assert first["on_demand_fetches"] > 0  # the root block at least
    for x, y in data[1:]:
        model._infinity_engine.zero_grad()
        loss_of(model, x, y).backward()
    s = infinity.stats(model)
    total = s["prefetch_hits"] + s["prefetch_misses"]
    # every layer is fetched in forward and in backward, except the last two of forward (the
    # prefetch window): they are the first two of backward and stay materialized between
    assert total >= 3 * (2 * CFG.n_layers - 2)
    # every fetch was issued ahead by the schedule; whether it had finished when compute
    # needed it (a hit) depends on the machine's load, which benchmarks measure, not tests
    assert s["on_demand_fetches"] == 0, s
    assert s["prefetch_hits"] > 0, s
    assert s["schedule_deviations"] == 0


@pytest.mark.parametrize("window", [0, 1, 2, 3])
def test_last_blocks_of_forward_are_kept_for_backward(tmp_path, window):
    """The first blocks of backward (as many as the prefetch window, at least one) are the last
    of forward: they are not released and read again in between."""
    cfg = GPTConfig(vocab_size=128, d_model=32, n_layers=6, n_heads=2, max_seq=16)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    reference = copy.deepcopy(model)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", prefetch_window=window)
    data = batches(cfg, 3, batch=2, seq=16)
    for step, (x, y) in enumerate(data):
        model._infinity_engine.zero_grad()
        reference.zero_grad(set_to_none=True)
        infinity.stats(model, reset=True)
        loss_of(model, x, y).backward()
        loss_of(reference, x, y).backward()
        assert_grads_equal(reference, model)
        if step == 0:
            continue  # records the schedule
        s = infinity.stats(model)
        kept = max(1, window)
        # root once, every layer in forward, every layer in backward but the kept ones (the
        # next step's first fetches, issued at the end of this backward, replace those the
        # previous step issued for this one)
        assert s["fetches"] == 1 + 2 * cfg.n_layers - kept, s


class _SkipLayers(TinyGPT):
    """Skips a random subset of layers on each call: dynamic control flow."""

    def __init__(self, cfg, seed):
        super().__init__(cfg)
        self.rng = random.Random(seed)
        self.skip = set()

    def resample(self):
        self.skip = {i for i in range(len(self.layers)) if self.rng.random() < 0.4}

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = layer(x)
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("window", [1, 3])
def test_random_layer_skipping_stays_correct(window, tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, d_model=32, n_layers=6, n_heads=2, max_seq=32)
    ref = _SkipLayers(cfg, seed=5)
    wrapped = copy.deepcopy(ref)
    infinity.wrap(wrapped, nvme_path=str(tmp_path), param_tier="nvme", prefetch_window=window,
                  device_budget=None)
    for x, y in batches(cfg, 8, seq=8):
        ref.resample()
        wrapped.skip = set(ref.skip)
        ref.zero_grad()
        wrapped._infinity_engine.zero_grad()
        l_ref = loss_of(ref, x, y)
        l_ref.backward()
        l = loss_of(wrapped, x, y)
        l.backward()
        assert torch.equal(l_ref, l.detach())
        assert_grads_equal(ref, wrapped, rtol=0, atol=0)
    s = infinity.stats(wrapped)
    assert s["schedule_deviations"] > 0  # the schedule did deviate, and was re-recorded
    engine = wrapped._infinity_engine
    engine.release_all()  # accounting is consistent: nothing materialized, nothing counted
    assert engine.device_budget.used == 0
    assert all(not b.materialized for b in engine.blocks)


class _Reversed(TinyGPT):
    """Runs its layers in the reverse of their registration order."""

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for layer in reversed(self.layers):
            x = layer(x)
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("cls", [TinyGPT, _Reversed])
def test_first_step_prefetches_by_registration_order(tmp_path, cls):
    """Before any order is recorded the engine guesses the registration order (its reverse for
    backward): a model that runs its layers in that order prefetches from the first step on;
    one that does not falls back to on-demand fetches (not counted as a deviation), computes
    the same gradients and prefetches from its second step."""
    torch.manual_seed(0)
    ref = cls(CFG)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", prefetch_window=2)
    data = batches(CFG, 2, batch=2, seq=16)
    for step, (x, y) in enumerate(data):
        ref.zero_grad(set_to_none=True)
        model._infinity_engine.zero_grad()
        loss_of(ref, x, y).backward()
        loss_of(model, x, y).backward()
        assert_grads_equal(ref, model, rtol=0, atol=0)
        s = infinity.stats(model, reset=True)
        assert s["schedule_deviations"] == 0, s
        if step == 0 and cls is _Reversed:
            assert s["on_demand_fetches"] >= CFG.n_layers, s  # most of them
        else:  # only the root block, needed at once, is fetched on demand
            assert s["on_demand_fetches"] <= 1, (step, s)
            assert s["prefetch_hits"] + s["prefetch_misses"] >= 2 * CFG.n_layers - 2, s
