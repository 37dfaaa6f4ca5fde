"""Where an NVMe optimizer step's time goes: the I/O engine's per-request timing, the
pipeline's read/write waits and its request timeline, and that recording them changes no bit."""
import copy
import time

import pytest
import torch
from test_optim import _model, _train

import infinity
import infinity.io as inf_io
from infinity import _native
from infinity.optim.states import swapper


def test_request_timing_is_ordered_and_counts_crc(tmp_path):
    buf = inf_io.aligned_empty(8 << 20)
    buf.fill_(7)
    with inf_io.FileHandle(tmp_path / "t.bin", "w+") as f:
        t0 = time.perf_counter()
        wfut = f.pwrite(buf, 0, crc=True)
        assert wfut.timing() is None or wfut.done()  # pending: no timing yet
        wfut.wait()
        rfut = f.pread(buf, 0, crc=False)
        rfut.wait()
        t1 = time.perf_counter()
    for fut, crc in ((wfut, True), (rfut, False)):
        timing = fut.timing()
        if timing is None:
            pytest.skip("the native I/O engine is not loaded (no request timing)")
        submit, first, done, crc_s = timing
        # the engine's clock is time.perf_counter's: the request lies inside [t0, t1]
        assert t0 <= submit <= first <= done <= t1
        assert (crc_s > 0) == crc
        assert crc_s <= done - first
    assert wfut.op == "write" and rfut.op == "read" and wfut.nbytes == 8 << 20


def test_fallback_backend_has_no_timing(tmp_path):
    buf = inf_io.aligned_empty(1 << 16)
    with _native.force_fallback():
        with inf_io.FileHandle(tmp_path / "f.bin", "w+") as f:
            fut = f.pwrite(buf, 0)
            fut.wait()
            assert fut.timing() is None


def _states(opt):
    return {s.key: torch.cat([s.master, s.exp_avg, s.exp_avg_sq]).clone()
            for s in opt.state_dicts.shard_states()}


def test_recording_the_timeline_changes_no_bit_and_adds_up(tmp_path):
    base = _model()
    results = []
    for record in (False, True):
        model = copy.deepcopy(base)
        path = tmp_path / f"r{int(record)}"
        path.mkdir()
        infinity.wrap(model, nvme_path=str(path), optimizer_tier="nvme")
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
        swapper.record_requests(record)
        try:
            losses = _train(model, opt, 3)
        finally:
            swapper.record_requests(False)
        st = opt.last_step_stats
        n_shards = len(list(opt.state_dicts.shard_states()))
        if record:
            reqs = st.requests
            kinds = [r[0] for r in reqs]
            # one update per shard; per shard at least its states read and written (plus
            # gradients read and the working copy written where those live on NVMe)
            assert kinds.count("compute") == n_shards
            assert kinds.count("read") >= n_shards and kinds.count("write") >= n_shards
            assert sum(r[1] for r in reqs if r[0] == "read") == st.bytes_read
            assert sum(r[1] for r in reqs if r[0] == "write") == st.bytes_written
            for r in reqs:
                if r[0] != "compute" and r[3]:
                    assert r[2] <= r[3] <= r[4]
            assert st.crc_s > 0  # verify_checksums is on by default: the workers CRC'd
        else:
            assert st.requests is None
        assert st.read_wait_s >= 0 and st.write_wait_s >= 0
        assert st.read_wait_s + st.write_wait_s == pytest.approx(st.io_wait_s, abs=1e-6)
        results.append((losses, _states(opt)))
        opt.close()
        infinity.unwrap(model)
    (l0, s0), (l1, s1) = results
    assert l0 == l1
    for key in s0:
        assert torch.equal(s0[key], s1[key]), key


@pytest.fixture
def crc_threads_restored():
    saved = inf_io.get_config()
    yield
    inf_io.configure(crc_threads=saved.crc_threads, chunk_bytes=saved.chunk_bytes)


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_crc_threads_give_the_same_checksums(tmp_path, crc_threads_restored, threads):
    """Checksums computed inline by the I/O workers (0) or by CRC threads beside them are the
    same CRC32C, for aligned and unaligned sizes, reads and writes."""
    inf_io.configure(crc_threads=threads, chunk_bytes=1 << 20)
    gen = torch.Generator().manual_seed(threads)
    data = inf_io.aligned_empty(5 << 20)
    data.copy_(torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, generator=gen))
    back = inf_io.aligned_empty(5 << 20)
    with inf_io.FileHandle(tmp_path / "c.bin", "w+") as f:
        for n in (5 << 20, (5 << 20) - 100, 4096, 1):
            w = f.pwrite(data, 0, n, crc=True)
            w.wait()
            r = f.pread(back, 0, n, crc=True)
            want = inf_io.crc32c(data[:n])
            assert w.crc32c() == want and r.crc32c() == want, n
            if w.timing() is not None:
                assert w.timing()[3] > 0 or n < (1 << 20)


@pytest.mark.parametrize("op", ["read", "write"])
def test_failed_chunk_with_crc_threads_raises_and_does_not_hang(tmp_path, crc_threads_restored,
                                                               op):
    """A chunk that fails while other chunks' checksums are queued: the request completes with
    the error (no checksum), and the engine keeps working."""
    import errno

    from infinity.io import faults
    inf_io.configure(crc_threads=2, chunk_bytes=1 << 20)
    buf = inf_io.aligned_empty(8 << 20)
    buf.fill_(3)
    with inf_io.FileHandle(tmp_path / "x.bin", "w+") as f:
        f.pwrite(buf, 0).wait()
        faults.inject_fault(op, errno.EIO, after_bytes=3 << 20)
        try:
            fut = (f.pread if op == "read" else f.pwrite)(buf, 0, crc=True)
            with pytest.raises(inf_io.InfinityIOError):
                fut.wait(timeout=30)
        finally:
            faults.clear_faults()
        ok = f.pread(buf, 0, crc=True)
        assert ok.wait(timeout=30) == 8 << 20
        assert ok.crc32c() == inf_io.crc32c(buf)


def test_crc_threads_config_is_checked(crc_threads_restored):
    with pytest.raises(ValueError, match="crc_threads"):
        inf_io.configure(crc_threads=-1)
    with pytest.raises(ValueError, match="crc_threads"):
        inf_io.configure(crc_threads=True)
    assert inf_io.get_config().crc_threads >= 2
