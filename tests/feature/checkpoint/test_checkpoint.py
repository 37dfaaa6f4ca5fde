"""Durable checkpoints (infinity.save_checkpoint / load_checkpoint) and consolidation.

* save at step K, train to N; load into a fresh wrapped model + optimizer (other initial
  weights), train K..N: losses and weights bitwise equal to the uninterrupted run, parameters and
  optimizer states on host (fp32 and bf16 working weights) and on NVMe; scheduler, loss scaler,
  RNG states and extra values come back too;
* across processes: a child process saves, then is SIGKILLed in the middle of a later save to
  the same path; this process resumes bitwise from what survived;
* damaged files (a data file, the manifest) are detected, naming the file; a checkpoint of
  another model lists every missing / unexpected / mismatched tensor; a path that is not a
  checkpoint and a full disk during a save give clear errors and keep the previous checkpoint;
* consolidate -> safetensors equal to the model's state_dict (single file, sharded, bf16 from the
  command line), and transformers' from_pretrained of a consolidated Llama / GPT-2 (tied head)
  has exactly the trained weights.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import infinity
from infinity.checkpoint import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from infinity.checkpoint.disk import files as ckpt_files
from infinity.checkpoint.disk.atomic import aside_path
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, max_seq=16)
K, N = 3, 6  # checkpoint after K steps, train to N


def _batches(n: int = N):
    g = torch.Generator().manual_seed(1)
    return [synthetic_batch(CFG, 4, 8, g) for _ in range(n)]


DATA = _batches()

TIERS = {
    "host": dict(param_tier="host", grad_tier="host", optimizer_tier="host"),
    # bf16 homes computing in bf16 (run in place on a CPU), pinned: "auto" computes them in
    # fp32 on a CPU without fast bf16
    "host-bf16": dict(param_tier="host", grad_tier="host", optimizer_tier="host",
                      compute_dtype=torch.bfloat16),
    "nvme": dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme"),
}


def setup(tmp_path, tier: str = "host", seed: int = 0, cfg: GPTConfig = CFG):
    """A wrapped TinyGPT with infinity AdamW, an LR schedule and a loss scaler."""
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    if tier.endswith("bf16"):
        model.to(torch.bfloat16)
    settings = dict(TIERS[tier])
    if "nvme" in settings.values():
        swap = tmp_path / "swap"
        swap.mkdir(exist_ok=True)
        settings["nvme_path"] = str(swap)
    infinity.wrap(model, **settings)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    scaler = infinity.optim.LossScaler(init_scale=2.0 ** 8, growth_interval=2)
    return model, opt, sched, scaler


def train_step(model, opt, sched, scaler, batch) -> float:
    x, y = batch
    loss = lm_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad()
    return loss.item()


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(actual, expected, what=""):
    assert sorted(actual) == sorted(expected), what
    for k in expected:
        assert torch.equal(actual[k], expected[k]), f"{what}: {k} differs"


def rng_draws():
    return torch.rand(3), np.random.rand(3), random.random()


# ---- resume -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tier", list(TIERS))
def test_resume_is_bitwise(tmp_path, tier):
    model, opt, sched, scaler = setup(tmp_path, tier)
    for b in DATA[:K]:
        train_step(model, opt, sched, scaler, b)
    ckpt = tmp_path / "ckpt"
    infinity.save_checkpoint(ckpt, model, opt, scheduler=sched, scaler=scaler, rng=True,
                             step=K, note=("tuple", 1))
    draws = rng_draws()
    losses = [train_step(model, opt, sched, scaler, b) for b in DATA[K:]]
    expected, expected_opt = weights(model), opt.state_dict()

    model2, opt2, sched2, scaler2 = setup(tmp_path, tier, seed=7)  # other initial weights
    extra = infinity.load_checkpoint(ckpt, model2, opt2, scheduler=sched2, scaler=scaler2,
                                     rng=True)
    assert extra == {"step": K, "note": ("tuple", 1)}
    again = rng_draws()
    assert torch.equal(again[0], draws[0]) and np.array_equal(again[1], draws[1]) \
        and again[2] == draws[2]
    assert sched2.last_epoch == K
    resumed = [train_step(model2, opt2, sched2, scaler2, b) for b in DATA[K:]]
    assert resumed == losses
    assert_bitwise(weights(model2), expected, "weights")
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert scaler2.state_dict() == scaler.state_dict()
    state2 = opt2.state_dict()
    for i, entry in expected_opt["state"].items():
        for key, value in entry.items():
            assert torch.equal(state2["state"][i][key], value), (i, key)
    if tier == "host-bf16":  # the fp32 masters were saved (they differ from the bf16 weights)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert any("master" in s["tensors"] for s in manifest["optimizer"]["states"].values())
    # rolling the first (live, stepped, prefetched) model and optimizer back to step K
    infinity.load_checkpoint(ckpt, model, opt, scheduler=sched, scaler=scaler)
    assert [train_step(model, opt, sched, scaler, b) for b in DATA[K:]] == losses
    assert_bitwise(weights(model), expected, "rolled back")


@pytest.mark.parametrize("optim", ["torch", "infinity"])
def test_plain_model_round_trip(tmp_path, optim):
    """An unwrapped model with a torch or an infinity optimizer resumes bitwise; its checkpoint
    also loads into a wrapped model."""
    make = torch.optim.AdamW if optim == "torch" else infinity.optim.AdamW
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = make(model.parameters(), lr=1e-2)

    def step(m, o, b):
        loss = lm_loss(m(b[0]), b[1])
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.item()

    for b in DATA[:K]:
        step(model, opt, b)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    at_k = weights(model)
    losses = [step(model, opt, b) for b in DATA[K:]]
    torch.manual_seed(7)
    model2 = TinyGPT(CFG)
    opt2 = make(model2.parameters(), lr=1e-2)
    infinity.load_checkpoint(tmp_path / "ckpt", model2, opt2)
    assert [step(model2, opt2, b) for b in DATA[K:]] == losses
    assert_bitwise(weights(model2), weights(model))

    wrapped = TinyGPT(CFG)
    infinity.wrap(wrapped, param_tier="host")
    infinity.load_checkpoint(tmp_path / "ckpt", wrapped)
    assert_bitwise(weights(wrapped), at_k)


_CHILD = r"""
import pathlib, sys, time
import infinity
import infinity.checkpoint.disk.files as files
from test_checkpoint import DATA, K, setup, train_step
ckpt, tmp, tier = sys.argv[1], sys.argv[2], sys.argv[3]
model, opt, sched, scaler = setup(pathlib.Path(tmp), tier)
for b in DATA[:K]:
    train_step(model, opt, sched, scaler, b)
infinity.save_checkpoint(ckpt, model, opt, scheduler=sched, scaler=scaler, step=K)
for b in DATA[K:]:
    train_step(model, opt, sched, scaler, b)
real = files._write_bytes
def stalled(fd, data):  # a later save to the same path stops halfway through its first file
    real(fd, data[:len(data) // 2])
    print("writing", flush=True)
    time.sleep(120)
files._write_bytes = stalled
infinity.save_checkpoint(ckpt, model, opt, scheduler=sched, scaler=scaler, step=99)
"""


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_resume_after_kill9_during_a_later_save(tmp_path, tier):
    """Parameters and optimizer states on host, and on NVMe (there the killed child's swap
    files are left behind too; the engine removes them)."""
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(ckpt), str(tmp_path), tier],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(60, child.kill)
    watchdog.start()
    try:
        line = child.stdout.readline()
        assert line.strip() == "writing", f"child failed: {line}{child.stderr.read()}"
        assert glob.glob(str(tmp_path / ".ckpt.tmp-*")), "the save's temporary dir should exist"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    finally:
        watchdog.cancel()
        child.kill()
        child.stdout.close()
        child.stderr.close()

    # the uninterrupted run, in this process
    model, opt, sched, scaler = setup(tmp_path, tier)
    losses = [train_step(model, opt, sched, scaler, b) for b in DATA]
    # resumed from what the killed process left
    model2, opt2, sched2, scaler2 = setup(tmp_path, tier, seed=7)
    extra = infinity.load_checkpoint(ckpt, model2, opt2, scheduler=sched2, scaler=scaler2)
    assert extra == {"step": K}
    assert [train_step(model2, opt2, sched2, scaler2, b) for b in DATA[K:]] == losses[K:]
    assert_bitwise(weights(model2), weights(model))
    # the next save removes the dead process's temporary directory
    infinity.save_checkpoint(ckpt, model2, opt2)
    assert not glob.glob(str(tmp_path / ".ckpt.tmp-*"))


def test_interrupted_replace_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    model, opt, sched, scaler = setup(tmp_path)
    train_step(model, opt, sched, scaler, DATA[0])
    ckpt = tmp_path / "ckpt"
    infinity.save_checkpoint(ckpt, model, opt, step=1)
    saved = weights(model)
    # a crash between "rename the old checkpoint aside" and "rename the new one in"
    os.rename(ckpt, aside_path(str(ckpt)))
    model2, opt2, _, _ = setup(tmp_path, seed=7)
    assert infinity.load_checkpoint(ckpt, model2, opt2) == {"step": 1}
    assert "interrupted" in caplog.text
    assert_bitwise(weights(model2), saved)
    infinity.save_checkpoint(ckpt, model2, opt2, step=2)  # completes the replacement
    assert not os.path.exists(aside_path(str(ckpt)))
    assert infinity.load_checkpoint(ckpt, model2, opt2) == {"step": 2}


# ---- errors -----------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    model, opt, sched, scaler = setup(tmp_path)
    train_step(model, opt, sched, scaler, DATA[0])
    ckpt = tmp_path / "ckpt"
    infinity.save_checkpoint(ckpt, model, opt)
    return ckpt, weights(model)


def _flip(path, pos):
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))


def test_corrupted_data_file_is_detected(tmp_path, saved):
    ckpt, _ = saved
    target = ckpt / "model" / "block0001.float32.safetensors"
    _flip(target, target.stat().st_size // 2)
    model, opt, _, _ = setup(tmp_path, seed=7)
    with pytest.raises(CorruptCheckpointError, match="block0001.float32.safetensors"):
        infinity.load_checkpoint(ckpt, model, opt)
    with pytest.raises(CorruptCheckpointError, match="block0001.float32.safetensors"):
        infinity.consolidate(ckpt, tmp_path / "out")


def test_corrupted_manifest_is_detected(tmp_path, saved):
    ckpt, _ = saved
    manifest = ckpt / "manifest.json"
    original = manifest.read_bytes()
    model, opt, _, _ = setup(tmp_path, seed=7)
    for pos in range(0, len(original), len(original) // 7):
        manifest.write_bytes(original)
        _flip(manifest, pos)
        with pytest.raises(CorruptCheckpointError, match="manifest.json"):
            infinity.load_checkpoint(ckpt, model, opt)
    manifest.write_bytes(original)
    infinity.load_checkpoint(ckpt, model, opt)


class _Other(TinyGPT):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.extra = torch.nn.Linear(cfg.d_model, 2)


def test_checkpoint_of_another_model_lists_every_difference(tmp_path, saved):
    ckpt, _ = saved
    other = _Other(GPTConfig(vocab_size=80, d_model=32, n_layers=2, n_heads=2, max_seq=16))
    infinity.wrap(other, param_tier="host")
    before = weights(other)
    with pytest.raises(CheckpointMismatchError) as info:
        infinity.load_checkpoint(ckpt, other)
    msg = str(info.value)
    assert "missing in the checkpoint (2): extra.weight, extra.bias" in msg
    assert "unexpected in the checkpoint (12): layers.2.ln1.weight, " in msg
    assert "tok.weight: checkpoint (64, 32) vs model (80, 32)" in msg
    assert_bitwise(weights(other), before, "a failed load changed the model")

    # strict=False loads what matches (same shapes, one layer less, one module more)
    smaller = _Other(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16))
    infinity.wrap(smaller, param_tier="host")
    extra_w = smaller.extra.weight.detach().clone()
    infinity.load_checkpoint(ckpt, smaller, strict=False)
    got = weights(smaller)
    assert torch.equal(got["tok.weight"], saved[1]["tok.weight"])
    assert torch.equal(got["layers.1.fc.weight"], saved[1]["layers.1.fc.weight"])
    assert torch.equal(got["extra.weight"], extra_w)


def test_not_a_checkpoint(tmp_path):
    model = TinyGPT(CFG)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        infinity.load_checkpoint(tmp_path / "nothing", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not an infinity checkpoint"):
        infinity.load_checkpoint(tmp_path / "empty", model)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="is a file"):
        infinity.load_checkpoint(tmp_path / "model.pt", model)
    with pytest.raises(CheckpointError, match="not an infinity checkpoint"):
        infinity.consolidate(tmp_path / "empty", tmp_path / "out")
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep.txt").write_text("user data")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        infinity.save_checkpoint(data, model)
    assert (data / "keep.txt").read_text() == "user data"
    with pytest.raises(TypeError, match="extra"):
        infinity.save_checkpoint(tmp_path / "ck", model, bad=object())
    assert not os.path.exists(tmp_path / "ck")


@pytest.mark.parametrize("fail_at", ["data", "manifest"])
def test_full_disk_keeps_the_previous_checkpoint(tmp_path, saved, monkeypatch, fail_at):
    ckpt, first = saved
    model, opt, _, _ = setup(tmp_path, seed=7)
    infinity.load_checkpoint(ckpt, model, opt)
    model(DATA[1][0]).sum().backward()
    opt.step()
    opt.zero_grad()
    calls = []
    real = ckpt_files._write_bytes

    def counted(fd, data):
        calls.append(1)
        real(fd, data)

    monkeypatch.setattr(ckpt_files, "_write_bytes", counted)
    infinity.save_checkpoint(tmp_path / "count", model, opt)
    last = len(calls)  # the manifest is the last write of a save
    when = 3 if fail_at == "data" else last
    calls.clear()

    def full(fd, data):
        calls.append(1)
        if len(calls) == when:
            real(fd, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(ckpt_files, "_write_bytes", full)
    with pytest.raises(OSError, match="disk .* is full.*intact") as info:
        infinity.save_checkpoint(ckpt, model, opt)
    assert info.value.errno == errno.ENOSPC
    assert not glob.glob(str(tmp_path / ".ckpt.*"))
    monkeypatch.setattr(ckpt_files, "_write_bytes", real)
    fresh, fresh_opt, _, _ = setup(tmp_path, seed=3)
    infinity.load_checkpoint(ckpt, fresh, fresh_opt)
    assert_bitwise(weights(fresh), first)


# ---- consolidate ------------------------------------------------------------------------------
def test_consolidate_equals_state_dict(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from infinity.cli import main
    model, opt, sched, scaler = setup(tmp_path, "nvme")
    for b in DATA[:2]:
        train_step(model, opt, sched, scaler, b)
    ckpt = tmp_path / "ckpt"
    infinity.save_checkpoint(ckpt, model, opt)
    state = weights(model)
    expected = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: written once

    out = tmp_path / "one"
    assert infinity.consolidate(ckpt, out) == [str(out / "model.safetensors")]
    assert_bitwise(load_file(out / "model.safetensors"), expected, "single file")

    out = tmp_path / "sharded"
    infinity.consolidate(ckpt, out, max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for f in files:
        part = load_file(out / f)
        assert all(index["weight_map"][k] == f for k in part)
        merged.update(part)
    assert_bitwise(merged, expected, "sharded")
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in expected.values())

    out = tmp_path / "bf16"
    assert main(["consolidate", str(ckpt), str(out), "--dtype", "bf16"]) == 0
    assert_bitwise(load_file(out / "model.safetensors"),
                   {k: v.to(torch.bfloat16) for k, v in expected.items()}, "bf16")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=32))  # tied lm_head


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_hf_from_pretrained_of_consolidated_checkpoint(tmp_path, build):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = build()
    initial = weights(model)
    infinity.wrap(model, param_tier="host")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    trained = weights(model)
    assert not torch.equal(trained["lm_head.weight"], initial["lm_head.weight"])
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    infinity.consolidate(tmp_path / "ckpt", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded) is type(model)
    assert_bitwise(weights(loaded), trained, "from_pretrained")


# ---- NVMe states reused by a kernel-side copy -------------------------------------------------
def test_nvme_states_are_copied_by_the_kernel_and_resume_bitwise(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from infinity.optim.state_dicts import StateDicts
    model, opt, sched, scaler = setup(tmp_path, "nvme")
    for b in DATA[:K]:
        train_step(model, opt, sched, scaler, b)

    def no_reading(self, shard):
        raise AssertionError("NVMe optimizer states were read into RAM for the checkpoint")

    with monkeypatch.context() as m:
        m.setattr(StateDicts, "read_committed", no_reading)
        ckpt = infinity.save_checkpoint(tmp_path / "ckpt", model, opt, scheduler=sched,
                                        scaler=scaler, rng=True)
    rest = [train_step(model, opt, sched, scaler, b) for b in DATA[K:]]
    states = sorted(glob.glob(os.path.join(ckpt, "optimizer", "*.states.safetensors")))
    assert states, "no reused-extent state file was written"
    for path in states:  # real safetensors, data at 4096, gaps covered by __pad__ tensors
        raw = pathlib.Path(path).read_bytes()
        assert 8 + int.from_bytes(raw[:8], "little") == 4096
        names = load_file(path).keys()
        assert any(n.endswith("::exp_avg_sq") for n in names)
    model2, opt2, sched2, scaler2 = setup(tmp_path, "nvme", seed=7)
    infinity.load_checkpoint(ckpt, model2, opt2, scheduler=sched2, scaler=scaler2, rng=True)
    assert [train_step(model2, opt2, sched2, scaler2, b) for b in DATA[K:]] == rest
    assert_bitwise(weights(model2), weights(model))
    infinity.consolidate(ckpt, tmp_path / "out")  # ignores the optimizer files

    target = pathlib.Path(states[0])
    original = target.read_bytes()
    for pos in (100, 4096 + 8, len(original) - 1):  # header, data, padding tail
        target.write_bytes(original)
        _flip(target, pos)
        with pytest.raises(CorruptCheckpointError, match=target.name):
            infinity.load_checkpoint(ckpt, model2, opt2)
