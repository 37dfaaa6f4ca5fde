"""Which moment format each parameter gets: the optimizer's ``states=`` and ``min_8bit_size=``.

Design notes: docs/modules.md, optim/step/formats.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ...ops.adam_compact import BLOCK_SIZE as BLOCK  # elements per 8-bit block

STATE_FORMATS = ("fp32", "bf16", "8bit")
MIN_8BIT_SIZE = 4096  # bitsandbytes' default min_8bit_size

States = Union[str, Dict[Any, str], Callable[[nn.Parameter], Optional[str]]]

_FORMATS_TEXT = (
    "'fp32' (default: fp32 moments, 12 bytes per parameter with the fp32 "
    "master), 'bf16' (bf16 moments, 8 B/param) or '8bit' (block-wise 8-bit "
    "moments, ~6.03 B/param)"
)


def check_format(value: object, what: str = "states") -> str:
    """Validates one format name; the error names infinity and the accepted values."""
    if not isinstance(value, str) or value not in STATE_FORMATS:
        raise ValueError(f"infinity.optim: {what} must be {_FORMATS_TEXT}; got {value!r}")
    return value


def check_min_8bit_size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"infinity.optim: min_8bit_size must be an int >= 0 (elements; "
            f"bitsandbytes' default is {MIN_8BIT_SIZE}), got {value!r}"
        )
    return value


def moment_nbytes(numel: int, fmt: str) -> int:
    """Bytes of one parameter's two moments in ``fmt`` (8bit: codes plus one fp32 absmax per
    256-element block of each moment, blocks starting at the parameter's first element)."""
    if fmt == "fp32":
        return 8 * numel
    if fmt == "bf16":
        return 4 * numel
    check_format(fmt)
    return 2 * numel + 8 * -(-numel // BLOCK)


@dataclass(frozen=True)
class Choice:
    """A parameter's format and why: "default", "explicit", "min_8bit_size", "embedding"."""

    fmt: str
    reason: str


class FormatSpec:
    """The resolved ``states=`` / ``min_8bit_size=`` of one optimizer (see the module
    docstring). :meth:`choose` gives one parameter's format from its number of elements and,
    where known, the modules that own it directly."""

    def __init__(self, states: States = "fp32", min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        self.min_8bit_size = check_min_8bit_size(min_8bit_size)
        self.default = "fp32"
        self._fn: Optional[Callable[[nn.Parameter], Optional[str]]] = None
        self._named: Dict[int, Tuple[str, Tuple[int, int]]] = {}  # id(param) -> fmt, rank
        self._keep: List[torch.Tensor] = []  # the named parameters (their ids stay theirs)
        if states is None or isinstance(states, (str, int, float, torch.dtype)):
            self.default = check_format(states)
            self.kind = "uniform"
        elif isinstance(states, dict):
            self.kind = "dict"
            self._from_dict(states)
        elif callable(states):
            self.kind = "callable"
            self._fn = states
        else:
            raise ValueError(
                f"infinity.optim: states must be {_FORMATS_TEXT}, a dict "
                "{parameter | module | 'default': format} or a callable "
                f"f(param) -> format or None; got {type(states).__name__} "
                f"{states!r}"
            )

    def _from_dict(self, states: Dict[Any, str]) -> None:
        modules = []
        for n, (key, value) in enumerate(states.items()):
            if isinstance(key, str):
                if key != "default":
                    raise ValueError(
                        f"infinity.optim: the only string key of states= is "
                        f"'default'; got {key!r} (use the nn.Parameter or "
                        "nn.Module object itself as the key)"
                    )
                self.default = check_format(value, "states['default']")
            elif isinstance(key, torch.Tensor):  # an nn.Parameter
                fmt = check_format(
                    value, f"the states= value of a parameter of shape {tuple(key.shape)}"
                )
                self._named[id(key)] = (fmt, (0, n))  # a parameter key beats module keys
                self._keep.append(key)
            elif isinstance(key, nn.Module):
                fmt = check_format(value, f"the states= value of module {type(key).__name__}")
                modules.append((key, fmt, n))
            else:
                raise TypeError(
                    f"infinity.optim: a states= dict key must be an nn.Parameter, "
                    f"an nn.Module or 'default'; got {type(key).__name__} {key!r}"
                )
        for module, fmt, n in modules:
            params = list(module.parameters())
            rank = (1 + len(params), -n)  # innermost (fewest parameters) first, then later
            for p in params:
                old = self._named.get(id(p))
                if old is None or rank < old[1]:
                    self._named[id(p)] = (fmt, rank)
                    self._keep.append(p)

    def requested(self, param: torch.Tensor) -> Tuple[str, bool]:
        """The format asked for ``param`` before the safeguards, and whether a dict key named
        it (the parameter or one of its modules)."""
        if self._fn is not None:
            fmt = self._fn(param)
            if fmt is None:
                return self.default, False
            return check_format(
                fmt,
                f"the format returned by the states= callable for a "
                f"parameter of shape {tuple(param.shape)}",
            ), False
        named = self._named.get(id(param))
        return (named[0], True) if named is not None else (self.default, False)

    def choose(
        self,
        param: torch.Tensor,
        numel: Optional[int] = None,
        owners: Optional[Sequence[nn.Module]] = None,
    ) -> Choice:
        """``param``'s format. ``numel``: its number of elements (default ``param.numel()``;
        a sharded slot passes the whole parameter's); ``owners``: the modules holding it
        directly (None: unknown, the embedding rule cannot apply)."""
        numel = param.numel() if numel is None else numel
        fmt, explicit = self.requested(param)
        if fmt != "8bit":
            return Choice(fmt, "explicit" if explicit else "default")
        if numel < self.min_8bit_size:
            return Choice("fp32", "min_8bit_size")
        if not explicit and owners and any(isinstance(m, nn.Embedding) for m in owners):
            return Choice("fp32", "embedding")
        return Choice(fmt, "explicit" if explicit else "default")


def param_owners(model: nn.Module) -> Dict[int, List[nn.Module]]:
    """id(parameter) -> the modules of ``model`` that hold it directly (a tied weight has
    several)."""
    owners: Dict[int, List[nn.Module]] = {}
    for module in model.modules():
        for _, p in module.named_parameters(recurse=False):
            mods = owners.setdefault(id(p), [])
            if not any(m is module for m in mods):
                mods.append(module)
    return owners


def formats_for(
    model: nn.Module,
    states: States = "fp32",
    min_8bit_size: int = MIN_8BIT_SIZE,
    params: Optional[Iterable[torch.Tensor]] = None,
) -> Dict[str, str]:
    """The moment format ``infinity.optim.AdamW(params, states=states,
    min_8bit_size=min_8bit_size)`` gives each parameter of ``model`` once the model is wrapped
    (its modules known): ``{qualified name: format}`` (a tied parameter under its first name).
    Works on models built on meta (``infinity.empty_init()``). ``params``: only these."""
    spec = FormatSpec(states, min_8bit_size)
    owners = param_owners(model)
    wanted = None if params is None else {id(p) for p in params}
    out: Dict[str, str] = {}
    for name, p in model.named_parameters():
        if wanted is None or id(p) in wanted:
            out[name] = spec.choose(p, p.numel(), owners.get(id(p), [])).fmt
    return out


def format_summary(numels_and_formats: Iterable[Tuple[int, str]]) -> Dict[str, Dict[str, int]]:
    """``{format: {"params": count, "numel": elements, "moment_bytes": bytes}}`` of
    (numel, format) pairs (each parameter once), formats present only."""
    out: Dict[str, Dict[str, int]] = {}
    for numel, fmt in numels_and_formats:
        row = out.setdefault(fmt, {"params": 0, "numel": 0, "moment_bytes": 0})
        row["params"] += 1
        row["numel"] += int(numel)
        row["moment_bytes"] += moment_nbytes(int(numel), fmt)
    return {f: out[f] for f in STATE_FORMATS if f in out}


def model_state_bytes(
    model: nn.Module, states: States = "fp32", min_8bit_size: int = MIN_8BIT_SIZE
) -> Dict[str, Dict[str, int]]:
    """:func:`format_summary` of a model's trainable parameters under ``states=`` (what an
    estimate needs: moment bytes per format; add the masters' bytes, 4 B/param for fp32)."""
    fmts = formats_for(model, states, min_8bit_size)
    sizes = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    return format_summary((sizes[n], f) for n, f in fmts.items() if n in sizes)


__all__ = [
    "STATE_FORMATS",
    "MIN_8BIT_SIZE",
    "FormatSpec",
    "Choice",
    "check_format",
    "formats_for",
    "format_summary",
    "model_state_bytes",
    "moment_nbytes",
    "param_owners",
]
