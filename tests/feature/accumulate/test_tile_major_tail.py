"""infinity.accumulate with the LM head tiled over its vocabulary: the tails of the k
micro-batches sweep the head's tiles once for the losses and once for the gradients
(runtime/vocab/tile_major.py), and the embedding rows the k micro-batches looked up get their
gradients added at once (RowHooks.gathered), so the head's reads and the gradient additions do
not grow with k. Numbers: bitwise infinity's own plain loop (untied head), within 1e-6 of it (tied: the
embedding's and the head's gradients meet in another order, as before this sweep)."""
import pytest
import torch

import infinity
import infinity.optim
from layer_major_helpers import NVME, batches, llama, plain_backward, wrapped

VOCAB, TOKENS, STEPS = 4096, 16, 3
TILED = dict(tiled_head=True, chunk_bytes=64 << 10)  # 16 tiles of 256 rows


def _train(tmp_path, k, layer_major, tied, loss_from_logits=False, clip=None):
    model = llama(vocab_size=VOCAB, num_hidden_layers=2, tie_word_embeddings=tied)
    lm = wrapped(model, tmp_path, **NVME, **TILED)
    opt = infinity.optim.AdamW(lm.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        mbs = batches(k, VOCAB, seed=3 + step, tokens=TOKENS)
        if loss_from_logits:  # no labels: the head computes whole logits
            mbs = [dict(input_ids=mb["input_ids"]) for mb in mbs]

            def loss_fn(out, mb):
                return torch.nn.functional.cross_entropy(
                    out.logits[:, :-1].reshape(-1, VOCAB), mb["input_ids"][:, 1:].reshape(-1))
        if layer_major and clip is not None:  # the whole step; its first pass measures
            losses += [float(x) for x in infinity.accumulate(lm, mbs, optimizer=opt,
                                                            max_grad_norm=clip)]
            continue
        if layer_major:
            kw = dict(loss_fn=loss_fn) if loss_from_logits else {}
            losses += [float(x) for x in infinity.accumulate(lm, mbs, **kw)]
        elif loss_from_logits:
            for mb in mbs:
                loss = loss_fn(lm(**mb), mb)
                losses.append(float(loss.detach()))
                (loss / k).backward()
        else:
            losses += plain_backward(lm, mbs)
        if clip is not None:
            assert float(opt.clip_grad_norm_(clip)) > clip  # it fires
        opt.step()
        opt.zero_grad()
    state = {n: p.detach().clone() for n, p in lm.state_dict().items()}
    moved = infinity.stats(lm)["nvme_per_step"]["bytes"]
    on = infinity.stats(lm)["tiled_head"]["on"]
    infinity.unwrap(lm)
    return losses, state, moved, on


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tile_major_tail_trains_as_the_plain_loop(tmp_path, tied):
    k = 4
    losses, state, moved, on = _train(tmp_path / "lm", k, True, tied)
    ref_losses, ref_state, ref_moved, _ = _train(tmp_path / "plain", k, False, tied)
    assert on
    assert losses == ref_losses  # each micro-batch's loss: the same operations
    for name, ref in ref_state.items():
        if tied:
            torch.testing.assert_close(state[name], ref, rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(state[name], ref), name
    # the head's tiles: swept twice per step, against twice per micro-batch
    assert moved["params_read"] < ref_moved["params_read"] / 2, (moved, ref_moved)
    assert moved["grads_written"] < ref_moved["grads_written"], (moved, ref_moved)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_head_traffic_does_not_grow_with_the_micro_batches(tmp_path, tied):
    head = VOCAB * 64 * 4  # the head's fp32 bytes
    one = _train(tmp_path / "k1", 1, True, tied)[2]
    four = _train(tmp_path / "k4", 4, True, tied)[2]
    plain = _train(tmp_path / "plain", 4, False, tied)[2]
    # k = 4 reads what k = 1 reads, but for the embedding rows the other micro-batches look up
    assert four["params_read"] - one["params_read"] < head / 2, (one, four)
    assert plain["params_read"] - one["params_read"] > 3 * 2 * head * 0.9, (one, plain)
    # gradients: the head's tiles added once, the k lookups' rows summed and added once (a
    # first arrival without rows writes nothing: grads/chunks.py)
    assert four["grads_written"] < 1.25 * one["grads_written"], (one, four)
    assert plain["grads_written"] > 3 * one["grads_written"], (one, plain)


def test_a_tail_with_whole_logits_runs_micro_batch_by_micro_batch(tmp_path):
    """A loss computed from the logits (no labels: the tiled head computes them whole) is not
    one tiled cross-entropy: the tails run one by one, as the plain loop's."""
    losses, state, _, on = _train(tmp_path / "lm", 2, True, False, loss_from_logits=True)
    ref_losses, ref_state, _, _ = _train(tmp_path / "plain", 2, False, False,
                                         loss_from_logits=True)
    assert on
    assert losses == ref_losses
    for name, ref in ref_state.items():
        assert torch.equal(state[name], ref), name


def test_clip_with_the_step_in_backward(tmp_path):
    """``accumulate(optimizer=, max_grad_norm=)`` runs the tails twice (the first pass
    measures the norm): both sweep the tiles; the clipped steps are the plain loop's."""
    losses, state, _, _ = _train(tmp_path / "lm", 4, True, False, clip=0.05)
    ref_losses, ref_state, _, _ = _train(tmp_path / "plain", 4, False, False, clip=0.05)
    assert losses == ref_losses
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=0, atol=1e-6, msg=name)
