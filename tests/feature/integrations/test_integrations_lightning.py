"""PyTorch Lightning: configure_optimizers returning infinity.optim.AdamW, gradient_clip_val,
accumulate_grad_batches, trainer.save_checkpoint and fit(ckpt_path=...) on a wrapped model.

Lightning steps with ``optimizer.step(closure)``: the closure runs training_step, zero_grad,
backward and the clipping (``torch.nn.utils.clip_grad_norm_`` over the optimizer's params'
``p.grad``) inside the optimizer's step. Checkpoints hold ``module.state_dict()`` and
``optimizer.state_dict()``; on resume the weights are loaded before configure_optimizers and
the optimizer state after. Resume is tested at an epoch boundary (Lightning does not skip the
consumed batches of a plain DataLoader mid-epoch). Tolerances: see integrations_helpers.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning.pytorch as pl  # noqa: E402
from integrations_helpers import (  # noqa: E402
    TIERS,
    TokenDataset,
    assert_changed,
    assert_losses,
    assert_weights,
    llama,
    run_example,
    weights,
    wrap_settings,
)

import infinity  # noqa: E402

# lightning 2.6 on torch 2.13: a deprecation inside lightning's own pytree helper
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*")

ACCUM = 2
STEPS_PER_EPOCH = 3
CLIP = 0.5
LR = 1e-2
DATA = TokenDataset(2 * ACCUM * STEPS_PER_EPOCH)


class LitLM(pl.LightningModule):
    def __init__(self, seed: int, wrap=None) -> None:
        super().__init__()
        self.model = llama(seed=seed)
        if wrap is not None:
            infinity.wrap(self.model, **wrap)
        self.losses = []
        self.norms = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        # pre-clip norm of the accumulated gradients, as torch computes it (inf: no clipping)
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), float("inf"))))

    def configure_optimizers(self):
        opt = infinity.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(DATA, batch_size=2, shuffle=False)


def _trainer(max_epochs: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      max_epochs=max_epochs, gradient_clip_val=CLIP,
                      accumulate_grad_batches=ACCUM)


@pytest.fixture(scope="module")
def reference():
    """Two epochs of the unwrapped model, uninterrupted."""
    lit = LitLM(seed=0)
    init = weights(lit)
    _trainer(2).fit(lit)
    assert len(lit.norms) == 2 * STEPS_PER_EPOCH and min(lit.norms) > CLIP, lit.norms
    return {"init": init, "losses": lit.losses, "norms": lit.norms, "final": weights(lit)}


@pytest.mark.parametrize("settings", TIERS)
def test_lightning_matches_unwrapped_and_resumes(settings, reference, tmp_path):
    # epoch 1 on a wrapped model, then a checkpoint
    first = LitLM(seed=0, wrap=wrap_settings(settings, tmp_path / "a"))
    trainer = _trainer(1)
    trainer.fit(first)
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(str(ckpt))
    after_epoch1 = weights(first)
    assert_changed(reference["init"], after_epoch1)

    # the checkpoint holds every weight with its trained value
    saved = torch.load(str(ckpt), map_location="cpu", weights_only=False)
    assert_weights(saved["state_dict"], after_epoch1, exact=True, what="checkpoint state_dict")

    # epoch 2 from the checkpoint, on a fresh wrapped model with other initial weights
    second = LitLM(seed=123, wrap=wrap_settings(settings, tmp_path / "b"))
    _trainer(2).fit(second, ckpt_path=str(ckpt))

    # together they equal the uninterrupted unwrapped run (1e-6 relative)
    assert_losses(first.losses + second.losses, reference["losses"], what="losses")
    assert_losses(first.norms + second.norms, reference["norms"], what="pre-clip norms")
    assert_weights(weights(second), reference["final"], what="final weights")


def test_example_lightning_module_runs(tmp_path):
    out = run_example("lightning_module", "--epochs", "2", "--output-dir", str(tmp_path))
    assert math.isfinite(out["loss"]) and (tmp_path / "epoch1.ckpt").exists()
