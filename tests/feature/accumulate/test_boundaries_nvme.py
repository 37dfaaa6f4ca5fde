"""Layer-major boundaries on the NVMe activation tier (``activation_tier="nvme"``): each layer
input is written to the activation scratch files as it is made and read back for backward,
with at most two layers' worth in RAM. The results are bitwise those with the boundaries in
RAM (the bytes are copied, not converted), with a clip that fires too (its measuring pass
reads every boundary twice)."""
from __future__ import annotations

import pytest
import torch
from layer_major_helpers import NVME, batches, llama, wrapped

import infinity

LAYERS, K, TOKENS, HIDDEN = 6, 4, 16, 64


def _train(tmp_path, clip, **settings):
    model = wrapped(llama(num_hidden_layers=LAYERS), tmp_path, **NVME, **settings)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    losses, stats = [], []
    for step in range(3):
        infinity.stats(model, reset=True)
        out = infinity.accumulate(model, batches(K, 1000, seed=30 + step, tokens=TOKENS),
                                  optimizer=opt, max_grad_norm=clip)
        losses.append([float(x) for x in out])
        stats.append(infinity.stats(model))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    infinity.unwrap(model)
    return losses, state, stats


@pytest.mark.parametrize("clip", [None, 0.05])
def test_boundaries_on_nvme_equal_boundaries_in_ram(tmp_path, clip):
    ram_losses, ram_state, ram_stats = _train(tmp_path / "ram", clip)
    losses, state, stats = _train(tmp_path / "nvme", clip, activation_tier="nvme",
                                  activation_min_bytes=1 << 40)  # boundaries only
    assert losses == ram_losses
    assert all(torch.equal(state[k], ram_state[k]) for k in ram_state)
    boundary = TOKENS * HIDDEN * 4  # one micro-batch's layer input, fp32: one 4 KiB page
    for st, ram in zip(stats, ram_stats):
        moved = st["nvme_per_step"]["bytes"]
        assert moved["activations_written"] == (LAYERS + 1) * K * boundary
        reads = 1 if clip is None else 2  # a clip's measuring pass reads them too
        assert moved["activations_read"] >= reads * LAYERS * K * boundary
        assert ram["nvme_per_step"]["bytes"]["activations_written"] == 0
        # in RAM: at most two layers' boundaries at once, against all of them
        assert st["accumulate"]["boundary_bytes_peak"] <= (K + 1) * boundary
        assert ram["accumulate"]["boundary_bytes_peak"] == (LAYERS + 1) * K * boundary


def test_boundaries_over_the_host_budget_fit_on_nvme(tmp_path):
    """A step whose boundaries the host budget refuses in RAM runs with them on NVMe (the
    host budget is charged two layers' worth)."""
    mbs = batches(32, 1000, seed=8, rows=8, tokens=128)  # 32768 tokens x 7 boundaries x 256 B
    lm = wrapped(llama(num_hidden_layers=LAYERS), tmp_path / "ram", host_budget="48MiB", **NVME)
    with pytest.raises(ValueError, match="host budget.*fewer or shorter micro-batches"):
        infinity.accumulate(lm, mbs)
    on_nvme = wrapped(llama(num_hidden_layers=LAYERS), tmp_path / "nvme", host_budget="48MiB",
                      activation_tier="nvme", activation_min_bytes=1 << 40, **NVME)
    opt = infinity.optim.AdamW(on_nvme.parameters(), lr=1e-3)
    losses = infinity.accumulate(on_nvme, mbs, optimizer=opt)
    assert len(losses) == 32 and all(torch.isfinite(x) for x in losses)
    st = infinity.stats(on_nvme)
    assert st["tiers"]["host"]["peak"] <= 48 << 20
    assert st["nvme_per_step"]["bytes"]["activations_written"] >= 32768 * 7 * 256


def test_a_full_disk_while_writing_boundaries_changes_nothing_and_training_goes_on(tmp_path):
    """ENOSPC while a boundary is written: the call raises naming infinity, no gradient was
    changed, and the next call trains as if the failed one had not happened."""
    from infinity.io.faults import clear_faults, inject_fault
    ref, _, _ = _train(tmp_path / "ref", None)
    model = wrapped(llama(num_hidden_layers=LAYERS), tmp_path / "f", activation_tier="nvme",
                    activation_min_bytes=1 << 40, **NVME)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    inject_fault("write", 28, after_bytes=0)
    try:
        with pytest.raises(Exception, match="infinity") as info:
            infinity.accumulate(model, batches(K, 1000, seed=30, tokens=TOKENS), optimizer=opt)
    finally:
        clear_faults()
    assert "28" in str(info.value) or "space" in str(info.value).lower(), str(info.value)
    assert all(infinity.gradient(p) is None for p in model.parameters())
    losses = []
    for step in range(3):
        out = infinity.accumulate(model, batches(K, 1000, seed=30 + step, tokens=TOKENS),
                                  optimizer=opt)
        losses.append([float(x) for x in out])
    assert losses == ref
