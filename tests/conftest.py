"""The CPU suite computes on the CPU, also on a machine with a GPU.

Its tests build models and inputs on the CPU and leave ``device`` unset, which means CUDA where
one is available. ``INFINITY_DEVICE=cpu`` (read by ``resolve_device`` when the policy has no
device) keeps them on the CPU, in this process and in the subprocesses some tests start, so
``python -m pytest`` passes unchanged on a GPU machine. tests/gpu passes ``device="cuda"``
explicitly, which the environment variable does not override.
"""
import os

import pytest

DEVICE_ENV = "INFINITY_DEVICE"


@pytest.fixture(autouse=True, scope="session")
def _compute_on_cpu():
    before = os.environ.get(DEVICE_ENV)
    os.environ[DEVICE_ENV] = "cpu"
    yield
    if before is None:
        os.environ.pop(DEVICE_ENV, None)
    else:
        os.environ[DEVICE_ENV] = before
