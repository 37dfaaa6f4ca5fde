"""The free-extent allocator of the optimizer's state file (infinity.tiers.extents)."""
from __future__ import annotations

import os
import random

import pytest

from infinity.tiers.extents import ExtentAllocator, ExtentsExhaustedError

P = 4096


def test_alloc_rounds_to_the_alignment_and_grows_at_the_end():
    a = ExtentAllocator()
    assert a.alloc(1) == 0
    assert a.alloc(P) == P
    assert a.alloc(3 * P - 5) == 2 * P
    assert a.capacity == 5 * P and a.used == 5 * P and a.free_bytes == 0


def test_first_fit_reuses_the_first_hole_that_fits():
    a = ExtentAllocator()
    offs = [a.alloc(2 * P) for _ in range(4)]  # 0, 2P, 4P, 6P
    a.free(offs[0], 2 * P)
    a.free(offs[2], 2 * P)
    assert a.alloc(3 * P) == 8 * P        # neither hole fits: the end
    assert a.alloc(P) == 0                # the first hole, its start
    assert a.alloc(2 * P) == 4 * P        # the second hole (the first has P left)
    assert a.alloc(P) == P
    assert a.free_ranges == [] and a.capacity == 11 * P


def test_free_coalesces_with_both_neighbours_and_trim_drops_the_tail():
    a = ExtentAllocator()
    offs = [a.alloc(P) for _ in range(5)]
    a.free(offs[1], P)
    a.free(offs[3], P)
    assert a.free_ranges == [(P, P), (3 * P, P)]
    a.free(offs[2], P)                    # joins both
    assert a.free_ranges == [(P, 3 * P)]
    a.free(offs[4], P)
    assert a.free_ranges == [(P, 4 * P)]
    assert a.trim() == P and a.capacity == P and a.free_ranges == []
    assert a.used == P


def test_growth_reuses_a_free_tail():
    a = ExtentAllocator()
    a.alloc(P)
    b = a.alloc(P)
    a.free(b, P)
    assert a.alloc(3 * P) == P            # the free tail [P, 2P) plus 2P more
    assert a.capacity == 4 * P


def test_double_free_and_bad_ranges_are_refused():
    a = ExtentAllocator()
    x = a.alloc(2 * P)
    a.alloc(P)
    a.free(x, 2 * P)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(x, P)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(P, 2 * P)                  # overlaps the free range and the live one
    with pytest.raises(ValueError, match="infinity"):
        a.free(100, P)                    # unaligned
    with pytest.raises(ValueError, match="infinity"):
        a.free(2 * P, 4 * P)              # past the end
    with pytest.raises(ValueError, match="infinity"):
        a.alloc(0)


def test_exhaustion_is_a_clear_error_and_changes_nothing():
    a = ExtentAllocator(limit=4 * P, what="test file")
    a.alloc(2 * P)
    b = a.alloc(P)
    a.alloc(P)
    a.free(b, P)
    ranges, cap, used = a.free_ranges, a.capacity, a.used
    with pytest.raises(ExtentsExhaustedError) as info:
        a.alloc(2 * P)
    msg = str(info.value)
    assert "infinity" in msg and "test file" in msg and f"{2 * P:,}" in msg
    assert "largest free range is 4,096" in msg and "nvme_path" in msg
    assert (a.free_ranges, a.capacity, a.used) == (ranges, cap, used)
    assert a.alloc(P) == b                # what fits still does


def test_random_workload_against_a_page_map():
    """Random allocs and frees: live extents never overlap, free ranges are sorted and fully
    coalesced, the bookkeeping matches a page-by-page map, and the space never exceeds the
    peak of live bytes by more than the largest request times the live extents' count."""
    rng = random.Random(0)
    a = ExtentAllocator()
    live = {}
    peak = 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            n = rng.choice([1, 2, 3, 8]) * P
            off = a.alloc(n)
            live[off] = n
        peak = max(peak, a.used)
        pages = [0] * (a.capacity // P)
        for off, n in live.items():
            for p in range(off // P, (off + n) // P):
                assert pages[p] == 0
                pages[p] = 1
        free = a.free_ranges
        for (s0, n0), (s1, _) in zip(free, free[1:]):
            assert s0 + n0 < s1           # sorted, disjoint, not adjacent
        assert sum(n for _, n in free) == a.free_bytes == pages.count(0) * P
        assert a.used == sum(live.values())
    assert a.capacity <= peak + 8 * P * 64


def test_swap_store_reserves_grows_and_keeps_freed_blocks_up_to_a_bound(tmp_path):
    """SwapStore.reserve grows a one-piece file and reserves its blocks (ENOSPC up front);
    release keeps a freed range's blocks for the next reserve over it (no fallocate then), up
    to KEEP_FREED_EXTENTS times the largest extent; beyond, the kept ranges nearest the file's
    end are punched out (the file keeps its size) down to one largest extent; give_back
    punches the rest. Span I/O works throughout."""
    import torch

    from infinity import io as inf_io
    from infinity.tiers import SwapStore, swap_store
    keep = swap_store.KEEP_FREED_EXTENTS
    store = SwapStore(str(tmp_path), require_direct=False)
    try:
        store.create("f", 0)
        n = keep + 3                                  # extents of 2P, one written
        for i in range(n):
            store.reserve("f", 2 * i * P, 2 * P)
        assert store.nbytes("f") == 2 * n * P and store.disk_bytes("f") >= 2 * n * P
        assert store.allocated_bytes == 2 * n * P
        buf = inf_io.aligned_empty(2 * P)
        buf.copy_(torch.arange(2 * P, dtype=torch.int64).to(torch.uint8))
        store.write_span("f", buf, 0).wait()
        full = store.disk_bytes("f")
        for i in range(1, keep + 1):                  # up to the bound: all kept
            assert store.release("f", 2 * i * P, 2 * P) is False
        assert store.kept_bytes("f") == 2 * keep * P and store.released_bytes == 0
        assert store.disk_bytes("f") == full
        store.reserve("f", 2 * P, 2 * P)              # a kept range: no fallocate
        store.reserve("f", 4 * P, P)                  # part of one
        assert store.allocated_bytes == 2 * n * P
        assert store.kept_bytes("f") == 2 * (keep - 2) * P + P
        store.release("f", 2 * P, 2 * P)
        store.release("f", 4 * P, P)
        released = store.release("f", 2 * (n - 1) * P, 2 * P)   # over the bound
        if released:  # the filesystem punches holes: the last ranges went back, one extent kept
            assert store.kept_bytes("f") == 2 * P and store.released_bytes == 2 * keep * P
            assert store.disk_bytes("f") <= full - 2 * keep * P
            assert store.give_back("f") is True
            assert store.kept_bytes("f") == 0
            assert store.disk_bytes("f") <= full - 2 * (keep + 1) * P
        assert os.stat(store.path("f")).st_size == 2 * n * P
        store.reserve("f", 2 * (n - 1) * P, 2 * P)    # punched (or kept): reserved again
        back = inf_io.aligned_empty(2 * P)
        store.read_span("f", back, 0).wait()
        assert torch.equal(back, buf)
        with pytest.raises(ValueError, match="outside"):
            store.release("f", 2 * (n - 1) * P, 4 * P)
        store.release("f", 2 * (n - 1) * P, 2 * P)
        with pytest.raises(RuntimeError, match="released twice"):
            store.release("f", 2 * (n - 1) * P, P)
    finally:
        store.close()


def test_a_failed_reserve_keeps_the_kept_blocks(tmp_path, monkeypatch):
    """posix_fallocate failing (ENOSPC) for the part of a reserve that was not kept leaves the
    kept part kept (the caller frees the extent without releasing it)."""
    import errno

    from infinity.tiers import SwapStore
    store = SwapStore(str(tmp_path), require_direct=False)
    try:
        store.create("f", 0)
        store.reserve("f", 0, 4 * P)
        store.release("f", P, 2 * P)

        def full(fd, offset, nbytes):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(OSError):
            store.reserve("f", P, 4 * P)              # kept [P, 3P) plus 2P past the end
        assert store.kept_bytes("f") == 2 * P and store.nbytes("f") == 4 * P
        store.reserve("f", 2 * P, P)                  # all kept: no fallocate needed
        assert store.kept_bytes("f") == P
    finally:
        store.close()
