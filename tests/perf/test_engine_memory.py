"""Memory claims, checked: the device budget holds, and real peak RSS stays far below the model."""
import json
import subprocess
import sys
import textwrap

import torch
from engine_helpers import batches, loss_of

import infinity
from infinity.models import GPTConfig, TinyGPT


def test_device_budget_of_two_blocks_is_never_exceeded(tmp_path):
    cfg = GPTConfig(vocab_size=256, d_model=64, n_layers=8, n_heads=4, max_seq=64)
    torch.manual_seed(0)
    probe = TinyGPT(cfg)
    layer = sum(p.numel() for p in probe.layers[0].parameters()) * 4
    root = sum(p.numel() for n, p in probe.named_parameters() if not n.startswith("layers.")) * 4
    budget = root + 2 * layer + 2 * 4096 * 2  # root + about two layer blocks (+ padding)
    infinity.wrap(probe, nvme_path=str(tmp_path), param_tier="nvme", device_budget=budget,
                  prefetch_window=3)
    for x, y in batches(cfg, 4, batch=2, seq=16):
        probe._infinity_engine.zero_grad()
        loss_of(probe, x, y).backward()
    s = infinity.stats(probe)
    assert 0 < s["tiers"]["device"]["peak"] <= budget, (s["tiers"], budget)
    assert s["tiers"]["device"]["peak"] >= root + layer  # it did stream blocks through
    total_params = sum(b.compute_nbytes for b in probe._infinity_engine.blocks)
    assert total_params > 3 * budget


_RSS_SCRIPT = textwrap.dedent("""
    import json, re, sys, torch, infinity
    from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch

    def status(key):
        return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=512, d_model=384, n_layers=32, n_heads=6, max_seq=64)
    model = TinyGPT(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layer_bytes = sum(p.numel() * 4 for p in model.layers[0].parameters())
    budget = 3 * layer_bytes
    # a host_budget: RAM is the constraint, so the temporaries go back to the OS as they are
    # freed (runtime/process/host_memory.py); without one they reuse glibc's heap, as in plain PyTorch
    infinity.wrap(model, nvme_path=sys.argv[1], param_tier="nvme", device_budget=budget,
                  prefetch_window=1, host_budget=4 * model_bytes)
    g = torch.Generator().manual_seed(1)
    x, y = synthetic_batch(cfg, 1, 16, g)          # small activations: measure the engine
    before = status("VmRSS")                        # after wrap: the model now lives on NVMe
    open("/proc/self/clear_refs", "w").write("5")   # reset the kernel's peak-RSS counter
    for _ in range(3):
        model._infinity_engine.zero_grad()
        lm_loss(model(x), y).backward()
    peak = status("VmHWM")
    s = infinity.stats(model)
    print(json.dumps({"model_bytes": model_bytes, "budget": budget, "before": before,
                      "peak": peak, "device_peak": s["tiers"]["device"]["peak"],
                      "host_now": s["tiers"]["host"]["now"],
                      "host_compute": s["tiers"]["host"]["compute"]}))
""")


def test_forward_backward_from_nvme_peak_rss(tmp_path):
    """A 32-layer model (228 MB fp32) ~10x the device budget runs three forward+backward steps
    from NVMe (parameters and gradients both streamed). Bound: the real peak RSS growth over
    those steps (kernel VmHWM, reset right after wrap) stays below 30% of the model's size;
    measured here: 22-23%. The parts: engine buffers (1 staging + 3 gradient + the pooled
    compute buffers, which are kept for reuse up to the device budget (9% of the model here)
    instead of being unmapped at each release) plus activations; 12-14% before the pool.
    Without the engine's fixed glibc mmap threshold (runtime/process/host_memory.py) and without the
    pool it was 29-58%: freed block buffers stayed in the heap. With the threshold at 1 MiB
    instead of 128 KiB it varied from 23% to 35% between runs: backward's gradient temporaries
    were served from the holes the model's freed 590 KB parameters left in the heap. The wrap
    sets a host_budget: without one the engine lets temporaries reuse the heap (faster, as in
    plain PyTorch), and the growth then varies from 26% to 110% between runs."""
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    growth = r["peak"] - r["before"]
    assert r["model_bytes"] > 8 * r["budget"], r
    assert r["device_peak"] <= r["budget"], r
    assert growth < 0.30 * r["model_bytes"], (growth / r["model_bytes"], r)
    # the host budget also reserves the CPU device's compute buffers: counted once
    assert r["host_now"] - r["host_compute"] + r["device_peak"] < 0.25 * r["model_bytes"], r
