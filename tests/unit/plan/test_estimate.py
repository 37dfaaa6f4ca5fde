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
    # homes, gradients, states once, and the spare: the extents of the 3 units in flight
    # (here whole blocks, each smaller than the chunk)
    spare = nvme.nvme_by_category["spare"]
    assert spare == pytest.approx(min(12 * n, 3 * 12 * t.shape.largest_block_params), rel=1e-6)
    assert nvme.nvme_bytes == pytest.approx(n * (4 + 4 + 12) + spare, rel=1e-6)
    assert nvme.nvme_overlap_bytes == pytest.approx(12 * n - spare, rel=1e-6)
    assert b8.nvme_bytes < t.row("nvme_bf16").nvme_bytes < nvme.nvme_bytes
    assert nvme.nvme_written_per_step == pytest.approx(n * (4 + 12 + 4), rel=1e-6)
    assert t.row("nvme", 2).nvme_bytes == pytest.approx(nvme.nvme_bytes / 2, rel=1e-3)
    # plain PyTorch: weights, gradients and fp32 Adam states, and the step's activations and
    # logits (its gradients are in the 16 bytes)
    dev = t.row("device")
    assert set(dev.working_set) == {"activations", "logits", "peak"}
    assert dev.device_bytes == 16 * n + dev.working_set["activations"] + dev.working_set["logits"]
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


def _train_measure(tmp_path, settings, steps=2, master="fp32"):
    torch.manual_seed(0)
    model = infinity.wrap(TinyGPT(CFG), **settings)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, master=master)
    x = torch.randint(0, CFG.vocab_size, (2, 32))
    for _ in range(steps):
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    s = infinity.stats(model)
    out = {"written": s["nvme_bytes_written"]["last_step"],
           "nvme": s["tiers"]["nvme"]["now"] + opt.state_bytes["nvme"],
           "nvme_peak": s["tiers"]["nvme"]["now"] + s["swap"]["states_peak"],
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
        # after a step the states are held once; the spare (units in flight) only during it,
        # and the estimate's is a bound (3 units of the largest block here)
        spare = e.nvme_by_category["spare"]
        assert e.nvme_bytes - spare == pytest.approx(real["nvme"], rel=0.05)
        assert real["nvme"] < real["nvme_peak"] <= e.nvme_bytes * 1.05
    else:
        assert real["written"] == 0 and e.nvme_written_per_step == 0
        assert e.host_bytes == pytest.approx(real["host"], rel=0.05)


@pytest.mark.parametrize("name", ["nvme", "host"])
def test_predicted_bytes_with_a_bf16_master_match_the_engine(pr, tmp_path, name):
    """AdamW(master="bf16_sr"): 2 B of master per parameter instead of 4 (and on host the
    fp32 home is no longer the master); estimate(master=...) predicts the engine's bytes."""
    from infinity.plan.placements import placement
    pl = placement(name)
    settings = dict(pl.wrap_settings(), nvme_path=str(tmp_path) if pl.uses_nvme else None)
    real = _train_measure(tmp_path, settings, master="bf16_sr")
    e = estimate(_meta_model(), probe=pr, placements=[name], batch=2, seq=32,
                 master="bf16_sr").rows[0]
    fp32 = estimate(_meta_model(), probe=pr, placements=[name], batch=2, seq=32).rows[0]
    if name == "nvme":
        assert e.nvme_written_per_step == pytest.approx(real["written"], rel=0.05)
        # after a step the states are held once; the spare (units in flight) only during it,
        # and the estimate's is a bound (3 units of the largest block here)
        spare = e.nvme_by_category["spare"]
        assert e.nvme_bytes - spare == pytest.approx(real["nvme"], rel=0.05)
        assert real["nvme"] < real["nvme_peak"] <= e.nvme_bytes * 1.05
        assert e.nvme_bytes < fp32.nvme_bytes
    else:
        assert e.host_bytes == pytest.approx(real["host"], rel=0.05)
        assert e.host_bytes > fp32.host_bytes  # a bf16 master beside the fp32 home
    with pytest.raises(ValueError, match="master must be"):
        estimate(_meta_model(), probe=pr, placements=[name], master="fp16")


# ---- the step-time model's terms (deterministic: figures set on a probe result) -----------
def _with_overhead(pr, host=(1e-3, 5e-3), nvme=(4e-3, 1e-2), optim_nvme=None):
    import dataclasses
    disk_ovh = {"nvme": {"block_s": nvme[0], "step_s": nvme[1]}}
    if optim_nvme is not None:
        disk_ovh["optim_nvme"] = {"block_s": optim_nvme[0], "step_s": optim_nvme[1]}
    return dataclasses.replace(
        pr, overhead={"host": {"block_s": host[0], "step_s": host[1]}},
        disk=dataclasses.replace(pr.disk, overhead=disk_ovh))


def test_step_is_the_sum_of_its_terms_and_the_engine_cost_is_per_block(pr):
    from infinity.plan.estimate import estimate_one
    from infinity.plan.placements import placement
    from infinity.plan.shape import shape_of
    shape = shape_of(_meta_model())
    blocks = len(shape.block_bytes)
    p2 = _with_overhead(pr)
    for name in ("host", "optim_nvme", "nvme", "nvme_8bit", "optim_host"):
        e = estimate_one(shape, placement(name), p2, batch=2, seq=32, compute_s=0.5)
        assert e.compute_s == 0.5
        assert e.step_s == pytest.approx(e.compute_s + e.fetch_s + e.grad_offload_s
                                         + e.optimizer_s + e.engine_s, rel=1e-9)
    host = estimate_one(shape, placement("host"), p2, batch=2, seq=32, compute_s=0.5)
    assert host.engine_s == pytest.approx(blocks * 1e-3 + 5e-3)
    nvme = estimate_one(shape, placement("nvme"), p2, batch=2, seq=32, compute_s=0.5)
    assert nvme.engine_s == pytest.approx(blocks * 4e-3 + 1e-2)
    # optim_nvme not measured: at least what the host layout measured
    mid = estimate_one(shape, placement("optim_nvme"), p2, batch=2, seq=32, compute_s=0.5)
    assert mid.engine_s == pytest.approx(host.engine_s)
    # a noisy probe that found NVMe cheaper than RAM does not make it so
    noisy = _with_overhead(pr, host=(5e-3, 0.0), nvme=(1e-3, 0.0), optim_nvme=(2e-3, 0.0))
    n2 = estimate_one(shape, placement("nvme"), noisy, batch=2, seq=32, compute_s=0.5)
    h2 = estimate_one(shape, placement("host"), noisy, batch=2, seq=32, compute_s=0.5)
    assert n2.engine_s == pytest.approx(h2.engine_s) == pytest.approx(blocks * 5e-3)
    # plain PyTorch has no engine
    dev = estimate_one(shape, placement("device"), p2, batch=2, seq=32, compute_s=0.5)
    assert dev.engine_s == 0 and dev.fetch_s == 0 and dev.grad_offload_s == 0
    # the old call (the planner's) still works
    assert estimate_one(shape, placement("host"), p2, batch=2, seq=32,
                        prefetch_window=3).step_s > 0


def test_disk_bound_optimizer_and_fetch_follow_the_probed_bandwidths(pr):
    import dataclasses

    from infinity.plan.estimate import estimate_one
    from infinity.plan.placements import placement
    from infinity.plan.shape import shape_of
    shape = shape_of(_meta_model())
    n, pb = shape.params, shape.param_bytes
    slow = dataclasses.replace(pr, disk=dataclasses.replace(pr.disk, read_bps=1e6,
                                                            write_bps=2e6, compute_overlap=1.0))
    e = estimate_one(shape, placement("nvme"), slow, batch=2, seq=32, compute_s=0.01)
    io_opt = 16.0 * n / 1e6 + (12.0 * n + pb) / 2e6
    assert e.optimizer_s > io_opt  # the disk, not CPU Adam, sets it (+ the pipeline's edges)
    assert e.optimizer_s < io_opt * 1.5
    # every block read in forward and in backward but the last two layers (the window),
    # kept between them
    io_fb = (2 * pb - 2 * shape.layer_block_bytes) / 1e6 + 4.0 * n / 2e6
    assert e.fetch_s > io_fb - 0.01 - e.grad_offload_s  # the reads do not hide behind compute
    hidden = dataclasses.replace(pr, disk=dataclasses.replace(pr.disk, compute_overlap=1.0))
    fast = estimate_one(shape, placement("nvme"), hidden, batch=2, seq=32, compute_s=100.0)
    first = (shape.root_bytes + shape.layer_block_bytes) / pr.disk.read_bps
    assert fast.fetch_s == pytest.approx(first)  # only the first read is exposed
    # a machine where the disk and compute take turns (the probe measured no overlap): the
    # disk's time adds to compute's, in forward + backward and in the optimizer's pipeline
    turns = dataclasses.replace(pr, disk=dataclasses.replace(pr.disk, compute_overlap=0.0))
    t = estimate_one(shape, placement("nvme"), turns, batch=2, seq=32, compute_s=100.0)
    io_fb = sum(t.nvme_per_step[c] for c in ("params_read",)) / pr.disk.read_bps + \
        t.nvme_per_step["grads_written"] / pr.disk.write_bps
    assert t.fetch_s == pytest.approx(first + io_fb)
    assert t.optimizer_s > fast.optimizer_s
    # more optimizer bytes, more time: fp32 > bf16 > 8bit states on a slow disk
    t = {s: estimate_one(shape, placement("nvme"), slow, batch=2, seq=32, compute_s=0.01,
                         states=s).optimizer_s for s in ("fp32", "bf16", "8bit")}
    assert t["fp32"] > t["bf16"] > t["8bit"]


def test_states_override_matches_the_named_placement_and_is_checked(pr):
    from infinity.plan.estimate import estimate_one
    from infinity.plan.placements import placement
    from infinity.plan.shape import shape_of
    shape = shape_of(_meta_model())
    a = estimate_one(shape, placement("nvme"), pr, batch=2, seq=32, states="8bit")
    b = estimate_one(shape, placement("nvme_8bit"), pr, batch=2, seq=32)
    assert (a.nvme_bytes, a.host_bytes, a.nvme_written_per_step) == \
        (b.nvme_bytes, b.host_bytes, b.nvme_written_per_step)
    with pytest.raises(ValueError, match="plain PyTorch"):
        estimate_one(shape, placement("device"), pr, batch=2, seq=32, states="8bit")
    with pytest.raises(ValueError, match="states must be"):
        estimate_one(shape, placement("host"), pr, batch=2, seq=32, states="fp8")


@pytest.mark.parametrize("vocab", [32000, 128256, 256000])
def test_nvme_host_ram_is_flat_in_the_vocabulary_and_bytes_are_categorised(pr, vocab):
    """With parameters on NVMe the engine's host pools and the optimizer's buffer sets are
    bounded by the chunk: the estimated host RAM does not grow with the vocabulary (the
    embedding is 0.4-3x the 256 MiB chunk here), the device working set (the compute buffers:
    the embedding block is fetched whole) does; the swap bytes by category add up to the
    total, and the SSD-wear figure follows the bytes written."""
    dims = dict(d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn=8192, tied=True)
    t = estimate(None, probe=pr, placements=["nvme_8bit", "nvme"], batch=1, seq=256,
                 vocab_size=vocab, **dims)
    ref = estimate(None, probe=pr, placements=["nvme_8bit", "nvme"], batch=1, seq=256,
                   vocab_size=32000, **dims)
    for name in ("nvme_8bit", "nvme"):
        r, r0 = t.row(name), ref.row(name)
        assert r.host_bytes == r0.host_bytes < 3 << 30
        assert (r.device_bytes > r0.device_bytes) == (vocab > 32000)
        assert sum(r.nvme_by_category.values()) == pytest.approx(r.nvme_bytes, rel=1e-6)
        assert set(r.nvme_by_category) == {"parameters", "gradients", "master", "moments",
                                           "spare"}
        assert r.tb_written_per_1000_steps == pytest.approx(
            r.nvme_written_per_step * 1000 / 1e12)
    small = estimate(None, probe=pr, placements=["nvme_8bit"], batch=1, seq=256,
                     vocab_size=vocab, chunk_bytes=64 << 20, **dims).row("nvme_8bit")
    assert small.host_bytes < t.row("nvme_8bit").host_bytes  # the chunk bounds it
    assert "SSD wear" in str(t) and "swap bytes/param" in str(t)


def test_a_bf16_model_is_predicted_at_the_bf16_compute_rate(pr):
    import dataclasses

    from infinity.plan.estimate import estimate_one
    from infinity.plan.placements import placement
    from infinity.plan.shape import shape_of
    fast = dataclasses.replace(pr, flops={k: 1e9 for k in pr.flops},
                               flops_bf16={k: 4e9 for k in pr.flops})
    fp32 = shape_of(_meta_model())
    with infinity.empty_init():
        bf16 = shape_of(TinyGPT(CFG).to(torch.bfloat16))
    assert bf16.bytes_per_param == 2 and fp32.bytes_per_param == 4
    for name in ("host", "nvme"):
        a = estimate_one(fp32, placement(name), fast, batch=2, seq=32)
        b = estimate_one(bf16, placement(name), fast, batch=2, seq=32)
        assert a.compute_s == pytest.approx(4 * b.compute_s, rel=1e-9)


@pytest.mark.parametrize("host_blocks", [0, 2])
def test_nvme_bytes_per_step_by_category_are_what_the_engine_moves(tmp_path, pr, host_blocks):
    """The estimate's bytes per category of a steady step (states read and written, fp32
    gradients written in backward and read by the optimizer, every NVMe-homed block read twice
    but the last layer kept from forward into backward, the working copies of the NVMe-homed
    blocks written back) against stats()["nvme_per_step"] of a wrapped model's second step."""
    from infinity.plan.estimate import estimate_one
    from infinity.plan.placements import placement
    from infinity.plan.shape import describe
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    shape = describe(model)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", grad_tier="nvme",
                  optimizer_tier="nvme", placement=None, host_blocks=host_blocks or None)
    try:
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=False)
        x = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            lm_loss(model(x), x).backward()
            opt.step()
            opt.zero_grad()
        moved = infinity.stats(model)["nvme_per_step"]["bytes"]
    finally:
        infinity.unwrap(model)
    e = estimate_one(shape, placement("nvme"), pr, batch=2, seq=32, host_blocks=host_blocks)
    assert set(e.nvme_per_step) == {"params_read", "params_written", "grads_read",
                                    "grads_written", "states_read", "states_written"}
    # the root block (here the embedding and head: the whole step) is read once a step; the
    # next forward's prefetch, started as opt.step() ends, counts in the next step
    for cat, want in e.nvme_per_step.items():
        assert want - (64 << 10) <= moved[cat] <= want + (64 << 10), (cat, want, moved)
    assert e.nvme_written_per_step == sum(v for c, v in e.nvme_per_step.items()
                                          if c.endswith("_written"))


def test_the_next_forwards_prefetch_counts_in_the_next_step(tmp_path, monkeypatch):
    """opt.step() ends by prefetching the next forward's first blocks (Engine.resume): those
    reads belong to the next step's bytes however fast they land. Here every other step's
    prefetch surely lands before step() returns, and the others' never starts (the forward
    fetches on demand): each steady step must still count the same bytes."""
    import time

    from infinity.runtime.engine import Engine

    resume, calls = Engine.resume, []

    def uneven_resume(self):
        calls.append(1)
        if len(calls) % 2:
            resume(self)
            time.sleep(0.3)  # the prefetch's reads (~1 MB) land well within this

    monkeypatch.setattr(Engine, "resume", uneven_resume)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    infinity.wrap(model, nvme_path=str(tmp_path), param_tier="nvme", grad_tier="nvme",
                  optimizer_tier="nvme", placement=None)
    try:
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=False)
        x = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        reads = []
        for _ in range(5):
            lm_loss(model(x), x).backward()
            opt.step()
            opt.zero_grad()
            reads.append(infinity.stats(model)["nvme_per_step"]["bytes"]["params_read"])
        opt.close()
    finally:
        infinity.unwrap(model)
    assert len(calls) == 5
    assert reads[1] == reads[2] == reads[3] == reads[4], reads
