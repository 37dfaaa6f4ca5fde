"""State-format conversion across a resume: a checkpoint holds every moment widened to fp32, so
an fp32-state checkpoint loads into an 8-bit (or bf16) optimizer and back, re-quantized per
parameter on the fly. Measured against an uninterrupted fp32-only run: fp32 -> fp32 resumes
bitwise; fp32 -> 8-bit -> fp32 stays within the 8-bit bound (2 * steps * lr per element over the
steps trained in 8-bit); fp32 -> bf16 within the same bound."""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

CFG = GPTConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, max_seq=16)
LR = 1e-3


def _batch(step):
    return synthetic_batch(CFG, 4, 16, torch.Generator().manual_seed(100 + step))


def _wrap(model, tmp_path, name):
    swap = tmp_path / name
    swap.mkdir()
    infinity.wrap(model, nvme_path=str(swap), param_tier="nvme", optimizer_tier="nvme")
    return model


def _opt(model, fmt):
    states = fmt if fmt == "fp32" else {"default": fmt, model: fmt}
    return infinity.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, states=states,
                                min_8bit_size=0)


def _train(model, opt, steps):
    for s in steps:
        x, y = _batch(s)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("middle", ["fp32", "8bit", "bf16"])
def test_fp32_to_format_to_fp32_resume(tmp_path, middle):
    torch.manual_seed(0)
    base = TinyGPT(CFG)
    ref = _wrap(copy.deepcopy(base), tmp_path, "ref")
    ref_opt = _opt(ref, "fp32")
    _train(ref, ref_opt, range(9))
    want = _weights(ref)

    # 3 steps fp32, save; load into a `middle` optimizer, 3 steps, save; load into fp32, 3 steps
    a = _wrap(copy.deepcopy(base), tmp_path, "a")
    opt_a = _opt(a, "fp32")
    _train(a, opt_a, range(3))
    infinity.save_checkpoint(str(tmp_path / "c1"), a, opt_a)
    b = _wrap(copy.deepcopy(base), tmp_path, "b")
    opt_b = _opt(b, middle)
    infinity.load_checkpoint(str(tmp_path / "c1"), b, opt_b)
    assert set(opt_b.state_formats().values()) == {middle}
    _train(b, opt_b, range(3, 6))
    infinity.save_checkpoint(str(tmp_path / "c2"), b, opt_b)
    c = _wrap(copy.deepcopy(base), tmp_path, "c")
    opt_c = _opt(c, "fp32")
    infinity.load_checkpoint(str(tmp_path / "c2"), c, opt_c)
    _train(c, opt_c, range(6, 9))
    got = _weights(c)
    dev = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(f"fp32 -> {middle} -> fp32: max |w - w_fp32| = {dev:.3g}")
    if middle == "fp32":
        assert dev == 0.0, dev
    else:
        assert dev <= 2 * 3 * LR, dev  # the 3 steps in `middle`, then exact fp32 steps
        assert dev > 0.0
    for m in (ref, a, b, c):
        infinity.unwrap(m)
