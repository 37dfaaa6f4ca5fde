"""consolidate: a checkpoint -> a plain safetensors model in the model's own parameter names
(one file, or shards with a ``model.safetensors.index.json`` in Hugging Face's format), plus
``config.json`` when the model had a transformers config, so ``from_pretrained(out)`` works.
Streams file by file: at most two checkpoint files and one tensor being cast are in RAM."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from tqdm.auto import tqdm

from . import bnb4
from .disk.files import TensorFileWriter, aligned_order, fsync_dir, nbytes_of
from .disk.manifest import dtype_name, parse_dtype
from .disk.pieces import Source
from .load import Reader, open_checkpoint

_PROGRESS_MIN_BYTES = 1 << 30
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string such as "5GB" (10**9) or "500MiB" (2**20)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max_shard_size={size!r}: use bytes or a size like '5GB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _plan_shards(
    entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]], limit: int
) -> List[List[Tuple[str, torch.dtype, Tuple[int, ...]]]]:
    shards: List[list] = [[]]
    size = 0
    for spec in entries:
        n = nbytes_of(spec[1], spec[2])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def _remove_previous_outputs(out: str) -> None:
    for pattern in (
        "model.safetensors",
        "model-*-of-*.safetensors",
        "model.safetensors.index.json",
    ):
        for path in glob.glob(os.path.join(out, pattern)):
            os.remove(path)


def _write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def consolidate(
    checkpoint: str,
    out: str,
    dtype: Optional[Union[str, torch.dtype]] = None,
    max_shard_size: Union[int, str] = "5GB",
    quantize: Optional[str] = None,
) -> List[str]:
    """Writes the model of ``checkpoint`` to the directory ``out`` as safetensors in its own
    parameter names (tied weights once, under their first name, as transformers saves them);
    ``dtype`` casts floating-point tensors (e.g. "bf16"); above ``max_shard_size`` the weights
    are split into ``model-0000k-of-0000n.safetensors`` with a ``model.safetensors.index.json``.
    Writes ``config.json`` too when the checkpoint recorded a transformers config. Every input
    file's checksum is verified. ``quantize="nf4"`` or ``"nf4-dq"``: the layers' linear
    weights in bitsandbytes' serialized 4-bit format (double-quantized with ``"nf4-dq"``; see
    ``infinity.checkpoint.bnb4``), with a ``quantization_config`` in ``config.json``, so
    transformers loads the model with bitsandbytes and ``wrap(source=)`` reads it back.
    Returns the paths written."""
    bnb4.check(quantize)
    root, manifest = open_checkpoint(checkpoint)
    cast = parse_dtype(dtype) if dtype is not None else None
    limit = parse_size(max_shard_size)
    tensors: Dict[str, Any] = manifest["tensors"]
    entries = []
    encoded: Dict[str, str] = {}  # a file's tensor -> the weight it encodes (quantize)
    for name, info in tensors.items():
        saved = getattr(torch, info["dtype"])
        target = cast if cast is not None and saved.is_floating_point else saved
        shape = tuple(info["shape"])
        if quantize is not None and bnb4.quantized(name, shape, target):
            parts = bnb4.specs(name, shape, target, quantize == "nf4-dq")
            entries += parts
            encoded.update({key: name for key, _, _ in parts})
        else:
            entries.append((name, target, shape))
    shards = _plan_shards(entries, limit)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    out = os.path.abspath(os.fspath(out))
    os.makedirs(out, exist_ok=True)
    _remove_previous_outputs(out)
    written: List[str] = []
    total = sum(nbytes_of(d, s) for _, d, s in entries)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        leave=False,
        desc="infinity: consolidating",
        disable=total < _PROGRESS_MIN_BYTES,
    ) as bar:
        source = Source(manifest, Reader(root, manifest))
        for fname, specs in zip(names, shards):
            specs = aligned_order(specs)
            path = os.path.join(out, fname)
            tmp = os.path.join(out, f".{fname}.tmp")
            if os.path.exists(tmp):
                os.remove(tmp)
            writer = TensorFileWriter(tmp, specs, {"format": "pt"}, bar)
            try:
                # a quantized weight's tensors lie in two runs (the fp32 ones, then the
                # uint8 ones): encoded once for each, only the last weight's kept
                last: Dict[str, torch.Tensor] = {}
                for name, target, _ in specs:
                    if name in encoded:
                        if name not in last:
                            weight = encoded[name]
                            t = source.whole(weight)
                            t = t if cast is None else t.to(cast)
                            last = bnb4.encode(weight, t, quantize == "nf4-dq")
                        writer.write(name, last[name])
                        continue
                    t = source.whole(name)  # whole, or assembled from the ranks' pieces
                    writer.write(name, t if t.dtype == target else t.to(target))
                writer.close()
            except BaseException:
                writer.abort()
                os.remove(tmp)
                raise
            os.replace(tmp, path)
            written.append(path)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {
                name: fname for fname, specs in zip(names, shards) for name, _, _ in specs
            },
        }
        path = os.path.join(out, "model.safetensors.index.json")
        _write_json(path, index)
        written.append(path)
    config = manifest.get("hf_config")
    if config:
        config = dict(config)
        if cast is not None:
            for key in ("dtype", "torch_dtype"):
                if key in config or key == "dtype":
                    config[key] = dtype_name(cast)
        if quantize is not None:
            compute = (
                dtype_name(cast)
                if cast is not None
                else str(config.get("dtype") or config.get("torch_dtype") or "float32")
            )
            config["quantization_config"] = bnb4.hf_quantization_config(quantize, compute)
        path = os.path.join(out, "config.json")
        _write_json(path, config)
        written.append(path)
    fsync_dir(out)
    return written
