"""infinity.estimate: bytes per tier and NVMe bytes written per step, checked against what the
engine really holds and writes; meta models and parameter counts as input."""
import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss
from infinity.plan import estimate
from infinity.plan.probe import probe

CFG = GPTConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=2, max_seq=32)


@pytest.fixture(scope="module")
def pr(tmp_path_factory):
    d = tmp_path_factory.mktemp("est")
    return probe(str(d), quick=True, cache=str(d / "probe.json"))


def _meta_model():
    with infinity.empty_init():
        return TinyGPT(CFG)


def test_table_for_a_meta_model_has_every_placement_and_rank(pr):
    model = _meta_model()
    assert all(p.is_meta for p in model.parameters())
    t = estimate(model, probe=pr, ranks=2, batch=2, seq=32)
    n = sum(p.numel() for p in model.parameters())
    assert t.shape.params == n and t.shape.n_layers == 4 and t.shape.d_model == 128
    names = {r.placement for r in t.rows}
    assert names == {"device", "optim_host", "host", "optim_nvme", "nvme", "nvme_bf16",
                     "nvme_8bit"}
    for r in t.rows:
        assert r.step_s > 0 and r.step_s >= r.compute_s
    nvme, b8 = t.row("nvme"), t.row("nvme_8bit")
    assert nvme.nvme_bytes == pytest.approx(n * (4 + 4 + 24), rel=1e-6)
    assert b8.nvme_bytes < t.row("nvme_bf16").nvme_bytes < nvme.nvme_bytes
    assert nvme.nvme_written_per_step == pytest.approx(n * (4 + 12 + 4), rel=1e-6)
    assert t.row("nvme", 2).nvme_bytes == pytest.approx(nvme.nvme_bytes / 2, rel=1e-3)
    assert t.row("device").device_bytes == 16 * n
    text = str(t)
    assert "nvme_8bit" in text and "tokens/s" in text and "ranks > 1" in text
    assert all(p.is_meta for p in model.parameters())  # nothing was materialized


def test_parameter_count_input_and_bad_input(pr):
    t = estimate("2B", probe=pr, placements=["host", "nvme"])
    assert t.shape.params == 2_000_000_000 and t.shape.n_layers > 1
    assert [r.placement for r in t.rows] == ["host", "nvme"]
    with pytest.raises(ValueError, match="parameter count"):
        estimate("lots", probe=pr)
    with pytest.raises(ValueError, match="unknown placement"):
        estimate(1e6, probe=pr, placements=["gpu_magic"])
    with pytest.raises(ValueError, match="ranks"):
        estimate(1e6, probe=pr, ranks=0)


def _train_measure(tmp_path, settings, steps=2):
    torch.manual_seed(0)
    model = infinity.wrap(TinyGPT(CFG), **settings)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, CFG.vocab_size, (2, 32))
    for _ in range(steps):
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    s = infinity.stats(model)
    out = {"written": s["nvme_bytes_written"]["last_step"],
           "nvme": s["tiers"]["nvme"]["now"] + opt.state_bytes["nvme"],
           "host": s["tiers"]["host"]["params"] + s["tiers"]["host"]["grads"]
           + opt.state_bytes["host"]}
    infinity.unwrap(model)
    return out


@pytest.mark.parametrize("name", ["nvme", "host"])
def test_predicted_bytes_match_the_engine(pr, tmp_path, name):
    from infinity.plan.placements import placement
    pl = placement(name)
    settings = dict(pl.wrap_settings(), nvme_path=str(tmp_path) if pl.uses_nvme else None)
    real = _train_measure(tmp_path, settings)
    e = estimate(_meta_model(), probe=pr, placements=[name], batch=2, seq=32).rows[0]
    if name == "nvme":
        # swap files are padded to 4 KiB per block: a few percent on this small model
        assert e.nvme_written_per_step == pytest.approx(real["written"], rel=0.05)
        assert e.nvme_bytes == pytest.approx(real["nvme"], rel=0.05)
    else:
        assert real["written"] == 0 and e.nvme_written_per_step == 0
        assert e.host_bytes == pytest.approx(real["host"], rel=0.05)
