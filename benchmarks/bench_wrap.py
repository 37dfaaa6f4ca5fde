"""Peak RSS of ``infinity.wrap`` onto NVMe, as a multiple of the model's fp32 bytes.

    python benchmarks/bench_wrap.py                          # ~1.07B params fp32 (4.3 GB)
    python benchmarks/bench_wrap.py --quick                  # ~20M params, a few seconds
    python benchmarks/bench_wrap.py --old-tree /tmp/oldinf   # also an older checkout's wrap

Cases, each in a fresh subprocess (so one case's heap cannot flatter the next), run round after
round (interleaved) and reported as medians:

* ``materialized``: a TinyGPT built normally (all parameters in RAM), then
  ``infinity.wrap(model, nvme_path=..., param_tier="nvme")``.
* ``meta``: the same model built under ``infinity.empty_init()`` and wrapped with
  ``source=`` a safetensors folder written beforehand by another subprocess (tied
  ``lm_head.weight`` left out, as ``save_pretrained`` does).
* ``materialized_old`` (with ``--old-tree``): the materialized case running an older checkout's
  Python code (put first on sys.path) with this build's native library copied next to it.

In each child: RSS is read from /proc/self/status. ``base`` is VmRSS just before wrap; the
kernel's peak counter is reset right before wrap (``echo 5 > /proc/self/clear_refs``, VmHWM :=
VmRSS) and read as soon as wrap returns. Reported per case, over the model's fp32 bytes
(tied weights counted once): growth = (peak - base), the absolute peak, and VmRSS after wrap
returns (absolute, and "held": minus the RSS of the process before the model was built), and
"pools": the engine's own host buffers after wrap (``infinity.stats(model)["tiers"]["host"]``:
gradient and staging buffers sized from the largest block), which wrap allocates up front.
After the wrap measurement each child (not --old-tree's) runs one forward+backward from NVMe
(batch 1 x 16, ``--no-step`` skips it) and the benchmark prints where its time went
(``infinity.stats(model)["time"]``).
Results: benchmarks/results/bench_wrap.json (+ .png when matplotlib imports).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# a child of the --old-tree case imports infinity from that tree instead of this one
sys.path.insert(0, os.environ.get("BENCH_WRAP_TREE") or ROOT)

import _common  # noqa: E402  (benchmarks/, this script's folder)

logger = logging.getLogger("bench_wrap")

GIB = 1 << 30


def model_config(quick: bool, layers: Optional[int]) -> Dict:
    if quick:  # ~20M parameters
        cfg = dict(vocab_size=8192, d_model=384, n_layers=10, n_heads=6, max_seq=128)
    else:      # ~1.07B parameters, 4.3 GB fp32
        cfg = dict(vocab_size=32000, d_model=2048, n_layers=20, n_heads=16, max_seq=128)
    if layers:
        cfg["n_layers"] = layers
    return cfg


# ---------------------------------------------------------------------------- child process

def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _model_bytes(model) -> int:
    seen = set()
    total = 0
    for p in model.parameters():  # parameters() yields a tied weight once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * 4
    return total


def child_write_source(cfg_kw: Dict, folder: str) -> Dict:
    import torch
    from safetensors.torch import save_file

    from infinity.models import GPTConfig, TinyGPT
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(**cfg_kw))
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, "model.safetensors"))
    return {"bytes": os.path.getsize(os.path.join(folder, "model.safetensors"))}


def child_wrap(case: str, cfg_kw: Dict, nvme: str, source: Optional[str],
               train_step: bool = True) -> Dict:
    import gc

    import torch

    import infinity
    from infinity import _native
    from infinity.models import GPTConfig, TinyGPT
    cfg = GPTConfig(**cfg_kw)
    gc.collect()
    empty = _status("VmRSS")  # the interpreter + torch + infinity, no model yet
    torch.manual_seed(0)
    if case == "meta":
        with infinity.empty_init():
            model = TinyGPT(cfg)
        model_bytes = cfg.approx_params * 4
        kw = dict(source=source)
    else:
        model = TinyGPT(cfg)
        model_bytes = _model_bytes(model)
        kw = {}
    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    t0 = time.perf_counter()
    infinity.wrap(model, nvme_path=nvme, param_tier="nvme", **kw)
    wrap_s = time.perf_counter() - t0
    peak = _status("VmHWM")
    after = _status("VmRSS")
    n_params = sum(p.numel() for p in model.parameters())
    host = infinity.stats(model)["tiers"]["host"]  # the engine's own host buffers (pools)
    step = None
    if train_step:  # then one forward+backward from NVMe: where its time went
        from infinity.models import lm_loss, synthetic_batch
        x, y = synthetic_batch(cfg, 1, 16, torch.Generator().manual_seed(1))
        infinity.stats(model, reset=True)
        t0 = time.perf_counter()
        lm_loss(model(x), y).backward()
        s = infinity.stats(model)
        step = {"s": time.perf_counter() - t0, "time": s["time"],
                "peak_rss": _status("VmHWM"), "prefetch_hit_rate": s["prefetch_hit_rate"]}
    return {"first_step": step,
            "case": case, "infinity_file": infinity.__file__, "native": _native.available(),
            "torch": torch.__version__,
            "params": n_params, "model_bytes": model_bytes, "wrap_s": wrap_s,
            "rss_empty": empty, "base": base, "peak": peak, "after": after,
            "growth_x": (peak - base) / model_bytes, "peak_x": peak / model_bytes,
            "after_x": after / model_bytes, "held_after_x": (after - empty) / model_bytes,
            "engine_host_bytes": host["now"], "engine_host": host,
            "engine_host_x": host["now"] / model_bytes}


def child_main(argv: List[str]) -> int:
    what, cfg_json = argv[0], argv[1]
    cfg_kw = json.loads(cfg_json)
    if what == "write_source":
        out = child_write_source(cfg_kw, argv[2])
    else:
        out = child_wrap(what, cfg_kw, argv[2], argv[3] if len(argv) > 3 else None,
                         train_step="--no-step" not in argv)
    print(json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------- parent process

def run_child(args: List[str], tree: Optional[str] = None, timeout: float = 1800) -> Dict:
    env = dict(os.environ)
    env.pop("BENCH_WRAP_TREE", None)
    if tree:
        env["BENCH_WRAP_TREE"] = tree
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"] + args,
                       capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def summarize(case: str, rows: List[Dict]) -> Dict:
    out = {"case": case, "runs": rows, "params": rows[0]["params"],
           "model_bytes": rows[0]["model_bytes"], "native": rows[0]["native"],
           "infinity_file": rows[0]["infinity_file"]}
    for key in ("growth_x", "peak_x", "after_x", "held_after_x", "engine_host_x", "wrap_s",
                "base", "peak", "after", "rss_empty", "engine_host_bytes"):
        out[key + "_median"] = statistics.median(r[key] for r in rows)
    return out


def print_table(rows: List[Dict]) -> None:
    print(f"{'case':<18} {'growth/model':>12} {'peak/model':>10} {'after/model':>11} "
          f"{'held/model':>10} {'pools/model':>11} {'after GiB':>9} {'wrap s':>7}")
    for r in rows:
        print(f"{r['case']:<18} {r['growth_x_median']:>11.2f}x {r['peak_x_median']:>9.2f}x "
              f"{r['after_x_median']:>10.2f}x {r['held_after_x_median']:>9.2f}x "
              f"{r['engine_host_x_median']:>10.2f}x "
              f"{r['after_median'] / GIB:>9.2f} {r['wrap_s_median']:>7.1f}")


def plot(rows: List[Dict], path: str) -> None:
    plt = _common.pyplot(logger)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["case"] for r in rows]
    y = range(len(rows))
    h = 0.27
    for k, (key, label) in enumerate((("peak_x_median", "absolute peak RSS"),
                                      ("growth_x_median", "peak growth during wrap"),
                                      ("held_after_x_median",
                                       "held after wrap (RSS - empty process)"))):
        ax.barh([i + (1 - k) * h for i in y], [r[key] for r in rows], h, label=label)
    ax.set_yticks(list(y), names)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("x model fp32 bytes")
    ax.set_title(f"infinity.wrap onto NVMe, {rows[0]['params'] / 1e9:.2f}B params "
                 f"({rows[0]['model_bytes'] / 1e9:.2f} GB)", fontsize=9)
    ax.legend(fontsize=8)
    _common.save_figure(fig, path)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~20M params, a few seconds")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument("--repeats", type=int, default=None,
                    help="rounds over the cases (default 3, --quick 1)")
    ap.add_argument("--old-tree", default=None,
                    help="a checkout of an older infinity (with a native library in "
                         "infinity/_native) to measure too, as case materialized_old")
    ap.add_argument("--no-meta", action="store_true", help="skip the meta/source= case")
    ap.add_argument("--nvme-path", default=None, help="directory for the swap and source "
                    "folders (default: a temporary directory under /tmp)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_wrap.json"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-step", action="store_true",
                    help="skip the forward+backward after wrap (its time attribution)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    repeats = args.repeats or (1 if args.quick else 3)
    cfg_kw = model_config(args.quick, args.layers)
    cases = [("materialized", None)]
    if args.old_tree:
        cases.append(("materialized_old", os.path.abspath(args.old_tree)))
    if not args.no_meta:
        cases.append(("meta", None))
    per_case: Dict[str, List[Dict]] = {c: [] for c, _ in cases}
    work = tempfile.mkdtemp(prefix="bench-wrap-", dir=args.nvme_path or "/tmp")
    try:
        source = os.path.join(work, "source")
        if not args.no_meta:
            t0 = time.perf_counter()
            src = run_child(["write_source", json.dumps(cfg_kw), source])
            logger.info("source written: %.2f GB in %.1f s", src["bytes"] / 1e9,
                        time.perf_counter() - t0)
        for r in range(repeats):
            for case, tree in cases:
                swap = tempfile.mkdtemp(prefix="swap-", dir=work)
                kind = "materialized" if case.startswith("materialized") else case
                row = run_child([kind, json.dumps(cfg_kw), swap, source]
                                + (["--no-step"] if args.no_step or tree else []), tree=tree)
                shutil.rmtree(swap, ignore_errors=True)
                row["case"] = case
                per_case[case].append(row)
                logger.info("round %d %-17s growth %.2fx peak %.2fx after %.2f GiB (%.1f s)",
                            r, case, row["growth_x"], row["peak_x"], row["after"] / GIB,
                            row["wrap_s"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [summarize(c, per_case[c]) for c, _ in cases]
    print_table(rows)
    steps = [(c, r["first_step"]) for c, _ in cases for r in per_case[c][-1:]
             if r.get("first_step")]
    if steps:
        print("\nfirst forward+backward after wrap (last round), time attribution (s):")
        for case, st in steps:
            t = st["time"]
            print(f"{case:<18} {st['s']:6.2f} s: " + " ".join(
                f"{k} {v:.2f}" for k, v in t.items() if not isinstance(v, dict)))
    result = {"date": datetime.date.today().isoformat(),
              "command": " ".join(["python", "benchmarks/bench_wrap.py"] + argv),
              "config": cfg_kw, "repeats": repeats, **_common.machine_info(),
              "torch": rows[0]["runs"][0]["torch"], "rows": rows}
    _common.write_json(args.out, result)
    if not args.no_plot:
        plot(rows, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
