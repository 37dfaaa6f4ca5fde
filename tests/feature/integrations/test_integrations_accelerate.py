"""accelerate: prepare(model, opt, dataloader, scheduler), accumulate/backward,
clip_grad_norm_, save_state / load_state on a wrapped model.

``Accelerator.clip_grad_norm_`` is ``torch.nn.utils.clip_grad_norm_`` over ``p.grad``;
``save_state`` writes ``model.state_dict()`` with safetensors after dropping every entry whose
storage aliases another's (``clean_state_dict_for_safetensors``), so a wrapped model must give
per-parameter storages; ``load_state`` goes through ``model.load_state_dict`` and
``optimizer.load_state_dict``. Tolerances: see integrations_helpers.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate import Accelerator  # noqa: E402
from integrations_helpers import (  # noqa: E402
    TIERS,
    TokenDataset,
    assert_changed,
    assert_losses,
    assert_weights,
    llama,
    reset_accelerate,
    run_example,
    weights,
    wrapped_copy,
)

import infinity  # noqa: E402

ACCUM = 2
STEPS = 6
SAVE_AT = 3
MAX_GRAD_NORM = 0.5
LR = 1e-2
DATA = TokenDataset(2 * ACCUM * STEPS)


@pytest.fixture(autouse=True)
def _clean_accelerate_state():
    reset_accelerate()
    yield
    reset_accelerate()


def _run(model, *, save_dir=None, resume_dir=None):
    """The accelerate loop of its docs: returns per-micro-batch losses, per-step pre-clip
    norms, and the weights when the state was saved."""
    reset_accelerate()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    dl = torch.utils.data.DataLoader(DATA, batch_size=2, shuffle=False)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    step = 0
    if resume_dir is not None:
        acc.load_state(str(resume_dir))
        step = SAVE_AT
        dl = acc.skip_first_batches(dl, SAVE_AT * ACCUM)
    out = {"loss": [], "norm": [], "saved": None}
    for batch in dl:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            out["loss"].append(loss.item())
            if acc.sync_gradients:
                out["norm"].append(acc.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item())
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            step += 1
            if step == SAVE_AT and save_dir is not None:
                acc.save_state(str(save_dir))
                out["saved"] = weights(model)
    assert step == STEPS
    return out


@pytest.fixture(scope="module")
def reference():
    model = llama(seed=0)
    init = weights(model)
    out = _run(model)
    assert len(out["norm"]) == STEPS and min(out["norm"]) > MAX_GRAD_NORM, out["norm"]
    return {"init": init, "final": weights(model), **out}


@pytest.mark.parametrize("settings", TIERS)
def test_accelerate_loop_matches_unwrapped_and_resumes(settings, reference, tmp_path):
    model = wrapped_copy(llama(seed=0), settings, tmp_path / "a")
    run = _run(model, save_dir=tmp_path / "state")
    # same losses, same (pre-clip) norms, same weights as the unwrapped model: 1e-6 relative
    assert_losses(run["norm"], reference["norm"], what="clip_grad_norm_ result")
    assert_losses(run["loss"], reference["loss"], what="loss")
    final = weights(model)
    assert_changed(reference["init"], final)
    assert_weights(final, reference["final"], what="final weights")

    # save_state wrote every weight (none dropped as an alias), with its value at step 3
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "state" / "model.safetensors"))
    assert_weights(saved, run["saved"], exact=True, what="model.safetensors of save_state")

    # a fresh wrapped model (other initial weights) + load_state continues identically
    resumed_model = wrapped_copy(llama(seed=123), settings, tmp_path / "b")
    resumed = _run(resumed_model, resume_dir=tmp_path / "state")
    assert_losses(resumed["loss"], run["loss"][SAVE_AT * ACCUM:], exact=True,
                  what="losses after load_state")
    assert_losses(resumed["norm"], run["norm"][SAVE_AT:], exact=True, what="norms after load_state")
    assert_weights(weights(resumed_model), final, exact=True, what="weights after resume")


def test_example_accelerate_loop_runs(tmp_path):
    out = run_example("accelerate_loop", "--steps", "2", "--output-dir", str(tmp_path))
    assert math.isfinite(out["loss"]) and (tmp_path / "model.safetensors").exists()
