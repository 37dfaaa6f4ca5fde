"""Forward/backward parity with plain PyTorch, parameters on host and on NVMe (fp32: exact)."""
import pytest
import torch
from engine_helpers import SMALL, assert_grads_equal, batches, loss_of, pair

import infinity


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_parity_fp32_with_grad_accumulation(tier, tmp_path):
    ref, wrapped = pair(param_tier=tier, nvme_path=str(tmp_path), prefetch_window=2)
    data = batches(SMALL, 6)
    for step in range(3):  # 3 steps x 2 micro-batches, gradients accumulated across micro-batches
        ref.zero_grad(set_to_none=True)
        wrapped._infinity_engine.zero_grad()
        for x, y in data[2 * step:2 * step + 2]:
            l_ref = loss_of(ref, x, y)
            l_ref.backward()
            l_wrapped = loss_of(wrapped, x, y)
            l_wrapped.backward()
            # same ops on the same values: bitwise identical in fp32
            assert torch.equal(l_ref.detach(), l_wrapped.detach()), (step, l_ref, l_wrapped)
        assert_grads_equal(ref, wrapped, rtol=0, atol=0)
    s = infinity.stats(wrapped)
    if tier == "nvme":
        assert s["moved"]["nvme_to_host"] > 0 and s["tiers"]["nvme"]["now"] > 0
    for (name, p), p_ref in zip(wrapped.named_parameters(), ref.parameters()):
        # p.grad is the gradient, as torch would have it: the host accumulator itself, or a
        # memory map of the gradient swap file
        assert p.grad is not None and torch.equal(p.grad, p_ref.grad), name
        if tier == "host":
            assert p.grad.data_ptr() == infinity.gradient(p).data_ptr(), name


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_parity_compute_dtype_bf16(tier, tmp_path):
    """A requested working dtype is applied per block at fetch; the home copy stays fp32."""
    ref, wrapped = pair(param_tier=tier, nvme_path=str(tmp_path), compute_dtype=torch.bfloat16)
    ref_bf16 = __import__("copy").deepcopy(ref).to(torch.bfloat16)
    (x, y), = batches(SMALL, 1)
    l_ref = loss_of(ref_bf16, x, y)
    l_ref.backward()
    l = loss_of(wrapped, x, y)
    l.backward()
    assert torch.equal(l_ref.detach(), l.detach())
    assert_grads_equal(ref_bf16, wrapped, rtol=0, atol=0)
    assert all(f.home_dtype == torch.float32 for f in wrapped._infinity_engine.flats)


def test_unwrap_restores_plain_module(tmp_path):
    ref, wrapped = pair(param_tier="nvme", nvme_path=str(tmp_path))
    (x, y), = batches(SMALL, 1)
    with torch.no_grad():
        expected = ref(x)
    infinity.unwrap(wrapped)
    assert not hasattr(wrapped, "_infinity_engine")
    with torch.no_grad():
        assert torch.equal(wrapped(x), expected)
    for (n, p), (_, q) in zip(ref.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(p, q), n
    assert wrapped.lm_head.weight is wrapped.tok.weight  # tying survives
    assert not list(tmp_path.iterdir())  # swap directory removed
