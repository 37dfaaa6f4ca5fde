"""The block-quantized payloads of ZeRO's compressed collectives (runtime/zero/compress.py):
size, round trip within half a quantization step, the native int8 kernel against the torch
definition, and error feedback keeping what a quantization lost."""
import pytest
import torch

from infinity.runtime.zero.compress import Codec, Compression, _quantize, _scale
from infinity.policy import CommPolicy


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4097])
def test_round_trip_within_half_a_step(bits, numel):
    codec = Codec(bits, 256)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    x[:7] = 0  # a zero run
    payload = torch.empty(codec.payload_bytes(numel), dtype=torch.uint8)
    codec.encode(x, payload)
    out = torch.empty(numel)
    codec.decode(payload, numel, out)
    levels = 127 if bits == 8 else 7
    for start in range(0, numel, 256):
        block = x[start:start + 256]
        step = block.abs().max() / levels
        err = (out[start:start + 256] - block).abs().max()
        assert err <= step / 2 + 1e-6 * step, (start, float(err), float(step))
    codes = -(-(numel if bits == 8 else (numel + 1) // 2) // 4) * 4
    assert payload.numel() == codes + 4 * (-(-numel // 256))


def test_native_int8_equals_the_torch_definition():
    codec = Codec(8, 256)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    native = torch.empty(codec.payload_bytes(3000), dtype=torch.uint8)
    codec.encode(x, native)
    q, absmax = _quantize(x, 256, 127)
    assert torch.equal(native[:3000].view(torch.int8), q)
    assert torch.equal(native[3000:].view(torch.float32), absmax)
    out32, out16 = torch.empty(3000), torch.empty(3000, dtype=torch.bfloat16)
    codec.decode(native, 3000, out32)
    codec.decode(native, 3000, out16)
    assert torch.allclose(out32, _scale(q.float(), absmax, 256, 127), rtol=1e-6, atol=0)
    assert torch.equal(out16, out32.to(torch.bfloat16))


def test_error_feedback_keeps_what_was_lost():
    comp = Compression(CommPolicy("none", "int4", error_feedback=True))
    r = comp.residual(1, 512, torch.device("cpu"))
    assert r is not None and r.abs().sum() == 0 and comp.residual_bytes == 512 * 4
    assert Compression(CommPolicy("none", "int4")).residual(1, 512, torch.device("cpu")) is None


def test_bad_payload_is_refused():
    codec = Codec(8, 256)
    with pytest.raises(ValueError, match="payload"):
        codec.decode(torch.empty(10, dtype=torch.uint8), 300, torch.empty(300))
    with pytest.raises(ValueError, match="3-bit"):
        Codec(3, 256)
