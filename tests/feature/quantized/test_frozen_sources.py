"""A bitsandbytes NF4 checkpoint as ``source=`` of a meta model (runtime/homes/source_quant.py): each
weight decodes to bitsandbytes' own dequantization (bitwise), with and without double
quantization, and with frozen_format="nf4" the home holds bitsandbytes' codes and absmax again.
Other quantized formats are refused with a clear error."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
bnb_f = pytest.importorskip("bitsandbytes.functional")

from integrations_helpers import llama, llama_config  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import infinity  # noqa: E402
from infinity.runtime.engine import engine_of  # noqa: E402
from infinity.runtime.homes.quantized import QuantFlat  # noqa: E402
from infinity.runtime.homes.sources import SourceError  # noqa: E402


def _bnb_checkpoint(path, compress: bool):
    """A tiny Llama saved as bitsandbytes' 4-bit models are: every Linear of the layers in NF4
    (packed codes + quant state entries), the rest in fp32. Returns (file, expected values,
    {name: (codes, fp32 absmax)})."""
    model = llama(seed=0, hidden_size=64, intermediate_size=128)
    sd, expected, states = {}, {}, {}
    for name, p in model.state_dict().items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, state = bnb_f.quantize_4bit(p.reshape(-1).contiguous(), blocksize=64,
                                           quant_type="nf4", compress_statistics=compress)
            state.shape = p.shape
            sd[name] = q
            for k, v in state.as_dict(packed=True).items():
                sd[f"{name}.{k}"] = v
            expected[name] = bnb_f.dequantize_4bit(q, state, quant_type="nf4").reshape(p.shape)
            absmax = state.absmax if not compress else bnb_f.dequantize_blockwise(
                state.absmax, state.state2) + state.offset
            states[name] = (q.reshape(-1), absmax.float().reshape(-1))
        else:
            sd[name] = p.detach().clone().contiguous()
            expected[name] = p.detach().clone()
    file = str(path / "model.safetensors")
    save_file(sd, file)
    return file, expected, states


def _meta_llama():
    from transformers import LlamaForCausalLM
    with infinity.empty_init():
        return LlamaForCausalLM(llama_config(hidden_size=64, intermediate_size=128))


@pytest.mark.parametrize("frozen_format", [None, "nf4"])
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "double_quant"])
def test_bitsandbytes_nf4_checkpoint_as_source(compress, frozen_format, tmp_path):
    file, expected, states = _bnb_checkpoint(tmp_path, compress)
    model = _meta_llama()
    if frozen_format:
        model.requires_grad_(False)
    infinity.wrap(model, param_tier="host", source=file, frozen_format=frozen_format)
    got = model.state_dict()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    if frozen_format:  # the home holds bitsandbytes' codes and absmax again
        engine = engine_of(model)
        flats = [f for f in engine.flats if isinstance(f, QuantFlat)]
        assert len(flats) == 2
        for flat in flats:
            codes_bytes = flat.fmt.codes_nbytes(flat.numel)
            absmax = flat.home[codes_bytes:codes_bytes + 4 * (flat.numel // 64)].view(
                torch.float32)
            for s in flat.slots:
                q, a = states[s.qualname]
                assert torch.equal(flat.home[s.offset // 2:(s.offset + s.numel) // 2], q)
                assert torch.equal(absmax[s.offset // 64:(s.offset + s.numel) // 64], a)
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    infinity.unwrap(model)


@pytest.mark.parametrize("suffix,what", [(".SCB", "LLM.int8"), (".qweight", "GPTQ/AWQ"),
                                         (".quant_state.bitsandbytes__fp4", "FP4"),
                                         (".weight_scale_inv", "FP8")])
def test_unsupported_quantized_source_is_refused(suffix, what, tmp_path):
    sd = {k: v.contiguous() for k, v in llama(seed=0).state_dict().items()}
    sd["model.layers.0.self_attn.q_proj" + suffix] = torch.zeros(4)
    file = str(tmp_path / "model.safetensors")
    save_file(sd, file)
    with pytest.raises(SourceError, match=f"quantized in .*{what}.*original"):
        infinity.wrap(_meta_llama(), param_tier="host", source=file)
