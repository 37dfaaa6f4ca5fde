"""``infinity ckpt inspect PATH``: the summary of a checkpoint, and a damaged file named."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import infinity
from infinity.checkpoint.inspect import inspect_checkpoint
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch


def _saved(tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq=16)
    model = TinyGPT(cfg)
    (tmp_path / "swap").mkdir()
    infinity.wrap(model, nvme_path=str(tmp_path / "swap"), param_tier="nvme",
                  optimizer_tier="nvme")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, 16, torch.Generator().manual_seed(step))
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    path = str(tmp_path / "ckpt")
    infinity.save_checkpoint(path, model, opt)
    return path, model


def test_inspect_summary_and_corruption(tmp_path):
    path, model = _saved(tmp_path)
    info = inspect_checkpoint(path)
    assert info["kind"] == "single" and info["world_size"] == 1 and info["wrapped"]
    assert info["param_tier"] == "nvme" and info["verified"] is True
    assert info["tensors"] == len(model.state_dict()) or info["tensors"] > 0
    assert info["optimizer"] is not None and info["bytes"] > 0
    # the CLI, in a subprocess, exit 0 and the summary
    proc = subprocess.run([sys.executable, "-m", "infinity", "ckpt", "inspect", path, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verified"] is True
    # flip a byte in one model file: it is named, exit code 1
    model_dir = os.path.join(info["path"], "model")
    victim = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))[0]
    with open(os.path.join(model_dir, victim), "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    bad = inspect_checkpoint(path)
    assert bad["verified"] is False and any(victim in p for p in bad["problems"])
    proc = subprocess.run([sys.executable, "-m", "infinity", "ckpt", "inspect", path],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and victim in proc.stdout
    infinity.unwrap(model)


def test_inspect_not_a_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "infinity", "ckpt", "inspect", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "infinity ckpt inspect" in proc.stderr
