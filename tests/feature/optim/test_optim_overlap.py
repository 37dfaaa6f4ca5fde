"""The optimizer step overlapping backward (infinity.optim.overlap): every mode gives bitwise the
result of the step after backward -- without clipping (updates kept), with clipping that
triggers, loss scaling, an lr change, gradient accumulation, zero_grad or a failed write
(updates rolled back and redone) -- and the quick benchmark runs."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from test_optim import CFG, _model, _train

import infinity
from infinity.models import lm_loss, synthetic_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEPS = 5


def _wrap(base, path, **kw):
    model = copy.deepcopy(base)
    path.mkdir(exist_ok=True)
    infinity.wrap(model, nvme_path=str(path), param_tier="nvme", grad_tier="nvme",
                  optimizer_tier="nvme", **kw)
    return model


def _snapshot(opt, model):
    states = {s.key: (torch.cat([s.master, s.exp_avg, s.exp_avg_sq]).clone(), s.steps)
              for s in opt.state_dicts.shard_states()}
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return states, weights


def _assert_same(a, b):
    (sa, wa), (sb, wb) = a, b
    assert sa.keys() == sb.keys() and wa.keys() == wb.keys()
    for k in sa:
        assert torch.equal(sa[k][0], sb[k][0]), k
        assert sa[k][1] == sb[k][1], k
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _run(base, path, overlap, steps=STEPS, fmt="fp32", loop=None, **train_kw):
    model = _wrap(base, path)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, states=fmt, overlap=overlap)
    losses = (loop or _train)(model, opt, steps, **train_kw)
    out = (losses, _snapshot(opt, model), opt._overlap.kept_total,
           opt._overlap.rolled_back_total)
    opt.close()
    infinity.unwrap(model)
    return out


@pytest.fixture(scope="module")
def base():
    return _model()


def test_overlap_argument_is_checked():
    with pytest.raises(ValueError, match="overlap must be"):
        infinity.optim.AdamW(_model().parameters(), overlap="yes")


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_overlap_without_clipping_is_bitwise_and_kept(base, tmp_path, fmt):
    ref = _run(base, tmp_path / "ref", False, fmt=fmt)
    for mode in (True, "auto"):
        got = _run(base, tmp_path / str(mode), mode, fmt=fmt)
        assert got[0] == ref[0]
        _assert_same(got[1], ref[1])
        assert got[3] == 0  # nothing rolled back
    # True: every step after the first (states exist) keeps the non-root shards' updates;
    # auto: from the third step on (two steps with one backward each seen first)
    assert got[2] > 0
    assert _run(base, tmp_path / "t2", True, fmt=fmt)[2] > got[2]


def test_clipping_that_triggers_rolls_back_exactly(base, tmp_path):
    ref = _run(base, tmp_path / "ref", False, clip=0.05)
    got = _run(base, tmp_path / "ov", True, clip=0.05)
    assert got[0] == ref[0]
    _assert_same(got[1], ref[1])
    assert got[2] == 0 and got[3] > 0  # every speculative update redone with the coefficient


def test_clipping_that_does_not_trigger_keeps_the_updates(base, tmp_path):
    ref = _run(base, tmp_path / "ref", False, clip=1e6)
    got = _run(base, tmp_path / "ov", True, clip=1e6)
    assert got[0] == ref[0]
    _assert_same(got[1], ref[1])
    assert got[2] > 0 and got[3] == 0


def test_gradient_accumulation_never_uses_an_early_update(base, tmp_path):
    ref = _run(base, tmp_path / "ref", False, micro=3)
    forced = _run(base, tmp_path / "true", True, micro=3)
    auto = _run(base, tmp_path / "auto", "auto", micro=3)
    for got in (forced, auto):
        assert got[0] == ref[0]
        _assert_same(got[1], ref[1])
    assert forced[3] > 0            # True speculated on the first micro-batch and rolled back
    assert auto[2] == 0 and auto[3] == 0  # auto never armed: no step had a single backward


def _loop_with_changes(model, opt, steps, *, change):
    """A loop that changes something between backward and step (``change(opt, i)``)."""
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        x, y = synthetic_batch(CFG, 2, 8, gen)
        loss = lm_loss(model(x), y)
        loss.backward()
        change(opt, i)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_lr_changed_between_backward_and_step(base, tmp_path):
    def change(opt, i):
        for g in opt.param_groups:
            g["lr"] = 1e-3 if i < 2 else 2e-3  # changed once, before the third step
    ref = _run(base, tmp_path / "ref", False, loop=lambda m, o, n: _loop_with_changes(
        m, o, n, change=change))
    got = _run(base, tmp_path / "ov", True, loop=lambda m, o, n: _loop_with_changes(
        m, o, n, change=change))
    assert got[0] == ref[0]
    _assert_same(got[1], ref[1])
    assert got[2] > 0 and got[3] > 0  # kept where lr did not change, redone where it did


def test_grad_multiplier_and_zero_grad_between_backward_and_step(base, tmp_path):
    def change(opt, i):
        if i == 2:
            opt.set_grad_multiplier(0.5)  # as LossScaler.unscale_ does
        if i == 3:  # throw this batch away: zero_grad without a step, then another backward
            opt.zero_grad()
    ref = _run(base, tmp_path / "ref", False, loop=lambda m, o, n: _loop_with_changes(
        m, o, n, change=change))
    got = _run(base, tmp_path / "ov", True, loop=lambda m, o, n: _loop_with_changes(
        m, o, n, change=change))
    assert got[0] == ref[0]
    _assert_same(got[1], ref[1])
    assert got[3] > 0


def test_failed_speculative_update_is_redone_by_the_step(base, tmp_path, monkeypatch):
    """An error on the worker (here: its kernel call, during backward) rolls back every
    speculative update of that backward; the step redoes them."""
    from infinity.optim.core import AdamCore
    real = AdamCore.apply
    calls = []

    def flaky(self, shard, runs, buf, staging, multiplier, grad=None, hypers=None):
        if hypers is not None:
            calls.append(shard.key)
            if len(calls) == 3:
                raise OSError(5, "simulated failure of a speculative update")
        return real(self, shard, runs, buf, staging, multiplier, grad, hypers)

    ref = _run(base, tmp_path / "ref", False)
    monkeypatch.setattr(AdamCore, "apply", flaky)
    got = _run(base, tmp_path / "ov", True)
    assert len(calls) > 3
    assert got[0] == ref[0]
    _assert_same(got[1], ref[1])
    assert got[3] > 0


def test_bench_overlap_quick(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_overlap.py"),
                           "--quick", "--nvme-path", str(tmp_path), "--json", str(out),
                           "--give-back-every", "2"],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["bitwise_equal"] is True  # with the kept disk given back every other step
    for key in ("backward_s", "step_s", "overlapped_s"):
        assert res[key] > 0
    assert res["kept_shards_per_step"] > 0
    gb = res["give_back"]
    assert gb["every"] == 2 and gb["overlap_given_back_bytes"] > 0
    assert gb["overlapped_s_after"] > 0 and gb["overlapped_s_other"] > 0


def test_auto_backs_off_when_updates_keep_being_redone(base, tmp_path):
    """A loop whose clipping always triggers: "auto" speculates, is rolled back, then sits out
    1, 2, 4 .. steps -- few rollbacks, same result."""
    steps = 10
    ref = _run(base, tmp_path / "ref", False, steps=steps, clip=0.05)
    got = _run(base, tmp_path / "auto", "auto", steps=steps, clip=0.05)
    assert got[0] == ref[0]
    _assert_same(got[1], ref[1])
    # armed at steps 3, 5 and 8 (1-based) only: 3 rollbacks of the non-root shards
    assert got[2] == 0 and 0 < got[3] <= 3 * len(got[1][0]), got[3]


def test_unwrap_between_backward_and_step_gives_the_weights_before_the_step(base, tmp_path):
    def loop(model, opt, steps):
        losses = _train(model, opt, steps)
        x, y = synthetic_batch(CFG, 2, 8, torch.Generator().manual_seed(9))
        lm_loss(model(x), y).backward()  # armed: updates run, then no step
        return losses

    ref_model = _wrap(base, tmp_path / "ref")
    ref_opt = infinity.optim.AdamW(ref_model.parameters(), lr=1e-3, overlap=False)
    loop(ref_model, ref_opt, 3)
    ref_opt.close()
    infinity.unwrap(ref_model)
    model = _wrap(base, tmp_path / "ov")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=True)
    loop(model, opt, 3)
    assert opt._overlap.pending  # speculative updates exist
    infinity.unwrap(model)  # before opt.close(): the engine undoes them itself
    assert opt._overlap.rolled_back_total > 0 and not opt._overlap.pending
    opt.close()
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n


def test_a_dropped_optimizer_is_freed_at_once(base, tmp_path):
    """The engine holds the overlap listener, not the optimizer: an optimizer dropped without
    close() is freed by reference counting (its state files closed), as before."""
    import weakref
    model = _wrap(base, tmp_path / "m")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    ref = weakref.ref(opt)
    del opt
    assert ref() is None
    infinity.unwrap(model)


def test_materialized_right_after_backward_waits_for_the_updates_in_flight(base, tmp_path,
                                                                          monkeypatch):
    """The worker's parameter writes are slowed down; ``materialized`` right after backward
    (a logged weight, a model-only checkpoint) must not read a home while its speculative
    write is in flight (it would read the old block and fail its checksum, or a torn one): it
    shows whole updated blocks, the ones ``opt.step()`` keeps, and training goes on exactly."""
    import threading
    import time

    from infinity.runtime.homes.ranges import HomeWorkingCopy
    real = HomeWorkingCopy.write

    def slow(self, flat, src):
        if threading.current_thread().name == "infinity-optim-overlap":
            time.sleep(0.05)
        return real(self, flat, src)

    def loop(model, opt, steps, shown):
        def look(opt, i):
            with infinity.materialized(model):
                shown.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return _loop_with_changes(model, opt, steps, change=look)

    before = []  # without overlap: the weights before each step
    ref = _run(base, tmp_path / "ref", False, loop=lambda m, o, n: loop(m, o, n, before))
    monkeypatch.setattr(HomeWorkingCopy, "write", slow)
    shown = []
    model = _wrap(base, tmp_path / "ov")
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=True)
    losses = loop(model, opt, STEPS, shown)
    kept = opt._overlap.kept_total
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = (losses, _snapshot(opt, model))
    opt.close()
    infinity.unwrap(model)
    assert kept > 0  # the updates ran while backward did, and were kept
    assert got[0] == ref[0]
    _assert_same(got[1], ref[1])
    # between backward and step a speculatively updated block shows its whole update (kept at
    # the step), every other block its weights before the step; never a mix
    updated = 0
    for n, p in after.items():
        if torch.equal(shown[-1][n], p) and not torch.equal(p, before[-1][n]):
            updated += 1
        else:
            assert torch.equal(shown[-1][n], before[-1][n]), n
    assert updated > 0
