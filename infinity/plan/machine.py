"""Who this machine is: CPU model, RAM, GPU, and the disk behind a path. The probe cache is
keyed by it, so a cache copied from another machine (or a disk swapped) is measured again."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import Any, Dict, Optional

import psutil
import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> Optional[str]:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory // (1 << 20)} MiB)"


def machine_identity() -> Dict[str, Any]:
    """What the compute and memory figures depend on."""
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "ram_bytes": int(psutil.virtual_memory().total),
        "gpu": gpu_name(),
        "torch": torch.__version__.split("+")[0],
    }


def _sysfs_read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def disk_identity(path: str) -> Dict[str, Any]:
    """The block device (major:minor, kernel name, model where sysfs tells) and the filesystem
    type holding ``path``."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    base = f"/sys/dev/block/{major}:{minor}"
    name = None
    uevent = _sysfs_read(f"{base}/uevent")
    if uevent:
        for line in uevent.splitlines():
            if line.startswith("DEVNAME="):
                name = line.split("=", 1)[1]
    model = _sysfs_read(f"{base}/device/model") or _sysfs_read(f"{base}/../device/model")
    fstype = None
    best = -1
    real = os.path.realpath(path)
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) > best:
            best, fstype = len(mp), part.fstype
    return {"dev": f"{major}:{minor}", "name": name, "model": model, "fs": fstype}


def key_of(identity: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
