"""The planner: wrap(placement="auto") picks tiers and window from budgets and the probe;
explicit tiers are kept; too-small nvme_path / budgets are refused before anything is written."""
import os

import pytest
import torch

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss
from infinity.plan import PlanError, plan
from infinity.plan import planner as planner_mod
from infinity.plan.probe import probe

CFG = GPTConfig(vocab_size=512, d_model=128, n_layers=16, n_heads=2, max_seq=32)
N = CFG.approx_params


@pytest.fixture(autouse=True)
def probe_cache(tmp_path_factory, monkeypatch):
    # one quick probe for the whole module, in a private cache
    d = tmp_path_factory.getbasetemp() / "planner_probe"
    d.mkdir(exist_ok=True)
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(d))


@pytest.fixture
def pr(tmp_path):
    return probe(str(tmp_path), quick=True)


def _trains_like_torch(model, ref) -> None:
    """Two AdamW steps of the wrapped model and of its plain twin ``ref`` give the same
    outputs; unwraps the model."""
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m(x), x).backward()
            o.step()
            o.zero_grad()
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x), atol=1e-5)
    infinity.unwrap(model)

def test_ample_ram_plans_host_small_budget_plans_nvme(tmp_path, pr):
    roomy = plan(TinyGPT(CFG), probe=pr, nvme_path=str(tmp_path), host_budget=1 << 30)
    assert (roomy.param_tier, roomy.grad_tier, roomy.optimizer_tier) == ("host",) * 3
    # too little RAM for the homes + states, enough for NVMe's staging buffers
    tight = plan(TinyGPT(CFG), probe=pr, nvme_path=str(tmp_path), host_budget=8 * N)
    assert tight.param_tier == "nvme" or tight.optimizer_tier == "nvme"
    assert tight.estimate.host_bytes <= 12 * N
    text = str(tight)
    assert "why:" in text and "does not fit" in text and "host" in text


def test_explicit_tiers_are_kept(tmp_path, pr):
    p = plan(TinyGPT(CFG), probe=pr, nvme_path=str(tmp_path), param_tier="nvme",
             host_budget=1 << 30)
    assert p.param_tier == "nvme"
    assert any("kept as you set: param_tier=nvme" in r for r in p.reasons)
    p = plan(TinyGPT(CFG), probe=pr, nvme_path=str(tmp_path), optimizer_tier="nvme",
             host_budget=1 << 30)
    assert p.optimizer_tier == "nvme" and p.param_tier == "host"


def test_wrap_auto_uses_the_plan_and_trains_like_torch(tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = TinyGPT(CFG)
    model.load_state_dict(ref.state_dict())
    infinity.wrap(model, nvme_path=str(tmp_path), placement="auto", host_budget=8 * N)
    p = infinity.explain(model, show=False)
    eng = infinity.api._engine(model)
    assert eng.param_tier.value == p.param_tier and eng.grad_tier.value == p.grad_tier
    assert eng.policy.optimizer_tier == p.optimizer_tier
    assert eng.policy.prefetch_window == p.prefetch_window
    _trains_like_torch(model, ref)


def test_explain_unwrapped_model_prints_the_plan(tmp_path, capsys):
    p = infinity.explain(TinyGPT(CFG), nvme_path=str(tmp_path))
    out = capsys.readouterr().out
    assert out.startswith("infinity plan: ") and p.placement in out
    wrapped = infinity.wrap(TinyGPT(CFG), param_tier="host", placement=None)
    with pytest.raises(ValueError, match="no plan: it was wrapped with placement=None"):
        infinity.explain(wrapped)
    infinity.unwrap(wrapped)
    wrapped = infinity.wrap(TinyGPT(CFG), nvme_path=str(tmp_path), param_tier="host",
                            grad_tier="host", optimizer_tier="nvme")
    with pytest.raises(ValueError, match="all set explicitly"):
        infinity.explain(wrapped)
    infinity.unwrap(wrapped)


def test_nvme_path_too_small_is_refused_before_writing(tmp_path, monkeypatch):
    swap = tmp_path / "swap"
    swap.mkdir()
    real = planner_mod.shutil.disk_usage

    def tiny_disk(path):
        u = real(path)
        return type(u)(u.total, u.total - 1 << 20, 1 << 20)  # 1 MiB free
    monkeypatch.setattr(planner_mod.shutil, "disk_usage", tiny_disk)
    model = TinyGPT(CFG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=r"too small.*needs [\d,]+ bytes.*1,048,576 bytes are "
                                        r"free"):
        infinity.wrap(model, nvme_path=str(swap), placement="auto", host_budget=8 * N)
    assert [f for f in os.listdir(swap) if not f.startswith(".infinity-probe")] == []
    assert infinity.runtime.engine.engine_of(model) is None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_budget_below_the_largest_block_is_a_clear_error(tmp_path, pr):
    block = 4 * (12 * CFG.d_model ** 2 + 13 * CFG.d_model)
    with pytest.raises(PlanError, match="cannot hold the largest block"):
        plan(TinyGPT(CFG), probe=pr, nvme_path=str(tmp_path), host_budget=block // 2)
    with pytest.raises(PlanError, match="device budget .* cannot hold the largest block"):
        plan(TinyGPT(CFG), probe=pr, nvme_path=str(tmp_path), device_budget=block // 2,
             host_budget=1 << 30, param_tier="nvme")


def test_no_nvme_path_and_no_room_names_the_remedy(pr):
    with pytest.raises(PlanError, match="pass nvme_path"):
        plan(TinyGPT(CFG), probe=pr, host_budget=3 * N)


def test_placement_value_is_checked():
    with pytest.raises(ValueError, match="placement="):
        infinity.wrap(TinyGPT(CFG), placement="fastest")


def _steady_disk(pr):
    """The quick probe with round disk figures, so the comparison below does not hang on noise."""
    import dataclasses
    return dataclasses.replace(pr, disk=dataclasses.replace(pr.disk, read_bps=1e9,
                                                            write_bps=1e9))


def _half_the_blocks_budget(model, pr):
    from infinity.plan.placements import placement
    from infinity.plan.planner import _window, estimate_one
    from infinity.plan.shape import describe
    shape = describe(model)
    pl = placement("nvme")
    from infinity.tiers.chunk_size import resolve_chunk_bytes
    # as plan() without batch/seq (as wrap plans): the working set that grows with the batch
    # is not counted; the pools at the chunk the budget implies (the budget sets the chunk,
    # the chunk the pools: two rounds settle it)
    budget = None
    for _ in range(3):
        e = estimate_one(shape, pl, pr, batch=4, seq=128,
                         prefetch_window=_window(shape, pr, pl, 4, 128), batch_known=False,
                         chunk_bytes=resolve_chunk_bytes(None, budget))
        budget = e.host_bytes + e.device_bytes + shape.param_bytes // 2
    return shape, budget


def test_budget_for_half_the_blocks_plans_a_per_block_split(tmp_path, pr):
    pr = _steady_disk(pr)
    model = TinyGPT(CFG)
    shape, budget = _half_the_blocks_budget(model, pr)
    p = plan(model, probe=pr, nvme_path=str(tmp_path), host_budget=budget)
    n = len(shape.block_bytes)
    assert p.param_tier == "nvme" and 0 < p.host_blocks < n
    # "about half": the blocks are equal layers (and a smaller root, counted last)
    assert abs(p.host_blocks - n // 2) <= 1, (p.host_blocks, n)
    assert p.policy_changes()["host_blocks"] == p.host_blocks
    steps = {name: step for name, step, ok, _ in p.candidates if ok}
    assert steps[p.placement] < steps["nvme"]
    assert p.estimate.host_bytes + p.estimate.device_bytes <= budget
    text = str(p)
    assert f"parameters of the first {p.host_blocks} of {n} blocks on host" in text
    assert f"host_blocks={p.host_blocks}:" in text and "host: does not fit" in text
    # with RAM for everything the whole-model host placement wins; the user's tiers stay
    assert plan(model, probe=pr, nvme_path=str(tmp_path), host_budget=1 << 30).host_blocks == 0
    kept = plan(model, probe=pr, nvme_path=str(tmp_path), host_budget=budget,
                param_tier="nvme")
    assert kept.host_blocks == 0 and kept.placement == "nvme"
    given = plan(model, probe=pr, nvme_path=str(tmp_path), host_budget=1 << 30, host_blocks=3)
    assert given.host_blocks == 3 and given.param_tier == "nvme"


def test_wrap_auto_with_a_split_plan_trains_like_torch(tmp_path, pr):
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = TinyGPT(CFG)
    model.load_state_dict(ref.state_dict())
    _, budget = _half_the_blocks_budget(model, pr)
    infinity.wrap(model, nvme_path=str(tmp_path), placement="auto", host_budget=budget)
    p = infinity.explain(model, show=False)
    eng = infinity.api._engine(model)
    assert p.host_blocks > 0 and eng.policy.host_blocks == p.host_blocks
    assert infinity.stats(model)["param_blocks"] == {"host": p.host_blocks,
                                                     "nvme": len(eng.blocks) - p.host_blocks}
    _trains_like_torch(model, ref)


def test_the_planner_is_the_default_and_measures_nothing_with_a_cache(tmp_path, pr,
                                                                    monkeypatch):
    import importlib
    probe_mod = importlib.import_module("infinity.plan.probe")

    def no_measuring(*a, **k):
        raise AssertionError("wrap measured the machine although a cached probe exists")
    monkeypatch.setattr(probe_mod, "_measure_machine", no_measuring)
    monkeypatch.setattr(probe_mod, "measure_disk", no_measuring)
    assert infinity.OffloadPolicy().placement == "auto"
    model = infinity.wrap(TinyGPT(CFG), nvme_path=str(tmp_path))  # pr filled the cache
    p = infinity.explain(model, show=False)
    eng = infinity.api._engine(model)
    # ample RAM: the planner keeps everything on host although nvme_path is given
    assert p.param_tier == "host" and eng.param_tier.value == "host"
    infinity.unwrap(model)
    # placement=None: the old rules (nvme_path given, no host_budget: NVMe)
    model = infinity.wrap(TinyGPT(CFG), nvme_path=str(tmp_path), placement=None)
    assert infinity.api._engine(model).param_tier.value == "nvme"
    infinity.unwrap(model)


def test_sharded_wraps_follow_the_rules_on_every_rank(monkeypatch):
    import torch.distributed as dist
    policy = infinity.OffloadPolicy(nvme_path="/tmp")
    model = TinyGPT(CFG)
    assert planner_mod.skip_reason(model, policy) is None
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    why = planner_mod.skip_reason(model, policy)
    assert why is not None and "sharded over 4 ranks" in why
    out, p, reason = planner_mod.apply_plan(model, policy)
    assert p is None and out is policy and reason == why
    # shard="none": each process plans for itself
    assert planner_mod.skip_reason(model, infinity.OffloadPolicy(shard="none")) is None


def _swap_file(tmp_path):
    """An existing regular file where a swap directory belongs, and a snapshot of its folder."""
    f = tmp_path / "swap.bin"
    f.write_bytes(b"user data")
    return f, lambda: (sorted(os.listdir(tmp_path)), f.read_bytes())


@pytest.mark.parametrize("tiers", [
    dict(param_tier="nvme", grad_tier="host", optimizer_tier="host"),  # explicit: no planner
    dict(param_tier="host", grad_tier="host", optimizer_tier="nvme"),
    dict(),                                                            # the planner's path
    dict(param_tier="nvme")])
def test_nvme_path_that_is_a_file_is_refused_before_writing(tmp_path, tiers):
    f, snapshot = _swap_file(tmp_path)
    before = snapshot()
    model = TinyGPT(CFG)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NotADirectoryError) as err:
        infinity.wrap(model, nvme_path=str(f), host_budget=8 * N, **tiers)
    msg = str(err.value)
    assert msg.startswith("infinity: nvme_path") and str(f) in msg and "is a file" in msg
    assert "does not exist" not in msg
    assert "pass a directory" in msg and "creates its swap files inside it" in msg
    assert str(tmp_path) in msg  # the folder it sits in, as an example
    assert snapshot() == before  # nothing written next to it, the file untouched
    from infinity.runtime.engine import engine_of
    assert engine_of(model) is None
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_nvme_path_file_in_plan_explain_and_probe(tmp_path, pr):
    from infinity.plan.probe import ProbeError
    f, snapshot = _swap_file(tmp_path)
    before = snapshot()
    with pytest.raises(NotADirectoryError, match="is a file, not a directory; pass a directory"):
        plan(TinyGPT(CFG), probe=pr, nvme_path=str(f))
    with pytest.raises(NotADirectoryError, match="is a file"):
        infinity.explain(TinyGPT(CFG), nvme_path=str(f), show=False)
    with pytest.raises(ProbeError, match=r"infinity\.probe: nvme_path .* is a file"):
        probe(str(f), quick=True)
    with pytest.raises(NotADirectoryError, match="is a file"):
        infinity.OffloadPolicy(nvme_path=str(f))
    assert snapshot() == before
    # a missing directory still says so (the planner's check), with the same remedy
    with pytest.raises(FileNotFoundError, match="does not exist; create the directory"):
        infinity.wrap(TinyGPT(CFG), nvme_path=str(tmp_path / "nope"))


def test_the_plan_sizes_its_pools_at_the_chunk_wrap_derives_from_the_budget(tmp_path, pr):
    from infinity.tiers.chunk_size import DEFAULT_CHUNK_BYTES, resolve_chunk_bytes
    cfg = GPTConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=2, max_seq=32)
    budget = 64 << 20
    chunk = resolve_chunk_bytes(None, budget)
    assert chunk < DEFAULT_CHUNK_BYTES and chunk < 12 * 256 * 256 * 4  # smaller than a layer
    nvme = dict(probe=pr, nvme_path=str(tmp_path), host_budget=budget, param_tier="nvme",
                grad_tier="nvme", optimizer_tier="nvme", batch=2, seq=32)
    derived = plan(TinyGPT(cfg), **nvme)
    assert derived.chunk_bytes == chunk
    assert f"chunk {chunk / 2**20:.1f} MiB" in str(derived)
    given = plan(TinyGPT(cfg), chunk_bytes=chunk, **nvme)
    assert given.estimate == derived.estimate
    # the estimate at the same chunk counts the same host bytes; at the 256 MiB default its
    # buffers would hold whole blocks: more
    def host_at(chunk_bytes):
        return infinity.estimate(TinyGPT(cfg), probe=pr, placements=["nvme"], batch=2, seq=32,
                                 prefetch_window=derived.prefetch_window,
                                 chunk_bytes=chunk_bytes).row("nvme").host_bytes
    assert host_at(chunk) == derived.estimate.host_bytes < host_at(DEFAULT_CHUNK_BYTES)
    # wrap with the same budget uses the same chunk
    model = TinyGPT(cfg)
    infinity.wrap(model, nvme_path=str(tmp_path), placement="auto", host_budget=budget)
    try:
        p = infinity.explain(model, show=False)
        assert infinity.api._engine(model).chunk_bytes == p.chunk_bytes == chunk
    finally:
        infinity.unwrap(model)
