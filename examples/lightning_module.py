"""PyTorch Lightning with an infinity-wrapped model.

    python examples/lightning_module.py [--nvme-path /mnt/ssd] [--epochs 2]

Wrap the model in the LightningModule's ``__init__`` and return infinity's optimizer from
``configure_optimizers``. ``gradient_clip_val``, ``accumulate_grad_batches``,
``trainer.save_checkpoint`` and ``fit(ckpt_path=...)`` work unchanged.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import infinity


class LitLM(pl.LightningModule):
    def __init__(self, nvme_path=None) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64,
                                                  intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4))
        if nvme_path:
            infinity.wrap(self.model, nvme_path=nvme_path, param_tier="nvme", grad_tier="host")
        else:
            infinity.wrap(self.model, param_tier="host")

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return infinity.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    def train_dataloader(self):
        ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids],
                                           batch_size=4)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-path", default=None, help="swap directory (parameters on NVMe)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--output-dir", default=None)
    args = ap.parse_args(argv)

    def trainer(epochs):
        return pl.Trainer(max_epochs=epochs, gradient_clip_val=1.0, accumulate_grad_batches=2,
                          accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)

    first = trainer(1)
    first.fit(LitLM(args.nvme_path))
    ckpt = os.path.join(args.output_dir or tempfile.mkdtemp(prefix="infinity-lightning-"),
                        "epoch1.ckpt")
    first.save_checkpoint(ckpt)
    resumed = trainer(args.epochs)           # a new process would do the same
    resumed.fit(LitLM(args.nvme_path), ckpt_path=ckpt)
    loss = float(resumed.callback_metrics.get("train_loss", float("nan")))
    print(f"trained {args.epochs} epochs (resumed from {ckpt})")
    return {"ckpt": ckpt, "loss": loss}


if __name__ == "__main__":
    main()
