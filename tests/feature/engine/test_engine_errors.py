"""Bad input gets a clear error, and a failed wrap leaves the model exactly as it was."""
import copy
import os

import pytest
import torch
from engine_helpers import SMALL, batches, loss_of
from torch import nn

import infinity
from infinity.models import TinyGPT
from infinity.tiers import BudgetExceededError, SwapCorruptionError


def _model():
    torch.manual_seed(0)
    return TinyGPT(SMALL)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, snap):
    assert not hasattr(model, "_infinity_engine")
    for n, p in model.named_parameters():
        assert p.untyped_storage().size() > 0, n
        assert torch.equal(p.detach(), snap[n]), n


def test_missing_nvme_path(tmp_path):
    m = _model()
    snap = _snapshot(m)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        infinity.wrap(m, nvme_path=str(tmp_path / "nope"), param_tier="nvme")
    _unchanged(m, snap)


def test_unwritable_nvme_path(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/self"  # not writable even for root
    else:
        target = str(tmp_path / "ro")
        os.mkdir(target, 0o500)
    m = _model()
    snap = _snapshot(m)
    with pytest.raises((PermissionError, OSError)):
        infinity.wrap(m, nvme_path=target, param_tier="nvme")
    _unchanged(m, snap)


def test_nvme_tier_without_path():
    with pytest.raises(ValueError, match="needs nvme_path"):
        infinity.wrap(_model(), param_tier="nvme")


def test_filesystem_without_o_direct(tmp_path, monkeypatch):
    # Recent kernels give tmpfs O_DIRECT, so a filesystem without it is simulated by making the
    # probe say no (tests/unit/io/test_io.py covers the handle's own fallback).
    shm = str(tmp_path)
    monkeypatch.setattr(infinity.io, "supports_direct_io", lambda path: False)
    m = _model()
    snap = _snapshot(m)
    with pytest.raises(OSError, match="O_DIRECT"):
        infinity.wrap(m, nvme_path=shm, param_tier="nvme", require_direct_io=True)
    _unchanged(m, snap)
    # documented behaviour without require_direct_io: a warning, buffered I/O, correct results
    ref = copy.deepcopy(m)
    with pytest.warns(RuntimeWarning, match="does not support O_DIRECT"):
        infinity.wrap(m, nvme_path=shm, param_tier="nvme")
    (x, y), = batches(SMALL, 1)
    with torch.no_grad():
        assert torch.equal(ref(x), m(x))
    infinity.unwrap(m)


def test_budget_smaller_than_largest_block(tmp_path):
    m = _model()
    snap = _snapshot(m)
    layer_bytes = sum(p.numel() * 4 for p in m.layers[0].parameters())
    with pytest.raises(BudgetExceededError, match=r"block 'layers\.\d+' needs [\d,]+ bytes"):
        infinity.wrap(m, nvme_path=str(tmp_path), param_tier="nvme",
                      device_budget=layer_bytes // 2)
    _unchanged(m, snap)
    assert not [p for p in tmp_path.iterdir()]  # nothing left on disk


def test_model_without_parameters():
    with pytest.raises(ValueError, match="no parameters"):
        infinity.wrap(nn.Sequential(nn.ReLU(), nn.Dropout()))


def test_wrapping_twice(tmp_path):
    m = _model()
    infinity.wrap(m)
    with pytest.raises(RuntimeError, match="already wrapped"):
        infinity.wrap(m, nvme_path=str(tmp_path), param_tier="nvme")
    infinity.unwrap(m)
    infinity.wrap(m, nvme_path=str(tmp_path), param_tier="nvme")  # fine after unwrap


def test_unsupported_dtype_and_settings():
    m = nn.Linear(4, 4)
    m.register_parameter("steps", nn.Parameter(torch.zeros(2, dtype=torch.int64),
                                               requires_grad=False))
    with pytest.raises(TypeError, match="dtype torch.int64"):
        infinity.wrap(m)
    assert m.weight.untyped_storage().size() > 0
    with pytest.raises(TypeError, match="unknown infinity.wrap setting"):
        infinity.wrap(nn.Linear(2, 2), prefetch=3)
    with pytest.raises(ValueError, match="prefetch_window"):
        infinity.wrap(nn.Linear(2, 2), prefetch_window=-1)
    with pytest.raises(ValueError, match="device_budget"):
        infinity.wrap(nn.Linear(2, 2), device_budget=0)
    with pytest.raises(ValueError, match="compute_dtype"):
        infinity.wrap(nn.Linear(2, 2), compute_dtype=torch.int8)
    with pytest.raises(TypeError, match="block_rule"):
        infinity.wrap(nn.Linear(2, 2), block_rule="layers")
    with pytest.raises(ValueError, match="not wrapped"):
        infinity.stats(nn.Linear(2, 2))


def test_corrupted_swap_file_is_detected(tmp_path):
    m = _model()
    infinity.wrap(m, nvme_path=str(tmp_path), param_tier="nvme")
    engine = m._infinity_engine
    flat = engine.blocks[1].flats[0]
    path = engine.store.path(flat.key)
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    (x, y), = batches(SMALL, 1)
    with pytest.raises(SwapCorruptionError, match="corrupted"):
        loss_of(m, x, y)
    # the engine is still consistent: other blocks are not left half-fetched
    assert engine.blocks[1].state.value == "on_nvme"


def test_meta_device_model_is_refused():
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta"):
        infinity.wrap(m)


def test_error_during_offload_restores_model(tmp_path, monkeypatch):
    """A failure half way through moving blocks to NVMe (e.g. a full disk) rolls back."""
    m = _model()
    snap = _snapshot(m)
    from infinity.tiers import swap_store

    calls = {"n": 0}
    real_create = swap_store.SwapStore.create

    def failing_create(self, key, nbytes):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device (injected)")
        return real_create(self, key, nbytes)

    monkeypatch.setattr(swap_store.SwapStore, "create", failing_create)
    with pytest.raises(OSError, match="No space"):
        infinity.wrap(m, nvme_path=str(tmp_path), param_tier="nvme")
    _unchanged(m, snap)
    assert not list(tmp_path.iterdir())


def test_process_killed_mid_run_leaves_nothing_behind(tmp_path):
    """A training process SIGKILLed while its swap files are open (mid-step) leaves a swap
    directory behind; the next wrap under the same nvme_path removes it and trains normally."""
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, signal, torch, infinity
        from infinity.models import TinyGPT, GPTConfig, lm_loss, synthetic_batch
        cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)
        m = infinity.wrap(TinyGPT(cfg), nvme_path={str(tmp_path)!r}, param_tier="nvme")
        opt = infinity.optim.AdamW(m.parameters())
        x, y = synthetic_batch(cfg, 2, 8, torch.Generator().manual_seed(0))
        lm_loss(m(x), y).backward()
        opt.step()
        lm_loss(m(x), y).backward()
        os.kill(os.getpid(), signal.SIGKILL)  # dies with swap and state files open
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = [p.name for p in tmp_path.iterdir()]
    assert left and all(n.startswith("infinity-swap-") for n in left)  # what the crash left
    ref, wrapped = _model(), _model()
    infinity.wrap(wrapped, nvme_path=str(tmp_path), param_tier="nvme")
    remaining = [p.name for p in tmp_path.iterdir()]
    assert not set(left) & set(remaining)  # the dead process's directories are gone
    (x, y), = batches(SMALL, 1)
    with torch.no_grad():
        assert torch.equal(ref(x), wrapped(x))
    infinity.unwrap(wrapped)
    assert not list(tmp_path.iterdir())


def test_disk_too_small_for_the_swap_files_is_refused_before_anything_is_written(
        tmp_path, monkeypatch):
    """A disk under nvme_path with less free space than the parameters' and gradients' swap
    files: wrap raises ENOSPC naming infinity, the bytes needed and free and the remedy, the
    model is left as it was, and nothing is written under nvme_path."""
    import collections
    import errno
    import os
    import re

    from infinity.models import GPTConfig, TinyGPT
    from infinity.tiers import disk_space
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: usage(1 << 30, 0, 100_000))
    model = TinyGPT(GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, max_seq=16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(OSError) as err:
        infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", grad_tier="nvme",
                      optimizer_tier="host")
    assert err.value.errno == errno.ENOSPC
    msg = str(err.value)
    assert "infinity:" in msg and "100,000 bytes free" in msg and "grad_tier" in msg
    need = int(re.search(r"need ([\d,]+) bytes", msg).group(1).replace(",", ""))
    n = sum(p.numel() for p in model.parameters())
    assert need >= 8 * n  # fp32 homes + fp32 gradients
    assert os.listdir(tmp_path) == []
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
