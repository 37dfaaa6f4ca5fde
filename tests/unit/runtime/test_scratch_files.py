"""The activation tier's scratch files: extents of any size carved from a few files by the swap
files' extent allocator; freed ranges serve the next step's (files and bytes stay flat); a
slot's bytes round-trip and a changed one is caught by its CRC32C."""
import gc

import pytest
import torch

from infinity import io as inf_io
from infinity.runtime.activations.buffers import ScratchFiles
from infinity.tiers import SwapCorruptionError, SwapStore

A = inf_io.ALIGNMENT


@pytest.fixture
def files(tmp_path):
    store = SwapStore(str(tmp_path), require_direct=False, verify=True)
    scratch = ScratchFiles(store, verify=True, require_direct=False, file_bytes=16 * A)
    yield scratch
    scratch.close()
    store.close()


def _step(files, sizes):
    """One step's saves: slots of ``sizes`` bytes held together, then all dropped."""
    slots = [files.acquire(n) for n in sizes]
    where = sorted((s.handle.path, s.offset, s.nbytes) for s in slots)
    del slots
    gc.collect()
    return where


def test_sizes_share_files_and_steps_reuse_the_ranges(files):
    sizes = [A, 3 * A, 100, 2 * A + 1, 5 * A, A]  # 15 pages: one 16-page file
    first = _step(files, sizes)
    assert files.files == 1 and files.total_bytes == 16 * A
    ends = {}
    for path, offset, nbytes in first:  # disjoint ranges
        assert nbytes % A == 0 and offset % A == 0
        assert offset >= ends.get(path, 0)
        ends[path] = offset + nbytes
    for _ in range(3):  # later steps take the same ranges: nothing grows
        assert _step(files, sizes) == first
        assert files.files == 1 and files.total_bytes == 16 * A


def test_a_full_file_or_a_larger_request_makes_a_new_file(files):
    held = [files.acquire(8 * A), files.acquire(8 * A)]  # the first file, full
    held.append(files.acquire(A))
    assert files.files == 2
    held.append(files.acquire(20 * A))  # larger than a file: one of its own
    assert files.files == 3 and files.total_bytes == (16 + 16 + 20) * A
    del held[0]
    gc.collect()
    again = files.acquire(8 * A)  # the freed range, not a fourth file
    assert files.files == 3 and again.offset == 0


def test_round_trip_and_corruption_caught(files):
    slot = files.acquire(3 * A)
    data = torch.arange(3 * A, dtype=torch.uint8)
    buf = inf_io.aligned_empty(3 * A)
    buf.copy_(data)
    files.write(slot, buf)
    out = inf_io.aligned_empty(3 * A)
    files.read(slot, out)
    assert torch.equal(out, data)
    with open(slot.handle.path, "r+b") as fh:  # another process changes a byte
        fh.seek(slot.offset + 5)
        fh.write(b"\xff" if data[5] != 255 else b"\x00")
    with pytest.raises(SwapCorruptionError, match="corrupted"):
        files.read(slot, out)
