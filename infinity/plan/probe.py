"""``infinity.probe()``: measures what the planner and the estimates need, once per machine.

Design notes: docs/modules.md, plan/probe.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from tqdm.auto import tqdm

from ..policy import nvme_path_problem
from .machine import disk_identity, key_of, machine_identity

logger = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: engine overhead, torch AdamW rate
# (d_model, batch, seq) of the GPT layers timed for the compute rate
FULL_SHAPES = ((128, 4, 128), (256, 4, 128), (512, 4, 128), (1024, 4, 128), (2048, 2, 128))
QUICK_SHAPES = ((64, 2, 64), (128, 2, 64))
Tick = Callable[[], None]


@dataclass(frozen=True)
class ProbeSettings:
    """What a probe measures, with how much data, and how long its compute timing may take.

    ``fp32_budget_s``, ``bf16_budget_s``: seconds the GPT-layer timing in that dtype may take;
    the widths are timed from the narrowest up, and a width whose projected time (its FLOPs at
    the rate just measured, for its warm-up and timed calls, x 1.6) would run past the budget is
    left out, with the wider ones (:attr:`ProbeResult.cut_short` says which, and why). None: every
    width, however long. ``long_call_s``: a layer whose warm-up call took this long is timed
    once more rather than ``compute_reps`` times. ``short_call_s``: a layer whose warm-up took
    less than this is timed over about that many seconds (up to 8 calls; a median of two
    20 ms calls on a loaded machine is mostly noise). ``overlap_bytes``: the disk transfer of
    :func:`measure_compute_overlap` (None: not measured).
    ``overlap_reps``: the timed calls of each phase of :func:`measure_compute_overlap`, the
    disk phase alone warmed up (None: ``disk_reps``, each phase warmed up)."""

    quick: bool
    shapes: Tuple[Tuple[int, int, int], ...]
    mem_bytes: int
    adam_numel: int
    torch_adam_numel: int
    transfer_bytes: int
    disk_bytes: int
    disk_reps: int
    overlap_bytes: Optional[int]
    overhead: bool  # measure_engine_overhead
    fp32_budget_s: Optional[float]
    bf16_budget_s: Optional[float]
    compute_reps: int = 2
    long_call_s: float = float("inf")
    short_call_s: float = 0.0
    overlap_reps: Optional[int] = None  # measure_disk's


FULL = ProbeSettings(
    quick=False,
    shapes=FULL_SHAPES,
    mem_bytes=512 << 20,
    adam_numel=16 << 20,
    torch_adam_numel=16 << 20,
    transfer_bytes=512 << 20,
    disk_bytes=1 << 30,
    disk_reps=3,
    # on all of the 1 GiB: with 256 MiB the share hidden came out 0.03-0.26 against 0.30-1.0
    # with 1 GiB, in the same rounds
    overlap_bytes=1 << 30,
    overhead=True,
    fp32_budget_s=20.0,
    bf16_budget_s=20.0,
    long_call_s=2.0,
    short_call_s=0.3,
    overlap_reps=2,
)
# every width of every dtype, each timed ``compute_reps`` times after a warm-up, the compute
# overlap's phases each warmed up and timed three times: the full probe before the budgets
# (8 to 10 minutes on a 2-core AVX2 CPU, most of it bf16 layers at 0.6-3 GFLOP/s)
THOROUGH = replace(
    FULL,
    fp32_budget_s=None,
    bf16_budget_s=None,
    long_call_s=float("inf"),
    short_call_s=0.0,
    overlap_reps=None,
)
QUICK = ProbeSettings(
    quick=True,
    shapes=QUICK_SHAPES,
    mem_bytes=32 << 20,
    adam_numel=1 << 20,
    torch_adam_numel=1 << 18,
    transfer_bytes=64 << 20,
    disk_bytes=32 << 20,
    disk_reps=2,
    overlap_bytes=None,
    overhead=False,
    fp32_budget_s=None,  # two narrow layers: a second or two, even in a slow bf16
    bf16_budget_s=None,
)


class ProbeError(RuntimeError):
    """A measurement could not be made (e.g. the swap directory does not exist)."""


@dataclass(frozen=True)
class DiskProbe:
    path: str
    identity: Dict[str, Any]
    direct: bool
    read_bps: float
    write_bps: float
    free_bytes: int
    test_bytes: int
    # layout -> {"block_s", "step_s"}: the engine's fixed costs with this disk (nvme, optim_nvme)
    overhead: Dict[str, Dict[str, float]] = field(default_factory=dict)
    latency_s: Optional[float] = None  # one 4 KiB O_DIRECT request (read and write, mean)
    # the share of the shorter of a disk transfer (a write then a read, checksummed as the
    # swap files are) and a computation on the device that hides behind the other when both
    # run at once: 1 they overlap fully, 0 they take turns (on a CPU-only machine the I/O's
    # own CPU, and a virtual disk's, come from the cores the model computes on).
    # None: not measured (an older probe; the estimates then take 1, full overlap)
    compute_overlap: Optional[float] = None


@dataclass(frozen=True)
class ProbeResult:
    identity: Dict[str, Any]
    quick: bool
    measured_at: float
    mem_bps: float  # bytes/s of an in-place update (read + write counted)
    adam_params_per_s: float  # fp32 states
    adam8_params_per_s: float  # 8-bit states
    device: str  # "cuda" or "cpu": where the compute rates were measured
    flops: Dict[str, float]  # str(d_model) -> FLOP/s of a GPT layer fwd+bwd (fp32)
    h2d_pinned_bps: Optional[float] = None
    h2d_pageable_bps: Optional[float] = None
    d2h_pinned_bps: Optional[float] = None
    d2h_pageable_bps: Optional[float] = None
    device_memory_bytes: Optional[int] = None
    device_mem_bps: Optional[float] = None  # in-place update on the GPU
    disk: Optional[DiskProbe] = None
    from_cache: bool = False
    notes: List[str] = field(default_factory=list)
    torch_adam_params_per_s: Optional[float] = None  # torch.optim.AdamW (plain PyTorch)
    # layout -> {"block_s", "step_s"}: the engine's fixed costs without a disk (host)
    overhead: Dict[str, Dict[str, float]] = field(default_factory=dict)
    # str(d_model) -> FLOP/s of the same layer computed in bf16 (empty: not measured)
    flops_bf16: Dict[str, float] = field(default_factory=dict)
    # figure -> why it holds fewer widths than the probe times ("flops_bf16": the widths left
    # out to stay in the time budget; :meth:`flops_at` takes the widest measured for them)
    cut_short: Dict[str, str] = field(default_factory=dict)

    def engine_overhead(self, layout: str) -> Dict[str, float]:
        """``{"block_s", "step_s"}`` for a tier layout (``host``, ``optim_nvme``, ``nvme``):
        measured by the probe; zeros when it was not (an old result)."""
        got = self.overhead.get(layout)
        if got is None and self.disk is not None:
            got = self.disk.overhead.get(layout)
        return dict(got) if got else {"block_s": 0.0, "step_s": 0.0}

    def flops_at(self, d_model: int, dtype: torch.dtype = torch.float32) -> float:
        """The measured rate at the nearest width (log-linear between two measured widths),
        for a model computing in ``dtype``: bf16 and fp16 take the bf16 rate where it was
        measured (a probe from before it was measured gives the fp32 rate)."""
        table = (
            self.flops_bf16
            if dtype in (torch.bfloat16, torch.float16) and self.flops_bf16
            else self.flops
        )
        pts = sorted((int(k), v) for k, v in table.items())
        if d_model <= pts[0][0]:
            return pts[0][1]
        if d_model >= pts[-1][0]:
            return pts[-1][1]
        import math

        for (d0, r0), (d1, r1) in zip(pts, pts[1:]):
            if d0 <= d_model <= d1:
                w = (math.log(d_model) - math.log(d0)) / (math.log(d1) - math.log(d0))
                return r0 + w * (r1 - r0)
        return pts[-1][1]

    def rate_caveat(self, d_model: int, dtype: torch.dtype = torch.float32) -> Optional[str]:
        """A sentence when :meth:`flops_at` answers for this width from a narrower layer
        because the probe cut that dtype's timing short (None otherwise)."""
        bf16 = dtype in (torch.bfloat16, torch.float16) and bool(self.flops_bf16)
        key = "flops_bf16" if bf16 else "flops"
        table = self.flops_bf16 if bf16 else self.flops
        widest = max((int(k) for k in table), default=0)
        if key not in self.cut_short or d_model <= widest:
            return None
        name = "bf16" if bf16 else "fp32"
        return (
            f"compute at the probe's {name} rate for d_model {widest}, the widest it timed in "
            f"its time budget ({_fmt_rate(table[str(widest)], 'FLOP/s')}); a layer of "
            f"{d_model} may run at another rate: --calibrate times this shape, "
            "`infinity probe --thorough` every width"
        )

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: Dict[str, Any]) -> ProbeResult:
        """A saved result; fields a newer infinity added are left out (and missing ones take
        their defaults), so a result or cache written by another version still reads."""
        data = dict(data)
        disk = data.pop("disk", None)
        known = {f.name for f in fields(ProbeResult)}
        disk_known = {f.name for f in fields(DiskProbe)}
        return ProbeResult(
            disk=DiskProbe(**{k: v for k, v in disk.items() if k in disk_known}) if disk else None,
            **{k: v for k, v in data.items() if k in known},
        )


def _median_time(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _best_time(fn: Callable[[], None], reps: int, warmup: int = 2) -> float:
    """The fastest of ``reps`` timed calls after ``warmup``: what the machine does when nothing
    else runs (other processes' load only ever adds to a timing)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_memory(nbytes: int, reps: int = 5) -> float:
    x = torch.ones(nbytes // 4)
    t = _median_time(lambda: x.mul_(1.0000001), reps)
    return 2 * x.numel() * 4 / t


def measure_adam(numel: int, reps: int = 3) -> Dict[str, float]:
    from ..ops import cpu_adam_step, cpu_adam_step_8bit, new_8bit_state

    p, g = torch.zeros(numel), torch.full((numel,), 1e-3)
    m, v = torch.zeros(numel), torch.zeros(numel)
    t = _median_time(lambda: cpu_adam_step(p, g, m, v, step=1, lr=1e-3), reps)
    s8 = new_8bit_state(numel)
    t8 = _median_time(
        lambda: cpu_adam_step_8bit(
            p,
            g,
            s8["exp_avg_codes"],
            s8["exp_avg_absmax"],
            s8["exp_avg_sq_codes"],
            s8["exp_avg_sq_absmax"],
            step=1,
            lr=1e-3,
        ),
        reps,
    )
    return {"fp32": numel / t, "8bit": numel / t8}


def measure_torch_adam(numel: int, reps: int = 3) -> float:
    """Parameters/s of ``torch.optim.AdamW`` (fused where torch has it) on one tensor."""
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full((numel,), 1e-3)
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        opt.step()
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW([p], lr=1e-3)
    return numel / _median_time(opt.step, reps)


# (n_layers) of the two tiny GPTs whose difference gives the engine's per-block cost
OVERHEAD_DEPTHS = (2, 10)
OVERHEAD_LAYOUTS = {
    "host": ("host", "host", "host"),
    "optim_nvme": ("host", "host", "nvme"),
    "nvme": ("nvme", "nvme", "nvme"),
}


def _tiny_step_s(
    n_layers: int, layout: Optional[str], nvme_path: Optional[str], warmup: int, steps: int
) -> float:
    """Seconds of the fastest training step (forward, backward, optimizer step, zero_grad) of a
    d_model=64 GPT, plain PyTorch (``layout`` None) or wrapped with a tier layout (an engine
    built from a policy with every tier given, as ``infinity.wrap`` builds it when nothing is
    left to the planner)."""
    from ..models import GPTConfig, TinyGPT, lm_loss
    from ..optim import AdamW
    from ..policy import OffloadPolicy
    from ..runtime.core.device import resolve_device
    from ..runtime.engine import Engine

    cfg = GPTConfig(vocab_size=256, d_model=64, n_layers=n_layers, n_heads=1, max_seq=16)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    device = resolve_device(None)  # where a wrapped model computes (and so the plain one)
    if layout is None:
        model.to(device)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        p_t, g_t, o_t = OVERHEAD_LAYOUTS[layout]
        engine = Engine(
            model,
            OffloadPolicy(
                nvme_path=nvme_path if "nvme" in (p_t, o_t) else None,
                placement=None,
                param_tier=p_t,
                grad_tier=g_t,
                optimizer_tier=o_t,
            ),
            None,
            None,
        )
        opt = AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (1, 16), device=device)
    times: List[float] = []
    try:
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            lm_loss(model(x), x).backward()
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        if layout is not None:
            engine.close(restore=True)
    # the fastest step: a fixed cost of a few ms is what load adds to, never takes from
    return min(times)


def measure_engine_overhead(
    layouts: Sequence[str],
    nvme_path: Optional[str] = None,
    quick: bool = False,
    depths: Tuple[int, int] = OVERHEAD_DEPTHS,
    tick: Optional[Tick] = None,
    plain: Optional[Dict[int, float]] = None,
) -> Dict[str, Dict[str, float]]:
    """For each tier layout: the seconds the engine adds to a plain PyTorch training step,
    per block (``block_s``) and per step (``step_s``), from two tiny GPTs (d_model 64, 2 and 10
    layers: 3 and 11 blocks) whose compute is negligible. ``nvme_path``: a directory on the
    disk to measure (a scratch folder is made in it and removed). ``tick``: called after each
    of the timed models. ``plain``: depth -> the plain model's step seconds, timed by an
    earlier call of this probe: those depths are not timed again, the others are and are added
    to it."""
    warmup, steps = (1, 3) if quick else (3, 10)
    d0, d1 = depths
    tick = tick or (lambda: None)
    plain = {} if plain is None else plain
    for d in (d0, d1):
        if d not in plain:
            plain[d] = _tiny_step_s(d, None, None, warmup, steps)
            tick()
    out: Dict[str, Dict[str, float]] = {}
    scratch = (
        tempfile.mkdtemp(prefix=".infinity-probe-engine-", dir=nvme_path) if nvme_path else None
    )
    try:
        for layout in layouts:
            extra: Dict[int, float] = {}
            for d in (d0, d1):
                extra[d] = _tiny_step_s(d, layout, scratch, warmup, steps) - plain[d]
                tick()
            block = max(0.0, (extra[d1] - extra[d0]) / (d1 - d0))
            out[layout] = {"block_s": block, "step_s": max(0.0, extra[d0] - (d0 + 1) * block)}
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


def layer_flops(d_model: int, tokens: int, seq: int) -> float:
    """FLOPs of one GPT layer's forward + backward: 6 x params x tokens for the matrices, plus
    the attention scores and mixing (12 x tokens x seq x d_model)."""
    params = 12 * d_model * d_model + 13 * d_model
    return 6.0 * params * tokens + 12.0 * tokens * seq * d_model


@dataclass(frozen=True)
class ComputeRates:
    """:func:`measure_compute_budgeted`'s answer: the rates it measured, str(d_model) ->
    FLOP/s, and, when it left widths out, why (None: every width was timed)."""

    rates: Dict[str, float]
    cut_short: Optional[str] = None


def measure_compute(
    shapes: Sequence[Tuple[int, int, int]],
    device: torch.device,
    reps: int = 2,
    dtype: torch.dtype = torch.float32,
) -> Dict[str, float]:
    """FLOP/s of one GPT layer's forward + backward at each (d_model, batch, seq), with its
    weights and activations in ``dtype``; every shape, however long it takes."""
    return measure_compute_budgeted(shapes, device, reps=reps, dtype=dtype).rates


def time_layer(
    d_model: int,
    batch: int,
    seq: int,
    device: torch.device,
    dtype: torch.dtype,
    reps: int = 2,
    long_call_s: float = float("inf"),
    short_call_s: float = 0.0,
) -> float:
    """Seconds of one forward + backward of a GPT layer of width ``d_model`` on a
    (batch, seq) input, its weights and activations in ``dtype``: the median of ``reps`` calls
    after a warm-up; one call after the warm-up when the warm-up took ``long_call_s`` or more;
    as many as fill ``short_call_s`` (at most 8) when that is more than ``reps``."""
    from ..models import Block, GPTConfig

    cfg = GPTConfig(d_model=d_model, n_heads=max(1, d_model // 64), max_seq=seq)
    layer = Block(cfg).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, d_model, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    step()
    warm = time.perf_counter() - t0
    if warm >= long_call_s:
        return _median_time(step, 1, warmup=0)
    return _median_time(step, max(reps, min(8, int(short_call_s / max(warm, 1e-6)))), warmup=0)


def measure_compute_budgeted(
    shapes: Sequence[Tuple[int, int, int]],
    device: torch.device,
    reps: int = 2,
    dtype: torch.dtype = torch.float32,
    budget_s: Optional[float] = None,
    long_call_s: float = float("inf"),
    reference: Optional[Dict[str, float]] = None,
    tick: Optional[Tick] = None,
    short_call_s: float = 0.0,
    margin: float = 1.6,
) -> ComputeRates:
    """FLOP/s of one GPT layer's forward + backward at each (d_model, batch, seq), narrowest
    first, with its weights and activations in ``dtype``. ``budget_s``: a width whose projected
    time (its FLOPs at the rate of the width before, for a warm-up and its timed calls, times
    ``margin``: a wider layer can run at a lower rate, as bf16 on AVX2 does, 0.6 times as fast
    at d=512 as at d=256) would take this dtype past ``budget_s`` seconds is not timed, nor any
    after it (the first width always is); the answer then says which were left out and why.
    ``reference``: the fp32 rates, to say how far below them a slow dtype runs. ``tick``:
    called after each width."""
    ordered = sorted(shapes)
    out: Dict[str, float] = {}
    start = time.perf_counter()
    for i, (d, batch, seq) in enumerate(ordered):
        flop = layer_flops(d, batch * seq, seq)
        if budget_s is not None and out:
            last_d = ordered[i - 1][0]
            one = flop / out[str(last_d)]
            calls = 2 if one >= long_call_s else 1 + reps
            spent = time.perf_counter() - start
            if spent + margin * calls * one > budget_s:
                return ComputeRates(
                    out, _cut_note(dtype, ordered[i:], out, last_d, spent, budget_s, reference)
                )
        out[str(d)] = flop / time_layer(
            d, batch, seq, device, dtype, reps, long_call_s, short_call_s
        )
        if tick is not None:
            tick()
    return ComputeRates(out)


def _cut_note(
    dtype: torch.dtype,
    left: Sequence[Tuple[int, int, int]],
    rates: Dict[str, float],
    last_d: int,
    spent: float,
    budget_s: float,
    reference: Optional[Dict[str, float]],
) -> str:
    rate = rates[str(last_d)]
    rest = sum(layer_flops(d, b * s, s) for d, b, s in left) / rate
    dt = str(dtype).replace("torch.", "")
    note = (
        f"{dt} layers of d_model {', '.join(str(d) for d, _, _ in left)} not timed: one "
        f"forward+backward of each takes ~{rest:.0f} s in all at d={last_d}'s rate "
        f"({_fmt_rate(rate, 'FLOP/s')}), past the {budget_s:.0f} s budget "
        f"({spent:.0f} s spent)"
    )
    ref = (reference or {}).get(str(last_d))
    if ref:
        note += f"; {dt} runs at {rate / ref:.0%} of fp32's rate at d={last_d}"
    return note + f"; wider layers take d={last_d}'s rate (`infinity probe --thorough` times all)"


def measure_gpt_parts(
    d_model: int,
    n_heads: int,
    vocab: int,
    batch: int,
    seq: int,
    device: Optional[torch.device] = None,
    reps: int = 3,
) -> Dict[str, float]:
    """Seconds of forward + backward of one GPT layer (``layer_s``) and of the rest of the
    model with no layer (embeddings, final norm, tied head, loss: ``head_s``), at exactly this
    shape: the compute of an L-layer model is ``L * layer_s + head_s``. The fastest of ``reps``
    after two warm-up calls: a prediction for the machine, not for its load at that moment."""
    from ..models import Block, GPTConfig, TinyGPT, lm_loss

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig(vocab_size=vocab, d_model=d_model, n_layers=0, n_heads=n_heads, max_seq=seq)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    layer = Block(cfg).to(device)
    x = torch.randn(batch, seq, d_model, device=device, requires_grad=True)

    def layer_step() -> None:
        layer(x).sum().backward()
        sync()

    layer_s = _best_time(layer_step, reps)

    head = TinyGPT(cfg).to(device)
    idx = torch.randint(0, vocab, (batch, seq), device=device)

    def head_step() -> None:
        lm_loss(head(idx), idx).backward()
        sync()

    head_s = _best_time(head_step, reps)
    return {"layer_s": layer_s, "head_s": head_s}


def measure_transfers(nbytes: int, reps: int = 3) -> Dict[str, float]:
    dev = torch.device("cuda")
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out: Dict[str, float] = {}
    for pinned in (True, False):
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        tag = "pinned" if pinned else "pageable"

        def up() -> None:
            d.copy_(h, non_blocking=pinned)
            torch.cuda.synchronize()

        def down() -> None:
            h.copy_(d, non_blocking=pinned)
            torch.cuda.synchronize()

        out[f"h2d_{tag}"] = nbytes / _median_time(up, reps)
        out[f"d2h_{tag}"] = nbytes / _median_time(down, reps)
    return out


def _check_dir(path: str) -> None:
    """A ProbeError (nothing measured or written) for a file, a missing path or a non-path."""
    if not isinstance(path, (str, os.PathLike)):
        raise ProbeError(f"infinity.probe: nvme_path must be a path string, got {path!r}")
    problem = nvme_path_problem(path)  # an existing file: it says so, and what to pass
    if problem is not None:
        raise ProbeError(problem[1].replace("infinity:", "infinity.probe:", 1))
    if not os.path.isdir(path):
        raise ProbeError(
            f"infinity.probe: nvme_path {path!r} is not an existing directory; "
            "create it (on the disk that will hold the swap files) first"
        )


def measure_disk(
    path: str,
    nbytes: int,
    reps: int = 3,
    overlap: bool = True,
    tick: Optional[Tick] = None,
    overlap_bytes: Optional[int] = None,
    overlap_reps: Optional[int] = None,
) -> DiskProbe:
    """O_DIRECT write (an overwrite of an allocated file, as the swap extents are rewritten)
    and read of ``nbytes`` in one request each (the I/O engine splits it across its workers);
    ``overlap``: also :func:`measure_compute_overlap` (left out of a quick probe), on the first
    ``overlap_bytes`` (None: all ``nbytes``), its phases timed ``overlap_reps`` times after
    warming up the disk only (None: ``reps`` times, each after a warm-up).
    ``tick``: called after the write, the read, the latency and the overlap (when measured)."""
    from .. import io as inf_io

    tick = tick or (lambda: None)
    _check_dir(path)
    free = shutil.disk_usage(path).free
    nbytes = max(inf_io.ALIGNMENT, min(nbytes, (free // 4) // inf_io.ALIGNMENT * inf_io.ALIGNMENT))
    buf = inf_io.aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    fd, name = tempfile.mkstemp(prefix=".infinity-probe-", dir=path)
    os.close(fd)
    try:
        with inf_io.FileHandle(name, "r+") as fh:
            direct = fh.direct
            fh.allocate(nbytes)
            write = _median_time(lambda: fh.pwrite(buf).wait(), reps)
            tick()
            read = _median_time(lambda: fh.pread(buf).wait(), reps)
            tick()
            small = buf[: inf_io.ALIGNMENT]
            latency = 0.5 * (
                _median_time(lambda: fh.pwrite(small).wait(), 5)
                + _median_time(lambda: fh.pread(small).wait(), 5)
            )
            tick()
            part = buf[
                : min(nbytes, overlap_bytes or nbytes) // inf_io.ALIGNMENT * inf_io.ALIGNMENT
            ]
            hidden = (
                measure_compute_overlap(fh, part, overlap_reps or reps, overlap_reps is None)
                if overlap
                else None
            )
            if overlap:
                tick()
    finally:
        os.unlink(name)
    return DiskProbe(
        path=os.path.abspath(path),
        identity=disk_identity(path),
        direct=direct,
        read_bps=nbytes / read,
        write_bps=nbytes / write,
        free_bytes=free,
        test_bytes=nbytes,
        latency_s=latency,
        compute_overlap=hidden,
    )


def measure_compute_overlap(
    fh: Any, buf: torch.Tensor, reps: int = 3, rewarm: bool = True
) -> float:
    """:attr:`DiskProbe.compute_overlap`: a write then a read of ``buf`` (checksummed, as the
    swap store's requests are) alone, a matrix-multiply loop on the device of about the same
    length alone, then both at once; the share of the shorter one hidden by the overlap,
    ``(t_disk + t_compute - t_both) / min(t_disk, t_compute)``, clipped to [0, 1]. Each phase
    is the median of ``reps`` calls after a warm-up call; ``rewarm`` False: the loop alone and
    both at once without one (the disk's and the loop's first calls are behind them)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a = torch.randn(1024, 1024, device=dev)
    out = torch.empty_like(a)

    def disk() -> None:
        fh.pwrite(buf, crc=True).wait()
        fh.pread(buf, crc=True).wait()

    def mm(k: int) -> None:
        for _ in range(k):
            torch.mm(a, a, out=out)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    t_disk = _median_time(disk, reps)
    one = _median_time(lambda: mm(4), 3) / 4
    k = max(1, int(round(t_disk / max(one, 1e-9))))
    warmup = 1 if rewarm else 0
    t_compute = _median_time(lambda: mm(k), reps, warmup)

    def both() -> None:
        worker = threading.Thread(target=disk)
        worker.start()
        mm(k)
        worker.join()

    t_both = _median_time(both, reps, warmup)
    hidden = (t_disk + t_compute - t_both) / max(min(t_disk, t_compute), 1e-9)
    return min(1.0, max(0.0, hidden))


# ---- the cache ------------------------------------------------------------------------------
def cache_path() -> str:
    root = os.environ.get("INFINITY_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "infinity"
    )
    return os.path.join(root, "probe.json")


def _load_cache(path: str) -> Dict[str, Any]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("infinity.probe: ignoring unreadable cache %s (%s)", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    return data


def _save_cache(path: str, data: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


@contextlib.contextmanager
def _stage(desc: str, total: int, progress: Optional[bool]) -> Iterator[Any]:
    """A tqdm bar on stderr for one stage of the probe (``progress`` False: none); its time
    is logged (INFO)."""
    t0 = time.perf_counter()
    with tqdm(
        total=total,
        desc=f"infinity probe: {desc}",
        unit="step",
        leave=False,
        file=sys.stderr,
        disable=not progress,
        bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
    ) as bar:
        yield bar
    logger.info("infinity.probe: %s took %.1f s", desc, time.perf_counter() - t0)


def _settings(quick: bool, thorough: bool) -> ProbeSettings:
    if quick and thorough:
        raise ValueError("infinity.probe: quick and thorough exclude each other; pass one")
    return QUICK if quick else THOROUGH if thorough else FULL


def _duration(settings: ProbeSettings, disk: bool) -> str:
    if settings.quick:
        return "a few seconds"
    if settings.fp32_budget_s is None or settings.bf16_budget_s is None:
        return "minutes: every layer width in fp32 and bf16, however slow"
    return "about half a minute" + (", and half a minute more for the disk" if disk else "")


def _announce(who: Optional[str], what: str, settings: ProbeSettings, disk: bool) -> None:
    """Says that a probe starts: a warning when ``who`` (estimate, the planner) started it
    without being asked to probe, a log line otherwise."""
    kind = "a quick probe" if settings.quick else "a full probe"
    how_long = _duration(settings, disk)
    msg = f"{who or 'infinity.probe'}: {what}; measuring it now with {kind} ({how_long})"
    if who is None:
        logger.info("%s", msg)
        return
    if settings.quick:
        msg += (
            ": small buffers and layers (d_model <= 128), no engine overhead timing: its "
            "compute rates are those of narrow layers (a wide model's compute predicted "
            "several times too slow on a CPU: 4-12x on a 2-core AVX2 VM) and its disk rates "
            "from 32 MiB transfers"
        )
    logger.warning(
        "%s; `infinity probe%s` measures it ahead, once per machine",
        msg,
        " --nvme-path DIR" if disk else "",
    )


def probe(
    nvme_path: Optional[str] = None,
    *,
    quick: bool = False,
    refresh: bool = False,
    cache: Optional[str] = None,
    thorough: bool = False,
    progress: Optional[bool] = None,
    announce: Optional[str] = None,
) -> ProbeResult:
    """Measures this machine (or returns the cached figures for it) and, when ``nvme_path`` is
    given, the disk behind it. ``quick``: small buffers, a few seconds (a cached full probe is
    also accepted). A full probe takes about half a minute (as long again with a disk): each
    dtype's layer timing stops at its time budget (:class:`ProbeSettings`;
    :attr:`ProbeResult.cut_short` says what was left out); ``thorough``: time every width
    however long (minutes on a CPU without fast bf16), the disk too when one is given.
    ``refresh``: measure again even when cached. ``cache``: the JSON file (default
    :func:`cache_path`; ``""`` disables caching). ``progress``: a tqdm bar per stage on stderr
    (None: for a full probe, not a quick one). ``announce``: who asks (e.g. ``"infinity
    estimate"``) when the caller did not ask for a probe: a measurement then starts with a
    warning saying so, how long it takes and, for a quick one, how rough it is."""
    settings = _settings(quick, thorough)
    if nvme_path is not None:
        _check_dir(nvme_path)  # a wrong path is said before a minute of measuring, not after
    show = (not quick) if progress is None else progress
    cache = cache_path() if cache is None else cache
    ident = machine_identity()
    data = _load_cache(cache) if cache else {}
    notes: List[str] = []
    machine = None
    if data and not refresh:
        if data.get("identity_key") != key_of(ident):
            diff = sorted(k for k in ident if data.get("identity", {}).get(k) != ident[k])
            notes.append(
                f"probe cache {cache} is from another machine (differs in "
                f"{', '.join(diff) or 'identity'}); measured again"
            )
            logger.warning("infinity.probe: %s", notes[-1])
            data = {}
        else:
            cached = data.get("machine")
            if cached and (quick or not cached.get("quick")) and not thorough:
                machine = cached
                if "flops_bf16" not in machine:  # a cache from before bf16 was measured
                    old = QUICK if machine.get("quick", quick) else FULL
                    bf16 = _measure_bf16(old, machine.get("flops", {}), show)
                    machine["flops_bf16"] = bf16.rates
                    if bf16.cut_short:
                        machine["cut_short"] = {
                            **machine.get("cut_short", {}),
                            "flops_bf16": bf16.cut_short,
                        }
                    data["machine"] = machine
    if not data:
        data = {
            "version": CACHE_VERSION,
            "identity": ident,
            "identity_key": key_of(ident),
            "disks": {},
        }
    from_cache = machine is not None
    plain: Dict[int, float] = {}  # the plain tiny GPTs' steps, timed once for every layout
    if machine is None:
        _announce(
            announce,
            "no probe of this machine is cached" + (f" in {cache}" if cache else ""),
            settings,
            nvme_path is not None,
        )
        machine = _measure_machine(settings, show, plain)
        data["machine"] = machine
    disk = None
    if nvme_path is not None:
        again = refresh or thorough
        disk = _disk(nvme_path, settings, again, data, notes, show, announce, from_cache, plain)
        from_cache = from_cache and disk.identity.get("cached", False)
    if cache:
        try:
            _save_cache(cache, data)
        except OSError as exc:
            logger.warning("infinity.probe: could not write the cache %s (%s)", cache, exc)
    if disk is not None and "cached" in disk.identity:
        ident_d = dict(disk.identity)
        ident_d.pop("cached")
        disk = DiskProbe(**{**asdict(disk), "identity": ident_d})
    known = {f.name for f in fields(ProbeResult)}  # a cache a newer infinity wrote still reads
    return ProbeResult(
        identity=ident,
        from_cache=from_cache,
        notes=notes,
        disk=disk,
        **{k: v for k, v in machine.items() if k in known},
    )


def _disk(
    path: str,
    settings: ProbeSettings,
    refresh: bool,
    data: Dict[str, Any],
    notes: List[str],
    show: bool,
    announce: Optional[str],
    machine_cached: bool,
    plain: Optional[Dict[int, float]] = None,
) -> DiskProbe:
    _check_dir(path)
    ident = disk_identity(path)
    key = key_of(ident)
    cached = data.get("disks", {}).get(key)
    free = shutil.disk_usage(path).free
    if cached and not refresh and (settings.quick or not cached.get("quick")):
        return DiskProbe(
            path=os.path.abspath(path),
            identity={**ident, "cached": True},
            direct=cached["direct"],
            read_bps=cached["read_bps"],
            write_bps=cached["write_bps"],
            free_bytes=free,
            test_bytes=cached["test_bytes"],
            overhead=cached.get("overhead", {}),
            latency_s=cached.get("latency_s"),
            compute_overlap=cached.get("compute_overlap"),
        )
    if machine_cached:  # else the machine's announcement said the disk comes next
        _announce(announce, f"no probe of the disk behind {path} is cached", settings, True)
    with _stage("swap disk", 3 if settings.overlap_bytes is None else 4, show) as bar:
        result = measure_disk(
            path,
            settings.disk_bytes,
            reps=settings.disk_reps,
            overlap=settings.overlap_bytes is not None,
            tick=bar.update,
            overlap_bytes=settings.overlap_bytes,
            overlap_reps=settings.overlap_reps,
        )
    overhead: Dict[str, Dict[str, float]] = {}
    if settings.overhead:
        layouts = ["optim_nvme", "nvme"]
        models = 2 * len(layouts) + (0 if plain else 2)
        with _stage("engine overhead with the disk", models, show) as bar:
            overhead = measure_engine_overhead(
                layouts,
                nvme_path=path,
                tick=bar.update,
                plain=plain,
            )
    result = DiskProbe(**{**asdict(result), "overhead": overhead})
    data.setdefault("disks", {})[key] = {
        "identity": ident,
        "quick": settings.quick,
        "direct": result.direct,
        "read_bps": result.read_bps,
        "write_bps": result.write_bps,
        "test_bytes": result.test_bytes,
        "overhead": overhead,
        "latency_s": result.latency_s,
        "compute_overlap": result.compute_overlap,
    }
    if not result.direct:
        notes.append(f"{path}: no O_DIRECT (e.g. tmpfs); swap files go through the page cache")
    return result


def _measure_bf16(settings: ProbeSettings, fp32: Dict[str, float], show: bool) -> ComputeRates:
    """The layer's FLOP rate in bf16 (CPUs with AMX or AVX512-BF16 run it several times
    faster than fp32, others many times slower: then the budget cuts it short)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with _stage("GPT layer bf16", len(settings.shapes), show) as bar:
        got = measure_compute_budgeted(
            settings.shapes,
            dev,
            reps=settings.compute_reps,
            dtype=torch.bfloat16,
            budget_s=settings.bf16_budget_s,
            long_call_s=settings.long_call_s,
            reference=fp32,
            tick=bar.update,
            short_call_s=settings.short_call_s,
        )
        if got.cut_short:
            bar.total = bar.n
            bar.set_postfix_str("cut short: past its time budget")
    return got


def _measure_machine(
    settings: ProbeSettings, show: bool = False, plain: Optional[Dict[int, float]] = None
) -> Dict[str, Any]:
    """The machine's figures (the cache's "machine" entry). ``plain``: filled with the plain
    tiny GPTs' step times of the engine overhead, for the disk's layouts to reuse."""
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    out: Dict[str, Any] = {"quick": settings.quick, "measured_at": time.time()}
    with _stage("memory and optimizers", 3, show) as bar:
        out["mem_bps"] = measure_memory(settings.mem_bytes)
        bar.update()
        adam = measure_adam(settings.adam_numel)
        out["adam_params_per_s"] = adam["fp32"]
        out["adam8_params_per_s"] = adam["8bit"]
        bar.update()
        out["torch_adam_params_per_s"] = measure_torch_adam(settings.torch_adam_numel)
        bar.update()
    out["device"] = dev.type
    cut: Dict[str, str] = {}
    with _stage("GPT layer fp32", len(settings.shapes), show) as bar:
        fp32 = measure_compute_budgeted(
            settings.shapes,
            dev,
            reps=settings.compute_reps,
            budget_s=settings.fp32_budget_s,
            long_call_s=settings.long_call_s,
            tick=bar.update,
            short_call_s=settings.short_call_s,
        )
    out["flops"] = fp32.rates
    if fp32.cut_short:
        cut["flops"] = fp32.cut_short
    bf16 = _measure_bf16(settings, fp32.rates, show)
    out["flops_bf16"] = bf16.rates
    if bf16.cut_short:
        cut["flops_bf16"] = bf16.cut_short
    out["cut_short"] = cut
    # a quick probe leaves the engine's fixed costs out (tens of seconds on a loaded 2-core
    # machine); the estimates then assume BLOCK_OVERHEAD_S per block
    out["overhead"] = {}
    if settings.overhead:
        with _stage("engine overhead", 4, show) as bar:
            out["overhead"] = measure_engine_overhead(["host"], tick=bar.update, plain=plain)
    if cuda:
        with _stage("host<->device", 2, show) as bar:
            out.update(
                {f"{k}_bps": v for k, v in measure_transfers(settings.transfer_bytes).items()}
            )
            bar.update()
            out["device_memory_bytes"] = int(torch.cuda.get_device_properties(0).total_memory)
            x = torch.ones((256 << 20) // 4, device=dev)

            def update() -> None:
                x.mul_(1.0000001)
                torch.cuda.synchronize()

            out["device_mem_bps"] = 2 * x.numel() * 4 / _median_time(update, 5)
            del x
            bar.update()
    for what, why in cut.items():
        logger.info("infinity.probe: %s cut short: %s", what, why)
    logger.info("infinity.probe: measured the machine in %.1f s", time.perf_counter() - t0)
    return out


def _fmt_rate(v: Optional[float], unit: str = "B/s") -> str:
    if v is None:
        return "-"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= scale:
            return f"{v / scale:.2f} {prefix}{unit}"
    return f"{v:.0f} {unit}"


def format_probe(r: ProbeResult) -> str:
    """The probe as a table a person reads in a glance."""
    rows = [
        (
            "machine",
            f"{r.identity['cpu']}, {r.identity['cpus']} CPUs, "
            f"{r.identity['ram_bytes'] / (1 << 30):.1f} GiB RAM, "
            f"GPU: {r.identity['gpu'] or 'none (the CPU is the device tier)'}",
        ),
        (
            "memory bandwidth (in-place update)",
            _fmt_rate(r.mem_bps)
            + (f"; GPU {_fmt_rate(r.device_mem_bps)}" if r.device_mem_bps else ""),
        ),
        (
            "host->device pinned / pageable",
            f"{_fmt_rate(r.h2d_pinned_bps)} / {_fmt_rate(r.h2d_pageable_bps)}",
        ),
        (
            "device->host pinned / pageable",
            f"{_fmt_rate(r.d2h_pinned_bps)} / {_fmt_rate(r.d2h_pageable_bps)}",
        ),
        (
            "CPU Adam fp32 / 8-bit states",
            f"{_fmt_rate(r.adam_params_per_s, 'params/s')} / "
            f"{_fmt_rate(r.adam8_params_per_s, 'params/s')}",
        ),
        ("torch AdamW (plain PyTorch)", _fmt_rate(r.torch_adam_params_per_s, "params/s")),
        (
            "engine overhead per block / step",
            "; ".join(
                f"{k}: {1e3 * v['block_s']:.2f} / {1e3 * v['step_s']:.2f} ms"
                for k, v in list(r.overhead.items())
                + list((r.disk.overhead if r.disk else {}).items())
            )
            or "-",
        ),
        (
            f"{r.device} GPT layer fwd+bwd",
            ", ".join(
                f"d={k}: {_fmt_rate(v, 'FLOP/s')}"
                for k, v in sorted(r.flops.items(), key=lambda kv: int(kv[0]))
            ),
        ),
        (
            f"{r.device} GPT layer fwd+bwd, bf16",
            ", ".join(
                f"d={k}: {_fmt_rate(v, 'FLOP/s')}"
                for k, v in sorted(r.flops_bf16.items(), key=lambda kv: int(kv[0]))
            )
            or "-",
        ),
    ]
    if r.disk is not None:
        d = r.disk
        rows += [
            (
                "swap dir",
                f"{d.path} on {d.identity.get('name') or d.identity['dev']} "
                f"({d.identity.get('fs')}), O_DIRECT {'yes' if d.direct else 'NO'}",
            ),
            ("swap read / write (O_DIRECT)", f"{_fmt_rate(d.read_bps)} / {_fmt_rate(d.write_bps)}"),
            ("swap free space", f"{d.free_bytes / (1 << 30):.1f} GiB"),
            ("swap 4 KiB request", "-" if d.latency_s is None else f"{1e6 * d.latency_s:.0f} us"),
            (
                "swap I/O hidden behind compute",
                "-"
                if d.compute_overlap is None
                else f"{d.compute_overlap:.0%} (of the shorter, both at once)",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(f"({'cached' if r.from_cache else 'measured'}{', quick' if r.quick else ''})")
    lines += [f"cut short: {why}" for why in r.cut_short.values()]
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines) + "\n"
