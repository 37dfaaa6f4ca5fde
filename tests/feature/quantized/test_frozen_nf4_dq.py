"""frozen_format="nf4-dq": NF4 with its absmax double-quantized as bitsandbytes'
``compress_statistics=True`` (runtime/homes/quant_format.py, ops/nf4_dq.py).

* the absmax quantization against bitsandbytes' own on one tensor (a single segment, so the
  offset is the same mean): the same map, offset and scales bitwise, codes equal but for
  values within rounding distance of a midpoint, decoded absmax within one code step;
* the stored size (0.5161 bytes per parameter) and a segmented flat decoding within the 8-bit
  rounding of the plain NF4 decode;
* LoRA on an nf4-dq base on NVMe trains like a plain model holding the engine's dequantized
  weights (losses within 1e-5 over 5 steps);
* a bitsandbytes checkpoint saved with double quantization as ``source=`` with
  frozen_format="nf4-dq": the values are bitsandbytes' within its absmax rounding.
"""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity.ops import nf4, nf4_dq
from infinity.runtime.homes.quant_format import frozen_format

bnb_f = pytest.importorskip("bitsandbytes.functional")

FMT = frozen_format("nf4-dq")


def _max_step(table: torch.Tensor) -> float:
    return float((table[1:] - table[:-1]).max())


@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 77), (64 * 256 * 3 + 64 * 5,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_absmax_quantization_matches_bitsandbytes(shape, dtype):
    torch.manual_seed(0)
    w = (torch.randn(shape) * 0.02).to(dtype)
    q, state = bnb_f.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    codes, absmax = nf4.quantize_nf4(w, 64)
    qa, scales, offset = nf4_dq.quantize_absmax(absmax)
    table = nf4_dq.dynamic_map()
    assert torch.equal(state.state2.code.float(), table)
    assert torch.equal(q.reshape(-1), codes)
    assert float(state.offset) == float(offset)
    assert torch.equal(state.state2.absmax.float(), scales)
    theirs = state.absmax.reshape(-1).long()
    mine = qa.long()
    differ = (theirs != mine).nonzero().reshape(-1)
    # ours is the nearest code; bitsandbytes' CPU kernel picks a neighbour for a few values
    # (0.16% of 405,078 over 3 seeds; 1 code away, 2 near zero where the map is dense)
    assert differ.numel() <= 0.01 * mine.numel()
    assert int((theirs - mine).abs().max()) <= 2
    ref = bnb_f.dequantize_4bit(q, state).float().reshape(-1)
    got = nf4.dequantize_nf4(codes, nf4.absmax_from_nested(qa, table, scales, offset), w.numel())
    # an absmax one code step apart at most: |level| <= 1 times step x scale
    bound = _max_step(table) * float(scales.max()) * 1.0001
    assert float((ref - got).abs().max()) <= bound


def test_stored_size_and_segmented_decode_within_rounding():
    assert FMT.segment_nbytes % 4096 == 0 and FMT.segment_nbytes == 262144
    assert abs(FMT.bytes_per_param - (0.5 + 1 / 64 + 4 / (64 * 256))) < 1e-12
    n = 2 * FMT.segment_elems + 3 * 4096 + 64 * 7 + 5   # 3 segments, a partial block
    assert FMT.stored_nbytes(n) <= n * 0.5162 + 4096
    torch.manual_seed(1)
    x = torch.randn(n) * 0.02
    stored = torch.zeros(FMT.stored_nbytes(n), dtype=torch.uint8)
    plain = torch.empty(n)
    for _, start, count, offset in FMT.segments(n):
        FMT.quantize_segment(x[start:start + count], stored[offset:offset + FMT.raw_nbytes(count)])
        codes, absmax = nf4.quantize_nf4(x[start:start + count])
        plain[start:start + count] = nf4.dequantize_nf4(codes, absmax, count)
    got = FMT.decode(stored, n)
    assert not torch.equal(got, plain)  # the absmax are rounded ...
    table = nf4_dq.dynamic_map()
    for _, start, count, offset in FMT.segments(n):
        _, _, scales, _ = FMT._parts(stored[offset:offset + FMT.raw_nbytes(count)], count)
        bound = _max_step(table) / 2 * float(scales.max()) * 1.0001 + 1e-9
        # ... by half a code step at most (levels are within [-1, 1])
        assert float((got - plain)[start:start + count].abs().max()) <= bound


def _lora_model():
    pytest.importorskip("peft")
    from integrations_helpers import llama
    from peft import LoraConfig, get_peft_model
    base = llama(seed=0, hidden_size=64, intermediate_size=128, vocab_size=128)
    torch.manual_seed(1)
    cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"])
    return get_peft_model(base, cfg)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_lora_on_nf4_dq_base_trains_like_its_dequantized_weights(tmp_path):
    from integrations_helpers import TokenDataset
    data = TokenDataset(10)
    model = _lora_model()
    ref = copy.deepcopy(model)
    infinity.wrap(model, frozen_format="nf4-dq", param_tier="nvme", grad_tier="host",
                  nvme_path=str(tmp_path))
    got = model.state_dict()
    step = _max_step(nf4_dq.dynamic_map())
    moved = 0
    with torch.no_grad():
        for name, p in ref.named_parameters():
            value = got[name]
            if ".layers." in name and "lora_" not in name and p.dim() >= 2:
                flat = p.detach().reshape(-1)
                codes, absmax = nf4.quantize_nf4(flat)
                plain = nf4.dequantize_nf4(codes, absmax, flat.numel()).view(p.shape)
                moved += int(not torch.equal(value, plain))
                # within the absmax rounding of plain NF4: a scale is at most the largest absmax
                assert float((value - plain).abs().max()) <= step * float(plain.abs().max()), name
            else:
                assert torch.equal(value, p.detach()), name
            p.copy_(value)
    assert moved > 0

    def train(m):
        opt = infinity.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for i in range(5):
            ids = data.ids[2 * i:2 * i + 2]
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    losses, expected = train(model), train(ref)
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5, (losses, expected)
    infinity.unwrap(model)


def test_bitsandbytes_double_quant_checkpoint_as_source(tmp_path):
    pytest.importorskip("transformers")
    from test_frozen_sources import _bnb_checkpoint, _meta_llama
    file, expected, _ = _bnb_checkpoint(tmp_path, compress=True)
    model = _meta_llama()
    model.requires_grad_(False)
    infinity.wrap(model, param_tier="host", source=file, frozen_format="nf4-dq")
    got = model.state_dict()
    step = _max_step(nf4_dq.dynamic_map())
    for name, value in expected.items():
        if ".layers." in name and name.endswith("proj.weight"):
            # the absmax quantized again: one code step of the 8-bit map at most, each
            # bitsandbytes' and ours (a scale is at most the largest absmax)
            assert float((got[name] - value).abs().max()) <= \
                2 * step * float(value.abs().max()), name
        else:
            assert torch.equal(got[name], value), name
    infinity.unwrap(model)
