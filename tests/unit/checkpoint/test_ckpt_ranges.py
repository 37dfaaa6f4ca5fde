"""Ranged reads of checkpoint files: the manifest records a CRC32C per chunk of each file, so
a rank reads (and verifies) only the chunks around the element ranges it owns."""
from __future__ import annotations

import os

import pytest
import torch

from infinity.checkpoint import CorruptCheckpointError
from infinity.checkpoint.disk import files as files_mod


def test_ranged_reads_verify_only_the_chunks_they_read(tmp_path, monkeypatch):
    monkeypatch.setattr(files_mod, "CRC_CHUNK", 4096)
    a = torch.arange(5000, dtype=torch.float32)
    b = torch.arange(3000, dtype=torch.bfloat16)
    path = str(tmp_path / "f.safetensors")
    chunks: list = []
    size, _ = files_mod.write_tensor_file(path, [("a", a), ("b", b)], None, None, chunks)
    assert len(chunks) == -(-size // 4096) >= 5
    f = files_mod.RangedFile(path, "f.safetensors", size, 4096, chunks)
    assert torch.equal(f.elements("a", 1234, 4321), a[1234:4321])
    assert torch.equal(f.elements("b", 0, 3000), b)
    assert torch.equal(f.elements("a", 7, 7), a[7:7])
    with pytest.raises(CorruptCheckpointError, match="no elements"):
        f.elements("a", 10, 5001)
    # a flipped byte at the end (in b) is found by a read of b, not by a read of a's start
    with open(path, "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 1]))
    f = files_mod.RangedFile(path, "f.safetensors", size, 4096, chunks)
    assert torch.equal(f.elements("a", 0, 100), a[:100])
    with pytest.raises(CorruptCheckpointError, match=r"f\.safetensors is corrupted"):
        f.elements("b", 2990, 3000)
    with pytest.raises(CorruptCheckpointError, match="manifest recorded"):
        files_mod.RangedFile(path, "f.safetensors", size + 1, 4096, chunks)
