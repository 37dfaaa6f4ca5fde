"""LayerMajorTrainer: the Trainer's gradient_accumulation_steps run as one layer-major step
give the plain Trainer's run (losses, clipped gradient norms and weights; the Trainer passes
num_items_in_batch, so the losses are token sums over the step's count), and what it cannot
honour is refused naming the plain Trainer."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from integrations_helpers import (  # noqa: E402
    WRAP_NVME,
    TokenDataset,
    assert_changed,
    assert_losses,
    assert_weights,
    llama,
    weights,
    wrapped_copy,
)
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup  # noqa: E402

import infinity  # noqa: E402
from infinity.integrations.hf_trainer import LayerMajorTrainer  # noqa: E402

ALL_NVME = {"param_tier": "nvme", "grad_tier": "nvme", "optimizer_tier": "nvme"}
STEPS = 4
ACCUMULATE = 4
MAX_GRAD_NORM = 0.5
LR = 1e-2
DATA = TokenDataset(2 * ACCUMULATE * STEPS)


def _args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), per_device_train_batch_size=2,
                gradient_accumulation_steps=ACCUMULATE, max_steps=STEPS, learning_rate=LR,
                max_grad_norm=MAX_GRAD_NORM, logging_steps=1, report_to="none", use_cpu=True,
                disable_tqdm=True, seed=0, dataloader_num_workers=0, save_strategy="no")
    base.update(kw)
    return TrainingArguments(**base)


def _train(cls, model, out, **kw):
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, 1, STEPS)
    trainer = cls(model=model, args=_args(out), train_dataset=DATA, optimizers=(opt, sched), **kw)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [float(h["grad_norm"]) for h in logs],
            "grad_file_bytes": infinity.stats(model)["swap"]["gradients"],
            "in_backward": opt.last_step_stats.overlapped_shards}


@pytest.mark.parametrize("tiers, in_backward", [(WRAP_NVME, True), (ALL_NVME, True),
                                                (ALL_NVME, False)],
                         ids=["grads_host", "all_nvme", "all_nvme_written"])
def test_layer_major_trainer_matches_plain_trainer(tmp_path, tiers, in_backward):
    """All on NVMe: the step is taken in backward too (no gradient file is written), unless
    step_in_backward=False; gradients on host: the Trainer clips and steps."""
    init = llama(seed=0)
    plain = wrapped_copy(init, tiers, tmp_path / "plain")
    lm = wrapped_copy(init, tiers, tmp_path / "lm")
    ref = _train(Trainer, plain, tmp_path / "out_plain")
    got = _train(LayerMajorTrainer, lm, tmp_path / "out_lm", step_in_backward=in_backward)
    assert len(ref["loss"]) == STEPS
    assert min(ref["grad_norm"]) > MAX_GRAD_NORM  # the clip fires at every step
    assert_losses(got["grad_norm"], ref["grad_norm"], what="grad_norm")
    assert_losses(got["loss"], ref["loss"], what="loss")
    final = weights(lm)
    assert_changed(weights(init), final)
    assert_weights(final, weights(plain), what="final weights")
    if tiers is ALL_NVME and in_backward:
        # the step was taken in backward: blocks stepped from RAM, their gradient files never
        # written (the plain Trainer writes them all)
        assert got["in_backward"] > 0
        assert got["grad_file_bytes"] == 0 < ref["grad_file_bytes"]
    else:  # the Trainer clipped and stepped: the gradients were written
        assert got["in_backward"] == 0
        assert got["grad_file_bytes"] == ref["grad_file_bytes"]


def test_layer_major_trainer_refuses_what_it_cannot_honour(tmp_path):
    model = wrapped_copy(llama(seed=0), WRAP_NVME, tmp_path)

    class OwnLoss(LayerMajorTrainer):
        def compute_loss(self, *a, **kw):
            return super().compute_loss(*a, **kw)

    with pytest.raises(ValueError, match="compute_loss.*transformers.Trainer"):
        OwnLoss(model=model, args=_args(tmp_path / "a"), train_dataset=DATA)
    with pytest.raises(ValueError, match="label smoothing.*transformers.Trainer"):
        LayerMajorTrainer(model=model, args=_args(tmp_path / "b", label_smoothing_factor=0.1),
                          train_dataset=DATA)
    with pytest.raises(TypeError, match="infinity LayerMajorTrainer: step_in_backward"):
        LayerMajorTrainer(model=model, args=_args(tmp_path / "c"), train_dataset=DATA,
                          step_in_backward="auto")


def test_layer_major_trainer_gives_the_kept_disk_back_before_each_checkpoint(tmp_path,
                                                                             monkeypatch):
    """Each checkpoint the Trainer saves first returns the free blocks infinity's state file
    keeps for the next step (opt.give_back_disk()), then saves the optimizer; training goes on
    and the next checkpoint does the same."""
    from infinity.optim.adam import OffloadedAdam
    from infinity.optim.states.extents import STATE_FILE

    calls = []
    give_back = OffloadedAdam.give_back_disk

    def recorded(self):
        given = give_back(self)
        kept = [s.extents.store.kept_bytes(STATE_FILE) for s in self.core.wrapped.stores()]
        calls.append((given, kept))
        return given

    monkeypatch.setattr(OffloadedAdam, "give_back_disk", recorded)
    model = wrapped_copy(llama(seed=0), ALL_NVME, tmp_path / "swap")
    opt = infinity.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, overlap=True)
    out = tmp_path / "out"
    trainer = LayerMajorTrainer(model=model, args=_args(out, max_steps=2, save_strategy="steps",
                                                        save_steps=1),
                                train_dataset=DATA, optimizers=(opt, None))
    trainer.train()
    assert len(calls) == 2, calls
    assert all(given > 0 and kept == [0] for given, kept in calls), calls
    for step in (1, 2):
        assert (out / f"checkpoint-{step}" / "optimizer.pt").exists()
    opt.close()
