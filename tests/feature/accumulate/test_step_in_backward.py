"""infinity.accumulate(..., optimizer=opt): the whole optimizer step, each block stepped from
RAM as its gradients complete, committed in place. The numbers are the plain loop's (bitwise
against infinity's own plain loop, 1e-6 against torch AdamW), with and without clipping that
fires, over several steps; no gradient is written and the gradient files take no disk."""
import copy

import pytest
import torch

import infinity
import infinity.optim
from infinity.runtime.core.registry import engine_of
from layer_major_helpers import NVME, batches, llama, plain_backward, wrapped

VOCAB = 32000  # a real vocabulary: the embedding and the head are blocks of their own


def _runs(tmp_path, states="fp32", **model_kw):
    """Plain PyTorch, a layer-major and a plain-loop wrapped model (all on NVMe)."""
    model = llama(vocab_size=VOCAB, **model_kw)
    ref, lm, plain = copy.deepcopy(model), wrapped(model, tmp_path / "a", **NVME), \
        wrapped(model, tmp_path / "b", **NVME)
    opts = (torch.optim.AdamW(ref.parameters(), lr=1e-3),
            infinity.optim.AdamW(lm.parameters(), lr=1e-3, states=states),
            infinity.optim.AdamW(plain.parameters(), lr=1e-3, states=states))
    return ref, lm, plain, opts


def _plain_step(model, opt, mbs, clip):
    plain_backward(model, mbs)
    norm = None
    if clip is not None:
        clipper = getattr(opt, "clip_grad_norm_", None)
        norm = clipper(clip) if clipper else torch.nn.utils.clip_grad_norm_(
            model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return norm


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("k", [1, 4])
def test_matches_plain_loop_over_steps(tmp_path, k, clip):
    ref, lm, plain, (o_ref, o_lm, o_plain) = _runs(tmp_path)
    for step in range(3):
        mbs = batches(k, VOCAB, seed=30 + step)
        norm_ref = _plain_step(ref, o_ref, mbs, clip)
        norm_plain = _plain_step(plain, o_plain, mbs, clip)
        infinity.stats(lm, reset=True)
        losses = infinity.accumulate(lm, mbs, optimizer=o_lm, max_grad_norm=clip)
        assert len(losses) == k
        st = infinity.stats(lm)
        grads_written = st["nvme_per_step"]["bytes"]["grads_written"]
        if clip is None:
            assert st["accumulate"]["grad_norm"] is None
        else:
            assert float(norm_ref) > clip  # the clip fires
            assert st["accumulate"]["grad_norm"] == float(norm_plain)
            torch.testing.assert_close(torch.tensor(st["accumulate"]["grad_norm"]),
                                       norm_ref, rtol=1e-6, atol=0)
        # no gradient is written, the root block's (the final norm) included: it is closed
        # once the step's last backward ran, and stepped from RAM as the layers are; with a
        # clip, the measuring pass writes none either
        assert grads_written == 0, grads_written
        assert st["swap"]["gradients"] == 0  # no gradient file took disk
        assert o_lm.last_step_stats.overlapped_shards > 0  # blocks stepped in backward
    want, got, own = ref.state_dict(), lm.state_dict(), plain.state_dict()
    # against torch: the clip coefficient comes from a norm that rounds within 1e-6 of
    # torch's, and Adam's m / sqrt(v) magnifies that on embedding rows with tiny gradients
    # (infinity's own plain loop shows the same 2.3e-6 after 3 steps)
    atol = 1e-6 if clip is None else 1e-5
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=name)
        assert torch.equal(got[name], own[name]), name
    # the optimizer's states equal the plain loop's, bit for bit
    sd_lm, sd_plain = o_lm.state_dict(), o_plain.state_dict()
    for i, st in sd_plain["state"].items():
        for key, value in st.items():
            got_v = sd_lm["state"][i][key]
            assert torch.equal(torch.as_tensor(got_v), torch.as_tensor(value)), (i, key)


@pytest.mark.parametrize("vocab, clip", [(64, None), (64, 0.05), (4000, None)])
def test_gradients_over_one_pool_buffer_are_stepped_chunk_by_chunk(tmp_path, vocab, clip):
    """chunk_bytes far below a layer's gradient (as a Llama-3.1-8B layer's 832 MiB against
    6 GiB's 192 MiB chunks): the gradient pool grows for the step to hold a whole layer, so
    the micro-batches add to its chunks in RAM; each block is stepped in backward from its
    chunks, those in RAM and those written out, and no gradient file keeps disk after the
    step. Vocabulary 64: the embedding's and the head's gradients fit one buffer, and
    nothing is written. 4000: theirs (2 MiB) are not held whole, and their
    chunks go to disk and back between micro-batches. With a clip that fires, the measuring
    pass measures the layers' slots larger than a chunk from their chunks in RAM, so it writes
    nothing either. Bitwise infinity's plain loop."""
    chunk = 64 << 10  # a layer's gradient: 964 KiB, 16 chunks
    model = llama(vocab_size=vocab, hidden_size=128, intermediate_size=512)
    lm = wrapped(model, tmp_path / "a", chunk_bytes=chunk, **NVME)
    plain = wrapped(model, tmp_path / "b", chunk_bytes=chunk, **NVME)
    o_lm = infinity.optim.AdamW(lm.parameters(), lr=1e-3)
    o_plain = infinity.optim.AdamW(plain.parameters(), lr=1e-3)
    engine = engine_of(lm)
    layers = [f for b in engine.blocks if b.kind == "layer" for f in b.flats]
    assert min(f.numel * 4 for f in layers) > 8 * chunk
    blocks = sum(1 for b in engine.blocks if any(f.trainable for f in b.flats))  # root too
    pool = engine.grads.host_bytes()
    for step in range(3):
        mbs = batches(4, vocab, seed=80 + step)
        norm = _plain_step(plain, o_plain, mbs, clip)
        infinity.stats(lm, reset=True)
        infinity.accumulate(lm, mbs, optimizer=o_lm, max_grad_norm=clip)
        assert o_lm.last_step_stats.overlapped_shards == blocks
        st = infinity.stats(lm)
        written = st["nvme_per_step"]["bytes"]["grads_written"]
        outer = sum(f.numel * 4 for b in engine.blocks if b.kind != "layer" and not b.is_root
                    for f in b.flats)
        if clip is not None:
            assert float(norm) > clip and st["accumulate"]["grad_norm"] == float(norm)
        if vocab == 64:
            assert written == 0
        else:  # the outer blocks' chunks, at most once per micro-batch; no layer's
            assert 0 < written <= 4 * outer
        assert st["swap"]["gradients"] == 0
        assert engine.grads.host_bytes() == pool  # the pool is back to its planned size
    own, got = plain.state_dict(), lm.state_dict()
    for name in own:
        assert torch.equal(got[name], own[name]), name


def test_bf16_weights_8bit_states_bf16_master_bitwise_against_own_plain_loop(tmp_path):
    """bf16 weights, 8-bit moments and a stochastically rounded bf16 master (the settings that
    fit a Llama-3.1-8B on a small disk), clipping that fires: bitwise infinity's plain loop."""
    model = llama(vocab_size=VOCAB).to(torch.bfloat16)
    lm, plain = wrapped(model, tmp_path / "a", **NVME), wrapped(model, tmp_path / "b", **NVME)
    kw = dict(lr=1e-3, states="8bit", master="bf16_sr")
    o_lm, o_plain = infinity.optim.AdamW(lm.parameters(), **kw), \
        infinity.optim.AdamW(plain.parameters(), **kw)
    for step in range(3):
        mbs = batches(4, VOCAB, seed=40 + step)
        _plain_step(plain, o_plain, mbs, 0.05)
        infinity.accumulate(lm, mbs, optimizer=o_lm, max_grad_norm=0.05)
        assert o_lm.last_step_stats.overlapped_shards > 0
    own, got = plain.state_dict(), lm.state_dict()
    for name in own:
        assert torch.equal(got[name], own[name]), name


def test_state_dict_right_after_then_resume_and_train_on(tmp_path):
    """Model and optimizer state dicts taken right after a step taken in backward, loaded into
    a fresh wrapped model and optimizer, which trains on: the same as the run that went on."""
    _, lm, _, (_, o_lm, _) = _runs(tmp_path)
    infinity.accumulate(lm, batches(2, VOCAB, seed=50), optimizer=o_lm, max_grad_norm=0.05)
    msd, osd = copy.deepcopy(lm.state_dict()), copy.deepcopy(o_lm.state_dict())
    fresh = wrapped(llama(vocab_size=VOCAB, seed=9), tmp_path / "c", **NVME)
    fresh.load_state_dict(msd)
    o_fresh = infinity.optim.AdamW(fresh.parameters(), lr=1e-3)
    o_fresh.load_state_dict(osd)
    for step in range(2):
        mbs = batches(2, VOCAB, seed=51 + step)
        a = infinity.accumulate(lm, mbs, optimizer=o_lm, max_grad_norm=0.05)
        b = infinity.accumulate(fresh, mbs, optimizer=o_fresh, max_grad_norm=0.05)
        assert [float(x) for x in a] == [float(x) for x in b]
    want, got = lm.state_dict(), fresh.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_full_disk_in_backward_names_the_remedy_then_training_goes_on(tmp_path):
    """ENOSPC part way through the states written in backward: accumulate raises the disk
    error, its notes naming what took the step and the remedy (load the last checkpoint).
    After loading it, training goes on exactly as a run that never failed."""
    import errno

    from infinity.io import clear_faults, inject_fault
    _, lm, good, (_, o_lm, o_good) = _runs(tmp_path)
    mbs0, mbs1 = batches(2, VOCAB, seed=60), batches(2, VOCAB, seed=61)
    for model, opt in ((lm, o_lm), (good, o_good)):
        infinity.accumulate(model, mbs0, optimizer=opt)
    msd, osd = copy.deepcopy(lm.state_dict()), copy.deepcopy(o_lm.state_dict())
    inject_fault("write", errno.ENOSPC, after_bytes=1 << 20)
    try:
        with pytest.raises(OSError) as info:
            infinity.accumulate(lm, mbs1, optimizer=o_lm)
    finally:
        clear_faults()
    assert info.value.errno == errno.ENOSPC
    told = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "load the last checkpoint" in told and "infinity.optim" in told
    o_lm.zero_grad()
    lm.load_state_dict(msd)
    o_lm.load_state_dict(osd)
    for model, opt in ((lm, o_lm), (good, o_good)):
        infinity.accumulate(model, mbs1, optimizer=opt, max_grad_norm=0.05)
        infinity.accumulate(model, batches(2, VOCAB, seed=62), optimizer=opt)
    want, got = good.state_dict(), lm.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_elsewhere_the_step_follows_backward(tmp_path):
    """Gradients on host (nothing to save on disk): accumulate with an optimizer is the plain
    loop's backward, clip, step and zero_grad, on a wrapped model and on a torch optimizer."""
    model = llama(vocab_size=VOCAB)
    ref, host = copy.deepcopy(model), wrapped(model, tmp_path / "a", param_tier="nvme",
                                              grad_tier="host", optimizer_tier="nvme")
    plain_twin = copy.deepcopy(model)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    o_twin = torch.optim.AdamW(plain_twin.parameters(), lr=1e-3)
    o_host = infinity.optim.AdamW(host.parameters(), lr=1e-3)
    for step in range(2):
        mbs = batches(2, VOCAB, seed=70 + step)
        _plain_step(ref, o_ref, mbs, 0.05)
        infinity.accumulate(plain_twin, mbs, optimizer=o_twin, max_grad_norm=0.05)
        infinity.accumulate(host, mbs, optimizer=o_host, max_grad_norm=0.05)
        assert o_host.last_step_stats.overlapped_shards == 0
        assert all(p.grad is None for p in plain_twin.parameters())  # zero_grad ran
    want = ref.state_dict()
    for name, got in ((n, plain_twin.state_dict()[n]) for n in want):
        assert torch.equal(got, want[name]), name
    for name, got in ((n, host.state_dict()[n]) for n in want):
        torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5, msg=name)


def test_bad_arguments_are_refused():
    model = llama()
    mbs = batches(1, 1000, seed=1)
    with pytest.raises(ValueError, match="max_grad_norm needs optimizer"):
        infinity.accumulate(model, mbs, max_grad_norm=1.0)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="positive number"):
        infinity.accumulate(model, mbs, optimizer=opt, max_grad_norm=0.0)
    assert all(p.grad is None for p in model.parameters())  # nothing ran


def test_skip_next_step_does_nothing_or_refuses_waiting_gradients(tmp_path):
    """skip_next_step (a trainer calling step() after accumulate took it): that step() does
    nothing; with gradients from a later backward waiting, it raises naming zero_grad."""
    _, lm, _, (_, o_lm, _) = _runs(tmp_path)
    mbs = batches(1, VOCAB, seed=90)
    infinity.accumulate(lm, mbs, optimizer=o_lm)
    before = copy.deepcopy(lm.state_dict())
    o_lm.skip_next_step()
    o_lm.step()
    after = lm.state_dict()
    assert all(torch.equal(after[n], before[n]) for n in before)
    o_lm.skip_next_step()
    plain_backward(lm, mbs)
    with pytest.raises(RuntimeError, match="zero_grad"):
        o_lm.step()
    o_lm.step()  # the gradients are stepped by the next call
    assert any(not torch.equal(lm.state_dict()[n], before[n]) for n in before)
