"""Counters the engine keeps: bytes per tier now and at peak, bytes moved, prefetch, stalls,
and where the time of a training step went (forward+backward wall time, gradient offload,
the optimizer's StepStats) with the bytes written to NVMe per optimizer step (SSD wear), and
the NVMe bytes per step by what they were (parameters, gradients, optimizer states,
activations; read and written)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

DIRECTIONS = ("nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host")
# what NVMe bytes were (reads: nvme_to_host, writes: host_to_nvme)
NVME_CATEGORIES = ("params", "grads", "states", "activations")
_NVME_DIRECTIONS = {"nvme_to_host": "read", "host_to_nvme": "written"}


def _nvme_zero() -> Dict[str, int]:
    return {f"{c}_{d}": 0 for c in NVME_CATEGORIES for d in ("read", "written")}


@dataclass
class Stats:
    moved: Dict[str, int] = field(default_factory=lambda: {d: 0 for d in DIRECTIONS})
    # bytes fetched into compute buffers, in the stored format, by the flats' category
    # ("frozen.layer.nf4", "frozen.outer.bfloat16", "mixed.layer.float32", ...)
    fetched: Dict[str, int] = field(default_factory=dict)
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    on_demand_fetches: int = 0
    stall_seconds: float = 0.0
    fetches: int = 0
    releases: int = 0
    schedule_deviations: int = 0
    # embeddings looked up row by row (runtime/vocab/rows.py): lookups, bytes read for them
    rows_lookups: int = 0
    rows_read_bytes: int = 0
    # time attribution (seconds since the last reset)
    forward_backward_seconds: float = 0.0  # wall time, model pre-forward -> end of backward
    grad_offload_seconds: float = 0.0  # inside GradientSink.add/close/finish_backward
    hook_seconds: float = 0.0  # inside the engine's forward/backward hooks
    transfer_cpu_seconds: float = 0.0  # CPU time of the transfer threads (background)
    optimizer_cpu_adam_seconds: float = 0.0
    optimizer_nvme_wait_seconds: float = 0.0
    optimizer_nvme_busy_seconds: float = 0.0
    optimizer_total_seconds: float = 0.0
    optimizer_steps: int = 0
    # activation offload (runtime/activations/offload.py): bytes moved, waits in forward/backward
    activation_bytes_offloaded: int = 0
    activation_bytes_fetched: int = 0
    activation_wait_seconds: float = 0.0
    activations_offloaded: bool = False  # set when activation_tier is on: adds them to time
    # bytes written to NVMe (host_to_nvme), cut at each optimizer step
    nvme_written_last_step: int = 0
    nvme_written_total: int = 0
    _nvme_written_mark: int = field(default=0, repr=False)
    # NVMe bytes by what they were ("<category>_read" / "<category>_written"), since the last
    # reset and in the last optimizer step (cut like nvme_written_last_step)
    nvme_by_category: Dict[str, int] = field(default_factory=_nvme_zero)
    nvme_by_category_last_step: Dict[str, int] = field(default_factory=_nvme_zero)
    _nvme_category_mark: Dict[str, int] = field(default_factory=_nvme_zero, repr=False)
    _fb_t0: Optional[float] = field(default=None, repr=False)  # forward+backward in progress
    # tokens trained on (layer-major steps count theirs: runtime/layered), cut at each optimizer
    # step like the NVMe bytes, and the layer inputs those steps kept (peak bytes)
    tokens: int = 0
    tokens_last_step: int = 0
    _tokens_mark: int = field(default=0, repr=False)
    boundary_bytes_peak: int = 0
    micro_batches: int = 0
    grad_norm: Optional[float] = None  # the last layer-major step's norm before clipping
    # the last layer-major step's seconds: record pass and layer-major forward, then the
    # backward passes (tail, layers, embeddings; with a step in backward, its updates overlap)
    forward_s: float = 0.0
    backward_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_moved(self, direction: str, nbytes: int, category: str = "params") -> None:
        """Counts bytes moved; NVMe reads and writes also by ``category`` (one of
        :data:`NVME_CATEGORIES`; the parameter homes' swap I/O is the default)."""
        with self._lock:
            self.moved[direction] += nbytes
            way = _NVME_DIRECTIONS.get(direction)
            if way is not None:
                self.nvme_by_category[f"{category}_{way}"] += nbytes

    def add_fetched(self, category: str, nbytes: int) -> None:
        with self._lock:
            self.fetched[category] = self.fetched.get(category, 0) + nbytes

    def hit_waited(self, seconds: float) -> None:
        """A prefetch counted as a hit turned out to make the compute stream wait: it becomes
        a miss (not across a reset, which zeroed the hit) and the wait is stall time."""
        with self._lock:
            if self.prefetch_hits > 0:
                self.prefetch_hits -= 1
                self.prefetch_misses += 1
            self.stall_seconds += seconds

    def reset(self) -> None:
        with self._lock:
            self.moved = {d: 0 for d in DIRECTIONS}
            self.fetched = {}
            self.prefetch_hits = self.prefetch_misses = self.on_demand_fetches = 0
            self.stall_seconds = 0.0
            self.fetches = self.releases = self.schedule_deviations = 0
            self.rows_lookups = self.rows_read_bytes = 0
            self.forward_backward_seconds = self.grad_offload_seconds = 0.0
            self.hook_seconds = self.transfer_cpu_seconds = 0.0
            self.optimizer_cpu_adam_seconds = self.optimizer_nvme_wait_seconds = 0.0
            self.optimizer_nvme_busy_seconds = self.optimizer_total_seconds = 0.0
            self.optimizer_steps = 0
            self.activation_bytes_offloaded = self.activation_bytes_fetched = 0
            self.activation_wait_seconds = 0.0
            self.nvme_written_last_step = self.nvme_written_total = 0
            self._nvme_written_mark = 0
            self.nvme_by_category = _nvme_zero()
            self.nvme_by_category_last_step = _nvme_zero()
            self._nvme_category_mark = _nvme_zero()
            self._fb_t0 = None
            self.tokens = self.tokens_last_step = self._tokens_mark = 0
            self.boundary_bytes_peak = self.micro_batches = 0
            self.grad_norm = None

    def note_tokens(
        self,
        tokens: int,
        boundary_bytes: int,
        micro_batches: int,
        seconds: Tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """A layer-major step ran over ``tokens`` tokens in ``micro_batches`` micro-batches,
        keeping at most ``boundary_bytes`` of layer inputs, in ``seconds`` (forward,
        backward)."""
        with self._lock:
            self.forward_s, self.backward_s = seconds
            self.tokens += tokens
            self.micro_batches += micro_batches
            self.boundary_bytes_peak = max(self.boundary_bytes_peak, boundary_bytes)

    def note_grad_norm(self, norm: Optional[float]) -> None:
        """A layer-major step with its optimizer step clipped at this norm (None: no clip)."""
        with self._lock:
            self.grad_norm = norm

    def forward_started(self, now: float) -> None:
        if self._fb_t0 is None:
            self._fb_t0 = now

    def forward_backward_ended(self, now: float) -> None:
        """End of a backward (or of a forward no backward follows): the time since the first
        forward still counted is forward+backward wall time."""
        t0, self._fb_t0 = self._fb_t0, None
        if t0 is not None:
            self.forward_backward_seconds += max(0.0, now - t0)

    def forward_backward_aborted(self) -> None:
        self._fb_t0 = None

    def record_optimizer_step(self, step) -> None:
        """One optimizer step went through this engine: ``step`` is its StepStats (any object
        with step_s, compute_s, io_wait_s, io_busy_s). Also closes the NVMe-written period."""
        with self._lock:
            self.optimizer_cpu_adam_seconds += float(step.compute_s)
            self.optimizer_nvme_wait_seconds += float(step.io_wait_s)
            self.optimizer_nvme_busy_seconds += float(step.io_busy_s)
            self.optimizer_total_seconds += float(step.step_s)
            self.optimizer_steps += 1
            written = self.moved["host_to_nvme"]
            self.nvme_written_last_step = max(0, written - self._nvme_written_mark)
            self.nvme_written_total += self.nvme_written_last_step
            self._nvme_written_mark = written
            now = dict(self.nvme_by_category)
            self.nvme_by_category_last_step = {
                k: max(0, v - self._nvme_category_mark[k]) for k, v in now.items()
            }
            self._nvme_category_mark = now
            self.tokens_last_step = self.tokens - self._tokens_mark
            self._tokens_mark = self.tokens

    def time_breakdown(self) -> Dict[str, object]:
        """Seconds since the last reset. Forward+backward wall time splits into ``compute``
        (outside the engine's hooks: the model's own math and autograd), ``fetch_wait``
        (waiting for parameters), ``grad_offload`` (accumulating gradients, handing them to
        NVMe), ``activation_wait`` (waiting for offloaded activations; present with
        activation_tier on, as is ``activation_bytes``: offloaded and fetched) and ``engine``
        (the rest of the hooks: bookkeeping, releases, locks, Python).
        ``transfer_cpu``: CPU time the transfer threads used in the background (on a machine
        without a GPU, taken from the compute's cores; not part of the wall-time sum)."""
        fb, fetch, grad = (
            self.forward_backward_seconds,
            self.stall_seconds,
            self.grad_offload_seconds,
        )
        act = self.activation_wait_seconds
        hooks = max(min(self.hook_seconds, fb), fetch + grad)
        out: Dict[str, object] = {
            "compute": max(0.0, fb - hooks - act),
            "fetch_wait": float(fetch),
            "grad_offload": float(grad),
            "engine": max(0.0, hooks - fetch - grad),
            "transfer_cpu": float(self.transfer_cpu_seconds),
            "optimizer": {
                "cpu_adam": float(self.optimizer_cpu_adam_seconds),
                "nvme_wait": float(self.optimizer_nvme_wait_seconds),
                "nvme_busy": float(self.optimizer_nvme_busy_seconds),
                "total": float(self.optimizer_total_seconds),
            },
        }
        if self.activations_offloaded:  # activation_tier is on
            out["activation_wait"] = float(act)
            out["activation_bytes"] = {
                "offloaded": self.activation_bytes_offloaded,
                "fetched": self.activation_bytes_fetched,
            }
        return out

    def add_transfer_cpu(self, seconds: float) -> None:
        with self._lock:
            self.transfer_cpu_seconds += seconds

    @property
    def hit_rate(self) -> float:
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 1.0
