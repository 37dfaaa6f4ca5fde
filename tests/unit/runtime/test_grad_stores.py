"""The per-tier gradient stores and their parts, on their own: the store picked per tier, the
host tier refusing file reads, gradients held in RAM for an overlapping step (handed back from
another thread), and the per-slot norms of chunked flats."""
import threading
from types import SimpleNamespace

import pytest
import torch

from infinity.runtime.core.stats import Stats
from infinity.runtime.grads.held import HeldGrads
from infinity.runtime.grads.norms import SlotNorms
from infinity.runtime.grads.sink import GradientSink
from infinity.tiers import ByteBudget, Tier


def _flat(nslots: int = 2, key: str = "b0.f0"):
    return SimpleNamespace(key=key, grad=None, slots=[object()] * nslots,
                           grad_ready=[True] * nslots)


def _sink(tier: Tier) -> GradientSink:
    return GradientSink(tier, torch.device("cpu"), Stats(), ByteBudget("host", None), None,
                        [], 2)


def test_the_store_is_picked_by_tier_and_other_tiers_are_refused():
    host, nvme = _sink(Tier.HOST), _sink(Tier.NVME)  # no trainable flat: no swap file needed
    assert not host.on_nvme and nvme.on_nvme
    assert host.pool is None and nvme.pool is None and host.host_bytes() == 0
    with pytest.raises(ValueError, match="host or nvme"):
        _sink(Tier.DEVICE)
    for sink in (host, nvme):
        sink.shutdown()


def test_host_tier_refuses_file_reads_with_a_clear_error():
    sink = _sink(Tier.HOST)
    flat = _flat()
    dst = torch.empty(4)
    for call in (lambda: sink.reads.read(flat, dst), lambda: sink.reads.read_range(flat, 0, 4, dst),
                 lambda: sink.reads.verify(flat, dst), lambda: sink.reads.range_elems(flat)):
        with pytest.raises(RuntimeError, match="host RAM"):
            call()
    sink.reads.wait_written(flat)  # nothing is ever written: returns at once
    assert sink.finite(flat) is None and sink.slot_norms(flat) is None
    assert sink.held.written(flat) and not sink.held.holds(flat) and sink.held.lost(flat) is None
    sink.shutdown()


def test_held_buffers_return_to_the_pool_once_handed_back_from_another_thread():
    released = []
    writing = set()
    held = HeldGrads(released.append, lambda buf: id(buf) in writing)
    a, b = _flat(key="a"), _flat(key="b")
    bufs = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    a.grad = bufs[0].view(torch.float32)
    held.hold(a, [bufs[0]])
    held.keep_chunks(b, {0: bufs[1], 1: bufs[2]})
    writing.add(id(bufs[2]))  # still being written: given back by the writer, not here
    assert held.holds(a) and held.holds(b) and held.holds_buffer(bufs[1])
    assert held.buffers_out() == 2 and held.kept_chunks(b) == {0: bufs[1], 1: bufs[2]}
    worker = threading.Thread(target=lambda: (held.release_held(a), held.release_held(b)))
    worker.start()
    held.reclaim(wait=True)  # blocks until the worker handed at least one back
    worker.join()
    held.reclaim()
    assert not held.any_held() and held.kept_chunks(b) is None
    assert a.grad is None  # the buffer it viewed went back to the pool
    assert [id(x) for x in released] == [id(bufs[0]), id(bufs[1])]


def test_unwritten_gradients_are_refused_then_lost_then_forgotten():
    held = HeldGrads()
    flat = _flat(key="b3.f0")
    held.set_unwritten(flat, "taken from RAM and not written")
    assert not held.written(flat)
    err = held.not_kept(flat, "reading")
    assert "infinity" in str(err) and "b3.f0" in str(err) and "zero_grad" in str(err)
    assert held.mark_lost(flat, "its update was undone")
    assert flat.grad_ready == [False, False] and held.written(flat)
    assert "its update was undone" in held.lost(flat)
    assert not held.mark_lost(flat, "again")  # nothing left to lose
    held.clear()
    assert held.lost(flat) is None


def _norm_flat(values):
    flat = SimpleNamespace(slots=[SimpleNamespace(offset=2 * i, numel=2)
                                  for i in range(len(values))],
                           grad_ready=[v is not None for v in values])
    return flat


def test_chunked_norms_keep_untouched_slots_and_give_up_on_unknown_ones():
    norms = SlotNorms()
    flat = _norm_flat([1.0, 2.0, None])
    norms.start_chunked(flat)
    norms.pending(flat)[0] = torch.tensor(3.0)
    norms.pending(flat)[1] = torch.tensor(4.0)
    assert norms.record_chunked(flat) == [torch.tensor(3.0), torch.tensor(4.0), None]
    assert norms.finite(flat) is True
    # the next backward touches slot 0 only: slot 1 keeps the norm of its sum
    norms.start_chunked(flat)
    norms.pending(flat)[0] = torch.tensor(float("inf"))
    got = norms.record_chunked(flat)
    assert got[1] == torch.tensor(4.0) and torch.isinf(got[0])
    assert norms.finite(flat) is None  # an infinite norm may be an overflow: read to check
    # a slot measured as None (larger than a chunk, accumulated): unknown for the flat
    norms.start_chunked(flat)
    norms.pending(flat)[1] = None
    assert norms.record_chunked(flat) is None and norms.slot_norms(flat) is None
    norms.forget(flat)
    assert norms.finite(flat) is None


ROWS, WIDTH = 256, 16  # a 16 KiB fp32 table in 4 chunks of 4 KiB, a pool of 2 buffers


def _table_sink(tmp_path):
    from infinity.runtime.core.flat import FlatParam
    from infinity.tiers import SwapStore
    table = torch.nn.Embedding(ROWS, WIDTH)
    flat = FlatParam("b0.f0", [("embed.weight", table, "weight", table.weight)],
                     torch.float32, torch.float32, torch.device("cpu"))
    store = SwapStore(str(tmp_path))
    stats = Stats()
    sink = GradientSink(Tier.NVME, torch.device("cpu"), stats, ByteBudget("host", None), store,
                        [flat], 2, chunk_bytes=4096)
    return flat, store, stats, sink


def _rows(rows, seed):
    rows = torch.tensor(rows, dtype=torch.int64)
    values = torch.randn(rows.numel(), WIDTH, generator=torch.Generator().manual_seed(seed))
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (ROWS, WIDTH), is_coalesced=True,
                                   check_invariants=True)


@pytest.mark.parametrize("case", ["none-first", "some-chunks", "then-dense", "no-rows"])
def test_row_gradients_write_each_chunk_once_and_zeros_where_no_rows_landed(tmp_path, case):
    """Row-sparse gradients on NVMe larger than a pool buffer: a first arrival without rows
    (the lookups' rows gathered and added later, RowHooks.gathered) writes nothing; the rows'
    chunks get them, every other chunk zeros, each chunk written once; a dense gradient after
    them adds onto zeros everywhere else."""
    flat, store, stats, sink = _table_sink(tmp_path)
    none = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, WIDTH),
                                   (ROWS, WIDTH), is_coalesced=True,
                                   check_invariants=True)
    expected = torch.zeros(ROWS, WIDTH)
    arrivals = {
        "none-first": [none, none, _rows([3, 70, 250], 1), none],
        "some-chunks": [_rows([5, 6], 2), _rows([6, 200], 3)],  # chunks 0 and 3 only
        "then-dense": [_rows([130], 4), torch.randn(ROWS, WIDTH)],
        "no-rows": [none, none],
    }[case]
    try:
        for g in arrivals:
            expected += g.to_dense()
            sink.add(flat, 0, g)
        sink.close(flat)
        sink.finish_backward()
        back = torch.empty(ROWS * WIDTH)
        sink.reads.read(flat, back).wait()
        assert torch.equal(back.view(ROWS, WIDTH), expected)
        assert stats.nvme_by_category["grads_written"] == ROWS * WIDTH * 4  # each chunk once
        assert stats.nvme_by_category["grads_read"] == ROWS * WIDTH * 4  # the read above only
    finally:
        sink.shutdown()
        store.close()
