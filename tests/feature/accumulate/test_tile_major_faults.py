"""infinity.accumulate's tile-major tail (runtime/vocab/tile_major.py) when something goes wrong:
a full disk while its gradient sweep hands the head's tiles to the gradient tier, and a tail
that does not replay what it recorded. Each raises a clear error; after ``zero_grad`` the step
is redone and training ends where a run without the fault ends (bitwise)."""
import errno

import pytest
import torch
from engine_helpers import all_buffers_free

import infinity
import infinity.optim
from infinity.io import clear_faults, inject_fault
from infinity.runtime.engine import engine_of
from infinity.runtime.grads.sink import GradientWriteError
from infinity.runtime.layered.chain import ChainError
from infinity.runtime.vocab.tile_major import TileMajor
from layer_major_helpers import NVME, batches, llama, wrapped

VOCAB, TOKENS, K, STEPS = 4096, 16, 4, 3
TILED = dict(tiled_head=True, chunk_bytes=64 << 10)  # 16 tiles of 256 rows


def _setup(path):
    lm = wrapped(llama(vocab_size=VOCAB, num_hidden_layers=2), path, **NVME, **TILED)
    return lm, infinity.optim.AdamW(lm.parameters(), lr=1e-3)


def _step(lm, opt, step):
    losses = [float(x) for x in infinity.accumulate(lm, batches(K, VOCAB, 3 + step, tokens=TOKENS))]
    opt.step()
    opt.zero_grad()
    return losses


def _reference(path):
    lm, opt = _setup(path)
    losses = [_step(lm, opt, step) for step in range(STEPS)]
    state = {n: p.detach().clone() for n, p in lm.state_dict().items()}
    infinity.unwrap(lm)
    return losses, state


def _train_on_and_compare(lm, opt, losses, reference):
    """Redoes step 1 and trains on: the run ends where the reference ends."""
    losses += [_step(lm, opt, step) for step in range(1, STEPS)]
    ref_losses, ref_state = reference
    assert losses == ref_losses
    for name, ref in ref_state.items():
        assert torch.equal(lm.state_dict()[name], ref), name


def test_a_full_disk_inside_the_gradient_sweep_then_train_on(tmp_path, monkeypatch):
    """ENOSPC on every write from the start of the sweep that hands the head's tile gradients to
    the gradient tier (their chunks go to disk: the head is 16 pool buffers): accumulate
    raises GradientWriteError naming the disk and zero_grad; the pool's buffers all come back."""
    reference = _reference(tmp_path / "ref")
    lm, opt = _setup(tmp_path / "lm")
    losses = [_step(lm, opt, 0)]
    sweep = TileMajor.gradients
    swept = []

    def full_disk(self):
        swept.append(True)
        inject_fault("write", errno.ENOSPC)
        return sweep(self)

    monkeypatch.setattr(TileMajor, "gradients", full_disk)
    try:
        with pytest.raises(GradientWriteError) as info:
            infinity.accumulate(lm, batches(K, VOCAB, 3 + 1, tokens=TOKENS))
    finally:
        clear_faults()
        monkeypatch.undo()
    assert swept == [True]
    assert info.value.errno == errno.ENOSPC
    assert "infinity" in str(info.value) and "zero_grad" in str(info.value)
    opt.zero_grad()
    assert all_buffers_free(engine_of(lm).grads.pool)  # no buffer kept by the failed writes
    _train_on_and_compare(lm, opt, losses, reference)
    infinity.unwrap(lm)


def test_a_tail_that_replays_differently_is_refused_then_train_on(tmp_path, monkeypatch):
    """The tails run twice per micro-batch (collect, then replay with autograd). A final norm
    whose output drifts between the runs is refused with a ChainError naming the remedies (a
    deterministic tail, the plain loop), before any gradient is handed on; the parameters are
    unchanged, and after zero_grad the step is redone and training goes on."""
    reference = _reference(tmp_path / "ref")
    lm, opt = _setup(tmp_path / "lm")
    losses = [_step(lm, opt, 0)]
    before = {n: p.detach().clone() for n, p in lm.state_dict().items()}
    norm = lm.model.norm
    calls = []

    def drifting(hidden):
        calls.append(1)
        return type(norm).forward(norm, hidden) + 1e-3 * len(calls)

    monkeypatch.setattr(norm, "forward", drifting)
    try:
        with pytest.raises(ChainError) as info:
            infinity.accumulate(lm, batches(K, VOCAB, 3 + 1, tokens=TOKENS))
    finally:
        monkeypatch.undo()
    message = str(info.value)
    assert "infinity.accumulate" in message and "changed between its two runs" in message
    assert "deterministic tail" in message and "plain micro-batch loop" in message
    assert len(calls) == K + 1  # k collected, the first replay refused
    for name, value in before.items():
        assert torch.equal(lm.state_dict()[name], value), name
    opt.zero_grad()
    _train_on_and_compare(lm, opt, losses, reference)
    infinity.unwrap(lm)
