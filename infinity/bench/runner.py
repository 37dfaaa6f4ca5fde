"""``infinity bench``: the GPT ladder x placements (+ the planner's), each run in its own
process, next to the estimate's prediction for it; results to JSON, Parquet and a PNG."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from tqdm.auto import tqdm

from ..plan.estimate import calibrated_compute, estimate_one
from ..plan.placements import PLACEMENTS
from ..plan.placements import placement as get_placement
from ..plan.planner import PlanError, _fits, budgets, plan
from ..plan.probe import ProbeResult
from ..plan.probe import probe as run_probe
from ..plan.shape import shape_of
from ..policy import OffloadPolicy
from .models import config_for

logger = logging.getLogger(__name__)

FIXED = tuple(p.name for p in PLACEMENTS)
MARKER = "INFINITY_BENCH_RESULT "
STATES = ("fp32", "bf16", "8bit")


@dataclass
class BenchConfig:
    sizes: Sequence[str]
    placements: Sequence[str] = FIXED
    planner: bool = True
    batch: int = 2
    seq: int = 128
    steps: int = 4
    warmup: int = 2
    repeats: int = 2
    states: Optional[str] = None  # optimizer states of every infinity placement (None: own)
    nvme_path: Optional[str] = None
    ram_budget: Optional[int] = None
    timeout_s: float = 1800.0
    quick_probe: bool = False
    calibrate: bool = True  # compute timed at each rung's shape before the runs
    calibrate_in_run: bool = False  # also time it inside each run (a diagnostic column)
    extra_env: Dict[str, str] = field(default_factory=dict)
    # a JSON-lines file each finished run is appended to at once (spec + result), so a ladder
    # cut short (a time limit, Ctrl-C) keeps the runs it finished
    runs_log: Optional[str] = None


def _shape(size: str, seq: int):
    import infinity

    from ..models import TinyGPT

    with infinity.empty_init():
        model = TinyGPT(config_for(size, seq))
    return shape_of(model)


def _run_worker(spec: Dict[str, Any], timeout: float, env: Dict[str, str]) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "infinity.bench.worker", json.dumps(spec)]
    full_env = {**os.environ, "TQDM_DISABLE": "1", **env}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"ok": False, "error": f"worker exited with {proc.returncode}: {' | '.join(tail)}"}


def run_bench(cfg: BenchConfig, probe: Optional[ProbeResult] = None, write=None) -> Dict[str, Any]:
    """Runs the ladder; returns {"machine": ..., "rows": [...]} (one row per size x
    placement: the median of every measured step of its ``repeats`` runs). The prediction is
    made before any run, from the probe and one layer timed at the rung's shape."""
    if cfg.states is not None and cfg.states not in STATES:
        raise ValueError(f"--states must be one of {', '.join(STATES)}, got {cfg.states!r}")
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.repeats < 1:
        raise ValueError(
            f"steps >= 1, warmup >= 0 and repeats >= 1 are needed, got "
            f"{cfg.steps}, {cfg.warmup}, {cfg.repeats}"
        )
    load_start = list(os.getloadavg())
    pr = probe or run_probe(cfg.nvme_path, quick=cfg.quick_probe, announce="infinity bench")
    policy = OffloadPolicy(nvme_path=cfg.nvme_path, host_budget=cfg.ram_budget)
    b = budgets(policy, pr)
    cuda = pr.device == "cuda"
    rows: List[Dict[str, Any]] = []
    jobs = []
    job_models = []
    compute_by_size: Dict[str, Optional[float]] = {}
    for size in cfg.sizes:
        shape = _shape(size, cfg.seq)
        compute_s = calibrated_compute(shape, cfg.batch, cfg.seq, reps=5) if cfg.calibrate else None
        compute_by_size[size] = compute_s
        names = list(cfg.placements) + (["planner"] if cfg.planner else [])
        for name in names:
            row: Dict[str, Any] = {
                "size": size,
                "params": shape.params,
                "placement": name,
                "d_model": shape.d_model,
                "n_layers": shape.n_layers,
                "batch": cfg.batch,
                "seq": cfg.seq,
                "ok": False,
                "skipped": None,
                "pred_compute_timed": compute_s is not None,
            }
            if name == "planner":
                try:
                    p = plan(
                        shape,
                        policy,
                        probe=pr,
                        batch=cfg.batch,
                        seq=cfg.seq,
                        states=cfg.states or "fp32",
                    )
                except PlanError as exc:
                    row["skipped"] = f"planner: {exc}"
                    rows.append(row)
                    continue
                pl = get_placement(p.placement)
                row["planned"] = p.placement
                window = p.prefetch_window
            else:
                pl = get_placement(name)
                window = 2
            if cfg.states and not pl.plain and pl.states != cfg.states:
                if name != "planner" and pl.states != "fp32":
                    row["skipped"] = (
                        f"the tiers of another placement with --states {cfg.states}: not run twice"
                    )
                    rows.append(row)
                    continue
                pl = dataclasses.replace(pl, states=cfg.states)
            row["states"] = "torch" if pl.plain else pl.states
            if pl.uses_nvme and pr.disk is None:
                row["skipped"] = "needs --nvme-path"
                rows.append(row)
                continue
            e = estimate_one(
                shape,
                pl,
                pr,
                batch=cfg.batch,
                seq=cfg.seq,
                compute_s=compute_s,
                prefetch_window=window,
            )
            row.update(
                {
                    "pred_step_s": e.step_s,
                    "pred_compute_s": e.compute_s,
                    "pred_fetch_s": e.fetch_s,
                    "pred_grad_offload_s": e.grad_offload_s,
                    "pred_optimizer_s": e.optimizer_s,
                    "pred_engine_s": e.engine_s,
                    "pred_nvme_bytes_per_step": e.nvme_written_per_step,
                    "pred_host_bytes": e.host_bytes,
                    "pred_device_bytes": e.device_bytes,
                    "pred_nvme_bytes": e.nvme_bytes,
                }
            )
            why = _fits(e, pl, b, cuda) if name != "planner" else ""
            if why:
                row["skipped"] = f"does not fit: {why}"
                rows.append(row)
                continue
            rows.append(row)
            jobs.append(row)
            job_models.append((shape, pl, window))
    if importlib.util.find_spec("deepspeed") is None:
        rows.append(
            {
                "size": "*",
                "placement": "deepspeed",
                "ok": False,
                "skipped": "DeepSpeed is not installed (pip install deepspeed)",
            }
        )
    else:
        rows.append(
            {
                "size": "*",
                "placement": "deepspeed",
                "ok": False,
                "skipped": "DeepSpeed ZeRO-Infinity comparison is not built yet",
            }
        )
    results: Dict[int, List[Dict[str, Any]]] = {id(r): [] for r in jobs}
    models = {id(r): m for r, m in zip(jobs, job_models)}
    env = dict(cfg.extra_env)
    with tqdm(total=len(jobs) * cfg.repeats, desc="infinity bench", unit="run") as bar:
        for rep in range(cfg.repeats):
            for row in jobs:
                bar.set_postfix_str(f"{row['size']} {row['placement']}")
                spec = {
                    "size": row["size"],
                    "placement": row["placement"],
                    "batch": cfg.batch,
                    "seq": cfg.seq,
                    "steps": cfg.steps,
                    "warmup": cfg.warmup,
                    "nvme_path": cfg.nvme_path,
                    "host_budget": cfg.ram_budget,
                    "states": cfg.states,
                    "calibrate_in_run": cfg.calibrate_in_run,
                }
                results[id(row)].append(_run_worker(spec, cfg.timeout_s, env))
                if cfg.runs_log:
                    _append_run(cfg.runs_log, spec, rep, results[id(row)][-1])
                bar.update(1)
    for row in jobs:
        runs = results[id(row)]
        good = [r for r in runs if r.get("ok")]
        if not good:
            row["error"] = runs[-1].get("error") if runs else "not run"
            continue
        row["ok"] = True
        row["repeats"] = len(good)
        # every measured step of every run (warm-up excluded), pooled: the median is the figure
        row["step_times_s"] = [r.get("step_s_all", [r["step_s"]]) for r in good]
        row["warmup_times_s"] = [r.get("warmup_s_all", []) for r in good]
        med = statistics.median(t for ts in row["step_times_s"] for t in ts)
        row["step_s"] = med
        row["step_s_runs"] = [r["step_s"] for r in good]
        row["tokens_per_s"] = cfg.batch * cfg.seq / med
        row["loadavg"] = [[r.get("loadavg_start"), r.get("loadavg_end")] for r in good]
        in_run = [r["compute_in_run_s"] for r in good if "compute_in_run_s" in r]
        if in_run:  # a diagnostic: not used by the prediction
            row["compute_in_run_s"] = statistics.median(in_run)
        planned = good[0].get("planned")
        if row["placement"] == "planner" and planned and planned != row.get("planned"):
            # the run's own plan differs from the one predicted: predict what ran
            shape, pl, window = models[id(row)]
            pl = get_placement(planned)
            if cfg.states and not pl.plain:
                pl = dataclasses.replace(pl, states=cfg.states)
            row["pred_step_s_start"] = row["pred_step_s"]
            e = estimate_one(
                shape,
                pl,
                pr,
                batch=cfg.batch,
                seq=cfg.seq,
                compute_s=compute_by_size.get(row["size"]),
                prefetch_window=window,
            )
            row.update(
                {
                    "pred_step_s": e.step_s,
                    "pred_compute_s": e.compute_s,
                    "pred_fetch_s": e.fetch_s,
                    "pred_grad_offload_s": e.grad_offload_s,
                    "pred_optimizer_s": e.optimizer_s,
                    "pred_engine_s": e.engine_s,
                }
            )
        row["pred_error"] = row["pred_step_s"] / med - 1.0
        for key in (
            "peak_rss_bytes",
            "rss_start_bytes",
            "peak_device_bytes",
            "nvme_bytes_per_step",
            "host_peak_bytes",
            "nvme_disk_bytes",
            "build_s",
            "loss_first",
            "loss_last",
        ):
            vals = [r.get(key) for r in good if r.get(key) is not None]
            if not vals:
                row[key] = None
            else:
                row[key] = max(vals) if key.startswith("peak") else statistics.median(vals)
        att = [r["attribution"] for r in good if "attribution" in r]
        for k in att[0] if att else {}:
            row[f"{k}_s"] = statistics.median(a[k] for a in att)
        if row["placement"] == "planner":
            row["tiers"] = good[0].get("tiers")
            row["planned"] = good[0].get("planned", row.get("planned"))
    return {
        "machine": {
            "identity": pr.identity,
            "probe": pr.to_json(),
            "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg()),
        },
        "config": {k: v for k, v in cfg.__dict__.items() if k != "extra_env"},
        "rows": rows,
        "time": time.time(),
    }


def _append_run(path: str, spec: Dict[str, Any], rep: int, result: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({"spec": spec, "repeat": rep, "result": result}, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def save(result: Dict[str, Any], out_dir: str) -> List[str]:
    """bench.json, bench.parquet (pyarrow) and bench.png (matplotlib) under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    path = os.path.join(out_dir, "bench.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    written.append(path)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = sorted({k for r in result["rows"] for k in r})
        table = pa.Table.from_pylist(
            [
                {
                    k: (json.dumps(r[k]) if isinstance(r.get(k), (dict, list)) else r.get(k))
                    for k in cols
                }
                for r in result["rows"]
            ]
        )
        path = os.path.join(out_dir, "bench.parquet")
        pq.write_table(table, path)
        written.append(path)
    except ImportError:
        logger.warning(
            "infinity bench: pyarrow not installed (pip install "
            "'infinity-offload[bench]'); no Parquet file"
        )
    png = _plot(result, os.path.join(out_dir, "bench.png"))
    if png:
        written.append(png)
    return written


def _plot(result: Dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in result["rows"] if r.get("ok")]
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in sorted({r["placement"] for r in rows}):
        pts = sorted(
            (r["params"], r["tokens_per_s"], r["pred_step_s"], r["step_s"])
            for r in rows
            if r["placement"] == name
        )
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax2.scatter([p[3] for p in pts], [p[2] for p in pts], label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("parameters")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("throughput per placement")
    ax1.legend(fontsize=7)
    lim = max(max(r["step_s"], r["pred_step_s"]) for r in rows) * 1.1
    ax2.plot([0, lim], [0, lim], "k--", lw=0.8)
    ax2.fill_between([0, lim], [0, 0.7 * lim], [0, 1.3 * lim], color="0.9")
    ax2.set_xlabel("measured step (s)")
    ax2.set_ylabel("predicted step (s)")
    ax2.set_title("prediction vs measurement (band: +-30%)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def report(result: Dict[str, Any]) -> str:
    """A Markdown summary to paste into an issue."""
    ident = result["machine"]["identity"]
    pr = result["machine"]["probe"]
    c = result["config"]
    disk = pr.get("disk") or {}
    lines = [
        f"### infinity bench ({time.strftime('%Y-%m-%d %H:%M', time.gmtime(result['time']))} UTC)",
        f"Machine: {ident['cpu']}, {ident['cpus']} CPUs, {ident['ram_bytes'] / (1 << 30):.1f} GiB "
        f"RAM, GPU: {ident['gpu'] or 'none'}; torch {ident['torch']}. Probe: memory "
        f"{pr['mem_bps'] / 1e9:.1f} GB/s, CPU Adam {pr['adam_params_per_s'] / 1e6:.0f} "
        f"Mparams/s"
        + (
            f", disk read/write {disk['read_bps'] / 1e9:.2f}/"
            f"{disk['write_bps'] / 1e9:.2f} GB/s (O_DIRECT "
            f"{'yes' if disk['direct'] else 'no'})"
            if disk
            else ""
        ),
        f"Batch {c['batch']} x seq {c['seq']}, {c['steps']} measured steps after "
        f"{c['warmup']} warm-up in each of {c['repeats']} run(s), each run its own process; "
        f"step s = median of all measured steps; optimizer states "
        f"{c.get('states') or 'the placement own'}"
        + (f"; RAM budget {_gib(c['ram_budget'])} GiB" if c.get("ram_budget") else "")
        + _load_line(result),
        "",
        "| size | placement | tokens/s | step s | predicted s | error | compute | fetch wait | "
        "grad offload | engine | optimizer | peak RSS GiB | NVMe written/step GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v: Optional[float], fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in result["rows"]:
        if not r.get("ok"):
            continue
        name = r["placement"] + (f" -> {r['planned']}" if r.get("planned") else "")
        lines.append(
            f"| {r['size']} | {name} | {r['tokens_per_s']:,.0f} | {r['step_s']:.2f} | "
            f"{r['pred_step_s']:.2f} | {100 * r['pred_error']:+.0f}% | {f(r.get('compute_s'))} | "
            f"{f(r.get('fetch_wait_s'))} | {f(r.get('grad_offload_s'))} | "
            f"{f(r.get('engine_s'))} | "
            f"{f(r.get('optimizer_s'))} | {_gib(r.get('peak_rss_bytes'))} | "
            f"{_gib(r.get('nvme_bytes_per_step'))} |"
        )
    ok = [r for r in result["rows"] if r.get("ok")]
    if ok:
        within = [r for r in ok if abs(r["pred_error"]) <= 0.30]
        lines += [
            "",
            f"Predicted within 30% of measured: {len(within)} of {len(ok)} cells; "
            f"median |error| {100 * statistics.median(abs(r['pred_error']) for r in ok):.0f}%"
            " (predicted = compute, engine, gradient, fetch, optimizer terms "
            "from the probe and one layer timed at the rung's shape, before the runs)",
        ]
    skipped = [r for r in result["rows"] if not r.get("ok")]
    if skipped:
        lines.append("")
        for r in skipped:
            lines.append(
                f"- {r['size']} {r['placement']}: "
                f"{r.get('skipped') or 'failed: ' + str(r.get('error'))}"
            )
    verdicts = planner_verdicts(result)
    if verdicts:
        lines.append("")
        lines += [f"- {v}" for v in verdicts]
    return "\n".join(lines) + "\n"


def _load_line(result: Dict[str, Any]) -> str:
    m = result["machine"]
    loads = [
        x
        for r in result["rows"]
        for pair in (r.get("loadavg") or [])
        for x in pair
        if x is not None
    ]
    if not loads:
        return ""
    return (
        f". Load average (1 min) over the runs: {min(loads):.1f}-{max(loads):.1f}, median "
        f"{statistics.median(loads):.1f}"
        + (f" (at the start {m['loadavg_start'][0]:.1f})" if m.get("loadavg_start") else "")
    )


def planner_verdicts(result: Dict[str, Any]) -> List[str]:
    out = []
    by_size: Dict[str, List[Dict[str, Any]]] = {}
    for r in result["rows"]:
        if r.get("ok"):
            by_size.setdefault(r["size"], []).append(r)
    for size, rs in by_size.items():
        pl = next((r for r in rs if r["placement"] == "planner"), None)
        fixed = [r for r in rs if r["placement"] not in ("planner", "device")]
        if pl is None or not fixed:
            continue
        best = min(fixed, key=lambda r: r["step_s"])
        slower = [r["placement"] for r in fixed if r["step_s"] < pl["step_s"]]
        ratio = pl["step_s"] / best["step_s"]
        # how far two runs of one configuration differ here: a gap below it is not resolved
        spreads = [
            max(r["step_s_runs"]) / min(r["step_s_runs"]) - 1
            for r in rs
            if len(r.get("step_s_runs") or []) > 1
        ]
        spread = max(spreads, default=0.0)
        line = (
            f"{size}: planner chose {pl.get('planned')} ({pl['step_s']:.2f} s/step); "
            f"fastest fixed placement {best['placement']} ({best['step_s']:.2f} s); "
        )
        if not slower:
            line += "planner at least as fast as every fixed placement"
        else:
            line += (
                f"faster than the planner's run: {', '.join(slower)} (ratio planner/best "
                f"{ratio:.2f}"
            )
            line += (
                f", within the {spread:.0%} between two runs of one configuration here: "
                "not resolved)"
                if ratio - 1 <= spread
                else ")"
            )
        same = next((r for r in fixed if r["placement"] == pl.get("planned")), None)
        if same is not None:
            line += (
                f"; the planner's tiers are fixed {same['placement']}'s "
                f"({same['step_s']:.2f} s/step)"
            )
        out.append(line)
    return out
