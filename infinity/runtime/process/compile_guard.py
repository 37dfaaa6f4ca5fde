"""Keeps the engine's hooks out of torch.compile's tracing, as FSDP2 keeps its own.

The hooks move buffers between tiers, time themselves and call native code (``perf_counter``,
``ctypes``): dynamo cannot trace them and would warn, break its graphs inside them and compile
their frames. :func:`eager_only` makes a compiled model run them eagerly between its graphs.

Why not ``torch.compiler.disable`` directly: it imports ``torch._dynamo`` at once, so applied
where the hooks are defined it imported dynamo with ``import infinity``. That import costs
~70 MiB of RSS and, worse, raises glibc's dynamic mmap threshold (it frees a large buffer):
a model built after it then gets its parameters from the heap instead of mmap (73 of 217 MiB
instead of 19 for the 32-layer TinyGPT of tests/perf/test_engine_memory.py), and freeing them at
wrap leaves holes that backward's temporaries fault in again, so the peak RSS growth of NVMe
streaming went from 22% to 40-46% of the model. ``torch._disable_dynamo`` (what torch's own
optimizers use) imports dynamo only at the first call, and lives in a module dynamo skips, so a
traced hook breaks the graph there without dynamo tracing the wrapper. :func:`eager_only` calls
it only while dynamo is loaded: the hooks never import it (torch.optim's optimizers do, when
they are built, which is after the model).
"""

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
