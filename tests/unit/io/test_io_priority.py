"""Urgent reads (``pread(..., urgent=True)``: the engine's parameter fetches) are served ahead of
queued requests that are not, on both native backends; the bytes are right either way."""
import pytest
import torch
from test_io import _uring_usable

from infinity import _native, io

MIB = 1 << 20


@pytest.fixture(params=["threads", "io_uring"])
def one_worker(request):
    if not _native.available():
        pytest.skip("native library not built")
    if request.param == "io_uring" and not _uring_usable():
        pytest.skip("io_uring not usable here")
    old = io.get_config()
    # one worker (one ring slot), 1 MiB chunks: requests are served strictly in queue order
    io.configure(backend=request.param, num_threads=1, chunk_bytes=MIB)
    try:
        yield request.param
    finally:
        io.configure(backend=old.backend, num_threads=old.num_threads,
                     chunk_bytes=old.chunk_bytes)


def test_urgent_read_overtakes_queued_reads(tmp_path, one_worker):
    path = tmp_path / "data.bin"
    data = torch.arange(16 * MIB // 4, dtype=torch.int32)
    with io.FileHandle(path, "w+") as f:
        f.write(io.aligned_empty(data.numel(), torch.int32).copy_(data))
    bulk = [io.aligned_empty(2 * MIB // 4, torch.int32) for _ in range(6)]
    first = io.aligned_empty(MIB // 4, torch.int32)
    with io.FileHandle(path, "r") as f:
        futures = [f.pread(buf, offset=i * 2 * MIB) for i, buf in enumerate(bulk)]
        urgent = f.pread(first, offset=14 * MIB, urgent=True)
        for fut in futures + [urgent]:
            fut.wait()
        done = {i: fut.timing()[2] for i, fut in enumerate(futures)}
        urgent_done = urgent.timing()[2]
    for i, buf in enumerate(bulk):
        assert torch.equal(buf, data[i * MIB // 2:(i + 1) * MIB // 2])
    assert torch.equal(first, data[14 * MIB // 4:15 * MIB // 4])
    # in submission order it would finish last; ahead of the queue it finishes before every
    # request that had not started (the first one or two may have been under way)
    assert urgent_done < min(done[i] for i in range(2, 6)), (urgent_done, done)
