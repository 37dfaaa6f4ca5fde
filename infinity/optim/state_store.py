"""Where the optimizer's per-shard states live: fp32 master, exp_avg and exp_avg_sq.

One *shard* is one FlatParam (one block's parameters of one dtype). Its three fp32 states are
stored back to back in one buffer of ``3 * flat.numel`` elements ([master | exp_avg |
exp_avg_sq]) so a shard moves to or from NVMe as one aligned sequential transfer.

- :class:`HostStates`: the buffers stay in host RAM (counted in the engine's host budget).
- :class:`NvmeStates`: the buffers live in the optimizer's own SwapStore (a private directory
  under ``nvme_path``). Each shard has two extents, A and B: a step reads the committed one and
  writes the other; :meth:`NvmeStates.commit` flips them only after every write of the step
  succeeded, so a failed write (disk full, I/O error) leaves the previous states valid.

:func:`choose_tier` is the one place that decides between them.
"""
from __future__ import annotations

import errno as errno_mod
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import io as inf_io
from ..runtime.engine import Engine
from ..runtime.flat import FlatParam
from ..runtime.homes import master_is_home
from ..tiers import SwapStore

logger = logging.getLogger(__name__)

STATE_TENSORS = 3  # master, exp_avg, exp_avg_sq
_FULL_DISK = (errno_mod.ENOSPC, errno_mod.EFBIG, errno_mod.EDQUOT)


class OptimizerStateIOError(inf_io.InfinityIOError):
    """Reading or writing optimizer states on NVMe failed. The states committed by the last
    successful step stay valid; the step that failed was not applied."""


def state_nbytes(flat: FlatParam) -> int:
    return STATE_TENSORS * flat.numel * 4


def choose_tier(engine: Engine, flats: List[FlatParam]) -> str:
    """The one place the optimizer-state tier is chosen, from ``engine.policy.optimizer_tier``:
    "host" or "nvme" as given; "auto" = "nvme" when ``nvme_path`` is set and (no
    ``host_budget`` is set, or the states do not fit in what is left of it), else "host"."""
    policy = engine.policy
    if policy.optimizer_tier in ("host", "nvme"):
        return policy.optimizer_tier
    if policy.nvme_path is None:
        return "host"
    need = sum(state_nbytes(f) for f in flats)
    if policy.host_budget is None or not engine.host_budget.fits(need):
        return "nvme"
    return "host"


@dataclass
class Shard:
    """The optimizer's view of one FlatParam: which slots it steps and their step counts."""

    engine: Engine
    flat: FlatParam
    groups: List[Optional[int]]          # per slot: index of its param group, None = not ours
    steps: List[int] = field(default_factory=list)  # per slot: Adam steps taken (0 = no state)
    initialized: bool = False            # states exist (master taken from the home copy)

    def __post_init__(self) -> None:
        if not self.steps:
            self.steps = [0] * len(self.flat.slots)

    @property
    def key(self) -> str:
        return self.flat.key

    @property
    def numel(self) -> int:
        return self.flat.numel


def split_states(buf: torch.Tensor, numel: int) -> tuple:
    """(master, exp_avg, exp_avg_sq) views of one shard's state buffer."""
    return buf[:numel], buf[numel:2 * numel], buf[2 * numel:3 * numel]


def master_in_home(shard: Shard) -> bool:
    """fp32 parameters homed in host RAM are their own master weights: the optimizer keeps
    only the two moments and updates the home copy in place (no second fp32 copy, 4 bytes per
    parameter less to store and to write each step), as torch.optim does for fp32 params."""
    return master_is_home(shard.engine.home, shard.flat)


def states_of(shard: Shard, buf: torch.Tensor) -> tuple:
    """(master, exp_avg, exp_avg_sq) of a shard: the buffer holds all three, or only the
    moments when the master is the home copy itself (HostStates, :func:`master_in_home`)."""
    n = shard.numel
    if buf.numel() == 2 * n:
        return shard.engine.home.working_buffer(shard.flat), buf[:n], buf[n:]
    return split_states(buf, n)


def init_states(shard: Shard, buf: torch.Tensor, scratch: Optional[torch.Tensor]) -> None:
    """Fills ``buf`` with the shard's initial states: master = the home copy, moments = 0.
    ``scratch``: an aligned buffer of at least home_nbytes bytes, needed when params live on
    NVMe (the home copy is read through it)."""
    flat, engine = shard.flat, shard.engine
    master, m, v = states_of(shard, buf)
    if buf.numel() == 2 * shard.numel:
        pass  # the home copy is the master (HostStates of an fp32 host home)
    elif engine.working_copy_staged:
        if scratch is None:
            raise RuntimeError("init_states needs a scratch buffer for NVMe-homed parameters")
        home = scratch[:flat.home_nbytes].view(flat.home_dtype)
        engine.read_home(flat, home)
        master.copy_(home)
    else:
        engine.read_home(flat, master)  # host / device homes: a plain converting copy
    m.zero_()
    v.zero_()


class HostStates:
    """Shard states in host RAM, allocated at a shard's first step."""

    tier = "host"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._bufs: Dict[str, torch.Tensor] = {}
        self._held = 0

    def has(self, shard: Shard) -> bool:
        return shard.key in self._bufs

    def buffer(self, shard: Shard) -> torch.Tensor:
        """The shard's state buffer, created (and budgeted) on first use."""
        buf = self._bufs.get(shard.key)
        if buf is None:
            tensors = STATE_TENSORS - 1 if master_in_home(shard) else STATE_TENSORS
            nbytes = tensors * shard.numel * 4
            self.engine.host_budget.acquire(nbytes, what=f"optimizer states of {shard.key}")
            self._held += nbytes
            buf = inf_io.aligned_empty(tensors * shard.numel, torch.float32)
            self._bufs[shard.key] = buf
        return buf

    @property
    def nbytes(self) -> int:
        return self._held

    def close(self) -> None:
        self._bufs.clear()
        if self._held:
            self.engine.host_budget.release(self._held)
            self._held = 0


class NvmeStates:
    """Shard states in two extents per shard (A/B) of the optimizer's own SwapStore."""

    tier = "nvme"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.nvme_path = engine.policy.nvme_path
        self.store = SwapStore(self.nvme_path, require_direct=engine.policy.require_direct_io,
                               verify=engine.policy.verify_checksums)
        self.committed: Dict[str, int] = {}  # shard key -> 0 (A) or 1 (B)
        self._pending: Dict[str, int] = {}   # written this step, flipped by commit()

    @staticmethod
    def extent(key: str, which: int) -> str:
        return f"{key}.opt{'AB'[which]}"

    def has(self, shard: Shard) -> bool:
        return shard.key in self.committed

    def create(self, shard: Shard) -> None:
        """Preallocates both extents (ENOSPC surfaces here, before any state exists)."""
        nbytes = state_nbytes(shard.flat)
        for which in (0, 1):
            name = self.extent(shard.key, which)
            try:
                self.store.create(name, nbytes)
            except KeyError:
                continue  # already there (created by an earlier, failed attempt)
            except inf_io.InfinityIOError as exc:
                raise self.wrap_error(exc, shard, "preallocating") from exc

    def read(self, shard: Shard, buf: torch.Tensor) -> "inf_io.IOFuture":
        """Starts reading the committed states of ``shard`` into ``buf`` (3*numel fp32)."""
        return self.store.read(self.extent(shard.key, self.committed[shard.key]), buf)

    def verify(self, shard: Shard, buf: torch.Tensor) -> None:
        self.store.verify_read(self.extent(shard.key, self.committed[shard.key]), buf)

    def write(self, shard: Shard, buf: torch.Tensor) -> "inf_io.IOFuture":
        """Starts writing ``buf`` to the shard's inactive extent; visible after commit()."""
        target = 1 - self.committed[shard.key] if shard.key in self.committed else 0
        self._pending[shard.key] = target
        return self.store.write(self.extent(shard.key, target), buf)

    def write_and_commit(self, shard: Shard, buf: torch.Tensor, doing: str) -> None:
        """Writes one shard's states and commits them at once (first use, load_state_dict);
        on failure nothing is committed and the error names the shard and the disk."""
        try:
            self.write(shard, buf).wait()
        except inf_io.InfinityIOError as exc:
            self.abort()
            raise self.wrap_error(exc, shard, doing) from exc
        self.commit()

    def commit(self) -> None:
        """Makes every write of this step the committed state (call after all succeeded)."""
        self.committed.update(self._pending)
        self._pending.clear()

    def abort(self) -> None:
        """Forgets the writes of a failed step: the committed extents stay as they were."""
        self._pending.clear()

    def wrap_error(self, exc: BaseException, shard: Shard, doing: str) -> OptimizerStateIOError:
        err = getattr(exc, "errno", None) or errno_mod.EIO
        what = ("disk full: the disk under nvme_path has no space left" if err in _FULL_DISK
                else errno_mod.errorcode.get(err, f"errno {err}"))
        msg = (f"{doing} optimizer states of shard {shard.key!r} under nvme_path "
               f"{self.nvme_path!r} failed ({what}). The step was not applied; the states of "
               f"the previous step are intact. Cause: {exc}")
        return OptimizerStateIOError(err, msg, getattr(exc, "filename", None) or self.nvme_path,
                                     getattr(exc, "offset", None))

    @property
    def nbytes(self) -> int:
        return self.store.total_bytes

    def close(self) -> None:
        self.store.close()
