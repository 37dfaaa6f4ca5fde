"""Faults in the middle of training, and what a user does about them.

Each test trains a tiny model for a few steps, makes one thing fail at step ``K`` (an exception
inside a block's forward or backward, a failed read or write of a swap file), checks that the
error is raised and says what happened, clears the fault, does what a user would do (retry the
step, or zero_grad and redo the micro-batch) and goes on. The losses and the final weights must
equal, bit for bit, those of a run where nothing failed (fp32 homes: the same kernels run on the
same values in the same order, so any difference is a stale buffer, a lost or doubled update or
a gradient counted twice).
"""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from engine_helpers import all_buffers_free, assert_tensors_equal
from torch import nn

import infinity
from infinity.io import InfinityIOError, clear_faults, inject_fault
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.optim import OptimizerStateIOError
from infinity.optim.states.extents import STATE_FILE
from infinity.runtime.core.flat import FlatParam
from infinity.runtime.engine import Engine, engine_of, locate
from infinity.runtime.grads.sink import GradientWriteError
from infinity.tiers import SwapStore

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, max_seq=16)
STEPS = 5
K = 2  # the step at which the fault happens
LR = 1e-2

Batch = Tuple[torch.Tensor, torch.Tensor]


def _tight_device_budget() -> int:
    """Bytes for the root block (embeddings, final norm) and two and a half layers: at most two
    layers can be materialized at once, so every fetch must find released budget."""
    model = TinyGPT(CFG)
    layer = sum(p.numel() * 4 for p in model.layers[0].parameters())
    in_layers = {id(p) for p in model.layers.parameters()}
    root = sum(p.numel() * 4 for p in model.parameters() if id(p) not in in_layers)
    return root + 2 * layer + layer // 2


# Tier settings. "host_bf16": fp32 homes in RAM computed in bf16, so on the CPU the blocks are
# not resident: they are fetched into (and released from) a bf16 compute buffer like on a GPU.
SETTINGS: Dict[str, Dict] = {
    "host_fp32": dict(param_tier="host", grad_tier="host", optimizer_tier="host"),
    "host_bf16": dict(param_tier="host", grad_tier="host", optimizer_tier="host",
                      compute_dtype=torch.bfloat16),
    "nvme": dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="host"),
    "nvme_tight": dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="host",
                       device_budget=_tight_device_budget()),
    "nvme_grads": dict(param_tier="host", grad_tier="nvme", optimizer_tier="host"),
}


@pytest.fixture(autouse=True)
def _no_fault_left_behind():
    clear_faults()
    yield
    clear_faults()


class SwapIO:
    """Every transfer to or from a swap file, in the order they were started: (op, key, bytes,
    future). Fault offsets are measured from it, never assumed."""

    def __init__(self) -> None:
        self.log: List[Tuple[str, str, int, object]] = []

    def clear(self) -> None:
        self.log.clear()

    def sizes(self, op: str) -> List[Tuple[str, int]]:
        return [(key, n) for o, key, n, _ in self.log if o == op]

    def failed(self, op: str) -> List[str]:
        """Keys whose transfer failed (waits for each)."""
        out = []
        for o, key, _, future in self.log:
            if o == op:
                try:
                    future.wait()
                except InfinityIOError:
                    out.append(key)
        return out


@pytest.fixture
def swap_io(monkeypatch) -> SwapIO:
    recorder = SwapIO()
    for op in ("read", "write"):
        original = getattr(SwapStore, op)

        def recording(self, key, buf, *args, _op=op, _original=original, **kwargs):
            future = _original(self, key, buf, *args, **kwargs)
            recorder.log.append((_op, key, buf.numel() * buf.element_size(), future))
            return future

        monkeypatch.setattr(SwapStore, op, recording)
        span = getattr(SwapStore, f"{op}_span")  # the optimizer's state file: (key, buf, offset)

        def recording_span(self, key, buf, offset, _op=op, _original=span):
            future = _original(self, key, buf, offset)
            recorder.log.append((_op, key, buf.numel() * buf.element_size(), future))
            return future

        monkeypatch.setattr(SwapStore, f"{op}_span", recording_span)
    return recorder


# ---- helpers -------------------------------------------------------------------------------

def _batches(n: int = STEPS, seed: int = 1) -> List[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [synthetic_batch(CFG, 2, 8, gen) for _ in range(n)]


def _weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _setup(path: Path, **settings) -> Tuple[nn.Module, infinity.optim.AdamW]:
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = infinity.wrap(TinyGPT(CFG), nvme_path=str(path), **settings)
    # overlap=False: these tests place faults by the order of the step's own writes; faults in
    # updates overlapping backward are tested in tests/feature/optim/test_optim_overlap.py
    return model, infinity.optim.AdamW(model.parameters(), lr=LR, overlap=False)


def _engine(model: nn.Module) -> Engine:
    engine = engine_of(model)
    assert engine is not None
    return engine


def _backward(model: nn.Module, batch: Batch) -> float:
    loss = lm_loss(model(batch[0]), batch[1])
    loss.backward()
    return loss.item()


def _train_step(model: nn.Module, opt, batch: Batch) -> float:
    loss = _backward(model, batch)
    opt.step()
    opt.zero_grad()
    return loss


def _finish(model: nn.Module, opt) -> Dict[str, torch.Tensor]:
    infinity.unwrap(model)
    opt.close()
    return _weights(model)


_REFERENCES: Dict[str, Tuple[List[float], Dict[str, torch.Tensor]]] = {}


def _reference(tmp_path: Path, **settings) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Losses and final weights of an uninterrupted run with the same settings (cached)."""
    key = repr(sorted(settings.items()))
    if key not in _REFERENCES:
        model, opt = _setup(tmp_path / "reference", **settings)
        losses = [_train_step(model, opt, b) for b in _batches()]
        _REFERENCES[key] = losses, _finish(model, opt)
    return _REFERENCES[key]


def _assert_same_run(tmp_path: Path, losses: List[float], weights: Dict[str, torch.Tensor],
                     **settings) -> None:
    ref_losses, ref_weights = _reference(tmp_path, **settings)
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for k, v in weights.items():
        assert v.dtype == ref_weights[k].dtype, k
        assert torch.equal(v, ref_weights[k]), k


class _Armed:
    """A one-shot trigger: ``fire()`` returns True once after ``arm()``."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = 0

    def arm(self) -> None:
        self.armed = True

    def fire(self) -> bool:
        if self.armed:
            self.armed = False
            self.fired += 1
            return True
        return False


def _raise_in_forward(module: nn.Module, trigger: _Armed) -> None:
    """``module.forward`` raises a (simulated) out-of-memory error when the trigger fires."""
    original = module.forward

    def forward(*args, **kwargs):
        if trigger.fire():
            raise torch.OutOfMemoryError("simulated: CUDA out of memory in a block's forward")
        return original(*args, **kwargs)

    module.forward = forward


def _raise_in_backward(module: nn.Module, trigger: _Armed) -> None:
    """The gradient of ``module``'s output raises when the trigger fires (a tensor hook)."""

    def hook(grad):
        if trigger.fire():
            raise RuntimeError("simulated failure in a block's backward")
        return None

    def register(mod, args, output):
        if output.requires_grad:
            output.register_hook(hook)

    module.register_forward_hook(register)


def _step_order(model: nn.Module) -> List[FlatParam]:
    """The flat buffers in the order the optimizer steps them (that of model.parameters())."""
    order: List[FlatParam] = []
    for p in model.parameters():
        flat = locate(p).flat
        if flat not in order:
            order.append(flat)
    return order


# ---- 1. an exception inside a block's forward ------------------------------------------------

@pytest.mark.parametrize("tiers", ["host_bf16", "nvme", "nvme_tight"])
@pytest.mark.parametrize("at,where", [(0, "layers.1.fc"), (K, "layers.1.fc"), (K, "ln_f")])
def test_exception_in_block_forward_then_retry(tmp_path, tiers, at, where):
    """A forward raises (as a caught OOM would) at step ``at``, inside layer 1 (its first
    sub-layers ran, the next layers may be prefetched) or in the root block after every layer
    ran (the last layer is kept for backward). The user catches it and retries the step with
    the same batch. What the failed forward had fetched is released, so the retried forward and
    every later one compute on the current home copies, never on a stale materialized copy."""
    settings = SETTINGS[tiers]
    model, opt = _setup(tmp_path / "run", **settings)
    trigger = _Armed()
    _raise_in_forward(model.get_submodule(where), trigger)
    losses = []
    for step, batch in enumerate(_batches()):
        if step == at:
            trigger.arm()
            with pytest.raises(torch.OutOfMemoryError, match="simulated"):
                lm_loss(model(batch[0]), batch[1]).backward()
            assert trigger.fired == 1
        losses.append(_train_step(model, opt, batch))
    _assert_same_run(tmp_path, losses, _finish(model, opt), **settings)


def test_exception_in_forward_skipped_micro_batch(tmp_path):
    """Gradient accumulation: the second micro-batch's forward raises and the user skips it,
    stepping on the first micro-batch's gradients; the result equals a run that only ever had
    the first micro-batch (the failed forward left nothing that the step or the next forward
    would compute on)."""
    settings = SETTINGS["host_bf16"]
    trigger = _Armed()
    runs = []
    for fail in (False, True):
        model, opt = _setup(tmp_path / f"run{int(fail)}", **settings)
        _raise_in_forward(model.layers[2].fc, trigger)
        losses = []
        for step, batch in enumerate(_batches()):
            losses.append(_backward(model, batch))
            if fail and step == K:
                trigger.arm()
                with pytest.raises(torch.OutOfMemoryError):
                    model(batch[0])
            opt.step()
            opt.zero_grad()
        runs.append((losses, _finish(model, opt)))
    assert trigger.fired == 1
    assert runs[0][0] == runs[1][0]
    assert_tensors_equal(runs[0][1], runs[1][1])


def test_exception_in_block_forward_then_evaluation_sees_new_weights(tmp_path):
    """After a failed forward the user runs an evaluation forward (no_grad) before retrying; the
    step that follows updates the homes, and the next forward must see the update."""
    settings = SETTINGS["host_bf16"]
    model, opt = _setup(tmp_path / "run", **settings)
    trigger = _Armed()
    _raise_in_forward(model.layers[2], trigger)
    losses = []
    for step, batch in enumerate(_batches()):
        if step == K:
            trigger.arm()
            with pytest.raises(torch.OutOfMemoryError):
                model(batch[0])
            with torch.no_grad():
                model(batch[0])
        losses.append(_train_step(model, opt, batch))
    _assert_same_run(tmp_path, losses, _finish(model, opt), **settings)


# ---- 2. an exception inside a block's backward -----------------------------------------------

@pytest.mark.parametrize("tiers", ["host_fp32", "host_bf16", "nvme", "nvme_tight", "nvme_grads"])
def test_exception_in_block_backward_then_redo(tmp_path, tiers):
    """A tensor hook inside block 1 raises during backward (after block 2 and part of block 1
    produced gradients). The user catches it, calls opt.zero_grad() and redoes the micro-batch's
    forward and backward; the step equals an uninterrupted one."""
    settings = SETTINGS[tiers]
    model, opt = _setup(tmp_path / "run", **settings)
    trigger = _Armed()
    _raise_in_backward(model.layers[1].fc, trigger)
    losses = []
    for step, batch in enumerate(_batches()):
        if step == K:
            trigger.arm()
            loss = lm_loss(model(batch[0]), batch[1])
            with pytest.raises(RuntimeError, match="simulated failure in a block's backward"):
                loss.backward()
            assert trigger.fired == 1
            del loss
            opt.zero_grad()
        losses.append(_train_step(model, opt, batch))
    _assert_same_run(tmp_path, losses, _finish(model, opt), **settings)


# ---- 3. a failed infinity.materialized() -----------------------------------------------------

def test_failed_materialized_releases_what_it_fetched(tmp_path, swap_io):
    """With parameters on NVMe and a device budget that holds the root block and two layers,
    ``infinity.materialized`` over two layers fails while reading the second one: the first one
    is released and its budget returned, so neither a later materialized() nor training hits a
    BudgetExceededError, and training goes on exactly."""
    settings = SETTINGS["nvme_tight"]
    model, opt = _setup(tmp_path / "run", **settings)
    engine = _engine(model)
    first, second = model.layers[0], model.layers[1]
    losses = []
    for step, batch in enumerate(_batches()):
        losses.append(_train_step(model, opt, batch))
        if step == K:
            with torch.no_grad():  # an evaluation forward: afterwards no layer is fetched
                model(batch[0])
            used = engine.device_budget.used
            pairs = nn.ModuleList([first, second])
            swap_io.clear()
            with infinity.materialized(model, pairs):  # measures the reads
                pass
            assert engine.device_budget.used == used
            (key0, first_read), (key1, _) = swap_io.sizes("read")
            assert (key0, key1) == (engine.blocks[0].flats[0].key, engine.blocks[1].flats[0].key)
            inject_fault("read", errno.EIO, after_bytes=first_read)
            with pytest.raises(InfinityIOError) as info:
                with infinity.materialized(model, pairs):
                    pytest.fail("materialized() should have failed reading layers.1")
            clear_faults()
            assert info.value.errno == errno.EIO
            assert key1 in str(info.value)  # the second block's read failed
            assert engine.device_budget.used == used
            outside = {k: v.detach().clone() for k, v in pairs.named_parameters()}
            with infinity.materialized(model, pairs):
                inside = {k: v.detach().clone() for k, v in pairs.named_parameters()}
            assert outside.keys() == inside.keys()
            assert_tensors_equal(inside, outside)
            with infinity.materialized(model, nn.ModuleList([second, model.layers[2]])):
                pass
            assert engine.device_budget.used == used
    _assert_same_run(tmp_path, losses, _finish(model, opt), **settings)


# ---- 4. a failed write of the parameters' swap file ------------------------------------------

def test_failed_parameter_write_host_states_retry_step(tmp_path, swap_io):
    """optimizer_tier="host", param_tier="nvme": the step writes each updated working copy to
    the parameter swap file. ENOSPC on the second shard's write: step() raises the disk error
    with a note saying to call step() again; after the disk is fixed, step() finishes the same
    step (rewriting the failed shard from its stepped states, stepping the rest once)."""
    settings = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="host")
    model, opt = _setup(tmp_path / "run", **settings)
    losses = []
    for step, batch in enumerate(_batches()):
        losses.append(_backward(model, batch))
        if step == K:
            flats = _step_order(model)
            assert [k for k, _ in previous] == [f.key for f in flats]  # one write per shard
            swap_io.clear()
            inject_fault("write", errno.ENOSPC, after_bytes=previous[0][1])
            with pytest.raises(InfinityIOError) as info:
                opt.step()
            clear_faults()
            assert info.value.errno == errno.ENOSPC
            assert "full" in str(info.value) and flats[1].key in str(info.value)
            assert any("opt.step() again" in n for n in getattr(info.value, "__notes__", []))
            assert swap_io.failed("write") == [flats[1].key]
        swap_io.clear()
        opt.step()
        previous = swap_io.sizes("write")
        opt.zero_grad()
    _assert_same_run(tmp_path, losses, _finish(model, opt), **settings)


@pytest.mark.parametrize("where", ["home", "states"])
def test_failed_parameter_write_nvme_states_retry_step(tmp_path, swap_io, where):
    """optimizer_tier="nvme", param_tier="nvme": ENOSPC from the last shard's write of its
    updated parameters on (``home``: the writes before it succeed), or from the second shard's
    states on (``states``). step() raises an OptimizerStateIOError saying the disk is full;
    after the disk is fixed, step() redoes the same step."""
    settings = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
    model, opt = _setup(tmp_path / "run", **settings)
    losses = []
    for step, batch in enumerate(_batches()):
        losses.append(_backward(model, batch))
        if step == K:
            # a step writes, shard by shard, its states (an extent of the optimizer's state
            # file) then its working copy: the sizes and order of the previous step's writes
            # tell where to fail
            flats = _step_order(model)
            assert [k for k, _ in previous] \
                == [k for f in flats for k in (STATE_FILE, f.key)]
            sizes = [n for _, n in previous]
            after_bytes = sum(sizes[:-1]) if where == "home" else sum(sizes[:2])
            swap_io.clear()
            inject_fault("write", errno.ENOSPC, after_bytes=after_bytes)
            with pytest.raises(OptimizerStateIOError, match="disk full") as info:
                opt.step()
            clear_faults()
            assert info.value.errno == errno.ENOSPC
            message = str(info.value)
            assert str(tmp_path) in message and "shard 'block" in message
            lost = swap_io.failed("write")
            if where == "home":
                # a parameters' swap file (normally the last shard's: flats[-1].key; with the
                # gradient-writer and CRC threads the order of the last writes can vary, so the
                # fault may land on another shard's parameters)
                assert any(".opt" not in k for k in lost), lost
            else:
                assert previous[2][0] == STATE_FILE
                assert STATE_FILE in lost
        swap_io.clear()
        opt.step()
        previous = swap_io.sizes("write")
        opt.zero_grad()
    _assert_same_run(tmp_path, losses, _finish(model, opt), **settings)


# ---- 5. a failed write of the gradients' swap file -------------------------------------------

@pytest.mark.parametrize("tiers", ["nvme", "nvme_grads"])
@pytest.mark.parametrize("step_first", [True, False])
def test_failed_gradient_write_then_redo_micro_batch(tmp_path, swap_io, tiers, step_first):
    """grad_tier="nvme": ENOSPC while backward writes block 1's gradients raises one
    GradientWriteError naming the block; the host buffers of the gradient pool all come back;
    a step without redoing the backward (``step_first``) is refused with an error mentioning
    zero_grad; after zero_grad and the micro-batch's backward again, training equals an
    uninterrupted run."""
    settings = SETTINGS[tiers]
    model, opt = _setup(tmp_path / "run", **settings)
    engine = _engine(model)
    pool = engine.grads.pool
    losses = []
    for step, batch in enumerate(_batches()):
        if step == K:
            # backward writes block 2's gradients first, then block 1's: fail in block 1's
            (key2, block2_bytes), (key1, _) = previous[:2]
            assert (key2, key1) == tuple(f"{engine.blocks[i].flats[0].key}.grad" for i in (2, 1))
            inject_fault("write", errno.ENOSPC, after_bytes=block2_bytes)
            loss = lm_loss(model(batch[0]), batch[1])
            with pytest.raises(GradientWriteError) as info:
                loss.backward()
            clear_faults()
            del loss
            assert info.value.errno == errno.ENOSPC
            # the error names the block whose write failed: block 1's, or, when another write
            # (the gradient writer and CRC threads run beside backward) took bytes of the
            # budget first, block 2's -- seen on a loaded machine
            named = [i for i in (1, 2) if engine.blocks[i].flats[0].key in str(info.value)]
            assert named, str(info.value)
            assert f"{engine.blocks[named[0]].flats[0].key}.grad" in swap_io.failed("write")
            assert "zero_grad" in str(info.value)
            if step_first:
                with pytest.raises(RuntimeError, match="zero_grad") as refused:
                    opt.step()
                assert "the gradients of block" in str(refused.value)  # a lost one
                # the failed backward is settled (by the step's quiesce): no buffer was kept
                assert all_buffers_free(pool)
                assert not isinstance(refused.value, GradientWriteError)
                with pytest.raises(RuntimeError, match="zero_grad"):  # still refused
                    opt.step()
            opt.zero_grad()
        swap_io.clear()
        losses.append(_backward(model, batch))
        previous = swap_io.sizes("write")
        opt.step()
        opt.zero_grad()
        assert all_buffers_free(pool)
    # many more backwards still find every buffer of the pool
    for batch in _batches(6, seed=7):
        _backward(model, batch)
        assert all_buffers_free(pool)
    opt.zero_grad()
    _assert_same_run(tmp_path, losses, _finish(model, opt), **settings)


def test_failed_gradient_write_in_second_micro_batch(tmp_path):
    """Gradient accumulation over two micro-batches, grad_tier="nvme": the second micro-batch's
    backward fails writing the accumulated gradients. After zero_grad, both micro-batches are
    redone; the result equals a run where nothing failed."""
    settings = SETTINGS["nvme"]
    batches = _batches(2 * STEPS)
    runs = []
    for fail in (False, True):
        model, opt = _setup(tmp_path / f"run{int(fail)}", **settings)
        engine = _engine(model)
        losses = []
        for step in range(STEPS):
            micro = batches[2 * step:2 * step + 2]
            if fail and step == K:
                _backward(model, micro[0])
                inject_fault("write", errno.ENOSPC, after_bytes=0)
                with pytest.raises(GradientWriteError, match="zero_grad"):
                    _backward(model, micro[1])
                clear_faults()
                with pytest.raises(RuntimeError, match="zero_grad"):
                    opt.step()
                opt.zero_grad()
            losses.append([_backward(model, b) for b in micro])
            opt.step()
            opt.zero_grad()
            assert all_buffers_free(engine.grads.pool)
        runs.append((losses, _finish(model, opt)))
    assert runs[0][0] == runs[1][0]
    assert_tensors_equal(runs[0][1], runs[1][1])


# ---- 6. a failed write of the optimizer states -----------------------------------------------

def _around_step(path: Path, **settings) -> Tuple[Dict, Dict, Dict, Dict]:
    """Weights and optimizer state_dict of an uninterrupted run just before and just after
    step ``K``."""
    model, opt = _setup(path, **settings)
    out: List[Dict] = []
    for step, batch in enumerate(_batches()):
        _backward(model, batch)
        if step == K:
            out += [_weights(model), opt.state_dict()]
        opt.step()
        if step == K:
            out += [_weights(model), opt.state_dict()]
            break
        opt.zero_grad()
    _finish(model, opt)
    return tuple(out)  # type: ignore[return-value]


@pytest.mark.parametrize("homes,chunk", [("host", None), ("host", 8 << 10),
                                         ("nvme", 16 << 10)])
def test_io_error_during_state_write_then_retry_equals_uninterrupted(tmp_path, homes, chunk):
    """EIO (not ENOSPC) in the middle of a step's state writes, parameters on host (``chunk``:
    each shard cut into units of about 8 KiB, committed one by one; None: one unit per shard).
    The error names the errno, the shard and nvme_path. Before the retry, no state is lost or
    garbled: element by element, each unit's master, moments and parameters equal bitwise
    either those before the step or those after it in a run that never failed, and the
    optimizer records which (whole shards as done, units as stepped); step counts move only
    for shards that took the whole step. After the fault is cleared, ``opt.step()`` finishes
    the same step, and training gives exactly what a run that never failed gives.
    ``homes="nvme"``: parameters and gradients on NVMe too, so the retried units read the
    gradient and working-copy pieces they share with units that took the step from the swap
    files."""
    settings = dict(param_tier=homes, grad_tier=homes, optimizer_tier="nvme")
    if chunk is not None:
        settings["chunk_bytes"] = chunk
    w_before, sd_before, w_after, sd_after = _around_step(tmp_path / "around", **settings)
    model, opt = _setup(tmp_path / "run", **settings)
    losses = []
    for step, batch in enumerate(_batches()):
        losses.append(_backward(model, batch))
        if step == K:
            assert_tensors_equal(_weights(model), w_before)
            inject_fault("write", errno.EIO, after_bytes=50 * 4096)
            with pytest.raises(OptimizerStateIOError) as info:
                opt.step()
            clear_faults()
            assert info.value.errno == errno.EIO
            message = str(info.value)
            assert "EIO" in message and "block" in message and str(tmp_path) in message
            assert "disk full" not in message
            assert any("opt.step() again" in n for n in getattr(info.value, "__notes__", []))
            # parameters an NVMe home could not take back while the fault lasted (the note
            # says so): rewritten from the committed masters, as step() does first
            opt.restore_parameters()
            _check_each_unit_old_or_new(model, opt, w_before, sd_before, w_after, sd_after,
                                        chunked=chunk is not None)
        opt.step()  # the gradients are still there: retry the step
        opt.zero_grad()
    _assert_same_run(tmp_path, losses, _finish(model, opt), **settings)


def _check_each_unit_old_or_new(model, opt, w_before, sd_before, w_after, sd_after,
                                chunked: bool) -> None:
    store = next(iter(opt.core.wrapped.stores()))
    sd_mid, w_mid = opt.state_dict(), _weights(model)
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    name_of = {id(p): n for n, p in model.named_parameters()}
    took_units = kept_units = 0
    for shard in opt.shards():
        plan = store.plan(shard)
        assert plan.chunked == chunked
        done = shard.key in opt.core.done
        took = set(range(len(plan.units))) if done else store.extents.stepped(shard)
        assert not (done and store.extents.stepped(shard))
        took_units += len(took)
        kept_units += len(plan.units) - len(took)
        for slot in shard.flat.slots:
            i, name = index[id(slot.param)], name_of[id(slot.param)]
            assert float(sd_mid["state"][i]["step"]) == \
                float((sd_after if done else sd_before)["state"][i]["step"])
            for un in plan.units:
                lo = max(un.start, slot.offset) - slot.offset
                hi = min(un.end, slot.offset + slot.numel) - slot.offset
                if lo >= hi:
                    continue
                sd, w = (sd_after, w_after) if un.index in took else (sd_before, w_before)
                for part in ("exp_avg", "exp_avg_sq", "master"):
                    got = sd_mid["state"][i][part].reshape(-1)[lo:hi]
                    assert torch.equal(got, sd["state"][i][part].reshape(-1)[lo:hi]), \
                        (shard.key, un.index, part)
                assert torch.equal(w_mid[name].reshape(-1)[lo:hi], w[name].reshape(-1)[lo:hi])
    assert took_units > 0 and kept_units > 0  # the fault landed in the middle of the step
    if chunked:
        assert store.partial  # a shard was left part way, unit by unit


# ---- 7. a failed infinity.unwrap() -----------------------------------------------------------

@pytest.mark.parametrize("after_flats", [0, 2])
def test_failed_unwrap_keeps_model_working(tmp_path, swap_io, after_flats):
    """param_tier="nvme": reading the homes for unwrap fails (EIO, on the first or the third
    block). unwrap raises, the model is still wrapped and computes what it did before; training
    goes on, and a later unwrap returns the right values."""
    settings = SETTINGS["nvme"]
    model, opt = _setup(tmp_path / "run", **settings)
    engine = _engine(model)
    probe = _batches(1, seed=99)[0][0]
    losses = []
    for step, batch in enumerate(_batches()):
        swap_io.clear()
        losses.append(_train_step(model, opt, batch))
        if step == K:
            with torch.no_grad():
                expected = model(probe)
            read = dict(swap_io.sizes("read"))  # bytes of each home's read (unwrap reads each)
            inject_fault("read", errno.EIO,
                         after_bytes=sum(read[f.key] for f in engine.flats[:after_flats]))
            with pytest.raises(InfinityIOError) as info:
                infinity.unwrap(model)
            clear_faults()
            assert info.value.errno == errno.EIO
            assert engine_of(model) is engine
            with torch.no_grad():
                assert torch.equal(model(probe), expected)
            # p.grad, hooks and the optimizer still work: the loop continues
    weights = _finish(model, opt)
    _assert_same_run(tmp_path, losses, weights, **settings)
    assert engine_of(model) is None


def test_failed_unwrap_then_retry_gives_right_values(tmp_path, swap_io):
    """A retried unwrap right after the failed one succeeds and gives the trained values."""
    settings = SETTINGS["nvme"]
    model, opt = _setup(tmp_path / "run", **settings)
    engine = _engine(model)
    losses = [_train_step(model, opt, b) for b in _batches()]
    read = dict(swap_io.sizes("read"))  # bytes of each home's read (unwrap reads each)
    probe = _batches(1, seed=99)[0][0]
    with torch.no_grad():
        expected = model(probe)
    inject_fault("read", errno.EIO, after_bytes=read[engine.flats[0].key])
    with pytest.raises(InfinityIOError):
        infinity.unwrap(model)
    clear_faults()
    with torch.no_grad():
        assert torch.equal(model(probe), expected)
    infinity.unwrap(model)
    assert engine_of(model) is None
    with torch.no_grad():
        assert torch.equal(model(probe), expected)
    weights = _weights(model)
    opt.close()
    _assert_same_run(tmp_path, losses, weights, **settings)


def test_failed_unwrap_after_the_last_step(tmp_path):
    """The usual end of training: the last step, then unwrap. The disk fails during the last
    step (its writes succeed, the prefetches it starts for the next forward fail), so unwrap
    raises. Once the disk is fixed, the model computes with the trained weights and a retried
    unwrap succeeds: neither trips over a prefetch that failed while the disk was down."""
    settings = dict(param_tier="nvme", grad_tier="host", optimizer_tier="host")
    model, opt = _setup(tmp_path / "run", **settings)
    engine = _engine(model)
    losses = []
    for step, batch in enumerate(_batches()):
        losses.append(_backward(model, batch))
        if step == STEPS - 1:
            inject_fault("read", errno.EIO)
        opt.step()  # writes only: it succeeds
        opt.zero_grad()
    with pytest.raises(InfinityIOError) as info:
        infinity.unwrap(model)
    clear_faults()
    assert info.value.errno == errno.EIO
    assert engine_of(model) is engine
    probe = _batches(1, seed=99)[0][0]
    with torch.no_grad():
        wrapped = model(probe)
    infinity.unwrap(model)
    opt.close()
    with torch.no_grad():
        assert torch.equal(model(probe), wrapped)
    _assert_same_run(tmp_path, losses, _weights(model), **settings)
