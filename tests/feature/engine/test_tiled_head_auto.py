"""tiled_head="auto", the default (runtime/build/head.py): the LM head is tiled where a budget
is set that it would break fetched whole (its weight and gradient; tied, the embedding's dense
gradient and their sum, next to what the engine holds), whole otherwise; stats() says which
and why; a head that would break the budget but cannot be tiled is warned about at wrap with
the bytes and the remedy. The wrapped model's loss is plain PyTorch's either way."""
import copy
import logging
import re

import pytest
import torch

import infinity
from infinity.runtime.build.head import WHOLE_SHARE, whole_head_bytes
from infinity.runtime.engine import engine_of

transformers = pytest.importorskip("transformers")

VOCAB = 128256  # a 128256 x 64 fp32 table: 32.8 MB
NVME = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
TABLE = VOCAB * 64 * 4


def _llama(tied: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied)).float()


def _need(why: str) -> int:
    return int(re.search(r": ([\d,]+) bytes against", why).group(1).replace(",", ""))


def _loss_matches(ref, model, rtol: float) -> None:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    want = ref(input_ids=ids, labels=ids).loss.item()
    got = model(input_ids=ids, labels=ids).loss.item()
    assert abs(got - want) <= rtol * abs(want), (got, want)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_budget_decides(tmp_path, tied):
    ref = _llama(tied)
    # no budget: nothing to keep, the head is fetched whole (as before "auto")
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), **NVME)
    head = infinity.stats(model)["tiled_head"]
    assert head == {"setting": "auto", "on": False,
                    "why": "no host_budget is set: the head is fetched whole"}
    infinity.unwrap(model)
    # a roomy budget: whole; the reason names the bytes it compared
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), host_budget="1GiB",
                          chunk_bytes="1MiB", **NVME)
    head = infinity.stats(model)["tiled_head"]
    assert not head["on"] and "fetched whole" in head["why"]
    owner = next(b for b in engine_of(model).blocks if b.kind == "outer"
                 and any(m is model.lm_head for m in b.modules))
    assert whole_head_bytes(owner) == (4 if tied else 2) * TABLE
    need = _need(head["why"])
    assert need > whole_head_bytes(owner)  # and what the engine holds besides
    _loss_matches(ref, model, 1e-6)
    infinity.unwrap(model)
    # whole up to WHOLE_SHARE of the budget (the rest: what the count leaves out)
    edge = int(need / WHOLE_SHARE)
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), host_budget=edge + 1,
                          chunk_bytes="1MiB", **NVME)
    assert not infinity.stats(model)["tiled_head"]["on"]
    infinity.unwrap(model)
    # a byte less: tiled, and the loss is still plain PyTorch's
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), host_budget=edge - 1,
                          chunk_bytes="1MiB", **NVME)
    head = infinity.stats(model)["tiled_head"]
    assert head["on"] and "tiled over its vocabulary" in head["why"]
    assert engine_of(model).tiled_head is model.lm_head
    _loss_matches(ref, model, 4e-6)
    infinity.unwrap(model)
    # pinned off, the same budget fetches it whole
    model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), host_budget=edge - 1,
                          chunk_bytes="1MiB", tiled_head=False, **NVME)
    assert infinity.stats(model)["tiled_head"] == {
        "setting": False, "on": False, "why": "tiled_head=False as set: the head is fetched whole"}
    infinity.unwrap(model)


def test_a_head_that_cannot_be_tiled_is_warned_about(tmp_path, caplog):
    """The tied table kept in the root block (param_persistence_threshold above it) cannot be
    tiled: under a budget it would break, wrap warns naming the bytes and the remedy."""
    ref = _llama(tied=True)
    with caplog.at_level(logging.WARNING, logger="infinity.runtime.build.head"):
        model = infinity.wrap(copy.deepcopy(ref), nvme_path=str(tmp_path), host_budget="64MiB",
                              chunk_bytes="1MiB", param_persistence_threshold=10 ** 9, **NVME)
    head = infinity.stats(model)["tiled_head"]
    assert not head["on"] and "root block" in head["why"]
    warned = [r.getMessage() for r in caplog.records if "cannot be tiled" in r.getMessage()]
    assert warned and "Raise host_budget to at least" in warned[0], caplog.text
    infinity.unwrap(model)


def test_a_model_without_a_tileable_head_is_left_alone(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    infinity.wrap(model, nvme_path=str(tmp_path), host_budget="64MiB", **NVME)
    head = infinity.stats(model)["tiled_head"]
    assert not head["on"] and "get_output_embeddings" in head["why"]
    infinity.unwrap(model)
