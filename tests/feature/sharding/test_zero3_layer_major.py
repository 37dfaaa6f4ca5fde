"""infinity.accumulate under ZeRO-1/2/3 (2 gloo ranks): each rank's micro-batches run layer-major
and the result is the single-process plain loop's over the global batch; ranks given different
numbers of micro-batches are refused on every rank, before any collective of the step."""
import time

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


NVME_TIERS = {"nvme": True, "param_tier": "nvme", "grad_tier": "nvme", "optimizer_tier": "nvme"}


EIGHT_BIT = {"states": "8bit", "min_8bit_size": 0}


@pytest.mark.parametrize("shard,clip,optim", [("zero3", 1.0, {}), ("zero3", None, {}),
                                              ("zero2", 1.0, {}), ("zero3", 1.0, EIGHT_BIT)])
def test_step_in_backward_on_ranks_matches_step_after(tmp_path, shard, clip, optim):
    """accumulate(..., optimizer=) under ZeRO: each rank steps its part of every block from RAM
    as the block's reduce-scatter hands it over, so no gradient is written on any rank. The
    numbers are bitwise those of the same ranks' accumulate() followed by clip_grad_norm_ and
    opt.step() (the clip measured on a first pass, its norm all-reduced, and it fires)."""
    tiers = dict(NVME_TIERS, shard=shard)
    if shard == "zero2":  # zero2 keeps whole parameters on every rank: they live on host
        tiers["param_tier"] = "host"
    common = {"steps": 3, "batch": BATCH, "micro": MICRO, "layer_major": True,
              "clip": clip, "settings": tiers, "optim": optim}
    after = run_ranks("train", 2, common, tmp_path / "after")
    inside = run_ranks("train", 2, dict(common, in_backward=True), tmp_path / "inside")
    for r, res in enumerate(after + inside):
        assert "error" not in res, f"run {r}: {res['error']}\n{res['log'][-3000:]}"
    for rank in range(2):
        got, want = inside[rank], after[rank]
        assert got["losses"] == want["losses"]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), (rank, name)
        for step, (s_got, s_want) in enumerate(zip(got["steps"], want["steps"])):
            # every step was taken in backward and wrote no gradient; the step after
            # backward writes this rank's part of every gradient
            assert s_got["overlapped"] > 0, (rank, step, s_got)
            assert s_got["grads_written"] == 0, (rank, step, s_got)
            assert s_want["grads_written"] > 0, (rank, step, s_want)
            assert s_got["norm"] == s_want["norm"], (rank, step)
            if clip is not None:
                assert s_got["norm"] > clip, (rank, step)  # the clip fires
    for name, value in inside[0]["params"].items():  # the ranks agree
        assert torch.equal(inside[1]["params"][name], value), name


def test_step_in_backward_refused_on_one_rank_falls_back_on_every_rank(tmp_path):
    """One rank cannot step in backward: every rank steps after backward (the same numbers as
    the step after accumulate), with no hang and the reason logged on both."""
    common = {"steps": 2, "batch": BATCH, "micro": MICRO, "layer_major": True, "clip": 1.0,
              "settings": dict(NVME_TIERS, shard="zero3")}
    after = run_ranks("train", 2, common, tmp_path / "after")
    inside = run_ranks("train", 2, dict(common, in_backward=True, refuse_in_backward_ranks=[1]),
                       tmp_path / "inside")
    for rank, (got, want) in enumerate(zip(inside, after)):
        assert "error" not in got, f"rank {rank}: {got['error']}\n{got['log'][-3000:]}"
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), (rank, name)
        assert all(s["overlapped"] == 0 and s["grads_written"] > 0 for s in got["steps"])
    assert "(injected)" in inside[1]["log"]
    assert "another rank's step cannot be taken in backward" in inside[0]["log"]


@pytest.mark.parametrize("in_backward", [True, False])
def test_full_disk_on_one_rank_during_the_step_raises_on_every_rank(tmp_path, in_backward):
    """One rank's disk fills during its part of the step (in backward, or after it): that
    rank raises the disk error and the other raises at once, before any later collective,
    naming infinity and the remedy."""
    opts = {"steps": 3, "batch": BATCH, "micro": MICRO, "layer_major": True, "clip": 1.0,
            "in_backward": in_backward, "full_disk_ranks": [1], "full_disk_step": 1,
            "settings": dict(NVME_TIERS, shard="zero3", collective_timeout=60)}
    t0 = time.monotonic()
    results = run_ranks("train", 2, opts, tmp_path, timeout=100)
    assert time.monotonic() - t0 < 45  # not the collective timeout
    assert "No space left on device (injected)" in results[1].get("error", ""), \
        results[1]["log"][-3000:]
    err = results[0].get("error", "")
    assert "infinity.optim: the step failed on 1 other rank" in err, results[0]["log"][-3000:]
    assert "Load the last checkpoint on every rank" in err


def test_step_in_backward_checkpoint_then_train_on(tmp_path):
    """Save a sharded checkpoint right after a step taken in backward, load it into fresh
    ranks and train on in backward: the same numbers as never stopping."""
    common = {"steps": 3, "batch": BATCH, "micro": MICRO, "layer_major": True, "clip": 1.0,
              "in_backward": True, "settings": dict(NVME_TIERS, shard="zero3")}
    straight = run_ranks("train", 2, common, tmp_path / "straight")
    ck = str(tmp_path / "ck")
    first = run_ranks("train", 2, dict(common, stop=2, save_sharded_to=ck), tmp_path / "a")
    rest = run_ranks("train", 2, dict(common, start=2, load_sharded_from=ck), tmp_path / "b")
    for res in straight + first + rest:
        assert "error" not in res, f"{res['error']}\n{res['log'][-3000:]}"
    for rank in range(2):
        assert first[rank]["losses"] + rest[rank]["losses"] == straight[rank]["losses"]
        assert rest[rank]["steps"][0]["overlapped"] > 0  # the resumed step ran in backward
        for name, value in straight[rank]["params"].items():
            assert torch.equal(rest[rank]["params"][name], value), (rank, name)
