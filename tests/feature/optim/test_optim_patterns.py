"""Usage patterns x every tier combination, trained for several optimizer steps.

Each pattern (activation checkpointing, reentrant and not; a module called twice in one
forward; dynamic control flow; frozen parameters; tied weights with gradient accumulation;
parameters and state_dict() read between steps) is trained for STEPS steps on a wrapped model,
for every param_tier {device, host, nvme} x grad_tier {host, nvme} x optimizer_tier {host, nvme},
and compared with the same model unwrapped, trained by torch.optim.AdamW(fused=True) with the
same lr / weight decay: losses equal (fp32: list equality), every value read outside forward and
the final weights within rtol=1e-6, atol=1e-7 (in practice bitwise equal; see test_optim.py).

The reference run of each pattern is made once (module-scoped fixture).
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, max_seq=16)
BATCH, SEQ = 2, 8
STEPS = 5
LR, WD = 1e-2, 0.1
FP32_TOL = dict(rtol=1e-6, atol=1e-7)
TIERS = list(itertools.product(["device", "host", "nvme"], ["host", "nvme"], ["host", "nvme"]))
TIER_IDS = [f"p{p}-g{g}-o{o}" for p, g, o in TIERS]


class _Net(TinyGPT):
    """TinyGPT (head tied to the embedding) with the pattern's forward.

    ckpt: None, "reentrant" or "non_reentrant" (torch.utils.checkpoint around each layer);
    reuse: layers[0] runs again after the last layer (one module used twice per forward);
    skip: indices of layers the next forward leaves out (set by the training loop).
    """

    def __init__(self, ckpt: Optional[str] = None, reuse: bool = False) -> None:
        super().__init__(CFG)
        self.ckpt = ckpt
        self.reuse = reuse
        self.skip: FrozenSet[int] = frozenset()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        order = [i for i in range(len(self.layers)) if i not in self.skip]
        if self.reuse:
            order.append(0)
        for i in order:
            layer = self.layers[i]
            if self.ckpt is None:
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=self.ckpt == "reentrant")
        return self.lm_head(self.ln_f(x))


def _freeze_lora_style(model: _Net) -> None:
    """layers.0 wholly frozen; in layers 1-2 only the MLP input projection (fc) trains; pos
    frozen; tok (= lm_head, tied) and ln_f train. Blocks: frozen, partly frozen, root mixed."""
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            p.requires_grad_(not name.startswith("layers.0.") and ".fc." in name)
        elif name.startswith("pos."):
            p.requires_grad_(False)


def _no_skip(step: int, micro: int) -> FrozenSet[int]:
    return frozenset()


def _dynamic_skip(step: int, micro: int) -> FrozenSet[int]:
    """By step index: steps 1 and 4 leave layer 1 out of every micro-batch (its parameters get
    no gradient: torch's AdamW skips them, no decay, no step count); step 2 leaves layer 2 out
    of micro-batch 0 only; steps 0 and 3 run every layer."""
    if step % 3 == 1:
        return frozenset({1})
    if step % 3 == 2 and micro == 0:
        return frozenset({2})
    return frozenset()


@dataclass(frozen=True)
class Pattern:
    name: str
    ckpt: Optional[str] = None
    reuse: bool = False
    freeze: bool = False
    micro: int = 1
    skip: Callable[[int, int], FrozenSet[int]] = _no_skip
    observe: bool = False  # read parameters and state_dict() outside forward every step

    def build(self) -> _Net:
        torch.manual_seed(0)
        model = _Net(self.ckpt, self.reuse)
        if self.freeze:
            _freeze_lora_style(model)
        return model


PATTERNS = [
    Pattern("ckpt_reentrant", ckpt="reentrant"),
    Pattern("ckpt_non_reentrant", ckpt="non_reentrant"),
    Pattern("module_twice", reuse=True),
    Pattern("dynamic_skip", micro=2, skip=_dynamic_skip),
    Pattern("frozen_lora", freeze=True),
    Pattern("tied_accumulate", micro=2),
    Pattern("read_outside_forward", observe=True, micro=2),
]


def _observe(model: torch.nn.Module) -> Tuple[torch.Tensor, float, Dict[str, torch.Tensor]]:
    """What a logger / EMA / checkpointer reads between steps: each parameter's sum, the sum of
    all of them, and every state_dict() value (copied)."""
    with torch.no_grad():
        sums = torch.stack([p.detach().float().sum() for p in model.parameters()])
        total = float(sum(p.detach().float().sum() for p in model.parameters()))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return sums, total, state


def _train(model: _Net, opt: torch.optim.Optimizer, pat: Pattern):
    gen = torch.Generator().manual_seed(1)
    losses: List[float] = []
    seen = [_observe(model)] if pat.observe else []
    for step in range(STEPS):
        total = 0.0
        for micro in range(pat.micro):
            model.skip = pat.skip(step, micro)
            x, y = synthetic_batch(CFG, BATCH, SEQ, gen)
            loss = lm_loss(model(x), y) / pat.micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if pat.observe:
            seen.append(_observe(model))
    model.skip = frozenset()
    return losses, seen


@pytest.fixture(scope="module", params=PATTERNS, ids=[p.name for p in PATTERNS])
def reference(request):
    pat: Pattern = request.param
    base = pat.build()
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    losses, seen = _train(model, opt, pat)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return pat, base, losses, seen, weights


def _assert_seen_equal(seen, ref_seen) -> None:
    assert len(seen) == len(ref_seen)
    for step, ((sums, total, state), (r_sums, r_total, r_state)) in enumerate(
            zip(seen, ref_seen)):
        torch.testing.assert_close(sums, r_sums, **FP32_TOL,
                                   msg=lambda m: f"after step {step}, parameter sums: {m}")
        assert total == pytest.approx(r_total, rel=1e-6, abs=1e-6), step
        assert list(state) == list(r_state), step
        for k in r_state:
            torch.testing.assert_close(state[k], r_state[k], **FP32_TOL,
                                       msg=lambda m: f"after step {step}, state_dict {k}: {m}")


@pytest.mark.parametrize("param_tier,grad_tier,optimizer_tier", TIERS, ids=TIER_IDS)
def test_pattern_trains_like_torch(reference, tmp_path, param_tier, grad_tier, optimizer_tier):
    pat, base, ref_losses, ref_seen, ref_weights = reference
    model = copy.deepcopy(base)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier=param_tier, grad_tier=grad_tier,
                  optimizer_tier=optimizer_tier)
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    try:
        losses, seen = _train(model, opt, pat)
        assert set(opt.state_tiers.values()) == {optimizer_tier}
        # no block stays pinned in forward across steps (checkpoint recompute regression)
        assert all(b.active_forward == 0 for b in model._infinity_engine.blocks)
        assert model.lm_head.weight is model.tok.weight
    finally:
        opt.close()
        infinity.unwrap(model)
    assert model.lm_head.weight is model.tok.weight
    assert losses == ref_losses
    if pat.observe:
        _assert_seen_equal(seen, ref_seen)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_weights[name], **FP32_TOL,
                                   msg=lambda m: f"{name}: {m}")
    if pat.freeze:
        for (name, p), q in zip(model.named_parameters(), base.parameters()):
            if not p.requires_grad:
                assert torch.equal(p, q), f"frozen {name} changed"


# =========================================================================================
# bf16 compute with fp32 homes: host blocks are not resident (cast at each fetch)
# =========================================================================================
BF16_STEPS = 4


def _train_bf16_reference(master: _Net) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """What infinity does with compute_dtype=bf16 and fp32 homes, in plain torch: a bf16 copy
    computes forward/backward; its bf16 gradients, cast to fp32, feed torch's fused AdamW on the
    fp32 master; after each step the bf16 copy is re-rounded (nearest even) from the master."""
    work = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD, fused=True)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(BF16_STEPS):
        x, y = synthetic_batch(CFG, BATCH, SEQ, gen)
        loss = lm_loss(work(x), y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for m, w in zip(master.parameters(), work.parameters()):
                m.grad = None if w.grad is None else w.grad.float()
                w.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, w in zip(master.parameters(), work.parameters()):
                w.copy_(m)
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


@pytest.fixture(scope="module")
def bf16_reference():
    out = {}
    for ckpt in ("reentrant", "non_reentrant"):
        base = Pattern("bf16", ckpt=ckpt).build()
        out[ckpt] = (base, _train_bf16_reference(copy.deepcopy(base)))
    return out


@pytest.mark.parametrize("grad_tier,optimizer_tier",
                         list(itertools.product(["host", "nvme"], ["host", "nvme"])),
                         ids=lambda t: t)
@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant"])
def test_checkpointing_bf16_compute_host_params(bf16_reference, tmp_path, ckpt, grad_tier,
                                                optimizer_tier):
    """param_tier=host, compute_dtype=bf16: each block is cast into a bf16 compute buffer at
    fetch and released after use, so checkpoint recompute must fetch it again. Same
    operations in the same dtypes as the reference: exact (losses equal, weights at the fp32
    tolerance)."""
    base, (ref_losses, ref_weights) = bf16_reference[ckpt]
    model = copy.deepcopy(base)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="host", grad_tier=grad_tier,
                  optimizer_tier=optimizer_tier, compute_dtype=torch.bfloat16)
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    try:
        engine = model._infinity_engine
        assert all(f.home_dtype == torch.float32 and f.compute_dtype == torch.bfloat16
                   for f in engine.flats)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(BF16_STEPS):
            x, y = synthetic_batch(CFG, BATCH, SEQ, gen)
            loss = lm_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        assert all(b.active_forward == 0 for b in engine.blocks)
        s = infinity.stats(model)
        assert s["releases"] > 0 and s["fetches"] > 0  # blocks really came and went
    finally:
        opt.close()
        infinity.unwrap(model)
    assert losses == ref_losses
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_weights[name], **FP32_TOL,
                                   msg=lambda m: f"{name}: {m}")
