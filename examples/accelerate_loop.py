"""An accelerate training loop on an infinity-wrapped model.

    python examples/accelerate_loop.py [--nvme-path /mnt/ssd] [--steps 20]

``Accelerator.prepare`` takes the wrapped model and infinity's optimizer like any others;
``accelerator.backward``, ``clip_grad_norm_``, ``accumulate``, ``save_state`` and
``load_state`` work unchanged.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import infinity


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-path", default=None, help="swap directory (parameters on NVMe)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output-dir", default=None)
    args = ap.parse_args(argv)

    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4))
    if args.nvme_path:
        infinity.wrap(model, nvme_path=args.nvme_path, param_tier="nvme", grad_tier="host")
    else:
        infinity.wrap(model, param_tier="host")
    opt = infinity.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4 * 2 * args.steps, 16), generator=g)
    data = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=4)

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    state_dir = args.output_dir or tempfile.mkdtemp(prefix="infinity-accelerate-")
    accelerator.save_state(state_dir)   # accelerator.load_state(state_dir) resumes
    print(f"last loss {loss.item():.4f}; state saved to {state_dir}")
    return {"loss": loss.item(), "state_dir": state_dir}


if __name__ == "__main__":
    main()
