"""Know your machine: probe it, estimate a model on it, plan a placement, explain the plan."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Union

from torch import nn

from ..policy import OffloadPolicy
from .estimate import Estimate, EstimateTable, estimate
from .placements import PLACEMENTS, Candidate
from .planner import Plan, PlanError, plan
from .probe import ProbeError, ProbeResult, format_probe, probe
from .shape import DecoderDims, ModelShape, decoder_dims, describe


def _with_compute_dtype(result: Plan, model: nn.Module, settings: Dict[str, Any]) -> Plan:
    """``result`` with the compute dtype wrap would choose for ``model``'s parameters, and
    why, as its last reason (runtime/build/dtypes.py)."""
    from ..runtime.build.blocks import SUPPORTED_DTYPES
    from ..runtime.build.dtypes import choose
    from ..runtime.build.dtypes import describe as describe_dtypes
    from ..runtime.core.device import resolve_device

    policy = settings.get("policy")
    if policy is None:
        policy = OffloadPolicy(
            **{k: v for k, v in settings.items() if k in OffloadPolicy.field_names()}
        )
    stored = [
        d for d in dict.fromkeys(p.dtype for p in model.parameters()) if d in SUPPORTED_DTYPES
    ]
    if not stored:
        return result
    choices = choose(policy.compute_dtype, resolve_device(policy.device), stored)
    return dataclasses.replace(result, reasons=result.reasons + (describe_dtypes(choices),))


def explain(model: Union[nn.Module, int, float], *, show: bool = True, **settings: Any) -> Plan:
    """The plan for ``model``, with its reasons: for a wrapped model the plan it got;
    otherwise the plan ``wrap(model, **settings)`` would choose (nothing is allocated or
    written). ``show``: also print it (to stdout). Its last reason says the compute dtype
    each stored dtype gets and why (``compute_dtype="auto"``: the rates compared). A wrapped
    model with a host_budget on a CPU device whose first backward ended has one more: its
    peak RSS against the host budget's bound (``infinity.stats(model)["rss_check"]``); one
    with activation offload on says what its last forward kept and offloaded."""
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
            check = engine.step.rss_bound
            measured = check.describe() if check is not None else None
            acts = engine.activations.describe() if engine.activations is not None else None
            extra = tuple(line for line in (acts, measured) if line is not None)
            if extra:
                result = dataclasses.replace(result, reasons=result.reasons + extra)
    if result is None:
        settings.pop("placement", None)
        result = plan(model, **settings)
        if isinstance(model, nn.Module):
            result = _with_compute_dtype(result, model, settings)
    if show:
        print(result, end="")  # noqa: T201 - explain's job is to show the plan
    return result


__all__ = [
    "DecoderDims",
    "Estimate",
    "EstimateTable",
    "ModelShape",
    "PLACEMENTS",
    "Candidate",
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
