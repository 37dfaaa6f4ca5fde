"""Activation offload on CUDA (pinned host buffers, side-stream copies): same losses and
gradients as without offload, and fetched activations counted. Skipped without a GPU; this
path has NOT run in this project's CI (no GPU there)."""
import copy
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = GPTConfig(vocab_size=128, d_model=64, n_layers=3, n_heads=4, max_seq=128)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_cuda_activation_offload_matches_no_offload(tier, tmp_path):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        base = TinyGPT(CFG)
        g = torch.Generator().manual_seed(1)
        data = [synthetic_batch(CFG, 2, 128, g) for _ in range(3)]
        runs = []
        for kw in ({}, dict(activation_tier=tier, activation_min_bytes=4096)):
            model = infinity.wrap(copy.deepcopy(base), nvme_path=str(tmp_path), device="cuda",
                                  param_tier="host", **kw)
            losses, grads = [], []
            with sdpa_kernel(SDPBackend.MATH):
                for x, y in data:
                    model._infinity_engine.zero_grad()
                    loss = lm_loss(model(x.cuda()), y.cuda())
                    loss.backward()
                    losses.append(loss.item())
            torch.cuda.synchronize()
            grads = [infinity.gradient(p).clone() for p in model.parameters()]
            stats = infinity.stats(model)
            infinity.unwrap(model)
            runs.append((losses, grads, stats))
        assert runs[0][0] == runs[1][0]
        for a, b in zip(runs[0][1], runs[1][1]):
            assert torch.equal(a, b)
        act = runs[1][2]["activations"]
        assert act["last_step"]["offloaded_bytes"] > 0
        assert act["last_step"]["fetched_bytes"] == act["last_step"]["offloaded_bytes"]
        assert act["device"]["now"] == 0
    finally:
        torch.use_deterministic_algorithms(False)
