"""One checkpoint format for every topology and placement (gloo ranks, CPU, spawned by
tests/helpers/dist_helpers): saved by 1, 2 or 3 ranks after 5 of 8 steps (one process: the
single-process save; ranks: each its part), with parameters and optimizer states on NVMe or
in host RAM, and resumed on 1, 2 or 3 ranks with the other placement. The 3 remaining steps
equal the uninterrupted single-process run on the global batch within TOL (fp32 states:
sharded runs reduce gradients in another order; see tests/feature/sharding/test_zero3.py).

The whole 3 x 3 matrix is marked slow; CI runs every save world size into 2 ranks."""
from __future__ import annotations

import json
import os

import pytest
import torch
from dist_helpers import run_ranks

STEPS, BATCH, SAVE_AT, TOL = 8, 12, 5, 1e-5
NVME = {"nvme": True, "param_tier": "nvme", "grad_tier": "nvme", "optimizer_tier": "nvme"}
HOST = {"param_tier": "host", "optimizer_tier": "host"}
SAVED_ON = {1: "nvme", 2: "host", 3: "nvme"}  # world size -> placement of the saving run


def _opts(**extra):
    return {"steps": STEPS, "batch": BATCH, "clip": 1.0, **extra}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    res = run_ranks("train", 1, _opts(), tmp_path_factory.mktemp("ref"), dist=False)[0]
    assert "error" not in res, res.get("log")
    return res


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """world size -> checkpoint after SAVE_AT steps."""
    tmp = tmp_path_factory.mktemp("saves")
    out = {}
    for world, where in SAVED_ON.items():
        path = str(tmp / f"ck{world}")
        settings = dict(NVME if where == "nvme" else HOST)
        res = run_ranks("train", world, _opts(stop=SAVE_AT, save_sharded_to=path,
                                              settings=settings), tmp, dist=world > 1)
        for r in res:
            assert "error" not in r, r["log"][-3000:]
        manifest = json.load(open(os.path.join(path, "manifest.json")))
        assert manifest["format"] == "infinity-checkpoint"
        assert manifest["world_size"] == world
        out[world] = path
        out[f"params{world}"] = res[0]["params"]  # the weights it saved
    return out


def _resume(reference, saved, tmp_path, world):
    worlds = sorted(SAVED_ON)
    loads = [{"from": saved[w], "nvme": SAVED_ON[w] == "host"} for w in worlds]
    res = run_ranks("resume_many", world, _opts(start=SAVE_AT, stop=STEPS, loads=loads),
                    tmp_path, dist=world > 1, timeout=240)
    for r in res:
        assert "error" not in r, r["log"][-3000:]
    ref_losses = torch.tensor(reference["losses"][SAVE_AT:])
    for k, w in enumerate(worlds):
        case = f"saved by {w} ({SAVED_ON[w]}) -> {world} ranks"
        run = res[0]["runs"][k]
        diff = (torch.tensor(run["losses"]) - ref_losses).abs().max().item()
        assert diff <= TOL, (case, diff)
        worst = max((run["params"][n] - ref).abs().max().item()
                    for n, ref in reference["params"].items())
        assert worst <= TOL, (case, worst)
        for other in res[1:]:
            for n, v in other["runs"][k]["params"].items():
                assert torch.equal(v, run["params"][n]), (case, n)


def test_resume_into_two_ranks_from_every_world_size(reference, saved, tmp_path):
    _resume(reference, saved, tmp_path, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_resume_matrix(reference, saved, tmp_path, world):
    _resume(reference, saved, tmp_path, world)


def _wrapped(layers=3):
    from dist_helpers import _model

    import infinity
    torch.manual_seed(7)
    return infinity.wrap(_model(layers=layers), param_tier="host")


def test_checkpoint_saved_by_ranks_is_inspected_verified_and_checked(saved, tmp_path):
    """In this process: `infinity ckpt inspect` reports the world size; a flipped byte in one
    rank's file is detected and the file named; a model with other parameters is refused
    with the differing names listed, and left as it was."""
    import shutil

    import infinity
    from infinity.checkpoint import CheckpointMismatchError, CorruptCheckpointError
    from infinity.checkpoint.inspect import inspect_checkpoint
    info = inspect_checkpoint(saved[3])
    assert info["world_size"] == 3 and info["kind"] == "ranks" and info["verified"]
    model = _wrapped()
    infinity.load_checkpoint(saved[3], model)  # 3 ranks -> 1 process, weights only
    infinity.unwrap(model)

    ck = str(tmp_path / "ck")
    shutil.copytree(saved[2], ck)
    victim = sorted(f for f in os.listdir(os.path.join(ck, "model")) if "rank1-of-2" in f)[0]
    with open(os.path.join(ck, "model", victim), "r+b") as fh:
        fh.seek(-5, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-5, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0x40]))
    info = inspect_checkpoint(ck)
    assert not info["verified"] and victim in info["problems"][0]
    model = _wrapped()
    with pytest.raises(CorruptCheckpointError, match=victim.replace(".", r"\.")):
        infinity.load_checkpoint(ck, model)
    infinity.unwrap(model)

    other = _wrapped(layers=2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as err:
        infinity.load_checkpoint(saved[2], other)
    assert "unexpected in the checkpoint (4): layers.2.up.weight" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    infinity.unwrap(other)


def test_checkpoint_in_the_earlier_per_rank_format_resumes_on_two_ranks(reference, tmp_path):
    """A checkpoint in the per-rank format of earlier versions (its flats laid out with
    parameters 16-element aligned) resumes on 2 ranks, whose flats now align parameters to
    8-bit blocks: loaded parameter by parameter, equal to the uninterrupted run."""
    ck = str(tmp_path / "legacy")
    first = run_ranks("train", 1, _opts(stop=SAVE_AT, legacy_to=ck), tmp_path, dist=False)
    assert "error" not in first[0], first[0]["log"][-3000:]
    rest = run_ranks("train", 2, _opts(start=SAVE_AT, load_sharded_from=ck), tmp_path)
    for r in rest:
        assert "error" not in r, r["log"][-3000:]
    diff = (torch.tensor(rest[0]["losses"])
            - torch.tensor(reference["losses"][SAVE_AT:])).abs().max().item()
    assert diff <= TOL, diff
    worst = max((rest[0]["params"][n] - ref).abs().max().item()
                for n, ref in reference["params"].items())
    assert worst <= TOL, worst


def test_consolidate_a_checkpoint_saved_by_ranks(saved, tmp_path):
    """HF export from the one format: the pieces of 3 ranks consolidate into one safetensors
    file equal to the weights they saved."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    import infinity
    out = tmp_path / "hf"
    infinity.consolidate(saved[3], str(out))
    got = safetensors_torch.load_file(str(out / "model.safetensors"))
    want = saved["params3"]
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
