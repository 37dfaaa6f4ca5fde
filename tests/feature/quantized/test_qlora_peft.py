"""PEFT's LoRA on a base stored in NF4 by infinity (frozen_format="nf4"), in both orders:

* ``peft_then_wrap``: get_peft_model, then wrap: the frozen base matrices go to NF4 homes,
  the adapters and the norms stay fp32 in their layer's ordinary flat;
* ``wrap_then_peft``: the base frozen (requires_grad_(False)), wrapped with NF4, then
  get_peft_model: PEFT's LoRA Linears wrap the quantized base Linears (the adapters are plain
  parameters outside the engine).

Each trains like the plain PEFT model whose frozen layer matrices hold the dequantized NF4
values (losses within 1e-5; equal in practice), under HF's Trainer too (with a checkpoint
resume), and the adapters save and load through PEFT's own save_pretrained / from_pretrained.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from integrations_helpers import TokenDataset, llama  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from test_frozen_nf4 import LINEARS, _reference_weights, _train  # noqa: E402

import infinity  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

DATA = TokenDataset(8)


def _config() -> LoraConfig:
    return LoraConfig(r=16, lora_alpha=32, target_modules=LINEARS, lora_dropout=0.0,
                      init_lora_weights=False, task_type="CAUSAL_LM")


def _base():
    return llama(seed=0, hidden_size=64, intermediate_size=128)


def _models(order: str):
    """(the model trained through infinity, the plain reference with the same adapters)."""
    base = _base()
    base.requires_grad_(False)
    ref_base = copy.deepcopy(base)
    torch.manual_seed(1)
    ref = get_peft_model(ref_base, _config())
    _reference_weights(ref, "nf4")
    if order == "wrap_then_peft":
        infinity.wrap(base, param_tier="host", frozen_format="nf4")
        torch.manual_seed(1)
        model = get_peft_model(base, _config())
    else:
        torch.manual_seed(1)
        model = get_peft_model(base, _config())
        infinity.wrap(model, param_tier="host", frozen_format="nf4")
    return model, ref


@pytest.mark.parametrize("order", ["peft_then_wrap", "wrap_then_peft"])
def test_lora_trains_like_the_dequantized_reference(order, tmp_path):
    model, ref = _models(order)
    losses, expected = _train(model), _train(ref)
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5, (losses, expected)

    # PEFT's own save / load: onto the plain dequantized base, and onto a quantized one
    model.save_pretrained(str(tmp_path / "adapter"))
    ids = DATA.ids[:2]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    plain_base = _base()
    plain_base.requires_grad_(False)
    _reference_weights(plain_base, "nf4")
    plain = PeftModel.from_pretrained(plain_base, str(tmp_path / "adapter"))
    quant_base = _base()
    quant_base.requires_grad_(False)
    infinity.wrap(quant_base, param_tier="host", frozen_format="nf4")
    loaded = PeftModel.from_pretrained(quant_base, str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=1e-6, atol=1e-6)


def test_trainer_with_resume_on_quantized_base(tmp_path):
    from transformers import Trainer, TrainingArguments

    def run(model, out, resume=None):
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2,
                                 max_steps=4, learning_rate=1e-2, logging_steps=1,
                                 report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
                                 save_strategy="steps", save_steps=2)
        opt = infinity.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                   lr=1e-2)
        trainer = Trainer(model=model, args=args, train_dataset=DATA, optimizers=(opt, None))
        trainer.train(resume_from_checkpoint=resume)
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    model, ref = _models("peft_then_wrap")
    full = run(model, tmp_path / "full")
    expected = run(ref, tmp_path / "ref")
    assert max(abs(a - b) for a, b in zip(full, expected)) <= 1e-5, (full, expected)
    resumed_model, _ = _models("peft_then_wrap")
    resumed = run(resumed_model, tmp_path / "resumed",
                  resume=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed[-2:] == full[-2:]
