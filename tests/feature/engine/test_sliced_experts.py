"""Fused MoE experts (transformers 5.x: 3-D gate_up_proj/down_proj) sliced per expert by
infinity.slice_experts: the same numbers as the fused module, and, with each expert a block of
its own (infinity.expert_block_rule), an expert the router does not choose is neither read nor
stepped. Across ranks: tests/feature/sharding/test_zero3_moe.py.

Tolerances: the sliced module runs the fused module's eager forward expert by expert, so
against the eager implementation forward and gradients are bitwise equal. transformers'
default implementation (grouped_mm) sums the weight gradients in another order: 1e-6 relative.
Under infinity with everything on NVMe, losses are bitwise equal to plain PyTorch on the
sliced model and parameters within 1e-6 after 6 AdamW steps (the native Adam rounds as in
tests/feature/optim)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import infinity
from infinity.runtime.experts import ExpertSlice, SlicedExperts

EXPERTS = 8


def _qwen3_moe(impl: str = "eager", seed: int = 0, experts: int = EXPERTS, width: int = 32,
               inter: int = 16, layers: int = 2):
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=200, hidden_size=width, intermediate_size=64, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        num_experts=experts, num_experts_per_tok=2, head_dim=8, use_cache=False,
        experts_implementation=impl))


def _family(arch: str):
    from layer_major_helpers import tiny_decoder
    model = tiny_decoder(arch)
    model.config._experts_implementation = "eager"
    for m in model.modules():
        if getattr(m, "config", None) is not None and hasattr(m, "gate_up_proj"):
            m.config._experts_implementation = "eager"
    return model


def _ids(seed: int, tokens: int, vocab: int = 200):
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))


def _fused_experts(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and m.gate_up_proj.dim() == 3]


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "mixtral"])
def test_sliced_forward_and_gradients_are_the_fused_ones(arch):
    fused = _qwen3_moe() if arch == "qwen3_moe" else _family(arch)
    vocab = fused.config.vocab_size
    sliced = copy.deepcopy(fused)
    assert infinity.slice_experts(sliced) == fused.config.num_hidden_layers
    ids = _ids(1, 3, vocab)  # few tokens: some experts get none
    a = fused(input_ids=ids, labels=ids).loss
    b = sliced(input_ids=ids, labels=ids).loss
    assert torch.equal(a, b)
    a.backward()
    b.backward()
    unrouted = 0
    for f, s in zip(_fused_experts(fused), [m for m in sliced.modules() if isinstance(m, SlicedExperts)]):
        assert len(s) == f.num_experts and all(isinstance(e, ExpertSlice) for e in s)
        for e, expert in enumerate(s):
            if expert.gate_up_proj.grad is None:  # not routed: no gradient, fused has zeros
                unrouted += 1
                assert not f.gate_up_proj.grad[e].any() and not f.down_proj.grad[e].any()
                continue
            assert torch.equal(expert.gate_up_proj.grad, f.gate_up_proj.grad[e])
            assert torch.equal(expert.down_proj.grad, f.down_proj.grad[e])
    assert unrouted > 0, "every expert was routed: the case is not exercised"
    # everything outside the experts has the same gradient too
    fused_rest = {n: p.grad for n, p in fused.named_parameters() if "experts" not in n}
    for n, p in sliced.named_parameters():
        if "experts" not in n:
            assert torch.equal(p.grad, fused_rest[n]), n


def test_sliced_matches_the_default_grouped_implementation():
    fused = _qwen3_moe(impl="grouped_mm")
    sliced = copy.deepcopy(fused)
    infinity.slice_experts(sliced)
    ids = _ids(2, 12)
    a, b = fused(input_ids=ids, labels=ids).loss, sliced(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    a.backward()
    b.backward()
    f = _fused_experts(fused)[0]
    s = sliced.model.layers[0].mlp.experts
    for e in range(EXPERTS):
        if s[e].down_proj.grad is not None:
            torch.testing.assert_close(s[e].down_proj.grad, f.down_proj.grad[e], rtol=1e-6, atol=1e-9)


def test_fuse_experts_gives_the_fused_module_back():
    model = _qwen3_moe()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cls = type(model.model.layers[0].mlp.experts)
    infinity.slice_experts(model)
    assert "model.layers.0.mlp.experts.3.gate_up_proj" in model.state_dict()
    assert infinity.fuse_experts(model) == 2
    assert type(model.model.layers[0].mlp.experts) is cls
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def _train(model, steps, tmp_path=None, **settings):
    """``steps`` AdamW steps on 3-token batches (so some experts get no token); plain torch
    without ``tmp_path``."""
    if tmp_path is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        tmp_path.mkdir(parents=True, exist_ok=True)
        infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", grad_tier="nvme",
                      optimizer_tier="nvme", **settings)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses, per_step = [], []
    for step in range(steps):
        ids = _ids(10 + step, 3)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if tmp_path is not None:
            per_step.append(infinity.stats(model)["nvme_per_step"]["bytes"])
    if tmp_path is not None:
        infinity.unwrap(model)
    return losses, per_step


def test_expert_blocks_train_as_plain_torch_on_the_sliced_model(tmp_path):
    base = _qwen3_moe()
    infinity.slice_experts(base)
    ref = copy.deepcopy(base)
    want, _ = _train(ref, 6)
    model = copy.deepcopy(base)
    got, _ = _train(model, 6, tmp_path, block_rule=infinity.expert_block_rule(model))
    assert got == want
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, n
    # an expert no batch routed to kept its initial values (None gradient: not stepped)
    untouched = [n for (n, p), q in zip(base.named_parameters(), model.parameters())
                 if ".experts." in n and torch.equal(p, q)]
    assert untouched, "every expert was routed at least once: the case is not exercised"


def test_expert_blocks_read_and_step_only_the_routed_experts(tmp_path):
    """Bytes per step with everything on NVMe: 6 layers of 16 experts of 96 KiB, 3 tokens per
    step (at most 6 of a layer's 16 experts routed). The fused layer block is read (for forward
    and again for backward), written and stepped whole; with expert blocks an unrouted expert
    is not fetched, gets no gradient and is not stepped. Observed here, against the fused run:
    parameter reads 0.42-0.49x; gradients written, states and updated parameters 0.27-0.33x;
    all NVMe bytes of a step 0.30-0.39x (the expert blocks' gradients are written and read
    back, where the fused layers' are mostly stepped from RAM in backward)."""
    def run(sliced: bool, path):
        m = _qwen3_moe(experts=16, width=64, inter=128, layers=6)
        opts = {}
        if sliced:
            infinity.slice_experts(m)
            opts["block_rule"] = infinity.expert_block_rule(m)
        return _train(m, 4, path, **opts)[1]
    fused_bytes, sliced_bytes = run(False, tmp_path / "fused"), run(True, tmp_path / "sliced")
    for f, s in zip(fused_bytes[1:], sliced_bytes[1:]):  # after the first step's fill
        for kind in ("grads_written", "states_read", "states_written", "params_written"):
            assert s[kind] < 0.45 * f[kind], (kind, s[kind], f[kind])
        assert s["params_read"] < 0.6 * f["params_read"], (s, f)
        assert sum(s.values()) < 0.55 * sum(f.values()), (s, f)


def test_bad_input_is_refused_with_the_remedy(tmp_path):
    torch.manual_seed(0)
    oss = GptOssForCausalLM(GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False))
    with pytest.raises(ValueError, match="cannot be sliced.*leave its experts fused"):
        infinity.slice_experts(oss)
    assert _fused_experts(oss), "a refused model is left as it was"
    plain = _qwen3_moe()
    with pytest.raises(ValueError, match="no sliced experts.*slice_experts"):
        infinity.expert_block_rule(plain)
    infinity.wrap(plain, nvme_path=str(tmp_path))
    with pytest.raises(RuntimeError, match="before infinity.wrap"):
        infinity.slice_experts(plain)
    infinity.unwrap(plain)
    infinity.slice_experts(plain)
    infinity.wrap(plain, nvme_path=str(tmp_path))
    with pytest.raises(RuntimeError, match="unwrap first"):
        infinity.fuse_experts(plain)
    infinity.unwrap(plain)


@pytest.mark.parametrize("sliced", [False, True], ids=["fused", "sliced"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_meta_moe_loads_from_a_checkpoint_stored_per_expert(tmp_path, arch, sliced):
    """Published MoE checkpoints (and save_pretrained) keep one tensor per expert and
    projection (Mixtral: w1/w3/w2 under block_sparse_moe); a model built on meta, fused or
    sliced, is filled from them block by block and computes as the model from_pretrained
    loads."""
    import transformers as tf
    ref = _qwen3_moe() if arch == "qwen3_moe" else _family("mixtral")
    folder = str(tmp_path / "ckpt")
    ref.save_pretrained(folder)
    loaded = type(ref).from_pretrained(folder, experts_implementation="eager")
    with infinity.empty_init():
        model = type(ref)(tf.AutoConfig.from_pretrained(folder, experts_implementation="eager"))
    if sliced:
        infinity.slice_experts(model)
        infinity.slice_experts(loaded)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", source=folder)
    ids = _ids(3, 6, ref.config.vocab_size)
    assert torch.equal(model(input_ids=ids, labels=ids).loss, loaded(input_ids=ids, labels=ids).loss)
    infinity.unwrap(model)
    want = loaded.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_per_expert_checkpoint_of_another_shape_is_refused(tmp_path):
    """A checkpoint whose per-expert tensors do not add up to the model's experts weight is
    refused naming the parameter and the shape, before anything is trained."""
    from infinity.runtime.homes.sources import SourceError
    folder = str(tmp_path / "ckpt")
    _qwen3_moe().save_pretrained(folder)
    with infinity.empty_init():
        model = _qwen3_moe(inter=24)  # wider experts than the checkpoint's 16
    with pytest.raises(SourceError, match="per-expert tensors.*do not add up"):
        infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", source=folder)
