"""Swap files created lazily (gradient files): no disk until the first write, which
preallocates the whole file; its content then reads back checked like any other file's."""
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
