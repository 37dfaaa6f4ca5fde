"""The dtype each flat computes in, decided once at wrap.

Design notes: docs/modules.md, runtime/build/dtypes.py."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

AUTO = "auto"
# the narrow dtypes "auto" decides for (fp32 homes always compute in fp32)
NARROW = (torch.bfloat16, torch.float16)
# on a CPU, a narrow dtype computes in fp32 when its rate is below this share of fp32's: a
# tolerance for the measurement's noise that favours the stored dtype (half the compute memory)
FP32_WHEN_BELOW = 0.9
QUICK_CHECK_SIZE = 128  # the quick check's matrix: 128 x 128 x 128, 4.2 MFLOP a product
QUICK_CHECK_REPS = 3

ComputeSetting = Union[str, torch.dtype, None]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Rates:
    """One CPU's rates in FLOP/s: fp32 and a narrow dtype, and where they were measured."""

    fp32: float
    narrow: float
    source: str  # "the probe cache (<path>)", "a quick check at wrap", ...


# a reader of measured rates for a narrow dtype (None: it has none for that dtype)
RateReader = Callable[[torch.dtype], Optional[Rates]]


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: the kernel's first call allocates and dispatches
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def quick_rates(dtype: torch.dtype, n: int = QUICK_CHECK_SIZE) -> Rates:
    """The CPU's matrix-product rate in fp32 and in ``dtype`` (``F.linear``, n x n x n, the
    best of a few runs on one thread: on a loaded machine a multi-threaded product of this
    size waits on its slowest thread, and the question is the instruction set's, not the
    core count's). A few milliseconds where ``dtype`` is slow, less where it is fast."""
    flop = 2.0 * n * n * n
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(n, n, generator=gen)
    w32 = torch.randn(n, n, generator=gen)
    xn, wn = x32.to(dtype), w32.to(dtype)
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            t32 = _best_seconds(lambda: F.linear(x32, w32), QUICK_CHECK_REPS)
            tn = _best_seconds(lambda: F.linear(xn, wn), QUICK_CHECK_REPS)
    finally:
        torch.set_num_threads(threads)
    return Rates(flop / t32, flop / tn, f"a quick check at wrap: {n}x{n} products on one thread")


class CpuRates:
    """The process's source of CPU rates: the registered readers first (the probe cache),
    else the quick check, run once per dtype and kept."""

    def __init__(self) -> None:
        self._readers: List[RateReader] = []
        self._checked: Dict[torch.dtype, Rates] = {}
        self._lock = threading.Lock()

    def add_reader(self, reader: RateReader) -> None:
        """Rates measured elsewhere (the probe's cache) are asked first, in order added."""
        with self._lock:
            if reader not in self._readers:
                self._readers.append(reader)

    def remove_reader(self, reader: RateReader) -> None:
        with self._lock:
            if reader in self._readers:
                self._readers.remove(reader)

    def forget(self) -> None:
        """Drops the quick checks' results (the next wrap measures again)."""
        with self._lock:
            self._checked.clear()

    def __call__(self, dtype: torch.dtype) -> Rates:
        with self._lock:
            readers = list(self._readers)
        for reader in readers:
            try:
                got = reader(dtype)
            except Exception as exc:  # a reader is advisory: the quick check decides then
                logger.warning("infinity: reading cached %s rates failed (%s)", dtype, exc)
                got = None
            if got is not None:
                return got
        with self._lock:
            if dtype not in self._checked:
                self._checked[dtype] = quick_rates(dtype)
                r = self._checked[dtype]
                logger.info(
                    "infinity: %s on this CPU: %.2f GFLOP/s against %.2f in fp32 (%s)",
                    dtype_name(dtype),
                    r.narrow / 1e9,
                    r.fp32 / 1e9,
                    r.source,
                )
            return self._checked[dtype]


CPU_RATES = CpuRates()


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a stored dtype computes in, and why."""

    stored: torch.dtype
    compute: torch.dtype
    reason: str


def _auto(stored: torch.dtype, device: torch.device, rates: Callable[[torch.dtype], Rates]):
    name = dtype_name(stored)
    if stored not in NARROW:
        return DtypeChoice(stored, stored, f"{name} homes compute in {name}")
    if device.type == "cuda":
        return DtypeChoice(
            stored,
            stored,
            f"{name} homes compute in {name} on CUDA (tensor cores run it at least as fast as "
            "fp32, in half the memory)",
        )
    r = rates(stored)
    figures = (
        f"{name} runs at {r.narrow / 1e9:.2f} GFLOP/s on this CPU against "
        f"{r.fp32 / 1e9:.2f} in fp32 ({r.source})"
    )
    if r.narrow < FP32_WHEN_BELOW * r.fp32:
        return DtypeChoice(
            stored,
            torch.float32,
            f"{name} homes compute in float32: {figures}; the compute buffers take twice "
            f"the homes' bytes. Pass compute_dtype=torch.{name} to compute in {name}",
        )
    return DtypeChoice(
        stored,
        stored,
        f"{name} homes compute in {name}: {figures}. Pass compute_dtype=torch.float32 "
        "to compute in float32",
    )


def choose(
    setting: ComputeSetting,
    device: torch.device,
    stored: Iterable[torch.dtype],
    rates: Optional[Callable[[torch.dtype], Rates]] = None,
) -> Dict[torch.dtype, DtypeChoice]:
    """The compute dtype of each stored dtype in ``stored`` under ``setting`` (see the
    module; the policy checked it); ``rates``: the CPU's rates for a narrow dtype (default:
    :data:`CPU_RATES`)."""
    out: Dict[torch.dtype, DtypeChoice] = {}
    for dtype in stored:
        if dtype in out:
            continue
        if setting is None:
            out[dtype] = DtypeChoice(
                dtype, dtype, f"compute_dtype=None: {dtype_name(dtype)} homes compute as stored"
            )
        elif isinstance(setting, torch.dtype):
            out[dtype] = DtypeChoice(
                dtype,
                setting,
                f"compute_dtype=torch.{dtype_name(setting)} as set: {dtype_name(dtype)} "
                f"homes compute in {dtype_name(setting)}",
            )
        else:
            out[dtype] = _auto(dtype, device, rates if rates is not None else CPU_RATES)
    return out


def agree(
    choices: Dict[torch.dtype, DtypeChoice],
    setting: ComputeSetting,
    device: torch.device,
    reduce_max: Callable[[float], float],
) -> Dict[torch.dtype, DtypeChoice]:
    """Sharded over ranks, every rank must compute alike (their all-gathers and
    reduce-scatters move the same dtypes): each narrow dtype "auto" decided on a CPU from
    this rank's measurement computes in fp32 on every rank when it does on one
    (``reduce_max``: the maximum of a number over all ranks; every rank calls this with
    the same stored dtypes, in the same order)."""
    if setting != AUTO or device.type != "cpu":
        return choices
    out = dict(choices)
    for stored, c in choices.items():
        if stored not in NARROW:
            continue
        mine = 1.0 if c.compute == torch.float32 else 0.0
        if reduce_max(mine) > mine:
            out[stored] = DtypeChoice(
                stored,
                torch.float32,
                f"{c.reason}; another rank measured {dtype_name(stored)} slow, and the ranks "
                "compute alike: float32",
            )
    return out


def summary(setting: ComputeSetting, choices: Dict[torch.dtype, DtypeChoice]) -> Dict[str, object]:
    """What ``infinity.stats`` reports: the setting, each stored dtype's compute dtype, why."""
    shown = setting if setting is None or isinstance(setting, str) else dtype_name(setting)
    return {
        "setting": shown,
        "chosen": {dtype_name(s): dtype_name(c.compute) for s, c in choices.items()},
        "why": {dtype_name(s): c.reason for s, c in choices.items()},
    }


def describe(choices: Dict[torch.dtype, DtypeChoice]) -> str:
    """One line for ``infinity.explain``: each stored dtype's compute dtype and why."""
    return "compute dtype: " + "; ".join(c.reason for c in choices.values())
