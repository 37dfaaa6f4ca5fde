from __future__ import annotations

import threading
from typing import Optional, Protocol


class BudgetExceededError(RuntimeError):
    """Raised when bytes that must be resident at once do not fit in a tier's budget."""


class Budget(Protocol):
    """What a pool counts its bytes in: a :class:`ByteBudget`, or an optimizer port's view of
    the engine's host budget."""

    @property
    def limit(self) -> Optional[int]: ...

    @property
    def used(self) -> int: ...

    def fits(self, nbytes: int) -> bool: ...

    def try_acquire(self, nbytes: int) -> bool: ...

    def acquire(self, nbytes: int, *, what: str) -> None: ...

    def release(self, nbytes: int) -> None: ...


class ByteBudget:
    """Counts the bytes held in one tier against an optional limit and remembers the peak.

    ``try_acquire`` never blocks (prefetch uses it); ``acquire`` raises BudgetExceededError
    instead of waiting, so a budget that is too small fails loudly rather than hanging.
    """

    def __init__(self, name: str, limit: Optional[int]) -> None:
        if limit is not None and limit <= 0:
            raise ValueError(f"{name} budget must be a positive number of bytes, got {limit}")
        self.name = name
        self.limit = limit
        self._used = 0
        self._peak = 0
        self._high = 0  # the peak since creation: reset_peak does not lower it
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def high_water(self) -> int:
        """The most bytes ever held at once (``peak`` counts from the last ``reset_peak``)."""
        return self._high

    def fits(self, nbytes: int) -> bool:
        return self.limit is None or self._used + nbytes <= self.limit

    def try_acquire(self, nbytes: int) -> bool:
        with self._lock:
            if not self.fits(nbytes):
                return False
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            self._high = max(self._high, self._used)
            return True

    def acquire(self, nbytes: int, *, what: str) -> None:
        if not self.try_acquire(nbytes):
            raise BudgetExceededError(
                f"infinity: {what} needs {nbytes:,} bytes but the {self.name} budget has "
                f"{self.limit - self._used:,} of {self.limit:,} bytes free ({self._used:,} "
                f"already held). This needs {self.name}_budget >= {self._used + nbytes:,} "
                f"bytes (more if later allocations follow); raise {self.name}_budget to at "
                f"least that, or use smaller blocks (block_rule)"
                + (
                    ", or a smaller chunk_bytes (staging and gradient buffers are one chunk each)"
                    if self.name == "host"
                    else ""
                )
            )

    def release(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self._used:
                raise RuntimeError(
                    f"{self.name} budget: releasing {nbytes} bytes but only "
                    f"{self._used} are held (accounting bug)"
                )
            self._used -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._used
