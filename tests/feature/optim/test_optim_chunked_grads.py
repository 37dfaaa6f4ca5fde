"""The NVMe optimizer step with parameters *and* gradients on NVMe, bounded by the chunk: each
unit's gradients are read as whole pieces of the gradient file and its updated working copy is
written as whole pieces of the parameter swap file (the partial piece at a unit's edge is
finished by the next unit), so no buffer of the step holds a whole shard.

Every comparison is bitwise (``torch.equal``): small chunks (the engine's swap-file pieces of
8-16 KiB, so each block is dozens of units and a gradient / home piece is shared by several
units, or one unit spans several pieces) against a run whose chunk is larger than every flat,
and, for fp32 states, against ``torch.optim.AdamW(fused=True)``."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch
from optim_helpers import assert_equal as _equal
from optim_helpers import states as _states
from optim_helpers import weights as _weights

import infinity
from infinity.models import GPTConfig, TinyGPT, lm_loss, synthetic_batch
from infinity.runtime.port import OptimizerPort

CFG = GPTConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=2, max_seq=16)
HUGE = 1 << 30
ALL_NVME = dict(param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme")
# (the engine's chunk: its swap files' pieces, the optimizer's chunk; None: the engine's)
SMALL = [(16 << 10, None), (8 << 10, 96 << 10)]


def _model(dtype: torch.dtype = torch.float32) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CFG).to(dtype)


def _train(model, opt, steps: int, *, micro: int = 2, clip: Optional[float] = 0.5,
           seed: int = 1, torch_opt: bool = False, after_step=None) -> List[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        for _ in range(micro):
            x, y = synthetic_batch(CFG, 2, 8, gen)
            loss = lm_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            if torch_opt:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                opt.clip_grad_norm_(clip)
        opt.step()
        if after_step is not None:
            after_step(opt)
        opt.zero_grad()
    return losses


def _no_whole_shard_io(engine, opt) -> List[str]:
    """Makes the engine's whole-flat gradient read and working-copy write fail while the
    optimizer steps a shard cut in units; returns the log of ranged calls."""
    calls: List[str] = []
    inside = [False]
    store = lambda: next(iter(opt.core.wrapped.stores()))  # noqa: E731

    def cut(flat) -> bool:
        shard = opt.core.wrapped.shards.get(id(flat))
        return shard is not None and store().plan(shard).chunked

    read, read_range = engine.grads.reads.read, engine.grads.reads.read_range
    write_home, write_range = engine.working.write, engine.working.write_range

    def guarded_read(flat, dst):
        if inside[0] and cut(flat):
            raise AssertionError(f"whole gradient read of {flat.key} in the step")
        return read(flat, dst)

    def guarded_write(flat, src):
        if inside[0] and cut(flat):
            raise AssertionError(f"whole working-copy write of {flat.key} in the step")
        return write_home(flat, src)

    def logged_read_range(flat, start, end, dst):
        calls.append("grad")
        return read_range(flat, start, end, dst)

    def logged_write_range(flat, start, src):
        calls.append("home")
        return write_range(flat, start, src)

    engine.grads.reads.read = guarded_read
    engine.grads.reads.read_range = logged_read_range
    engine.working.write = guarded_write
    engine.working.write_range = logged_write_range
    step = opt.step

    def guarded_step(*args, **kwargs):
        inside[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            inside[0] = False

    opt.step = guarded_step
    return calls


def _run(tmp_path, name: str, engine_chunk: int, opt_chunk: Optional[int], *,
         dtype=torch.float32, steps: int = 3, guard: bool = False, **kw
         ) -> Tuple[List[float], Dict, Dict, Dict[str, int], List[str]]:
    model = _model(dtype)
    d = tmp_path / name
    d.mkdir()
    # as stored (bf16 homes compute in bf16: pinned, "auto" would compute them in fp32 on
    # a CPU without fast bf16)
    infinity.wrap(model, nvme_path=str(d), chunk_bytes=engine_chunk, compute_dtype=dtype,
                  **ALL_NVME)
    engine = infinity.runtime.engine_of(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=opt_chunk, **kw)
    calls = _no_whole_shard_io(engine, opt) if guard else []
    try:
        losses = _train(model, opt, steps)
        store = next(iter(opt.core.wrapped.stores()))
        units = {s.key: len(store.plan(s).units) for s in opt.shards()}
        return losses, _weights(model), _states(opt), units, calls
    finally:
        opt.close()
        infinity.unwrap(model)


CASES = [("fp32", torch.float32, {}), ("bf16", torch.float32, {}),
         ("8bit", torch.float32, dict(min_8bit_size=0)),
         ("8bit", torch.bfloat16, dict(min_8bit_size=0)),
         ("8bit", torch.float32, {})]  # bitsandbytes' defaults: mixed-format shards


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("small", range(len(SMALL)))
def test_ranged_gradients_and_working_copy_are_bitwise_the_whole_step(tmp_path, case, small):
    """3 steps of 2 accumulated micro-batches each, clipped: chunked == whole, bitwise; the
    step never reads a whole gradient or writes a whole working copy of a cut shard."""
    fmt, dtype, extra = CASES[case]
    engine_chunk, opt_chunk = SMALL[small]
    kw = dict(states=fmt, dtype=dtype, **extra)
    l1, w1, s1, units, calls = _run(tmp_path, "small", engine_chunk, opt_chunk, guard=True,
                                    **kw)
    l2, w2, s2, whole, _ = _run(tmp_path, "huge", HUGE, HUGE, **kw)
    assert max(units.values()) >= 10, units  # the shards really were cut
    assert set(whole.values()) == {1}
    assert calls.count("grad") >= 20 and calls.count("home") >= 20, calls.count("grad")
    assert l1 == l2
    _equal(w1, w2)
    _equal(s1, s2)


@pytest.mark.parametrize("small", range(len(SMALL)))
def test_fp32_states_equal_torch_adamw(tmp_path, small):
    """Accumulation over 2 micro-batches and clipping, parameters, gradients and states on
    NVMe in small chunks: bitwise torch.optim.AdamW(fused=True) with
    torch.nn.utils.clip_grad_norm_."""
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    want = _train(ref, ref_opt, 3, torch_opt=True)
    engine_chunk, opt_chunk = SMALL[small]
    got, w, _, units, _ = _run(tmp_path, "small", engine_chunk, opt_chunk)
    assert max(units.values()) >= 10
    assert got == want
    _equal(w, _weights(ref))


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_overlap_with_ranged_gradients(tmp_path, fmt):
    """overlap=True (updates during backward, through the same ranged reads and writes) and
    clipping that triggers: kept or rolled back, bitwise the step after backward."""
    results = []
    for engine_chunk, opt_chunk in ((16 << 10, None), (HUGE, HUGE)):
        model = _model()
        d = tmp_path / f"c{engine_chunk}"
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), chunk_bytes=engine_chunk, **ALL_NVME)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, chunk_bytes=opt_chunk,
                                   states=fmt, min_8bit_size=0, overlap=True)
        losses = _train(model, opt, 4, micro=1, clip=1.0)
        losses += _train(model, opt, 3, micro=1, clip=None, seed=7)  # updates kept
        store = next(iter(opt.core.wrapped.stores()))
        units = max(len(store.plan(s).units) for s in opt.shards())
        results.append((losses, _weights(model), _states(opt), opt._overlap.kept_total, units))
        opt.close()
        infinity.unwrap(model)
    (l1, w1, s1, k1, u1), (l2, w2, s2, _, u2) = results
    assert u1 >= 10 and u2 == 1
    assert k1 > 0  # some chunked updates ran during backward and were kept
    assert l1 == l2
    _equal(w1, w2)
    _equal(s1, s2)


BIG = GPTConfig(vocab_size=4096, d_model=64, n_layers=2, n_heads=2, max_seq=16)


@pytest.mark.parametrize("fmt,dtype", [("fp32", torch.float32), ("8bit", torch.bfloat16)])
def test_host_bytes_bounded_by_sets_times_chunk(tmp_path, fmt, dtype):
    """A root shard of 0.27M parameters (1 MB of fp32 gradients, 4x the chunk; its states
    6-13x) with parameters, gradients and states on NVMe: the optimizer's host bytes are its
    buffer sets, each at most one chunk (states, gradients and working copy of one unit)."""
    chunk = 256 << 10
    torch.manual_seed(0)
    model = TinyGPT(BIG).to(dtype)
    infinity.wrap(model, nvme_path=str(tmp_path), chunk_bytes=16 << 10, compute_dtype=dtype,
                  **ALL_NVME)
    engine = infinity.runtime.engine_of(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=chunk, states=fmt,
                               min_8bit_size=0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = synthetic_batch(BIG, 2, 8, gen)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    sets = next(iter(opt.core.wrapped.sets()))
    largest = max(engine.flats, key=lambda f: f.numel)
    assert largest.numel * 4 >= 4 * chunk
    assert 0 < sets.grad_nbytes < largest.numel * 4
    assert 0 < sets.staging_nbytes < largest.home_nbytes
    assert sets.set_nbytes <= chunk
    host_opt = engine.tier_bytes()["host"]["optimizer"]
    assert host_opt == sets.nbytes == sets.count * sets.set_nbytes <= sets.count * chunk
    opt.close()
    infinity.unwrap(model)


def test_budget_minimum_counts_one_chunk_per_set(tmp_path):
    """With parameters and gradients on NVMe, the construction-time minimum is 3 sets of
    about one chunk each (no whole-shard buffer on top): a budget that leaves less is refused
    when the optimizer is constructed, naming that minimum; one that leaves more is used."""
    chunk = 256 << 10

    def wrapped(budget: int):
        torch.manual_seed(0)
        model = TinyGPT(BIG)
        d = tmp_path / f"{budget}-{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), chunk_bytes=16 << 10, host_budget=budget,
                      **ALL_NVME)
        return model, infinity.runtime.engine_of(model)

    model, engine = wrapped(16 << 20)
    used = engine.host_budget.used
    infinity.unwrap(model)
    model, engine = wrapped(used + 2 * chunk)  # room for 2 chunks, not 3
    with pytest.raises(infinity.tiers.budget.BudgetExceededError) as info:
        infinity.optim.AdamW(model.parameters(), chunk_bytes=chunk)
    msg = str(info.value)
    need = int(msg.split("needs at least ")[1].split(":")[0].replace(",", ""))
    assert 2 * chunk < need <= 3 * chunk and "infinity.optim" in msg
    assert "working copy" in msg and "shard buffer" not in msg
    infinity.unwrap(model)
    model, engine = wrapped(16 << 20)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=chunk)
    sets = next(iter(opt.core.wrapped.sets()))
    assert sets.nbytes <= sets.count * chunk
    gen = torch.Generator().manual_seed(1)
    x, y = synthetic_batch(BIG, 2, 8, gen)
    lm_loss(model(x), y).backward()
    opt.step()
    assert engine.host_budget.used <= engine.host_budget.limit
    opt.close()
    infinity.unwrap(model)


def test_inf_in_a_large_accumulated_gradient_is_found_in_ranges(tmp_path):
    """A slot larger than the engine's chunk that accumulates over micro-batches has no
    measured norm, so check_finite=True reads the gradients back: range by range (never the
    whole flat), finding a nan that only the second micro-batch put in; the step is skipped
    and nothing changes. The same run without the nan steps."""
    results = []
    for poison in (True, False):
        model = _model()
        d = tmp_path / f"p{poison}"
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), chunk_bytes=16 << 10, **ALL_NVME)
        engine = infinity.runtime.engine_of(model)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, check_finite=True)
        before = _weights(model)
        calls: List[int] = []
        read, read_range = engine.grads.reads.read, engine.grads.reads.read_range

        def no_whole(flat, dst):
            raise AssertionError(f"whole gradient read of {flat.key}")

        def counted(flat, start, end, dst):
            calls.append(end - start)
            return read_range(flat, start, end, dst)

        engine.grads.reads.read, engine.grads.reads.read_range = no_whole, counted
        gen = torch.Generator().manual_seed(1)
        for micro in range(2):
            x, y = synthetic_batch(CFG, 2, 8, gen)
            handle = None
            if poison and micro == 1:
                def hook(g: torch.Tensor) -> torch.Tensor:
                    g = g.clone()
                    g[-1, -1] = float("nan")
                    return g
                handle = model.tok.weight.register_hook(hook)
            lm_loss(model(x), y).backward()
            if handle is not None:
                handle.remove()
        big = max(engine.flats, key=lambda f: f.numel)
        assert big.numel * 4 > 4 * (16 << 10)
        assert engine.grads.finite(big) is None  # unknown: the optimizer reads them
        calls.clear()
        opt.step()
        assert calls and max(calls) * 4 <= max(16 << 10, opt.core.wrapped.chunk_for(OptimizerPort.of(engine)))
        results.append((opt.skipped_steps, _weights(model), before))
        engine.grads.reads.read = read
        opt.close()
        infinity.unwrap(model)
    (skipped, after, before), (skipped2, after2, before2) = results
    assert skipped == 1
    _equal(after, before)
    assert skipped2 == 0 and not torch.equal(after2["tok.weight"], before2["tok.weight"])


def test_overlap_rolled_back_by_accumulation_restores_parameters(tmp_path):
    """overlap=True with 2 micro-batches: updates that started during the first backward are
    rolled back when the second forward starts, and the parameters are rewritten from the
    committed masters unit by unit (whole home pieces) before that forward reads them:
    bitwise the run without overlap."""
    results = []
    for overlap in (True, False):
        model = _model()
        d = tmp_path / f"o{overlap}"
        d.mkdir()
        infinity.wrap(model, nvme_path=str(d), chunk_bytes=16 << 10, **ALL_NVME)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-2, states="8bit",
                                   min_8bit_size=0, overlap=overlap)
        losses = _train(model, opt, 3, micro=2, clip=None)
        store = next(iter(opt.core.wrapped.stores()))
        units = max(len(store.plan(s).units) for s in opt.shards())
        results.append((losses, _weights(model), _states(opt), opt._overlap.rolled_back_total,
                        units))
        opt.close()
        infinity.unwrap(model)
    (l1, w1, s1, rolled, units), (l2, w2, s2, _, _) = results
    assert rolled > 0 and units >= 10
    assert l1 == l2
    _equal(w1, w2)
    _equal(s1, s2)


@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_parameters_written_between_steps_follow_unit_by_unit(tmp_path, tiers):
    """A weight written outside forward (halved, like an EMA copied back) is taken into the
    masters of a shard stepped in units, read and rewritten unit by unit (home pieces of 16
    KiB, or the host home): bitwise torch AdamW."""
    def halve(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("weight") and p.dim() == 2:
                    p.mul_(0.5)

    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _train(ref, ref_opt, 2, micro=1, clip=None, torch_opt=True)
    halve(ref)
    want = _train(ref, ref_opt, 2, micro=1, clip=None, seed=9, torch_opt=True)
    model = _model()
    settings = ALL_NVME if tiers == "nvme" else dict(param_tier="host", grad_tier="host",
                                                     optimizer_tier="nvme")
    infinity.wrap(model, nvme_path=str(tmp_path), chunk_bytes=16 << 10, **settings)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, micro=1, clip=None)
    halve(model)
    got = _train(model, opt, 2, micro=1, clip=None, seed=9)
    store = next(iter(opt.core.wrapped.stores()))
    assert max(len(store.plan(s).units) for s in opt.shards()) >= 10
    assert got == want
    _equal(_weights(model), _weights(ref))
    opt.close()
    infinity.unwrap(model)



@pytest.mark.parametrize("host_blocks", [0, 1])
def test_overlap_writes_each_gradient_once(tmp_path, host_blocks):
    """With the step overlapping backward, the optimizer's worker holds blocks' gradient
    chunks in RAM while backward fills the next block's chunks in the same pool. A Llama
    layer's flat ends with its two norms, whose gradients arrive last: the chunk holding them
    is opened first (by the down projection's gradient) and stays incomplete through the
    block's backward. When the pool runs out, a complete chunk is written or backward waits
    for a held one; the incomplete chunk is not written out, read back and written again.
    Every step writes each gradient byte once (the bytes of the first step, which holds
    nothing) and reads at most that much."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    infinity.wrap(model, nvme_path=str(tmp_path), chunk_bytes=16 << 10,
                  host_blocks=host_blocks, **ALL_NVME)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=True)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    written, read, kept = [], [], 0
    infinity.stats(model, reset=True)
    for _ in range(6):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        kept += opt.last_step_stats.overlapped_shards
        opt.zero_grad()
        moved = infinity.stats(model, reset=True)["nvme_per_step"]["bytes"]
        written.append(moved["grads_written"])
        read.append(moved["grads_read"])
    opt.close()
    assert kept > 0  # updates ran during backward and were kept (they held gradient chunks)
    assert written[0] > 0
    assert written == [written[0]] * len(written), written
    assert max(read) <= written[0], (read, written)
