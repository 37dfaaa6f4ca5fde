"""Each parameter's moment format, decided once (``states=``, ``min_8bit_size=``; the rules
are :class:`.formats.FormatSpec`'s): from the parameter's whole size and, for a parameter of a
wrapped model, the modules that hold it."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .formats import Choice, FormatSpec


class FormatChoices:
    """The optimizer's record of each parameter's moment format (id(param) -> Choice)."""

    def __init__(self, spec: FormatSpec) -> None:
        self.spec = spec
        self._choices: Dict[int, Choice] = {}  # id(param) -> its moment format and why

    def choose(
        self,
        p: torch.Tensor,
        numel: Optional[int] = None,
        owners: Optional[List[torch.nn.Module]] = None,
    ) -> Choice:
        """``p``'s moment format, decided once: from its whole size (``numel``; default
        ``p.numel()``) and, for a parameter of a wrapped model, the modules that hold it
        (``owners``; None for an unwrapped parameter)."""
        choice = self._choices.get(id(p))
        if choice is None:
            choice = self.spec.choose(p, p.numel() if numel is None else numel, owners)
            self._choices[id(p)] = choice
        return choice

    def format_of(self, p: torch.Tensor) -> str:
        return self.choose(p).fmt

    def slot_formats(self, flat: Any, owners: Dict[int, List[torch.nn.Module]]) -> Tuple[str, ...]:
        """The format of every slot of ``flat`` (slots another optimizer steps too: the
        layout has room for them), fixed for the shard's lifetime; ``owners``: id(param) ->
        the modules of the wrapped model that hold it."""
        out = []
        for s in flat.slots:
            choice = self._choices.get(id(s.param))
            if choice is None:  # decided once (a callable states= is asked once per param)
                whole = s.full.slots[s.full_index].numel if hasattr(s, "full_index") else s.numel
                choice = self.spec.choose(s.param, whole, owners.get(id(s.param), []))
                self._choices[id(s.param)] = choice
            out.append(choice.fmt)
        return tuple(out)
