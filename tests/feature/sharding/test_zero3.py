"""ZeRO sharding across ranks (gloo, CPU, ranks spawned as subprocesses by
tests/helpers/dist_helpers):
parity with one process on the same global batch, per-rank memory, divergent ranks, stages,
hybrid 2-D mesh.

Tolerance: sharded runs reduce gradients in another order (reduce-scatter of per-rank means
instead of one mean over the global batch) and sum the clipping norm over ranks, so results
equal the single-process run within fp32 rounding, amplified by Adam's normalisation over 10
steps: losses within 1e-5 absolute, parameters within 1e-5 absolute (observed: <= 2e-6).
Every rank ends with bitwise identical parameters.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
from dist_helpers import run_ranks

STEPS = 10
BATCH = 12  # divides by 1, 2, 3 and 4 ranks
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run (no torch.distributed) on the global batch."""
    res = run_ranks("train", 1, {"steps": STEPS, "batch": BATCH, "clip": 1.0},
                    tmp_path_factory.mktemp("ref"), dist=False)[0]
    assert "error" not in res, res.get("log")
    return res


def _check_parity(reference, results):
    for r, res in enumerate(results):
        if "error" in res:
            raise AssertionError(f"rank {r}: {res['error']}\n{res['log'][-3000:]}")
    ref_losses = torch.tensor(reference["losses"])
    for res in results:
        diff = (torch.tensor(res["losses"]) - ref_losses).abs().max().item()
        assert diff <= TOL, f"losses differ by {diff}"
    for name, ref in reference["params"].items():
        got = results[0]["params"][name]
        diff = (got - ref).abs().max().item()
        assert diff <= TOL, f"{name} differs by {diff}"
        for res in results[1:]:
            assert torch.equal(res["params"][name], got), f"ranks disagree on {name}"
    # the parameters really moved (a no-op would also "agree")
    assert max((reference["params"][k] - results[0]["params"][k]).abs().max().item()
               for k in reference["params"]) < 1e-3


def _opts(**settings):
    return {"steps": STEPS, "batch": BATCH, "clip": 1.0, "settings": settings}


def test_zero3_two_ranks_host_parity_and_memory(reference, tmp_path):
    results = run_ranks("train", 2, dict(_opts(), probe=True), tmp_path)
    _check_parity(reference, results)
    for res in results:
        # model.state_dict() gathers the whole parameters (not the NaN outside views)
        for name, value in res["params"].items():
            assert torch.equal(res["state_dict"][name], value), name
        # a torch optimizer cannot see a rank's part of a gradient: a clear error
        assert "infinity.optim.AdamW" in res["torch_optimizer"]
    part = results[0]["partition"]
    assert part["stage"] == "zero3" and part["world"] == 2
    # per step: an all-gather of each layer in forward, in backward of each layer but the last
    # ones of forward (the prefetch window: still materialized), a reduce-scatter per block
    assert part["calls"]["all_gather"] >= STEPS * (3 + 1)
    assert part["calls"]["reduce_scatter"] == STEPS * 4  # 3 layers + the root block
    # once the schedule is recorded, the next block's all-gather starts during this one's
    assert part["early_gathers"] >= (STEPS - 1) * 4
    # each rank keeps about half of the homes, gradients and optimizer states
    ref_host = reference["tiers"]["host"]
    for res in results:
        host = res["tiers"]["host"]
        for key in ("params", "grads"):
            assert host[key] <= ref_host[key] // 2 + 4096 * 4, (key, host, ref_host)
        assert res["state_bytes"]["host"] <= reference["state_bytes"]["host"] // 2 + 4096 * 4
    total = sum(res["tiers"]["host"]["params"] for res in results)
    assert total >= ref_host["params"]  # nothing lost: the parts cover the whole


def test_zero3_three_ranks_nvme_uneven_parity(reference, tmp_path):
    """World size 3: every block's flat buffer (1,837 / 316 elements) does not divide by 3 and
    parameters straddle the parts; parameters, gradients and states on NVMe; swap directories
    named per host and rank. Each rank accumulates 2 micro-batches per step (its NVMe
    gradient file is read back and added to)."""
    results = run_ranks("train", 3, dict(_opts(nvme=True, param_tier="nvme", grad_tier="nvme",
                                               optimizer_tier="nvme"), micro=2), tmp_path)
    _check_parity(reference, results)
    dirs = [d for d in results[0]["swap_dirs"] if d.startswith("infinity-swap-")]
    for rank in range(3):
        assert any(f"-rank{rank}-" in d for d in dirs), dirs
    for res in results:
        assert res["tiers"]["nvme"]["now"] < reference["tiers"]["nvme"]["now"] or \
            reference["tiers"]["nvme"]["now"] == 0


@pytest.mark.parametrize("stage", [pytest.param("zero1", marks=pytest.mark.slow),
                                   "zero2"])
def test_zero1_zero2_parity(reference, tmp_path, stage):
    results = run_ranks("train", 2, _opts(shard=stage), tmp_path)
    _check_parity(reference, results)
    assert results[0]["partition"]["stage"] == stage
    calls = results[0]["partition"]["calls"]
    if stage == "zero1":
        assert calls["reduce_scatter"] == 0 and calls["all_reduce"] >= STEPS * 4
        # gradients whole on every rank, states halved
        assert results[0]["tiers"]["host"]["grads"] >= reference["tiers"]["host"]["grads"]
    else:
        assert calls["reduce_scatter"] == STEPS * 4
        assert results[0]["tiers"]["host"]["grads"] < reference["tiers"]["host"]["grads"]
    for res in results:
        assert res["state_bytes"]["host"] < reference["state_bytes"]["host"]
        # parameters replicated: each rank's home holds them all
        assert res["tiers"]["host"]["params"] >= reference["tiers"]["host"]["params"]


@pytest.mark.slow
def test_hybrid_2x2_mesh_parity(reference, tmp_path):
    """4 ranks as a 2-D DeviceMesh: shard within pairs, all-reduce across the two replicas."""
    results = run_ranks("train", 4, dict(_opts(), mesh=[2, 2]), tmp_path, timeout=180)
    _check_parity(reference, results)
    part = results[0]["partition"]
    assert part["world"] == 2 and part["replicas"] == 2


def test_divergent_rank_fails_fast_with_clear_error(tmp_path):
    """Rank 1 skips layer 1 in its second step: both ranks raise naming ranks and blocks,
    well before the process group's 60 s timeout (no hang)."""
    t0 = time.monotonic()
    results = run_ranks("train", 2, {"steps": 3, "batch": 4, "skip_ranks": [1],
                                     "skip_step": 1, "skip_layer": 1}, tmp_path, timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 45
    for res in results:
        err = res.get("error", "")
        assert "RanksDivergedError" in err, res.get("log", "")[-2000:]
        assert "rank 0" in err and "rank 1" in err
        # the first collective that differs names each rank's block (which one depends on
        # what is still materialized: the last blocks of forward are not gathered again)
        assert "'layers.1'" in err and ("'layers.2'" in err or "'layers.0'" in err)


@pytest.mark.slow
def test_peer_that_exits_gives_clear_error(tmp_path):
    """Rank 1 raises in its forward and its process ends: rank 0 does not hang; it gets
    an error naming the collective it waited for."""
    t0 = time.monotonic()
    results = run_ranks("train", 2, {"steps": 3, "batch": 4, "raise_ranks": [1],
                                     "raise_step": 1, "settings": {"collective_timeout": 10}},
                        tmp_path, timeout=60)
    assert time.monotonic() - t0 < 45
    assert "boom" in results[1]["error"]
    err = results[0].get("error", "")
    assert "CollectiveTimeoutError" in err or "RanksDivergedError" in err, err
    assert "infinity: rank 0" in err


def test_shard_setting_validation():
    import infinity
    with pytest.raises(ValueError, match="shard="):
        infinity.OffloadPolicy(shard="zero4")
    with pytest.raises(ValueError, match="collective_timeout"):
        infinity.OffloadPolicy(collective_timeout=0)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        infinity.wrap(model, shard="zero3")


@pytest.mark.slow
def test_peak_rss_per_rank_about_half(tmp_path):
    """A 16.8M-parameter model (67 MB fp32), host tier: each of 2 ranks' tier accounting is
    half of one process's (homes, gradients, optimizer states; +padding), and its measured
    peak RSS growth (from before wrap to the end of training, in the rank's own process) is
    half of one process's plus what ZeRO-3 adds on a rank: the device working set (a gathered
    block and the root, engine-accounted) and one block's flat fp32 gradient buffer.
    Measured on this machine: 296 MB one process, 188 MB per rank (0.64x). With a host_budget:
    without one, a CPU rank's forward and backward temporaries reuse glibc's heap as in plain
    PyTorch (runtime/process/host_memory.py), which holds more RSS (measured 251 MB per rank)."""
    opts = {"steps": 2, "batch": 4, "big": 1024, "layers": 8,
            "settings": {"host_budget": 1 << 30}}
    ref = run_ranks("train", 1, opts, tmp_path, dist=False)[0]
    results = run_ranks("train", 2, opts, tmp_path)
    assert "error" not in ref and all("error" not in r for r in results)
    ref_host = ref["tiers"]["host"]
    largest_block_grad = 4 * (2 * 1024 * 1024 + 2 * 1024)
    for res in results:
        host = res["tiers"]["host"]
        # (with a host_budget, a rank's host tier also reserves its CPU compute buffers for
        # the gathered blocks: counted in "compute", and in the RSS bound below as the device
        # working set)
        assert host["now"] - host["compute"] <= ref_host["now"] // 2 + 64 * 1024, (host,
                                                                                   ref_host)
        assert res["state_bytes"]["host"] <= ref["state_bytes"]["host"] // 2 + 64 * 1024
        growth = res["rss_growth_kb"] * 1024
        allowed = (ref["rss_growth_kb"] * 1024 // 2 + res["tiers"]["device"]["peak"]
                   + largest_block_grad + (32 << 20))
        assert growth <= allowed, (growth, allowed, ref["rss_growth_kb"] * 1024)
        assert growth < 0.8 * ref["rss_growth_kb"] * 1024


@pytest.mark.slow
def test_full_state_dict_from_two_ranks_loads_on_one_and_three(tmp_path):
    """Resharding of model weights: the whole state dict gathered on rank 0 of 2 ranks loads
    on 1 rank (no torch.distributed) and on 3 ranks with the same forward outputs, and one
    more training step from it agrees between 1 and 3 ranks. infinity.save_checkpoint works
    there (one file per rank); optimizer.state_dict() is refused with a clear error."""
    file = str(tmp_path / "full.pt")
    saved = run_ranks("save_full", 2, {"file": file}, tmp_path)
    for res in saved:
        assert "error" not in res, res["log"][-3000:]
        assert res["save_checkpoint"] == "no error"  # one file per rank (save_sharded)
        assert "infinity.sharding.save_sharded" in res["optimizer.state_dict"]
    assert saved[0]["keys"] and saved[1]["keys"] == []  # rank0_only
    one = run_ranks("load_full", 1, {"file": file}, tmp_path, dist=False)[0]
    three = run_ranks("load_full", 3, {"file": file}, tmp_path)
    assert "error" not in one and all("error" not in r for r in three), three[0]["log"]
    assert torch.equal(one["loaded"], saved[0]["output"])
    for res in three:
        assert torch.equal(res["loaded"], saved[0]["output"])
        assert (res["after"] - one["after"]).abs().max().item() <= TOL
    assert not torch.equal(one["after"], one["loaded"])  # the step changed something


@pytest.fixture(scope="module")
def checkpoint_after_5(tmp_path_factory):
    """2 ranks after 5 of 10 steps: whole model + optimizer state dicts gathered on rank 0
    (one file) and a sharded checkpoint (one file per rank)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    files = {"full": str(tmp / "ckpt.pt"), "sharded": str(tmp / "sharded")}
    first = run_ranks("train", 2, dict(_opts(), stop=5, save_to=files["full"],
                                       save_sharded_to=files["sharded"]), tmp)
    assert all("error" not in r for r in first), first[0]["log"][-3000:]
    saved = torch.load(files["full"], weights_only=False)
    assert len(saved["optim"]["state"]) == len(saved["model"])  # every parameter stepped
    assert all(int(e["step"]) == 5 for e in saved["optim"]["state"].values())
    import json
    import os
    manifest = json.load(open(os.path.join(files["sharded"], "manifest.json")))
    assert manifest["world_size"] == 2 and manifest["version"] == 3
    assert any(f.endswith("rank1-of-2.safetensors") for f in manifest["files"])
    return files


@pytest.mark.parametrize("fmt,world", [
    ("sharded", 3),
    pytest.param("sharded", 1, marks=pytest.mark.slow),
    pytest.param("full", 3, marks=pytest.mark.slow),
    pytest.param("full", 1, marks=pytest.mark.slow)])
def test_resume_from_two_ranks_on_other_world_sizes(reference, checkpoint_after_5, tmp_path,
                                                     fmt, world):
    """Resharding: the 2-rank checkpoint (sharded: one file per rank; full: gathered on rank
    0) resumes on 3 ranks and on 1 process without torch.distributed; the remaining 5 steps
    end where the uninterrupted single-process run ends (within TOL)."""
    key = "load_sharded_from" if fmt == "sharded" else "load_from"
    rest = run_ranks("train", world, dict(_opts(), start=5, **{key: checkpoint_after_5[fmt]}),
                     tmp_path, dist=world > 1)
    for r in rest:
        assert "error" not in r, r["log"][-3000:]
    diff = (torch.tensor(rest[0]["losses"])
            - torch.tensor(reference["losses"][5:])).abs().max().item()
    assert diff <= TOL, (world, diff)
    for name, ref in reference["params"].items():
        d = (rest[0]["params"][name] - ref).abs().max().item()
        assert d <= TOL, (world, name, d)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_flat_parts_cover_the_flat_buffer(world):
    """Layout alone (no processes): parts are equal, page-aligned and, concatenated in rank
    order, give the whole (padded) flat buffer; a parameter straddling parts is clipped on
    each rank, with param_start saying where its piece begins."""
    from torch import nn

    from infinity.runtime.core.flat import FlatParam
    from infinity.runtime.homes.shard_flat import ShardFlat
    torch.manual_seed(0)
    mods = [nn.Linear(37, 29), nn.Linear(29, 3)]
    entries = [(f"m{i}.{n}", m, n, p) for i, m in enumerate(mods)
               for n, p in m.named_parameters()]
    flat = FlatParam("blk", entries, torch.float32, torch.float32, torch.device("cpu"),
                     pad_multiple=world * 1024)
    assert flat.numel % (world * 1024) == 0
    whole = torch.empty(flat.numel)
    flat.gather_into(whole)
    n = flat.numel // world
    parts, straddling = [], 0
    for rank in range(world):
        local = ShardFlat(flat, rank * n, (rank + 1) * n, rank, world)
        assert local.numel == n and (local.start * 4) % 4096 == 0
        buf = torch.empty(n)
        local.gather_into(buf)
        parts.append(buf)
        for s in local.slots:
            full = flat.slots[s.full_index]
            assert local.local_index(s.full_index) is not None
            assert full.offset + s.param_start == local.start + s.offset
            straddling += not s.whole
    assert torch.equal(torch.cat(parts), whole)
    assert straddling >= 2  # m0.weight (elements 0..1072) crosses the first part boundary


def test_load_checkpoint_recognises_sharded_checkpoints_and_refuses_what_it_lacks(tmp_path):
    """infinity.load_checkpoint on a directory written by sharded ranks goes to load_sharded;
    what such a checkpoint was saved without (a scheduler) and a checkpoint of another model are
    refused with clear errors, and the model is left as it was."""
    import json

    import infinity
    from infinity.sharding import FORMAT, is_sharded_checkpoint

    ck = tmp_path / "ck"
    ck.mkdir()
    assert not is_sharded_checkpoint(str(ck))
    (ck / "manifest.json").write_text("{not json")
    assert not is_sharded_checkpoint(str(ck))
    (ck / "manifest.json").write_text(json.dumps({"format": FORMAT, "version": 1, "world": 2,
                                                  "files": [], "layout": {"other": {}},
                                                  "optimizer": False}))
    assert is_sharded_checkpoint(str(ck))
    model = infinity.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4)), param_tier="host")
    before = [p.detach().clone() for p in model.parameters()]
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0),
                                              lambda s: 1.0)
    from infinity.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="saved without a scheduler"):
        infinity.load_checkpoint(str(ck), model, scheduler=sched)
    with pytest.raises(ValueError, match="differ from this model"):
        infinity.load_checkpoint(str(ck), model)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    infinity.unwrap(model)


def _tree(path):
    """Every file under ``path`` (relative name -> bytes)."""
    import os
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def test_sharded_save_is_atomic_when_a_rank_fails_or_is_killed(reference, checkpoint_after_5,
                                                               tmp_path):
    """Saving over an existing sharded checkpoint: a rank whose file write fails (disk full)
    makes every rank raise and leaves the previous checkpoint byte for byte, with no
    temporary left; a rank killed mid-write leaves it too (rank 0 times out). The next save
    succeeds, replaces it and removes the dead save's temporary directory; training resumes
    from it on 3 ranks."""
    import os
    import shutil

    from infinity.checkpoint.load import open_checkpoint
    ck = str(tmp_path / "ck")
    shutil.copytree(checkpoint_after_5["sharded"], ck)
    before = _tree(ck)
    leftovers = lambda: [e for e in os.listdir(tmp_path) if e.startswith(".ck.")]  # noqa: E731

    failed = run_ranks("train", 2, dict(_opts(), stop=2, save_sharded_to=ck,
                                        fail_save_ranks=[1]), tmp_path / "runs")
    assert "No space left on device" in failed[1]["error"], failed[1]["log"][-2000:]
    assert "only 1 of 2 ranks wrote their file" in failed[0]["error"], failed[0]["log"][-2000:]
    assert _tree(ck) == before and leftovers() == []

    with pytest.raises(RuntimeError, match="rank 1 saved nothing"):  # its process was killed
        run_ranks("train", 2, dict(_opts(collective_timeout=8), stop=2, save_sharded_to=ck,
                                   fail_save_ranks=[1], fail_save_how="kill"),
                  tmp_path / "runs", timeout=90)
    assert _tree(ck) == before and open_checkpoint(ck)[1]["world_size"] == 2
    assert len(leftovers()) == 1  # the killed save's directory, until the next save

    saved = run_ranks("train", 2, dict(_opts(), stop=3, save_sharded_to=ck), tmp_path / "runs")
    assert all("error" not in r for r in saved), saved[0]["log"][-2000:]
    assert leftovers() == [] and _tree(ck) != before
    assert sorted(os.listdir(ck)) == ["manifest.json", "model"]
    assert any(f.endswith(".rank1-of-2.safetensors") for f in os.listdir(os.path.join(ck, "model")))
    rest = run_ranks("train", 3, dict(_opts(), start=3, load_sharded_from=ck),
                     tmp_path / "runs")
    assert all("error" not in r for r in rest), rest[0]["log"][-2000:]
    diff = (torch.tensor(rest[0]["losses"]) - torch.tensor(reference["losses"][3:])).abs()
    assert diff.max().item() <= TOL


def test_sharded_checkpoint_keeps_scheduler_rng_and_extras(tmp_path):
    """A sharded save holds the scheduler, the RNG states (each rank's own) and extra entries:
    2 ranks save after 3 steps; 2 ranks resume with the scheduler where it was and each rank's
    next random draw equal to the one it made right after the save; 1 process resumes with rank
    0's; 3 ranks asking for RNG states are refused (rank 2 had none) with a clear error."""
    ck = str(tmp_path / "ck")
    saved = run_ranks("train", 2, dict(_opts(), stop=3, sched=True, rng=True,
                                       save_sharded_to=ck), tmp_path / "a")
    assert all("error" not in r for r in saved), saved[0]["log"][-3000:]
    assert any(f.endswith(".rank1-of-2.safetensors")
               for f in os.listdir(os.path.join(ck, "model"))), "saved by 2 ranks"
    assert [r["sched_last_epoch"] for r in saved] == [3, 3]
    resumed = run_ranks("train", 2, dict(_opts(), start=3, stop=3, sched=True, rng=True,
                                         load_sharded_from=ck), tmp_path / "b")
    assert all("error" not in r for r in resumed), resumed[0]["log"][-3000:]
    for before, after in zip(saved, resumed):
        assert after["sched_last_epoch"] == 3 and after["lr"] == before["lr"]
        assert after["loaded_extra"]["note"] == "saved by 2"
        assert after["loaded_extra"]["draw"] == before["draw_after_save"]
    one = run_ranks("train", 1, dict(_opts(), start=3, stop=3, sched=True, rng=True,
                                     load_sharded_from=ck), tmp_path / "c")
    assert one[0]["loaded_extra"]["draw"] == saved[0]["draw_after_save"]
    three = run_ranks("train", 3, dict(_opts(), start=3, stop=3, sched=True, rng=True,
                                       load_sharded_from=ck), tmp_path / "d")
    assert "no RNG states for this rank" in three[2].get("error", ""), three[2].get("log")


def test_old_package_name_fails_naming_the_new_one():
    """infinity.dist (the package's old name) is gone: attribute access after ``import infinity``
    and ``import infinity.dist`` both fail with an error that names infinity.sharding."""
    import subprocess
    import sys
    code = ("import infinity\n"
            "try:\n    infinity.dist.full_state_dict\n"
            "except AttributeError as e:\n    print('attr:', e)\n"
            "try:\n    import infinity.dist\n"
            "except ImportError as e:\n    print('import:', e)\n"
            "import infinity.sharding as s\n"
            "print('sharding:', callable(s.full_state_dict))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout
    assert lines[0].startswith("attr:") and "infinity.sharding" in lines[0], lines
    assert lines[1].startswith("import:") and "infinity.sharding" in lines[1], lines
    assert lines[2] == "sharding: True", lines
