"""Keeps the engine's hooks out of torch.compile's tracing, as FSDP2 keeps its own.

Design notes: docs/modules.md, runtime/process/compile_guard.py."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_DYNAMO = "torch._dynamo"


def eager_only(fn: F) -> F:
    """``fn`` (a function, or a method defined in a class body) run outside torch.compile's
    tracing, recursively. Wrap once, where the hook's function or class is defined: the
    wrapper is shared by every hook object. It costs about 1 us per call while dynamo is not
    loaded, about 5 us once it is (``torch.compiler.disable``'s own wrapper: about 2 us)."""
    disabled = torch._disable_dynamo(fn, recursive=True)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # under tracing is_compiling() is the constant True (sys.modules is never traced, so
        # dynamo puts no guard on it): dynamo reaches `disabled` and breaks its graph there.
        # Run eagerly with dynamo loaded (a compiled model's frames run this after the break),
        # `disabled` runs fn with dynamo's frame evaluation off, so fn's frames are not compiled.
        if torch.compiler.is_compiling() or _DYNAMO in sys.modules:
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
