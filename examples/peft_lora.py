"""LoRA (PEFT) on an infinity-wrapped base model.

    python examples/peft_lora.py [--nvme-path /mnt/ssd] [--steps 20]

Wrap the base model first, then add the adapters: the frozen base weights stay offloaded, the
small LoRA matrices are ordinary parameters. (``get_peft_model`` first and then
``infinity.wrap(peft_model)`` works too: the adapters are then offloaded with their layer.)
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import infinity

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-path", default=None, help="swap directory (parameters on NVMe)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output-dir", default=None)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**CONFIG))   # or from_pretrained(...)
    if args.nvme_path:
        infinity.wrap(base, nvme_path=args.nvme_path, param_tier="nvme", grad_tier="host")
    else:
        infinity.wrap(base, param_tier="host")
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    model.print_trainable_parameters()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = infinity.optim.AdamW(trainable, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        ids = torch.randint(0, 128, (4, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad()
    out = args.output_dir or tempfile.mkdtemp(prefix="infinity-lora-")
    model.save_pretrained(out)      # the adapter only
    torch.manual_seed(0)
    reloaded = PeftModel.from_pretrained(LlamaForCausalLM(LlamaConfig(**CONFIG)), out)
    print(f"last loss {loss.item():.4f}; adapter saved to {out}")
    return {"loss": loss.item(), "adapter": out, "reloaded": reloaded}


if __name__ == "__main__":
    main()
