"""Vocabulary-tiled LM head and cross-entropy (infinity/runtime/vocab/tiled_head.py,
``tiled_head=True``): the head's weight streams from its home in tiles of vocabulary rows, the
loss over labels is computed with an online logsumexp over the tiles (logits never
materialized), backward recomputes each tile and writes its weight gradient to the gradient
tier.

Tolerance (fp32): on the same weights, loss and gradients within SAME = 4e-6 relative of plain
PyTorch (each gradient's largest difference over its largest magnitude: the tiles' products
reduce in another order than the whole head's, by up to 1.3e-6 on an AVX2 CPU); over several
AdamW steps the parameters follow within 1e-5 (the runs drift apart by rounding)."""
import copy

import pytest
import torch
from rss_helpers import run_rss_child

import infinity
from infinity.runtime.engine import engine_of

transformers = pytest.importorskip("transformers")

LLAMA_VOCAB = 128256
SAME = 4e-6  # relative, same weights (module docstring)
TIERS = {"nvme": dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme"),
         "host": dict(param_tier="host", grad_tier="host", optimizer_tier="host")}


def _config(tied: bool, hidden: int = 64):
    return transformers.LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=tied)


def _llama(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(tied)).float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("tier", ["nvme", "host"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_parity_over_steps_generate_and_eval(tmp_path, tied, tier):
    ref = _llama(tied)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget="1GiB", chunk_bytes="4MiB",
                  tiled_head=True, **TIERS[tier])
    eng = engine_of(model)
    head_block = next(b for b in eng.blocks if any(m is model.lm_head for m in b.modules))
    assert head_block.row_lookup
    assert head_block.modules == ([model.model.embed_tokens, model.lm_head] if tied
                                  else [model.lm_head])
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    states = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: states.append(head_block.state))
    for step in range(3):
        ids = torch.randint(0, LLAMA_VOCAB, (2, 12), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100  # ignored positions
        l_ref = ref(input_ids=ids, labels=labels).loss
        out = model(input_ids=ids, labels=labels)
        assert out.logits is None  # never materialized
        assert abs(out.loss.item() - l_ref.item()) <= (SAME if step == 0 else 1e-5) * l_ref.item()
        l_ref.backward()
        out.loss.backward()
        if step == 0:  # same weights: gradients within SAME
            for (name, p), q in zip(ref.named_parameters(), model.parameters()):
                assert _rel(infinity.gradient(q), p.grad) <= SAME, name
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()
    hook.remove()
    assert infinity.stats(model)["schedule_deviations"] == 0
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(q, p, rtol=0, atol=1e-5), name
    # never fetched whole (on a CPU host tier the block is the home itself)
    assert {s.value for s in states} == ({"on_nvme"} if tier == "nvme" else {"resident"})
    # eval without labels: logits in tiles; generate() gives the plain model's tokens
    ids = torch.randint(0, LLAMA_VOCAB, (1, 6), generator=g)
    with torch.no_grad():
        want, got = ref(input_ids=ids).logits, model(input_ids=ids).logits
    assert got.shape == want.shape and _rel(got, want) <= SAME
    ref.eval(), model.eval()
    out_ref = ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out_ref, out)
    opt.close()
    infinity.unwrap(model)
    assert "forward" not in model.lm_head.__dict__
    assert "_loss_function" not in model.__dict__


def test_num_items_in_batch_and_logits_with_grad(tmp_path):
    """The loss divided by num_items_in_batch (gradient accumulation in transformers'
    Trainer); a forward without labels under grad: tiled logits whose backward is tiled."""
    ref = _llama(tied=False)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget="1GiB", chunk_bytes="1MiB",
                  tiled_head=True, **TIERS["nvme"])
    ids = torch.randint(0, LLAMA_VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    n = torch.tensor(40)
    l_ref = ref(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    l = model(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    assert abs(l.item() - l_ref.item()) <= SAME * l_ref.item()
    l_ref.backward(), l.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert _rel(infinity.gradient(q), p.grad) <= SAME, name
    ref.zero_grad(), model.zero_grad()
    logits_ref, logits = ref(input_ids=ids).logits, model(input_ids=ids).logits
    assert _rel(logits, logits_ref) <= SAME
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(6))
    (logits_ref * w).sum().backward(), (logits * w).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert _rel(infinity.gradient(q), p.grad) <= SAME, name
    infinity.unwrap(model)


def test_refusals(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="tiled_head=True needs a model whose "
                                         "get_output_embeddings"):
        infinity.wrap(model, nvme_path=str(tmp_path), tiled_head=True)
    small = _llama(tied=False)
    with pytest.raises(ValueError, match="root block .below param_persistence_threshold"):
        infinity.wrap(small, nvme_path=str(tmp_path), tiled_head=True,
                      param_persistence_threshold=10 ** 9, **TIERS["nvme"])
    tied = _llama(tied=True)
    with pytest.raises(ValueError, match="embedding_rows=False"):
        infinity.wrap(tied, nvme_path=str(tmp_path), tiled_head=True, embedding_rows=False,
                      **TIERS["nvme"])
    with pytest.raises(ValueError, match="tiled_head must be True, False or 'auto'"):
        infinity.wrap(tied, nvme_path=str(tmp_path), tiled_head=1)


_RSS_CHILD = r"""
import json, sys, torch, transformers, infinity
cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, tie_word_embeddings=True)
with infinity.empty_init():
    model = transformers.LlamaForCausalLM(cfg)
infinity.wrap(model, nvme_path=sys.argv[1], host_budget="1GiB", chunk_bytes="4MiB",
              init=model._init_weights, prefetch_window=0, tiled_head=sys.argv[2] == "1",
              param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
ids = torch.randint(0, 128256, (1, 128))
base = status("VmRSS")
reset_peak()
for _ in range(2):
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad()
print(json.dumps({"growth": status("VmHWM") - base}))
"""


def test_peak_rss_growth_smaller_than_whole_block_fetch(tmp_path):
    """In a subprocess, a tied 128256 x 256 fp32 table (131 MB), 128 tokens: with the tiled
    head, peak RSS grows by far less than the table; fetched whole (with its dense gradient
    and the 66 MB of logits), by more than the table."""
    growth = {}
    for tiled in ("1", "0"):
        swap = tmp_path / tiled
        swap.mkdir()
        growth[tiled] = run_rss_child(_RSS_CHILD, str(swap), tiled)["growth"]
    table = 128256 * 256 * 4
    assert growth["1"] < table / 3, growth
    assert growth["0"] > table, growth


@pytest.mark.parametrize("setting", [True, "auto"])
def test_budget_refusal_names_tiled_head_and_tiled_fits(tmp_path, setting):
    """A host budget too small for the head fetched whole (tiled_head=False) is refused naming
    the module and tiled_head=True; with the tiled head (as set, or "auto": the default, which
    tiles it because of that budget) the same budget wraps and trains."""
    ref = _llama(tied=False)
    model = copy.deepcopy(ref)
    budget = 24 << 20  # the head alone is 128256 x 64 x 4 = 32.8 MB
    with pytest.raises(infinity.tiers.BudgetExceededError,
                       match=r"wrap with tiled_head=True: module 'lm_head' \(the LM head\)"):
        infinity.wrap(model, nvme_path=str(tmp_path), host_budget=budget, chunk_bytes="1MiB",
                      tiled_head=False, **TIERS["nvme"])
    kw = {} if setting == "auto" else {"tiled_head": True}
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget=budget, chunk_bytes="1MiB",
                  **kw, **TIERS["nvme"])
    head = infinity.stats(model)["tiled_head"]
    assert head["on"] and head["setting"] == setting
    if setting == "auto":
        assert "of host_budget=25,165,824" in head["why"], head["why"]
    ids = torch.randint(0, LLAMA_VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    l_ref, l = ref(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
    assert abs(l.item() - l_ref.item()) <= SAME * l_ref.item()
    l_ref.backward(), l.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert _rel(infinity.gradient(q), p.grad) <= SAME, name
    assert infinity.stats(model)["tiers"]["host"]["peak"] <= budget
    infinity.unwrap(model)
