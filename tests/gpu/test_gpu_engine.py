"""The engine's parity and prefetch tests on CUDA: pinned host buffers, host->device copies on a
side stream, device->host gradient copies with events. Skipped where there is no GPU; run them
on a GPU machine with `python -m pytest tests/gpu -q`."""
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import infinity  # noqa: E402
from engine_helpers import SMALL, batches  # noqa: E402
from infinity.models import GPTConfig, TinyGPT, lm_loss  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _pair(**kw):
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ref = copy.deepcopy(model).cuda()
    infinity.wrap(model, **kw)
    return ref, model


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_cuda_parity_fp32(tier, tmp_path):
    ref, wrapped = _pair(param_tier=tier, nvme_path=str(tmp_path))
    assert next(wrapped.parameters()).device.type == "cuda"
    for x, y in batches(SMALL, 3):
        x, y = x.cuda(), y.cuda()
        ref.zero_grad()
        wrapped._infinity_engine.zero_grad()
        l_ref = lm_loss(ref(x), y)
        l_ref.backward()
        l = lm_loss(wrapped(x), y)
        l.backward()
        torch.testing.assert_close(l, l_ref, rtol=1e-6, atol=1e-6)
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), wrapped.named_parameters()):
            g = infinity.gradient(p)
            torch.testing.assert_close(g.cuda(), p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_cuda_prefetch_hits_and_budget(tmp_path):
    cfg = GPTConfig(vocab_size=512, d_model=256, n_layers=12, n_heads=4, max_seq=128)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    layer = sum(p.numel() for p in model.layers[0].parameters()) * 4
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers")) * 4
    budget = root + 3 * layer + 65536
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", device_budget=budget,
                  prefetch_window=2)
    data = [(x.cuda(), y.cuda()) for x, y in batches(cfg, 4, batch=8, seq=128)]
    x, y = data[0]
    lm_loss(model(x), y).backward()
    infinity.stats(model, reset=True)
    for x, y in data[1:]:
        model._infinity_engine.zero_grad()
        lm_loss(model(x), y).backward()
    torch.cuda.synchronize()
    s = infinity.stats(model)
    assert s["tiers"]["device"]["peak"] <= budget
    assert s["prefetch_hit_rate"] >= 0.9, s


def test_cuda_pinned_host_buffers():
    buf = infinity.io.aligned_empty(1 << 20, torch.float32)
    assert buf.is_pinned()
    assert buf.data_ptr() % 4096 == 0
