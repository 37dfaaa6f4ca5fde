"""Shared helpers for the engine tests: a reference/wrapped model pair and gradient checks."""
from __future__ import annotations

import copy
import threading
from typing import Dict, List, Tuple

import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

SMALL = GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, max_seq=64)


def pair(cfg: GPTConfig = SMALL, seed: int = 0, **wrap_kwargs) -> Tuple[TinyGPT, TinyGPT]:
    torch.manual_seed(seed)
    ref = TinyGPT(cfg)
    wrapped = copy.deepcopy(ref)
    infinity.wrap(wrapped, **wrap_kwargs)
    return ref, wrapped


def batches(cfg: GPTConfig, n: int, batch: int = 4, seq: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [synthetic_batch(cfg, batch, seq, g) for _ in range(n)]


def grads_of(ref: torch.nn.Module, wrapped: torch.nn.Module) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, reference grad, engine grad) for every parameter with a reference gradient."""
    out = []
    wrapped_params: Dict[str, torch.Tensor] = dict(wrapped.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        g = infinity.gradient(wrapped_params[name])
        out.append((name, p.grad, g))
    return out


def assert_grads_equal(ref, wrapped, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    pairs = grads_of(ref, wrapped)
    if not pairs:
        raise AssertionError("reference model has no gradients to compare")
    for name, g_ref, g in pairs:
        if g is None:
            raise AssertionError(f"{name}: engine has no gradient")
        torch.testing.assert_close(g.float(), g_ref.float(), rtol=rtol, atol=atol, msg=name)


def loss_of(model, x, y) -> torch.Tensor:
    return lm_loss(model(x), y)


def assert_tensors_equal(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> None:
    """Each tensor of ``got`` is bitwise equal to ``want``'s of the same name."""
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


def assert_optimizer_states_equal(want: Dict, got: Dict) -> None:
    """Each state tensor of optimizer state_dict ``want`` is bitwise equal in ``got``."""
    for i, e in want["state"].items():
        for name, t in e.items():
            assert torch.equal(t, got["state"][i][name]), (i, name)


def check_grads_then_step(ref, model, opt_ref, opt, step: int) -> None:
    """Each gradient of the wrapped ``model`` bitwise the reference's (parameters in the same
    order), then both optimizers step and zero their gradients."""
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, infinity.gradient(q)), (step, name)
    opt_ref.step(), opt.step()
    opt_ref.zero_grad(), opt.zero_grad()


def assert_params_bitwise(ref, model) -> None:
    """Each parameter of the wrapped ``model`` bitwise the reference's (same order)."""
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def all_buffers_free(pool) -> bool:
    """Every buffer of ``pool`` (a HostPool) can be acquired at once, from another thread
    within 10 s: none is kept by a failed write."""
    got: List[torch.Tensor] = []
    done = threading.Event()

    def take() -> None:
        for _ in range(pool.count):
            got.append(pool.acquire())
        done.set()

    threading.Thread(target=take, daemon=True).start()
    ok = done.wait(timeout=10.0)
    for buf in got:
        pool.release(buf)
    return ok
