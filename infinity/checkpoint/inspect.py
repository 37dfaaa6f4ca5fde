"""``infinity ckpt inspect PATH``: what a checkpoint holds and whether it verifies.

Design notes: docs/modules.md, checkpoint/inspect.py."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any, Dict, List

from .disk.atomic import resolve
from .disk.manifest import MANIFEST, CheckpointError, read_manifest
from .load import Reader


def inspect_checkpoint(path: str, verify: bool = True) -> Dict[str, Any]:
    """A summary dict: kind ("single": one process; "ranks": saved by sharded ranks, one
    file per rank and flat; "sharded": the earlier per-rank format), world size, model class, wrapped / tier,
    tensors and their dtypes, bytes, optimizer (format, states, steps), trainer state present,
    and ``verified`` (True, or False with ``problems`` naming each bad file)."""
    root = resolve(path)
    with open(os.path.join(root, MANIFEST), "rb") as fh:
        raw = json.loads(fh.read().decode("utf-8"))
    if "world" in raw and "world_size" not in raw:
        return _sharded(root, raw, verify)
    manifest = read_manifest(root)  # raises on a damaged manifest
    files = manifest.get("files", {})
    tensors = manifest.get("tensors", {})
    out: Dict[str, Any] = {
        "path": root,
        "kind": "single" if manifest.get("world_size", 1) == 1 else "ranks",
        "format_version": manifest.get("version"),
        "infinity_version": manifest.get("infinity_version"),
        "created": manifest.get("created"),
        "model_class": manifest.get("model_class"),
        "world_size": manifest.get("world_size", 1),
        "wrapped": manifest.get("wrapped"),
        "param_tier": manifest.get("param_tier"),
        "tensors": len(tensors),
        "dtypes": dict(Counter(t.get("dtype") for t in tensors.values())),
        "files": len(files),
        "bytes": sum(int(f.get("size", 0)) for f in files.values()),
        "scheduler": manifest.get("scheduler") is not None,
        "scaler": manifest.get("scaler") is not None,
        "rng": manifest.get("rng") is not None,
    }
    opt = manifest.get("optimizer")
    if opt:
        states = opt.get("states", {}) if isinstance(opt, dict) else {}
        steps = sorted(
            {
                int(v.get("values", {}).get("step", 0))
                for v in states.values()
                if isinstance(v, dict)
            }
        )
        out["optimizer"] = {
            "class": opt.get("class") if isinstance(opt, dict) else None,
            "states": len(states),
            "steps": steps[-1] if steps else None,
            "moments": "fp32 (any state format is saved widened to fp32)",
        }
    else:
        out["optimizer"] = None
    problems: List[str] = []
    if verify:
        reader = Reader(root, manifest, keep=1)
        for rel in files:
            try:
                reader.file(rel)
            except (CheckpointError, OSError, ValueError) as exc:
                problems.append(f"{rel}: {exc}")
    out["verified"] = (not problems) if verify else None
    out["problems"] = problems
    return out


def _sharded(root: str, raw: Dict[str, Any], verify: bool) -> Dict[str, Any]:
    problems = []
    sizes = 0
    for rel in raw.get("files", []):
        p = os.path.join(root, rel)
        if not os.path.isfile(p):
            problems.append(f"{rel}: missing")
        else:
            sizes += os.path.getsize(p)
    return {
        "path": root,
        "kind": "sharded",
        "format_version": raw.get("version"),
        "world_size": raw.get("world"),
        "files": len(raw.get("files", [])),
        "bytes": sizes,
        "flats": len(raw.get("layout", {})),
        "optimizer": bool(raw.get("optimizer")),
        "verified": (not problems) if verify else None,
        "problems": problems,
        "note": "rank files carry no recorded checksum: presence checked only",
    }


def format_inspection(info: Dict[str, Any]) -> str:
    lines = [
        f"{info['path']}: infinity checkpoint ({info['kind']}, format "
        f"{info.get('format_version')}), saved with world size {info.get('world_size')}"
    ]
    for key in (
        "model_class",
        "created",
        "infinity_version",
        "wrapped",
        "param_tier",
        "tensors",
        "dtypes",
        "flats",
        "files",
        "bytes",
        "optimizer",
        "scheduler",
        "scaler",
        "rng",
        "note",
    ):
        if key in info and info[key] is not None:
            lines.append(f"  {key}: {info[key]}")
    if info["verified"] is None:
        lines.append("  verified: not checked (--no-verify)")
    elif info["verified"]:
        lines.append("  verified: every file matches its recorded size and checksum")
    else:
        lines.append(f"  verified: NO, {len(info['problems'])} problem(s):")
        lines.extend(f"    {p}" for p in info["problems"])
    return "\n".join(lines) + "\n"
