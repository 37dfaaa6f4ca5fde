"""NVMe gradients: the per-slot L2 norms the sink hands the optimizer (measured while each
gradient is accumulated, before the block is written) equal the norms of what was written."""
import torch
from engine_helpers import batches, loss_of

import infinity
from infinity.models import GPTConfig, TinyGPT

# tied embeddings: the embedding slot receives two gradients in one backward
CFG = GPTConfig(vocab_size=128, d_model=32, n_layers=3, n_heads=2, max_seq=16,
                tie_embeddings=True)


def _check_norms(model) -> int:
    engine = model._infinity_engine
    sink = engine.grads
    checked = 0
    for flat in engine.home_flats:
        norms = sink.slot_norms(flat)
        if not flat.trainable or norms is None:
            continue
        for i, s in enumerate(flat.slots):
            g = sink.gradient(flat, i)
            if g is None:
                if norms[i] is not None:
                    raise AssertionError(f"{s.qualname}: a norm without a gradient")
                continue
            want = torch.linalg.vector_norm(g.reshape(-1), 2.0, dtype=torch.float32)
            if not torch.equal(norms[i], want):
                raise AssertionError(f"{s.qualname}: norm {norms[i]} != {want}")
            checked += 1
    return checked


def test_slot_norms_match_written_gradients(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", grad_tier="nvme")
    data = batches(CFG, 3, batch=2, seq=16)
    x, y = data[0]
    loss_of(model, x, y).backward()
    assert _check_norms(model) > 0
    # accumulation across micro-batches: the norms are of the sums
    for x, y in data[1:]:
        loss_of(model, x, y).backward()
    assert _check_norms(model) > 0
    # a p.grad replaced by the user is measured again
    p = next(p for p in model.parameters() if p.grad is not None)
    p.grad = torch.full_like(p.grad, 2.0)
    model._infinity_engine.grads.reconcile(detach=False)
    assert _check_norms(model) > 0
    infinity.unwrap(model)
