"""PyTorch Distributed Checkpoint (DCP) interop: an infinity checkpoint read by
``torch.distributed.checkpoint.load`` (weights exact, 8-bit moments dequantized to the
values the optimizer steps from), a DCP checkpoint of a plain model loaded into a wrapped
model (exact), and (tests/helpers/dist_helpers, gloo) a checkpoint saved by 2 ranks read by
``dcp.load`` on 3 ranks."""
from __future__ import annotations

import warnings

import pytest
import torch
from dist_helpers import _model, run_ranks

import infinity

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


# ---- save_dcp: a wrapped model written for plain torch.distributed.checkpoint.load ----------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from engine_helpers import SMALL, batches, loss_of  # noqa: E402
from rss_helpers import run_rss_child  # noqa: E402

from infinity.checkpoint import CheckpointError  # noqa: E402
from infinity.models import GPTConfig, TinyGPT  # noqa: E402


def _llama(seed):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).float()


def _tiny_of(cfg, seed):
    torch.manual_seed(seed)
    return TinyGPT(cfg)


def _tiny(seed):
    return _tiny_of(SMALL, seed)


def _steps(model, kind, opt, n, seed=1):
    """``n`` training steps; the losses."""
    losses = []
    if kind == "gpt":
        data = batches(SMALL, n, seed=seed)
    else:
        g = torch.Generator().manual_seed(seed)
        data = [torch.randint(0, 96, (2, 12), generator=g) for _ in range(n)]
    for item in data:
        loss = loss_of(model, *item) if kind == "gpt" else \
            model(input_ids=item, labels=item).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _wrap(model, tier, tmp_path):
    kw = {}
    if tier == "nvme":
        swap = tmp_path / f"swap-{id(model)}"
        swap.mkdir()
        kw = {"nvme_path": str(swap)}
    return infinity.wrap(model, param_tier=tier, **kw)


def _plain_load(model, path, prefix=""):
    sd = {prefix + k: v for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming ... a single process"
        dcp.load(sd, checkpoint_id=path)
    model.load_state_dict({k[len(prefix):]: v for k, v in sd.items()})
    return model.state_dict()


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_save_dcp_of_a_wrapped_model_loads_into_a_plain_model_with_plain_dcp(tmp_path, kind,
                                                                            tier):
    make = _tiny if kind == "gpt" else _llama
    model = _wrap(make(0), tier, tmp_path)
    _steps(model, kind, infinity.optim.AdamW(model.parameters(), lr=1e-2), 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ck = infinity.checkpoint.save_dcp(str(tmp_path / "dcp"), model)
    assert ck == str(tmp_path / "dcp")
    files = os.listdir(ck)
    assert ".metadata" in files and any(f.endswith(".distcp") for f in files), files
    infinity.unwrap(model)
    plain = make(7)
    assert any(not torch.equal(v, expected[k]) for k, v in plain.state_dict().items())
    got = _plain_load(plain, ck)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert v.dtype == torch.float32 and torch.equal(got[k], v), k
    if kind == "gpt":  # tied: both names hold the one tensor
        assert torch.equal(got["lm_head.weight"], got["tok.weight"])


_NO_INFINITY_CHILD = r"""
import sys, warnings, torch, transformers
import torch.distributed.checkpoint as dcp
torch.manual_seed(7)
cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=32)
model = transformers.LlamaForCausalLM(cfg).float()
sd = {"model." + k: v for k, v in model.state_dict().items()}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.load(sd, checkpoint_id=sys.argv[1])
if any(m == "infinity" or m.startswith("infinity.") for m in sys.modules):
    raise SystemExit("infinity was imported")
torch.save(sd, sys.argv[2])
"""


def test_a_process_without_infinity_loads_save_dcp_under_a_prefix(tmp_path):
    pytest.importorskip("transformers")
    model = _wrap(_llama(0), "nvme", tmp_path)
    _steps(model, "llama", infinity.optim.AdamW(model.parameters(), lr=1e-2), 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ck = infinity.checkpoint.save_dcp(str(tmp_path / "dcp"), model, prefix="model.")
    out = str(tmp_path / "loaded.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", _NO_INFINITY_CHILD, ck, out], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(out)
    assert set(got) == {"model." + k for k in expected}
    for k, v in expected.items():
        assert torch.equal(got["model." + k], v), k
    infinity.unwrap(model)


@pytest.mark.parametrize("tiers", [("host", "nvme"), ("nvme", "host")])
def test_save_dcp_then_load_dcp_trains_as_without_the_round_trip(tmp_path, tiers):
    """save_dcp -> load_dcp into a fresh wrapped model (other tier), then 2 steps with a new
    optimizer: losses and weights bitwise equal to the same 2 steps on the saved model."""
    saved = _wrap(_tiny(0), tiers[0], tmp_path)
    _steps(saved, "gpt", infinity.optim.AdamW(saved.parameters(), lr=1e-2), 2)
    ck = infinity.checkpoint.save_dcp(str(tmp_path / "dcp"), saved)
    fresh = _wrap(_tiny(5), tiers[1], tmp_path)
    infinity.checkpoint.load_dcp(ck, fresh)
    want = _steps(saved, "gpt", infinity.optim.AdamW(saved.parameters(), lr=1e-2), 2, seed=9)
    got = _steps(fresh, "gpt", infinity.optim.AdamW(fresh.parameters(), lr=1e-2), 2, seed=9)
    assert [torch.equal(a, b) for a, b in zip(got, want)] == [True, True], (got, want)
    a, b = saved.state_dict(), fresh.state_dict()
    for k, v in a.items():
        assert torch.equal(b[k], v), k
    infinity.unwrap(saved)
    infinity.unwrap(fresh)


def test_save_dcp_errors_and_atomic_replacement(tmp_path, monkeypatch):
    from infinity.checkpoint import dcp_write
    model = _wrap(_tiny(0), "host", tmp_path)
    with pytest.raises(TypeError, match="save_dcp expects an nn.Module"):
        infinity.checkpoint.save_dcp(str(tmp_path / "x"), {"w": torch.ones(2)})
    afile = tmp_path / "afile"
    afile.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="it is a file, not a checkpoint"):
        infinity.checkpoint.save_dcp(str(afile), model)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"non-empty directory that is not a checkpoint "
                                              r"\(no \.metadata\)"):
        infinity.checkpoint.save_dcp(str(other), model)
    assert (other / "notes.txt").read_text() == "keep me"
    with pytest.raises(CheckpointError, match="not a torch.distributed.checkpoint directory"):
        infinity.checkpoint.load_dcp(str(tmp_path / "missing"), model)

    ck = str(tmp_path / "dcp")
    infinity.checkpoint.save_dcp(ck, model)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    _steps(model, "gpt", infinity.optim.AdamW(model.parameters(), lr=1e-2), 1)
    calls = []
    real = dcp_write._ModelTensors.value

    def failing(self, name):
        calls.append(name)
        if len(calls) == 5:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, name)

    monkeypatch.setattr(dcp_write._ModelTensors, "value", failing)
    with pytest.raises(OSError, match="simulated"):
        infinity.checkpoint.save_dcp(ck, model)
    monkeypatch.undo()
    assert len(calls) == 5
    assert sorted(os.listdir(tmp_path)) == ["afile", "dcp", "other"]  # no temporaries left
    got = _plain_load(_tiny(3), ck)  # the previous checkpoint, intact
    for k, v in first.items():
        assert torch.equal(got[k], v), k
    infinity.checkpoint.save_dcp(ck, model)  # replacing a DCP checkpoint
    got = _plain_load(_tiny(3), ck)
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k
    assert not any(torch.equal(got[k], v) for k, v in first.items() if k.endswith("fc.weight"))
    # a crash between the two renames of a replacement: load_dcp reads the one kept aside
    from infinity.checkpoint.disk.atomic import aside_path
    os.rename(ck, aside_path(ck))
    fresh = _wrap(_tiny(4), "host", tmp_path)
    infinity.checkpoint.load_dcp(ck, fresh)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    infinity.unwrap(fresh)
    infinity.unwrap(model)


_RSS_CHILD = r"""
import json, os, sys, torch, infinity
from infinity.models import GPTConfig, TinyGPT
from infinity.runtime.engine import engine_of
tier, swap, ck = sys.argv[1:4]
torch.manual_seed(0)
model = TinyGPT(GPTConfig(vocab_size=256, d_model=1024, n_layers=6, n_heads=8, max_seq=64))
os.makedirs(swap)
kw = {"nvme_path": swap} if tier == "nvme" else {}
infinity.wrap(model, param_tier=tier, **kw)
flats = engine_of(model).flats
block = max(f.numel * f.home_itemsize for f in flats)
total = sum(f.numel * f.home_itemsize for f in flats)
param = max(p.numel() * 4 for p in model.parameters())
with torch.no_grad():  # the engine's working set (its buffers, prefetch) is in place
    model(torch.zeros(1, 8, dtype=torch.long))
engine_of(model).quiesce()  # the prefetch this forward started has landed
# torch.distributed.checkpoint's lazy imports and first-call costs are not the save's
infinity.checkpoint.save_dcp(ck + "-warm", torch.nn.Linear(4, 4))
growth = []
for _ in range(2):  # a first save and one replacing it
    reset_peak()
    before = status("VmRSS")
    infinity.checkpoint.save_dcp(ck, model)
    growth.append(status("VmHWM") - before)
print(json.dumps({"growth": growth, "block": block, "param": param, "total": total}))
"""


@pytest.mark.parametrize("tier", ["nvme", "host"])
def test_save_dcp_streams_one_block_at_a_time(tmp_path, tier):
    """A ~300 MB model, saved between steps: the peak RSS of a save grows by at most one block
    (NVMe; a host home is read in place) and two parameters (the writer's copy of one and
    what torch.save holds of it), plus 64 MiB of allocator slack (glibc's heap retention varies
    from run to run): well under the model."""
    res = run_rss_child(_RSS_CHILD, tier, str(tmp_path / "swap"), str(tmp_path / "dcp"))
    assert res["total"] > 250e6, res
    bound = (res["block"] if tier == "nvme" else 0) + 2 * res["param"] + (64 << 20)
    assert max(res["growth"]) < bound < 0.6 * res["total"], res
    cfg = GPTConfig(vocab_size=256, d_model=1024, n_layers=6, n_heads=8, max_seq=64)
    torch.manual_seed(0)
    want = TinyGPT(cfg).state_dict()
    got = _plain_load(_tiny_of(cfg, 3), str(tmp_path / "dcp"))
    for k, v in want.items():
        assert torch.equal(got[k], v), k
