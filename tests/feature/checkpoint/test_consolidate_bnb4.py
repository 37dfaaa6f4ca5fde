"""consolidate(quantize="nf4" | "nf4-dq"): the layers' linear weights in bitsandbytes'
serialized 4-bit format (infinity/checkpoint/bnb4.py), read back

* by ``wrap(source=)`` of a meta model: every quantized weight equals the NF4 quantization of
  the trained weight decoded (bitwise; double-quantized: decoded from its nested absmax),
  everything else equals the trained model bitwise;
* by transformers' ``from_pretrained`` with bitsandbytes: the same dequantized weights.
"""
from __future__ import annotations

import json

import pytest
import torch

import infinity
from infinity.checkpoint import bnb4
from infinity.ops import nf4, nf4_dq

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False))


def _trained_checkpoint(tmp_path):
    model = _llama()
    infinity.wrap(model, param_tier="host")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    infinity.unwrap(model)
    return trained


def _expected(trained, quantize):
    out = {}
    for name, value in trained.items():
        if not bnb4.quantized(name, tuple(value.shape), value.dtype):
            out[name] = value
            continue
        codes, absmax = nf4.quantize_nf4(value)
        if quantize == "nf4-dq":
            q, scales, offset = nf4_dq.quantize_absmax(absmax)
            absmax = nf4.absmax_from_nested(q, nf4_dq.dynamic_map(), scales, offset)
        out[name] = nf4.dequantize_nf4(codes, absmax, value.numel()).view(value.shape)
    return out


@pytest.mark.parametrize("quantize", ["nf4", "nf4-dq"])
def test_consolidated_nf4_is_read_back_by_source_and_by_transformers(quantize, tmp_path):
    from safetensors.torch import load_file
    trained = _trained_checkpoint(tmp_path)
    out = tmp_path / "hf"
    infinity.consolidate(tmp_path / "ckpt", out, quantize=quantize)
    raw = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert raw[name].dtype == torch.uint8 and raw[name].shape == (64 * 128 // 2, 1)
    state = json.loads(bytes(raw[name + ".quant_state.bitsandbytes__nf4"].tolist()))
    assert state["quant_type"] == "nf4" and state["shape"] == [64, 128]
    assert ("nested_offset" in state) == (quantize == "nf4-dq")
    assert raw["lm_head.weight"].dtype == torch.float32  # the head stays full width
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_use_double_quant"] == (quantize == "nf4-dq")
    expected = _expected(trained, quantize)
    assert sum(not torch.equal(expected[k], trained[k]) for k in trained) == 14  # 7 x 2 layers

    # wrap(source=) of a meta model
    from transformers import LlamaForCausalLM
    with infinity.empty_init():
        meta = LlamaForCausalLM(_llama().config)
    meta.requires_grad_(False)
    infinity.wrap(meta, param_tier="host", source=str(out / "model.safetensors"),
                  frozen_format="nf4" if quantize == "nf4" else None)
    got = meta.state_dict()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    infinity.unwrap(meta)

    # transformers + bitsandbytes
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM
    try:
        loaded = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    except (ImportError, RuntimeError, ValueError) as exc:  # pragma: no cover
        pytest.skip(f"transformers cannot load bitsandbytes 4-bit on this CPU: {exc}")
    seen = 0
    for mod_name, module in loaded.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            value = bnb.functional.dequantize_4bit(w.data, w.quant_state).float()
            assert torch.equal(value, expected[mod_name + ".weight"]), mod_name
            seen += 1
    assert seen == 14


def test_unsupported_quantize_is_refused_before_anything_is_read_or_written(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="infinity.consolidate: quantize='nf8' is not supported"):
        infinity.consolidate(tmp_path / "no-such-checkpoint", out, quantize="nf8")
    assert not out.exists()


def test_cli_quantize_writes_the_same_files_as_the_function(tmp_path, capsys):
    from safetensors.torch import load_file

    from infinity.cli import main
    _trained_checkpoint(tmp_path)
    infinity.consolidate(tmp_path / "ckpt", tmp_path / "api", quantize="nf4-dq")
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "cli"),
                 "--quantize", "nf4-dq"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    api = load_file(tmp_path / "api" / "model.safetensors")
    cli = load_file(tmp_path / "cli" / "model.safetensors")
    assert api.keys() == cli.keys()
    assert all(torch.equal(api[k], cli[k]) for k in api)
    assert (json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
            == json.loads((tmp_path / "api" / "config.json").read_text())["quantization_config"])
    with pytest.raises(SystemExit):  # argparse refuses an unknown format
        main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "bad"), "--quantize", "nf8"])
    assert not (tmp_path / "bad").exists()
