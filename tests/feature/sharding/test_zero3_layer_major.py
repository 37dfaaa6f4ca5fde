"""infinity.accumulate under ZeRO-1/2/3 (2 gloo ranks): each rank's micro-batches run layer-major
and the result is the single-process plain loop's over the global batch; ranks given different
numbers of micro-batches are refused on every rank, before any collective of the step."""
import pytest
import torch
from dist_helpers import run_ranks

STEPS = 4
BATCH = 8
MICRO = 4  # per rank
TOL = 1e-5


@pytest.fixture(scope="module")
def plain_loop(tmp_path_factory):
    """The single process's plain loop over the global batch."""
    ref = run_ranks("train", 1, {"steps": STEPS, "batch": BATCH, "micro": 2 * MICRO,
                                 "clip": 1.0}, tmp_path_factory.mktemp("ref"), dist=False)[0]
    assert "error" not in ref, ref.get("log")
    return ref


@pytest.mark.parametrize("shard", ["zero3", "zero2", "zero1"])
def test_layer_major_on_ranks_matches_single_process_plain_loop(plain_loop, tmp_path, shard):
    ref = plain_loop
    results = run_ranks("train", 2, {"steps": STEPS, "batch": BATCH, "micro": MICRO,
                                     "clip": 1.0, "layer_major": True,
                                     "settings": {"shard": shard}}, tmp_path)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res['error']}\n{res['log'][-3000:]}"
    # the ranks' mean loss: each rank's micro-batches are a quarter of its half of the batch
    ref_losses = torch.tensor(ref["losses"])
    for res in results:
        assert (torch.tensor(res["losses"]) - ref_losses).abs().max().item() <= TOL
    for name, want in ref["params"].items():
        got = results[0]["params"][name]
        assert (got - want).abs().max().item() <= TOL, name
        assert torch.equal(results[1]["params"][name], got), name
    assert max((ref["params"][k] - results[0]["params"][k]).abs().max().item()
               for k in ref["params"]) < 1e-3
    # a "token" is a position of the first layer's input: here one row per micro-batch
    assert results[0]["stats"]["nvme_per_step"]["tokens"] == MICRO


def test_zero3_layer_major_different_micro_batch_counts_refused(tmp_path):
    # 10 rows a rank: 4 micro-batches on rank 0, 5 on rank 1
    results = run_ranks("train", 2, {"steps": 2, "batch": 20, "micro": MICRO,
                                     "layer_major": True, "extra_micro_ranks": [1],
                                     "settings": {"shard": "zero3"}}, tmp_path)
    for res in results:
        assert "different numbers of micro-batches (4 to 5" in res.get("error", ""), res
