"""infinity.stats(model)["time"] and ["nvme_bytes_written"]: where a training step's time went
and how many bytes it wrote to NVMe."""
import time

import torch
from engine_helpers import SMALL, batches, loss_of

import infinity
from infinity.models import TinyGPT

STEPS = 3


def _leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + k + ".")
        else:
            yield prefix + k, v


def test_time_attribution_and_nvme_bytes_written(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", grad_tier="nvme",
                  optimizer_tier="nvme")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    infinity.stats(model, reset=True)
    per_step = []
    t0 = time.perf_counter()
    for x, y in batches(SMALL, STEPS):
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(infinity.stats(model)["nvme_bytes_written"]["last_step"])
    wall = time.perf_counter() - t0
    s = infinity.stats(model, reset=True)
    t = s["time"]
    assert set(t) >= {"compute", "fetch_wait", "grad_offload", "optimizer"}
    assert set(t["optimizer"]) == {"cpu_adam", "nvme_wait", "nvme_busy", "total"}
    for name, v in _leaves(t):
        assert isinstance(v, float) and v >= 0.0, (name, v)
    assert t["optimizer"]["total"] >= t["optimizer"]["cpu_adam"]
    assert t["optimizer"]["total"] > 0.0 and t["compute"] > 0.0
    parts = t["compute"] + t["fetch_wait"] + t["grad_offload"] + t["optimizer"]["total"]
    assert parts <= wall + 1e-3, (parts, wall)
    written = s["nvme_bytes_written"]
    assert written["last_step"] == per_step[-1]
    assert written["total"] == sum(per_step) > 0
    assert all(n > 0 for n in per_step)

    after = infinity.stats(model)
    for name, v in _leaves(after["time"]):
        if name != "transfer_cpu":  # the prefetch for the next forward runs in the background
            assert v == 0.0, name
    assert after["nvme_bytes_written"] == {"last_step": 0, "total": 0}
    opt.close()
    infinity.unwrap(model)
