"""Outer blocks: modules outside the layer list holding large parameters (the input embedding,
the LM head, a tied embedding and head) are blocks of their own, fetched when they run and
released after; only small parameters stay in the root block for the whole step.

Parity is against plain PyTorch on the same weights and data: forward, backward and
``torch.optim.AdamW(fused=True)`` against ``infinity.optim.AdamW`` are bitwise equal in fp32
(as in tests/feature/engine/test_meta_loading.py), with parameters, gradients and fp32 states on
NVMe."""
import copy
import os
import re

import pytest
import torch
from engine_helpers import assert_params_bitwise, check_grads_then_step
from torch import nn

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.runtime.build.split import partition
from infinity.runtime.engine import engine_of
from infinity.tiers import BudgetExceededError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# vocabulary 4096 x 64 = 262,144 elements: above the default persistence threshold (100,000);
# 4 layers so that a block used at both ends of forward is released in the middle
GPT = dict(vocab_size=4096, d_model=64, n_layers=4, n_heads=4, max_seq=32)
NVME_ALL = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
LLAMA_VOCAB = 128256  # Llama 3's full vocabulary


def _gpt(tied: bool, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(**GPT, tie_embeddings=tied))


def _llama_config(tied: bool):
    return transformers.LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied)


def _llama(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_llama_config(tied)).float()


def _blocks(model):
    return engine_of(model).blocks


def _by_name(model, name):
    return next(b for b in _blocks(model) if b.name == name)


# ---- the partition ---------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_partition_outer_blocks_after_layers_root_last(tied):
    model = _gpt(tied)
    specs = partition(model, None, 100_000)
    names = [s.name for s in specs]
    kinds = [s.kind for s in specs]
    layers = [f"layers.{i}" for i in range(4)]
    if tied:  # one block for the shared weight, used by both modules
        assert names == layers + ["tok", "<root>"]
        tok = specs[4]
        assert tok.modules == [model.tok, model.lm_head]
        assert [q for q, _, _, _ in tok.params] == ["tok.weight"]
    else:
        assert names == layers + ["tok", "lm_head", "<root>"]
        assert specs[5].modules == [model.lm_head]
    assert kinds == ["layer"] * 4 + ["outer"] * (1 if tied else 2) + ["root"]
    root = specs[-1]
    assert root.is_root and {q for q, *_ in root.params} == {"pos.weight", "ln_f.weight",
                                                               "ln_f.bias"}
    assert all(p.numel() < 100_000 for *_, p in root.params)
    # no threshold: the layout before outer blocks (everything outside the layers in the root)
    old = partition(model)
    assert [s.name for s in old] == layers + ["<root>"]
    assert old[-1].numel == sum(p.numel() for p in model.parameters()) - sum(
        s.numel for s in old[:-1])


class _Tower(nn.Module):
    """Owns a parameter directly and has children owning parameters."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(200_000))
        self.small = nn.Linear(4, 4)
        self.proj = nn.Linear(500, 400)  # 200,400 elements

    def forward(self, x):
        return self.proj(x * self.scale[:500]) + self.small(x[..., :4]).sum()


class _WithTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = _Tower()
        self.layers = nn.ModuleList(nn.Linear(400, 400) for _ in range(2))

    def forward(self, x):
        x = self.tower(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_each_param_owning_module_is_considered_on_its_own(tmp_path):
    model = _WithTower()
    specs = partition(model, None, 100_000)
    assert [(s.name, s.kind) for s in specs] == [
        ("layers.0", "layer"), ("layers.1", "layer"), ("tower", "outer"),
        ("tower.proj", "outer"), ("<root>", "root")]
    assert [q for q, *_ in specs[2].params] == ["tower.scale"]  # its own, not its children's
    assert {q for q, *_ in specs[4].params} == {"tower.small.weight", "tower.small.bias"}
    # and it trains like the plain model: the tower's own block is fetched at the tower's
    # forward, its child's at the child's
    ref = copy.deepcopy(model)
    infinity.wrap(model, nvme_path=str(tmp_path), **NVME_ALL)
    assert [len(b.modules) for b in _blocks(model)] == [1, 1, 1, 1, 1]
    assert _by_name(model, "tower").modules == [model.tower]
    x = torch.randn(3, 500)
    ref(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, infinity.gradient(q)), name
    infinity.unwrap(model)


# ---- training parity, residency between uses ----------------------------------------------
def _states(model, names):
    return {n: _by_name(model, n).state.value for n in names}


def _watch_layers(model, names, log):
    """Records the residency of blocks ``names`` at the start of each layer's forward and
    of each layer's backward."""
    def pre(module, args, _i=None):
        log.append(("forward", module._watch_index, _states(model, names)))

    def post(module, args, output):
        idx = module._watch_index
        output.register_hook(lambda g: log.append(("backward", idx, _states(model, names))))

    handles = []
    for i, layer in enumerate(model.layers):
        layer._watch_index = i
        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    return handles


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt_parity_on_nvme_and_blocks_released_between_uses(tmp_path, tied, overlap):
    """``overlap=True``: each block's update starts in backward once its gradient is complete
    (the embedding's while its block is not materialized; a tied block's after both uses)."""
    ref = _gpt(tied)
    model = copy.deepcopy(ref)
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget="1GiB", prefetch_window=1,
                  **NVME_ALL)
    outer = ["tok"] if tied else ["tok", "lm_head"]
    blocks = _blocks(model)
    assert [b.name for b in blocks][4:] == outer + ["<root>"]
    root = blocks[-1]
    assert root.is_root and all(s.numel < 100_000 for f in root.flats for s in f.slots)
    if tied:
        tok = _by_name(model, "tok")
        assert tok.shared and tok.modules == [model.tok, model.lm_head]
        assert len(tok.flats) == 1 and len(tok.flats[0].slots) == 1  # one slot, two users
        assert model.lm_head.weight is model.tok.weight
    log = []
    _watch_layers(model, outer, log)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, overlap=overlap)
    g = torch.Generator().manual_seed(1)
    cfg = GPTConfig(**GPT, tie_embeddings=tied)
    for step in range(4):
        x, y = synthetic_batch(cfg, 2, 16, g)
        l_ref, l = lm_loss(ref(x), y), lm_loss(model(x), y)
        assert torch.equal(l_ref.detach(), l.detach()), step
        l_ref.backward()
        l.backward()
        check_grads_then_step(ref, model, opt_ref, opt, step)
    assert_params_bitwise(ref, model)  # outside forward: the parameters view their homes
    # residency: in the middle layers (1, 2), neither the embedding nor the head is
    # materialized, in forward nor in backward (the embedding's backward needs no fetch)
    middle = [e for e in log if e[1] in (1, 2)]
    assert len(middle) == 4 * 4  # 4 steps x 2 layers x (forward, backward)
    for phase, layer, states in middle:
        for name, state in states.items():
            assert state in ("on_nvme",), (phase, layer, name, state)
    # the head's block is materialized when the last layer's backward starts only if kept by
    # the window; the embedding's never is in backward
    for phase, layer, states in log:
        if phase == "backward" and not tied:
            assert states["tok"] == "on_nvme", (layer, states)
    s = infinity.stats(model)
    assert s["schedule_deviations"] == 0
    if overlap:  # every block's update but the root's ran during backward and was kept
        streamed = [f for b in _blocks(model) if not b.is_root for f in b.flats]
        assert opt.last_step_stats.overlapped_shards == len(streamed)
    assert engine_of(model).schedule.recorded["forward"][0] == _by_name(model, "tok").index
    opt.close()
    infinity.unwrap(model)


# ---- a Llama with the full Llama-3 vocabulary ------------------------------------------------
def _save_source(model, folder):
    os.makedirs(folder, exist_ok=True)
    sd = {k: v.clone().contiguous() for k, v in model.state_dict().items()
          if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    safetensors_torch.save_file(sd, os.path.join(folder, "model.safetensors"))
    model.config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("build", ["normal", "meta"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama_full_vocab_parity_eval_and_generate(tmp_path, tied, build):
    ref = _llama(tied)
    if build == "normal":
        model = copy.deepcopy(ref)
        source = {}
    else:
        with infinity.empty_init():
            model = transformers.LlamaForCausalLM(_llama_config(tied)).float()
        assert all(p.is_meta for p in model.parameters())
        source = {"source": _save_source(ref, str(tmp_path / "ckpt"))}
    swap = tmp_path / "swap"
    swap.mkdir()
    infinity.wrap(model, nvme_path=str(swap), host_budget="2GiB", **NVME_ALL, **source)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [b.name for b in _blocks(model)]
    outer = ["model.embed_tokens"] + ([] if tied else ["lm_head"])
    assert names == ["model.layers.0", "model.layers.1"] + outer + ["<root>"]
    emb = _by_name(model, "model.embed_tokens")
    assert emb.compute_nbytes >= LLAMA_VOCAB * 64 * 4
    assert _blocks(model)[-1].compute_nbytes < 64 * 1024  # the final norm only
    layer = max(b.compute_nbytes for b in _blocks(model) if b.kind == "layer")
    assert emb.compute_nbytes > 10 * layer

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        ids = torch.randint(0, LLAMA_VOCAB, (2, 12), generator=g)
        l_ref = ref(input_ids=ids, labels=ids).loss
        l = model(input_ids=ids, labels=ids).loss
        assert torch.equal(l_ref.detach(), l.detach()), step
        l_ref.backward()
        l.backward()
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()
    assert_params_bitwise(ref, model)

    # eval: a no_grad forward, then generate(), the same tokens as the plain model
    ids = torch.randint(0, LLAMA_VOCAB, (1, 6), generator=g)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = model(input_ids=ids).logits
    assert torch.equal(want, got)
    assert all(not b.materialized for b in _blocks(model) if not b.is_root)
    ref.eval(), model.eval()
    out_ref = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out_ref, out)
    # parameters read outside forward, and inside materialized()
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    with infinity.materialized(model, model.lm_head):
        head = _by_name(model, "model.embed_tokens" if tied else "lm_head")
        assert head.materialized
        assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    assert not head.materialized
    opt.close()
    infinity.unwrap(model)


# ---- budgets: the working set is the root + the largest block, not the whole old root ----------
def _old_root_bytes(model) -> int:
    """The root block as it was before outer blocks (everything outside the layers)."""
    old = partition(model)
    return sum(p.numel() * 4 for *_, p in old[-1].params)


def test_device_budget_fits_root_and_largest_block_but_not_old_root(tmp_path):
    ref = _llama(tied=False)
    model = copy.deepcopy(ref)
    probe = copy.deepcopy(ref)
    (tmp_path / "p").mkdir()
    infinity.wrap(probe, nvme_path=str(tmp_path / "p"), **NVME_ALL)
    root = _blocks(probe)[-1].compute_nbytes
    largest = max(b.compute_nbytes for b in _blocks(probe) if not b.is_root)
    infinity.unwrap(probe)
    old_root = _old_root_bytes(ref)
    budget = root + largest + 4096
    assert budget < old_root  # the embedding and the head did not fit together
    (tmp_path / "s").mkdir()
    infinity.wrap(model, nvme_path=str(tmp_path / "s"), device_budget=budget, **NVME_ALL)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    infinity.stats(model, reset=True)
    for step in range(2):
        ids = torch.randint(0, LLAMA_VOCAB, (2, 8), generator=g)
        l_ref, l = ref(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
        assert torch.equal(l_ref.detach(), l.detach()), step
        l_ref.backward(), l.backward()
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()
    assert_params_bitwise(ref, model)
    assert infinity.stats(model)["tiers"]["device"]["peak"] <= budget
    opt.close()
    infinity.unwrap(model)


def test_device_budget_below_root_and_largest_block_names_the_block(tmp_path):
    model = _llama(tied=True)
    with pytest.raises(BudgetExceededError,
                       match=r"infinity: device_budget=.*block 'model\.embed_tokens' needs "
                             r"[\d,]+ bytes.*Raise device_budget to at least [\d,]+"):
        infinity.wrap(model, nvme_path=str(tmp_path), device_budget=8 << 20, **NVME_ALL)
    assert not any(p.is_meta for p in model.parameters())
    assert engine_of(model) is None


def test_host_budget_compute_buffers_count_root_and_largest_block(tmp_path):
    """On a CPU device the compute buffers come out of host_budget: their minimum is the
    root + the largest block (named), and a budget at exactly the engine's minimum wraps and
    runs forward and backward exactly, though the old root (embedding + head) alone would
    not fit next to what the engine holds. The head fetched whole is pinned (tiled_head=False:
    "auto" would tile it under these budgets)."""
    ref = _llama(tied=False)
    model = copy.deepcopy(ref)
    with pytest.raises(BudgetExceededError) as err:
        infinity.wrap(model, nvme_path=str(tmp_path), host_budget=1 << 20, tiled_head=False,
                      **NVME_ALL)
    msg = str(err.value)
    # the untied embedding is looked up row by row (runtime/vocab/rows.py): the head is the largest
    m = re.search(r"the root block \+ the largest block '(lm_head)'\) ([\d,]+)", msg)
    assert m, msg
    compute = int(m.group(2).replace(",", ""))
    need = int(re.search(r"Raise host_budget to at least ([\d,]+) bytes", msg).group(1)
               .replace(",", ""))
    old_root = _old_root_bytes(ref)
    emb = LLAMA_VOCAB * 64 * 4
    assert emb <= compute < emb + (64 << 10)  # root (the final norm) + one of embedding/head
    assert old_root >= 2 * emb  # before: both, plus a layer, in compute buffers
    # exactly the minimum: wraps, and forward + backward equal plain PyTorch
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget=need, tiled_head=False,
                  **NVME_ALL)
    assert infinity.stats(model)["tiers"]["host"]["compute"] == compute
    ids = torch.randint(0, LLAMA_VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    l_ref, l = ref(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
    assert torch.equal(l_ref.detach(), l.detach())
    l_ref.backward(), l.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, infinity.gradient(q)), name
    assert infinity.stats(model)["tiers"]["host"]["peak"] <= need
    infinity.unwrap(model)


# ---- the estimate follows the blocks ---------------------------------------------------------
def test_estimate_shape_has_outer_blocks_and_a_small_root():
    from infinity.plan.shape import describe
    dims = dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                num_key_value_heads=8, intermediate_size=8192, vocab_size=LLAMA_VOCAB,
                tie_word_embeddings=True)
    shape = describe(dims)
    assert shape.block_kinds == ("layer",) * 28 + ("outer", "root")
    assert shape.outer_block_bytes == LLAMA_VOCAB * 3072 * 4  # the tied embedding and head
    assert shape.root_bytes == 3072 * 4  # the final norm
    with torch.device("meta"):
        real = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims))
    assert describe(real).block_bytes == shape.block_bytes
    untied = describe(dict(dims, tie_word_embeddings=False))
    assert untied.block_kinds[-3:] == ("outer", "outer", "root")
    # the old layout (threshold None): the root holds the embedding
    old = describe(dims, param_persistence_threshold=None)
    assert old.root_bytes == (LLAMA_VOCAB * 3072 + 3072) * 4 and old.outer_block_bytes == 0


# ---- checkpoints: saved with the root layout, loaded into outer blocks ---------------------
def test_checkpoint_saved_with_the_root_layout_loads_into_outer_blocks(tmp_path):
    """Checkpoints are matched by parameter name, not by block: one saved when the embedding
    and head were in the root block (param_persistence_threshold above them: the layout
    before outer blocks) loads into the new layout, optimizer states included, and training
    goes on bitwise as the uninterrupted run."""
    cfg = GPTConfig(**GPT, tie_embeddings=True)
    data = [synthetic_batch(cfg, 2, 16, torch.Generator().manual_seed(9)) for _ in range(4)]

    def train(model, opt, batches):
        for x, y in batches:
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    dirs = [tmp_path / n for n in ("a", "b", "c")]
    for d in dirs:
        d.mkdir()
    old = _gpt(True)
    infinity.wrap(old, nvme_path=str(dirs[0]), param_persistence_threshold=10**12, **NVME_ALL)
    assert [b.kind for b in _blocks(old)] == ["layer"] * 4 + ["root"]
    opt_old = infinity.optim.AdamW(old.parameters(), lr=1e-2)
    train(old, opt_old, data[:2])
    ckpt = infinity.save_checkpoint(str(tmp_path / "ckpt"), old, opt_old)
    train(old, opt_old, data[2:])  # the uninterrupted run

    new = _gpt(True, seed=5)  # other weights: all of them come from the checkpoint
    infinity.wrap(new, nvme_path=str(dirs[1]), **NVME_ALL)
    assert [b.kind for b in _blocks(new)] == ["layer"] * 4 + ["outer", "root"]
    opt_new = infinity.optim.AdamW(new.parameters(), lr=1e-2)
    infinity.load_checkpoint(ckpt, new, opt_new)
    train(new, opt_new, data[2:])
    for (name, p), q in zip(old.named_parameters(), new.parameters()):
        assert torch.equal(p, q), name
    for o in (opt_old, opt_new):
        o.close()
    infinity.unwrap(old), infinity.unwrap(new)


def test_sharded_checkpoint_of_the_root_layout_loads_into_outer_blocks(tmp_path):
    """A sharded checkpoint (infinity.sharding) keys its elements by parameter name and global
    range, not by block layout: one saved with the embedding in the root block loads into a
    model whose embedding is an outer block, and into the root layout again, exactly."""
    from infinity.sharding import load_sharded, save_sharded
    dirs = [tmp_path / n for n in ("a", "b", "c")]
    for d in dirs:
        d.mkdir()
    old = _gpt(True)
    infinity.wrap(old, nvme_path=str(dirs[0]), param_persistence_threshold=10**12, **NVME_ALL)
    path = save_sharded(str(tmp_path / "sharded"), old)
    new = _gpt(True, seed=5)
    infinity.wrap(new, nvme_path=str(dirs[1]), **NVME_ALL)
    same = _gpt(True, seed=5)
    infinity.wrap(same, nvme_path=str(dirs[2]), param_persistence_threshold=10**12, **NVME_ALL)
    for m in (new, same):
        load_sharded(path, m)
        for (name, p), q in zip(old.named_parameters(), m.parameters()):
            assert torch.equal(p, q), name
    for m in (old, new, same):
        infinity.unwrap(m)
