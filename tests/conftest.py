"""The CPU suite computes on the CPU, also on a machine with a GPU.

Its tests build models and inputs on the CPU and leave ``device`` unset, which means CUDA where
one is available. ``INFINITY_DEVICE=cpu`` (read by ``resolve_device`` when the policy has no
device) keeps them on the CPU, in this process and in the subprocesses some tests start, so
``python -m pytest`` passes unchanged on a GPU machine. tests/gpu passes ``device="cuda"``
explicitly, which the environment variable does not override.

``wrap`` plans placements by default (``placement="auto"``), from the probe cache. The suite
points that cache (``INFINITY_CACHE_DIR``, inherited by subprocesses) at a directory of its
own and fills it once with a quick probe of this machine and of the temp directory's disk, so
no wrap measures anything and the user's own cache is left alone.

Each test process computes on its share of the cores: the cores divided by the pytest workers
(``-n 2`` on a 2-core machine: one thread each), set before the tests run and inherited by the
subprocesses they start through ``OMP_NUM_THREADS``. Two workers of two OpenMP threads each on
two cores spend most of their CPU time spinning while they wait for each other's cores. A
user's own ``OMP_NUM_THREADS`` is kept.
"""
import os
import tempfile

import pytest
import torch

DEVICE_ENV = "INFINITY_DEVICE"
CACHE_ENV = "INFINITY_CACHE_DIR"
THREADS_ENV = "OMP_NUM_THREADS"


def _share_the_cores() -> None:
    """In a pytest-xdist worker: torch's threads, and the default for its subprocesses."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 1:
        return  # one process: torch's own default (every core)
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault(THREADS_ENV, str(max(1, cores // workers)))
    torch.set_num_threads(int(os.environ[THREADS_ENV]))


_share_the_cores()


def _restore(name, before):
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


@pytest.fixture(autouse=True, scope="session")
def _compute_on_cpu():
    before = os.environ.get(DEVICE_ENV)
    os.environ[DEVICE_ENV] = "cpu"
    yield
    _restore(DEVICE_ENV, before)


@pytest.fixture(autouse=True, scope="session")
def _probe_cache(tmp_path_factory, _compute_on_cpu):
    before = os.environ.get(CACHE_ENV)
    cache = tmp_path_factory.mktemp("infinity_cache")
    os.environ[CACHE_ENV] = str(cache)
    from infinity.plan.probe import probe
    probe(tempfile.gettempdir(), quick=True)  # the machine and the disk of the tmp dirs
    yield
    _restore(CACHE_ENV, before)
