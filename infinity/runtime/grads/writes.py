"""Write-behind of gradients to their swap files.

Design notes: docs/modules.md, runtime/grads/writes.py."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable, List, Optional, Tuple

import torch

from ...tiers import HostPool, SwapStore
from ..core.flat import FlatParam
from ..core.stats import Stats
from .store import grad_key


class GradientWriteError(OSError):
    """Writing a block's gradients to NVMe failed: those gradients are lost."""


class _PendingWrite:
    """A gradient write handed to the writer thread: submitted to the I/O engine there, then
    running on the I/O workers. ``wait`` raises the submission's or the write's error."""

    __slots__ = ("_submitted",)

    def __init__(self, submitted: cf.Future) -> None:
        self._submitted = submitted

    def done(self) -> bool:
        if not self._submitted.done():
            return False
        if self._submitted.exception() is not None:
            return True
        return self._submitted.result().done()

    def wait(self) -> None:
        self._submitted.result().wait()


class GradWriter:
    def __init__(
        self, store: SwapStore, stats: Stats, pool: Optional[HostPool], *, start: bool
    ) -> None:
        self._store = store
        self._stats = stats
        self._pool = pool
        # (write, buffer, flat, chunk index or None for a whole flat)
        self._writes: List[Tuple[_PendingWrite, torch.Tensor, FlatParam, Optional[int]]] = []
        self._executor: Optional[cf.ThreadPoolExecutor] = None
        if start:
            self._executor = cf.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="infinity-grad-write"
            )

    def write(self, flat: FlatParam, buf: torch.Tensor, data: torch.Tensor) -> None:
        """Starts writing a whole flat's gradients ``data`` (in ``buf``)."""
        future = _PendingWrite(self._executor.submit(self._store.write, grad_key(flat), data))
        self._stats.add_moved("host_to_nvme", flat.numel * 4, "grads")
        self._writes.append((future, buf, flat, None))

    def write_chunk(
        self, flat: FlatParam, k: int, buf: torch.Tensor, start: int, view: torch.Tensor
    ) -> None:
        """Starts writing chunk ``k`` (``view``, in ``buf``) at element ``start``."""
        future = _PendingWrite(
            self._executor.submit(self._store.write_at, grad_key(flat), start * 4, view)
        )
        self._stats.add_moved("host_to_nvme", view.numel() * 4, "grads")
        self._writes.append((future, buf, flat, k))

    def __len__(self) -> int:
        return len(self._writes)

    def writing(self, buf: torch.Tensor) -> bool:
        """Whether a write of ``buf`` is in flight (not reaped)."""
        return any(w[1] is buf for w in self._writes)

    def writing_chunk(self, flat: FlatParam, k: int) -> bool:
        return any(w[2] is flat and w[3] == k for w in self._writes)

    def wait_written(self, flat: FlatParam) -> None:
        """Waits until the flat's writes in flight are done (safe from another thread; a failed
        write raises here too, and is reported by :meth:`reap` as usual)."""
        for future, _buf, f, _k in list(self._writes):
            if f is flat:
                future.wait()

    def wait_chunk(self, flat: FlatParam, k: int) -> bool:
        """Waits for the writes of chunk ``k`` (their errors are reported by :meth:`reap`);
        whether there were any."""
        pending = [w for w in self._writes if w[2] is flat and w[3] == k]
        for future, _buf, _f, _k in pending:
            try:
                future.wait()
            except Exception:  # noqa: BLE001 - reported by reap, once
                pass
        return bool(pending)

    def reap(
        self,
        *,
        block: bool,
        count: Optional[int],
        failed: Callable[[FlatParam, BaseException], None],
        held: Callable[[torch.Tensor], bool],
    ) -> None:
        """Collects finished writes (``block``: waits for them, or for the first ``count``).
        A failed write gives its buffer back, is reported to ``failed`` and raises once
        (GradientWriteError); later calls go on. Buffers ``held`` for the optimizer are given
        back when it hands them back."""
        remaining = []
        reaped = 0
        failure: Optional[BaseException] = None
        for future, buf, flat, k in self._writes:
            if (block and (count is None or reaped < count)) or future.done():
                try:
                    future.wait()
                except Exception as exc:  # noqa: BLE001 - reported below, once
                    failed(flat, exc)
                    failure = failure or GradientWriteError(
                        getattr(exc, "errno", None) or 5,
                        f"infinity: writing the gradients of {flat.key} to NVMe failed ({exc}). "
                        "These gradients are lost: once the disk is fixed, call zero_grad() and "
                        "run this micro-batch's backward again",
                    )
                finally:
                    if not held(buf):
                        self._pool.release(buf)
                reaped += 1
            else:
                remaining.append((future, buf, flat, k))
        self._writes = remaining
        if failure is not None:
            raise failure

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
