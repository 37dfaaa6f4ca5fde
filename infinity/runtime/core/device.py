"""The compute device: the policy's ``device``, the INFINITY_DEVICE variable, or CUDA when
available."""

from __future__ import annotations

import os
from typing import Any

import torch

DEVICE_ENV = "INFINITY_DEVICE"


def resolve_device(device: Any) -> torch.device:
    """The policy's ``device``, checked. None: the ``INFINITY_DEVICE`` environment variable
    when set (e.g. ``cpu`` to keep a GPU machine's tests on the CPU), else CUDA when
    available, else the CPU."""
    origin = f"device={device!r}"
    if device is None:
        env = os.environ.get(DEVICE_ENV, "").strip()
        if not env:
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        device, origin = env, f"{DEVICE_ENV}={env!r}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{origin} is not a device: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{origin} but CUDA is not available; use 'cpu'")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{origin} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"{origin} is not supported; use 'cuda', 'cuda:N' or 'cpu'")
    return dev
