"""The checkpoint manifest: format, errors, the JSON codec for trainer state, and its checksum.

Design notes: docs/modules.md, checkpoint/disk/manifest.py."""

from __future__ import annotations

import base64
import json
import os
from typing import Any, Dict

import numpy as np
import torch

from ... import io as inf_io

FORMAT = "infinity-checkpoint"
VERSION = 3  # 2: optimizer states may be reused-extent files (header/data CRCs);
#             3: tensors and states in pieces keyed by element ranges (saved by ranks)
MANIFEST = "manifest.json"
_CRC_KEY = "manifest_crc32c"


class CheckpointError(RuntimeError):
    """A path is not a usable infinity checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file does not match the size or checksum its manifest recorded."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was saved for another model (names or shapes differ)."""


# ---- JSON codec: tuples, tensors, arrays and non-string keys survive a round trip ------------
_TAGS = ("__tuple__", "__tensor__", "__ndarray__", "__dict__", "__bytes__", "__dtype__")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def encode(obj: Any, where: str = "value") -> Any:
    """``obj`` as plain JSON; tuples, tensors, numpy arrays, bytes, dtypes and dicts with
    non-string keys are tagged so :func:`decode` gives them back exactly."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        plain = all(isinstance(k, str) for k in obj) and not (
            len(obj) == 1 and next(iter(obj)) in _TAGS
        )
        if plain:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {
            "__dict__": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]
        }
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": {
                "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape),
                "data": _b64(raw),
            }
        }
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return {
            "__ndarray__": {"dtype": a.dtype.str, "shape": list(a.shape), "data": _b64(a.tobytes())}
        }
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": _b64(bytes(obj))}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).replace("torch.", "")}
    raise TypeError(
        f"{where} is a {type(obj).__name__}, which a checkpoint manifest cannot "
        "hold: use JSON values (numbers, strings, lists, dicts), tuples, tensors "
        "or numpy arrays"
    )


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == "__tuple__":
            return tuple(decode(v) for v in value)
        if tag == "__dict__":
            return {_hashable(decode(k)): decode(v) for k, v in value}
        if tag == "__tensor__":
            dtype = getattr(torch, value["dtype"])
            raw = bytearray(base64.b64decode(value["data"]))
            if not raw:
                return torch.empty(value["shape"], dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(value["shape"])
        if tag == "__ndarray__":
            raw = base64.b64decode(value["data"])
            return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
        if tag == "__bytes__":
            return base64.b64decode(value)
        if tag == "__dtype__":
            return getattr(torch, value)
    return {k: decode(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# ---- dtypes --------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(name: Any) -> torch.dtype:
    """A torch dtype from "bf16"/"bfloat16"/"fp16"/"float16"/"fp32"/"float32" or a dtype."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
        "fp64": "float64",
        "double": "float64",
    }
    key = aliases.get(
        str(name).lower().replace("torch.", ""), str(name).lower().replace("torch.", "")
    )
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use bf16, fp16 or fp32")
    return dtype


# ---- reading and writing the manifest --------------------------------------------------------
def _dumps(body: Dict[str, Any]) -> str:
    return json.dumps(body, indent=1)


def render_manifest(body: Dict[str, Any]) -> bytes:
    """The manifest's bytes: ``body`` plus the CRC32C of its JSON as the last key."""
    if _CRC_KEY in body:
        raise ValueError(f"{_CRC_KEY} is reserved")
    crc = inf_io.crc32c(_dumps(body).encode("utf-8"))
    return (_dumps({**body, _CRC_KEY: crc}) + "\n").encode("utf-8")


def read_manifest(directory: str) -> Dict[str, Any]:
    """The verified manifest of the checkpoint ``directory``; a damaged one raises
    CorruptCheckpointError naming the file."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"checkpoint manifest {path} is damaged (it is not valid "
            f"JSON: {exc}); the checkpoint cannot be used"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an infinity checkpoint manifest")
    crc = data.pop(_CRC_KEY, None)
    if crc is None or inf_io.crc32c(_dumps(data).encode("utf-8")) != crc:
        raise CorruptCheckpointError(
            f"checkpoint manifest {path} is damaged (its checksum does "
            "not match its content); the checkpoint cannot be used"
        )
    if data.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {data['version']}; this "
            f"infinity reads up to version {VERSION}: upgrade infinity"
        )
    return data
