"""The CUDA path's CPU-side logic, checked without a GPU: device choice (INFINITY_DEVICE, policy
validation), pinned memory only where a DMA needs it (a fake CUDA runtime records every
cudaHostRegister), RLIMIT_MEMLOCK errors, the deferred release of staging buffers, the bounded
gradient staging ring, casts on the device, and close draining fetches in flight."""
import concurrent.futures as cf
import copy
import threading
import time
import types

import pytest
import torch
from engine_helpers import SMALL, batches, loss_of

import infinity
from infinity.io import buffers
from infinity.models import TinyGPT
from infinity.policy import OffloadPolicy
from infinity.runtime import engine as engine_mod
from infinity.runtime.core.stats import Stats
from infinity.runtime.engine import resolve_device
from infinity.runtime.step.transfer import Fetch, Transfers
from infinity.tiers import BudgetExceededError, ByteBudget, HostPool, Tier, pinned


# ---- fakes ---------------------------------------------------------------------------------
class FakeCudart:
    """Records cudaHostRegister/cudaHostUnregister like the CUDA runtime would see them."""

    def __init__(self, fail: bool = False) -> None:
        self.registered = {}  # ptr -> bytes
        self.log = []
        self.fail = fail

    def cudaHostRegister(self, ptr, size, flags):
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = size
        self.log.append(("register", ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):
        assert ptr in self.registered, "unregistering memory that is not registered"
        self.log.append(("unregister", ptr, self.registered.pop(ptr)))
        return 0

    @property
    def nbytes(self) -> int:
        return sum(self.registered.values())


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.synchronized = 0
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(buffers, "_cudart", lambda: fake)
    return fake


@pytest.fixture
def dma_on_cpu(monkeypatch, cudart):
    """The engine pins as it would on CUDA (computing on the CPU), into the fake runtime."""
    monkeypatch.setattr(pinned, "pin_for_dma", lambda device: True)
    return cudart


def _memlock(monkeypatch, soft, hard, *, cap=False):
    calls = []
    fake = types.SimpleNamespace(
        RLIMIT_MEMLOCK=8, RLIM_INFINITY=-1,
        getrlimit=lambda which: (soft, hard),
        setrlimit=lambda which, limits: calls.append(limits))
    monkeypatch.setattr(buffers, "resource", fake)
    monkeypatch.setattr(buffers, "_has_cap_ipc_lock", lambda: cap)
    monkeypatch.delenv(buffers.MEMLOCK_ENV, raising=False)
    return calls


# ---- 1. device choice --------------------------------------------------------------------
def test_conftest_keeps_the_suite_on_the_cpu():
    import os
    assert os.environ.get("INFINITY_DEVICE") == "cpu"
    assert resolve_device(None) == torch.device("cpu")


def test_infinity_device_env(monkeypatch):
    monkeypatch.setenv("INFINITY_DEVICE", "cpu")
    assert resolve_device(None) == torch.device("cpu")
    monkeypatch.setenv("INFINITY_DEVICE", "  ")  # blank: as if unset
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    monkeypatch.delenv("INFINITY_DEVICE")
    assert resolve_device(None).type == expected
    for bad, match in (("tpu", "INFINITY_DEVICE='tpu'"), ("not a device", "INFINITY_DEVICE")):
        monkeypatch.setenv("INFINITY_DEVICE", bad)
        with pytest.raises(ValueError, match=match):
            resolve_device(None)


def test_explicit_device_beats_env(monkeypatch):
    monkeypatch.setenv("INFINITY_DEVICE", "cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="INFINITY_DEVICE='cuda' but CUDA is not available"):
            resolve_device(None)
        with pytest.raises(ValueError, match="device='cuda:0' but CUDA is not available"):
            resolve_device("cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_wrap_with_env_cuda_without_cuda_leaves_the_model_alone(monkeypatch):
    monkeypatch.setenv("INFINITY_DEVICE", "cuda")
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="INFINITY_DEVICE"):
        infinity.wrap(model, param_tier="host")
    assert engine_mod.engine_of(model) is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    infinity.wrap(model, param_tier="host", device="cpu")  # explicit device: fine
    assert next(model.parameters()).device.type == "cpu"
    infinity.unwrap(model)


@pytest.mark.parametrize("device", ["tpu", "mps", "meta", "cuda:x", 3.5])
def test_policy_rejects_unsupported_devices(device):
    with pytest.raises(ValueError, match="device="):
        OffloadPolicy(device=device)


def test_policy_accepts_devices():
    for device in ("cpu", "cuda", "cuda:1", torch.device("cpu"), None):
        OffloadPolicy(device=device)  # checked against the hardware only at wrap


def test_unwrap_restores_original_devices_and_values(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ref = copy.deepcopy(model)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme")
    engine = engine_mod.engine_of(model)
    assert set(engine._original_devices.values()) == {torch.device("cpu")}
    infinity.unwrap(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.device == q.device and torch.equal(p, q), name


# ---- 2. pinned memory only where a DMA needs it -----------------------------------------
def test_aligned_empty_is_not_pinned_by_default(cudart):
    pinned_before, locked_before = buffers.pinned_bytes(), buffers.locked_bytes()
    for dtype in (torch.uint8, torch.float32, torch.bfloat16):
        t = buffers.aligned_empty(100_000, dtype)
        assert buffers.is_aligned(t) and t.numel() == 100_000
        assert buffers.locked_bytes() == locked_before
    assert cudart.log == [] and buffers.pinned_bytes() == pinned_before


def test_aligned_empty_pin_registers_exactly_its_bytes(cudart):
    before = buffers.pinned_bytes()
    t = buffers.aligned_empty(12_345, torch.float32, pin=True)
    assert cudart.log == [("register", t.data_ptr(), 12_345 * 4)]
    assert buffers.pinned_bytes() - before == 12_345 * 4
    view = t[100:]
    del t
    assert len(cudart.log) == 1  # a view keeps it alive (and registered)
    ptr = cudart.log[0][1]
    del view
    assert cudart.log[-1] == ("unregister", ptr, 12_345 * 4)
    assert buffers.pinned_bytes() == before and cudart.registered == {}


def test_aligned_empty_pin_without_cuda_is_best_effort_mlock(monkeypatch):
    monkeypatch.setattr(buffers, "_cudart", lambda: None)
    before = buffers.locked_bytes()
    t = buffers.aligned_empty(1 << 16, pin=True)
    assert buffers.locked_bytes() - before in (0, 1 << 16)  # 0 where mlock is not permitted
    del t
    assert buffers.locked_bytes() == before
    u = buffers.aligned_empty(1 << 16)  # pageable by default
    assert buffers.locked_bytes() == before
    del u
    with pytest.raises(TypeError):
        buffers.aligned_empty(1 << 16, lock=True)  # one keyword: pin


def test_pin_tensors_is_all_or_nothing(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(buffers, "_cudart", lambda: fake)
    a, b = buffers.aligned_empty(4096), buffers.aligned_empty(8192)
    regions = buffers.pin_tensors([a, b], what="test")
    assert regions.nbytes == 4096 + 8192 == fake.nbytes
    regions.release()
    assert fake.registered == {}
    fake.fail = True
    with pytest.raises(buffers.PinnedMemoryError, match="cudaHostRegister of 4,096 bytes"):
        buffers.pin_tensors([a, b], what="test")
    assert fake.registered == {}
    with pytest.raises(ValueError, match="contiguous CPU"):
        buffers.pin_tensors([torch.zeros(4, 4).t()], what="test")


def test_host_pool_pins_exactly_what_the_budget_counts(cudart):
    budget = ByteBudget("host", None)
    pool = HostPool(3, 10_000, budget, pin=True)
    assert budget.used == 30_000 == cudart.nbytes == pool.pinned_nbytes
    assert sorted(cudart.registered) == sorted(b.data_ptr() for b in pool._buffers)
    pool.close()
    assert cudart.registered == {} and budget.used == 0
    unpinned = HostPool(2, 4096, budget)
    assert cudart.log[-1][0] == "unregister" and unpinned.pinned_nbytes == 0
    assert cudart.registered == {}
    unpinned.close()


def _registered_split(engine, cudart):
    homes = {f.home.data_ptr(): f.home_nbytes for f in engine.flats if f.home is not None}
    staging = ({b.data_ptr(): engine.pool.nbytes for b in engine.pool._buffers}
               if engine.pool is not None else {})
    ring = engine.grads.copies.ring
    ring_bufs = {s.buf.data_ptr(): ring.nbytes for s in ring._slabs} if ring is not None else {}
    return homes, staging, ring_bufs


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_engine_pins_exactly_staging_homes_and_gradient_staging(dma_on_cpu, tier, tmp_path):
    cudart = dma_on_cpu
    before = buffers.pinned_bytes()
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier=tier, grad_tier=tier,
                  compute_dtype=torch.bfloat16)
    engine = engine_mod.engine_of(model)
    homes, staging, ring = _registered_split(engine, cudart)
    expected = {**(homes if tier == "host" else {}), **staging, **ring}
    assert cudart.registered == expected
    # gradient staging: 2 buffers of the largest flat's gradients (compute dtype)
    largest = max(f.compute_nbytes for f in engine.flats if f.trainable)
    assert set(ring.values()) == {largest} and len(ring) == pinned.D2H_STAGING_BUFFERS
    if tier == "nvme":  # the NVMe gradient pool is never a DMA target: not pinned
        assert engine.grads.pool is not None
        assert not set(b.data_ptr() for b in engine.grads.pool._buffers) & set(cudart.registered)
        unpinned = engine.grads.pool.count * engine.grads.pool.nbytes
    else:
        assert staging == {}
        unpinned = 0
    # what is pinned is exactly what the host budget counts for it
    assert cudart.nbytes == buffers.pinned_bytes() - before
    assert cudart.nbytes == engine.host_budget.used - unpinned
    assert engine.transfers.pinned_nbytes == sum(expected.values()) - sum(ring.values())
    for x, y in batches(SMALL, 2):
        engine.zero_grad()
        loss_of(model, x, y).backward()
    grads = sum(f.numel * 4 for f in engine.flats if f.grad is not None) if tier == "host" else 0
    assert cudart.nbytes == engine.host_budget.used - unpinned - grads  # accumulators: pageable
    infinity.unwrap(model)
    assert cudart.registered == {} and buffers.pinned_bytes() == before


def test_engine_on_cpu_pins_nothing(cudart, tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme")
    (x, y), = batches(SMALL, 1)
    loss_of(model, x, y).backward()
    infinity.unwrap(model)
    assert cudart.log == []


# ---- RLIMIT_MEMLOCK ------------------------------------------------------------------------
def test_memlock_error_names_the_limit_and_the_remedy(monkeypatch, cudart):
    _memlock(monkeypatch, 1 << 20, 1 << 20)
    with pytest.raises(buffers.PinnedMemoryError) as err:
        buffers.aligned_empty(4 << 20, pin=True, what="the staging buffers")
    msg = str(err.value)
    for needle in ("RLIMIT_MEMLOCK", "ulimit -l", "1,048,576 bytes", "4,194,304 bytes",
                   "the staging buffers", "INFINITY_IGNORE_MEMLOCK", "host_budget"):
        assert needle in msg, needle
    assert cudart.log == []  # checked before anything was pinned
    buffers.aligned_empty(1 << 19, pin=True)  # within the limit: fine


def test_memlock_soft_limit_raised_to_hard_cap_and_env(monkeypatch, cudart):
    calls = _memlock(monkeypatch, 1 << 20, -1)  # hard limit unlimited
    buffers.check_memlock(8 << 20, "x")
    assert calls == [(-1, -1)]
    _memlock(monkeypatch, 1 << 20, 1 << 20, cap=True)  # CAP_IPC_LOCK lifts the limit
    buffers.check_memlock(8 << 20, "x")
    _memlock(monkeypatch, 1 << 20, 1 << 20)
    monkeypatch.setenv(buffers.MEMLOCK_ENV, "1")
    buffers.check_memlock(8 << 20, "x")
    monkeypatch.setenv(buffers.MEMLOCK_ENV, "0")
    with pytest.raises(buffers.PinnedMemoryError):
        buffers.check_memlock(8 << 20, "x")
    _memlock(monkeypatch, -1, -1)
    buffers.check_memlock(1 << 40, "x")  # unlimited


def test_memlock_counts_what_is_already_pinned(monkeypatch, cudart):
    _memlock(monkeypatch, 3 << 20, 3 << 20)
    a = buffers.aligned_empty(2 << 20, pin=True)
    with pytest.raises(buffers.PinnedMemoryError, match="with the 2,097,152 already pinned"):
        buffers.aligned_empty(2 << 20, pin=True)
    del a
    b = buffers.aligned_empty(2 << 20, pin=True)
    del b


def test_wrap_fails_cleanly_when_memlock_is_too_small(monkeypatch, dma_on_cpu):
    _memlock(monkeypatch, 64 << 10, 64 << 10)
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(buffers.PinnedMemoryError, match="RLIMIT_MEMLOCK"):
        infinity.wrap(model, param_tier="host")
    assert engine_mod.engine_of(model) is None
    assert dma_on_cpu.registered == {}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---- 3. bounded gradient staging ---------------------------------------------------------
def test_staging_ring_is_bounded_and_drains_oldest_first():
    budget = ByteBudget("host", 10_000)
    consumed = []
    ring = pinned.StagingRing(2, 1024, budget, pin=False,
                              consume=lambda item, view: consumed.append((item, view.clone())))
    assert budget.used == 2048 and ring.total_nbytes == 2048
    events = []
    values = {}
    for i in range(12):  # 12 x 200 fp32 = 9.6 KB through 2 KB of staging
        view = ring.take(50, torch.float32)
        assert view.numel() == 50 and view.data_ptr() % 256 == 0
        view.fill_(i)  # "the copy"
        values[i] = torch.full((50,), float(i))
        ev = FakeEvent()
        events.append(ev)
        ring.commit(i, view, ev)
        assert ring.pending <= 2 * (1024 // 256)  # never more than the ring holds
    # full buffers were waited for (their last event) and consumed in commit order
    assert [item for item, _ in consumed] == list(range(len(consumed)))
    assert len(consumed) > 0 and all(torch.equal(v, values[i]) for i, v in consumed)
    ring.drain()
    assert [item for item, _ in consumed] == list(range(12)) and ring.pending == 0
    assert all(ev.synchronized <= 1 for ev in events)
    with pytest.raises(ValueError, match="does not fit"):
        ring.take(257, torch.float32)
    ring.close()
    assert budget.used == 0


def test_staging_ring_single_buffer_and_discard():
    budget = ByteBudget("host", None)
    consumed = []
    ring = pinned.StagingRing(1, 512, budget, pin=False,
                              consume=lambda item, view: consumed.append(item))
    for i in range(5):
        v = ring.take(128, torch.uint8)
        ring.commit(i, v, FakeEvent())
    # 2 slots (256-byte aligned) per buffer: the 3rd and 5th take drained the buffer first
    assert consumed == [0, 1, 2, 3] and ring.pending == 1
    ev = FakeEvent()
    ring.commit(99, ring.take(1, torch.uint8), ev)
    ring.discard()
    assert ring.pending == 0 and ev.synchronized == 1 and consumed == [0, 1, 2, 3]
    ring.close()


def test_staging_ring_budget_and_pinning(cudart):
    with pytest.raises(BudgetExceededError):
        pinned.StagingRing(2, 4096, ByteBudget("host", 4096), pin=True, consume=print)
    assert cudart.log == []
    budget = ByteBudget("host", None)
    ring = pinned.StagingRing(2, 4096, budget, pin=True, consume=print)
    assert ring.pinned_nbytes == cudart.nbytes == budget.used == 8192
    ring.close()
    assert cudart.registered == {} and budget.used == 0


# ---- 5. no GPU sync in the I/O path: deferred release, hits by event ---------------------
def test_host_pool_release_after_event_without_synchronize():
    pool = HostPool(1, 4096, ByteBudget("host", None), timeout_s=5)
    buf = pool.acquire()
    ev = FakeEvent(done=False)
    pool.release_after(buf, ev)
    assert pool.in_flight == 1
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire()))
    t.start()
    time.sleep(0.05)
    assert not got  # the copy has not finished: the buffer is not handed out
    ev.done = True  # the device finished the copy
    t.join(timeout=5)
    assert got and got[0] is buf
    assert ev.synchronized == 0 and ev.queries >= 1  # queried, never waited on
    pool.release(buf)
    pool.close()


def test_host_pool_drain_and_close_wait_for_copies():
    pool = HostPool(2, 4096, ByteBudget("host", None))
    evs = [FakeEvent(), FakeEvent()]
    for ev in evs:
        pool.release_after(pool.acquire(), ev)
    pool.close()
    assert all(ev.synchronized == 1 for ev in evs)


def test_host_pool_acquire_times_out():
    pool = HostPool(1, 4096, ByteBudget("host", None), timeout_s=0.2)
    pool.release_after(pool.acquire(), FakeEvent(done=False))
    with pytest.raises(RuntimeError, match="stuck"):
        pool.acquire()


def test_fetch_hit_is_settled_on_the_gpu_timeline():
    waits = []
    fut = cf.Future()
    fetch = Fetch(fut, waits.append)
    assert not fetch.done()  # the CPU would wait for the transfer thread: a miss
    ev = FakeEvent()
    fut.set_result(ev)
    assert fetch.result() is ev and waits == []  # counted as a miss: nothing to settle
    fetch = Fetch(fut, waits.append)
    assert fetch.done()  # provisional hit: the compute stream's arrival is marked on result()
    assert fetch.result() is ev and waits == [ev]
    fetch.result()
    assert waits == [ev]  # once
    cpu = cf.Future()
    cpu.set_result(None)
    fetch = Fetch(cpu, waits.append)
    assert fetch.done() and fetch.result() is None and waits == [ev]


class _TimedEvent(FakeEvent):
    def __init__(self, t_ms, done=True):
        super().__init__(done)
        self.t = t_ms

    def elapsed_time(self, end):
        return end.t - self.t


def test_settle_waits_turns_hits_the_compute_stream_waited_for_into_misses():
    stats = Stats()
    transfers = Transfers(torch.device("cpu"), stats, _SlowHome(0), None)
    stats.prefetch_hits = 3
    # (copy end, arrival of the compute stream): in time, 2 ms late, not run yet
    transfers._waits.extend([(_TimedEvent(1.0), _TimedEvent(5.0)),
                             (_TimedEvent(9.0), _TimedEvent(7.0)),
                             (_TimedEvent(20.0, done=False), _TimedEvent(11.0))])
    transfers.settle_waits()
    assert (stats.prefetch_hits, stats.prefetch_misses) == (2, 1)
    assert stats.stall_seconds == pytest.approx(0.002)
    assert len(transfers._waits) == 1  # still running on the device: settled later
    transfers._waits[0][0].done = True
    transfers.settle_waits()
    assert (stats.prefetch_hits, stats.prefetch_misses) == (1, 2) and not transfers._waits
    transfers.close()


# ---- 4. casts on the device --------------------------------------------------------------
@pytest.mark.parametrize("chunk", [4, 1000, 1 << 20])
def test_cast_upload_in_chunks_matches_a_plain_cast(chunk):
    src = torch.randn(1000)
    dst = torch.empty(1000, dtype=torch.bfloat16)
    pinned.cast_upload(dst, src, non_blocking=False, chunk_bytes=chunk)
    assert torch.equal(dst, src.to(torch.bfloat16))
    with pytest.raises(ValueError):
        pinned.cast_upload(torch.empty(3), src, False)


def test_upload_on_cpu_is_a_copy():
    src = torch.randn(100)
    for dtype in (torch.float32, torch.bfloat16):
        dst = torch.empty(100, dtype=dtype)
        pinned.upload(dst, src, non_blocking=False)
        assert torch.equal(dst, src.to(dtype))


# ---- 6. close drains everything in flight ------------------------------------------------
class _SlowHome:
    tier = Tier.HOST

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.started = 0
        self.finished = 0
        self.lock = threading.Lock()

    def fetch_into(self, flat, dst, non_blocking):
        with self.lock:
            self.started += 1
        time.sleep(self.delay)
        dst.copy_(flat.home)
        with self.lock:
            self.finished += 1


def test_transfers_close_drains_running_fetches():
    home = _SlowHome(0.2)
    flats = [types.SimpleNamespace(home=torch.full((10,), float(i)), compute=torch.zeros(10),
                                   home_nbytes=40) for i in range(4)]
    transfers = Transfers(torch.device("cpu"), Stats(), home, None)
    pending = [transfers.fetch([f]) for f in flats]
    time.sleep(0.05)
    assert home.started == 1 and home.finished == 0
    transfers.close()
    assert home.started == home.finished >= 1  # the running one completed, none still runs
    assert all(f.done() for f in pending)
    for f, flat in zip(pending, flats):
        if not f._future.cancelled():
            assert torch.equal(flat.compute, flat.home)
    transfers.close()  # idempotent


@pytest.mark.parametrize("restore", [False, True])
def test_engine_close_drains_prefetches_in_flight(monkeypatch, tmp_path, restore):
    from infinity.runtime.homes.home import NvmeHome
    state = {"running": 0}
    lock = threading.Lock()
    original = NvmeHome.fetch_into

    def slow(self, flat, dst, non_blocking):
        with lock:
            state["running"] += 1
        try:
            time.sleep(0.05)
            original(self, flat, dst, non_blocking)
        finally:
            with lock:
                state["running"] -= 1

    monkeypatch.setattr(NvmeHome, "fetch_into", slow)
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ref = copy.deepcopy(model)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", prefetch_window=2)
    engine = engine_mod.engine_of(model)
    (x, y), = batches(SMALL, 1)
    loss_of(model, x, y).backward()  # records the schedule; after it, forward is prefetched
    fetching = [b for b in engine.blocks if b.state.name == "FETCHING"]
    assert fetching, "expected prefetches in flight after backward"
    threads = list(engine.transfers._executor._threads)
    engine.close(restore=restore)
    assert state["running"] == 0
    assert threads and not any(t.is_alive() for t in threads)
    assert engine.pool is None or engine.pool.count == 0  # closed after the copies landed
    assert engine.host_budget.used == 0
    if restore:
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
