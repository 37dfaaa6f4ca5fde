"""Step time (forward + backward) of a long-sequence GPT with its saved activations offloaded to
host RAM and to NVMe, against the same wrapped model without activation offload, in one run.

    python benchmarks/bench_activation_offload.py           # 4096 tokens, 3 rounds x 4 steps
    python benchmarks/bench_activation_offload.py --quick   # tiny, smoke test (CI)

Every configuration wraps the model the same way (parameters on host); only
``activation_tier`` differs. Each configuration runs in its own fresh process (one warm-up step
that records the backward order, then the measured steps); the processes take turns, round
after round, so a noisy phase of this shared machine hits each alike. Per configuration:
median step time, the ratio to no offload (overall, and paired: each round's median over the
same round's no-offload median), the seconds forward/backward waited for activations (copies
out, reads back), the bytes offloaded and fetched per step, the engine's peak of activation
bytes resident on the device tier (offloaded ones only; the rest stays as in PyTorch), and the
process's peak RSS growth over its steps (kernel VmHWM).
On a CPU-only machine the "device" is the CPU: host offload copies each saved tensor into a
pooled host buffer and hands that buffer back to backward in place; NVMe offload writes it to
a scratch file with O_DIRECT and reads it back ahead of its use.
Results: benchmarks/results/bench_activation_offload.json (+ .png when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import _common  # noqa: E402  (benchmarks/, this script's folder)
import torch  # noqa: E402

import infinity  # noqa: E402
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch  # noqa: E402

CONFIGS = ("none", "host", "nvme")


def config(quick: bool, seq: int) -> GPTConfig:
    if quick:
        return GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq=seq)
    return GPTConfig(vocab_size=512, d_model=128, n_layers=6, n_heads=4, max_seq=seq)


def build(name: str, cfg: GPTConfig, args, swap_dir: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    kw = {}
    if name != "none":
        kw = dict(activation_tier=name, activation_min_bytes=args.min_bytes,
                  activation_prefetch_bytes=args.window_mib << 20)
    infinity.wrap(model, nvme_path=swap_dir, param_tier="host", **kw)
    return model


def one_step(name: str, model: torch.nn.Module, x, y) -> Dict:
    infinity.stats(model, reset=True)
    model._infinity_engine.zero_grad()
    t0 = time.perf_counter()
    loss = lm_loss(model(x), y)
    loss.backward()
    row = {"step_s": time.perf_counter() - t0, "loss": loss.item()}
    s = infinity.stats(model)
    act = s.get("activations")
    if act is not None:
        row.update(wait_s=s["time"]["activation_wait"],
                   offloaded=act["last_step"]["offloaded_bytes"],
                   fetched=act["last_step"]["fetched_bytes"],
                   kept=act["last_step"]["kept_bytes"],
                   on_demand=act["last_step"]["on_demand_fetches"],
                   device_peak=act["device"]["peak"])
    return row


def summarize(name: str, rows: List[Dict]) -> Dict:
    times = [r["step_s"] for r in rows]
    out = {"config": name, "step_s_median": statistics.median(times), "step_s_all": times,
           "losses": [r["loss"] for r in rows]}
    if "wait_s" in rows[0]:
        med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
        out.update(activation_wait_s_median=med("wait_s"),
                   activation_wait_s_all=[r["wait_s"] for r in rows],
                   wait_fraction=statistics.median(r["wait_s"] / r["step_s"] for r in rows),
                   offloaded_bytes_per_step=med("offloaded"),
                   fetched_bytes_per_step=med("fetched"), kept_bytes_per_step=med("kept"),
                   on_demand_fetches=med("on_demand"),
                   device_peak_bytes=max(r["device_peak"] for r in rows))
    return out


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker(name: str, args) -> int:
    """One configuration in this process: a warm-up step, then the measured steps; prints
    the rows (and the peak RSS growth over all steps) as JSON."""
    cfg = config(args.quick, args.seq)
    x, y = synthetic_batch(cfg, args.batch, args.seq, torch.Generator().manual_seed(1))
    model = build(name, cfg, args, args.nvme_path)
    before = _status_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as fh:  # reset the peak-RSS counter
            fh.write("5")
    except OSError:
        pass
    rows = [one_step(name, model, x, y) for _ in range(args.steps + 1)]
    growth = _status_bytes("VmHWM") - before
    infinity.unwrap(model)
    print(json.dumps({"rows": rows[1:], "peak_rss_growth": growth,
                      "params": sum(q.numel() for q in model.parameters())}))
    return 0


def plot(rows: List[Dict], title: str, path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["config"] for r in rows]
    wait = [r.get("activation_wait_s_median", 0.0) for r in rows]
    rest = [r["step_s_median"] - w for r, w in zip(rows, wait)]
    ax.bar(names, rest, label="compute (incl. hidden copies)")
    ax.bar(names, wait, bottom=rest, label="waited for activations")
    for i, r in enumerate(rows):
        ax.text(i, r["step_s_median"], f"{r['ratio_vs_none']:.2f}x", ha="center", va="bottom")
    ax.set_ylim(0, 1.15 * max(r["step_s_median"] for r in rows))
    ax.set_ylabel("forward+backward step (s)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    _common.save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds; each runs every configuration once, in its own process")
    p.add_argument("--steps", type=int, default=None, help="measured steps per process")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--min-bytes", type=int, default=1 << 16, help="activation_min_bytes")
    p.add_argument("--window-mib", type=int, default=64, help="activation_prefetch_bytes, MiB")
    p.add_argument("--nvme-path", default=None, help="swap directory (default: temp dir)")
    p.add_argument("--worker", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "bench_activation_offload.json"))
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (1 if args.quick else 4)
    args.seq = args.seq or (256 if args.quick else 4096)
    if args.worker is not None:
        return worker(args.worker, args)
    cfg = config(args.quick, args.seq)
    swap_dir = args.nvme_path or tempfile.mkdtemp(prefix="bench-act-", dir=tempfile.gettempdir())
    # Each configuration runs in a fresh process (activation offload sets glibc's mmap
    # threshold process-wide, which would change the baseline's allocations too); the
    # processes take turns round by round, so a noisy phase of this shared machine hits each.
    per_config: Dict[str, List[Dict]] = {name: [] for name in CONFIGS}
    rss: Dict[str, List[int]] = {name: [] for name in CONFIGS}
    paired: Dict[str, List[float]] = {name: [] for name in CONFIGS}
    base_cmd = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps),
                "--seq", str(args.seq), "--batch", str(args.batch), "--min-bytes",
                str(args.min_bytes), "--window-mib", str(args.window_mib),
                "--nvme-path", swap_dir] + (["--quick"] if args.quick else [])
    n_params = 0
    try:
        for rnd in range(args.rounds):
            order = CONFIGS[rnd % 3:] + CONFIGS[:rnd % 3]
            medians = {}
            for name in order:
                out = subprocess.run(base_cmd + ["--worker", name], capture_output=True,
                                     text=True, timeout=3600)
                if out.returncode != 0:
                    print(out.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"worker {name} failed")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                per_config[name] += res["rows"]
                rss[name].append(res["peak_rss_growth"])
                n_params = res["params"]
                medians[name] = statistics.median(r["step_s"] for r in res["rows"])
            for name in CONFIGS:
                paired[name].append(medians[name] / medians["none"])
            print(f"round {rnd + 1}: " + "  ".join(
                f"{n} {medians[n]:.3f}s" for n in CONFIGS), flush=True)
        rows = [summarize(name, per_config[name]) for name in CONFIGS]
        for r in rows:
            r["peak_rss_growth_bytes_median"] = statistics.median(rss[r["config"]])
    finally:
        if args.nvme_path is None:
            shutil.rmtree(swap_dir, ignore_errors=True)
    base = rows[0]["step_s_median"]
    for r in rows:
        r["ratio_vs_none"] = r["step_s_median"] / base
        # paired: each round's median step over the no-offload median of the same round (run
        # next to it), so slow phases of a shared machine cancel out
        r["paired_ratio_median"] = statistics.median(paired[r["config"]])
        r["paired_ratios"] = paired[r["config"]]
        r["same_losses_as_none"] = r["losses"] == rows[0]["losses"]
    print("\nconfig  step (s)  x none  paired  act. wait  offloaded/step  device peak  "
          "peak RSS growth  same losses")
    for r in rows:
        print(f"{r['config']:<6} {r['step_s_median']:9.3f}  {r['ratio_vs_none']:5.2f}x"
              f"  {r['paired_ratio_median']:5.2f}x"
              f"  {r.get('activation_wait_s_median', 0):8.3f}s"
              f"  {r.get('offloaded_bytes_per_step', 0) / 2**20:10.1f} MiB"
              f"  {r.get('device_peak_bytes', 0) / 2**20:8.1f} MiB"
              f"  {r['peak_rss_growth_bytes_median'] / 2**20:10.1f} MiB  {r['same_losses_as_none']}")
    out = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": _common.machine_info({"torch": torch.__version__,
                                         "cuda": torch.cuda.is_available(),
                                         "torch_threads": torch.get_num_threads()}),
        "rounds": args.rounds, "steps_per_round": args.steps,
        "model": {"params": n_params, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
                  "vocab": cfg.vocab_size, "batch": args.batch, "seq": args.seq},
        "settings": {"activation_min_bytes": args.min_bytes,
                     "activation_prefetch_bytes": args.window_mib << 20},
        "quick": args.quick, "results": rows,
    }
    _common.write_json(args.out, out)
    plot(rows, f"GPT {cfg.n_layers}x{cfg.d_model}, {args.seq} tokens: activation offload",
         os.path.splitext(args.out)[0] + ".png")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
