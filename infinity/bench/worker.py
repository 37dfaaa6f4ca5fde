"""One benchmark run, in its own process (so its peak RSS is its own): builds the GPT, wraps it
with a placement (or the planner's, or none: plain PyTorch), trains a few steps on synthetic
data and prints one JSON line with tokens/s, step time and its attribution, peak memory and the
NVMe bytes written per step.

Design notes: docs/modules.md, bench/worker.py."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Dict


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    import infinity
    from infinity.bench.models import config_for, init_weights
    from infinity.models import TinyGPT, lm_loss, synthetic_batch
    from infinity.plan.placements import placement as get_placement
    from infinity.runtime.core.registry import engine_of

    torch.manual_seed(spec.get("seed", 0))
    cfg = config_for(spec["size"], spec["seq"])
    batch, seq, steps = spec["batch"], spec["seq"], spec["steps"]
    name = spec["placement"]
    cuda = torch.cuda.is_available()
    calibrations = []

    def calibrate() -> None:
        # a diagnostic only (never used for the prediction): forward + backward of one layer
        # and of the head at this shape, timed right after the measured steps in this process,
        # to tell the machine's load during the run from an error of the model
        if spec.get("calibrate_in_run"):
            from infinity.plan.probe import measure_gpt_parts

            parts = measure_gpt_parts(cfg.d_model, cfg.n_heads, cfg.vocab_size, batch, seq, reps=3)
            calibrations.append(cfg.n_layers * parts["layer_s"] + parts["head_s"])

    rss_start = _rss_kib()
    _reset_peak_rss()
    out: Dict[str, Any] = {
        "size": spec["size"],
        "placement": name,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "batch": batch,
        "seq": seq,
        "loadavg_start": os.getloadavg()[0],
    }
    t0 = time.perf_counter()
    states = "fp32"
    if name == "device":
        model = TinyGPT(cfg)
        if cuda:
            model = model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        settings: Dict[str, Any] = {"nvme_path": spec.get("nvme_path")}
        if spec.get("host_budget"):
            settings["host_budget"] = spec["host_budget"]
        if name == "planner":
            settings["placement"] = "auto"
            states = spec.get("states") or "fp32"
        else:
            pl = get_placement(name)
            settings.update(pl.wrap_settings())
            states = spec.get("states") or pl.states  # --states applies to every placement
            if not pl.uses_nvme:
                settings["nvme_path"] = None
        with infinity.empty_init():
            model = TinyGPT(cfg)
        infinity.wrap(model, init=init_weights, **settings)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-4, states=states)
        eng = engine_of(model)
        out["tiers"] = {
            "param": eng.param_tier.value,
            "grad": eng.grad_tier.value,
            "optimizer": eng.policy.optimizer_tier,
            "prefetch_window": eng.policy.prefetch_window,
        }
    out["params"] = sum(p.numel() for p in model.parameters())
    out["build_s"] = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    wrapped = name != "device"
    for i in range(spec["warmup"] + steps):
        if i == spec["warmup"] and wrapped:
            infinity.stats(model, reset=True)
        x, y = synthetic_batch(cfg, batch, seq, gen)
        if cuda:
            x, y = x.cuda(), y.cuda()
        t = time.perf_counter()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    measured = times[spec["warmup"] :]
    calibrate()
    if calibrations:
        out["compute_in_run_s"] = calibrations[-1]
    step = statistics.median(measured)
    out.update(
        {
            "step_s": step,
            "step_s_all": measured,
            "warmup_s_all": times[: spec["warmup"]],
            "states": states if wrapped else "torch",
            "loadavg_end": os.getloadavg()[0],
            "tokens_per_s": batch * seq / step,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "rss_start_bytes": rss_start * 1024,
            "peak_rss_bytes": _peak_rss_kib() * 1024,
        }
    )
    if cuda:
        out["peak_device_bytes"] = int(torch.cuda.max_memory_allocated())
    if wrapped:
        s = infinity.stats(model)
        t = s["time"]
        out["attribution"] = {
            "compute": t["compute"] / steps,
            "fetch_wait": t["fetch_wait"] / steps,
            "grad_offload": t["grad_offload"] / steps,
            "engine": t["engine"] / steps,
            "optimizer": t["optimizer"]["total"] / steps,
            "optimizer_cpu_adam": t["optimizer"]["cpu_adam"] / steps,
            "optimizer_nvme_wait": t["optimizer"]["nvme_wait"] / steps,
        }
        out["nvme_bytes_per_step"] = s["nvme_bytes_written"]["total"] / steps
        if not cuda:
            out["peak_device_bytes"] = s["tiers"]["device"]["peak"]
        out["host_peak_bytes"] = s["tiers"]["host"]["peak"]
        out["nvme_disk_bytes"] = s["tiers"]["nvme"]["now"] + opt.state_bytes["nvme"]
        if name == "planner":
            p = engine_of(model).plan
            out["planned"] = p.placement
        # close without restoring: unwrap() would read every parameter back into RAM as a
        # plain tensor (8 GB for a 2B model on NVMe), far above the RAM budget just measured
        engine_of(model).close(restore=False)
    else:
        out["nvme_bytes_per_step"] = 0
        if not cuda:
            out["peak_device_bytes"] = None
    return out


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported in the result row
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "size": spec.get("size"),
            "placement": spec.get("placement"),
        }
    sys.stdout.write("INFINITY_BENCH_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
