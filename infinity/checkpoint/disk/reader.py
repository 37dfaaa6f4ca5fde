"""Reading a checkpoint's files, each verified (size and CRC32C) before its bytes are used."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Dict, Tuple

import torch

from .atomic import resolve
from .files import RangedFile, TensorFile, read_tensor_file
from .manifest import CorruptCheckpointError, read_manifest


class Reader:
    """Reads the checkpoint's files verified, keeping the last ``keep`` in memory."""

    def __init__(
        self, root: str, manifest: Dict[str, Any], progress: Any = None, keep: int = 2
    ) -> None:
        self.root = root
        self.files: Dict[str, Dict[str, int]] = manifest.get("files", {})
        self.progress = progress
        self.keep = keep
        self._cache: OrderedDict[str, TensorFile] = OrderedDict()
        self._ranged: Dict[str, RangedFile] = {}

    def file(self, rel: str) -> TensorFile:
        cached = self._cache.get(rel)
        if cached is not None:
            self._cache.move_to_end(rel)
            return cached
        info = self.files.get(rel)
        if info is None:
            raise CorruptCheckpointError(
                f"checkpoint {self.root}: the manifest refers to "
                f"{rel}, which it does not list among its files"
            )
        if "crc32c" in info:
            tf = read_tensor_file(os.path.join(self.root, rel), rel, info["size"], info["crc32c"])
        else:  # a reused-extent file: its header and its data section, checked apart
            start = info["data_offset"]
            tf = read_tensor_file(
                os.path.join(self.root, rel),
                rel,
                info["size"],
                parts=[
                    (0, start, info["header_crc32c"]),
                    (start, info["size"], info["data_crc32c"]),
                ],
            )
        if self.progress is not None:
            self.progress.update(info["size"])
        self._cache[rel] = tf
        while len(self._cache) > self.keep:
            self._cache.popitem(last=False)
        return tf

    def elements(self, rel: str, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of tensor ``name`` of file ``rel``: only the chunks around them are
        read and verified where the manifest has chunk checksums (files written since), else
        the whole file (cached, as :meth:`tensor`)."""
        info = self.files.get(rel)
        if info is None or "chunk_crc32c" not in info:
            return self.tensor(rel, name).reshape(-1)[a:b]
        ranged = self._ranged.get(rel)
        if ranged is None:
            ranged = RangedFile(
                os.path.join(self.root, rel),
                rel,
                info["size"],
                info["chunk_bytes"],
                info["chunk_crc32c"],
            )
            self._ranged = {rel: ranged}  # one file's last chunk in RAM
        return ranged.elements(name, a, b)

    def tensor(self, rel: str, name: str) -> torch.Tensor:
        tf = self.file(rel)
        if name not in tf:
            raise CorruptCheckpointError(
                f"checkpoint file {rel} has no tensor {name!r}, which "
                f"the manifest places there ({self.root})"
            )
        return tf.get(name)


def open_checkpoint(path: str) -> Tuple[str, Dict[str, Any]]:
    """(directory, verified manifest) of the checkpoint at ``path``."""
    root = resolve(path)
    return root, read_manifest(root)
