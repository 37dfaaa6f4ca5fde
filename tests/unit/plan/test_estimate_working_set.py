"""The working set autograd allocates outside the engine's pools (estimate.py's
autograd_working_set): activations, the logits and the head's gradient without a tiled head,
the dense gradient of an embedding not read by rows; counted in the device bytes (RAM on a CPU),
so the planner leaves room for it in the host budget."""
import dataclasses

import pytest
import torch

from infinity.plan import estimate
from infinity.plan.estimate import autograd_working_set, estimate_one
from infinity.plan.placements import placement
from infinity.plan.planner import plan
from infinity.plan.probe import probe
from infinity.plan.shape import HEAD, TIED, describe

# a small Llama-style decoder (bf16, as published models are)
DIMS = dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=704, vocab_size=5000)
D, V, T = 256, 5000, 2 * 64   # width, vocabulary, tokens (batch 2 x seq 64)
KV, FFN, L = 128, 704, 2


@pytest.fixture(scope="module")
def pr(tmp_path_factory):
    d = tmp_path_factory.mktemp("ws")
    return probe(str(d), quick=True, cache=str(d / "probe.json"))


def _shape(tied: bool):
    return describe(None, tied=tied, bytes_per_param=2, param_persistence_threshold=1, **DIMS)


def _activations(c: int) -> int:
    return L * T * (c * (6 * D + 2 * KV + 4 * FFN) + 8 * D) + T * D * (4 + 2 * c)


def test_tied_embedding_gradient_is_dense_unless_the_head_is_tiled():
    shape = _shape(tied=True)
    assert shape.tied and TIED in shape.block_roles
    ws = autograd_working_set(shape, T, 2)
    assert ws["embedding_grad"] == V * D * 2           # vocab x d in the compute dtype
    assert ws["logits"] == 12 * V * T
    assert ws["activations"] == _activations(2)
    assert "head_grad" not in ws                        # the tied gradient is the head's
    start = ws["activations"] + ws["logits"] + ws["embedding_grad"]
    assert ws["peak"] == max(start, 3 * ws["embedding_grad"])
    # tiled head (and rows, the default): no dense gradient, no whole logits; one tile
    tiled = autograd_working_set(shape, T, 2, tiled_head=True, chunk_bytes=1 << 20)
    assert "embedding_grad" not in tiled and "logits" not in tiled
    rows = (1 << 20) // (D * 2)
    assert tiled["head_tile"] == 2 * min(1 << 20, V * D * 2) + 12 * T * rows
    # a tiled head but embedding_rows=False: the tied block is fetched whole and the head is
    # plain, as without tiled_head
    assert autograd_working_set(shape, T, 2, tiled_head=True, embedding_rows=False,
                                chunk_bytes=1 << 20) == ws


def test_untied_embedding_by_rows_and_head_gradient():
    shape = _shape(tied=False)
    assert not shape.tied and HEAD in shape.block_roles
    ws = autograd_working_set(shape, T, 2)
    assert "embedding_grad" not in ws                   # read by rows: row-sparse gradient
    assert ws["head_grad"] == V * D * 2 and ws["logits"] == 12 * V * T
    assert ws["peak"] == ws["activations"] + ws["logits"] + ws["head_grad"]
    whole = autograd_working_set(shape, T, 2, embedding_rows=False)
    assert whole["embedding_grad"] == V * D * 2
    assert whole["peak"] == max(ws["peak"], V * D * 2)
    tiled = autograd_working_set(shape, T, 2, tiled_head=True, chunk_bytes=1 << 20)
    assert "head_grad" not in tiled and "logits" not in tiled and tiled["head_tile"] > 0
    # the batch unknown: only what does not grow with it
    assert set(autograd_working_set(shape, None, 2, embedding_rows=False)) == {
        "embedding_grad", "head_grad", "peak"}


def test_activation_formula_matches_the_saved_tensors_of_a_llama_layer():
    """Per token and layer, what autograd saves in a transformers LlamaForCausalLM (bf16),
    counted with saved-tensor hooks (parameters left out): the formula's
    c*(6d + 2kv + 4ffn) + 8d, as measured at Llama-3.2-3B's width (131,072 bytes)."""
    transformers = pytest.importorskip("transformers")

    def saved(layers: int) -> int:
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=D, intermediate_size=FFN, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            use_cache=False, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
            return t
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(seen.values())

    per_layer = (saved(3) - saved(1)) / 2 / T
    assert per_layer == pytest.approx(2 * (6 * D + 2 * KV + 4 * FFN) + 8 * D, rel=0.03)


def test_estimate_counts_the_working_set_and_the_compute_buffers_follow_the_reads(pr):
    kw = dict(probe=pr, placements=["nvme_8bit"], batch=2, seq=64, dtype=torch.bfloat16,
              chunk_bytes=1 << 20, **DIMS)
    whole = estimate(None, tied=True, **kw).row("nvme_8bit")
    tiled = estimate(None, tied=True, tiled_head=True, **kw).row("nvme_8bit")
    assert whole.working_set["embedding_grad"] == V * D * 2
    assert "embedding_grad" not in tiled.working_set
    assert whole.host_bytes == tiled.host_bytes          # the engine's pools are the same
    # device bytes: the compute buffers + the working set's peak; tiled, the tied block is
    # never fetched whole, so the buffers are smaller too
    buffers = whole.device_bytes - whole.working_set["peak"]
    tiled_buffers = tiled.device_bytes - tiled.working_set["peak"]
    assert buffers - tiled_buffers == V * D * 2 - _shape(True).layer_block_bytes


def test_the_planner_leaves_room_for_the_working_set(pr, tmp_path):
    """With batch/seq given the step's activations and logits are counted: under a budget
    sized for about half the blocks on host with them, the plan without batch/seq (as wrap
    plans) keeps more parameters on host; the chosen placement's RAM (pools + compute buffers
    + working set) is within the budget."""
    from infinity.plan.planner import _window
    big = dict(d_model=256, n_layers=8, n_heads=4, n_kv_heads=2, ffn=704, vocab_size=50000)
    shape = describe(None, tied=True, bytes_per_param=2, **big)
    pl = dataclasses.replace(placement("nvme"), states="8bit")
    e = estimate_one(shape, pl, pr, batch=1, seq=256, chunk_bytes=1 << 20,
                     prefetch_window=_window(shape, pr, pl, 1, 256))
    assert e.working_set["logits"] == 12 * 50000 * 256
    budget = e.host_bytes + e.device_bytes + shape.param_bytes // 2
    # the head fetched whole (its logits counted), pinned: the default tiled_head="auto" is
    # estimated as tiled
    kw = dict(probe=pr, nvme_path=str(tmp_path), host_budget=budget, states="8bit",
              chunk_bytes=1 << 20, tiled_head=False)
    told = plan(shape, batch=1, seq=256, **kw)
    blind = plan(shape, **kw)
    assert told.param_tier == "nvme" and 0 < told.host_blocks < len(shape.block_bytes)
    assert blind.param_tier == "host" or blind.host_blocks > told.host_blocks
    assert told.estimate.host_bytes + told.estimate.device_bytes <= budget
    assert any("not counted" in r for r in blind.reasons)
    assert not any("not counted" in r for r in told.reasons)
