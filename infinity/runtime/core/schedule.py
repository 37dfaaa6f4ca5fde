"""Schedule: the recorded order in which blocks run, used to prefetch the next ones.

Design notes: docs/modules.md, runtime/core/schedule.py."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

PHASES = ("forward", "backward")


class Schedule:
    def __init__(self, window: int, guess: Optional[Dict[str, List[int]]] = None) -> None:
        self.window = window
        self.recorded: Dict[str, Optional[List[int]]] = {p: None for p in PHASES}
        self._current: Dict[str, List[int]] = {p: [] for p in PHASES}
        self._deviated: Dict[str, bool] = {p: False for p in PHASES}
        self._open: Dict[str, bool] = {p: False for p in PHASES}
        self._guessed: Dict[str, bool] = {p: False for p in PHASES}
        for phase, order in (guess or {}).items():
            if phase not in PHASES:
                raise ValueError(f"unknown schedule phase {phase!r}")
            if order:
                self.recorded[phase] = list(order)
                self._guessed[phase] = True

    def guessed(self, phase: str) -> bool:
        """Whether ``phase``'s record is still the guess (no pass has finished yet)."""
        return self._guessed[phase]

    def begin(self, phase: str) -> None:
        self._current[phase] = []
        self._deviated[phase] = False
        self._open[phase] = True

    def is_open(self, phase: str) -> bool:
        return self._open[phase]

    def visit(self, phase: str, block: int) -> Tuple[bool, bool, List[int]]:
        """Records a visit. Returns (on_trace, newly_deviated, blocks to prefetch next)."""
        if not self._open[phase]:
            self.begin(phase)
        current = self._current[phase]
        pos = len(current)
        current.append(block)
        rec = self.recorded[phase]
        if rec is None:
            return False, False, []
        if not self._deviated[phase] and pos < len(rec) and rec[pos] == block:
            return True, False, rec[pos + 1 : pos + 1 + self.window]
        newly = not self._deviated[phase] and not self._guessed[phase]
        self._deviated[phase] = True
        return False, newly, []

    def upcoming(self, phase: str, count: Optional[int] = None) -> List[int]:
        """The first blocks the recorded ``phase`` will need (to prefetch before it starts)."""
        rec = self.recorded[phase]
        if rec is None:
            return []
        return rec[: self.window if count is None else count]

    def next_on_trace(self, phase: str) -> Optional[int]:
        """The block the recorded ``phase`` runs after the last visit, while the open pass
        follows the record (None otherwise). The same on every rank that ran the same blocks:
        ZeRO-3 starts that block's all-gather early."""
        rec = self.recorded[phase]
        if not self._open[phase] or self._deviated[phase] or rec is None:
            return None
        pos = len(self._current[phase])
        return rec[pos] if pos < len(rec) else None

    def next_visit(self, phase: str, block: int) -> Optional[int]:
        """How many visits after the last one the recorded ``phase`` uses ``block`` again (1:
        next), while the open pass follows the record; None when it does not (or when the
        pass left the record, or none is open)."""
        rec = self.recorded[phase]
        if not self._open[phase] or self._deviated[phase] or rec is None:
            return None
        pos = len(self._current[phase])
        for distance, index in enumerate(rec[pos:], 1):
            if index == block:
                return distance
        return None

    def abort(self, phase: str) -> None:
        """Closes a pass that did not finish (it raised): its partial order is not recorded."""
        self._open[phase] = False
        self._current[phase] = []

    def end(self, phase: str) -> None:
        if not self._open[phase]:
            return
        self._open[phase] = False
        current = self._current[phase]
        if current and current != self.recorded[phase]:
            self.recorded[phase] = list(current)
        if current:
            self._guessed[phase] = False
