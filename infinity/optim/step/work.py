"""What one ``opt.step()`` hands to a state store: the work (runs, kernels) and where the
store reports which shards took the step. The store owns how its tier moves the states; the
optimizer owns the step counts and the record of shards to finish or restore."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch

from .kernels import Window
from .shard import Run as _Run
from .stats import StepStats

if TYPE_CHECKING:  # pragma: no cover
    from .chunks import Unit
    from .shard import Shard


@dataclass(frozen=True)
class StepWork:
    """One step's work for one store.

    - ``runs``: id(shard.flat) -> the shard's runs (slots with gradients, grouped by param
      group and step; :meth:`runs_of`); flat keys repeat across wrapped models, ids do not;
    - ``apply(shard, buf, staging, grad)``: the kernels over a whole shard whose states are
      in ``buf`` (``staging``: where the working copy is written for an NVMe home, or None;
      ``grad``: gradients read from NVMe, or None for those in RAM);
    - ``apply_unit(shard, unit, buf, out, grad)``: the same over one unit of a pipeline;
    - ``took(shard)``: the shard's states took the step (its step counts advance, a retry
      skips it);
    - ``dirty(shard)``: its working copy may not match its committed masters (restored by
      ``restore()`` or the next step); ``dirty_count()``: how many are;
    - ``done_count()``: shards that took this step so far."""

    runs: Dict[int, List[_Run]]
    stats: StepStats
    apply: Callable[[Shard, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]], None]
    apply_unit: Callable[[Shard, Unit, torch.Tensor, Optional[Window], Optional[Window]], None]
    took: Callable[[Shard], None]
    dirty: Callable[[Shard], None]
    restore: Callable[[], None]
    dirty_count: Callable[[], int]
    done_count: Callable[[], int]

    def runs_of(self, shard: Shard) -> List[_Run]:
        return self.runs[id(shard.flat)]

    def steps(self, shard: Shard) -> bool:
        """Whether ``shard`` takes this step (it has runs)."""
        return id(shard.flat) in self.runs
