"""Know your machine: probe it, estimate a model on it, plan a placement, explain the plan."""

from __future__ import annotations

from typing import Any, Optional, Union

from torch import nn

from .estimate import Estimate, EstimateTable, estimate
from .placements import PLACEMENTS, Placement
from .planner import Plan, PlanError, plan
from .probe import ProbeError, ProbeResult, format_probe, probe
from .shape import DecoderDims, ModelShape, decoder_dims, describe


def explain(model: Union[nn.Module, int, float], *, show: bool = True, **settings: Any) -> Plan:
    """The plan for ``model``, with its reasons: for a wrapped model the plan it got;
    otherwise the plan ``wrap(model, **settings)`` would choose (nothing is allocated or
    written). ``show``: also print it (to stdout)."""
    result: Optional[Plan] = None
    if isinstance(model, nn.Module):
        from ..runtime.core.registry import engine_of

        engine = engine_of(model)
        if engine is not None:
            result = getattr(engine, "plan", None)
            if result is None:
                why = getattr(engine, "unplanned", None) or "it was not planned"
                raise ValueError(
                    f"infinity.explain: this model has no plan: {why}. Unwrap it "
                    "and call infinity.explain(model, nvme_path=...) to see the "
                    "plan the planner would choose"
                )
    if result is None:
        settings.pop("placement", None)
        result = plan(model, **settings)
    if show:
        print(result, end="")  # noqa: T201 - explain's job is to show the plan
    return result


__all__ = [
    "DecoderDims",
    "Estimate",
    "EstimateTable",
    "ModelShape",
    "PLACEMENTS",
    "Placement",
    "Plan",
    "PlanError",
    "ProbeError",
    "ProbeResult",
    "decoder_dims",
    "describe",
    "estimate",
    "explain",
    "format_probe",
    "plan",
    "probe",
]
