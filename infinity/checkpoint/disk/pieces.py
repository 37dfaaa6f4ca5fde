"""Tensors stored whole or in pieces keyed by global element ranges, and reading any range back.

Design notes: docs/modules.md, checkpoint/disk/pieces.py."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from .manifest import CorruptCheckpointError, decode

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def piece_name(name: str, a: int, b: int, numel: int) -> str:
    """The name of elements [a, b) of tensor ``name`` (``numel`` elements) in a data file."""
    return name if (a, b) == (0, numel) else f"{name}[{a}:{b}]"


class Source:
    """Element ranges of the checkpoint's tensors and optimizer states, by saved name."""

    def __init__(self, manifest: Dict[str, Any], reader: Any, ranged: bool = False) -> None:
        """``ranged``: read only the chunks of each file around the ranges asked for (a rank
        reading its part), instead of whole files (one process reading every tensor)."""
        self.ranged = ranged
        self.tensors: Dict[str, Any] = manifest.get("tensors", {})
        opt = manifest.get("optimizer") or {}
        self.states: Dict[str, Any] = opt.get("states", {})
        self.reader = reader

    def numel(self, name: str) -> int:
        return math.prod(self.tensors[name]["shape"])

    def _gather(
        self,
        pieces: Sequence[Sequence[Any]],
        name: str,
        suffix: str,
        a: int,
        b: int,
        dtype: Optional[torch.dtype],
        numel: int,
    ) -> torch.Tensor:
        out: Optional[torch.Tensor] = None
        covered = 0
        for rel, pa, pb, *_ in pieces:
            lo, hi = max(a, pa), min(b, pb)
            if hi <= lo:
                continue
            t = self._read(rel, piece_name(name, pa, pb, numel) + suffix, lo - pa, hi - pa, pb - pa)
            if out is None:
                out = torch.empty(b - a, dtype=dtype or t.dtype)
            out[lo - a : hi - a].copy_(t)
            covered += hi - lo
        if out is None or covered != b - a:
            raise CorruptCheckpointError(
                f"checkpoint {self.reader.root}: elements [{a}, {b}) of {name}{suffix} are not "
                "all in its files (the manifest's pieces leave a gap)"
            )
        return out

    def _read(self, rel: str, stored: str, a: int, b: int, numel: int) -> torch.Tensor:
        """Elements [a, b) of the ``numel`` elements stored as ``stored`` in ``rel``."""
        if self.ranged:
            return self.reader.elements(rel, stored, a, b)
        t = self.reader.tensor(rel, stored).reshape(-1)
        if t.numel() != numel:
            raise CorruptCheckpointError(
                f"checkpoint file {rel}: {stored} holds {t.numel()} "
                f"values, not {numel} ({self.reader.root})"
            )
        return t[a:b]

    def param(
        self, name: str, a: int = 0, b: Optional[int] = None, dtype: Optional[torch.dtype] = None
    ) -> torch.Tensor:
        """Elements [a, b) of saved tensor ``name`` (flattened), in ``dtype`` (default: as
        saved)."""
        record = self.tensors[name]
        numel = self.numel(name)
        b = numel if b is None else b
        if "pieces" in record:
            return self._gather(record["pieces"], name, "", a, b, dtype, numel)
        t = self._read(record["file"], name, a, b, numel)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def whole(self, name: str) -> torch.Tensor:
        """Saved tensor ``name`` in its shape."""
        return self.param(name).view(self.tensors[name]["shape"])

    def has_state(self, name: str) -> bool:
        return name in self.states

    def step(self, name: str) -> Any:
        return decode(self.states[name]["values"]).get("step")

    def state(
        self, name: str, key: str, a: int = 0, b: Optional[int] = None
    ) -> Optional[torch.Tensor]:
        """Elements [a, b) of optimizer state ``key`` of parameter ``name`` as fp32, flat;
        None where not saved (a master equal to the parameter: the caller reads that)."""
        record = self.states[name]
        if "pieces" not in record:
            rel = record["tensors"].get(key)
            if rel is None:
                return None
            if b is None:
                return self.reader.tensor(rel, f"{name}::{key}").reshape(-1).to(torch.float32)
            return self._read(rel, f"{name}::{key}", a, b, self.numel(name)).to(torch.float32)
        numel = self.numel(name)
        b = numel if b is None else b
        pieces: List[Sequence[Any]] = [p for p in record["pieces"] if max(a, p[1]) < min(b, p[2])]
        if key == "master" and any(key not in p[3] for p in pieces):
            # some pieces left the master out (equal to the fp32 parameter): read it piecewise
            out = torch.empty(b - a, dtype=torch.float32)
            for p in pieces:
                lo, hi = max(a, p[1]), min(b, p[2])
                out[lo - a : hi - a].copy_(
                    self._gather([p], name, "::master", lo, hi, torch.float32, numel)
                    if key in p[3]
                    else self.param(name, lo, hi, torch.float32)
                )
            return out
        return self._gather(pieces, name, f"::{key}", a, b, torch.float32, numel)

    def state_entry(self, name: str, a: int = 0, b: Optional[int] = None) -> Dict[str, Any]:
        """{"step", "exp_avg", "exp_avg_sq", "master"} of elements [a, b), flat fp32."""
        entry: Dict[str, Any] = {"step": self.step(name)}
        for key in STATE_KEYS:
            entry[key] = self.state(name, key, a, b)
        return entry


__all__ = ["Source", "piece_name", "STATE_KEYS"]
