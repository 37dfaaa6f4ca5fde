"""8-bit optimizer states give the same numbers on any world size (gloo ranks, CPU): every
parameter starts on a quantization block boundary of its flat buffer when sharded, and parts
are cut at multiples of a page of elements, so each rank's piece of a parameter quantizes in
exactly the blocks one process uses. 2 and 3 ranks equal one process on the global batch
within TOL over 10 steps (as fp32 states do: gradients are reduced in another order)."""
from __future__ import annotations

import pytest
import torch
from dist_helpers import run_ranks

STEPS, BATCH, TOL = 10, 12, 1e-5
EIGHT_BIT = {"states": "8bit", "min_8bit_size": 0}


def _opts(**extra):
    return {"steps": STEPS, "batch": BATCH, "clip": 1.0, "optim": EIGHT_BIT, **extra}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    res = run_ranks("train", 1, _opts(), tmp_path_factory.mktemp("ref8"), dist=False)[0]
    assert "error" not in res, res.get("log")
    return res


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_8bit_states_on_ranks_equal_one_process(reference, tmp_path, world):
    res = run_ranks("train", world, _opts(), tmp_path)
    for r in res:
        assert "error" not in r, r["log"][-3000:]
    diff = (torch.tensor(res[0]["losses"]) - torch.tensor(reference["losses"])).abs().max()
    assert diff.item() <= TOL, diff
    worst = max((res[0]["params"][k] - v).abs().max().item()
                for k, v in reference["params"].items())
    assert worst <= TOL, worst
    # the parts really cut parameters of more than one block (what used to shift blocks)
    fp32 = run_ranks("train", 1, {"steps": STEPS, "batch": BATCH, "clip": 1.0}, tmp_path,
                     dist=False)[0]
    moved = max((fp32["params"][k] - v).abs().max().item() for k, v in reference["params"].items())
    assert moved > 10 * TOL, "8-bit states changed nothing: the test would not see a shift"


def test_sharded_parameters_start_on_quantization_blocks():
    """Layout alone: with a partitioner, parameters of a block or more start on a block and
    every cut between 2 or 3 ranks lands on a multiple of 256 inside the parameter it splits
    (smaller parameters are never split)."""
    from torch import nn

    from infinity.ops.adam_compact import BLOCK_SIZE
    from infinity.runtime.core.flat import FlatParam
    from infinity.runtime.homes.shard_flat import ShardFlat
    mods = [nn.Linear(37, 29), nn.Linear(29, 300), nn.Linear(11, 20), nn.Linear(300, 7)]
    entries = [(f"m{i}.{n}", m, n, p) for i, m in enumerate(mods)
               for n, p in m.named_parameters()]
    for world in (2, 3):
        flat = FlatParam("blk", entries, torch.float32, torch.float32, torch.device("cpu"),
                         pad_multiple=world * 1024, elem_align=BLOCK_SIZE)
        assert all(s.offset % BLOCK_SIZE == 0 for s in flat.slots if s.numel >= BLOCK_SIZE)
        assert any(s.offset % BLOCK_SIZE for s in flat.slots)  # small ones are not padded
        n = flat.numel // world
        cut = 0
        for rank in range(world):
            for s in ShardFlat(flat, rank * n, (rank + 1) * n, rank, world).slots:
                assert s.param_start % BLOCK_SIZE == 0
                if not s.whole:
                    assert flat.slots[s.full_index].numel >= BLOCK_SIZE
                cut += s.param_start > 0
        assert cut >= 1
