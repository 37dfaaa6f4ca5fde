"""frozen_format="nf4" / "int8": frozen matrices of the layer blocks stored quantized on host or
NVMe and dequantized at fetch (runtime/homes/quantized.py, runtime/homes/quant_format.py).

* LoRA on a quantized base trains exactly like a plain PyTorch model whose frozen layer
  matrices hold bitsandbytes' dequantization of the same NF4 weights (losses within 1e-5 over
  5 steps; in fact equal), on host and on NVMe, with a tiny and with Llama-3's vocabulary;
* the bytes fetched per category are the stored format's, by arithmetic;
* bad input: a quantized parameter made trainable, frozen_format with nothing frozen, a
  corrupted quantized swap file, an unknown format, param_tier='device'.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from integrations_helpers import TokenDataset, llama, wrap_settings  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

import infinity  # noqa: E402
from infinity.ops import int8_block, nf4  # noqa: E402
from infinity.runtime.homes.quant_format import frozen_format  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

STEPS = 5
LR = 1e-2
DATA = TokenDataset(2 * STEPS)
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HOST = {"param_tier": "host"}
NVME = {"param_tier": "nvme", "grad_tier": "host"}


def _lora_model(vocab: int = 128, seed: int = 0) -> torch.nn.Module:
    base = llama(seed=seed, hidden_size=64, intermediate_size=128, vocab_size=vocab)
    torch.manual_seed(1)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules=LINEARS, lora_dropout=0.0,
                     init_lora_weights=False)  # B random too: every adapter moves at step 1
    return get_peft_model(base, cfg)


def _quantized(name: str) -> bool:
    return ".layers." in name and "lora_" not in name


def _reference_weights(model: torch.nn.Module, fmt: str) -> None:
    """Frozen layer matrices -> their dequantized values: bitsandbytes' NF4 when it is
    installed (the reference format), else infinity's own ops; int8 by its definition."""
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError:  # pragma: no cover - bitsandbytes is in the test venv
        bnb_f = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad or p.dim() < 2 or not _quantized(name):
                continue
            flat = p.detach().reshape(-1).float()
            if fmt == "nf4" and bnb_f is not None:
                q, state = bnb_f.quantize_4bit(flat, blocksize=64, quant_type="nf4",
                                               compress_statistics=False)
                value = bnb_f.dequantize_4bit(q, state, quant_type="nf4")
            elif fmt == "nf4":
                codes, absmax = nf4.quantize_nf4(flat)
                value = nf4.dequantize_nf4(codes, absmax, flat.numel())
            else:
                codes, absmax = int8_block.quantize_int8(flat)
                value = int8_block.dequantize_int8(codes, absmax, flat.numel())
            p.copy_(value.reshape(p.shape).to(p.dtype))


def _train(model: torch.nn.Module, steps: int = STEPS):
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = infinity.optim.AdamW(trainable, lr=LR, weight_decay=0.01)
    losses = []
    for i in range(steps):
        ids = DATA.ids[2 * i:2 * i + 2]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# every format on every tier at a small vocabulary; the real vocabulary once (nf4 on NVMe)
@pytest.mark.parametrize("fmt, settings, vocab", [
    pytest.param(f, s, 128, id=f"{f}-{name}") for f in ("nf4", "int8")
    for name, s in (("host", HOST), ("nvme", NVME))] + [
    pytest.param("nf4", NVME, 128256, id="nf4-nvme-vocab128256")])
def test_lora_on_quantized_base_equals_dequantized_reference(fmt, settings, vocab, tmp_path):
    model = _lora_model(vocab)
    ref = copy.deepcopy(model)
    _reference_weights(ref, fmt)
    infinity.wrap(model, frozen_format=fmt, **wrap_settings(settings, tmp_path))
    # the engine's dequantized base equals the reference's (state_dict decodes the homes)
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    losses = _train(model)
    expected = _train(ref)
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5, (losses, expected)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for n, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-6)
    infinity.unwrap(model)


def _layer_stored_bytes(model: torch.nn.Module, fmt: str, layer: int = 0) -> int:
    """Arithmetic: the layer's frozen matrices, each starting on a block boundary, the flat
    padded to a 4 KiB page of fp32, stored as codes + fp32 absmax, padded to a page."""
    f = frozen_format(fmt)
    numel = 0
    for name, p in model.named_parameters():
        if f".layers.{layer}." in name and not p.requires_grad and p.dim() >= 2:
            numel = -(-numel // f.blocksize) * f.blocksize + p.numel()
    numel = -(-numel // 1024) * 1024
    raw = numel * f.code_bits // 8 + 4 * (numel // f.blocksize)
    return -(-raw // 4096) * 4096


@pytest.mark.parametrize("settings", [pytest.param(HOST, id="host"),
                                      pytest.param(NVME, id="nvme")])
def test_bytes_fetched_are_the_stored_format(settings, tmp_path):
    runs = {}
    for fmt in ("nf4", None):
        model = _lora_model()
        wrap = wrap_settings(settings, tmp_path / str(fmt))
        infinity.wrap(model, frozen_format=fmt, prefetch_window=0, **wrap)
        _train(model, 1)  # the first step records the schedule
        infinity.stats(model, reset=True)
        _train(model, 1)
        runs[fmt] = (infinity.stats(model), model)
    stats, model = runs["nf4"]
    fetched = stats["fetched"]
    stored = _layer_stored_bytes(model, "nf4")
    assert stored > 0
    nf4_bytes = fetched["frozen.layer.nf4"]
    fetches, rest = divmod(nf4_bytes, stored)  # every layer has the same shapes
    # 2 layers fetched for forward and again for backward, except the last one, which
    # backward finds still materialized
    assert rest == 0 and fetches == 3, fetched
    # the rest of each layer (adapters, norms: fp32) as a flat of its own, fetched alongside
    rest_numel = 0
    for name, p in model.named_parameters():
        if ".layers.0." in name and (p.requires_grad or p.dim() < 2):
            rest_numel = -(-rest_numel // 16) * 16 + p.numel()
    assert fetched["mixed.layer.float32"] == fetches * (-(-rest_numel // 1024) * 1024) * 4
    # the same run with a full-width base (on NVMe; on host an fp32 block is not fetched on a
    # CPU device: it computes in place in its home): the same fetches, 4 bytes per element
    plain = runs[None][0]["fetched"]
    if settings is HOST:
        assert not plain, plain
        return
    plain_numel = 0
    for name, p in model.named_parameters():
        if ".layers.0." in name:
            plain_numel = -(-plain_numel // 16) * 16 + p.numel()
    assert plain["mixed.layer.float32"] == fetches * (-(-plain_numel // 1024) * 1024) * 4
    numel = sum(p.numel() for n, p in model.named_parameters()
                if ".layers.0." in n and not p.requires_grad and p.dim() >= 2)
    assert nf4_bytes <= fetches * (numel * 0.5625 + 4096)
    if settings is NVME:
        assert stats["moved"]["nvme_to_host"] >= nf4_bytes
    # embeddings and head keep their dtype and are counted under their own category
    assert not any(k.startswith("frozen.outer.") and not k.endswith("float32") for k in fetched)


def test_trainable_parameter_in_quantized_home_is_refused(tmp_path):
    model = _lora_model()
    infinity.wrap(model, frozen_format="nf4", param_tier="host")
    weight = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    weight.requires_grad_(True)
    ids = DATA.ids[:2]
    with pytest.raises(RuntimeError, match="stored in nf4.*cannot be trained"):
        model(input_ids=ids, labels=ids).loss.backward()
    weight.requires_grad_(False)
    infinity.unwrap(model)


def test_nothing_frozen_warns(caplog):
    model = llama(seed=0)
    with caplog.at_level(logging.WARNING, logger="infinity"):
        infinity.wrap(model, frozen_format="nf4", param_tier="host")
    assert any("nothing was quantized" in r.getMessage() for r in caplog.records)
    assert not any(k.endswith(".nf4") for k in infinity.stats(model)["fetched"])
    infinity.unwrap(model)


def test_corrupted_quantized_swap_file_is_named(tmp_path):
    from infinity.runtime.engine import engine_of
    from infinity.tiers.swap_store import SwapCorruptionError
    model = _lora_model()
    infinity.wrap(model, frozen_format="nf4", prefetch_window=0,
                  **wrap_settings(NVME, tmp_path))
    engine = engine_of(model)
    key = next(f.key for f in engine.flats if ".nf4." in f.key)
    with open(engine.store.path(key), "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    ids = DATA.ids[:2]
    with pytest.raises(SwapCorruptionError, match=key.replace(".", r"\.")):
        model(input_ids=ids, labels=ids)
    engine.close(restore=False)


@pytest.mark.parametrize("settings,match", [
    ({"frozen_format": "fp4", "param_tier": "host"}, "frozen_format='fp4' is not supported"),
    ({"frozen_format": "nf4", "param_tier": "device"}, "quantized on host or NVMe"),
])
def test_bad_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        infinity.wrap(llama(seed=0), **settings)


def test_unwrap_gives_dequantized_values_and_outside_views_are_placeholders():
    model = _lora_model()
    ref = copy.deepcopy(model)
    _reference_weights(ref, "nf4")
    infinity.wrap(model, frozen_format="nf4", param_tier="host")
    weight = model.base_model.model.model.layers[1].mlp.down_proj.base_layer.weight
    # outside forward: a placeholder of the right shape, dtype and device (no memory)
    assert weight.shape == (64, 128) and weight.dtype == torch.float32
    assert bool(weight.isnan().all()) and weight.stride() == (0, 0)
    with infinity.materialized(model):
        expected = ref.base_model.model.model.layers[1].mlp.down_proj.base_layer.weight
        assert torch.equal(weight, expected)
    infinity.unwrap(model)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


def test_checkpoint_round_trip_requantizes_to_the_same_codes(tmp_path):
    """infinity.save_checkpoint writes the base's dequantized values; loading them into a
    quantized model quantizes them again to the same codes and absmax (NF4 is idempotent on
    its own values): the same weights and the same loss."""
    from infinity.runtime.engine import engine_of
    model = _lora_model()
    infinity.wrap(model, param_tier="host", frozen_format="nf4")
    _train(model, 1)
    opt = infinity.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    infinity.save_checkpoint(str(tmp_path / "ck"), model, opt)
    other = _lora_model(seed=5)  # another base and other adapters
    infinity.wrap(other, param_tier="host", frozen_format="nf4")
    opt2 = infinity.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=LR)
    infinity.load_checkpoint(str(tmp_path / "ck"), other, opt2)
    homes = {f.key: f.home for f in engine_of(model).flats if ".nf4." in f.key}
    for f in engine_of(other).flats:
        if ".nf4." in f.key:
            assert torch.equal(f.home, homes[f.key]), f.key
    ids = DATA.ids[:2]
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() == \
            other(input_ids=ids, labels=ids).loss.item()


@pytest.mark.parametrize("cap", ["scalar", "avx2", "avx512"])
def test_each_dequantization_path_trains_the_same(cap):
    """The engine's fetches decode with the kernel path chosen at run time; each path (forced)
    gives the reference's losses bitwise, and the path's own call counter moves."""
    from infinity import ops
    if cap not in ops.available_cpu_capabilities():
        pytest.skip(f"this CPU has no {cap}")
    model = _lora_model()
    ref = copy.deepcopy(model)
    _reference_weights(ref, "nf4")
    with ops.cpu_capability_override(cap):
        before = nf4.nf4_calls("dequantize", cap)
        infinity.wrap(model, frozen_format="nf4", param_tier="host")
        losses = _train(model, 2)
        assert nf4.nf4_calls("dequantize", cap) > before
    assert losses == _train(ref, 2)
    infinity.unwrap(model)
