"""The NVMe optimizer step in units bounded by a chunk (``AdamW(chunk_bytes=)``): a shard whose
states are larger than the chunk is read, stepped and written in element ranges, bit for bit
the step of the whole shard, with host buffers bounded by the chunk.

Every comparison here is bitwise (``torch.equal``): a run with a tiny chunk (8-16 KiB, so each
block's shard is cut into dozens to hundreds of units, 8-bit blocks and pages shared between
units included) against a run whose chunk is larger than every shard, and, for fp32 states,
against ``torch.optim.AdamW(fused=True)`` (the CPU kernel uses its order of operations)."""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from optim_helpers import assert_equal as _equal
from optim_helpers import states as _states
from optim_helpers import weights as _weights

import infinity
from infinity import io as inf_io
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.optim.step import chunks
from infinity.tiers.budget import BudgetExceededError
from infinity.tiers.swap_store import SwapCorruptionError

CFG = GPTConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=2, max_seq=16)
TINY = 16 << 10          # many units per shard
HUGE = 1 << 30           # larger than every shard: the whole-shard step
NVME_HOMES = dict(param_tier="nvme", grad_tier="nvme")


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(CFG)


def _train(model, opt, steps: int, *, seed: int = 1, clip: Optional[float] = None,
           after_step=None) -> List[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = synthetic_batch(CFG, 2, 8, gen)
        loss = lm_loss(model(x), y)
        loss.backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        if after_step is not None:
            after_step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _units(opt) -> Dict[str, int]:
    store = next(iter(opt.core.wrapped.stores()))
    return {s.key: len(store.plan(s).units) for s in opt.shards()}


def _run(tmp_path, name: str, chunk: int, *, tiers=None, steps: int = 3, inspect=None,
         dtype: torch.dtype = torch.float32,
         **opt_kwargs) -> Tuple[List[float], Dict, Dict, Dict[str, int]]:
    model = _model().to(dtype)
    d = tmp_path / name
    d.mkdir()
    # as stored (bf16 homes compute in bf16: pinned, "auto" would compute them in fp32 on
    # a CPU without fast bf16)
    infinity.wrap(model, nvme_path=str(d), optimizer_tier="nvme", compute_dtype=dtype,
                  **(tiers or {}))
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=chunk, **opt_kwargs)
    try:
        losses = _train(model, opt, steps)
        if inspect is not None:
            inspect(_mixed_units(opt))
        return losses, _weights(model), _states(opt), _units(opt)
    finally:
        opt.close()
        infinity.unwrap(model)


HOMES = {"host": dict(param_tier="host", grad_tier="host"), "nvme": NVME_HOMES,
         "device": dict(param_tier="device", grad_tier="host")}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("homes", ["host", "nvme", "device"])
def test_chunked_step_is_bitwise_the_whole_step(tmp_path, fmt, homes):
    tiers = HOMES[homes]
    kw = dict(states=fmt, min_8bit_size=0)  # every layer slot 8-bit (the embedding: fp32)
    l1, w1, s1, units = _run(tmp_path, "tiny", TINY, tiers=tiers, **kw)
    l2, w2, s2, whole = _run(tmp_path, "huge", HUGE, tiers=tiers, **kw)
    assert max(units.values()) >= 20, units          # the shards really were cut
    assert set(whole.values()) == {1}
    assert l1 == l2
    _equal(w1, w2)
    _equal(s1, s2)


@pytest.mark.parametrize("homes", ["host", "nvme"])
def test_chunked_step_bf16_weights(tmp_path, homes):
    """bf16 parameters (the working copy the kernel writes is bf16; fp32 masters in the
    states)."""
    kw = dict(states="8bit", min_8bit_size=0, dtype=torch.bfloat16, tiers=HOMES[homes])
    l1, w1, s1, units = _run(tmp_path, "tiny", TINY, **kw)
    l2, w2, s2, _ = _run(tmp_path, "huge", HUGE, **kw)
    assert max(units.values()) >= 20
    assert l1 == l2
    _equal(w1, w2)
    _equal(s1, s2)


def test_chunked_step_without_checksums(tmp_path):
    """verify_checksums=False: pieces are moved without CRCs and nothing is recorded."""
    kw = dict(states="8bit", min_8bit_size=0,
              tiers=dict(NVME_HOMES, verify_checksums=False))
    l1, w1, s1, units = _run(tmp_path, "tiny", TINY, **kw)
    l2, w2, s2, _ = _run(tmp_path, "huge", HUGE, **kw)
    assert max(units.values()) >= 20
    assert l1 == l2
    _equal(w1, w2)
    _equal(s1, s2)


def test_chunked_fp32_equals_torch_adamw(tmp_path):
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    want = _train(ref, ref_opt, 3)
    for homes in ("host", "nvme"):
        got, w, _, units = _run(tmp_path, homes, TINY,
                                tiers=NVME_HOMES if homes == "nvme" else None)
        assert max(units.values()) >= 20
        assert got == want
        _equal(w, _weights(ref))


def test_chunk_size_changes_no_bit(tmp_path):
    """Chunks of different sizes (unit boundaries and shared pages elsewhere)."""
    base = _run(tmp_path, "c8", 8 << 10, states="8bit", min_8bit_size=0)
    for chunk in (12 << 10, 40 << 10):
        other = _run(tmp_path, f"c{chunk}", chunk, states="8bit", min_8bit_size=0)
        assert other[0] == base[0]
        _equal(other[1], base[1])
        _equal(other[2], base[2])


def _mixed_units(opt) -> Dict[str, int]:
    store = next(iter(opt.core.wrapped.stores()))
    return {s.key: len(store.plan(s).units) for s in opt.shards()
            if store.layout(s).mixed}


@pytest.mark.parametrize("states", ["8bit", "bf16+8bit"])
def test_mixed_format_shard_on_nvme(tmp_path, states):
    """Blocks whose slots have several formats (8-bit states with bitsandbytes' defaults:
    small parameters and the embedding keep fp32 moments; or bf16 for the attention and 8-bit
    elsewhere): each format's region is cut along the same element ranges."""
    if states == "8bit":
        kw: Dict[str, Any] = dict(states="8bit")
    else:
        kw = dict(states=lambda p: "bf16" if p.dim() == 2 and p.shape[0] == p.shape[1]
                  else "8bit", min_8bit_size=0)
    mixed: List[Dict[str, int]] = []
    l1, w1, s1, units = _run(tmp_path, "tiny", TINY, inspect=mixed.append, **kw)
    l2, w2, s2, _ = _run(tmp_path, "huge", HUGE, **kw)
    assert mixed[0] and min(mixed[0].values()) >= 10, mixed  # mixed shards really were cut
    assert l1 == l2
    _equal(w1, w2)
    _equal(s1, s2)


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_chunked_step_overlapping_backward_with_clipping(tmp_path, fmt):
    """overlap=True (updates run during backward) and clipping that triggers on some steps:
    kept or rolled back, the result is the step after backward, chunked or not."""
    results = []
    for chunk in (TINY, HUGE):
        model = _model()
        d = tmp_path / f"c{chunk}"
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), optimizer_tier="nvme", **NVME_HOMES)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=chunk,
                                   states=fmt, min_8bit_size=0, overlap=True)
        kept: List[int] = []
        losses = _train(model, opt, 5, clip=1.0,
                        after_step=lambda o: kept.append(o.last_step_stats.overlapped_shards))
        losses += _train(model, opt, 3, seed=7)  # no clipping: updates kept
        kept.append(opt._overlap.kept_total)
        results.append((losses, _weights(model), _states(opt), kept))
        opt.close()
        infinity.unwrap(model)
    (l1, w1, s1, k1), (l2, w2, s2, k2) = results
    assert k1[-1] > 0, k1  # some chunked updates ran during backward and were kept
    assert l1 == l2
    _equal(w1, w2)
    _equal(s1, s2)


def test_state_dict_after_step_and_resume(tmp_path):
    """state_dict right after a chunked step equals the whole step's; loading it into a new
    chunked optimizer and training on equals training on without the reload."""
    def run(chunk: int, name: str, reload: bool):
        model = _model()
        d = tmp_path / name
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), optimizer_tier="nvme", **NVME_HOMES)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=chunk,
                                   states="8bit", min_8bit_size=0)
        _train(model, opt, 2)
        sd = copy.deepcopy(opt.state_dict())
        if reload:
            opt.close()
            opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=chunk,
                                       states="8bit", min_8bit_size=0)
            opt.load_state_dict(sd)
        losses = _train(model, opt, 2, seed=5)
        out = (sd, losses, _weights(model), _states(opt))
        opt.close()
        infinity.unwrap(model)
        return out

    sd_t, l_t, w_t, s_t = run(TINY, "tiny", reload=True)
    sd_h, l_h, w_h, s_h = run(HUGE, "huge", reload=False)
    _equal({i: {k: v for k, v in e.items() if isinstance(v, torch.Tensor)}
            for i, e in sd_t["state"].items()},
           {i: {k: v for k, v in e.items() if isinstance(v, torch.Tensor)}
            for i, e in sd_h["state"].items()})
    assert l_t == l_h
    _equal(w_t, w_h)
    _equal(s_t, s_h)


def test_parameters_written_between_steps(tmp_path):
    """A parameter written outside forward (an EMA copied back) is taken into the master
    weights of a shard stepped in units, as in one stepped whole, and as torch AdamW sees it
    (fp32 states: bitwise)."""
    def halve(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("weight") and p.dim() == 2:
                    p.mul_(0.5)

    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _train(ref, ref_opt, 2)
    halve(ref)
    want = _train(ref, ref_opt, 2, seed=9)
    results = []
    for chunk in (TINY, HUGE):
        model = _model()
        d = tmp_path / f"c{chunk}"
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), optimizer_tier="nvme", **NVME_HOMES)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=chunk)
        _train(model, opt, 2)
        halve(model)
        losses = _train(model, opt, 2, seed=9)
        results.append((losses, _weights(model), _states(opt)))
        opt.close()
        infinity.unwrap(model)
    (l1, w1, s1), (l2, w2, s2) = results
    assert l1 == l2 == want
    _equal(w1, w2)
    _equal(w1, _weights(ref))
    _equal(s1, s2)


def test_unit_checksums_after_chunked_write(tmp_path):
    """Each unit of a chunked shard is an extent of its own in the state file: the CRC the
    store records for it is the CRC32C of the file's bytes there, and a whole read (units put
    together into the shard's layout) verifies against them."""
    model = _model()
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=TINY)
    _train(model, opt, 2)
    store = next(iter(opt.core.wrapped.stores()))
    path = store.extents.store.path("optimizer-states")
    data = open(path, "rb").read()
    checked = 0
    for shard in opt.shards():
        if not store.plan(shard).chunked:
            continue
        assert opt.state_dicts.committed_extent(shard.key) is None  # not one contiguous layout
        for un, ext in zip(store.plan(shard).units, store.extents.committed[shard.key]):
            assert ext.nbytes == un.nbytes and ext.offset % 4096 == 0
            raw = torch.frombuffer(bytearray(data[ext.offset:ext.end]), dtype=torch.uint8)
            assert inf_io.crc32c(raw) == ext.crc
        buf = store.empty(shard)
        store.read_whole(shard, buf)  # raises on mismatch
        checked += 1
    assert checked >= 2
    opt.close()
    infinity.unwrap(model)


def test_corrupted_unit_is_detected_before_it_is_stepped(tmp_path):
    """One byte flipped in the last unit of a chunked shard: the step raises
    SwapCorruptionError naming it; that unit was neither stepped nor committed (its extent
    and CRC are as before), and every unit that did commit is recorded as stepped."""
    model = _model()
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=TINY)
    _train(model, opt, 1)
    store = next(iter(opt.core.wrapped.stores()))
    shard = next(s for s in opt.shards() if store.plan(s).chunked)
    before = {k: list(v) for k, v in store.extents.committed.items()}
    last = before[shard.key][-1]
    path = store.extents.store.path("optimizer-states")
    with open(path, "r+b") as f:  # one byte in the middle of the last unit's extent
        f.seek(last.offset + last.nbytes // 2)
        b = f.read(1)
        f.seek(last.offset + last.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(SwapCorruptionError, match="corrupted") as info:
        _train(model, opt, 1, seed=3)
    assert shard.key in str(info.value)
    assert store.extents.committed[shard.key][-1] == last  # not stepped, not committed
    for key, units in store.extents.committed.items():
        s = next(x for x in opt.shards() if x.key == key)
        changed = {i for i, (old, new) in enumerate(zip(before[key], units)) if old != new}
        if key in opt.core.done:
            assert changed == set(range(len(units)))
        else:
            assert changed == store.extents.stepped(s)
    opt.close()
    infinity.unwrap(model)


# ---- host bytes and the budget --------------------------------------------------------------
BIG = GPTConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=2, max_seq=16)


def test_host_bytes_bounded_by_sets_times_chunk(tmp_path):
    """The root shard (embedding + head, 0.27M parameters, 3.2 MB of fp32 states) is 50 chunks
    of 64 KiB: the optimizer's host bytes are its buffer sets, each at most a chunk."""
    chunk = 64 << 10
    torch.manual_seed(0)
    model = TinyGPT(BIG)
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    engine = infinity.runtime.engine_of(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=chunk)
    gen = torch.Generator().manual_seed(1)
    x, y = synthetic_batch(BIG, 2, 8, gen)
    lm_loss(model(x), y).backward()
    opt.step()
    store = next(iter(opt.core.wrapped.stores()))
    largest = max(store.layout(s).nbytes for s in opt.shards())
    assert largest >= 40 * chunk
    sets = next(iter(opt.core.wrapped.sets()))
    assert sets.grad_nbytes == sets.staging_nbytes == 0  # gradients and parameters in RAM
    assert sets.set_nbytes <= chunk
    host_opt = engine.tier_bytes()["host"]["optimizer"]
    assert host_opt == sets.nbytes == sets.count * sets.set_nbytes
    assert host_opt <= sets.count * chunk < largest
    opt.close()
    infinity.unwrap(model)


def test_host_bytes_with_gradients_and_parameters_on_nvme(tmp_path):
    """Where the engine keeps gradients and parameters on NVMe, each buffer set also holds its
    unit's gradients (whole pieces of the gradient file) and working copy, and the units are
    cut so that states, gradients and working copy fit the chunk together: no buffer of a
    whole shard (the root shard's gradients alone are 4x the chunk)."""
    chunk = 256 << 10
    torch.manual_seed(0)
    model = TinyGPT(BIG)
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme", chunk_bytes=16 << 10,
                  **NVME_HOMES)  # the engine's swap-file pieces: 16 KiB
    engine = infinity.runtime.engine_of(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=chunk)
    gen = torch.Generator().manual_seed(1)
    x, y = synthetic_batch(BIG, 2, 8, gen)
    lm_loss(model(x), y).backward()
    opt.step()
    sets = next(iter(opt.core.wrapped.sets()))
    largest = max(engine.flats, key=lambda f: f.numel)
    assert largest.numel * 4 >= 4 * chunk
    assert sets.grad_nbytes > 0 and sets.staging_nbytes > 0
    assert sets.set_nbytes <= chunk
    host_opt = engine.tier_bytes()["host"]["optimizer"]
    assert host_opt == sets.nbytes == sets.count * sets.set_nbytes <= sets.count * chunk
    assert not hasattr(sets, "slot_nbytes")
    opt.close()
    infinity.unwrap(model)


def test_budget_below_minimum_refused_at_construction(tmp_path):
    def wrapped(budget):
        torch.manual_seed(0)
        model = TinyGPT(BIG)
        d = tmp_path / str(budget)
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), param_tier="host", grad_tier="host",
                      optimizer_tier="nvme", host_budget=budget)
        return model, infinity.runtime.engine_of(model)

    model, engine = wrapped(16 << 20)
    grads = sum(f.numel * 4 for f in engine.flats)  # host accumulators, from the 1st backward
    engine_bytes = engine.host_budget.used + grads
    infinity.unwrap(model)
    budget = engine_bytes + (100 << 10)  # 100 KiB for the optimizer
    model, engine = wrapped(budget)
    free = engine.host_budget.limit - engine.host_budget.used - grads
    with pytest.raises(BudgetExceededError) as info:  # 3 sets of 64 KiB do not fit
        infinity.optim.AdamW(model.parameters(), chunk_bytes=64 << 10)
    msg = str(info.value)
    assert "infinity.optim" in msg and f"host_budget={budget:,}" in msg and "chunk_bytes" in msg
    need = int(msg.split("needs at least ")[1].split(":")[0].replace(",", ""))
    assert free < need <= 3 * (64 << 10)  # 3 units, each within the chunk
    assert f"needs host_budget >= {engine_bytes + need:,} bytes" in msg
    assert engine.host_budget.limit - engine.host_budget.used - grads == free  # nothing held
    # a chunk that fits: accepted, and its sets counted at construction, before any step
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=8 << 10)
    sets = next(iter(opt.core.wrapped.sets()))
    assert engine.host_budget.limit - engine.host_budget.used - grads == free - sets.nbytes
    assert sets.count >= 3 and sets.nbytes <= free
    gen = torch.Generator().manual_seed(1)
    x, y = synthetic_batch(BIG, 2, 8, gen)
    lm_loss(model(x), y).backward()
    opt.step()  # trains within the budget
    assert engine.host_budget.used <= budget
    opt.close()
    infinity.unwrap(model)


def test_sets_adapt_to_the_budget(tmp_path):
    """Above the minimum the number of sets follows what the budget leaves (never below 3)."""
    counts = []
    for budget in (16 << 20, 64 << 20):
        torch.manual_seed(0)
        model = TinyGPT(BIG)
        d = tmp_path / str(budget)
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), param_tier="host", grad_tier="host",
                      optimizer_tier="nvme", host_budget=budget)
        opt = infinity.optim.AdamW(model.parameters(), chunk_bytes=1 << 20)
        sets = next(iter(opt.core.wrapped.sets()))
        counts.append(sets.count)
        engine = infinity.runtime.engine_of(model)
        assert engine.host_budget.used <= budget
        opt.close()
        infinity.unwrap(model)
    assert counts[0] >= 3 and counts[0] <= counts[1]


@pytest.mark.parametrize("bad", [5000, 4096 + 1, 0, -4096, "3KiB", 1.5])
def test_chunk_not_a_multiple_of_4096_refused(tmp_path, bad):
    model = _model()
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    with pytest.raises((ValueError, TypeError), match="infinity"):
        infinity.optim.AdamW(model.parameters(), chunk_bytes=bad)
    infinity.unwrap(model)


def test_chunk_from_policy_and_size_string(tmp_path):
    model = _model()
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme", chunk_bytes="16KiB")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    assert next(iter(opt.core.wrapped.stores())).chunk_bytes == 16 << 10
    assert max(_units(opt).values()) >= 20
    opt.close()
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes="32KiB")
    _train(model, opt, 1)
    assert next(iter(opt.core.wrapped.stores())).chunk_bytes == 32 << 10
    opt.close()
    infinity.unwrap(model)


# ---- geometry ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit", "mixed"])
@pytest.mark.parametrize("chunk", [8 << 10, 20 << 10, 64 << 10])
def test_unit_geometry_tiles_the_layout(tmp_path, fmt, chunk):
    """Units cover the elements in order; each unit's extent packs its spans without overlap
    (4096-aligned size); over all units the spans of each region tile it in order, so the
    units together hold every byte of the shard's layout once; extents stay within the chunk
    once the chunk is above the per-region slack."""
    from infinity.optim.step.layout import layout_for
    model = _model()
    infinity.wrap(model, nvme_path=str(tmp_path), optimizer_tier="nvme")
    engine = infinity.runtime.engine_of(model)
    page = inf_io.ALIGNMENT
    for flat in engine.flats:
        cycle = ["8bit", "fp32", "8bit", "bf16"]
        layout = layout_for(flat, fmt if fmt != "mixed" else
                            [cycle[i % 4] for i in range(len(flat.slots))], True)
        slots = [(s.offset, s.numel) for s in flat.slots]
        plan = chunks.plan_chunks(layout, slots, chunk)
        if not plan.chunked:
            assert layout.nbytes <= chunk
            continue
        assert [u.start for u in plan.units][0] == 0 and plan.units[-1].end == layout.numel
        assert all(x.end == y.start for x, y in zip(plan.units, plan.units[1:]))
        assert plan.nbytes == sum(u.nbytes for u in plan.units)
        ends: Dict[str, int] = {}
        content = 0
        for u in plan.units:
            assert u.nbytes % page == 0
            at = 0
            for name, s0, e0, p in sorted(u.spans, key=lambda x: x[3]):
                assert p >= at and p + (e0 - s0) <= u.nbytes  # packed, no overlap
                at = p + (e0 - s0)
                assert ends.get(name, s0) == s0, name  # the region tiled in order
                ends[name] = e0
                content += e0 - s0
            if chunk >= 2 * 9 * page + 256 * 12:
                assert u.nbytes <= chunk
        assert content == layout.master_nbytes + layout.moment_nbytes
        # the unit-major extents cost at most a page (and 16-byte span starts) per unit
        assert plan.nbytes <= layout.nbytes + len(plan.units) * (page + 16 * 9)
        whole = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8)
        back = torch.zeros_like(whole)
        tmp = torch.empty(plan.buffer_nbytes, dtype=torch.uint8)
        for u in plan.units:  # gather then scatter: every content byte comes back
            chunks.gather_unit(u, whole, tmp)
            chunks.scatter_unit(u, tmp, back)
        n = layout.master_nbytes + layout.moment_nbytes
        assert torch.equal(back[:n], whole[:n])
    infinity.unwrap(model)


def test_bench_nvme_chunked_step_quick(tmp_path):
    import json
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(repo, "benchmarks",
                                                        "bench_nvme_chunked_step.py"),
                           "--quick", "--nvme-path", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    before, *after = res["set_bytes_3b"]
    assert before["sets"] == 16_585_175_040  # the figure the 3B run was refused with
    for row in after:
        assert row["sets"] <= 3 * row["chunk"] and row["units"] > 1
    assert {r["states"] for r in res["step"]} == {"fp32", "8bit"}
    assert all(r["step_ms"] > 0 for r in res["step"])
    assert any(r["units"] > 10 for r in res["step"])
