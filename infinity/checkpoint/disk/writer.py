"""Writing a checkpoint's files: the data files with their sizes and CRC32C (:class:`Writer`),
the manifest (:func:`write_manifest`), and what a save records beside the tensors."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from . import files as files_mod
from .files import write_tensor_file
from .manifest import MANIFEST, render_manifest

logger = logging.getLogger(__name__)


class Writer:
    """Writes the checkpoint's data files under ``root`` and records their size and CRC32C."""

    def __init__(self, root: str, progress: Any) -> None:
        self.root = root
        self.progress = progress
        self.files: Dict[str, Dict[str, int]] = {}

    def write_extent(
        self,
        rel: str,
        src: Tuple[Any, ...],
        tensors: List[Tuple[str, torch.dtype, Tuple[int, ...], int]],
        metadata: Dict[str, str],
    ) -> str:
        """A file whose data section is ``src`` = (path, nbytes, crc32c[, offset]): that many
        bytes of the file from ``offset`` (default 0), copied by the kernel; the manifest
        records the header's and the data's CRC32C apart."""
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        src_path, nbytes, data_crc = src[:3]
        src_offset = src[3] if len(src) > 3 else 0
        size, header_crc = files_mod.write_extent_file(
            path, src_path, nbytes, tensors, {"format": "pt", **metadata}, self.progress, src_offset
        )
        self.files[rel] = {
            "size": size,
            "data_offset": size - nbytes,
            "header_crc32c": header_crc,
            "data_crc32c": data_crc,
        }
        return rel

    def write(
        self,
        rel: str,
        items: List[Tuple[str, torch.Tensor]],
        metadata: Optional[Dict[str, str]] = None,
    ) -> str:
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        chunks: List[int] = []
        size, crc = write_tensor_file(
            path, items, {"format": "pt", **(metadata or {})}, self.progress, chunks
        )
        self.files[rel] = {
            "size": size,
            "crc32c": crc,
            "chunk_bytes": files_mod.CRC_CHUNK,
            "chunk_crc32c": chunks,
        }
        return rel


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.int32), b.reshape(-1).view(torch.int32)
    )


def hf_config(model: nn.Module) -> Optional[Dict[str, Any]]:
    config = getattr(model, "config", None)
    if (
        config is None
        or not hasattr(config, "to_json_string")
        or not hasattr(config, "save_pretrained")
    ):
        return None
    try:
        data = json.loads(config.to_json_string(use_diff=False))
    except Exception as exc:  # noqa: BLE001 - a config is a convenience, not the checkpoint
        logger.warning(
            "infinity: the model's config could not be saved (%s); consolidate "
            "will not write config.json",
            exc,
        )
        return None
    if not data.get("architectures"):
        data["architectures"] = [type(model).__name__]
    return data


def write_manifest(root: str, body: Dict[str, Any]) -> None:
    raw = np.frombuffer(render_manifest(body), dtype=np.uint8)
    fd = os.open(os.path.join(root, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        files_mod._write_bytes(fd, memoryview(raw))
        os.fsync(fd)
    finally:
        os.close(fd)
