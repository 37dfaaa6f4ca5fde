"""Gradients without the NVMe round trip: with the step overlapping backward, each block's
update takes its gradients from RAM (never read back), and with ``keep_grads="auto"`` they
are not written either once the loop has shown it does not need them after backward. Every
case stays bitwise the step after backward (and torch AdamW); where a gradient that was not
written is needed after all, the step raises instead of guessing."""
import copy

import pytest
import torch
from test_optim import CFG, _model, _train
from test_optim_overlap import _assert_same, _snapshot, _wrap

import infinity
from infinity.models import lm_loss, synthetic_batch

STEPS = 6


def _per_step(model):
    return infinity.stats(model)["nvme_per_step"]


def _root_grad_bytes(model):
    """fp32 gradient bytes of the root block (its gradients are closed at the end of
    backward, after the step overlapping it has started: always written and read back)."""
    engine = infinity.api._engine(model)
    return sum(f.numel * 4 for b in engine.blocks if b.is_root for f in b.flats if f.trainable)


def _run(base, path, *, overlap, keep_grads=True, steps=STEPS, loop=None, **train_kw):
    """Trains a wrapped copy (everything on NVMe); returns losses, states + weights, and the
    per-step NVMe byte counters of each step."""
    model = _wrap(base, path)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=overlap,
                               keep_grads=keep_grads)
    per_step = []

    def on_step(_opt, *_a, **_k):
        per_step.append(_per_step(model))

    handle = opt.register_step_post_hook(on_step)
    losses = (loop or _train)(model, opt, steps, **train_kw)
    handle.remove()
    out = dict(losses=losses, snap=_snapshot(opt, model), steps=per_step,
               root=_root_grad_bytes(model), total=sum(f.numel * 4 for f in
                                                      infinity.api._engine(model).flats),
               kept=opt._overlap.kept_total, unwritten=opt._overlap.unwritten_total)
    opt.close()
    infinity.unwrap(model)
    return out


@pytest.fixture(scope="module")
def base():
    return _model()


def _torch_reference(base, steps=STEPS, clip=None, micro=1):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = _train(model, opt, steps, micro=micro, clip=clip,
                    clip_fn=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_torch(got, ref, **tol):
    """Bitwise by default; ``tol`` where the math differs (see the caller)."""
    tol = tol or dict(rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref[0]), **tol)
    weights = got["snap"][1]
    for k, v in ref[1].items():
        torch.testing.assert_close(weights[k], v, **tol, msg=lambda m: f"{k}: {m}")


def test_keep_grads_argument_is_checked(base):
    with pytest.raises(ValueError, match="keep_grads must be"):
        infinity.optim.AdamW(_model().parameters(), keep_grads="never")


def test_no_clipping_gradients_never_touch_nvme_and_stay_bitwise(base, tmp_path):
    ref = _run(base, tmp_path / "ref", overlap=False)
    kept = _run(base, tmp_path / "keep", overlap=True, keep_grads=True)
    auto = _run(base, tmp_path / "auto", overlap=True, keep_grads="auto")
    for got in (kept, auto):
        assert got["losses"] == ref["losses"]
        _assert_same(got["snap"], ref["snap"])
    _assert_torch(auto, _torch_reference(base))
    total, root = ref["total"], ref["root"]
    assert 0 < root < total
    last = [s["bytes"] for s in ref["steps"]][-1]
    assert last["grads_written"] == total and last["grads_read"] == total
    # keep_grads=True: written, but the update takes them from RAM (only the root is read)
    last = kept["steps"][-1]["bytes"]
    assert last["grads_written"] == total and last["grads_read"] == root
    # auto: armed at step 2 (states exist), quiet there, so from step 3 on only the root
    # block's gradients reach the disk
    for s in auto["steps"][2:]:
        assert s["bytes"]["grads_written"] == root and s["bytes"]["grads_read"] == root, s
    assert auto["unwritten"] > 0
    saved = ref["steps"][-1]["bytes_per_param"]["grads_written"] \
        - auto["steps"][-1]["bytes_per_param"]["grads_written"]
    assert saved > 0


def test_accumulation_is_exact_and_written(base, tmp_path):
    ref = _run(base, tmp_path / "ref", overlap=False, micro=2)
    got = _run(base, tmp_path / "auto", overlap=True, keep_grads="auto", micro=2)
    assert got["losses"] == ref["losses"]
    _assert_same(got["snap"], ref["snap"])
    _assert_torch(got, _torch_reference(base, micro=2))
    assert got["unwritten"] == 0  # a loop that accumulates never skips a write
    for s in got["steps"]:
        assert s["bytes"]["grads_written"] >= got["total"]


@pytest.mark.parametrize("clip", [1e6, 0.05], ids=["not_firing", "firing"])
def test_clipping_is_exact_and_keeps_writing(base, tmp_path, clip):
    ref = _run(base, tmp_path / "ref", overlap=False, clip=clip)
    got = _run(base, tmp_path / "auto", overlap=True, keep_grads="auto", clip=clip)
    assert got["losses"] == ref["losses"]
    _assert_same(got["snap"], ref["snap"])
    # a clip that fires: torch's norm sums per-tensor norms in its own order (which depends
    # on its thread count) and rewrites the gradients, infinity multiplies inside the kernel:
    # 1e-6 relative, 2e-7 absolute for weights near zero (1.06e-7 seen on one thread);
    # against the step after backward (above) it is bitwise
    tol = {} if clip > 1 else dict(rtol=1e-6, atol=2e-7)
    _assert_torch(got, _torch_reference(base, clip=clip), **tol)
    assert got["unwritten"] == 0  # a loop that clips may have to redo: always written
    last = got["steps"][-1]["bytes"]
    assert last["grads_written"] == got["total"]
    if clip > 1:  # never clips: the updates are kept, nothing read back but the root
        assert got["kept"] > 0 and last["grads_read"] == got["root"]


def _quiet_then(model, opt, steps, *, then):
    """``steps`` plain steps, then one more backward followed by ``then(model, opt)``."""
    losses = _train(model, opt, steps)
    x, y = synthetic_batch(CFG, 2, 8, torch.Generator().manual_seed(7))
    lm_loss(model(x), y).backward()
    then(model, opt)
    return losses


def test_a_step_that_must_be_redone_without_its_gradients_raises(base, tmp_path):
    """auto skipped the writes (quiet loop), then the loop clips and the clip fires: the
    step is not applied and says why; the weights stay those before it."""
    ref = _run(base, tmp_path / "ref", overlap=False, steps=4)
    errors = []

    def clip_and_step(model, opt):
        opt.clip_grad_norm_(1e-4)
        with pytest.raises(RuntimeError, match="infinity.optim: this step was not applied") \
                as info:
            opt.step()
        errors.append(str(info.value))
        opt.zero_grad()

    got = _run(base, tmp_path / "auto", overlap=True, keep_grads="auto", steps=4,
               loop=lambda m, o, n: _quiet_then(m, o, n, then=clip_and_step))
    assert errors and "keep_grads=True" in errors[0]
    _assert_same(got["snap"], ref["snap"])


def test_p_grad_is_a_clear_error_when_not_kept_and_readable_when_kept(base, tmp_path):
    seen = {}

    def read_grads(keep):
        def then(model, opt):
            p = next(model.parameters())
            seen[keep] = p.grad is not None and p.grad.shape == p.shape
            if keep == "auto":
                with pytest.raises(RuntimeError, match="infinity: p.grad of"):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:  # a memory map of the gradient file: the norm the optimizer measured
                ours = opt.clip_grad_norm_(1e9)
                theirs = torch.nn.utils.get_total_norm(
                    [q.grad for q in model.parameters() if q.grad is not None])
                assert torch.equal(ours, theirs)
            opt.zero_grad()
        return then

    for keep in (True, "auto"):
        model = _wrap(base, tmp_path / str(keep))
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=True, keep_grads=keep)
        _quiet_then(model, opt, 3, then=read_grads(keep))
        opt.close()
        infinity.unwrap(model)
    assert seen == {True: True, "auto": True}


def test_a_late_second_micro_batch_makes_the_step_raise(base, tmp_path):
    """auto skipped the writes, then a second forward+backward before the step (accumulation
    decided late): the first micro-batch's gradients are gone, and the step says so."""
    def second_backward(model, opt):
        x, y = synthetic_batch(CFG, 2, 8, torch.Generator().manual_seed(8))
        lm_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="lost|not applied"):
            opt.step()
        opt.zero_grad()

    _run(base, tmp_path / "auto", overlap=True, keep_grads="auto", steps=3,
         loop=lambda m, o, n: _quiet_then(m, o, n, then=second_backward))


def test_stats_report_nvme_bytes_per_step_by_category(base, tmp_path):
    got = _run(base, tmp_path / "ref", overlap=False, steps=2)
    s = got["steps"][-1]
    b = s["bytes"]
    assert set(b) >= {"params_read", "params_written", "grads_read", "grads_written",
                      "states_read", "states_written"}
    written = sum(v for k, v in b.items() if k.endswith("_written"))
    assert written == s["written"] > 0
    assert s["tb_written_per_1000_steps"] == pytest.approx(written * 1000 / 1e12)
    assert b["states_read"] > 0 and b["states_written"] > 0 and b["params_read"] > 0
    n = got["total"] / 4
    assert s["bytes_per_param"]["grads_written"] == pytest.approx(b["grads_written"] / n)


_SMALL_POOL = r"""
import copy, sys, tempfile, torch, infinity
sys.path[:0] = ["tests/feature/optim", "tests/helpers"]
from test_optim import _train
from infinity.models import GPTConfig, TinyGPT
torch.manual_seed(0)
base = TinyGPT(GPTConfig(vocab_size=64, d_model=32, n_layers=6, n_heads=2, max_seq=16))
out = {}
for name, overlap, keep in (("ref", False, True), ("keep", True, True), ("auto", True, "auto")):
    with tempfile.TemporaryDirectory() as d:
        model = infinity.wrap(copy.deepcopy(base), nvme_path=d, param_tier="nvme",
                              grad_tier="nvme", optimizer_tier="nvme", prefetch_window=0)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=overlap,
                                   keep_grads=keep)
        losses = _train(model, opt, 6)
        out[name] = (losses, [p.detach().clone() for p in model.parameters()],
                     opt._overlap.unwritten_total)
        opt.close()
        infinity.unwrap(model)
for name in ("keep", "auto"):
    assert out[name][0] == out["ref"][0], name
    assert all(torch.equal(a, b) for a, b in zip(out[name][1], out["ref"][1])), name
assert out["auto"][2] > 0
print("ok")
"""


def test_two_gradient_buffers_backward_waits_for_the_worker_and_stays_exact():
    """prefetch_window=0: the NVMe gradient pool has its minimum of 2 buffers, fewer than the
    blocks whose gradients the worker has yet to step, so backward waits for the worker to
    hand buffers back (never deadlocks), and the result is unchanged. In a subprocess with
    a timeout, so a hang fails the test instead of the run."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    r = subprocess.run([sys.executable, "-c", _SMALL_POOL], cwd=root, capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": root + os.pathsep +
                            os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("chunk", [16 << 10, 64 << 10])
def test_blocks_larger_than_a_chunk_keep_the_chunks_still_in_ram(base, tmp_path, chunk):
    """chunk_bytes below a block's gradients: they are accumulated chunk by chunk; the chunks
    still in RAM when the block's backward ends (as many as leave two pool buffers) go to
    the update from RAM, the others were written and are read back. Bitwise either way."""
    def run(name, overlap, keep):
        model = _wrap(base, tmp_path / name, chunk_bytes=chunk)
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3, overlap=overlap,
                                   keep_grads=keep)
        steps = []
        opt.register_step_post_hook(lambda *_a, **_k: steps.append(_per_step(model)))
        losses = _train(model, opt, STEPS)
        out = (losses, _snapshot(opt, model), steps, opt._overlap.unwritten_total)
        opt.close()
        infinity.unwrap(model)
        return out

    ref = run("ref", False, True)
    keep = run("keep", True, True)
    auto = run("auto", True, "auto")
    for got in (keep, auto):
        assert got[0] == ref[0]
        _assert_same(got[1], ref[1])
    total = ref[2][-1]["bytes"]
    assert total["grads_read"] == total["grads_written"] > 0
    assert keep[2][-1]["bytes"]["grads_read"] < total["grads_read"]   # chunks served from RAM
    assert keep[2][-1]["bytes"]["grads_written"] == total["grads_written"]
    assert auto[3] > 0
    assert auto[2][-1]["bytes"]["grads_written"] < total["grads_written"]  # chunks not written
