"""Swap files created lazily (gradient files): no disk until the first write, which
preallocates the whole file; its content then reads back checked like any other file's."""
import pytest
import torch

from infinity.tiers.swap_store import SwapStore

PIECE = 64 * 1024


def test_lazy_file_takes_disk_at_its_first_write(tmp_path):
    store = SwapStore(str(tmp_path))
    try:
        nbytes = 4 * PIECE
        store.create("lazy", nbytes, PIECE, lazy=True)
        store.create("eager", nbytes, PIECE)
        assert not store.allocated("lazy") and store.allocated("eager")
        assert store.disk_bytes("lazy") == 0
        assert store.disk_bytes("eager") >= nbytes
        data = torch.arange(PIECE // 4, dtype=torch.float32)
        store.write_at("lazy", PIECE, data).wait()  # one piece, in the middle
        assert store.allocated("lazy")
        assert store.disk_bytes("lazy") >= nbytes  # the whole file, preallocated
        back = torch.empty_like(data)
        store.read_at("lazy", PIECE, back).wait()
        store.verify_read_at("lazy", PIECE, back)
        assert torch.equal(back, data)
    finally:
        store.close()


def test_dropped_file_gives_its_disk_back_refuses_reads_and_takes_disk_again(tmp_path):
    """drop_blocks (gradients a step in backward consumed): the file's disk goes back, a read
    raises instead of returning stale bytes or zeros, and the next write allocates and checksums it again."""
    store = SwapStore(str(tmp_path))
    try:
        n = 64 << 10
        store.create("g", n, piece_bytes=16 << 10, lazy=True)
        data = torch.arange(n // 4, dtype=torch.float32)
        store.write_at("g", 0, data)  # not waited for: drop_blocks waits for it
        assert store.drop_blocks("g")
        assert not store.allocated("g")
        assert store.disk_bytes("g") == 0
        assert not store.drop_blocks("g")  # nothing left to give back
        back = torch.empty(n // 4, dtype=torch.float32)
        with pytest.raises(OSError, match="short read"):  # the file holds no bytes now
            store.read_at_sync("g", 0, back)
        store.write_at("g", 0, data * 2).wait()
        assert store.allocated("g") and store.disk_bytes("g") >= n
        store.read_at_sync("g", 0, back)
        assert torch.equal(back, data * 2)
    finally:
        store.close()
