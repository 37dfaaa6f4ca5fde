"""infinity.accumulate gives the plain micro-batch loop's numbers: gradients bitwise against
plain PyTorch, parameters after several steps against torch AdamW (1e-6) and bitwise against
infinity's own plain loop, with clipping that fires, bf16 weights with 8-bit states, a full
Llama-3 vocabulary and a Qwen3-MoE config."""
import copy

import pytest
import torch

import infinity
import infinity.optim
from layer_major_helpers import (
    NVME,
    batches,
    grads_of,
    llama,
    plain_backward,
    qwen3_moe,
    tiny_decoder,
    wrapped,
)


def _same_grads(ref, got, rtol=0.0, atol=0.0):
    assert ref.keys() == got.keys()
    for name in ref:
        if rtol == 0.0 and atol == 0.0:
            assert torch.equal(ref[name], got[name]), name
        else:
            torch.testing.assert_close(got[name], ref[name], rtol=rtol, atol=atol, msg=name)


def test_plain_model_gradients_bitwise():
    model = llama()
    twin = copy.deepcopy(model)
    mbs = batches(4, 1000, seed=1, rows=2)
    ref_losses = plain_backward(model, mbs)
    losses = infinity.accumulate(twin, mbs)
    assert [float(x) for x in losses] == ref_losses
    _same_grads({n: p.grad for n, p in model.named_parameters()},
                {n: p.grad for n, p in twin.named_parameters()})


def _three_runs(tmp_path):
    """Plain PyTorch, a layer-major and a plain-loop wrapped model (all on NVMe), one
    initialisation, each with its AdamW."""
    model = llama()
    ref, lm, plain = copy.deepcopy(model), wrapped(model, tmp_path / "a", **NVME), \
        wrapped(model, tmp_path / "b", **NVME)
    opts = (torch.optim.AdamW(ref.parameters(), lr=1e-3),
            infinity.optim.AdamW(lm.parameters(), lr=1e-3),
            infinity.optim.AdamW(plain.parameters(), lr=1e-3))
    return ref, lm, plain, opts


def _step_all(opts):
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _same_weights(ref, lm, plain):
    """Layer-major against torch AdamW within 1e-6, against infinity's plain loop bitwise."""
    want, got, own = ref.state_dict(), lm.state_dict(), plain.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
        assert torch.equal(got[name], own[name]), name


@pytest.mark.parametrize("k", [1, 4, 16])
def test_wrapped_nvme_fp32_matches_torch_over_steps(tmp_path, k):
    ref, lm, plain, opts = _three_runs(tmp_path)
    for step in range(3):
        mbs = batches(k, 1000, seed=10 + step)
        ref_losses = plain_backward(ref, mbs)
        losses = [float(x) for x in infinity.accumulate(lm, mbs)]
        assert losses == plain_backward(plain, mbs)  # infinity's plain loop: bitwise
        if step == 0:  # same weights as torch: losses and gradients bit for bit
            assert losses == ref_losses
            _same_grads({n: p.grad for n, p in ref.named_parameters()}, grads_of(lm))
        _step_all(opts)
    _same_weights(ref, lm, plain)


def test_clipping_that_fires(tmp_path):
    ref, lm, plain, opts = _three_runs(tmp_path)
    _, opt_lm, opt_plain = opts
    for step in range(4):
        mbs = batches(4, 1000, seed=20 + step)
        plain_backward(ref, mbs)
        infinity.accumulate(lm, mbs)
        plain_backward(plain, mbs)
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norm_lm = opt_lm.clip_grad_norm_(0.05)
        norm_plain = opt_plain.clip_grad_norm_(0.05)
        assert float(norm_ref) > 0.05  # the clip fires
        assert float(norm_lm) == float(norm_plain)
        torch.testing.assert_close(norm_lm, norm_ref, rtol=1e-6, atol=0)
        _step_all(opts)
    _same_weights(ref, lm, plain)


def test_bf16_weights_8bit_states_match_own_plain_loop(tmp_path):
    model = llama().to(torch.bfloat16)
    lm, plain = wrapped(model, tmp_path / "a", **NVME), wrapped(model, tmp_path / "b", **NVME)
    opts = [infinity.optim.AdamW(m.parameters(), lr=1e-3, states="8bit", min_8bit_size=0)
            for m in (lm, plain)]
    for step in range(3):
        mbs = batches(4, 1000, seed=30 + step)
        infinity.accumulate(lm, mbs)
        plain_backward(plain, mbs)
        if step == 0:
            _same_grads(grads_of(plain), grads_of(lm))
        _step_all(opts)
    own, got = plain.state_dict(), lm.state_dict()
    for name in own:
        assert torch.equal(got[name], own[name]), name


def test_full_llama3_vocabulary(tmp_path):
    """LlamaConfig's published vocabulary (128256) at a small width: the embedding and head
    are outer blocks (the head tiled where "auto" says so)."""
    model = llama(vocab_size=128256, hidden_size=64, num_hidden_layers=2)
    ref, lm = copy.deepcopy(model), wrapped(model, tmp_path, **NVME)
    mbs = batches(4, 128256, seed=40)
    ref_losses = plain_backward(ref, mbs)
    losses = infinity.accumulate(lm, mbs)
    torch.testing.assert_close(torch.tensor([float(x) for x in losses]),
                               torch.tensor(ref_losses), rtol=4e-6, atol=0)
    tiled = infinity.stats(lm)["tiled_head"]["on"]
    _same_grads({n: p.grad for n, p in ref.named_parameters()}, grads_of(lm),
                rtol=4e-6 if tiled else 0.0, atol=1e-9 if tiled else 0.0)


def test_qwen3_moe(tmp_path):
    model = qwen3_moe()
    ref, lm = copy.deepcopy(model), wrapped(model, tmp_path, **NVME)
    mbs = batches(4, 500, seed=50, tokens=12)
    plain_backward(ref, mbs)
    infinity.accumulate(lm, mbs)
    _same_grads({n: p.grad for n, p in ref.named_parameters() if p.grad is not None},
                grads_of(lm))


def test_dropout_masks_replayed_in_recomputation():
    """k = 1 draws the random numbers in the plain loop's order (layer 0, 1, ...): with
    attention dropout on, the gradients are the plain loop's only if each layer's
    recomputation replays the masks its forward drew."""
    model = llama(attention_dropout=0.5)
    twin = copy.deepcopy(model)
    model.train(), twin.train()
    mbs = batches(1, 1000, seed=60)
    torch.manual_seed(123)
    plain_backward(model, mbs)
    torch.manual_seed(123)
    infinity.accumulate(twin, mbs)
    _same_grads({n: p.grad for n, p in model.named_parameters()},
                {n: p.grad for n, p in twin.named_parameters()})


def test_host_tier_and_train_on_with_plain_loop(tmp_path):
    """Host homes; a layer-major step, then plain-loop steps on the same engine, then
    layer-major again: all equal to a model trained with the plain loop throughout."""
    model = llama()
    lm, plain = wrapped(model, tmp_path / "a"), wrapped(model, tmp_path / "b")
    opts = [infinity.optim.AdamW(m.parameters(), lr=1e-3) for m in (lm, plain)]
    for step, layer_major in enumerate([True, False, True, True]):
        mbs = batches(3, 1000, seed=70 + step)
        if layer_major:
            infinity.accumulate(lm, mbs)
        else:
            plain_backward(lm, mbs)
        plain_backward(plain, mbs)
        _step_all(opts)
    own, got = plain.state_dict(), lm.state_dict()
    for name in own:
        assert torch.equal(got[name], own[name]), name


@pytest.mark.parametrize("arch", ["gemma3", "mixtral", "olmoe", "qwen2", "mistral"])
def test_other_decoder_families(tmp_path, arch):
    """Gemma-3's per-layer masks (sliding window 4 < 12 tokens, then full attention) are
    recorded per layer; MoE layers with fused experts are blocks like any other."""
    model = tiny_decoder(arch)
    ref, lm = copy.deepcopy(model), wrapped(model, tmp_path, **NVME)
    mbs = batches(3, 500, seed=80, tokens=12)
    ref_losses = plain_backward(ref, mbs)
    assert [float(x) for x in infinity.accumulate(lm, mbs)] == ref_losses
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = grads_of(lm)
    tied = "model.embed_tokens.weight" if ref.config.tie_word_embeddings else None
    if tied is not None:
        # a tied embedding's sum runs in another order: the head's part of every
        # micro-batch first (the tail), then the lookups' (the plain loop alternates them)
        torch.testing.assert_close(got.pop(tied), want.pop(tied), rtol=1e-6, atol=1e-8)
    _same_grads(want, got)


def test_checkpoint_right_after_step_then_resume_and_train_on(tmp_path):
    """A checkpoint saved right after a layer-major step, loaded into a fresh wrapped model,
    trains on exactly as the run that never stopped."""
    model = llama()
    run = wrapped(model, tmp_path / "a", **NVME)
    opt = infinity.optim.AdamW(run.parameters(), lr=1e-3)
    steps = [batches(4, 1000, seed=90 + s) for s in range(3)]
    infinity.accumulate(run, steps[0])
    _step_all([opt])
    infinity.save_checkpoint(str(tmp_path / "ckpt"), run, opt)
    resumed = wrapped(llama(seed=1), tmp_path / "b", **NVME)  # other weights: all overwritten
    opt2 = infinity.optim.AdamW(resumed.parameters(), lr=1e-3)
    infinity.load_checkpoint(str(tmp_path / "ckpt"), resumed, opt2)
    for mbs in steps[1:]:
        infinity.accumulate(run, mbs)
        infinity.accumulate(resumed, mbs)
        _step_all([opt, opt2])
    want, got = run.state_dict(), resumed.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name
