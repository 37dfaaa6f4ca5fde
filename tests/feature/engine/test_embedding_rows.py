"""Embedding row fetch (infinity/runtime/vocab/rows.py): an untied nn.Embedding block on the host or
NVMe tier reads only its batch's rows (on NVMe, the swap file's pieces holding them) and its
gradient is row-sparse, scattered into the gradient tier with zeros elsewhere.

Parity is against plain PyTorch on the same weights and data: loss, gradients and parameters
after ``torch.optim.AdamW(fused=True)`` vs ``infinity.optim.AdamW`` are bitwise equal in fp32
over several steps (AdamW still steps every row: weight decay and moments)."""
import copy

import pytest
import torch
from engine_helpers import assert_params_bitwise, check_grads_then_step
from rss_helpers import run_rss_child
from torch import nn

import infinity
from infinity.runtime.engine import engine_of
from infinity.runtime.grads.rows import scatter_rows, sparse_rows

transformers = pytest.importorskip("transformers")

LLAMA_VOCAB = 128256
NVME_ALL = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
HOST_ALL = dict(param_tier="host", grad_tier="host", optimizer_tier="host")


def _llama(hidden: int, layers: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).float()


def _block(model, name):
    return next(b for b in engine_of(model).blocks if b.name == name)


def _train_and_compare(ref, model, steps, micro=1, seq=12, seed=3):
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    emb = _block(model, "model.embed_tokens")
    states = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, a, o: states.append(emb.state.value))
    for step in range(steps):
        for _ in range(micro):
            ids = torch.randint(0, LLAMA_VOCAB, (2, seq), generator=g)
            ids[0, :4] = ids[0, 4]  # repeated rows: their gradients sum
            l_ref = ref(input_ids=ids, labels=ids).loss
            l = model(input_ids=ids, labels=ids).loss
            assert torch.equal(l_ref.detach(), l.detach()), step
            l_ref.backward()
            l.backward()
        check_grads_then_step(ref, model, opt_ref, opt, step)
    assert_params_bitwise(ref, model)
    hook.remove()
    opt.close()
    return states


@pytest.mark.parametrize("tier", ["nvme", "host"])
def test_untied_llama_parity_rows_only(tmp_path, tier):
    ref = _llama(hidden=64)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget="1GiB",
                  **(NVME_ALL if tier == "nvme" else HOST_ALL))
    emb = _block(model, "model.embed_tokens")
    assert emb.row_lookup and not _block(model, "lm_head").row_lookup
    assert "forward" in model.model.embed_tokens.__dict__
    states = _train_and_compare(ref, model, steps=3)
    # never fetched whole: on NVMe it stays there; on a CPU host tier it is the home itself
    assert set(states) == ({"on_nvme"} if tier == "nvme" else {"resident"}), states
    s = infinity.stats(model)
    assert s["schedule_deviations"] == 0
    infinity.unwrap(model)
    assert "forward" not in model.model.embed_tokens.__dict__  # the class's forward again


def test_rows_straddling_pieces_and_chunks_accumulate_across_micro_batches(tmp_path):
    """Row width 48 fp32 (192 bytes) does not divide a 1 MiB piece or gradient chunk: rows
    straddle their boundaries; two micro-batches add into the gradient file's chunks."""
    ref = _llama(hidden=48)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget="1GiB", chunk_bytes="1MiB",
                  **NVME_ALL)
    emb = _block(model, "model.embed_tokens")
    assert emb.row_lookup
    assert emb.flats[0].numel * 4 > (1 << 20)  # chunked gradient
    _train_and_compare(ref, model, steps=3, micro=2)
    infinity.unwrap(model)


def test_forward_reads_only_the_rows_pieces(tmp_path):
    ref = _llama(hidden=64)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget="1GiB", chunk_bytes="1MiB",
                  **NVME_ALL)
    eng = engine_of(model)
    flat = _block(model, "model.embed_tokens").flats[0]
    piece = eng.homes[infinity.tiers.Tier.NVME].range_elems(flat)
    ids = torch.tensor([[5, 6, 7, 70000, 70000, LLAMA_VOCAB - 1]])
    want = {int(r) * 64 // piece for r in ids.unique()} | \
        {(int(r) * 64 + 63) // piece for r in ids.unique()}
    eng.stats.reset()
    with torch.no_grad():
        got = model(input_ids=ids).logits
    s = eng.stats
    assert s.rows_lookups == 1
    assert s.rows_read_bytes == sum(min(flat.numel, (k + 1) * piece) - k * piece
                                    for k in want) * 4
    assert s.rows_read_bytes < flat.home_nbytes / 10  # 3 of 32 pieces
    with torch.no_grad():
        assert torch.equal(got, ref(input_ids=ids).logits)
    infinity.unwrap(model)


class _PadModel(nn.Module):
    def __init__(self, scale: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(5000, 40, padding_idx=3, scale_grad_by_freq=scale)
        self.layers = nn.ModuleList([nn.Linear(40, 40)])
        # sizes in whole 8-lane vectors: torch's fused AdamW (the reference) computes its scalar
        # remainder's exp_avg_sq with another rounding than its vector body on AVX2 builds
        self.out = nn.Linear(40, 8)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h).square().mean()


@pytest.mark.parametrize("scale", [False, True], ids=["plain", "scale_grad_by_freq"])
def test_padding_idx_and_scale_grad_by_freq(tmp_path, scale):
    torch.manual_seed(0)
    ref = _PadModel(scale)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), param_persistence_threshold=1000,
                  **NVME_ALL)
    assert _block(model, "emb").row_lookup
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randint(0, 50, (4, 9), generator=g)
        x[:, 0] = 3  # the padding row: no gradient
        l_ref, l = ref(x), model(x)
        assert torch.equal(l_ref.detach(), l.detach())
        l_ref.backward(), l.backward()
        check_grads_then_step(ref, model, opt_ref, opt, step)
    assert_params_bitwise(ref, model)
    # a copy of the wrapped model is a plain module: its embedding runs the plain lookup
    clone = copy.deepcopy(model)
    x = torch.randint(0, 50, (2, 5), generator=g)
    assert torch.equal(clone.emb(x), nn.functional.embedding(x, ref.emb.weight, 3))
    with pytest.raises(IndexError, match="infinity: embedding 'emb': index out of range"):
        model(torch.tensor([[5000]]))
    opt.close()
    infinity.unwrap(model)


def test_off_by_policy_fetches_whole(tmp_path):
    ref = _llama(hidden=64)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget="1GiB", embedding_rows=False,
                  **NVME_ALL)
    assert not _block(model, "model.embed_tokens").row_lookup
    assert "forward" not in model.model.embed_tokens.__dict__
    infinity.unwrap(model)
    with pytest.raises(ValueError, match="embedding_rows must be True or False"):
        infinity.wrap(model, nvme_path=str(tmp_path), embedding_rows="yes")


def test_tied_embedding_is_not_looked_up_by_rows(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    infinity.wrap(model, nvme_path=str(tmp_path), **NVME_ALL)
    assert not any(b.row_lookup for b in engine_of(model).blocks)  # the head needs every row
    infinity.unwrap(model)


@pytest.mark.parametrize("add", [False, True])
def test_scatter_rows_matches_dense(add):
    g = torch.Generator().manual_seed(0)
    width, nrows, lo = 7, 30, 5
    rows = torch.tensor([0, 3, 4, 11, 12, 29])
    values = torch.randn(len(rows), width, generator=g)
    dense = torch.zeros(nrows, width)
    dense[rows] = values
    base = torch.randn(lo + nrows * width + 3, generator=g)
    for a, b in [(lo, lo + nrows * width), (lo, lo + 10), (lo + 3, lo + 60), (lo + 20, lo + 22),
                 (lo + 28, lo + nrows * width)]:
        part = base[a:b].clone()
        scatter_rows(part, a, lo, width, rows, values, add=add)
        want = dense.reshape(-1)[a - lo:b - lo]
        if add:
            want = base[a:b] + want
        assert torch.equal(part, want), (a, b)
    sparse = torch.sparse_coo_tensor(torch.tensor([[4, 1, 4]]), torch.ones(3, 2), (6, 2),
                                     check_invariants=False)
    r, v = sparse_rows(sparse)
    assert r.tolist() == [1, 4] and torch.equal(v, torch.tensor([[1., 1.], [2., 2.]]))
    with pytest.raises(TypeError, match="infinity: a sparse gradient must be a 2-D COO"):
        sparse_rows(torch.ones(3).to_sparse())


_RSS_CHILD = r"""
import json, os, sys, torch, transformers, infinity
from infinity.runtime.engine import engine_of
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, tie_word_embeddings=False)
with infinity.empty_init():
    model = transformers.LlamaForCausalLM(cfg)
infinity.wrap(model, nvme_path=sys.argv[1], host_budget="1GiB", chunk_bytes="4MiB",
              init=model._init_weights, prefetch_window=0,
              param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme",
              embedding_rows=sys.argv[2] == "1")
ids = torch.randint(0, 128256, (1, 16))
base = status("VmRSS")
reset_peak()
for _ in range(2):
    out = model.model(input_ids=ids).last_hidden_state  # the embedding, a layer, the norm
    out.square().mean().backward()
    model.zero_grad()
peak = status("VmHWM")
print(json.dumps({"growth": peak - base,
                  "rows": engine_of(model).blocks[1].row_lookup}))
"""


def test_peak_rss_growth_smaller_than_whole_block_fetch(tmp_path):
    """In a subprocess: forward + backward through the embedding (128256 x 256 fp32: a 131 MB
    table) grows peak RSS by far less when looked up row by row than when fetched whole and
    given a dense gradient."""
    growth = {}
    for rows in ("1", "0"):
        swap = tmp_path / rows
        swap.mkdir()
        result = run_rss_child(_RSS_CHILD, str(swap), rows)
        assert result["rows"] == (rows == "1")
        growth[rows] = result["growth"]
    table = 128256 * 256 * 4
    assert growth["1"] < table / 4, growth
    assert growth["0"] > table, growth
