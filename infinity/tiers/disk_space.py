"""Free space under nvme_path, checked before any swap file is written."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Dict


def free_bytes(path: str) -> int:
    """Free bytes (for an unprivileged writer) of the filesystem holding ``path``, or of its
    nearest existing ancestor when ``path`` does not exist yet."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return shutil.disk_usage(probe).free


def check_free_space(path: str, needs: Dict[str, int], what: str) -> None:
    """Raises OSError(ENOSPC) naming infinity, the bytes by purpose, the free bytes and the
    remedies when the swap files ``needs`` lists (bytes by purpose) cannot fit under ``path``.
    Called before anything is written, so a refusal leaves the disk as it was."""
    need = sum(needs.values())
    if need <= 0:
        return
    free = free_bytes(path)
    if need > free:
        listed = " + ".join(f"{k} {v:,}" for k, v in needs.items() if v)
        raise OSError(
            errno.ENOSPC,
            f"infinity: {what} need {need:,} bytes of swap files under nvme_path "
            f"{path!r} ({listed}), but its disk has {free:,} bytes free. Free space "
            "or choose a larger disk for nvme_path, or keep less on NVMe "
            "(8-bit or bf16 optimizer states, grad_tier='host', param_tier='host')",
        )
