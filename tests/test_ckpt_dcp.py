"""PyTorch Distributed Checkpoint (DCP) interop: an infinity checkpoint read by
``torch.distributed.checkpoint.load`` (weights exact, 8-bit moments dequantized to the
values the optimizer steps from), a DCP checkpoint of a plain model loaded into a wrapped
model (exact), and (tests/dist_helpers, gloo) a checkpoint saved by 2 ranks read by
``dcp.load`` on 3 ranks."""
from __future__ import annotations

import warnings

import pytest
import torch

import infinity
from dist_helpers import _model, run_ranks

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _train(model, opt, steps=2):
    for step in range(steps):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        torch.nn.functional.mse_loss(model(x), torch.zeros(6, 4)).backward()
        opt.step()
        opt.zero_grad()


def _load(sd, reader):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized": one process
        dcp.load(sd, storage_reader=reader)


@pytest.mark.parametrize("tier,states", [("host", "8bit"), ("nvme", "fp32")])
def test_dcp_load_reads_an_infinity_checkpoint_into_a_plain_model(tmp_path, tier, states):
    torch.manual_seed(0)
    kw = {"nvme_path": str(tmp_path), "optimizer_tier": "nvme"} if tier == "nvme" else {}
    model = infinity.wrap(_model(), param_tier=tier, **kw)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, states=states, min_8bit_size=0)
    _train(model, opt)
    ck = str(tmp_path / "ck")
    infinity.save_checkpoint(ck, model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    infinity.unwrap(model)

    torch.manual_seed(1)
    plain = _model()
    sd = plain.state_dict()
    assert any(not torch.equal(sd[k], v) for k, v in expected.items())
    _load(sd, infinity.checkpoint.dcp_reader(ck))
    for k, v in expected.items():
        assert torch.equal(sd[k], v), k
    # the optimizer's moments (8-bit: dequantized) and steps, under optim.state.<name>.*
    want = {}
    for i, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            want[f"optim.state.{name}.{key}"] = osd["state"][i][key]
        want[f"optim.state.{name}.step"] = torch.tensor(float(osd["state"][i]["step"]))
    got = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    _load(got, infinity.checkpoint.dcp_reader(ck))
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert float(got[f"optim.state.{names[0]}.step"]) == 2.0


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_dcp_checkpoint_of_a_plain_model_loads_into_a_wrapped_model(tmp_path, tier):
    from infinity.checkpoint import CheckpointMismatchError
    torch.manual_seed(0)
    plain = _model()
    ck = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": plain.state_dict()}, checkpoint_id=ck)
    torch.manual_seed(5)
    kw = {"nvme_path": str(tmp_path)} if tier == "nvme" else {}
    model = infinity.wrap(_model(), param_tier=tier, **kw)
    infinity.checkpoint.load_dcp(ck, model, prefix="model.")
    got = model.state_dict()
    for k, v in plain.state_dict().items():
        assert torch.equal(got[k], v), k
    with torch.no_grad():
        assert torch.equal(model(torch.ones(2, 8)), plain(torch.ones(2, 8)))
    infinity.unwrap(model)
    other = infinity.wrap(_model(layers=2), param_tier="host")
    with pytest.raises(CheckpointMismatchError, match="layers.2.up.weight"):
        infinity.checkpoint.load_dcp(ck, other, prefix="model.")
    infinity.unwrap(other)


def test_dcp_load_on_three_ranks_reads_a_checkpoint_saved_by_two(tmp_path):
    ck = str(tmp_path / "ck")
    saved = run_ranks("train", 2, {"steps": 3, "batch": 6, "save_sharded_to": ck}, tmp_path)
    assert all("error" not in r for r in saved), saved[0]["log"][-3000:]
    res = run_ranks("dcp_load", 3, {"from": ck}, tmp_path)
    for r in res:
        assert "error" not in r, r["log"][-3000:]
        for k, v in saved[0]["params"].items():
            assert torch.equal(r["params"][k], v), k


def test_an_fsdp2_checkpoint_loads_into_wrapped_models_on_one_and_three_ranks(tmp_path):
    """FSDP2 on 2 ranks (CPU, gloo) saves with dcp.save; one process and 3 sharded ranks load
    it into a wrapped model (infinity.checkpoint.load_dcp), weights exact."""
    ck = str(tmp_path / "fsdp2")
    saved = run_ranks("fsdp2_save", 2, {"to": ck}, tmp_path)
    assert all("error" not in r for r in saved), saved[0]["log"][-3000:]
    model = infinity.wrap(_model(), param_tier="host")
    infinity.checkpoint.load_dcp(ck, model, prefix="model.")
    got = model.state_dict()
    for k, v in saved[0]["params"].items():
        assert torch.equal(got[k], v), k
    infinity.unwrap(model)
    three = run_ranks("dcp_into_wrapped", 3, {"from": ck, "prefix": "model."}, tmp_path)
    for r in three:
        assert "error" not in r, r["log"][-3000:]
        for k, v in saved[0]["params"].items():
            assert torch.equal(r["params"][k], v), k
