#!/usr/bin/env bash
# The one call to make on a lent GPU machine (issue 10): builds the package, runs tests/gpu, runs
# bench_offload_forward.py and bench_optimizer.py on CUDA, and measures the GPU path's figures
# (a model 10x the device_budget with parameters on host and on NVMe against the same model
# resident in GPU memory; prefetch hits on the GPU's timeline; host->device bandwidth from our
# pinned staging against torch's own pinned copy). Everything lands in one folder:
#
#   summary.txt              the figures against the issue's targets, test counts, stage status
#   gpu_figures.json         the measurements behind summary.txt
#   tests_gpu.log            pytest tests/gpu -v
#   bench_offload_forward.json/.png, bench_optimizer.json, bench.log   the two benchmarks
#   ladder/                  infinity bench at 125M: bench.json/.parquet/.png, runs.jsonl
#   build_env.log            machine, driver, torch, memlock limit, build output
#   llama8b/llama.json       Llama-3.1-8B config on one GPU vs resident (bench_gpu_llama.py)
#
# Usage (about 7-10 minutes; each stage has its own time limit, total under 13 minutes):
#   bash benchmarks/gpu_check.sh [OUT_DIR]      OUT_DIR: default $OUT, else benchmarks/results/gpu
# Runs with the `python3` on PATH (it must hold a CUDA build of torch); needs no network.
# GPU_CHECK_SKIP="figures bench_optimizer" skips those stages (a rerun of the others).
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DEST=${1:-${OUT:-$ROOT/benchmarks/results/gpu}}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
SWAP=$(mktemp -d "${TMPDIR:-/tmp}/infinity-gpu-check-XXXXXX")
trap 'rm -rf "$SWAP"' EXIT
unset INFINITY_DEVICE                  # the benchmarks leave device unset: CUDA
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
STATUS=$DEST/.status
: > "$STATUS"
T_START=$(date +%s)

stage() {  # stage NAME SECONDS LOG CMD...: runs CMD with a time limit, records its status
  local name=$1 limit=$2 log=$3; shift 3
  case " ${GPU_CHECK_SKIP:-} " in *" $name "*) echo "$name skipped" >>"$STATUS"; return 0;; esac
  local t0=$(date +%s)
  echo "== $name (limit ${limit}s)" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - t0 ))" | tee -a "$STATUS"
  return 0
}

# ---- environment and build ------------------------------------------------------------------
ENV_LOG=$DEST/build_env.log
: > "$ENV_LOG"
{
  date -u; uname -a; nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1
  echo "python: $(command -v "$PY")"; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  echo "RLIMIT_MEMLOCK before: soft $(ulimit -S -l) hard $(ulimit -H -l)"
} >>"$ENV_LOG" 2>&1
# cudaHostRegister'ed memory: the engine checks RLIMIT_MEMLOCK before pinning. Lift the soft
# limit where allowed; where it cannot be lifted, record that and skip the check (the NVIDIA
# driver pins with pin_user_pages and does not charge this limit).
if ! ulimit -S -l unlimited 2>/dev/null; then
  ulimit -S -l "$(ulimit -H -l)" 2>/dev/null
  if [ "$(ulimit -S -l)" != unlimited ]; then
    export INFINITY_IGNORE_MEMLOCK=1
    echo "RLIMIT_MEMLOCK stays $(ulimit -S -l) KiB: INFINITY_IGNORE_MEMLOCK=1 for this run" >>"$ENV_LOG"
  fi
fi
echo "RLIMIT_MEMLOCK now: $(ulimit -S -l)" >>"$ENV_LOG"
# (if the native library cannot be built, everything runs on the pure-PyTorch fallbacks,
# which the next line records)
stage build 80 "$ENV_LOG" "$PY" -m pip install --no-deps --no-build-isolation -e .
"$PY" -c "import infinity._native as n; print('native library:', n.available())" >>"$ENV_LOG" 2>&1

# ---- the most important figure first: a real 8B on one GPU (parameters on host, 8-bit states,
# a 24 GB card modelled by device_budget) against the same model resident, tokens/s ---------
stage llama8b 300 "$DEST/bench.log" "$PY" benchmarks/bench_gpu_llama.py "$DEST/llama8b"

# ---- tests/gpu --------------------------------------------------------------------------------
stage tests_gpu 140 "$DEST/tests_gpu.log" "$PY" -m pytest tests/gpu -v -rA -p no:cacheprovider

# ---- the issue's figures, then the two benchmarks --------------------------------------------
DRIVER=$SWAP/gpu_check_driver.py
cat >"$DRIVER" <<'PYEOF'
"""gpu_check.sh's measurements (written out by the script; see there)."""
import copy, json, os, statistics, sys, time, types

import torch

import infinity
from infinity.io import FileHandle, aligned_empty
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.runtime import engine_of
from infinity.tiers.pinned import upload

DEV = torch.device("cuda")


def sync_time():
    torch.cuda.synchronize()
    return time.perf_counter()


def h2d_bandwidth(nbytes=1 << 30, reps=5):
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)

    def rate(src, copy=lambda d, s: d.copy_(s, non_blocking=True)):
        for _ in range(2):
            copy(dst, src)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            copy(dst, src)
        end.record()
        end.synchronize()
        return reps * nbytes / (start.elapsed_time(end) / 1e3)

    out = {"bytes": nbytes}
    torch_pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out["torch_pinned_GBps"] = rate(torch_pinned) / 1e9
    del torch_pinned
    ours = aligned_empty(nbytes, pin=True, what="bandwidth probe")
    assert ours.is_pinned()
    out["ours_pinned_GBps"] = rate(ours) / 1e9
    out["fraction_of_torch"] = out["ours_pinned_GBps"] / out["torch_pinned_GBps"]
    f32 = ours.view(torch.float32)
    bf = torch.empty(f32.numel(), dtype=torch.bfloat16, device=DEV)
    out["ours_fp32_to_bf16_cast_upload_GBps_of_fp32"] = rate(
        f32, lambda d, s: upload(bf, s, True)) / 1e9
    del ours, f32
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    out["pageable_GBps"] = rate(pageable) / 1e9
    return out


def nvme_bandwidth(swap, nbytes=1 << 30, files=2):
    buf = aligned_empty(nbytes)
    buf.fill_(7)
    t0 = time.perf_counter()
    for i in range(files):
        with FileHandle(os.path.join(swap, f"bw{i}.bin"), "w+") as f:
            f.pwrite(buf).wait()
            f.fsync()
    write = files * nbytes / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(files):
        with FileHandle(os.path.join(swap, f"bw{i}.bin"), "r") as f:
            f.pread(buf).wait()
    read = files * nbytes / (time.perf_counter() - t0)
    for i in range(files):
        os.remove(os.path.join(swap, f"bw{i}.bin"))
    return {"read_GBps": read / 1e9, "write_GBps": write / 1e9}


def figures(dest, swap):
    cfg = GPTConfig(vocab_size=8192, d_model=1536, n_layers=40, n_heads=12, max_seq=512)
    batch, seq, steps = 8, 512, 3
    x, y = synthetic_batch(cfg, batch, seq, torch.Generator().manual_seed(1))
    x, y = x.to(DEV), y.to(DEV)
    torch.manual_seed(0)
    base = TinyGPT(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    budget = model_bytes // 10
    out = {"model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "vocab": cfg.vocab_size,
                     "batch": batch, "seq": seq, "params": model_bytes // 4,
                     "bytes": model_bytes, "device_budget": budget, "steps": steps}}

    def save():  # after every section: a stage cut short still leaves what it measured
        with open(os.path.join(dest, "gpu_figures.json"), "w") as fh:
            json.dump(out, fh, indent=2)

    out["h2d"] = h2d_bandwidth()
    save()

    def run(model, engine):
        times = []
        for i in range(steps + 1):  # step 0: warm-up (and the schedule is recorded)
            if i == 1 and engine is not None:
                torch.cuda.synchronize()
                engine.transfers.settle_waits()
                infinity.stats(model, reset=True)
            t0 = sync_time()
            (engine.zero_grad() if engine is not None else model.zero_grad(set_to_none=True))
            lm_loss(model(x), y).backward()
            t = sync_time() - t0
            if i:
                times.append(t)
        return times

    ref = copy.deepcopy(base).to(DEV)
    times = run(ref, None)
    out["resident"] = {"step_s_median": statistics.median(times), "step_s_all": times}
    del ref
    torch.cuda.empty_cache()
    out["nvme_bandwidth"] = nvme_bandwidth(swap)
    save()
    for tier in ("host", "nvme"):
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        infinity.wrap(model, device="cuda", param_tier=tier, nvme_path=swap,
                      device_budget=budget, prefetch_window=2)
        wrap_s = time.perf_counter() - t0
        engine = engine_of(model)
        times = run(model, engine)
        torch.cuda.synchronize()
        engine.transfers.settle_waits()
        s = infinity.stats(model)
        row = {"wrap_s": wrap_s, "step_s_median": statistics.median(times), "step_s_all": times,
               "ratio_vs_resident": statistics.median(times) / out["resident"]["step_s_median"],
               "prefetch_hits": s["prefetch_hits"], "prefetch_misses": s["prefetch_misses"],
               "prefetch_hit_rate": s["prefetch_hit_rate"],
               "on_demand_fetches": s["on_demand_fetches"], "stall_s_total": s["stall_seconds"],
               "moved_per_step": {k: v / steps for k, v in s["moved"].items()},
               "device_peak": s["tiers"]["device"]["peak"], "host": s["tiers"]["host"]}
        if tier == "nvme":
            bw = out["nvme_bandwidth"]
            m = row["moved_per_step"]
            nvme_s = (m["nvme_to_host"] / (bw["read_GBps"] * 1e9)
                      + m["host_to_nvme"] / (bw["write_GBps"] * 1e9))
            row["nvme_time_of_its_bytes_s"] = nvme_s
            row["bound_s"] = max(out["resident"]["step_s_median"], nvme_s)
            row["ratio_vs_bound"] = row["step_s_median"] / row["bound_s"]
        out[tier] = row
        save()
        infinity.unwrap(model)
        del model
        torch.cuda.empty_cache()
    print(json.dumps(out, indent=2))


def forward_bench(dest, swap):
    """benchmarks/bench_offload_forward.py on CUDA (--device cuda: its plain models and inputs
    on the GPU, its clock synchronizing the device), each configuration in its own process."""
    sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
    import bench_offload_forward as bench
    return bench.main(["--steps", "3", "--device", str(DEV), "--nvme-path", swap,
                       "--out", os.path.join(dest, "bench_offload_forward.json")])


def summary(dest):
    lines = []
    status = open(os.path.join(dest, ".status")).read().split("\n")
    lines.append("stages: " + "; ".join(s for s in status if s))
    log = os.path.join(dest, "tests_gpu.log")
    if os.path.exists(log):
        tail = [l for l in open(log).read().splitlines() if " passed" in l or " failed" in l
                or " error" in l]
        lines.append("tests/gpu: " + (tail[-1].strip("= ") if tail else "no result line"))
        lines += ["  " + l for l in open(log).read().splitlines() if l.startswith("FAILED")
                  or l.startswith("ERROR")]
    path = os.path.join(dest, "gpu_figures.json")
    if os.path.exists(path):
        f = json.load(open(path))
        m = f["model"]
        res = f.get("resident", {}).get("step_s_median", float("nan"))
        lines.append(f"model: {m['params'] / 1e6:.0f}M params fp32 ({m['bytes'] / 1e9:.2f} GB), "
                     f"device_budget {m['device_budget'] / 1e9:.2f} GB (1/10), batch {m['batch']}"
                     f" x seq {m['seq']}; resident fwd+bwd {res:.3f}s")
        for tier in ("host", "nvme"):
            if tier not in f:
                continue
            r = f[tier]
            if tier == "host":
                verdict = "OK" if r["ratio_vs_resident"] <= 1.10 else "MISSED"
                lines.append(f"host: {r['step_s_median']:.3f}s = {r['ratio_vs_resident']:.3f}x "
                             f"resident (target <= 1.10: {verdict})")
            else:
                verdict = "OK" if r["ratio_vs_bound"] <= 1.10 else "MISSED"
                lines.append(f"nvme: {r['step_s_median']:.3f}s = {r['ratio_vs_bound']:.3f}x "
                             f"max(resident, NVMe time of its bytes {r['nvme_time_of_its_bytes_s']:.3f}s)"
                             f" (target <= 1.10: {verdict})")
            bound_by_disk = tier == "nvme" and r["nvme_time_of_its_bytes_s"] > res
            hit_ok = ("n/a: the disk, not compute, bounds this step" if bound_by_disk else
                      "OK" if r["prefetch_hit_rate"] >= 0.95 else "MISSED")
            lines.append(f"  prefetch hits {r['prefetch_hit_rate']:.1%} ({r['prefetch_hits']}/"
                         f"{r['prefetch_hits'] + r['prefetch_misses']}, compute stream not waiting;"
                         f" target >= 95%: {hit_ok}); device peak {r['device_peak'] / 1e9:.2f} GB")
        h = f.get("h2d")
        lines.append("H2D: not measured" if h is None else
                     f"H2D: ours pinned {h['ours_pinned_GBps']:.1f} GB/s = "
                     f"{h['fraction_of_torch']:.2f} of torch pinned {h['torch_pinned_GBps']:.1f} "
                     f"GB/s (pageable {h['pageable_GBps']:.1f}); fp32->bf16 upload "
                     f"{h['ours_fp32_to_bf16_cast_upload_GBps_of_fp32']:.1f} GB/s")
        bw = f.get("nvme_bandwidth")
        lines.append("NVMe: not measured" if bw is None else
                     f"NVMe (swap dir): read {bw['read_GBps']:.2f} GB/s, write "
                     f"{bw['write_GBps']:.2f} GB/s")
    for name in ("bench_offload_forward.json", "bench_optimizer.json"):
        lines.append(f"{name}: {'written' if os.path.exists(os.path.join(dest, name)) else 'MISSING'}")
    text = "\n".join(lines) + "\n"
    open(os.path.join(dest, "summary.txt"), "w").write(text)
    print(text)


if __name__ == "__main__":
    mode, dest = sys.argv[1], sys.argv[2]
    {"figures": lambda: figures(dest, sys.argv[3]),
     "forward_bench": lambda: forward_bench(dest, sys.argv[3]),
     "summary": lambda: summary(dest)}[mode]()
PYEOF

stage figures 150 "$DEST/bench.log" "$PY" "$DRIVER" figures "$DEST" "$SWAP"
stage bench_offload_forward 90 "$DEST/bench.log" "$PY" "$DRIVER" forward_bench "$DEST" "$SWAP"
stage bench_optimizer 40 "$DEST/bench.log" "$PY" benchmarks/bench_optimizer.py --params 200e6 \
  --steps 3 --nvme-path "$SWAP" --json "$DEST/bench_optimizer.json" --no-plot
# the single-GPU `infinity bench` table (issue 12): one rung, one run per placement; each
# finished run is appended to ladder/runs.jsonl at once, so a stage cut short keeps them
stage ladder 240 "$DEST/bench.log" "$PY" -m infinity bench --size 125M --repeats 1 --warmup 1 \
  --steps 3 --nvme-path "$SWAP" --out "$DEST/ladder" --report
echo "total rc=0 seconds=$(( $(date +%s) - T_START ))" >>"$STATUS"
"$PY" "$DRIVER" summary "$DEST"
rm -f "$STATUS"
