"""Hugging Face Trainer on an infinity-wrapped model.

    python examples/hf_trainer.py [--nvme-path /mnt/ssd] [--steps 20]

The Trainer is used unchanged: pass infinity's optimizer (and a scheduler) through
``optimizers=``. Clipping (``max_grad_norm``), gradient accumulation, checkpoints,
``resume_from_checkpoint`` and ``save_model`` work as for a plain model. A tiny Llama is built
from a config so the example runs anywhere; use ``AutoModelForCausalLM.from_pretrained`` for a
real one.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

import infinity


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 16, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-path", default=None, help="swap directory (parameters on NVMe)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output-dir", default=None)
    args = ap.parse_args(argv)
    out = args.output_dir or tempfile.mkdtemp(prefix="infinity-hf-")

    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4))
    if args.nvme_path:   # parameters in swap files, gradients in RAM (p.grad works)
        infinity.wrap(model, nvme_path=args.nvme_path, param_tier="nvme", grad_tier="host")
    else:                # parameters in host RAM
        infinity.wrap(model, param_tier="host")
    opt = infinity.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=args.steps)

    targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, max_grad_norm=1.0, logging_steps=5,
                              save_steps=max(1, args.steps // 2), report_to="none",
                              use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(8 * args.steps),
                      optimizers=(opt, sched))
    result = trainer.train()          # resume later with trainer.train(resume_from_checkpoint=True)
    trainer.save_model(out + "/final")  # LlamaForCausalLM.from_pretrained(out + "/final")
    print(f"train loss {result.training_loss:.4f}; model saved to {out}/final")
    print(infinity.stats(model)["tiers"])
    return {"loss": result.training_loss, "output_dir": out}


if __name__ == "__main__":
    main()
