"""The states of parameters the optimizer steps one by one (not wrapped by ``infinity.wrap``),
like torch: one dict per parameter in ``optimizer.state`` with ``step``, the moments in the
parameter's format and, where needed, a master copy; stepped by the same kernel as a shard
(:func:`.kernels.adam_kernel`). Their 8-bit blocks start at the parameter's first element,
as a wrapped slot's."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional

import torch

from ..ops import dequantize_8bit, new_8bit_state
from .step.common import _float
from .step.kernels import adam_kernel
from .step.layout import quantize_exact


class ParamStates:
    """How an unwrapped parameter's state is made, stepped, saved and loaded, for one master
    format (``master``) and stochastic-rounding seed. Holds no state itself (the states are
    in ``optimizer.state``)."""

    def __init__(self, master: str, sr_seed: int, adamw: bool) -> None:
        self.master = master
        self.sr_seed = sr_seed
        self.adamw = adamw

    def needs_master(self, p: torch.Tensor) -> bool:
        return (
            self.master != "fp32"
            or p.dtype != torch.float32
            or p.device.type != "cpu"
            or not p.is_contiguous()
        )

    def new_master(self, value: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The master entries from fp32-convertible ``value``."""
        value = value.detach().to("cpu", torch.float32, copy=True).contiguous()
        if self.master == "fp32":
            return {"master": value}
        hi = value.to(torch.bfloat16)
        if self.master == "bf16_sr":
            return {"master": hi}
        d = value - hi.float()
        return {
            "master": hi,
            "master_comp": torch.where(torch.isfinite(d), d, torch.zeros_like(d)).bfloat16(),
        }

    @staticmethod
    def master_value(state: Dict[str, Any]) -> torch.Tensor:
        value = state["master"].float()
        comp = state.get("master_comp")
        return value + comp.float() if comp is not None else value

    @staticmethod
    def new_moments(p: torch.Tensor, fmt: str) -> Dict[str, torch.Tensor]:
        """Zero moments in format ``fmt``."""
        if fmt == "8bit":
            return new_8bit_state(p.numel())
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        return {
            "exp_avg": torch.zeros(p.shape, dtype=dtype),
            "exp_avg_sq": torch.zeros(p.shape, dtype=dtype),
        }

    def new_state(self, p: torch.Tensor, fmt: str) -> Dict[str, torch.Tensor]:
        state = {"step": torch.tensor(0.0), **self.new_moments(p, fmt)}
        if self.needs_master(p):
            state.update(self.new_master(p))
        return state

    def step(
        self,
        groups: Iterable[Dict[str, Any]],
        states: Dict[Any, Dict[str, Any]],
        skip: Callable[[torch.Tensor], bool],
        fmt_of: Callable[[torch.Tensor], str],
        index_of: Callable[[torch.Tensor], int],
        multiplier: float,
    ) -> int:
        """Steps every parameter of ``groups`` with a gradient that ``skip`` does not exclude;
        returns the elements stepped. ``fmt_of``/``index_of``: a parameter's moment format
        and stochastic-rounding element base."""
        stepped = 0
        for group in groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None or skip(p):
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("infinity.optim does not support sparse gradients")
                state = states[p]
                fmt = fmt_of(p)
                if not state:
                    state.update(self.new_state(p, fmt))
                state["step"] += 1
                master = state.get("master")
                target = master if master is not None else p.data
                out = None
                if master is not None and p.device.type == "cpu" and p.is_contiguous():
                    out = p.data
                grad = p.grad.detach()
                if grad.device.type != "cpu" or not grad.is_contiguous():
                    grad = grad.to("cpu").contiguous()
                if fmt == "8bit":
                    moments = (
                        state["exp_avg_codes"],
                        state["exp_avg_sq_codes"],
                        state["exp_avg_absmax"],
                        state["exp_avg_sq_absmax"],
                    )
                else:
                    moments = (state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1), None, None)
                comp = state.get("master_comp")
                bf16 = target.dtype != torch.float32
                adam_kernel(
                    fmt,
                    target.view(-1),
                    grad.reshape(-1),
                    moments,
                    out.view(-1) if out is not None else None,
                    comp.view(-1) if comp is not None else None,
                    seed=self.sr_seed,
                    index=index_of(p) if bf16 else 0,
                    step=int(state["step"].item()),
                    lr=_float(group["lr"]),
                    beta1=_float(beta1),
                    beta2=_float(beta2),
                    eps=_float(group["eps"]),
                    weight_decay=_float(group["weight_decay"]),
                    adamw=self.adamw,
                    grad_multiplier=multiplier,
                )
                if master is not None and out is None:
                    p.data.copy_(self.master_value(state).view_as(p))
                stepped += p.numel()
        return stepped

    def to_torch(self, p: torch.Tensor, state: Dict[str, Any]) -> Dict[str, Any]:
        """The state in torch's format (fp32 moments, dequantized; the master's fp32 value)."""
        out = {
            k: (t.clone() if isinstance(t, torch.Tensor) else t)
            for k, t in state.items()
            if k in ("step", "master")
        }
        if "master" in state and self.master != "fp32":
            out["master"] = self.master_value(state)  # its value, in fp32
        if "exp_avg_codes" in state:  # 8bit
            out["exp_avg"] = dequantize_8bit(
                state["exp_avg_codes"], state["exp_avg_absmax"], signed=True
            ).view(p.shape)
            out["exp_avg_sq"] = dequantize_8bit(
                state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], signed=False
            ).view(p.shape)
        else:
            out["exp_avg"] = state["exp_avg"].to(torch.float32, copy=True)
            out["exp_avg_sq"] = state["exp_avg_sq"].to(torch.float32, copy=True)
        return out

    def from_torch(self, p: torch.Tensor, entry: Dict[str, Any], fmt: str) -> Dict[str, Any]:
        """A state from torch's format (moments stored in ``fmt``: bf16 rounded, 8-bit
        quantized so that moments saved from 8 bits come back bitwise)."""
        state = {"step": torch.tensor(_float(entry["step"])), **self.new_moments(p, fmt)}
        m = entry["exp_avg"].detach().to("cpu", torch.float32).reshape(-1).contiguous()
        v = entry["exp_avg_sq"].detach().to("cpu", torch.float32).reshape(-1).contiguous()
        if fmt == "8bit":
            quantize_exact(m, True, state["exp_avg_codes"], state["exp_avg_absmax"])
            quantize_exact(v, False, state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"])
        else:  # fp32: a copy; bf16: rounded to nearest even
            state["exp_avg"].view(-1).copy_(m)
            state["exp_avg_sq"].view(-1).copy_(v)
        if self.needs_master(p):
            src: Optional[torch.Tensor] = entry.get("master")
            src = p.detach() if src is None else src
            state.update(self.new_master(src.reshape(p.shape)))
        elif entry.get("master") is not None:
            p.data.copy_(entry["master"])
        return state
