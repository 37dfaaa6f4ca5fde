"""The sub-chunk size check and the element-range geometry the NVMe step's sub-chunking is to be
built on (infinity.optim.step.chunks; the step does not use it yet, and the optimizer takes no
chunk_bytes= until it does): ranges never split an 8-bit block and map to the exact bytes each
region's views cover."""
import pytest
import torch
from test_optim import _model

import infinity
from infinity import io as inf_io
from infinity.optim.step.layout import layout_for, state_views
from infinity.optim.step import chunks
from infinity.tiers import chunk_size
from infinity.runtime.engine import locate


def test_chunk_bytes_not_a_multiple_of_4096_is_refused():
    for bad in (4095, 65536 + 1, 0, -4096, 1.5, True):
        with pytest.raises(ValueError, match=r"infinity.*chunk_bytes.*4096"):
            chunk_size.check_chunk_bytes(bad)
    assert chunk_size.check_chunk_bytes(64 << 10) == 64 << 10


def test_chunk_bytes_default_follows_the_host_budget():
    assert chunk_size.resolve_chunk_bytes(None, None) == chunk_size.DEFAULT_CHUNK_BYTES
    assert chunk_size.resolve_chunk_bytes(None, 1 << 40) == chunk_size.DEFAULT_CHUNK_BYTES
    got = chunk_size.resolve_chunk_bytes(None, 3 << 30)
    assert got == (3 << 30) // 32 and got % 4096 == 0
    assert chunk_size.resolve_chunk_bytes(None, 1 << 20) == chunk_size.MIN_DEFAULT_CHUNK_BYTES
    assert chunk_size.resolve_chunk_bytes(8192, 1 << 40) == 8192


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit"])
def test_ranges_map_to_the_bytes_of_the_views(tmp_path, fmt):
    model = _model()
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    engine = locate(next(model.parameters())).engine
    for flat in engine.flats:
        layout = layout_for(flat, fmt, True)
        slots = [(s.offset, s.numel) for s in flat.slots]
        buf = inf_io.aligned_empty(layout.nbytes)
        views = state_views(layout, buf)
        base = buf.data_ptr()
        chunk = 64 << 10
        ranges = chunks.element_ranges(layout, slots, chunk)
        assert ranges[0][0] == 0 and ranges[-1][1] == flat.numel
        assert all(r[1] == q[0] for r, q in zip(ranges, ranges[1:]))
        for a, b in ranges:
            assert b > a
            for off, numel in slots:  # no 8-bit block split: boundaries on the slot's grid
                if off < a < off + numel:
                    assert (a - off) % 256 == 0
            spans = dict((name, (lo, hi)) for name, lo, hi in
                         chunks.byte_spans(layout, slots, a, b))
            total = sum(hi - lo for lo, hi in spans.values())
            assert total <= chunk
            sizes = {"master": views.master, "exp_avg": views.exp_avg,
                     "exp_avg_sq": views.exp_avg_sq}
            for name, t in sizes.items():
                lo, hi = spans[name]
                el = t.element_size()
                assert lo == t[a:b].data_ptr() - base and hi - lo == (b - a) * el
            assert len(ranges) == 1 or layout.nbytes > chunk
            if fmt == "8bit":
                ba = chunks.blocks_before(slots, a)
                bb = chunks.blocks_before(slots, b)
                for name, t in (("exp_avg_absmax", views.exp_avg_absmax),
                                ("exp_avg_sq_absmax", views.exp_avg_sq_absmax)):
                    lo, hi = spans[name]
                    assert hi - lo == 4 * (bb - ba)
                    if bb > ba:
                        assert lo == t[ba:bb].data_ptr() - base
        if fmt == "8bit":
            assert chunks.blocks_before(slots, flat.numel) == layout.blocks
    infinity.unwrap(model)


def test_ranges_refuse_mixed_layouts(tmp_path):
    model = _model()
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    engine = locate(next(model.parameters())).engine
    flat = max(engine.flats, key=lambda f: len(f.slots))
    if len(flat.slots) < 2:
        pytest.skip("no shard with two slots")
    fmts = ["8bit"] + ["fp32"] * (len(flat.slots) - 1)
    layout = layout_for(flat, fmts, True)
    with pytest.raises(ValueError, match="one-format"):
        chunks.element_ranges(layout, [(s.offset, s.numel) for s in flat.slots], 1 << 20)
    infinity.unwrap(model)


def test_crc32c_combine_matches_the_whole():
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 * 4096 + 123,), dtype=torch.uint8, generator=gen)
    whole = inf_io.crc32c(data)
    for cuts in ([0, 4096, 3 * 4096 + 123], [0, 1, 5000, 8192, 3 * 4096 + 123],
                 [0, 3 * 4096 + 123]):
        crc = 0
        for lo, hi in zip(cuts, cuts[1:]):
            crc = chunks.crc32c_combine(crc, inf_io.crc32c(data[lo:hi]), hi - lo)
        assert crc == whole
    assert chunks.crc32c_combine(whole, inf_io.crc32c(data[:0]), 0) == whole
